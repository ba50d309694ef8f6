"""A replica's state in and out of the store (``--state-url``; the module docstring of
:mod:`kvconductor.state.replica`, "Snapshots" and "The store fails"): the *bootstrap*
(load the store's latest snapshot and go on from its log position), the *seed* (an empty
store gets this replica's state as its new generation) and the periodic snapshot one
replica writes (chunked, recorded, and the log trimmed below the previous one).

:class:`ReplicaSnapshots` is a part of :class:`kvconductor.state.replica.ValkeyJournal`
(its base class): these methods run on the journal's reader (bootstrap, seed), its
snapshot thread and at its start, on the journal's own attributes, declared below.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, cast

from kvconductor.state import dump
from kvconductor.state.store import (
    CHUNK_BYTES,
    EPOCH,
    GEN,
    LOG,
    SNAP,
    SNAP_CHUNK,
    SNAP_LOCK,
    ReplicaStats,
    text,
)

if TYPE_CHECKING:
    from valkey import Valkey
    from valkey.commands.core import Script

    from kvconductor.state.conductor import Conductor

log = logging.getLogger("kvconductor.replica")

__all__ = ["ReplicaSnapshots"]


class ReplicaSnapshots:
    """Bootstrap, seed and snapshots of a :class:`~kvconductor.state.replica.ValkeyJournal`."""

    # The journal's attributes these methods use (set by ValkeyJournal.__init__).
    conductor: Conductor
    client: Valkey
    id: str
    where: str
    snapshot_interval: float
    errors: tuple[type[BaseException], ...]
    stats: ReplicaStats
    gen: str | None
    floor: int
    applied_id: str
    bootstrapped: bool
    _needs_bootstrap: bool
    _leases: dict[tuple[str, int, str], str]
    _release: Script
    _commit: Script
    _seed_script: Script

    if TYPE_CHECKING:  # the journal's methods these call

        def _set_up(self, up: bool, ex: BaseException | None = None) -> None: ...

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
        gen = text(gen)
        meta = {text(k): text(v) for k, v in meta.items()}
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
            stale = [f"{SNAP_CHUNK}{text(old[0])}:{i}" for i in range(int(cast(bytes, old[1])))]
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
