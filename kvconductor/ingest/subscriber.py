"""ZeroMQ subscriptions to engine and pool publishers: the manager of the table.

:class:`SubscriptionManager` lives on the ingest thread
(:class:`~kvconductor.ingest.thread.IngestThread`); **every method is called on
that thread** (use ``thread.call(mgr.subscribe, ctx)`` / ``await
thread.run(...)`` from elsewhere), except :meth:`~SubscriptionManager.metrics_snapshot`
(any thread; the columns are read by :mod:`~kvconductor.ingest.sourcecolumns`). Its
table holds one :class:`~kvconductor.ingest.subscription.Subscription` per (instance_id,
dp_rank, url): the sockets, sequence numbers, replay and loss of one source are there.

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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.freshness import FreshnessTables
from kvconductor.ingest.host import (
    LOCAL_SOURCES,
    IngestHost,
    IngestSettings,
    SharedWrites,
    SourceJournal,
)
from kvconductor.ingest.liveness import Liveness
from kvconductor.ingest.replicated import DUPLICATE, HOLE
from kvconductor.ingest.sourcecolumns import Columns, RetiredTotals, read_columns, replays
from kvconductor.ingest.sourcemetrics import SourceSnapshot
from kvconductor.ingest.stats import COUNTS_STAMP, LABELS_STAMP, STATE_STAMP, Limits, WarnLimiter
from kvconductor.ingest.subscription import Subscription
from kvconductor.ingest.thread import IngestThread
from kvconductor.ingest.tracker import digest
from kvconductor.keys import Medium
from kvconductor.schema import JSONObject

log = logging.getLogger("kvconductor.ingest")


#: Subscriptions read per slice of a ``/metrics`` scrape (metrics_snapshot's ``pause``).
METRICS_CHUNK = 1024


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
        journal: SourceJournal = LOCAL_SOURCES,
    ) -> None:
        """``settings``: the flags of ingest (defaults:
        :class:`~kvconductor.ingest.host.IngestSettings`); ``shared``: ``--workers N``'s
        shared write section over each socket's drain (None: one process); ``journal``:
        what the sources' batches and events go through (``--state-url``: the replicated
        log; default: applied at once, every source consumed here)."""
        s = settings or IngestSettings()
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
        #: What the sources' batches and events go through (--state-url: the
        #: :class:`kvconductor.state.replica.ValkeyJournal`; one process: LOCAL_SOURCES).
        self.journal = journal
        #: --state-url: no source entry of an owner epoch below this is applied (raised
        #: when the state store is seeded again: owners of the old store are fenced off).
        self.fence_floor = 0
        #: Counters of closed subscriptions (metrics), folded in by :meth:`_remove`.
        self.retired = RetiredTotals()
        #: Held while the table changes and while a scrape reads it: a scrape sees a
        #: closing subscription's counters either in the table or in :attr:`retired`,
        #: never in both or neither. Never taken per batch.
        self._table_lock = threading.Lock()
        #: What the last scrape read that only changes with the table (read_columns).
        self._metric_columns: list[Columns] = []

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
            ok, failed = replays(sub)
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
        replicated = self.journal.replicated
        kept = self._metric_columns  # replaced whole: concurrent scrapes never share one
        out = []
        for c, i in enumerate(range(0, len(subs), METRICS_CHUNK)):
            if i and pause is not None:
                pause()
            last = kept[c] if c < len(kept) else None
            out.append(read_columns(snap, subs[i : i + METRICS_CHUNK], replicated, last, stamps))
        self._metric_columns = out
        return snap

    def cursors(self) -> list[JSONObject]:
        """Where each subscription's applied sequence stands (ingest thread; snapshots):
        ``instance_id``, ``dp_rank``, ``url``, ``last_seq`` and the ``digest`` of that
        batch, for every subscription that has applied a batch since its last loss;
        ``fence``: the highest owner epoch its log entries had (``--state-url``)."""
        self._check_thread()
        out: list[JSONObject] = []
        cursor = self.journal.cursor
        for k, sub in self._subs.items():
            cur = cursor(sub)
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
                sub.age_later(token)
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
        sub.begin_suspect(why)

    def aged_logged(self, key: tuple[str, int, str], epoch: int, token: str) -> None:
        """An ``aged`` entry: the grace period of loss ``token`` is over."""
        sub = self._subs.get(key)
        if sub is None or sub.replica.loss_token != token or not sub.replica.current(epoch):
            return
        sub.replica.loss_token = None
        sub.end_suspect()

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

    def restarted(self, instance_id: str, dp_rank: int, urls: set[str], why: str) -> None:
        """(instance, DP)'s engine came back on new URLs (``urls``, just opened by
        :meth:`replace`): its cache is new, as for a restart seen in a sequence
        (:meth:`~kvconductor.ingest.tracker.SequenceTracker.restarted`)."""
        self._check_thread()
        now = time.time()
        for url, sub in self._by_dp.get((instance_id, dp_rank), {}).items():
            if url in urls:
                sub.tracker.restarted(why, now)

    def request_replay(self, ctx: SubscriberContext) -> None:
        """A new subscription of an (instance, DP) with a replay endpoint: catch up from 0
        (or verify from the last applied seq) once its SUB is connected."""
        self._check_thread()
        key = (ctx.instance_id, ctx.dp_rank, ctx.url)
        if not ctx.replay_endpoint or not self.journal.claims(key):
            return  # --state-url: the source's owner replays when it takes the lease
        sub = self._subs.get(key)
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
            sub = self._subs[key]
        if sub.connected:
            sub.tracker.catch_up()
        # else: the SUB's handshake asks (Subscription._now_connected); asked now, before
        # the engine is up, the replay would be answered before anything is published

    # -- dead engines (kvconductor.ingest.liveness) -----------------------------------------
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
        self.journal.report_down(subs, now)  # --state-url: every replica mutes alike

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
