"""ZeroMQ subscriptions to engine and pool publishers, with replay and gap recovery.

:class:`SubscriptionManager` lives on the ingest thread
(:class:`~kvconductor.ingest.thread.IngestThread`); **every method is called on
that thread** (use ``thread.call(mgr.subscribe, ctx)`` / ``await
thread.run(...)`` from elsewhere). Each :class:`Subscription` owns one SUB
socket, its monitor socket and, while replaying, one DEALER
(:class:`~kvconductor.ingest.replay.ReplaySession`); all are polled by the one
ingest poller, which blocks when nothing happens (no busy spin; the reference
busy-spun one core per subscriber).

Sockets: one SUB per subscription and its monitor, in
:class:`~kvconductor.ingest.source.SubSource` (options, reconnects, heartbeats,
handshakes). Every handshake, the first one included, triggers a replay when the
subscription has a replay endpoint: a PUB drops what it sends before our subscription
reaches it, so only a replay asked once connected covers what the engine published
before (a replay asked at registration, before the engine is up, would be answered
empty). With a bound SUB (``--allow-bind-endpoints``) each engine PUB connecting to it is
such a handshake.

Sequence numbers (frame 1, 8-byte big-endian) per subscription: in order,
gap, duplicate, publisher restart, replay and its merge with the live batches
buffered meanwhile are decided by :class:`~kvconductor.ingest.tracker.SequenceTracker`
(no sockets, no clock); the subscription feeds it and carries out what it decides.

A loss never costs more than what the lost batches carried. Nothing is
cleared: engines never re-announce the blocks they still cache, so a cleared
DP would stay empty. Instead the source is marked ``degraded``; the blocks its
workers hold at that moment become *suspects* and everything the stream
announces from then on is applied as usual. After the grace period
(``--loss-grace-secs``, default 600 s) the suspects that were neither
announced again (stored, offloaded, pool-stored) nor are ancestors of a block
announced since are dropped (the lost batches may have evicted them), and the
source is ``live`` again. A new loss during the grace period starts it over.

A source that is not ready (``connecting`` or ``replaying``) for
``--source-down-secs`` (default 10 s) has its (instance, DP)'s HBM workers
*muted*: their blocks are kept and still take updates, but they give no hits
(:meth:`~kvconductor.index.Index.set_muted`), so a dead engine stops attracting
traffic. ZMTP heartbeats (:data:`HEARTBEAT_IVL_MS`) notice a silently dead
host, not only a closed TCP connection. When the source is ready again (connected
with a continuous sequence, or after its replay) the hits count again. After
``--source-purge-secs`` (default 600 s; 0: never) down, those HBM blocks are
dropped. With several HBM subscriptions for one (instance, DP), the DP is muted
when every one of them is down, for the shortest of their down times. Checked by
:meth:`SubscriptionManager.check_sources` every
:data:`~kvconductor.ingest.liveness.SOURCE_CHECK_SECS`.

Only subscriptions that feed HBM workers (engine PUB, ``not ctx.is_pool`` and a
HBM medium in ``ctx.default_media``) use ``ctx.replay_endpoint``: a replay ROUTER
serves the engine's sequence, not a pool port's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import and_, attrgetter, is_, itemgetter, not_
from typing import NamedTuple

import zmq

from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext, source_kind
from kvconductor.ingest.freshness import FreshnessTables
from kvconductor.ingest.host import IngestHost, IngestSettings, SharedWrites, SourceJournal
from kvconductor.ingest.liveness import Liveness
from kvconductor.ingest.replay import ReplaySession
from kvconductor.ingest.replicated import DUPLICATE, HOLE, ReplicaState
from kvconductor.ingest.source import SubSource
from kvconductor.ingest.sourcemetrics import SourceSnapshot, label_sets
from kvconductor.ingest.stats import (
    COUNTS_STAMP,
    LABELS_STAMP,
    STATE_STAMP,
    Limits,
    SourceStats,
    WarnLimiter,
    labels_changed,
    state_changed,
)
from kvconductor.ingest.thread import IngestThread
from kvconductor.ingest.tracker import SequenceTracker, digest
from kvconductor.keys import Medium
from kvconductor.schema import JSONObject

log = logging.getLogger("kvconductor.ingest")


class Subscription:
    """One SUB socket to one publisher URL for one (instance, DP).

    The sockets are here; what to do with each batch is decided by its
    :class:`~kvconductor.ingest.tracker.SequenceTracker`, for which this is the
    :class:`~kvconductor.ingest.tracker.TrackerHost`.
    """

    def __init__(self, manager: SubscriptionManager, ctx: SubscriberContext) -> None:
        self.manager = manager
        self.thread = manager.thread
        self.ctx = ctx  # also its metric label sets and source kind (the ctx setter)
        self.key = (ctx.instance_id, ctx.dp_rank, ctx.url)
        self.stats = SourceStats()
        #: Wall-clock time of the last batch received (live or replayed); at first, of
        #: the subscription's creation (``kvconductor_source_last_event_age_seconds``).
        self.stats.last_event = time.time()
        self.applier = Applier(
            ctx, manager.conductor, self.stats, manager.warn, limits=manager.limits
        )
        self.replay_endpoint = self._replay_endpoint_of(ctx)
        #: An engine stream of HBM blocks (:meth:`SubscriptionManager.check_sources`).
        self.feeds_hbm = self._feeds_hbm(ctx)
        #: The SUB and its monitor.
        self.source = SubSource(manager.thread, self, manager.shared)
        self._connected = False
        self.closed = False
        #: Monotonic time since when the source is not ready (None: ready).
        self.down_since: float | None = time.monotonic()
        self._muted = False
        self.replay: ReplaySession | None = None
        self.tracker = SequenceTracker(self, self.stats, replay=self.replay_endpoint is not None)
        #: --state-url (kvconductor.state.replica): the source's replicated state, the same on
        #: every replica (:class:`~kvconductor.ingest.replicated.ReplicaState`).
        self.replica = ReplicaState(manager.fence_floor)
        if manager.replicator is not None:
            self.down_since = None  # passive: up until the owner says otherwise
        cursor = manager.resume.pop(self.key, None)
        if cursor is not None:
            # warm start: go on from the snapshot's cursor (the registration's replay
            # verifies the batch at it and asks for what came after)
            self.tracker.last_seq = self.stats.last_seq = cursor[0]
            self.tracker.last_digest = cursor[1]
            self.replica.applied = (cursor[0], cursor[1])
            self.replica.fence = max(self.replica.fence, cursor[2])

    # connected, muted and tracker: properties whose setters tell a /metrics scrape to
    # read the source's state again (kvconductor.ingest.stats.STATE_STAMP)
    @property
    def connected(self) -> bool:
        """The SUB has a publisher (its monitor saw the handshake, or it is bound)."""
        return self._connected

    @connected.setter
    def connected(self, on: bool) -> None:
        if on != getattr(self, "_connected", None):  # (not __dict__: it slows the object)
            self._connected = on
            state_changed()

    @property
    def muted(self) -> bool:
        """Its (instance, DP)'s HBM hits are muted (down past --source-down-secs)."""
        return self._muted

    @muted.setter
    def muted(self, on: bool) -> None:
        if on != getattr(self, "_muted", None):
            self._muted = on
            state_changed()

    @property
    def tracker(self) -> SequenceTracker:
        """The sequence and replay state (a new one after a resync or a lease change)."""
        return self._tracker

    @tracker.setter
    def tracker(self, t: SequenceTracker) -> None:
        self._tracker = t
        state_changed()

    @property
    def ctx(self) -> SubscriberContext:
        """The registration facts the subscription applies events under."""
        return self._ctx

    @ctx.setter
    def ctx(self, ctx: SubscriberContext) -> None:
        # PERF: what /metrics shows of the source, rendered once per registration
        # (and again on retarget), never per scrape.
        self._ctx = ctx
        #: ``{dp_rank=..,instance_id=..,medium=..}`` per medium (metrics_snapshot).
        self.metric_labels = label_sets(ctx.instance_id, ctx.dp_rank, ctx.default_media)
        #: ``kvconductor_events_applied``'s source_kind.
        self.kind = source_kind(ctx.is_pool, ctx.engine_type)
        labels_changed()  # a scrape reads them again

    @property
    def owned(self) -> bool:
        """--state-url: this replica holds the source's lease and consumes it."""
        return self.replica.owned

    @property
    def lease_epoch(self) -> int:
        """--state-url: the epoch of this replica's lease on the source."""
        return self.replica.lease_epoch

    @staticmethod
    def _feeds_hbm(ctx: SubscriberContext) -> bool:
        """An engine stream of HBM blocks (what a down source mutes and purges)."""
        return not ctx.is_pool and any(Medium(m).tier == 0 for m in ctx.default_media)

    @property
    def dp_key(self) -> tuple[str, str, str, int]:
        c = self.ctx
        return (c.model, c.tenant, c.instance_id, c.dp_rank)

    @staticmethod
    def _replay_endpoint_of(ctx: SubscriberContext) -> str | None:
        feeds_hbm = any(Medium(m).tier == 0 for m in ctx.default_media)
        return (
            ctx.replay_endpoint if (ctx.replay_endpoint and feeds_hbm and not ctx.is_pool) else None
        )

    def retarget(self, ctx: SubscriberContext) -> None:
        """A changed registration of the same URL: apply what comes next under ``ctx``,
        on the same socket, so no batch is lost in a hand-over."""
        old = self.applier
        self.ctx = ctx
        self.applier = Applier(
            ctx, self.manager.conductor, self.stats, self.manager.warn, limits=self.manager.limits
        )
        self.applier.touched = old.touched
        self.applier.suspects, self.applier.confirmed = old.suspects, old.confirmed
        sb, old_sb = self.applier.store_bound, old.store_bound
        if sb is not None and old_sb is not None:
            # the blocks announced so far keep their deadlines under the new bound
            sb.adopt(old_sb)
        self.replay_endpoint = self._replay_endpoint_of(ctx)
        self.feeds_hbm = self._feeds_hbm(ctx)
        self.tracker.replay_enabled = self.replay_endpoint is not None

    @property
    def last_seq(self) -> int | None:
        """The seq of the last batch applied. ``--state-url``, a source another replica
        consumes: the replicated cursor (the last batch the log applied here), not this
        replica's tracker, which stopped when it last owned the source."""
        if self.passive:
            applied = self.replica.applied
            return None if applied is None else applied[0]
        return self.tracker.last_seq

    # -- sockets (kvconductor.ingest.source) -------------------------------------------------
    @property
    def bound(self) -> bool:
        """The SUB is bound (``--allow-bind-endpoints``): publishers connect to it."""
        return self.source.bound

    def open(self) -> None:
        """Open the SUB socket and its monitor (:meth:`SubSource.open`); raises
        ``zmq.ZMQError`` (nothing left open) when that fails: the registration is then
        rolled back and answered 503."""
        if self.closed or self.passive:
            return
        self.source.open(self.ctx.url, self.applier.limits.max_message_bytes)
        if self.source.bound:
            self.connected = self.tracker.ever_connected = True

    @property
    def passive(self) -> bool:
        """--state-url and another replica consumes this source (or none yet)."""
        return self.manager.replicator is not None and not self.owned

    def close(self) -> None:
        self.closed = True
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        self.source.close()
        self.tracker.close()
        self.connected = False

    def name(self) -> str:
        return f"{self.ctx.instance_id}/dp{self.ctx.dp_rank}@{self.ctx.url}"

    # the source's events
    def handshake(self) -> None:
        if not self.connected:
            self._now_connected()
        elif self.bound:
            # a publisher connected to our bound SUB: catch up on what it sent
            self.tracker.connected()

    def disconnected(self) -> None:
        if self.connected:
            log.info("%s: disconnected", self.name())
        self.connected = False
        if self.down_since is None:
            self.down_since = time.monotonic()

    def _now_connected(self) -> None:
        self.connected = True
        if self.tracker.ever_connected:
            log.info("%s: reconnected", self.name())
        self.tracker.connected()

    def receive_error(self, ex: zmq.ZMQError) -> None:
        self.manager.warn.warn(self.name(), "receive_error", str(ex), None)

    def message(self, frames: list[bytes]) -> None:
        # PERF: per message, the attributes behind the properties (no property call)
        if not self._connected:  # data beat the monitor event
            self._now_connected()
        if len(frames) < 3:
            self.stats.drop("short_message")
            self.manager.warn.warn(
                self.name(),
                "short_message",
                f"{len(frames)} frames",
                frames[-1] if frames else b"",
            )
            return
        seq_b = frames[1]
        if len(seq_b) != 8:
            self.stats.drop("bad_seq_frame")
            self.manager.warn.warn(self.name(), "bad_seq_frame", f"{len(seq_b)} bytes", seq_b)
            return
        now = time.time()
        self.stats.last_event = now
        self._tracker.live(int.from_bytes(seq_b, "big"), frames[2], now)

    # -- --state-url: ownership (kvconductor.state.replica) ----------------------------------------
    def activate(self, epoch: int) -> None:
        """This replica took the source's lease: consume it from the replicated cursor
        (a replay from there verifies it and brings what came after). ``zmq.ZMQError``
        when the socket cannot be opened (passive again)."""
        st = self.replica
        st.owned = True
        st.lease_epoch = epoch
        st.reported_down = None
        self.down_since = time.monotonic()  # not ready until connected
        self.tracker.close()
        self.tracker = SequenceTracker(self, self.stats, replay=self.replay_endpoint is not None)
        if st.applied is not None:
            self.tracker.last_seq, self.tracker.last_digest = st.applied
        try:
            self.open()
        except BaseException:
            st.owned = False
            raise
        if self.bound:
            self.tracker.catch_up()  # connected at once; else the SUB's handshake asks
        token = st.loss_token
        if token is not None:
            # the previous owner's grace period: ours ends it (a full one, to be safe)
            self.thread.call_later(self.manager.loss_grace, lambda: self._grace_over(token))
        log.info("%s: consuming (lease epoch %d)", self.name(), epoch)

    def release(self) -> None:
        """The lease is gone (another replica, or the state store lost): passive again."""
        if not self.replica.owned:
            return
        self.replica.owned = False
        self._close_sockets()
        self.tracker = SequenceTracker(self, self.stats, replay=self.replay_endpoint is not None)
        self.down_since = None  # as the next owner reports it
        log.info("%s: no longer consumed here", self.name())

    def _grace_over(self, token: str) -> None:
        r = self.manager.replicator
        if r is not None and self.owned and not self.closed and self.replica.loss_token == token:
            r.append_source(self, "aged", token)

    # -- the tracker's host ----------------------------------------------------------------
    def apply(self, payload: bytes, seq: int) -> None:
        r = self.manager.replicator
        if r is None:
            self.applier.apply_payload(payload)
        else:
            r.append_batch(self, seq, payload)

    def open_replay(self, start: int) -> None:
        # The tracker replays only when replay_enabled, i.e. with a replay endpoint.
        assert self.replay_endpoint is not None
        session = ReplaySession(
            self.thread,
            self.replay_endpoint,
            start,
            self._on_replayed,
            self._on_replay_done,
            self.manager.replay_timeout,
            self.manager.replay_deadline,
            2 * self.applier.limits.max_message_bytes,
        )
        self.replay = session
        session.start()

    def no_replay_why(self) -> str:
        c = self.ctx
        if c.is_pool:
            return "a pool stream has no replay"
        if not self.feeds_hbm:
            return "only a stream of HBM blocks is replayed"
        return f"instance {c.instance_id} DP {c.dp_rank} registered no replay_endpoint"

    def lost(self, why: str, epoch: int) -> None:
        """Keep the state, degrade, age out later (module docstring)."""
        r = self.manager.replicator
        if r is not None:
            # every replica marks the suspects when it applies the loss; the owner ends
            # the grace period with an ``aged`` entry (Subscription._grace_over)
            token = f"{self.lease_epoch}.{epoch}"
            r.append_source(self, "loss", token, why)
            grace = self.manager.loss_grace
            self.thread.call_later(grace, lambda: self._grace_over(token))
            return
        n = self.applier.begin_suspect()
        grace = self.manager.loss_grace
        self.thread.call_later(grace, lambda: self._end_degraded(epoch))
        log.warning(
            "%s: %s; source degraded: %d blocks kept, those not announced again "
            "within %gs will be dropped",
            self.name(),
            why,
            n,
            grace,
        )

    def _end_degraded(self, epoch: int) -> None:
        if not self.tracker.end_degraded(epoch):
            return  # closed, or superseded by a later loss
        n = self.applier.end_suspect()
        log.info(
            "%s: grace period after the loss is over; %d blocks not announced again "
            "were dropped; source live",
            self.name(),
            n,
        )

    def _on_replayed(self, seq: int, payload: bytes) -> None:
        now = time.time()
        self.stats.last_event = now
        self.tracker.replayed(seq, payload, now)

    def _on_replay_done(self, ok: bool, why: str) -> None:
        self.replay = None
        if not ok and not self.closed:
            self.manager.warn.warn(self.name(), "replay_failed", why, None)
        self.tracker.replay_done(ok, why, time.time())

    # -- introspection ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self.passive:
            return "remote"
        # PERF: every source at every liveness check: no property calls
        return self._tracker.state(self._connected)

    def info(self) -> dict[str, object]:
        s = self.stats
        down = self.down_since
        d: dict[str, object] = {
            "instance_id": self.ctx.instance_id,
            "dp_rank": self.ctx.dp_rank,
            "url": self.ctx.url,
            "media": [Medium(m).display.lower() for m in self.ctx.default_media],
            "model": self.ctx.model,
            "tenant": self.ctx.tenant,
            "is_pool": self.ctx.is_pool,
            "replay_endpoint": self.replay_endpoint,
            "state": self.state,
            "connected": self.connected,
            "last_seq": self.last_seq,
            "last_event_age_s": round(max(0.0, time.time() - s.last_event), 3),
            "batches": s.batches,
            "events": s.events,
            "blocks": s.blocks,
            "gaps": s.gaps,
            "replays": s.replays,
            "replayed_batches": s.replayed_batches,
            "restarts": s.restarts,
            "resyncs": s.resyncs,
            "losses": s.resyncs,
            "degraded_since": self.tracker.degraded_since,
            "last_loss": self._last_loss(),
            "aged_out_blocks": s.aged_out,
            "down_since": None if down is None else time.time() - (time.monotonic() - down),
            "muted": self.muted,
            "mutes": s.mutes,
            "purged_blocks": s.purged_blocks,
            "duplicates": s.duplicates,
            "buffered": len(self.tracker.buffer),
            "dropped": dict(s.dropped),
        }
        sb = self.applier.store_bound
        if sb is not None:
            d["store_only"] = sb.info()
        return d

    def _last_loss(self) -> dict[str, object] | None:
        loss = self.tracker.last_loss
        return None if loss is None else {"at": loss[0], "why": loss[1]}


class RetiredTotals:
    """Counters of the subscriptions closed so far, so that the metrics' sums over
    subscriptions never go down when one closes (a counter reset to Prometheus)."""

    __slots__ = (
        "dropped",
        "events",
        "gaps",
        "mutes",
        "purged_blocks",
        "replays_failed",
        "replays_ok",
    )

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.gaps = 0
        self.replays_ok = 0
        self.replays_failed = 0
        self.mutes = 0
        self.purged_blocks = 0


_STATS = attrgetter("stats")
_EVENTS = attrgetter("events")
# the attributes behind the properties of SourceStats, Subscription and SequenceTracker
# (read without the property's call)
_GAPS = attrgetter("_gaps")
_REPLAYS_OK = attrgetter("_replays_ok")
_MUTES = attrgetter("_mutes")
_PURGED = attrgetter("_purged_blocks")
_DROPPED = attrgetter("dropped")
_KIND = attrgetter("kind")
_TRACKER = attrgetter("_tracker")
_CONNECTED = attrgetter("_connected")
_REPLAYING = attrgetter("_replaying")
_DEGRADED = attrgetter("_degraded_since")
_OWNED = attrgetter("replica.owned")
_MUTED = attrgetter("_muted")
_LAST_EVENT = attrgetter("last_event")
_LABELS = attrgetter("metric_labels")
_FIRST = itemgetter(0)
_NONES = repeat(None)  # endless: map() stops at the shorter iterable
_ZEROS = repeat(0)
_ONE = 1


def _replays(sub: Subscription) -> tuple[int, int]:
    """(ok, failed) finished replays of ``sub`` (a running one is neither); each counted
    once, when it ends, so both only grow."""
    s = sub.stats
    return s.replays_ok, s.dropped.get("replay_failed", 0)


#: Subscriptions read per slice of a ``/metrics`` scrape (metrics_snapshot's ``pause``).
METRICS_CHUNK = 1024


class _Rare(NamedTuple):
    """The rarely moving counters of a slice of subscriptions, summed."""

    gaps: int
    replays_ok: int
    replays_failed: int
    mutes: int
    purged_blocks: int
    dropped: dict[str, int]


class _Columns(NamedTuple):
    """What a slice of subscriptions keeps from one scrape to the next while it stays
    the same: the same subscriptions, and :data:`~kvconductor.ingest.stats.LABELS_STAMP`
    unchanged (no label set or source kind changed anywhere); the live and muted flags
    while :data:`~kvconductor.ingest.stats.STATE_STAMP` is unchanged too, the rare
    counters' sums while :data:`~kvconductor.ingest.stats.COUNTS_STAMP` is."""

    #: (LABELS_STAMP, STATE_STAMP, COUNTS_STAMP) when read
    stamps: tuple[int, int, int]
    subs: list[Subscription]
    stats: list[SourceStats]
    #: the stats objects per source kind, in the order of the kinds
    kinds: list[tuple[str, list[SourceStats]]]
    #: the label sets flattened
    labels: list[str]
    #: None when each subscription has one medium, else what repeats a column's value
    #: for each medium of its subscription (an itemgetter of the indices after two 0s)
    ks: itemgetter[tuple[int, ...]] | None
    rare: _Rare
    #: per label set: connected, not replaying, not degraded (--state-url: not owned
    #: yet, which is read at every scrape)
    live: list[bool]
    #: per label set: muted
    muted: list[bool]


def _sum_rare(stats: list[SourceStats]) -> _Rare:
    # PERF: C loops (map/attrgetter, sum). The drops: one sum per reason over the
    # sources that have any (a few reasons, in C) or, when the reasons are many for the
    # drops there are, a Python loop over them. The dicts are read in C calls that run
    # no Python code: the ingest thread cannot add a reason in the middle of one.
    ds = list(filter(None, map(_DROPPED, stats)))
    reasons = set(chain.from_iterable(ds))
    if len(reasons) * len(ds) <= 4 * (sum(map(len, ds)) + len(ds)):
        dropped = {r: sum(map(dict.get, ds, repeat(r), _ZEROS)) for r in sorted(reasons)}
    else:
        dropped = {}
        for d in ds:
            for reason, n in list(d.items()):  # a copy in C
                dropped[reason] = dropped.get(reason, 0) + n
    return _Rare(
        sum(map(_GAPS, stats)),
        sum(map(_REPLAYS_OK, stats)),
        dropped.get("replay_failed", 0),
        sum(map(_MUTES, stats)),
        sum(map(_PURGED, stats)),
        dropped,
    )


def _repeater(lens: list[int]) -> itemgetter[tuple[int, ...]]:
    """What repeats a column's value ``lens[i]`` times for each ``i``: an itemgetter of
    the indices after two 0s (cut off after the call: a tuple even for fewer than two
    indices)."""
    # PERF: the indices built a run of single media at a time (a C extend), a Python
    # statement only for a source of another count
    idx = [0, 0]
    start = 0
    for i in compress(range(len(lens)), map(_ONE.__ne__, lens)):
        idx += range(start, i)
        idx += repeat(i, lens[i])
        start = i + 1
    idx += range(start, len(lens))
    return itemgetter(*idx)


def _live(subs: list[Subscription]) -> list[bool]:
    """What Subscription.state calls "live" (connected, not replaying, not degraded),
    from the columns (passive sources: see ``_read_columns``)."""
    trackers = list(map(_TRACKER, subs))
    if any(map(_REPLAYING, trackers)) or not all(map(is_, map(_DEGRADED, trackers), _NONES)):
        return list(
            map(
                and_,
                map(and_, map(_CONNECTED, subs), map(not_, map(_REPLAYING, trackers))),
                map(is_, map(_DEGRADED, trackers), _NONES),
            )
        )
    return list(map(_CONNECTED, subs))  # none replaying or degraded (the common case)


def _read_columns(
    snap: SourceSnapshot,
    subs: list[Subscription],
    replicated: bool,
    kept: _Columns | None,
    stamps: tuple[int, int, int],
) -> _Columns:
    """Appends the columns of ``subs`` to ``snap`` and adds their counters to its totals;
    returns what the next scrape may reuse (``kept``: this slice's from the last one,
    ``stamps``: :data:`~kvconductor.ingest.stats.LABELS_STAMP`, ``STATE_STAMP`` and
    ``COUNTS_STAMP``, read before anything else)."""
    # PERF: every column read by map/attrgetter (C loops); no Python statement per
    # subscription but for the rare ones with drops. What only changes with the table,
    # a registration, a source's state or a rare counter (stats objects, kinds, label
    # sets, the live and muted flags, the rare counters' sums) is reused while the stamps
    # are the same and the slice's subscriptions compare equal (identity, in C): each
    # scrape reads only what moves with every batch (events, last event).
    if kept is None or kept.stamps[0] != stamps[0] or kept.subs != subs:
        stats = list(map(_STATS, subs))
        kinds = list(map(_KIND, subs))
        if len(set(kinds)) == 1:  # one engine type (the common case)
            groups = [(kinds[0], stats)]
        else:
            by_kind: dict[str, list[SourceStats]] = {}
            for kind, st in zip(kinds, stats, strict=True):
                by_kind.setdefault(kind, []).append(st)
            groups = sorted(by_kind.items())
        sets = list(map(_LABELS, subs))
        ks: itemgetter[tuple[int, ...]] | None = None
        live, muted = _live(subs), list(map(_MUTED, subs))
        lens = list(map(len, sets))
        if all(map(_ONE.__eq__, lens)):
            labels = list(map(_FIRST, sets))
        else:  # sources of several media (or none): a line per medium
            labels = list(chain.from_iterable(sets))
            ks = _repeater(lens)
            live, muted = list(ks(live)[2:]), list(ks(muted)[2:])
        kept = _Columns(stamps, subs, stats, groups, labels, ks, _sum_rare(stats), live, muted)
    elif kept.stamps != stamps:
        if kept.stamps[1] != stamps[1]:  # a source's state moved (one flapping)
            live, muted = _live(subs), list(map(_MUTED, subs))
            if kept.ks is not None:
                live, muted = list(kept.ks(live)[2:]), list(kept.ks(muted)[2:])
            kept = kept._replace(live=live, muted=muted)
        if kept.stamps[2] != stamps[2]:  # a rare counter moved (a source dropping)
            kept = kept._replace(rare=_sum_rare(kept.stats))
        kept = kept._replace(stamps=stamps)
    stats, labels, ks, rare = kept.stats, kept.labels, kept.ks, kept.rare
    applied, dropped = snap.applied, snap.dropped
    snap.gaps += rare.gaps
    snap.replays_ok += rare.replays_ok
    snap.replays_failed += rare.replays_failed
    snap.mutes += rare.mutes
    snap.purged_blocks += rare.purged_blocks
    for reason, n in rare.dropped.items():
        dropped[reason] = dropped.get(reason, 0) + n
    for kind, group in kept.kinds:
        applied[kind] = applied.get(kind, 0) + sum(map(_EVENTS, group))
    live = kept.live
    if replicated:  # --state-url: a source this replica does not own is remote
        owned = list(map(_OWNED, subs))
        live = list(map(and_, live, owned if ks is None else ks(owned)[2:]))
    last = list(map(_LAST_EVENT, stats))
    snap.labels += labels
    snap.live += live
    snap.muted += kept.muted
    snap.last_event += last if ks is None else ks(last)[2:]
    return kept


class SubscriptionManager:
    """Lives on the ingest thread; every method is called on the ingest thread, except
    :meth:`metrics_snapshot` (any thread)."""

    def __init__(
        self,
        thread: IngestThread,
        conductor: IngestHost,
        *,
        settings: IngestSettings | None = None,
        shared: SharedWrites | None = None,
        replay_timeout: float | None = None,
        loss_grace: float | None = None,
        replay_deadline: float | None = None,
        source_down: float | None = None,
        source_purge: float | None = None,
    ) -> None:
        """``settings`` (defaults: :class:`~kvconductor.ingest.host.IngestSettings`), each
        overridden by the keyword of the same name when given; ``shared``: ``--workers N``'s
        shared write section over each socket's drain (None: one process)."""
        s = settings or IngestSettings()
        s = IngestSettings(
            loss_grace=s.loss_grace if loss_grace is None else loss_grace,
            replay_deadline=s.replay_deadline if replay_deadline is None else replay_deadline,
            replay_timeout=s.replay_timeout if replay_timeout is None else replay_timeout,
            source_down=s.source_down if source_down is None else source_down,
            source_purge=s.source_purge if source_purge is None else source_purge,
            limits=s.limits,
        )
        self.thread = thread
        self.conductor = conductor
        self.shared = shared
        #: Seconds a replay may wait for its next message.
        self.replay_timeout = float(s.replay_timeout)
        #: Seconds a whole replay may take before it counts as failed (a loss).
        self.replay_deadline = float(s.replay_deadline)
        #: Seconds after a loss before blocks not announced again are dropped.
        self.loss_grace = float(s.loss_grace)
        #: Down, muted and purged (instance, DP)s; this manager is its host.
        self.liveness = Liveness(self, source_down=s.source_down, source_purge=s.source_purge)
        #: Bounds on one message and one source (``--max-message-mb`` ...).
        self.limits: Limits = s.limits
        self.warn = WarnLimiter()
        self._subs: dict[tuple[str, int, str], Subscription] = {}
        #: The same subscriptions by (instance_id, dp_rank), then URL, in the order of
        #: :attr:`_subs` (kept by :meth:`_add` and :meth:`_remove`): what a registration
        #: replaces, counts or closes costs O(its own subscriptions), not O(all).
        self._by_dp: dict[tuple[str, int], dict[str, Subscription]] = {}
        #: The store-only subscriptions (their bound expires at every source check).
        self._bounded: dict[tuple[str, int, str], Subscription] = {}
        #: Bumped by :meth:`_add` and :meth:`_remove`: the table changed.
        self._generation = 0
        #: The states behind answers (``"freshness"`` queries; any thread).
        self.freshness = FreshnessTables(self._snapshot, self._table_generation)
        #: Warm start: (instance_id, dp_rank, url) -> (last applied seq, its digest) from a
        #: snapshot; a subscription of that key created next starts from there.
        self.resume: dict[tuple[str, int, str], tuple[int, int, int]] = {}
        #: --state-url: the :class:`kvconductor.state.replica.Replicator` (None: one process).
        self.replicator: SourceJournal | None = None
        #: --state-url: no source entry of an owner epoch below this is applied (raised
        #: when the state store is seeded again: owners of the old store are fenced off).
        self.fence_floor = 0
        #: Counters of closed subscriptions (metrics), folded in by :meth:`_remove`.
        self.retired = RetiredTotals()
        #: Held while the table changes and while a scrape reads it: a scrape sees a
        #: closing subscription's counters either in the table or in :attr:`retired`,
        #: never in both or neither. Never taken per batch.
        self._table_lock = threading.Lock()
        #: What the last scrape read that only changes with the table (_read_columns).
        self._metric_columns: list[_Columns] = []

    def _snapshot(self) -> tuple[Subscription, ...]:
        # one C call under the GIL: never a table changing under a reader
        return tuple(self._subs.values())

    def _table_generation(self) -> int:
        return self._generation

    def _add(self, sub: Subscription) -> None:
        iid, dp, url = sub.key
        with self._table_lock:
            self._subs[sub.key] = sub
            self._by_dp.setdefault((iid, dp), {})[url] = sub
            self._note_bounded(sub)
            self._generation += 1

    def _note_bounded(self, sub: Subscription) -> None:
        if sub.applier.store_bound is not None:
            self._bounded[sub.key] = sub
        else:
            self._bounded.pop(sub.key, None)

    def _remove(self, key: tuple[str, int, str]) -> Subscription:
        """Take ``key``'s subscription out of the table, its counters into retired."""
        with self._table_lock:
            sub = self._subs.pop(key)
            self._bounded.pop(key, None)
            self._generation += 1
            urls = self._by_dp[key[0], key[1]]
            del urls[key[2]]
            if not urls:
                del self._by_dp[key[0], key[1]]
            r = self.retired
            s = sub.stats
            r.events[sub.kind] = r.events.get(sub.kind, 0) + s.events
            for reason, n in s.dropped.items():
                r.dropped[reason] = r.dropped.get(reason, 0) + n
            r.gaps += s.gaps
            ok, failed = _replays(sub)
            r.replays_ok += ok
            r.replays_failed += failed
            r.mutes += s.mutes
            r.purged_blocks += s.purged_blocks
        return sub

    def metrics_snapshot(self, pause: Callable[[], None] | None = None) -> SourceSnapshot:
        """Any thread (the ``/metrics`` scrape): the subscriptions' columns and totals,
        the closed subscriptions' totals included. O(subscriptions), plain reads of
        counters; the label sets are the subscriptions' own (rendered at registration).

        The table and the retired totals are read together under the table lock (a
        closing subscription counts once: in the list, or in the totals); the counters
        of the listed subscriptions are read after it, :data:`METRICS_CHUNK` at a time,
        with ``pause()`` between two chunks (the scrape lets other threads run)."""
        snap = SourceSnapshot()
        applied, dropped = snap.applied, snap.dropped
        with self._table_lock:
            subs = list(self._subs.values())
            r = self.retired
            applied.update(r.events)
            dropped.update(r.dropped)
            snap.gaps, snap.replays_ok, snap.replays_failed = r.gaps, r.replays_ok, r.replays_failed
            snap.mutes, snap.purged_blocks = r.mutes, r.purged_blocks
        # before any counter is read (a change after this: a new stamp)
        stamps = (LABELS_STAMP[0], STATE_STAMP[0], COUNTS_STAMP[0])
        replicated = self.replicator is not None
        kept = self._metric_columns  # replaced whole: concurrent scrapes never share one
        out = []
        for c, i in enumerate(range(0, len(subs), METRICS_CHUNK)):
            if i and pause is not None:
                pause()
            last = kept[c] if c < len(kept) else None
            out.append(_read_columns(snap, subs[i : i + METRICS_CHUNK], replicated, last, stamps))
        self._metric_columns = out
        return snap

    def cursors(self) -> list[JSONObject]:
        """Where each subscription's applied sequence stands (ingest thread; snapshots):
        ``instance_id``, ``dp_rank``, ``url``, ``last_seq`` and the ``digest`` of that
        batch, for every subscription that has applied a batch since its last loss;
        ``fence``: the highest owner epoch its log entries had (``--state-url``)."""
        self._check_thread()
        out: list[JSONObject] = []
        for k, sub in self._subs.items():
            if self.replicator is not None:
                cur = sub.replica.applied
            else:
                t = sub.tracker
                cur = (
                    None
                    if t.last_seq is None or t.last_digest is None
                    else (t.last_seq, t.last_digest)
                )
            if cur is not None:
                out.append(
                    {
                        "instance_id": k[0],
                        "dp_rank": k[1],
                        "url": k[2],
                        "last_seq": cur[0],
                        "digest": cur[1],
                        "fence": sub.replica.fence,
                    }
                )
        return out

    # -- --state-url: the log's source entries, applied on every replica -------------------
    def apply_logged(self, key: tuple[str, int, str], seq: int, epoch: int, payload: bytes) -> bool:
        """A ``batch`` entry: apply unless fenced (an owner epoch older than one seen) or
        not past the source's cursor (a take-over's replay repeats what the old owner
        appended). True when applied."""
        sub = self._subs.get(key)
        if sub is None:
            return False  # unregistered after the owner appended it
        st = sub.replica
        if not st.current(epoch):
            sub.stats.drop("fenced")
            return False
        place = st.place(seq)
        if place == DUPLICATE:
            sub.stats.duplicates += 1
            return False
        if place == HOLE and st.applied is not None:
            # a hole in the log (appends lost with the store): a loss on every replica
            token = f"{epoch}.hole{seq}"
            sub.stats.gaps += 1
            self.loss_logged(key, epoch, token, f"log gap {st.applied[0]} -> {seq}")
            if sub.owned:
                self.thread.call_later(self.loss_grace, lambda: sub._grace_over(token))
        sub.applier.apply_payload(payload)
        st.applied = (seq, digest(payload))
        sub.stats.last_seq = seq
        return True

    def loss_logged(self, key: tuple[str, int, str], epoch: int, token: str, why: str) -> None:
        """A ``loss`` entry: the cursor is forgotten, the source's holdings are suspects."""
        sub = self._subs.get(key)
        if sub is None or not sub.replica.current(epoch):
            return
        sub.replica.lost(token)
        sub.tracker.last_loss = (time.time(), why)
        sub.stats.resyncs += 1
        n = sub.applier.begin_suspect()
        log.warning(
            "%s: %s; source degraded: %d blocks kept, those not announced again "
            "within %gs will be dropped",
            sub.name(),
            why,
            n,
            self.loss_grace,
        )

    def aged_logged(self, key: tuple[str, int, str], epoch: int, token: str) -> None:
        """An ``aged`` entry: the grace period of loss ``token`` is over."""
        sub = self._subs.get(key)
        if sub is None or sub.replica.loss_token != token or not sub.replica.current(epoch):
            return
        sub.replica.loss_token = None
        n = sub.applier.end_suspect()
        log.info(
            "%s: grace period after the loss is over; %d blocks not announced again "
            "were dropped; source live",
            sub.name(),
            n,
        )

    def down_logged(self, key: tuple[str, int, str], epoch: int, secs: float) -> None:
        """A ``down`` entry: the owner sees the source not ready for ``secs`` seconds
        (negative: ready again). The owner keeps its own clock."""
        sub = self._subs.get(key)
        if sub is None or sub.owned or not sub.replica.current(epoch):
            return
        sub.down_since = None if secs < 0 else time.monotonic() - secs

    def raise_fence_floor(self, floor: int) -> None:
        """Ignore every source entry of an owner epoch below ``floor`` from now on (the
        store was seeded again: what owners of the old store append is fenced off)."""
        self._check_thread()
        self.fence_floor = max(self.fence_floor, floor)
        for sub in self._subs.values():
            sub.replica.fence = max(sub.replica.fence, self.fence_floor)

    def highest_fence(self) -> int:
        """The highest owner epoch any source entry applied here had."""
        self._check_thread()
        return max([self.fence_floor, *(sub.replica.fence for sub in self._subs.values())])

    def release_all(self) -> int:
        """Stop consuming every owned source (passive again); how many were owned."""
        self._check_thread()
        owned = [sub for sub in self._subs.values() if sub.owned]
        for sub in owned:
            sub.release()
        return len(owned)

    def source_states(self) -> dict[tuple[str, int, str], bool]:
        """Every subscription's key (the sources replicas hold leases on) and whether this
        replica consumes it."""
        self._check_thread()
        return {k: sub.owned for k, sub in self._subs.items()}

    def _check_thread(self) -> None:
        if self.thread.is_alive() and not self.thread.on_thread():
            raise RuntimeError("SubscriptionManager methods must run on the ingest thread")

    def subscribe(self, ctx: SubscriberContext) -> None:
        """One SUB per (instance_id, dp_rank, url); replaces an existing one."""
        self._check_thread()
        key = (ctx.instance_id, ctx.dp_rank, ctx.url)
        if key in self._subs:
            self._remove(key).close()
        sub = Subscription(self, ctx)
        try:
            sub.open()
        except BaseException:
            sub.close()
            raise
        self._add(sub)
        log.info(
            "subscribed %s (model=%s tenant=%s media=%s pool=%s replay=%s)",
            sub.name(),
            ctx.model,
            ctx.tenant,
            [Medium(m).name for m in ctx.default_media],
            ctx.is_pool,
            sub.replay_endpoint,
        )

    def replace(
        self, instance_id: str, dp_rank: int, contexts: list[SubscriberContext]
    ) -> set[str]:
        """Make (instance, dp)'s subscriptions exactly ``contexts``; returns the URLs opened.

        A URL already subscribed keeps its socket and its sequence tracking (the
        hand-over loses no batch); new URLs are opened first, and if one cannot be
        opened, everything opened here is closed again and nothing changes (the
        ``zmq.ZMQError`` propagates). URLs no longer wanted are closed last.
        """
        self._check_thread()
        old = dict(self._by_dp.get((instance_id, dp_rank), ()))
        wanted = {c.url: c for c in contexts}
        opened: list[Subscription] = []
        try:
            for url, c in wanted.items():
                if url not in old:
                    sub = Subscription(self, c)
                    opened.append(sub)
                    sub.open()
        except BaseException:
            for sub in opened:
                sub.close()
            raise
        for sub in opened:
            self._add(sub)
        for url, sub in old.items():
            if url in wanted:
                sub.retarget(wanted[url])
                self._note_bounded(sub)
            else:
                self._remove(sub.key).close()
        for sub in opened:
            log.info(
                "subscribed %s (model=%s tenant=%s media=%s pool=%s replay=%s)",
                sub.name(),
                sub.ctx.model,
                sub.ctx.tenant,
                [Medium(m).name for m in sub.ctx.default_media],
                sub.ctx.is_pool,
                sub.replay_endpoint,
            )
        return {sub.ctx.url for sub in opened}

    def unsubscribe(self, instance_id: str, dp_rank: int) -> int:
        """Close every subscription of (instance, dp); return how many."""
        self._check_thread()
        keys = [s.key for s in self._by_dp.get((instance_id, dp_rank), {}).values()]
        for k in keys:
            self._remove(k).close()
        return len(keys)

    def request_replay(self, ctx: SubscriberContext) -> None:
        """A new subscription of an (instance, DP) with a replay endpoint: catch up from 0
        (or verify from the last applied seq) once its SUB is connected."""
        self._check_thread()
        if not ctx.replay_endpoint:
            return
        if self.replicator is not None:
            return  # --state-url: the source's owner replays when it takes the lease
        sub = self._subs.get((ctx.instance_id, ctx.dp_rank, ctx.url))
        if sub is None or not sub.replay_endpoint:
            sub = next(
                (
                    s
                    for s in self._by_dp.get((ctx.instance_id, ctx.dp_rank), {}).values()
                    if s.replay_endpoint
                ),
                None,
            )
        if sub is None:
            self.subscribe(ctx)
            sub = self._subs[(ctx.instance_id, ctx.dp_rank, ctx.url)]
        if sub.connected:
            sub.tracker.catch_up()
        # else: the SUB's handshake asks (Subscription._now_connected); asked now, before
        # the engine is up, the replay would be answered before anything is published

    # -- dead engines (kvconductor.ingest.liveness) -----------------------------------------
    @property
    def source_down(self) -> float:
        return self.liveness.source_down

    @property
    def source_purge(self) -> float:
        return self.liveness.source_purge

    def check_sources(self, now: float | None = None) -> None:
        """Mute the HBM workers of every (instance, DP) whose HBM sources have all been
        down for ``source_down`` seconds, unmute those back, purge those down for
        ``source_purge`` (:class:`~kvconductor.ingest.liveness.Liveness`). Idempotent;
        the ingest thread runs it every
        :data:`~kvconductor.ingest.liveness.SOURCE_CHECK_SECS`."""
        self._check_thread()
        now = time.monotonic() if now is None else now
        subs = self._subs.values()
        self.liveness.check(subs, now)
        for sub in self._bounded.values():
            sub.applier.expire_store_only(now)
        r = self.replicator
        if r is None:
            return
        for sub in subs:
            down = sub.down_since
            if sub.replica.down_changed(down is not None):
                # tell every replica, so that they mute and purge alike
                r.append_source(sub, "down", "", -1.0 if down is None else now - down)

    def seed_store_only(self) -> None:
        """Put the CPU/Disk blocks each store-only DP holds now under its bound (after a
        dump restored the indexes behind the subscriptions the registrations opened)."""
        self._check_thread()
        for sub in self._bounded.values():
            sub.applier.seed_store_only()

    def _hbm_keys(self, k: tuple[str, str, str, int]):
        model, tenant, iid, dp = k
        idx = self.conductor.get_index(model, tenant)
        if idx is None:
            return None, []
        return idx, [w for w in idx.workers_of(iid, dp) if Medium(w.medium).tier == 0]

    # the liveness policy's host
    def set_dp_muted(self, k: tuple[str, str, str, int], muted: bool) -> None:
        idx, keys = self._hbm_keys(k)
        for w in keys:
            idx.set_muted(w, muted)

    def purge_dp(self, k: tuple[str, str, str, int]) -> int:
        idx, keys = self._hbm_keys(k)
        return sum(idx.clear(w) for w in keys)

    def sources(self) -> list[dict]:
        """Per subscription: identity, state, last_seq and counters."""
        self._check_thread()
        return [s.info() for s in self._subs.values()]

    def get(self, instance_id: str, dp_rank: int, url: str) -> Subscription | None:
        return self._subs.get((instance_id, dp_rank, url))

    def close(self) -> None:
        """Close every subscription."""
        self._check_thread()
        for k in list(self._subs):
            self._remove(k).close()

    def count(self, instance_id: str, dp_rank: int) -> int:
        """Subscriptions of (instance, dp)."""
        return len(self._by_dp.get((instance_id, dp_rank), ()))

    def __len__(self) -> int:
        return len(self._subs)
