"""One prefix index per (model, tenant), over the compiled core or its twin.

:class:`Index` interns :class:`~kvconductor.keys.WorkerKey` values to the small
integer worker ids of the core and ``(instance_id, dp_rank)`` pairs to group
ids, and turns core answers into the V3 query shape.

**Threading: exactly one writer thread (the ingest thread) calls the mutating
methods; any number of threads may call** :meth:`Index.query`,
:meth:`Index.query_by_hash` **and** :meth:`Index.summary` **concurrently.**
The core serialises them with a C reader/writer lock taken without the GIL.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from xxhash import xxh3_64_intdigest

import kvconductor
from kvconductor._hash import DEFAULT_SEED
from kvconductor._py.rows import v3_body
from kvconductor.extrakeys import QueryExtras, extra_local_hashes
from kvconductor.keys import Medium, WorkerKey
from kvconductor.schema import (
    STOP_NO_WORKER,
    STOP_REASONS,
    U32_MAX,
)

# The service needs every compiled module, not only those this file names: a broken
# install fails here, at the first import of the index.
kvconductor.load_compiled()


def impl_classes(impl: str | None) -> tuple[type, type]:
    """The index core and the group name table of an implementation (``"c"``, ``"py"``;
    None: :data:`kvconductor.IMPL`): the compiled table pre-encodes each name for
    :func:`kvconductor._encode.encode_rows`; the twin's keeps names only."""
    impl = impl or kvconductor.IMPL
    if impl == "c":
        from kvconductor._encode import GroupNames
        from kvconductor._index import CoreIndex

        return CoreIndex, GroupNames
    if impl == "py":
        from kvconductor._py.index import CoreIndex as TwinCore
        from kvconductor._py.index import PyGroupNames

        return TwinCore, PyGroupNames
    raise ValueError(f"unknown index implementation {impl!r}")


def names_class(impl: str | None) -> type:
    """The group name table of an implementation (:func:`impl_classes`)."""
    return impl_classes(impl)[1]


class DpHit(NamedTuple):
    """Exclusive per-tier block counts of one (instance, DP)."""

    instance_id: str
    dp_rank: int
    npu_blocks: int
    cpu_blocks: int
    disk_blocks: int


#: The stop code of a tier on which a group has no worker (never a core code).
NO_WORKER = STOP_REASONS.index(STOP_NO_WORKER)


def tier_walks(
    rows: list[tuple[int, int, int]], placement: dict[int, tuple[int, int]]
) -> dict[int, list[tuple[int, int]]]:
    """Per group, per tier (HBM, CPU, Disk): ``(reach, stop code)`` from the core's
    :meth:`trace` rows; ``placement`` maps a worker id to ``(group, tier)``.

    A tier's reach is the farthest block the walk got to through it and the tiers before
    it (so it never goes back); its stop is the smallest code among the tier's workers
    that reach it (``NO_WORKER`` when the group has none there). The exclusive counts
    of ``match`` are the differences: ``npu = r0``, ``cpu = r1 - r0``, ``disk = r2 - r1``.
    """
    best: dict[int, list[tuple[int, int] | None]] = {}
    for w, reach, code in rows:
        g, tier = placement[w]
        cur = best.setdefault(g, [None, None, None])
        t = cur[tier]
        if t is None or reach > t[0] or (reach == t[0] and code < t[1]):
            cur[tier] = (reach, code)
    out: dict[int, list[tuple[int, int]]] = {}
    for g, tiers in best.items():
        prev = 0
        walks = []
        for t in tiers:
            if t is None:
                walks.append((prev, NO_WORKER))
            else:
                prev = max(prev, t[0])
                walks.append((prev, t[1]))
        out[g] = walks
    return out


def walk_counts(walks: list[tuple[int, int]]) -> tuple[int, int, int]:
    """``(npu, cpu, disk)`` exclusive counts of one group's :func:`tier_walks`."""
    (r0, _), (r1, _), (r2, _) = walks
    return r0, r1 - r0, r2 - r1


class WorkerTrace(NamedTuple):
    """One block holder of an explained query: blocks held on its tier, how far the walk
    reached (absolute blocks) and why it stopped (a ``STOP_*`` name)."""

    key: WorkerKey
    held: int
    reach: int
    stop: str


class GroupTrace(NamedTuple):
    """One (instance, DP) of an explained query: per tier (HBM, CPU, Disk) the exclusive
    count, the reach, the stop reason and the blocks held; and its workers."""

    instance_id: str
    dp_rank: int
    blocks: tuple[int, int, int]
    reach: tuple[int, int, int]
    stops: tuple[str, str, str]
    held: tuple[int, int, int]
    workers: list[WorkerTrace]


class QueryResult:
    """Per (instance, DP) hits of one query, in group order.

    An index's answer is backed by the core's rows (``rows``: a ``MatchRows``, group ids
    and the three exclusive counts in C arrays) and the index's group names (``names``);
    every Python form of it is built from them in C on demand (docs/api.md, "Reading an
    answer in Python"): :attr:`hits` (``DpHit`` rows, also what iterating gives),
    :meth:`to_dict` (the V3 body), and for routers :meth:`scores` (``{(instance_id,
    dp_rank): depth}``) and :meth:`tuples` (``(instance_id, dp_rank, npu, cpu, disk)``).
    The server's encoder renders the rows directly (``kvconductor.wire.encode_result``).
    ``QueryResult(hits)`` wraps a list of ``DpHit`` (tests, tools)."""

    __slots__ = ("rows", "names", "_hits")

    def __init__(
        self, hits: list[DpHit] | None = None, rows: Any = None, names: Any = None
    ) -> None:
        #: the core's rows (``MatchRows``) and the index's group names, or None
        self.rows: Any = rows
        self.names: Any = names
        self._hits: list[DpHit] | None = ([] if hits is None else hits) if rows is None else None

    @classmethod
    def of_rows(cls, rows: Any, names: Any) -> QueryResult:
        """The answer of ``rows`` (``MatchRows``) named by ``names`` (``GroupNames``)."""
        return cls(None, rows, names)

    @property
    def hits(self) -> list[DpHit]:
        """One ``DpHit`` per (instance, DP), in group order (built in C on first use)."""
        if self._hits is None:
            self._hits = self.rows.hits(self.names, DpHit)
        return self._hits

    def __iter__(self) -> Iterator[DpHit]:
        """The :attr:`hits`."""
        return iter(self.hits)

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self._hits or ())

    @property
    def omitted(self) -> int:
        """The rows tied at the ``top_k`` cut depth that the answer leaves out (0 without
        ``top_k``): the ``X-KV-Conductor-Top-K-Omitted`` header."""
        return self.rows.omitted if self.rows is not None else 0

    def scores(self) -> dict[tuple[str, int], int]:
        """``{(instance_id, dp_rank): depth}``, depth the (instance, DP)'s npu + cpu + disk
        blocks (the prefix it holds on any tier, as Dynamo's ``.scores``): a router's
        compact form, one dict built in C (the keys are the index's own tuples)."""
        if self.rows is not None:
            return self.rows.scores(self.names)
        return {(h[0], h[1]): h[2] + h[3] + h[4] for h in self.hits}

    def tuples(self) -> list[tuple[str, int, int, int, int]]:
        """``[(instance_id, dp_rank, npu_blocks, cpu_blocks, disk_blocks)]`` in group
        order, plain tuples built in C: per tier, for a router that weighs the tiers."""
        if self.rows is not None:
            return self.rows.tuples(self.names)
        return [(h[0], h[1], h[2], h[3], h[4]) for h in self.hits]

    def sums(self) -> tuple[int, int, int]:
        """``(npu, cpu, disk)`` blocks summed over the answer (C sums for array rows)."""
        if self.rows is not None:
            return self.rows.sums()
        assert self._hits is not None
        return (
            sum(h.npu_blocks for h in self._hits),
            sum(h.cpu_blocks for h in self._hits),
            sum(h.disk_blocks for h in self._hits),
        )

    def to_dict(self, tenant: str, block_size: int) -> dict[str, Any]:
        """The V3 response body ``{tenant: {instance: {...}}}``; its keys are those of
        :mod:`kvconductor.schema`'s ``InstanceMatch`` and ``DpMatch`` (built in C for
        array rows; ``block_size`` < 0 is a ValueError there)."""
        if self.rows is not None:
            return self.rows.v3(self.names, tenant, block_size)
        return v3_body(((h[0], str(h[1]), h[2], h[3], h[4]) for h in self.hits), tenant, block_size)


def result_of(rows, group_keys: Sequence[tuple[str, int]]) -> QueryResult:
    """The core's ``(group, npu, cpu, disk)`` rows named by ``group_keys`` (group id ->
    (instance_id, dp_rank)). ``IndexError`` for a group id the keys do not name."""
    return QueryResult([DpHit(group_keys[g][0], group_keys[g][1], n, c, d) for g, n, c, d in rows])


def request_seed(values: Any, typecode: str) -> int:
    """The seed of a request's rotation of ties at the ``top_k`` cut (docs/api.md, "top_k
    and instances"): XXH3-64 of its values' bytes as the wire parser reads them (token ids
    as u32, block hashes as u64: ``typecode``), a sequence of ints packed that way first
    (a buffer is hashed as it is).
    Two requests that differ anywhere get unrelated rotations; the same request, the
    same rows."""
    try:
        return xxh3_64_intdigest(values)
    except TypeError:  # not a buffer: ints, truncated as the wire parser truncates them
        mask = U32_MAX if typecode == "I" else (1 << 64) - 1
        return xxh3_64_intdigest(array(typecode, [int(v) & mask for v in values]))


def select_answer(
    rows: Any,
    names: Any,
    top_k: int | None,
    instances: Sequence[str] | None,
    values: Any = (),
    typecode: str = "Q",
) -> QueryResult:
    """The answer of ``rows`` named by ``names``, cut to the ``instances`` named (when
    given) and then to at most ``top_k`` rows, the deepest; ties at the k-th depth broken
    by the order of ``instances``, else by a rotation seeded from the request's
    ``values`` (:func:`request_seed`; docs/api.md, "top_k and instances"). The answer's
    :attr:`QueryResult.omitted` counts the tied rows left out. ``ValueError`` for
    ``top_k`` < 1."""
    if instances is not None:
        rows = rows.select(top_k, None, 0, names.instances_rank(instances))
    elif top_k is not None:
        if top_k < len(rows):
            rows = rows.select(top_k, None, request_seed(values, typecode))
        else:
            rows = rows.select(top_k)
    return QueryResult(None, rows, names)


class Index:
    """The index of one (model, tenant): HBM tree, CPU and Disk tiers, two-phase state."""

    def __init__(self, model: str, tenant: str, *, impl: str | None = None) -> None:
        self.model = model
        self.tenant = tenant
        core_class, names = impl_classes(impl)
        self.core = core_class()
        self._workers: dict[WorkerKey, int] = {}
        self._worker_keys: list[WorkerKey] = []
        self._groups: dict[tuple[str, int], int] = {}
        #: group id -> (instance_id, dp_rank), named once, pre-encoded for the answers
        self.names = names()
        self._group_keys: list[tuple[str, int]] = self.names.keys
        #: (instance_id, dp_rank) -> its WorkerKeys, in creation order
        self._group_workers: dict[tuple[str, int], list[WorkerKey]] = {}
        #: Called (writer thread) after a new group id was named, before any block of it
        #: is stored: ``--workers N`` publishes the names there (kvconductor.state.shared).
        self.on_new_group: Callable[[], None] | None = None
        #: (instance_id, dp_rank) -> its live predictions (``kvconductor.predict``; writer
        #: thread), and what an event of one of those groups is reported to:
        #: ``on_group_write(index, key, stored)`` (a store, else a removal or clear).
        self.predicted: dict[tuple[str, int], Any] = {}
        self.on_group_write: Callable[[Index, WorkerKey, bool], None] | None = None

    # -- interning ---------------------------------------------------------------
    def worker_id(self, key: WorkerKey) -> int:
        """The core's id of ``key``, created on first use (writer thread only)."""
        wid = self._workers.get(key)
        if wid is None:
            new_group = False
            g = (key.instance_id, key.dp_rank)
            gid = self._groups.get(g)
            if gid is None:
                gid = self.names.add(*g)
                self._groups[g] = gid
                new_group = True
            wid = len(self._worker_keys)
            self.core.set_worker(wid, gid, Medium(key.medium).tier)
            self._worker_keys.append(key)
            self._workers[key] = wid
            self._group_workers.setdefault(g, []).append(key)
            if new_group and self.on_new_group is not None:
                self.on_new_group()
        return wid

    @property
    def worker_keys(self) -> Sequence[WorkerKey]:
        """Every WorkerKey known, by the core's worker id (read it on the writer thread:
        a dump)."""
        return self._worker_keys

    @property
    def group_keys(self) -> Sequence[tuple[str, int]]:
        """(instance_id, dp_rank) by the core's group id (``--workers N``' directory)."""
        return self._group_keys

    def workers_of(self, instance_id: str, dp_rank: int | None = None) -> list[WorkerKey]:
        """Every known WorkerKey of an instance (optionally of one DP)."""
        if dp_rank is not None:
            return list(self._group_workers.get((instance_id, dp_rank), ()))
        return [
            k
            for k in self._worker_keys
            if k.instance_id == instance_id and (dp_rank is None or k.dp_rank == dp_rank)
        ]

    # -- direct mutations (HBM events and the HTTP /events path) -------------------
    def store(
        self,
        key: WorkerKey,
        parent: int | None,
        engine_hashes: Sequence[int],
        local_hashes: Sequence[int],
    ) -> int:
        """Store a chain of blocks for ``key`` under ``parent`` (or the root)."""
        n = self.core.store(self.worker_id(key), parent, engine_hashes, local_hashes)
        if self.predicted:
            self.note_write(key, True)
        return n

    def store_tokens(
        self,
        key: WorkerKey,
        parent: int | None,
        engine_hashes: Sequence[int],
        tokens,
        block_size: int,
        seed: int = DEFAULT_SEED,
    ) -> int:
        """Like :meth:`store`, hashing ``tokens`` (u32 buffer or ints) in C."""
        n = self.core.store_tokens(
            self.worker_id(key), parent, engine_hashes, tokens, block_size, seed
        )
        if self.predicted:
            self.note_write(key, True)
        return n

    def remove(self, key: WorkerKey, engine_hashes: Sequence[int]) -> int:
        """Remove blocks of ``key`` directly (no two-phase rule)."""
        wid = self._workers.get(key)
        if self.predicted:
            self.note_write(key, False)
        return 0 if wid is None else self.core.remove(wid, engine_hashes)

    def worker_blocks(self, key: WorkerKey) -> int:
        """Blocks ``key`` holds on its tier."""
        wid = self._workers.get(key)
        return 0 if wid is None else self.core.worker_blocks(wid)

    def worker_hashes(self, key: WorkerKey) -> array:
        """The engine hashes ``key`` holds on its tier (``array('Q')``, any order)."""
        wid = self._workers.get(key)
        return array("Q") if wid is None else self.core.worker_hashes(wid)

    def parent_of(self, key: WorkerKey, h: int) -> int | None:
        """Parent engine hash of ``key``'s block ``h`` (None: a root, or the parent is no
        longer held). Raises ``KeyError`` when ``key`` does not hold ``h``."""
        wid = self._workers.get(key)
        if wid is None:
            raise KeyError(h)
        return self.core.parent_of(wid, h)

    def block_of(self, key: WorkerKey, h: int) -> tuple[int | None, int]:
        """``(parent, local)`` of ``key``'s block ``h`` (:meth:`parent_of` and the block's
        local hash). Raises ``KeyError`` when ``key`` does not hold ``h``."""
        wid = self._workers.get(key)
        if wid is None:
            raise KeyError(h)
        return self.core.block_of(wid, h)

    def set_muted(self, key: WorkerKey, muted: bool) -> bool:
        """Mute or unmute ``key`` (its blocks stay and take updates; a muted worker gives
        no hits). False when ``key`` holds nothing here yet (nothing to mute)."""
        wid = self._workers.get(key)
        if wid is None:
            return False
        self.core.set_muted(wid, muted)
        return True

    def is_muted(self, key: WorkerKey) -> bool:
        wid = self._workers.get(key)
        return wid is not None and self.core.is_muted(wid)

    def clear(self, key: WorkerKey) -> int:
        """Drop every block and pending wait of ``key``."""
        wid = self._workers.get(key)
        if self.predicted:
            self.note_write(key, False)
        return 0 if wid is None else self.core.clear(wid)

    def remove_dp(self, instance_id: str, dp_rank: int) -> int:
        """Drop everything of (instance, DP) on every medium (unregister)."""
        return sum(self.clear(k) for k in self.workers_of(instance_id, dp_rank))

    def note_write(self, key: WorkerKey, stored: bool) -> None:
        """An event of ``key`` changed this index (``stored``: a store, else a removal or
        clear): its group's predictions are told (the mutations here call it; so does the
        compiled ingest path, which writes the core itself)."""
        hook = self.on_group_write
        if hook is not None and (key.instance_id, key.dp_rank) in self.predicted:
            hook(self, key, stored)

    # -- two-phase offload / pool join ---------------------------------------------
    def offload(
        self,
        engine_hashes: Sequence[int],
        local_hashes: Sequence[int],
        parent: int | None,
        now: float | None = None,
    ) -> int:
        """Phase 1: an engine moved blocks to CPU/Disk; wait for the pool's word."""
        return self.core.offload(
            engine_hashes, local_hashes, parent, time.monotonic() if now is None else now
        )

    def pool_store(
        self, key: WorkerKey, engine_hashes: Sequence[int], now: float | None = None
    ) -> tuple[int, int]:
        """Phase 2: the pool confirms it holds ``engine_hashes`` for ``key``."""
        return self.core.pool_store(
            self.worker_id(key), engine_hashes, time.monotonic() if now is None else now
        )

    def evict(self, key: WorkerKey, engine_hashes: Sequence[int]) -> int:
        """Removal with the two-phase rule (engine BlockRemoved, pool removed)."""
        if self.predicted:
            self.note_write(key, False)
        return self.core.evict(self.worker_id(key), engine_hashes)

    # -- queries ---------------------------------------------------------------------
    def query(
        self,
        tokens,
        block_size: int,
        seed: int = DEFAULT_SEED,
        *,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
    ) -> QueryResult:
        """Match token ids (u32 buffer or ints) hashed with ``block_size``; optionally only
        the named ``instances`` and the ``top_k`` deepest (instance, DP) rows."""
        rows = self.core.match_tokens_rows(tokens, block_size, seed)
        if top_k is None and instances is None:  # PERF: the plain V3 query
            return QueryResult(None, rows, self.names)
        return select_answer(rows, self.names, top_k, instances, tokens, "I")

    def query_by_hash(
        self,
        local_hashes: Sequence[int],
        *,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
    ) -> QueryResult:
        """Match precomputed LocalBlockHashes (``top_k`` and ``instances``: :meth:`query`)."""
        rows = self.core.match_rows(local_hashes)
        if top_k is None and instances is None:  # PERF: the plain V3 query
            return QueryResult(None, rows, self.names)
        return select_answer(rows, self.names, top_k, instances, local_hashes)

    def trace(
        self, tokens, block_size: int, seed: int = DEFAULT_SEED, extras: QueryExtras | None = None
    ) -> list[GroupTrace]:
        """Why each (instance, DP) holding workers in this index matches what it does
        (``POST /explain``), in group order; its ``blocks`` equal :meth:`query`'s (with the
        query's ``extras``: its blocks' extra keys, docs/api.md "Extra keys")."""
        if extras is None:
            rows = self.core.trace_tokens(tokens, block_size, seed)
        else:
            rows = self.core.trace(extra_local_hashes(tokens, block_size, seed, extras, False))
        keys = self._worker_keys
        placement = {
            w: (self._groups[(keys[w].instance_id, keys[w].dp_rank)], Medium(keys[w].medium).tier)
            for w, _, _ in rows
        }
        walks = tier_walks(rows, placement)
        per_group: dict[int, list[WorkerTrace]] = {}
        held_by: dict[int, list[int]] = {}
        for w, reach, code in rows:
            g, tier = placement[w]
            n = self.core.worker_blocks(w)
            held = held_by.setdefault(g, [0, 0, 0])
            held[tier] += n
            per_group.setdefault(g, []).append(WorkerTrace(keys[w], n, reach, STOP_REASONS[code]))
        out = []
        for g in sorted(walks):
            iid, dp = self._group_keys[g]
            wk = walks[g]
            out.append(
                GroupTrace(
                    iid,
                    dp,
                    walk_counts(wk),
                    (wk[0][0], wk[1][0], wk[2][0]),
                    (STOP_REASONS[wk[0][1]], STOP_REASONS[wk[1][1]], STOP_REASONS[wk[2][1]]),
                    (held_by[g][0], held_by[g][1], held_by[g][2]),
                    per_group[g],
                )
            )
        return out

    def close(self) -> None:
        """Free the core's state now (writer thread; ``--workers N`` drops an index this
        way once the directory no longer lists it). The twin has nothing to free."""
        self.core.close()

    # -- maintenance and introspection ------------------------------------------------
    def maintenance(
        self,
        now: float | None = None,
        pending_ttl: float = 60.0,
        content_ttl: float = 300.0,
        offload_ttl: float = 600.0,
    ) -> int:
        """TTL sweeps of the two-phase state plus the HBM empty-node sweep."""
        return self.core.sweep(
            time.monotonic() if now is None else now, pending_ttl, content_ttl, offload_ttl
        )

    def sizes(self) -> dict[str, int]:
        """The core's counters (``nodes``, ``hbm_pairs``, ``cpu_blocks``, ``disk_blocks``,
        ``offload``, ``content``, ``pending``, ``nbytes``): one read lock, no walk. Any
        thread (the ``/metrics`` scrape)."""
        return self.core.stats()

    def is_empty(self) -> bool:
        """No blocks in any tier and no two-phase entries."""
        s = self.core.stats()
        return not (
            s["hbm_pairs"]
            or s["cpu_blocks"]
            or s["disk_blocks"]
            or s["offload"]
            or s["content"]
            or s["pending"]
        )

    def summary(self) -> dict[str, Any]:
        """Counts for ``/workers``: workers, blocks per tier, two-phase sizes."""
        s = self.core.stats()
        holding = [k for k, w in self._workers.items() if self.core.worker_blocks(w)]
        return {
            "model_name": self.model,
            "tenant_id": self.tenant,
            "worker_count": len(holding),
            "total_blocks": s["hbm_pairs"] + s["cpu_blocks"] + s["disk_blocks"],
            "hbm_blocks": s["hbm_pairs"],
            "cpu_blocks": s["cpu_blocks"],
            "disk_blocks": s["disk_blocks"],
            "hbm_nodes": s["nodes"],
            "offload": s["offload"],
            "pending_pool": s["pending"],
            "content": s["content"],
            "bytes": s["nbytes"],
        }
