"""How fresh an answer is: the state of the sources behind each answered (instance, DP)
(docs/api.md, "freshness").

A query with ``"freshness": true`` gets, per (instance, DP) of its answer, the state of
that DP's own ZeroMQ sources (every medium registered for the instance and DP rank; the
worst of them by :data:`~kvconductor._encode.FRESH_STATES` order: ``live``, ``remote``,
``connecting``, ``replaying``, ``degraded``, ``muted``), the age of the newest event of
those sources, and for a degraded stream the time since its loss; ``no_source`` for a DP
that has none (fed by ``POST /events``, or holding only blocks a pool confirmed). The
answer as a whole says how many sources of its (model, tenant) are in each state, pools
included, and whether all of them are live.

The states change rarely and the ages all the time, so the states are collected once
per change (:class:`FreshnessTable`, cached against the stamps the subscriptions bump when
a state, a registration or the table changes) and the ages are read per query, from each
source's ``SourceStats.last_event``, by the encoder (``_encode.encode_rows``).

**Threading: built and read on any HTTP or query thread; the ingest thread's
subscriptions are only read (a tuple snapshot of the table, single attribute reads).**
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from kvconductor._encode import FRESH_STATES
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.stats import LABELS_STAMP, STATE_STAMP
from kvconductor.schema import FreshnessDocument, FreshnessSummary

#: Code of each state (its index in :data:`FRESH_STATES`): higher is worse.
STATE_CODE = {name: code for code, name in enumerate(FRESH_STATES)}

_JSON = msgspec.json.Encoder()
_MSGPACK = msgspec.msgpack.Encoder()


class LastEvent(Protocol):
    """What the encoder reads of a source's counters (``SourceStats``, :class:`Stamp`)."""

    @property
    def last_event(self) -> float: ...


class _Tracker(Protocol):
    @property
    def degraded_since(self) -> float | None: ...


class Source(Protocol):
    """What :func:`collect` reads of a subscription
    (:class:`~kvconductor.ingest.subscription.Subscription`)."""

    @property
    def ctx(self) -> SubscriberContext: ...
    @property
    def state(self) -> str: ...
    @property
    def muted(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def stats(self) -> LastEvent: ...
    @property
    def tracker(self) -> _Tracker: ...


#: A DP's entry: (state code, its sources' counters, earliest degradation or None).
Entry = tuple[int, tuple[LastEvent, ...], float | None]


class FreshnessTable:
    """The states of one (model, tenant)'s sources, as queries read them.

    ``by_key``: per (instance, DP) with sources of its own ``(code, stats,
    degraded_since)``: the worst state's code, the ``SourceStats`` of its sources (the
    encoder takes the newest ``last_event``) and the earliest wall time one of them was
    degraded at (None: none is). ``summary``: the answer's own ``"freshness"`` value,
    ``{"all_live", "sources", "states"}``; ``tail``: it encoded as JSON (``tail[False]``)
    and MessagePack (``tail[True]``)."""

    __slots__ = ("by_key", "summary", "tail", "key", "_groups", "_keys")

    def __init__(
        self,
        by_key: dict[tuple[str, int], Entry],
        counts: dict[str, int],
        key: tuple[int, ...] = (),
    ) -> None:
        self.by_key = by_key
        states = {name: counts[name] for name in FRESH_STATES if counts.get(name)}
        total = sum(states.values())
        self.summary = FreshnessSummary(states.get("live", 0) == total, total, states)
        self.tail = (_JSON.encode(self.summary), _MSGPACK.encode(self.summary))
        self.key = key
        self._groups: list[Entry | None] = []
        self._keys: Sequence[tuple[str, int]] | None = None

    def groups(self, keys: Sequence[tuple[str, int]]) -> list[Entry | None]:
        """``by_key`` by group id of an index's names (``names.keys``; None: a group
        without a source of its own), what the encoder takes. Kept while they are the
        same names (the same list: another index of the (model, tenant), made after a
        drop, numbers its groups anew) and have not grown (names only grow)."""
        g = self._groups
        if self._keys is not keys or len(g) != len(keys):
            g = [self.by_key.get((k[0], k[1])) for k in keys]
            self._groups, self._keys = g, keys
        return g


class FreshnessUnavailable(Exception):
    """The states cannot be had now (a worker that cannot reach its owner)."""


class Stamp:
    """A source's last event time as the encoder reads it (``.last_event``), for a
    table rebuilt from :meth:`FreshnessTable.document` in another process."""

    __slots__ = ("last_event",)

    def __init__(self, last_event: float) -> None:
        self.last_event = last_event


def document(table: FreshnessTable, model: str, tenant: str, now: float) -> FreshnessDocument:
    """``GET /freshness``: per (instance, DP) of the table its state, the wall time of
    its newest event and the time it was degraded at; the sources per state."""
    dps = []
    for (iid, dp), (code, stats, since) in table.by_key.items():
        last = max((s.last_event for s in stats), default=None)
        dps.append((iid, dp, FRESH_STATES[code], last, since))
    summary = table.summary
    return FreshnessDocument(
        model, tenant, now, dps, summary.all_live, summary.sources, summary.states
    )


def from_document(doc: FreshnessDocument) -> FreshnessTable:
    """The :class:`FreshnessTable` of a ``GET /freshness`` document (a worker's, from its
    owner). ``KeyError`` for a state this process does not know."""
    by_key: dict[tuple[str, int], Entry] = {}
    for iid, dp, state, last, since in doc.dps:
        stats: tuple[LastEvent, ...] = () if last is None else (Stamp(last),)
        by_key[iid, dp] = (STATE_CODE[state], stats, since)
    return FreshnessTable(by_key, doc.states)


def collect(
    subs: Sequence[Source], model: str, tenant: str
) -> tuple[dict[tuple[str, int], Entry], dict[str, int]]:
    """Per (instance, DP) of ``model``/``tenant`` its worst state, sources' stats and
    earliest degradation; and the count of the (model, tenant)'s sources per state."""
    by_key: dict[tuple[str, int], Entry] = {}
    counts: dict[str, int] = {}
    for sub in subs:
        ctx = sub.ctx
        if sub.closed or ctx.model != model or ctx.tenant != tenant:
            continue
        state = "muted" if sub.muted else sub.state
        counts[state] = counts.get(state, 0) + 1
        if ctx.is_pool:
            continue
        key = (ctx.instance_id, ctx.dp_rank)
        code = STATE_CODE[state]
        since = sub.tracker.degraded_since
        old = by_key.get(key)
        if old is not None:
            code = max(code, old[0])
            if old[2] is not None and (since is None or old[2] < since):
                since = old[2]
            by_key[key] = (code, (*old[1], sub.stats), since)
        else:
            by_key[key] = (code, (sub.stats,), since)
    return by_key, counts


class FreshnessTables:
    """The :class:`FreshnessTable` of each (model, tenant), built when first asked for and
    again after a change: of any source's state (``STATE_STAMP``), registration
    (``LABELS_STAMP``) or the subscription table (``generation()``)."""

    def __init__(
        self, snapshot: Callable[[], Sequence[Source]], generation: Callable[[], int]
    ) -> None:
        self._snapshot = snapshot
        self._generation = generation
        self._tables: dict[tuple[str, str], FreshnessTable] = {}
        self._lock = threading.Lock()

    def table(self, model: str, tenant: str) -> FreshnessTable:
        key = (STATE_STAMP[0], LABELS_STAMP[0], self._generation())
        t = self._tables.get((model, tenant))
        if t is not None and t.key == key:
            return t
        with self._lock:  # one builder at a time; the others take its table
            t = self._tables.get((model, tenant))
            if t is not None and t.key == key:
                return t
            by_key, counts = collect(self._snapshot(), model, tenant)
            t = FreshnessTable(by_key, counts, key)
            if len(self._tables) > 4096:
                self._tables.clear()  # dropped indexes: rebuilt when asked again
            self._tables[model, tenant] = t
            return t
