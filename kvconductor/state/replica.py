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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec

from kvconductor.state import dump
from kvconductor.state.conductor import Conductor, StateUnavailable
from kvconductor.state.journal import MUTATIONS, Args, apply_logged, mutation
from kvconductor.state.protocols import ReplicaInfo

if TYPE_CHECKING:
    from valkey import Valkey

    from kvconductor.ingest.host import JournalSource

log = logging.getLogger("kvconductor.replica")

# valkey types every command's reply as sync-or-async: the casts below name what the
# synchronous client this module uses returns.
NS = "kvc:"
#: The stream every replica applies.
LOG = NS + "log"
#: Generation of the store's content: a store found without it was emptied.
GEN = NS + "gen"
#: Hash: the latest snapshot (``id`` log position, ``key``, ``chunks``, ``bytes``,
#: ``gen``, ``time``, ``trimmed`` the position the log was trimmed to).
SNAP = NS + "snap"
SNAP_CHUNK = NS + "snap:"
SNAP_LOCK = NS + "snaplock"
EPOCH = NS + "epoch"
LEASE = NS + "lease:"
#: Sorted set: replica id -> its last heartbeat (ms).
MEMBERS = NS + "replicas"

LEASE_SECS = 5.0
CHUNK_BYTES = 4 << 20
READ_COUNT = 64
WRITE_BATCH = 512
QUEUE_MAX = 100_000
SUBMIT_TIMEOUT = 10.0
#: Keeper rounds over its share before a replica hands a source over.
SHED_ROUNDS = 3

# Leases are taken and renewed only in the generation the replica loaded: a lease taken
# in a store that was emptied (before it is seeded again) or renewed across a re-seed
# would let an owner go on from a cursor the new state does not have.
_TAKE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
local epoch = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[2], ARGV[2] .. ':' .. epoch, 'PX', ARGV[3])
return epoch
"""
_RENEW = """
if redis.call('GET', KEYS[2]) == ARGV[3] and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('DEL', KEYS[1]) else return 0 end"
)
# Record a snapshot and trim the log below the previous one, only if the store is still
# of the generation the snapshot was taken in.
_COMMIT_SNAPSHOT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local trim = redis.call('HGET', KEYS[2], 'id') or '0-0'
if ARGV[7] == '1' then trim = '0-0' end
redis.call('HSET', KEYS[2], 'id', ARGV[2], 'key', ARGV[3], 'chunks', ARGV[4],
           'bytes', ARGV[5], 'gen', ARGV[1], 'time', ARGV[6], 'trimmed', trim,
           'floor', ARGV[8])
if trim ~= '0-0' then redis.call('XTRIM', KEYS[3], 'MINID', trim) end
return 1
"""
# A new generation; owner epochs go on above every epoch the seeding replica applied
# (ARGV[2], the new fence floor), so that nothing an owner of the old store appends is
# applied in the new one.
_SEED = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('DEL', KEYS[2])
  redis.call('DEL', KEYS[3])
  redis.call('SET', KEYS[4], ARGV[2])
  return 1
end
return 0
"""


def _id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


SENTINEL_SCHEMES = ("redis+sentinel", "valkey+sentinel")


def connect(url: str, password: str | None = None) -> Valkey:
    """A client of ``url``: ``redis://HOST:PORT/DB``, ``rediss://...``,
    ``unix:///PATH?db=N``, or ``redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/
    SERVICE[/DB]``: the primary the Sentinels name for SERVICE, found again after a
    failover. ``password``: used when the URL carries none."""
    import valkey

    scheme = url.partition("://")[0]
    if scheme in SENTINEL_SCHEMES:
        from valkey.sentinel import Sentinel

        sentinels, service, db, url_password = parse_sentinel_url(url)
        kw = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
        return Sentinel(sentinels, sentinel_kwargs=kw, **kw).master_for(
            service, db=db, password=url_password or password, **kw
        )
    # from_url: a password in the URL takes precedence over the keyword
    return valkey.Valkey.from_url(
        url,
        password=password,
        socket_timeout=5.0,
        socket_connect_timeout=2.0,
        health_check_interval=0,
    )


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """(sentinels, service, db, password) of a ``redis+sentinel://`` URL; ``ValueError``
    naming what is wrong."""
    from urllib.parse import unquote

    rest = url.partition("://")[2]
    auth, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    password = unquote(auth.partition(":")[2]) or None if auth else None
    sentinels = []
    for h in hosts.split(","):
        host, _, port = h.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {h!r} is not HOST:PORT")
        sentinels.append((host.strip("[]"), int(port)))
    service, _, db = path.partition("/")
    if not service:
        raise ValueError("the URL names no Sentinel service (redis+sentinel://HOST:PORT/NAME)")
    if db and not db.isdigit():
        raise ValueError(f"database {db!r} is not a number")
    return sentinels, service, int(db or 0), password


def _errors() -> tuple[type[BaseException], ...]:
    import valkey

    return (valkey.ConnectionError, valkey.TimeoutError, OSError)


def safe_url(url: str) -> str:
    """``url`` with its password (``redis://user:PASSWORD@host``) replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def lease_key(key: tuple[str, int, str]) -> str:
    return f"{LEASE}{key[0]}/dp{key[1]}@{key[2]}"


@dataclass
class ReplicaStats:
    """Counters of one replica (``/metrics``, ``/workers``)."""

    applied: int = 0
    #: Engine batches in the applied ``batches`` entries.
    batches: int = 0
    appended: int = 0
    append_failures: int = 0
    apply_errors: int = 0
    bootstraps: int = 0
    seeds: int = 0
    snapshots: int = 0
    takeovers: int = 0
    #: Sources given back because this replica held more than its share.
    handed_over: int = 0
    #: The log's newest entry id and length, as last seen by the keeper.
    log_last_id: str = "0-0"
    log_length: int = 0
    replicas: int = 0


class ValkeyJournal:
    """One replica's link to the shared state (module docstring): the
    :class:`~kvconductor.state.journal.Journal` of a conductor with ``--state-url``
    (:meth:`Conductor.attach_journal <kvconductor.state.conductor.Conductor.attach_journal>`),
    then :meth:`start`."""

    def __init__(
        self,
        conductor: Conductor,
        url: str,
        *,
        password: str | None = None,
        replica_id: str | None = None,
        lease_secs: float = LEASE_SECS,
        snapshot_interval: float = 60.0,
        submit_timeout: float = SUBMIT_TIMEOUT,
    ) -> None:
        self.conductor = conductor
        self.url = url
        #: The URL without its password, for log lines and answers.
        self.where = safe_url(url)
        self.id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_ms = max(300, int(lease_secs * 1000))
        self.snapshot_interval = float(snapshot_interval)
        self.submit_timeout = submit_timeout
        self.client = connect(url, password)
        self.errors = _errors()
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
        self._take_lease = self.client.register_script(_TAKE)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self._commit = self.client.register_script(_COMMIT_SNAPSHOT)
        self._seed_script = self.client.register_script(_SEED)
        self._last_check = 0.0
        self._snap_thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, wait: float = 10.0) -> None:
        """Attach to the conductor (started), bootstrap (up to ``wait`` seconds; the
        reader goes on trying after that) and start the threads."""
        self.conductor.call(self._attach)
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

    def _attach(self) -> None:
        self.conductor.subs.replicator = self

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
            entries = _pack(items)
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
                if gen is None or _text(gen) != self.gen:
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
        if _text(gen) != self.gen:
            log.warning("state store %s was seeded again by another replica", self.where)
            self._new_generation()
            return
        if trimmed is not None and snap_gen == gen and _id(self.applied_id) < _id(_text(trimmed)):
            log.warning(
                "this replica is behind the log's trim point (%s < %s): loading the snapshot",
                self.applied_id,
                _text(trimmed),
            )
            self._needs_bootstrap = True

    def _bootstrap(self) -> None:
        """Load the latest snapshot (or seed an empty store) and read the log after it."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(GEN)
        pipe.hgetall(SNAP)
        gen, meta = pipe.execute()
        self._set_up(True)
        if gen is None:
            self._seed()
            return
        gen = _text(gen)
        meta = {_text(k): _text(v) for k, v in meta.items()}
        if meta.get("gen") != gen:
            return  # the seeding replica has not written its snapshot yet
        t0 = time.monotonic()
        n = int(meta["chunks"])
        keys = [f"{SNAP_CHUNK}{meta['key']}:{i}" for i in range(n)]
        chunks = cast("list[bytes | None]", self.client.mget(keys)) if keys else []
        if any(c is None for c in chunks):
            return  # replaced meanwhile: read the new one
        data = b"".join(c for c in chunks if c is not None)
        floor = int(meta.get("floor") or 0)
        if gen != self.gen:
            self._leases.clear()  # held in another generation: not renewable here
        try:
            dump.verify([data])
            loaded = self.conductor.call(self._load, data, meta["id"], floor, timeout=None)
        except Exception as ex:
            # A snapshot never stops a start: this replica goes on from its position
            # with an empty state (the log after it still applies).
            log.error(
                "replica %s cannot load the state store's snapshot at %s (%s: %s): "
                "serving from an empty state at that position; the next snapshot another "
                "replica writes replaces it (restart this replica then), or the engines' "
                "registrations fill it again",
                self.id,
                meta["id"],
                type(ex).__name__,
                ex,
            )
            self.conductor.call(self._load_empty, meta["id"], floor, timeout=None)
            loaded = {"registrations": 0, "indexes": 0, "sources": 0, "skipped": 0}
        self.gen = gen
        self.floor = floor
        self._needs_bootstrap = False
        self.bootstrapped = True
        self.stats.bootstraps += 1
        log.info(
            "replica %s loaded the state store's snapshot at %s: registrations=%d "
            "indexes=%d sources=%d skipped=%d in %.3fs",
            self.id,
            meta["id"],
            loaded["registrations"] - loaded["skipped"],
            loaded["indexes"],
            loaded["sources"],
            loaded["skipped"],
            time.monotonic() - t0,
        )

    def _load(self, data: bytes, position: str, floor: int) -> dict[str, int]:
        """Ingest thread: replace the state by a snapshot's (queries are answered from the
        old indexes meanwhile: ``Conductor.replacing``)."""
        from kvconductor.state.snapshot import reset

        c = self.conductor
        c.replacing = dict(c.indexes) if c.shared is None else None
        try:
            reset(c)
            loaded = dump.load_dump(c, [data])
        finally:
            c.replacing = None
        self.applied_id = position
        c.subs.raise_fence_floor(floor)
        return loaded

    def _load_empty(self, position: str, floor: int) -> None:
        """Ingest thread: a snapshot that does not load: forget what it loaded, go on from
        its position."""
        from kvconductor.state.snapshot import reset

        reset(self.conductor)
        self.applied_id = position
        self.conductor.subs.raise_fence_floor(floor)

    def _new_generation(self) -> None:
        """The store holds another generation than the one this replica loaded: stop
        consuming (its sources are resumed from the cursors of the new state, by whoever
        takes their leases) and load it."""
        self._leases.clear()
        self.conductor.call(self.conductor.subs.release_all)
        self._needs_bootstrap = True

    def _seed(self) -> None:
        """The store has no generation: make this replica's state its content.

        Every source this replica consumes is released first: its owner's tracker may be
        past what the state holds (batches appended to the lost store, never applied).
        The state's cursors are the replicated ones, so whoever takes a lease next
        resumes from there with a replay, and what the engine's ring still holds is
        appended again. Owner epochs of the new generation start above every epoch
        applied here (the fence floor), so an owner of the old store still appending is
        fenced off on every replica."""
        self._leases.clear()
        floor = self.conductor.call(self._release_for_seed) + 1
        gen = uuid.uuid4().hex
        if not self._seed_script(keys=[GEN, LOG, SNAP, EPOCH], args=[gen, floor]):
            self._needs_bootstrap = True  # another replica seeds it
            return
        self.stats.seeds += 1
        self.gen = gen
        self.floor = floor
        self.conductor.call(self._reset_position, floor)
        self._write_snapshot(first=True)
        self._needs_bootstrap = False
        self.bootstrapped = True
        log.info("replica %s seeded the state store %s (generation %s)", self.id, self.where, gen)

    def _release_for_seed(self) -> int:
        """Ingest thread: stop consuming; the highest owner epoch applied here."""
        subs = self.conductor.subs
        subs.release_all()
        return max(self.floor, subs.highest_fence())

    def _reset_position(self, floor: int) -> None:
        self.applied_id = "0-0"
        self.conductor.subs.raise_fence_floor(floor)

    # -- applying the log (ingest thread) --------------------------------------------------
    def _apply_entries(self, entries: list) -> None:
        shared = self.conductor.shared
        with shared.batch() if shared is not None else nullcontext():
            for eid, fields in entries:
                eid = _text(eid)
                if _id(eid) <= _id(self.applied_id):
                    continue
                kind = _text(fields.get(b"k", b""))
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
                    fut = self._waiters.pop(_text(tag), None)
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

    def _drop_all_leases(self) -> None:
        """The store is unreachable: the leases cannot be renewed, so they will lapse;
        stop consuming now rather than append into the void."""
        for key in list(self._leases):
            self.conductor.thread.submit(self._give_up, key)

    def _keep(self) -> None:
        r = self.client
        now_ms = int(time.time() * 1000)
        pipe = r.pipeline(transaction=False)
        pipe.zadd(MEMBERS, {self.id: now_ms})
        pipe.zremrangebyscore(MEMBERS, 0, now_ms - 10 * self.lease_ms)
        pipe.zcount(MEMBERS, now_ms - 2 * self.lease_ms, "+inf")
        pipe.exists(LOG)
        pipe.get(GEN)
        _, _, live, has_log, gen = pipe.execute()
        self._set_up(True)
        self.stats.replicas = int(live)
        if gen is None or _text(gen) != self.gen or self._needs_bootstrap:
            return  # not loaded in this generation: the reader seeds or loads it first
        if has_log:
            info: dict[str, bytes | int]
            try:
                info = cast("dict[str, bytes | int]", r.xinfo_stream(LOG))
            except self.errors:
                raise
            except Exception:  # the stream vanished in between (a re-seed)
                info = {}
            self.stats.log_last_id = _text(info.get("last-generated-id", b"0-0"))
            self.stats.log_length = int(info.get("length", 0))
        states = self.conductor.call(self.conductor.subs.source_states)
        # renew what we hold; forget what is gone or lost
        for key, token in list(self._leases.items()):
            if key not in states:
                self._release(keys=[lease_key(key)], args=[token])
                self._leases.pop(key, None)
                continue
            if not self._renew(keys=[lease_key(key), GEN], args=[token, self.lease_ms, self.gen]):
                log.warning("lost the lease of %s", lease_key(key)[len(LEASE) :])
                self._leases.pop(key, None)
                self.conductor.call(self._release_local, key)
            elif not states[key]:
                # held, but the subscription was made anew (a snapshot was loaded)
                epoch = int(token.rpartition(":")[2])
                if not self.conductor.call(self._activate, key, epoch):
                    self._release(keys=[lease_key(key)], args=[token])
                    self._leases.pop(key, None)
        keys = set(states)
        share = math.ceil(len(keys) / max(1, int(live)))
        self._shed_surplus(share)
        free = [k for k in keys if k not in self._leases]
        if not free:
            self._free_rounds.clear()
            return
        pipe = r.pipeline(transaction=False)
        for k in free:
            pipe.exists(lease_key(k))
        owned_elsewhere = pipe.execute()
        for k, taken in zip(free, owned_elsewhere, strict=True):
            if taken:
                self._free_rounds.pop(k, None)
                continue
            rounds = self._free_rounds.get(k, 0) + 1
            self._free_rounds[k] = rounds
            if len(self._leases) >= share and rounds < 2:
                continue  # leave it to a replica with fewer sources
            epoch = int(
                self._take_lease(
                    keys=[GEN, lease_key(k), EPOCH], args=[self.gen, self.id, self.lease_ms]
                )
            )
            if not epoch:
                continue
            token = f"{self.id}:{epoch}"
            self._free_rounds.pop(k, None)
            self._leases[k] = token
            if not self.conductor.call(self._activate, k, epoch):
                self._release(keys=[lease_key(k)], args=[token])
                self._leases.pop(k, None)
            else:
                self.stats.takeovers += 1

    def _shed_surplus(self, share: int) -> None:
        """Holding more sources than ``share`` (sources / live replicas) for
        :data:`SHED_ROUNDS` rounds in a row: give one back, so that sources spread over
        the replicas (the first replica to see a restarted store, or the only one running
        for a while, takes them all). The next owner resumes it from the replicated
        cursor with a replay: nothing is lost in the hand-over."""
        if len(self._leases) <= share:
            self._over_share = 0
            return
        self._over_share += 1
        if self._over_share < SHED_ROUNDS:
            return
        self._over_share = 0
        key, token = next(reversed(self._leases.items()))
        self._leases.pop(key, None)
        self.conductor.call(self._release_local, key)
        self._release(keys=[lease_key(key)], args=[token])
        self.stats.handed_over += 1
        log.info(
            "%s: handed over (this replica held %d sources, its share is %d)",
            lease_key(key)[len(LEASE) :],
            len(self._leases) + 1,
            share,
        )

    def _activate(self, key: tuple[str, int, str], epoch: int) -> bool:
        import zmq

        sub = self.conductor.subs.get(*key)
        if sub is None or sub.closed:
            return False
        try:
            sub.activate(epoch)
        except (zmq.ZMQError, OSError) as ex:
            log.error("%s: cannot open the subscription: %s", sub.name(), ex)
            return False
        return True

    def _release_local(self, key: tuple[str, int, str]) -> None:
        sub = self.conductor.subs.get(*key)
        if sub is not None:
            sub.release()

    # -- snapshots -------------------------------------------------------------------------
    def _snapshot_safely(self) -> None:
        try:
            self._maybe_snapshot()
        except self.errors as ex:
            log.warning("snapshot to the state store failed: %s", ex)
        except Exception:
            log.exception("snapshot to the state store failed")

    def _maybe_snapshot(self) -> None:
        r = self.client
        last = cast("bytes | None", r.hget(SNAP, "time"))
        if last is not None and time.time() - float(last) < self.snapshot_interval:
            return
        token = f"{self.id}:{uuid.uuid4().hex[:8]}"
        if not r.set(SNAP_LOCK, token, nx=True, px=60_000):
            return
        try:
            self._write_snapshot()
        finally:
            self._release(keys=[SNAP_LOCK], args=[token])

    def _write_snapshot(self, first: bool = False) -> None:
        """Write this replica's state at its applied position as the store's snapshot and
        trim the log below the previous one (``first``: a seed, nothing to trim)."""
        t0 = time.monotonic()
        snap, position = self.conductor.call(self._take, timeout=None)
        data = b"".join(dump.encode(snap))
        sid = uuid.uuid4().hex
        pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        r = self.client
        old = cast("list[bytes | None]", r.hmget(SNAP, ["key", "chunks"]))
        pipe = r.pipeline(transaction=False)
        for i, piece in enumerate(pieces):
            pipe.set(f"{SNAP_CHUNK}{sid}:{i}", piece)
        pipe.execute()
        ok = self._commit(
            keys=[GEN, SNAP, LOG],
            args=[
                cast("str", self.gen),  # set by the seed or load before any snapshot
                position,
                sid,
                len(pieces),
                len(data),
                time.time(),
                int(first),
                self.floor,
            ],
        )
        stale = [f"{SNAP_CHUNK}{sid}:{i}" for i in range(len(pieces))] if not ok else []
        if ok and old[0] is not None:
            stale = [f"{SNAP_CHUNK}{_text(old[0])}:{i}" for i in range(int(cast(bytes, old[1])))]
        if stale:
            r.delete(*stale)
        if ok:
            self.stats.snapshots += 1
            log.info(
                "snapshot written to the state store at %s: bytes=%d in %.3fs",
                position,
                len(data),
                time.monotonic() - t0,
            )

    def _take(self) -> tuple[dump.Snapshot, str]:
        return dump.snapshot(self.conductor), self.applied_id

    # -- introspection ---------------------------------------------------------------------
    def lag_seconds(self) -> float:
        """How far the applied position is behind the newest entry the keeper saw."""
        last, mine = _id(self.stats.log_last_id), _id(self.applied_id)
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


#: Bytes of engine payloads packed into one ``batches`` entry at most.
PACK_BYTES = 1 << 20


def _pack(items: list) -> list[dict]:
    """The log entries of a writer round, in order: each HTTP/source entry as it is,
    each run of engine batches as ``batches`` entries of at most :data:`PACK_BYTES`.

    PERF: one entry per batch costs the client ~50 µs to append and every replica as
    much to read (command building and reply parsing in Python); packed, the cost per
    batch is one msgpack item."""
    out: list[dict] = []
    run: list = []
    size = 0
    for fields, _, _, item in items:
        if item is not None:
            run.append(item)
            size += len(item[5])
            if size < PACK_BYTES:
                continue
        if run:
            out.append({"k": "batches", "b": msgspec.msgpack.encode(run)})
            run, size = [], 0
        if fields is not None:
            out.append(fields)
    if run:
        out.append({"k": "batches", "b": msgspec.msgpack.encode(run)})
    return out


def _is_outcome(ex: BaseException) -> bool:
    """An exception that is the answer to a request (4xx/503), not a failure."""
    from kvconductor.state.conductor import InstanceNotRegistered, RegistrationUnavailable
    from kvconductor.state.registry import RegistrationError

    return isinstance(ex, RegistrationError | RegistrationUnavailable | InstanceNotRegistered)


#: The name before the journal seam (tests, and callers of the replica module).
Replicator = ValkeyJournal
