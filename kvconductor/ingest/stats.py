"""Counters and bounds of one ingest source: :class:`SourceStats`, :class:`WarnLimiter`,
:class:`Limits`.

Plain data, no I/O: the tracker, the liveness policy, the applier and the sockets
count into the same :class:`SourceStats` of a subscription; nothing here imports
another ingest module.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Generic, TypeVar, overload

log = logging.getLogger("kvconductor.ingest")
T = TypeVar("T")


def hex_preview(payload: bytes, n: int = 32) -> str:
    b = bytes(payload[:n])
    return b.hex(" ") + (" ..." if len(payload) > n else "")


_STAMPS = itertools.count(1)

#: ``[stamp]``: a new stamp (:func:`counts_changed`) after every change of a rarely
#: moving counter of any :class:`SourceStats` (``gaps``, ``replays_ok``, ``mutes``,
#: ``purged_blocks``, ``dropped``): a ``/metrics`` scrape keeps their sums from one
#: scrape to the next instead of reading them again while it holds
#: (``SubscriptionManager.metrics_snapshot``). One list for the process: a change
#: anywhere makes every manager read them again, which is only slower.
COUNTS_STAMP = [0]
#: ``[stamp]``: the same (:func:`state_changed`) for a subscription's state (connected,
#: muted, its tracker, replaying, degraded), which a scrape keeps too: a source that
#: drops all the time does not make it read those again, nor one that flaps the rest.
STATE_STAMP = [0]
#: ``[stamp]``: the same (:func:`labels_changed`) for a subscription's label sets and
#: source kind (a registration's context: ``Subscription.ctx``).
LABELS_STAMP = [0]


def counts_changed() -> None:
    """Something :data:`COUNTS_STAMP` covers has changed (call after the change)."""
    # PERF: next() of a count is one C call, so two threads never write the same stamp
    COUNTS_STAMP[0] = next(_STAMPS)


def state_changed() -> None:
    """Something :data:`STATE_STAMP` covers has changed (call after the change)."""
    STATE_STAMP[0] = next(_STAMPS)


def labels_changed() -> None:
    """Something :data:`LABELS_STAMP` covers has changed (call after the change)."""
    LABELS_STAMP[0] = next(_STAMPS)


class Stamped(property, Generic[T]):
    """The attribute ``name`` whose writes call ``changed`` (one of :func:`counts_changed`,
    :func:`state_changed`), so that what a ``/metrics`` scrape keeps from one scrape to
    the next is read again. The value is in the attribute ``_name`` (a slot, or the
    instance's dict), which a scrape reads without the call (``attrgetter("_name")``:
    the ``READ_*`` readers). ``only_changes``: a write of the value already there calls
    nothing (nor writes).

    A property whose getter is that ``attrgetter``: a read is one C call."""

    def __init__(
        self, name: str, changed: Callable[[], None], doc: str, *, only_changes: bool = False
    ) -> None:
        slot = "_" + name

        def write(obj: object, value: T) -> None:
            if only_changes and value == getattr(obj, slot, None):
                return
            setattr(obj, slot, value)
            changed()

        super().__init__(attrgetter(slot), write, None, doc)
        self.__doc__ = doc  # (a subclass's own docstring would shadow it)

    if TYPE_CHECKING:  # what a read and a write are, for mypy (property's own at run time)

        @overload
        def __get__(self, obj: None, owner: type | None = None, /) -> Stamped[T]: ...
        @overload
        def __get__(self, obj: object, owner: type | None = None, /) -> T: ...
        def __get__(self, obj: object | None, owner: type | None = None, /) -> T | Stamped[T]: ...
        def __set__(self, obj: object, value: T, /) -> None: ...


@dataclass(slots=True, eq=False)
class SourceStats:
    """Counters of one subscription (shown by ``sources()``), declared once: the plain
    fields move with every batch; ``gaps``, ``replays_ok``, ``mutes`` and
    ``purged_blocks`` move rarely and are :class:`Stamped` (a write calls
    :func:`counts_changed`; their values: the name with a leading ``_``), and so does
    ``dropped``, written only through :meth:`drop`. A ``/metrics`` scrape sums the rare
    ones (:class:`~kvconductor.ingest.sourcemetrics.Totals`)."""

    #: Batches received (live or replayed).
    batches: int = 0
    #: Events of the batches applied.
    events: int = 0
    #: Blocks the applied events stored or removed.
    blocks: int = 0
    #: The seq of the last batch applied.
    last_seq: int | None = None
    #: Wall-clock time of the last batch received (set by the subscription).
    last_event: float = 0.0
    #: Messages and events dropped, by reason (written by :meth:`drop` only).
    dropped: dict[str, int] = field(default_factory=dict)
    #: Batches whose seq was seen already.
    duplicates: int = 0
    #: Publisher restarts seen (the batch replayed at the cursor differs from the applied one).
    restarts: int = 0
    #: Losses (``/workers`` shows them as ``losses`` too).
    resyncs: int = 0
    #: Blocks dropped because they were not re-announced after a loss.
    aged_out: int = 0
    # the values of the Stamped counters below (written through them, never as arguments)
    _gaps: int = field(default=0, init=False)
    #: Replays asked.
    replays: int = 0
    #: Batches the replays brought.
    replayed_batches: int = 0
    _replays_ok: int = field(default=0, init=False)
    _mutes: int = field(default=0, init=False)
    _purged_blocks: int = field(default=0, init=False)

    gaps = Stamped[int]("gaps", counts_changed, "Sequence gaps seen.")
    replays_ok = Stamped[int](
        "replays_ok",
        counts_changed,
        'Replays whose end marker arrived (the failed ones: ``dropped["replay_failed"]``).',
    )
    mutes = Stamped[int](
        "mutes",
        counts_changed,
        "Times the source's (instance, DP) HBM hits were muted (down past --source-down-secs).",
    )
    purged_blocks = Stamped[int](
        "purged_blocks",
        counts_changed,
        "HBM blocks dropped because the source stayed down past --source-purge-secs.",
    )

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        counts_changed()


# PERF: what a /metrics scrape reads of many SourceStats at once, in C loops
# (kvconductor.ingest.sourcecolumns): the attributes behind the properties, no call
READ_GAPS = attrgetter("_gaps")
READ_REPLAYS_OK = attrgetter("_replays_ok")
READ_MUTES = attrgetter("_mutes")
READ_PURGED = attrgetter("_purged_blocks")


class WarnLimiter:
    """At most one WARN per (source, reason) every ``interval`` seconds."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[tuple, float] = {}
        self._suppressed: dict[tuple, int] = {}

    def warn(self, source: str, reason: str, detail: str, payload: bytes | None) -> None:
        key = (source, reason)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        skipped = self._suppressed.pop(key, 0)
        log.warning(
            "%s: dropped (%s) %s%s%s",
            source,
            reason,
            detail[:200],
            f" payload[{len(payload)}B]={hex_preview(payload)}" if payload is not None else "",
            f" (+{skipped} similar suppressed)" if skipped else "",
        )


#: The limiter of appliers created without one (tests, tools).
DEFAULT_WARN = WarnLimiter()


class Limits:
    """Bounds on what one ZeroMQ message and one source may add to the index.

    A message over a bound is refused whole (nothing of it applied) and counted
    in the source's ``dropped``: ``message_too_large``,
    ``message_too_many_blocks`` or ``source_block_limit`` (the engine source's
    HBM worker, with what a store-only source's bound holds, would hold more blocks than
    ``max_blocks_per_source``). A store-only source's chunk counts as the registered
    blocks it stands for (:mod:`kvconductor.ingest.storeonly`).
    """

    __slots__ = ("max_message_bytes", "max_blocks_per_message", "max_blocks_per_source")

    def __init__(
        self,
        max_message_bytes: int = 256 << 20,
        max_blocks_per_message: int = 1_000_000,
        max_blocks_per_source: int = 4_000_000,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_blocks_per_message = max_blocks_per_message
        self.max_blocks_per_source = max_blocks_per_source
