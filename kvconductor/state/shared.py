"""One index in shared memory for ``kv-conductor --workers N`` (docs/design.md, "Several
worker processes, one index").

The owner process keeps the :class:`~kvconductor.state.conductor.Conductor` and its ingest thread,
the only writer. With :class:`SharedIndexes` installed, every structure the ingest thread
allocates for an index comes from an :class:`~kvconductor._arena.Arena` (a ``memfd``
mapped at one fixed address in every process), and every write to an index also takes
the cross-process :class:`~kvconductor._shlock.SharedLock`. Worker processes map both
(:class:`SharedView`) and answer ``/query`` and ``/query_by_hash`` from the owner's
structures, without copying them.

What a worker needs besides the structures is small and changes rarely: which
(model, tenant) indexes exist and where their state is, each index's group id ->
(instance, DP) names, the registered block sizes and the LoRA seeds seen (for the miss
warnings). The owner publishes them as one MessagePack *directory* in the arena, with a
generation number, each time one of them changes (ingest thread, under the shared
write lock). A worker's index handles carry the generation they were built from and
check it inside every read section: a handle whose directory is no longer current
raises :class:`~kvconductor._index.StaleIndexError` instead of touching memory the
owner may have freed, and the worker reloads the directory and asks again.

**Threading: the owner calls** :meth:`SharedIndexes.install` **and**
:meth:`SharedIndexes.publish` **on the ingest thread only; a** :class:`SharedView` **is
used by any number of threads of a worker.**
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import msgspec

from kvconductor import _index
from kvconductor._arena import OPAQUE_OFFSET, Arena
from kvconductor._shlock import SharedLock
from kvconductor.index import QueryResult, names_class, select_answer
from kvconductor.ingest.freshness import FreshnessTable, FreshnessUnavailable, from_document
from kvconductor.schema import FreshnessDocument

if TYPE_CHECKING:
    from kvconductor.index import Index

log = logging.getLogger("kvconductor")

#: The directory header at the start of the arena's opaque area: magic, generation,
#: address and length of the MessagePack directory.
_HEADER = struct.Struct("<QQQQ")
DIR_MAGIC = 0x6B76636469723031  # "kvcdir01"
#: Seconds a worker answers ``"freshness"`` queries from one read of its owner's states.
FRESHNESS_TTL = 0.25
#: How often a query retries after its directory went stale under it.
STALE_RETRIES = 16
#: Longest the ingest thread holds the shared write section over a drain of messages
#: (:class:`WriteBatch`); readers wait at most this plus one write.
WRITE_BATCH_SECS = 0.001


class Directory(msgspec.Struct, array_like=True):
    """What a worker needs besides the structures (published by the owner)."""

    #: [model, tenant, state address, [[instance_id, dp_rank], ...] by group id]
    indexes: list[tuple[str, str, int, list[tuple[str, int]]]]
    #: [model, tenant, registered block sizes]
    block_sizes: list[tuple[str, str, list[int]]]
    #: [model, tenant, LoRA hash seeds seen]
    lora_seeds: list[tuple[str, str, list[int]]]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Directory)


class DirectorySource(Protocol):
    """What the directory is made of (the owner's conductor; ingest thread)."""

    @property
    def indexes(self) -> Mapping[tuple[str, str], Index]: ...
    @property
    def block_sizes(self) -> Mapping[tuple[str, str], frozenset[int]]: ...
    @property
    def lora_seeds(self) -> Mapping[tuple[str, str], frozenset[int]]: ...


def directory_of(conductor: DirectorySource) -> Directory:
    """The directory of ``conductor``'s current state (ingest thread)."""
    return Directory(
        indexes=[
            (m, t, idx.core.address(), list(idx.group_keys))
            for (m, t), idx in conductor.indexes.items()
        ],
        block_sizes=[(m, t, sorted(s)) for (m, t), s in conductor.block_sizes.items()],
        lora_seeds=[(m, t, sorted(s)) for (m, t), s in conductor.lora_seeds.items()],
    )


class SharedIndexes:
    """The owner's side: the arena, the shared lock and the directory."""

    def __init__(self, arena: Arena | None = None, lock: SharedLock | None = None) -> None:
        self.arena = arena if arena is not None else Arena()
        self.lock = lock if lock is not None else SharedLock()
        self.header_address = self.arena.address + OPAQUE_OFFSET
        #: Generation of the last published directory (0: none yet).
        self.generation = 0
        self.publishes = 0
        self._blob = 0
        self.arena.write(self.header_address, _HEADER.pack(DIR_MAGIC, 0, 0, 0))

    def fds(self) -> list[int]:
        """The file descriptors a worker inherits: arena, then lock."""
        return [self.arena.fileno(), self.lock.fileno()]

    def install(self) -> None:
        """Route the calling thread's index allocations to the arena (ingest thread)."""
        _index.install_shared(self.arena, self.lock)

    def close(self) -> None:
        """End shared mode and unmap the arena (after the conductor stopped: it frees
        its shared indexes then). No shared index may be used afterwards."""
        _index.install_shared(None, None)
        self.arena.close()

    def publish(self, conductor: DirectorySource) -> int:
        """Write ``conductor``'s directory and bump the generation (ingest thread);
        returns the new generation."""
        doc = _encoder.encode(directory_of(conductor))
        addr = self.arena.malloc(max(1, len(doc)))
        if addr == 0:
            raise MemoryError("shared arena: no room for the directory")
        self.arena.write(addr, doc)
        old = self._blob
        with self.writing():
            self.generation += 1
            self.arena.write(
                self.header_address, _HEADER.pack(DIR_MAGIC, self.generation, addr, len(doc))
            )
        # no reader can still be inside the old blob: readers copy it under the read lock
        if old:
            self.arena.free(old)
        self._blob = addr
        self.publishes += 1
        return self.generation

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The shared write section (ingest thread); index writes inside nest in it."""
        _index.shared_write_enter()
        try:
            yield
        finally:
            _index.shared_write_exit()

    def batch(self) -> WriteBatch:
        """A write section over several writes that lets readers in every
        :data:`WRITE_BATCH_SECS` (ingest thread; see :class:`WriteBatch`)."""
        return WriteBatch()

    def reclaim_dead(self) -> int:
        """Clear the reader slots of dead processes (after a worker died)."""
        return self.lock.reclaim_dead()

    def set_stall_policy(self, stall_ms: int, kill: bool = True) -> None:
        """A reader inside ``stall_ms`` after the ingest thread started waiting for it is
        stalled: the other readers go on, and with ``kill`` the writer SIGKILLs it (a
        worker: a child of this process). 0: wait for readers without bound."""
        self.lock.set_stall_policy(stall_ms, kill)

    def stats(self) -> dict[str, int]:
        """Arena counters plus the directory generation and lock counters."""
        out = dict(self.arena.stats())
        out["generation"] = self.generation
        lk = self.lock.stats()
        out["reclaimed_reader_slots"] = int(lk.get("reclaimed", 0))
        out["writer_waits"] = int(lk.get("writer_waits", 0))
        out["stalled_readers"] = int(lk.get("stalls", 0))
        out["readers_killed"] = int(lk.get("kills", 0))
        return out

    def wait_histogram(self) -> dict[str, object]:
        """How long the ingest thread's write sections waited for worker queries inside
        (:meth:`~kvconductor._shlock.SharedLock.wait_histogram`)."""
        return self.lock.wait_histogram()


class WriteBatch:
    """Several index writes under ONE shared write section (ingest thread): the writer
    waits for the readers inside once, not once per ZeroMQ message. :meth:`tick` after
    each write leaves and enters again once the section has lasted
    :data:`WRITE_BATCH_SECS`, so a long drain never shuts readers out for longer."""

    __slots__ = ("t0", "inside")

    def __init__(self) -> None:
        self.t0 = 0.0
        self.inside = False

    def __enter__(self) -> None:
        _index.shared_write_enter()
        self.inside = True
        self.t0 = time.perf_counter()

    def tick(self) -> None:
        if time.perf_counter() - self.t0 >= WRITE_BATCH_SECS:
            _index.shared_write_exit()
            self.inside = False
            _index.shared_write_enter()
            self.inside = True
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.inside:
            self.inside = False
            _index.shared_write_exit()


class GroupNames(Protocol):
    """An index's group id -> (instance, DP) name table (:func:`kvconductor.index.
    names_class`)."""

    @property
    def keys(self) -> list[tuple[str, int]]: ...
    def __len__(self) -> int: ...
    def add(self, instance_id: str, dp_rank: int) -> object: ...


@dataclass(slots=True, eq=False)
class ViewIndex:
    """A worker's read-only index of one (model, tenant): the owner's structures through
    an attached :class:`~kvconductor._index.CoreIndex` handle, and the group names of
    the directory it was built from (pre-encoded once in ``names``, carried over from
    ``previous``, the names of the previous directory, when it only grew). Same query API
    as :class:`~kvconductor.index.Index`."""

    view: SharedView
    model: str
    tenant: str
    core: _index.CoreIndex
    #: (instance_id, dp_rank) by group id, as the directory names them.
    group_keys: list[tuple[str, int]]
    previous: InitVar[GroupNames | None] = None
    names: GroupNames = field(init=False)

    def __post_init__(self, previous: GroupNames | None) -> None:
        groups, names = self.group_keys, previous
        if names is None or names.keys != groups[: len(names)]:
            names = cast(GroupNames, names_class(None)())
        for g in groups[len(names) :]:
            names.add(*g)
        self.names = names

    def _run(
        self,
        fn: Callable[[_index.CoreIndex], _index.MatchRows],
        top_k: int | None,
        instances: Sequence[str] | None,
        values: object = (),
        typecode: str = "Q",
    ) -> QueryResult:
        idx: ViewIndex | None = self
        for _ in range(STALE_RETRIES):
            if idx is None:
                return QueryResult([])  # dropped meanwhile: nothing holds it any more
            try:
                rows = fn(idx.core)
                if len(rows) and rows.last_group() >= len(idx.names):
                    # a group named after this directory was read: reload it
                    raise IndexError(rows.last_group())
                return select_answer(rows, idx.names, top_k, instances, values, typecode)
            except (_index.StaleIndexError, IndexError):
                idx = self.view.reload().get((self.model, self.tenant))
        raise RuntimeError("the shared directory kept changing during a query")

    def query(
        self,
        tokens: Sequence[int],
        block_size: int,
        seed: int,
        *,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
    ) -> QueryResult:
        return self._run(
            lambda core: core.match_tokens_rows(tokens, block_size, seed),
            top_k,
            instances,
            tokens,
            "I",
        )

    def query_by_hash(
        self,
        local_hashes: Sequence[int],
        *,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
    ) -> QueryResult:
        return self._run(lambda core: core.match_rows(local_hashes), top_k, instances, local_hashes)


def _same_core(idx: ViewIndex, address: int) -> bool:
    try:
        return bool(idx.core.address() == address)
    except _index.IndexClosedError:
        return False


class SharedView:
    """A worker's view of the owner's indexes: the parts of
    :class:`~kvconductor.state.conductor.Conductor` the query resources read (``get_index``,
    ``block_sizes``, ``lora_seeds``, ``executor``, ``freshness``). Any thread.

    ``freshness_source``: reads the owner's ``GET /freshness`` document of a (model,
    tenant) (:class:`kvconductor.serve.proxy.OwnerFreshness`; None: no freshness here).
    A worker keeps each document :data:`FRESHNESS_TTL` seconds: its states are at most
    that old, and its ages count from the newest event the owner had then (so they can be
    that much too old, never too young). An owner that did not answer is asked again
    after the same time (meanwhile such queries get the same 503 at once)."""

    def __init__(self, arena: Arena, lock: SharedLock, *, query_threads: int = 2) -> None:
        self.arena = arena
        self.lock = lock
        self.header_address = self.arena.address + OPAQUE_OFFSET
        self.query_threads = query_threads
        self.generation = -1
        self.reloads = 0
        self.indexes: dict[tuple[str, str], ViewIndex] = {}
        self.block_sizes: dict[tuple[str, str], frozenset[int]] = {}
        self.lora_seeds: dict[tuple[str, str], frozenset[int]] = {}
        self._mutex = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.freshness_source: Callable[[str, str], FreshnessDocument] | None = None
        self._fresh: dict[tuple[str, str], tuple[float, FreshnessTable | Exception]] = {}
        magic = _HEADER.unpack(self.arena.read(self.header_address, _HEADER.size))[0]
        if magic != DIR_MAGIC:
            raise RuntimeError("the shared arena holds no kv-conductor directory")
        self.reload()

    @classmethod
    def attach(cls, arena_fd: int, lock_fd: int, *, query_threads: int = 2) -> SharedView:
        """Map the owner's arena (at its fixed address) and lock from inherited fds."""
        return cls(Arena.attach(arena_fd), SharedLock.attach(lock_fd), query_threads=query_threads)

    def current_generation(self) -> int:
        """The generation the owner last published (one 8-byte read)."""
        return int.from_bytes(self.arena.read(self.header_address + 8, 8), "little")

    def reload(self) -> dict[tuple[str, str], ViewIndex]:
        """Read the directory again if it changed; returns the indexes."""
        with self._mutex:
            # header and blob copied in one read section without the GIL: no thread of a
            # worker waits for the GIL inside a section (the writer would wait for it)
            (_, gen, _, _), blob = self.arena.read_record(self.lock, self.header_address)
            if gen == self.generation:
                return self.indexes
            doc = _decoder.decode(blob) if blob else Directory([], [], [])
            gen_addr = self.header_address + 8
            indexes = {}
            for m, t, state, groups in doc.indexes:
                core = _index.attach_core(state, self.lock, gen_addr, gen)
                old = self.indexes.get((m, t))
                # the names of an index that only grew are kept (group ids only append)
                names = old.names if old is not None and _same_core(old, state) else None
                indexes[(m, t)] = ViewIndex(self, m, t, core, [(i, d) for i, d in groups], names)
            self.indexes = indexes
            self.block_sizes = {(m, t): frozenset(s) for m, t, s in doc.block_sizes}
            self.lora_seeds = {(m, t): frozenset(s) for m, t, s in doc.lora_seeds}
            self.generation = gen
            self.reloads += 1
            return indexes

    def get_index(self, model: str, tenant: str) -> ViewIndex | None:
        """The index of (model, tenant), or None (query: 404)."""
        if self.current_generation() != self.generation:
            self.reload()
        return self.indexes.get((model, tenant))

    def freshness(self, model: str, tenant: str) -> FreshnessTable | None:
        """The owner's states behind (model, tenant)'s answers, at most
        :data:`FRESHNESS_TTL` seconds old (class doc); None without a source.
        :class:`~kvconductor.ingest.freshness.FreshnessUnavailable` when the owner
        cannot be read."""
        source = self.freshness_source
        if source is None:
            return None
        now = time.monotonic()
        hit = self._fresh.get((model, tenant))
        if hit is not None and now - hit[0] < FRESHNESS_TTL:
            if isinstance(hit[1], Exception):
                raise hit[1]  # an owner that did not answer is asked again only then
            return hit[1]
        if len(self._fresh) > 4096:
            self._fresh.clear()
        try:
            table = from_document(source(model, tenant))
        except FreshnessUnavailable as ex:
            self._fresh[model, tenant] = (now, ex)
            raise
        self._fresh[model, tenant] = (now, table)
        return table

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for large queries (created on first use)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, self.query_threads), thread_name_prefix="kv-query"
            )
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
