"""Replicas on Valkey: ``--state-url`` (docs/operations.md, "Replicas on Valkey").

K ``kv-conductor`` processes on any hosts form one logical conductor through one Valkey
(or Redis <= 7.2; only commands both have) database.

**The log.** Every change of the service's state is an entry of one stream
(:data:`LOG`), and every replica applies the stream in order on its ingest thread (the
one writer of its state), so a replica's state is a function of the prefix it applied.
Entries (field ``k`` the kind, ``b`` the body, ``o`` the tag of the replica request
that appended it):

* ``register``, ``unregister``, ``events``: an HTTP mutation, its request body as
  received. The replica that accepted it appends it, applies it like every other
  replica, and answers the client with what applying it did (201, 400, 404, 503...);
* ``batches``: ``[[instance, dp, url, seq, epoch, payload], ...]``, engine or pool
  messages appended by the replica that consumes their source (its *owner*), packed up to
  1 MiB of payload per entry;
* ``loss``, ``aged``: the owner's sequence tracker declared a loss (every replica marks
  the source's blocks suspect) and, ``--loss-grace-secs`` later, ended its grace period
  (every replica drops the suspects not announced again);
* ``down``: the owner sees the source not ready for so many seconds, or ready again
  (every replica mutes and purges a dead engine's DP as the owner does).

**Sources.** One replica at a time consumes a ZeroMQ source: the holder of its lease
(:data:`LEASE` + source, ``SET NX PX``, value ``<replica>:<epoch>``, the epoch from
``INCR`` of :data:`EPOCH`), renewed every third of ``lease_secs``. Replicas take free
sources up to their share (sources / live replicas), and any source free for two
rounds. A new owner resumes from the source's replicated cursor (the last batch the log
applied): its replay from there verifies that batch and brings the ones after it, so a
take-over loses nothing inside the engine's replay ring. Its entries carry a higher
epoch; an entry of an older epoch than one applied is ignored (a stale owner is fenced
off), a batch not past the cursor is a duplicate (the replay repeats what the old owner
appended just before it lost the lease).

**Snapshots.** Every ``snapshot_interval`` one replica (lock :data:`SNAP_LOCK`) writes a
dump (:mod:`kvconductor.state.dump`, with the cursors) of its state at a log position in
chunks, records it in :data:`SNAP` and trims the log below the previous snapshot's
position: the log's memory is bounded by two snapshot intervals. A replica that starts,
or finds itself behind the trim point, loads the latest snapshot and reads the log
after its position (*bootstrap*).

**The store fails.** Reads (queries) go on from what the replica holds; HTTP mutations
answer 503; an owner that cannot append a batch stops consuming that source (passive
again), and whoever takes its lease when the store is back resumes it from the
replicated cursor. A store that comes back empty (restarted without persistence) is
seeded again: one replica (``SET NX`` of a new :data:`GEN`) writes its state as the new
snapshot, the others bootstrap from it.

Threads: the *reader* (log -> ingest thread), the *writer* (appends, pipelined), the
*keeper* (heartbeat, leases, snapshots). The replicated state changes on the ingest
thread only.

Rooms: the store's keys, scripts, client and the packing of log entries are
:mod:`kvconductor.state.store`'s; the keeper's leases (:class:`~kvconductor.state.
replica_leases.ReplicaLeases`) and the bootstrap, seed and snapshots (:class:`~kvconductor.
state.replica_snapshots.ReplicaSnapshots`) are base classes of :class:`ValkeyJournal`,
each in a module of its own; this module keeps the journal itself (HTTP mutations,
source entries, the writer, the reader, applying the log, the keeper's loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvconductor.state.conductor import Conductor, StateUnavailable
from kvconductor.state.journal import MUTATIONS, Args, apply_logged, mutation
from kvconductor.state.protocols import ReplicaInfo
from kvconductor.state.replica_leases import ReplicaLeases
from kvconductor.state.replica_snapshots import ReplicaSnapshots
from kvconductor.state.store import (
    COMMIT_SNAPSHOT,
    GEN,
    LOG,
    MEMBERS,
    RELEASE,
    RENEW_LEASE,
    SEED,
    SENTINEL_SCHEMES,
    SNAP,
    TAKE_LEASE,
    ReplicaStats,
    connect,
    entry_id,
    lease_key,
    pack,
    parse_sentinel_url,
    safe_url,
    store_errors,
    text,
)

if TYPE_CHECKING:
    from kvconductor.ingest.host import JournalSource

log = logging.getLogger("kvconductor.replica")

# The store's URL helpers are importable from here too (the command line checks
# --state-url with them).
__all__ = [
    "SENTINEL_SCHEMES",
    "ReplicaSettings",
    "ReplicaStats",
    "Replicator",
    "ValkeyJournal",
    "connect",
    "parse_sentinel_url",
    "safe_url",
]

LEASE_SECS = 5.0
READ_COUNT = 64
WRITE_BATCH = 512
QUEUE_MAX = 100_000
SUBMIT_TIMEOUT = 10.0


@dataclass(frozen=True)
class ReplicaSettings:
    """``--state-url`` and the replication's flags (docs/operations.md, "Replicas on
    Valkey")."""

    url: str
    #: Used when the URL carries none (``KVCONDUCTOR_STATE_PASSWORD``).
    password: str | None = None
    #: This replica's name in the store (default: ``host:pid:random``).
    replica_id: str | None = None
    lease_secs: float = LEASE_SECS
    #: Seconds between the store's snapshots (0: none).
    snapshot_interval: float = 60.0
    #: Seconds an HTTP mutation waits for its entry to be applied here (then 503).
    submit_timeout: float = SUBMIT_TIMEOUT


class ValkeyJournal(ReplicaLeases, ReplicaSnapshots):
    """One replica's link to the shared state (module docstring): the
    :class:`~kvconductor.state.journal.Journal` of a conductor with ``--state-url`` (built
    by the ``journal`` factory handed to :class:`~kvconductor.state.conductor.Conductor`),
    and the :class:`~kvconductor.ingest.host.SourceJournal` of its subscriptions (handed
    to them at construction); :meth:`start` once the conductor runs."""

    #: Sources are leased among the replicas (a source not owned here is remote).
    replicated = True

    def __init__(self, conductor: Conductor, settings: ReplicaSettings) -> None:
        s = settings
        self.conductor = conductor
        self.url = s.url
        #: The URL without its password, for log lines and answers.
        self.where = safe_url(s.url)
        self.id = s.replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_ms = max(300, int(s.lease_secs * 1000))
        self.snapshot_interval = float(s.snapshot_interval)
        self.submit_timeout = s.submit_timeout
        self.client = connect(s.url, s.password)
        self.errors = store_errors()
        self.stats = ReplicaStats()
        #: The store answered the last command (reader or writer).
        self.up = False
        self.down_since: float | None = time.monotonic()
        #: The state was loaded from the store (readiness).
        self.bootstrapped = False
        self.gen: str | None = None
        #: Owner epochs below this are fenced off in this generation (set by its seed).
        self.floor = 0
        #: Keeper rounds in a row this replica held more sources than its share.
        self._over_share = 0
        #: The log position applied (written on the ingest thread).
        self.applied_id = "0-0"
        self._needs_bootstrap = True
        self._q: queue.Queue = queue.Queue(QUEUE_MAX)
        self._waiters: dict[str, concurrent.futures.Future] = {}
        self._n = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: Sources this replica holds the lease of: key -> lease value (keeper thread).
        self._leases: dict[tuple[str, int, str], str] = {}
        #: Rounds each source was seen without an owner (keeper thread).
        self._free_rounds: dict[tuple[str, int, str], int] = {}
        self._take_lease = self.client.register_script(TAKE_LEASE)
        self._renew = self.client.register_script(RENEW_LEASE)
        self._release = self.client.register_script(RELEASE)
        self._commit = self.client.register_script(COMMIT_SNAPSHOT)
        self._seed_script = self.client.register_script(SEED)
        self._last_check = 0.0
        self._snap_thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, wait: float = 10.0) -> None:
        """Bootstrap the started conductor (up to ``wait`` seconds; the reader goes on
        trying after that) and start the threads."""
        deadline = time.monotonic() + wait
        last: BaseException | None = None
        while time.monotonic() < deadline and not self.bootstrapped:
            try:
                self._bootstrap()
            except self.errors as ex:
                last = ex
                self._set_up(False, ex)
                time.sleep(0.2)
        if not self.bootstrapped:
            log.error(
                "state store %s unreachable (%s: %s): serving without its state; retrying",
                self.where,
                type(last).__name__,
                last,
            )
        for name, fn in (("reader", self._read_loop), ("writer", self._write_loop)):
            t = threading.Thread(target=fn, name=f"kvc-replica-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._keep_loop, name="kvc-replica-keeper", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Stop the threads and give up this replica's leases (a take-over is then
        immediate instead of a lease period later)."""
        self._stop.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass  # the writer sees _stop after its round
        for t in [*self._threads, self._snap_thread]:
            if t is not None:
                t.join(10)
        try:
            for key, token in list(self._leases.items()):
                self._release(keys=[lease_key(key)], args=[token])
            self.client.zrem(MEMBERS, self.id)
        except self.errors:
            pass
        self._leases.clear()

    def _set_up(self, up: bool, ex: BaseException | None = None) -> None:
        if up and not self.up:
            if self.down_since is not None and self.stats.appended + self.stats.applied:
                log.info("state store %s reachable again", self.where)
            self.down_since = None
        elif not up and self.up:
            self.down_since = time.monotonic()
            log.error("state store %s unreachable: %s", self.where, ex)
        self.up = up

    # -- HTTP mutations (the Journal) ---------------------------------------------------------
    @property
    def replica(self) -> ValkeyJournal:
        """This journal is the replica (``/ready``, ``/workers``, ``/metrics``)."""
        return self

    @property
    def sources(self) -> ValkeyJournal:
        """This journal is the subscriptions' too (the sources' entries)."""
        return self

    async def submit(self, kind: str, body: bytes, args: Args = ()) -> object:
        """Append an HTTP mutation and return what applying it did here (or raise what it
        raised); :class:`StateUnavailable` when the store cannot take it. ``args`` (the
        body parsed) are not used: every replica decodes the logged body the same way."""
        mutation(kind)  # an unknown kind is refused before it is logged
        if not self.up or not self.bootstrapped:
            raise StateUnavailable(self._down_reason())
        tag = f"{self.id}#{next(self._n)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._waiters[tag] = fut
        if not self._enqueue(kind, body, tag):
            self._waiters.pop(tag, None)
            raise StateUnavailable("the state store's append queue is full")
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.submit_timeout)
        except asyncio.TimeoutError:
            self._waiters.pop(tag, None)
            raise StateUnavailable(
                f"the state store did not confirm the change within {self.submit_timeout:g}s"
                " (it may still be applied)"
            ) from None

    def _down_reason(self) -> str:
        if not self.bootstrapped:
            return f"state store {self.where} not loaded yet; changes are refused until it is"
        return f"state store {self.where} unreachable; changes are refused until it is back"

    def _enqueue(self, kind: str, body: bytes, tag: str | None, key=None) -> bool:
        fields = {"k": kind, "b": body}
        if tag is not None:
            fields["o"] = tag
        try:
            self._q.put_nowait((fields, tag, key, None))
        except queue.Full:
            return False
        return True

    # -- source entries (ingest thread, the owner's tracker) -------------------------------
    def claims(self, key: tuple[str, int, str]) -> bool:
        """A new source is passive: consumed here only once this replica takes its lease."""
        return False

    def cursor(self, sub: JournalSource) -> tuple[int, int] | None:
        """The replicated cursor (what the log applied here), owned or not."""
        return sub.replica.applied

    def append_loss(self, sub: JournalSource, why: str, epoch: int) -> None:
        """Every replica marks the suspects when it applies the ``loss`` entry; the owner
        ends the grace period with an ``aged`` entry (``Subscription.grace_over``)."""
        token = f"{sub.lease_epoch}.{epoch}"
        self.append_source(sub, "loss", token, why)
        sub.age_later(token)

    def report_down(self, subs: Iterable[JournalSource], now: float) -> None:
        """A ``down`` entry for each owned source that went down or came back, so that
        every replica mutes and purges alike."""
        for sub in subs:
            down = sub.down_since
            if sub.replica.down_changed(down is not None):
                self.append_source(sub, "down", "", -1.0 if down is None else now - down)

    def append_batch(self, sub: JournalSource, seq: int, payload: bytes) -> None:
        """An engine batch of an owned source (the writer packs consecutive ones into one
        ``batches`` entry)."""
        key = sub.key
        item = [key[0], key[1], key[2], seq, sub.lease_epoch, payload]
        try:
            if not self.up:
                raise queue.Full
            self._q.put_nowait((None, None, key, item))
        except queue.Full:
            self._append_failed(key)

    def append_source(
        self, sub: JournalSource, kind: str, token: str, extra: str | float | None = None
    ) -> None:
        """A ``loss`` (``extra``: why), ``aged`` or ``down`` (``extra``: seconds not ready,
        negative when ready) entry of an owned source."""
        key = sub.key
        items: list[object] = [key[0], key[1], key[2], sub.lease_epoch, token]
        if extra is not None:
            items.append(extra)
        if not self.up or not self._enqueue(kind, msgspec.msgpack.encode(items), None, key):
            self._append_failed(key)

    def _append_failed(self, key: tuple[str, int, str]) -> None:
        """An entry of an owned source could not be appended: stop consuming it; whoever
        takes its lease next resumes it from the replicated cursor."""
        self.stats.append_failures += 1
        self.conductor.thread.submit(self._give_up, key)

    def _give_up(self, key: tuple[str, int, str]) -> None:
        sub = self.conductor.subs.get(*key)
        if sub is not None and sub.owned:
            log.warning("%s: cannot append to the state store; stopping consuming it", sub.name())
            sub.release()
        self._leases.pop(key, None)

    # -- the writer ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            items = [item]
            while len(items) < WRITE_BATCH:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop.set()
                    break
                items.append(nxt)
            entries = pack(items)
            pipe = self.client.pipeline(transaction=False)
            for fields in entries:
                pipe.xadd(LOG, fields)
            try:
                pipe.execute()
            except self.errors as ex:
                self._set_up(False, ex)
                failed = {it[2] for it in items if it[2] is not None}
                for key in failed:
                    self._append_failed(key)
                for it in items:
                    fut = self._waiters.pop(it[1], None) if it[1] is not None else None
                    if fut is not None and not fut.done():
                        fut.set_exception(StateUnavailable(self._down_reason()))
                continue
            self.stats.appended += len(entries)
            self._set_up(True)

    # -- the reader ------------------------------------------------------------------------
    def _read_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self._needs_bootstrap:
                    self._bootstrap()
                    if self._needs_bootstrap:
                        time.sleep(0.2)
                        continue
                self._check_store()
                if self._needs_bootstrap:
                    continue
                # the generation with the read, on one connection: entries of a store
                # that was emptied (before it is seeded again) are never applied
                pipe = self.client.pipeline(transaction=False)
                pipe.get(GEN)
                pipe.xread({LOG: self.applied_id}, count=READ_COUNT, block=500)
                gen, resp = pipe.execute()
                self._set_up(True)
                backoff = 0.1
                if gen is None or text(gen) != self.gen:
                    self._last_check = 0.0  # look at the store now
                    continue
                if resp:
                    entries = resp[0][1]
                    self.conductor.call(self._apply_entries, entries, timeout=None)
            except self.errors as ex:
                self._set_up(False, ex)
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
            except Exception:  # never let the reader die: log, pause, go on
                log.exception("state store reader failed; retrying")
                self._stop.wait(1.0)

    def _check_store(self) -> None:
        """At most twice a second: the store emptied (seed it again), re-seeded by another
        replica, or trimmed past what this replica applied (bootstrap)."""
        now = time.monotonic()
        if now - self._last_check < 0.5:
            return
        self._last_check = now
        pipe = self.client.pipeline(transaction=False)
        pipe.get(GEN)
        pipe.hmget(SNAP, ["gen", "trimmed"])
        gen, (snap_gen, trimmed) = pipe.execute()
        self._set_up(True)
        if gen is None:
            log.warning("state store %s is empty (restarted?): seeding it again", self.where)
            self._seed()
            return
        if text(gen) != self.gen:
            log.warning("state store %s was seeded again by another replica", self.where)
            self._new_generation()
            return
        if (
            trimmed is not None
            and snap_gen == gen
            and entry_id(self.applied_id) < entry_id(text(trimmed))
        ):
            log.warning(
                "this replica is behind the log's trim point (%s < %s): loading the snapshot",
                self.applied_id,
                text(trimmed),
            )
            self._needs_bootstrap = True

    # -- applying the log (ingest thread) --------------------------------------------------
    def _apply_entries(self, entries: list) -> None:
        shared = self.conductor.shared
        with shared.batch() if shared is not None else nullcontext():
            for eid, fields in entries:
                eid = text(eid)
                if entry_id(eid) <= entry_id(self.applied_id):
                    continue
                kind = text(fields.get(b"k", b""))
                body = fields.get(b"b", b"")
                tag = fields.get(b"o")
                result: object = None
                error: BaseException | None = None
                try:
                    result = self._apply_one(kind, body)
                except Exception as ex:
                    error = ex
                    if not _is_outcome(ex):
                        self.stats.apply_errors += 1
                        log.exception("log entry %s (%s) could not be applied", eid, kind)
                self.applied_id = eid
                self.stats.applied += 1
                if tag is not None:
                    fut = self._waiters.pop(text(tag), None)
                    if fut is not None and not fut.done():
                        if error is None:
                            fut.set_result(result)
                        else:
                            fut.set_exception(error)

    def _apply_one(self, kind: str, body: bytes) -> object:
        c = self.conductor
        if kind == "batches":
            apply = c.subs.apply_logged
            items = msgspec.msgpack.decode(body)
            for iid, dp, url, seq, epoch, payload in items:
                apply((iid, dp, url), seq, epoch, payload)
            self.stats.batches += len(items)
            return None
        if kind in MUTATIONS:  # an HTTP mutation: the same table as a LocalJournal's
            return apply_logged(c, kind, body)
        if kind == "loss":
            iid, dp, url, epoch, token, why = msgspec.msgpack.decode(body)
            c.subs.loss_logged((iid, dp, url), epoch, token, why)
            return None
        if kind == "aged":
            iid, dp, url, epoch, token = msgspec.msgpack.decode(body)
            c.subs.aged_logged((iid, dp, url), epoch, token)
            return None
        if kind == "down":
            iid, dp, url, epoch, _, secs = msgspec.msgpack.decode(body)
            c.subs.down_logged((iid, dp, url), epoch, float(secs))
            return None
        raise ValueError(f"unknown log entry kind {kind!r}")

    # -- the keeper: heartbeat, leases, snapshots ------------------------------------------
    def _keep_loop(self) -> None:
        period = self.lease_ms / 3000.0
        last_snap = time.monotonic()
        while not self._stop.wait(period):
            try:
                if not self.bootstrapped:
                    continue
                self._keep()
                if self.snapshot_interval > 0 and time.monotonic() - last_snap >= min(
                    self.snapshot_interval, 5.0
                ):
                    last_snap = time.monotonic()
                    snap = self._snap_thread
                    if snap is None or not snap.is_alive():
                        # its own thread: a large snapshot must not delay lease renewals
                        snap = threading.Thread(
                            target=self._snapshot_safely, name="kvc-replica-snapshot", daemon=True
                        )
                        self._snap_thread = snap
                        snap.start()
            except self.errors as ex:
                self._set_up(False, ex)
                self._drop_all_leases()
            except Exception:  # never let the keeper die
                log.exception("state store keeper failed; retrying")

    # -- introspection ---------------------------------------------------------------------
    def lag_seconds(self) -> float:
        """How far the applied position is behind the newest entry the keeper saw."""
        last, mine = entry_id(self.stats.log_last_id), entry_id(self.applied_id)
        if mine >= last:
            return 0.0
        return max(0.0, (last[0] - mine[0]) / 1000.0)

    def info(self) -> ReplicaInfo:
        """``/workers``' ``replica`` object."""
        s = self.stats
        return {
            "id": self.id,
            "state_store": "up" if self.up else "down",
            "loaded": self.bootstrapped,
            "applied_id": self.applied_id,
            "log_last_id": s.log_last_id,
            "log_length": s.log_length,
            "lag_s": round(self.lag_seconds(), 3),
            "replicas": s.replicas,
            "sources_consumed": len(self._leases),
            "sources_handed_over": s.handed_over,
            "entries_applied": s.applied,
            "batches_applied": s.batches,
            "entries_appended": s.appended,
            "append_failures": s.append_failures,
            "bootstraps": s.bootstraps,
            "snapshots_written": s.snapshots,
        }


def _is_outcome(ex: BaseException) -> bool:
    """An exception that is the answer to a request (4xx/503), not a failure."""
    from kvconductor.state.events import InstanceNotRegistered
    from kvconductor.state.registration import RegistrationUnavailable
    from kvconductor.state.registry import RegistrationError

    return isinstance(ex, RegistrationError | RegistrationUnavailable | InstanceNotRegistered)


#: The name before the journal seam (tests, and callers of the replica module).
Replicator = ValkeyJournal
