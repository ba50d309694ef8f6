"""One source: a SUB socket to one publisher URL for one (instance, DP), with replay
and gap recovery.

A :class:`Subscription` is one entry of the table of
:class:`~kvconductor.ingest.subscriber.SubscriptionManager` and, like it, runs on the
ingest thread (:class:`~kvconductor.ingest.thread.IngestThread`). It owns one SUB
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

A source that is not ready (``connecting`` or ``replaying``) is ``down`` from then
(:attr:`Subscription.down_since`); what that mutes and purges is the manager's
(:mod:`~kvconductor.ingest.subscriber`, "dead engines").

Only subscriptions that feed HBM workers (engine PUB, ``not ctx.is_pool`` and a
HBM medium in ``ctx.default_media``) use ``ctx.replay_endpoint``: a replay ROUTER
serves the engine's sequence, not a pool port's.
"""

from __future__ import annotations

import logging
import time
from operator import attrgetter
from typing import Protocol

import zmq

from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext, source_kind
from kvconductor.ingest.host import IngestHost, SharedWrites, SourceJournal
from kvconductor.ingest.replay import ReplaySession
from kvconductor.ingest.replicated import ReplicaState
from kvconductor.ingest.source import SubSource
from kvconductor.ingest.sourcemetrics import label_sets
from kvconductor.ingest.stats import (
    Limits,
    SourceStats,
    Stamped,
    WarnLimiter,
    labels_changed,
    state_changed,
)
from kvconductor.ingest.thread import IngestThread
from kvconductor.ingest.tracker import SequenceTracker
from kvconductor.keys import Medium

log = logging.getLogger("kvconductor.ingest")


class SubscriptionOwner(Protocol):
    """What a subscription reads of the manager that holds it (the
    :class:`~kvconductor.ingest.subscriber.SubscriptionManager`)."""

    thread: IngestThread
    conductor: IngestHost
    shared: SharedWrites | None
    warn: WarnLimiter
    limits: Limits
    replay_timeout: float
    replay_deadline: float
    loss_grace: float
    resume: dict[tuple[str, int, str], tuple[int, int, int]]
    journal: SourceJournal
    fence_floor: int


class Subscription:
    """One SUB socket to one publisher URL for one (instance, DP).

    The sockets are here; what to do with each batch is decided by its
    :class:`~kvconductor.ingest.tracker.SequenceTracker`, for which this is the
    :class:`~kvconductor.ingest.tracker.TrackerHost`.
    """

    def __init__(self, manager: SubscriptionOwner, ctx: SubscriberContext) -> None:
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
        #: An engine stream of HBM blocks (what a down source mutes and purges:
        #: :meth:`~kvconductor.ingest.subscriber.SubscriptionManager.check_sources`).
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
        #: What its batches and events go through (``--state-url``: the replicated log).
        self.journal = manager.journal
        #: --state-url (kvconductor.state.replica): the source's replicated state, the same on
        #: every replica (:class:`~kvconductor.ingest.replicated.ReplicaState`); owned from
        #: the start when the journal claims it (one process: always).
        self.replica = ReplicaState(manager.fence_floor, owned=self.journal.claims(self.key))
        if not self.replica.owned:
            self.down_since = None  # passive: up until the owner says otherwise
        cursor = manager.resume.pop(self.key, None)
        if cursor is not None:
            # warm start: go on from the snapshot's cursor (the registration's replay
            # verifies the batch at it and asks for what came after)
            self.tracker.last_seq = self.stats.last_seq = cursor[0]
            self.tracker.last_digest = cursor[1]
            self.replica.applied = (cursor[0], cursor[1])
            self.replica.fence = max(self.replica.fence, cursor[2])

    # connected, muted and tracker: a write tells a /metrics scrape to read the source's
    # state again (kvconductor.ingest.stats.STATE_STAMP)
    connected = Stamped[bool](
        "connected",
        state_changed,
        "The SUB has a publisher (its monitor saw the handshake, or it is bound).",
        only_changes=True,
    )
    muted = Stamped[bool](
        "muted",
        state_changed,
        "Its (instance, DP)'s HBM hits are muted (down past --source-down-secs).",
        only_changes=True,
    )
    tracker = Stamped[SequenceTracker](
        "tracker",
        state_changed,
        "The sequence and replay state (a new one after a resync or a lease change).",
    )
    _tracker: SequenceTracker

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
        """Not owned here: --state-url and another replica consumes this source (or none
        yet). One process owns every source (its journal claims them all)."""
        return not self.replica.owned

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
            self.age_later(token)
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

    def age_later(self, token: str) -> None:
        """--state-url: end loss ``token``'s grace period in ``--loss-grace-secs``."""
        self.thread.call_later(self.manager.loss_grace, lambda: self.grace_over(token))

    def grace_over(self, token: str) -> None:
        """--state-url: loss ``token``'s grace period is over; the owner says so to every
        replica (an ``aged`` entry)."""
        if self.owned and not self.closed and self.replica.loss_token == token:
            self.journal.append_source(self, "aged", token)

    # -- the tracker's host ----------------------------------------------------------------
    def apply(self, payload: bytes, seq: int) -> None:
        # one process: applied at once (LocalSources); --state-url: appended to the log
        self.journal.append_batch(self, seq, payload)

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
        """Keep the state, degrade, age out later (module docstring): here at once
        (:meth:`degrade`), or on every replica when the log applies the loss."""
        self.journal.append_loss(self, why, epoch)

    def degrade(self, why: str, epoch: int) -> None:
        """Loss ``epoch`` of the tracker: the blocks held now are suspects; those not
        announced again within the grace period are dropped then."""
        self.begin_suspect(why)
        self.thread.call_later(self.manager.loss_grace, lambda: self._end_degraded(epoch))

    def _end_degraded(self, epoch: int) -> None:
        if self.tracker.end_degraded(epoch):  # else closed, or superseded by a later loss
            self.end_suspect()

    def begin_suspect(self, why: str) -> None:
        """A loss (here, or a ``loss`` entry of the log): the blocks held now are suspects."""
        n = self.applier.begin_suspect()
        log.warning(
            "%s: %s; source degraded: %d blocks kept, those not announced again "
            "within %gs will be dropped",
            self.name(),
            why,
            n,
            self.manager.loss_grace,
        )

    def end_suspect(self) -> None:
        """The grace period is over: the suspects not announced again are dropped."""
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


# PERF: what a /metrics scrape reads of many subscriptions at once, in C loops
# (kvconductor.ingest.sourcecolumns): the attributes behind the properties, no call
READ_TRACKER = attrgetter("_tracker")
READ_CONNECTED = attrgetter("_connected")
READ_MUTED = attrgetter("_muted")
