"""The index core of one (model, tenant): pure-Python twin of ``kvconductor._index.CoreIndex``.

Semantics: ``docs/design.md``, sections "CoreIndex: two-phase state",
"CoreIndex: query" and "Core API". Everything is ints: worker ids and group ids
are small non-negative ints given out by :class:`kvconductor.index.Index`,
hashes are u64.

**Threading: exactly one writer thread (the ingest thread) calls the mutating
methods** (``set_worker``, ``store``, ``store_tokens``, ``remove``, ``clear``,
``offload``, ``pool_store``, ``evict``, ``sweep``); **any number of threads may
call** ``match``, ``match_tokens``, ``worker_blocks`` **and** ``stats``
**concurrently.** Every public method holds one :class:`threading.Lock` for its
whole duration, so each call sees and leaves a consistent state of all tiers and
of the two-phase maps.
"""

from __future__ import annotations

import threading

from kvconductor._hash import hash_blocks
from kvconductor._py.lower import LowerTier
from kvconductor._py.rows import MatchRows, PyGroupNames, mix64  # noqa: F401 (also here)
from kvconductor._py.tree import RadixTree, u64_list, u64_or_none
from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound
from kvconductor.schema import STOP_REASONS

HBM, CPU, DISK = 0, 1, 2
#: Stop codes of :meth:`CoreIndex.trace`: a reason's code is its position in the schema's
#: ``STOP_REASONS`` (end_of_prompt, parent_mismatch, not_held, no_first_block,
#: tier_exhausted, muted; the last, no_worker, is never a core code).
END, MISMATCH, NOT_HELD, NO_FIRST, EXHAUSTED, MUTED, _NO_WORKER = range(len(STOP_REASONS))


def _walk_starts(
    tier: LowerTier, hs: list[int], upstream, group, muted
) -> list[tuple[int, int, int | None]]:
    """Where a lower tier's walks start (match and trace alike): the unmuted owners of a
    root edge of the first block, then, after each upstream breakpoint ``(group, end,
    last)`` short of the end, the unmuted owners of the edge ``last -> hs[end]`` in that
    same group only (no cross-DP borrowing; the reference borrowed)."""
    n = len(hs)
    starts: list[tuple[int, int, int | None]] = (
        [(w, 0, None) for w in tier.owners(None, hs[0]) if w not in muted] if n else []
    )
    for g, end, last in upstream:
        if end < n:
            starts += [
                (w, end, last)
                for w in tier.owners(last, hs[end])
                if group(w) == g and w not in muted
            ]
    return starts


class CoreIndex:
    """HBM tree + CPU and Disk tiers + two-phase offload/pool state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tree = RadixTree()
        self._tiers = {CPU: LowerTier(), DISK: LowerTier()}
        #: worker -> (group, tier)
        self._workers: dict[int, tuple[int, int]] = {}
        #: muted workers: no hits, no breakpoints (``set_muted``)
        self._muted: set[int] = set()
        #: engine hash -> (local, parent, time): Phase-1 offloads awaiting the pool
        self._offload: dict[int, tuple[int, int | None, float]] = {}
        #: engine hash -> (local, parent, time): retained after the first confirmation
        self._content: dict[int, tuple[int, int | None, float]] = {}
        #: engine hash -> {worker: time of first insert}: pool confirmations awaiting Phase 1
        self._pending: dict[int, dict[int, float]] = {}

    # -- internals (caller holds the lock) ---------------------------------------------
    def _tier_of(self, worker: int) -> int:
        return self._workers[worker][1]

    def _group_of(self, worker: int) -> int:
        return self._workers[worker][0]

    def _store(self, worker: int, parent, ehashes, locs) -> int:
        tier = self._tier_of(worker)
        if tier == HBM:
            return self._tree.store(worker, parent, ehashes, locs)
        return self._tiers[tier].store(worker, parent, ehashes, locs)

    def _remove(self, worker: int, hashes) -> int:
        tier = self._tier_of(worker)
        if tier == HBM:
            return self._tree.remove(worker, hashes)
        return self._tiers[tier].remove(worker, hashes)

    def _apply(self, worker: int, parent: int | None, h: int, local: int) -> int:
        """store(w, p, [h], [t]) on the worker's tier; HBM chain errors swallowed (0)."""
        try:
            return self._store(worker, parent, [h], [local])
        except (ParentBlockNotFound, InvalidBlockSequence):
            return 0

    def _hbm_hits(self, hs: list[int]) -> list[tuple[int, int, int]]:
        """The HBM tree's ``(worker, depth, last engine hash)`` of ``hs``, muted workers left
        out (match and trace alike)."""
        return [hit for hit in self._tree.match(hs) if hit[0] not in self._muted]

    def _match(self, hs: list[int]) -> list[tuple[int, int, int, int]]:
        n = len(hs)
        if n == 0:
            return []
        group = self._group_of
        npu_end: dict[int, int] = {}
        cpu_end: dict[int, int] = {}
        disk_end: dict[int, int] = {}

        # 1. HBM breakpoints (group, end, last)
        hbm_bps = []
        muted = self._muted
        for w, depth, last in self._hbm_hits(hs):
            g = group(w)
            hbm_bps.append((g, depth, last))
            npu_end[g] = max(npu_end.get(g, 0), depth)

        def lower(tier: LowerTier, upstream, ends: dict[int, int]):
            """Root walks plus same-group continuations from ``upstream`` breakpoints."""
            found = []
            for w, start, parent in _walk_starts(tier, hs, upstream, group, muted):
                count, last_ehash = tier.walk(w, hs, start, parent)
                if count > 0:
                    g = group(w)
                    found.append((g, start + count, last_ehash))
                    ends[g] = max(ends.get(g, 0), start + count)
            return found

        # 2. CPU from the root and from HBM breakpoints of the same group
        cpu_bps = lower(self._tiers[CPU], hbm_bps, cpu_end)
        # 3. Disk from the root and from every HBM and CPU breakpoint of the same group
        lower(self._tiers[DISK], hbm_bps + cpu_bps, disk_end)

        # 4. exclusive partition per group
        out = []
        for g in sorted(set(npu_end) | set(cpu_end) | set(disk_end)):
            ne, ce, de = npu_end.get(g, 0), cpu_end.get(g, 0), disk_end.get(g, 0)
            npu = ne
            cpu = max(0, ce - ne)
            disk = max(0, de - max(ne, ce))
            if npu + cpu + disk > 0:
                out.append((g, npu, cpu, disk))
        return out

    # -- workers -------------------------------------------------------------------------
    def set_worker(self, worker: int, group: int, tier: int) -> None:
        """Declare ``worker``'s group and tier (0 HBM, 1 CPU, 2 DISK) before its first use."""
        if tier not in (HBM, CPU, DISK):
            raise ValueError(f"tier must be 0, 1 or 2, not {tier!r}")
        if worker < 0 or group < 0:
            raise OverflowError("worker and group ids are non-negative")
        with self._lock:
            self._workers[worker] = (group, tier)

    def set_muted(self, worker: int, muted: bool) -> None:
        """A muted worker keeps its blocks and updates but gives no hits in ``match``."""
        with self._lock:
            self._tier_of(worker)
            if muted:
                self._muted.add(worker)
            else:
                self._muted.discard(worker)

    def is_muted(self, worker: int) -> bool:
        with self._lock:
            self._tier_of(worker)
            return worker in self._muted

    # -- direct mutations ------------------------------------------------------------------
    def store(self, worker: int, parent: int | None, engine_hashes, local_hashes) -> int:
        """Store a chain on the worker's tier; returns blocks stored.

        HBM workers raise ParentBlockNotFound / InvalidBlockSequence (nothing stored).
        """
        ehashes, locs, p = u64_list(engine_hashes), u64_list(local_hashes), u64_or_none(parent)
        with self._lock:
            return self._store(worker, p, ehashes, locs)

    def store_tokens(
        self,
        worker: int,
        parent: int | None,
        engine_hashes,
        tokens,
        block_size: int,
        seed: int = 1337,
    ) -> int:
        """:meth:`store` with local hashes of ``tokens`` (trailing partial block included)."""
        locs = list(hash_blocks(tokens, block_size, seed))
        return self.store(worker, parent, engine_hashes, locs)

    def remove(self, worker: int, engine_hashes) -> int:
        """Remove blocks of ``worker`` directly (no two-phase rule); returns blocks removed."""
        hs = u64_list(engine_hashes)
        with self._lock:
            return self._remove(worker, hs)

    def clear(self, worker: int) -> int:
        """Remove every block of ``worker`` and its pending waits; returns the blocks removed."""
        with self._lock:
            tier = self._tier_of(worker)
            removed = (self._tree if tier == HBM else self._tiers[tier]).clear(worker)
            for h in list(self._pending):
                waiters = self._pending[h]
                waiters.pop(worker, None)
                if not waiters:
                    del self._pending[h]
            return removed

    # -- two-phase -------------------------------------------------------------------------
    def offload(self, engine_hashes, local_hashes, parent: int | None, now: float) -> int:
        """Phase 1 (one non-HBM engine BlockStored); returns the (worker, block) stores done."""
        ehashes, locs, p = u64_list(engine_hashes), u64_list(local_hashes), u64_or_none(parent)
        now = float(now)
        with self._lock:
            applied = 0
            for h, t in zip(ehashes, locs, strict=False):
                waiters = self._pending.pop(h, None)
                if waiters is not None:
                    self._content[h] = (t, p, now)
                    self._offload.pop(h, None)
                    for w in sorted(waiters):
                        applied += self._apply(w, p, h, t)
                else:
                    self._content.pop(h, None)
                    self._offload[h] = (t, p, now)
                p = h
            return applied

    def pool_store(self, worker: int, engine_hashes, now: float) -> tuple[int, int]:
        """Phase 2: the pool confirms ``engine_hashes`` for ``worker``; (applied, queued)."""
        hs = u64_list(engine_hashes)
        now = float(now)
        with self._lock:
            applied = queued = 0
            for h in hs:
                if h in self._offload:
                    t, p, _ = self._offload.pop(h)
                    self._content[h] = (t, p, now)
                elif h in self._content:
                    t, p, _ = self._content[h]  # time not refreshed
                else:
                    key = self._tiers[CPU].lookup_block(h)
                    if key is None:
                        key = self._tiers[DISK].lookup_block(h)
                    if key is None:
                        waiters = self._pending.setdefault(h, {})
                        if worker not in waiters:
                            waiters[worker] = now  # the first insert time is kept
                            queued += 1
                        continue
                    p, t = key
                    self._content[h] = (t, p, now)
                applied += self._apply(worker, p, h, t)
            return applied, queued

    def evict(self, worker: int, engine_hashes) -> int:
        """Removal with the two-phase rule; returns the number of index removals."""
        hs = u64_list(engine_hashes)
        with self._lock:
            if self._tier_of(worker) == HBM:
                return self._tree.remove(worker, hs)  # deviation: HBM skips the offload rule
            removed = 0
            for h in hs:
                if h in self._offload:
                    del self._offload[h]
                    self._content.pop(h, None)
                elif worker in self._pending.get(h, ()):
                    waiters = self._pending[h]
                    del waiters[worker]
                    if not waiters:
                        del self._pending[h]
                    if h in self._content:
                        removed += self._remove(worker, [h])
                else:
                    removed += self._remove(worker, [h])
            return removed

    def sweep(self, now: float, pending_ttl: float, content_ttl: float, offload_ttl: float) -> int:
        """Drop two-phase entries aged ``>= ttl``, then the tree sweep; returns the total."""
        with self._lock:
            removed = 0
            for h in [h for h, (_, _, t) in self._offload.items() if now - t >= offload_ttl]:
                del self._offload[h]
                removed += 1
            for h in [h for h, (_, _, t) in self._content.items() if now - t >= content_ttl]:
                del self._content[h]
                removed += 1
            for h in list(self._pending):
                waiters = self._pending[h]
                for w in [w for w, t in waiters.items() if now - t >= pending_ttl]:
                    del waiters[w]
                    removed += 1
                if not waiters:
                    del self._pending[h]
            return removed  # the HBM tree prunes empty nodes as it goes: nothing to sweep

    # -- queries -------------------------------------------------------------------------
    def match(self, local_hashes) -> list[tuple[int, int, int, int]]:
        """``[(group, npu_blocks, cpu_blocks, disk_blocks)]`` sorted by group, hits only."""
        hs = u64_list(local_hashes)
        with self._lock:
            return self._match(hs)

    def match_tokens(
        self, tokens, block_size: int, seed: int = 1337
    ) -> list[tuple[int, int, int, int]]:
        """:meth:`match` over the LocalBlockHashes of ``tokens``; block_size 0 matches nothing."""
        return self.match(list(hash_blocks(tokens, block_size, seed)))

    def match_rows(self, local_hashes) -> MatchRows:
        """:meth:`match` as :class:`MatchRows` (the compiled core's answer type)."""
        return MatchRows(self.match(local_hashes))

    def match_tokens_rows(self, tokens, block_size: int, seed: int = 1337) -> MatchRows:
        return MatchRows(self.match_tokens(tokens, block_size, seed))

    def trace(self, local_hashes) -> list[tuple[int, int, int]]:
        """``[(worker, reach, stop)]`` for every declared worker, by worker id
        (docs/design.md, "CoreIndex: explain")."""
        hs = u64_list(local_hashes)
        with self._lock:
            return self._trace(hs)

    def trace_tokens(self, tokens, block_size: int, seed: int = 1337) -> list[tuple[int, int, int]]:
        """:meth:`trace` over the LocalBlockHashes of ``tokens``."""
        return self.trace(list(hash_blocks(tokens, block_size, seed)))

    def _holds(self, worker: int, local: int) -> bool:
        """Does ``worker`` hold any block with content ``local`` on its tier?"""
        tier = self._tier_of(worker)
        if tier == HBM:
            return any(n.local == local for n in self._tree._rev.get(worker, {}).values())
        return any(k[1] == local for k in self._tiers[tier]._rev.get(worker, {}).values())

    def _trace(self, hs: list[int]) -> list[tuple[int, int, int]]:
        n = len(hs)
        group = self._group_of
        depth: dict[int, int] = {}
        hbm_bps = []
        muted = self._muted
        for w, d, last in self._hbm_hits(hs):
            depth[w] = d
            hbm_bps.append((group(w), d, last))
        # CPU breakpoints, as in _match: walks of more than 0 blocks
        cpu = self._tiers[CPU]
        cpu_bps = []
        for w, start, parent in _walk_starts(cpu, hs, hbm_bps, group, muted):
            count, last_ehash = cpu.walk(w, hs, start, parent)
            if count > 0:
                cpu_bps.append((group(w), start + count, last_ehash))
        # the tree path of the query: path[k] is the node after k blocks
        path = [self._tree._root]
        for h in hs:
            child = path[-1].children.get(h)
            if child is None:
                break
            path.append(child)
        out = []
        for w in sorted(self._workers):
            g, tier = self._workers[w]
            if w in muted:
                out.append((w, 0, MUTED))  # no hits and no breakpoints (set_muted)
                continue
            if tier == HBM:
                d = depth.get(w, 0)
                if d >= n:
                    code = END
                elif self._holds(w, hs[d]):
                    code = MISMATCH
                elif d + 1 < len(path) and path[d + 1].members:
                    code = NOT_HELD
                else:
                    code = NO_FIRST if d == 0 else EXHAUSTED
                out.append((w, d, code))
                continue
            lower = self._tiers[tier]
            upstream = hbm_bps if tier == CPU else hbm_bps + cpu_bps
            best = None
            for start, parent in [(0, None)] + [(e, last) for gg, e, last in upstream if gg == g]:
                count, last_ehash = lower.walk(w, hs, start, parent)
                pos = start + count
                p = last_ehash if count else parent
                if pos >= n:
                    code = END
                elif self._holds(w, hs[pos]):
                    code = MISMATCH
                elif p is None:
                    code = NOT_HELD if lower.owners(None, hs[pos]) else NO_FIRST
                else:
                    code = NOT_HELD if lower.owners(p, hs[pos]) else EXHAUSTED
                if best is None or pos > best[0] or (pos == best[0] and code < best[1]):
                    best = (pos, code)
            assert best is not None
            out.append((w, best[0], best[1]))
        return out

    def worker_blocks(self, worker: int) -> int:
        """Blocks ``worker`` holds on its tier (0 for an unknown worker)."""
        with self._lock:
            if worker not in self._workers:
                return 0
            tier = self._tier_of(worker)
            return (self._tree if tier == HBM else self._tiers[tier]).worker_blocks(worker)

    def worker_hashes(self, worker: int):
        """The engine hashes ``worker`` holds on its tier, as ``array('Q')``."""
        from array import array

        with self._lock:
            if worker not in self._workers:
                return array("Q")
            tier = self._tier_of(worker)
            return array("Q", (self._tree if tier == HBM else self._tiers[tier]).hashes_of(worker))

    def parent_of(self, worker: int, h: int) -> int | None:
        """Parent engine hash of ``worker``'s block ``h`` (None: root, or parent not held)."""
        with self._lock:
            if worker not in self._workers:
                raise KeyError(h)
            tier = self._tier_of(worker)
            return (self._tree if tier == HBM else self._tiers[tier]).parent_of(worker, h)

    def hbm_reach(self, worker: int, local_hashes) -> int:
        """Leading blocks of ``local_hashes`` the HBM ``worker`` holds on the tree's path (its
        ``match`` depth, muting aside; 0 for a worker of another tier)."""
        with self._lock:
            if worker not in self._workers or self._tier_of(worker) != HBM:
                return 0
            hs = [int(h) for h in local_hashes]
            return next((d for w, d, _ in self._tree.match(hs) if w == worker), 0)

    def block_of(self, worker: int, h: int) -> tuple[int | None, int]:
        """``(parent, local)`` of ``worker``'s block ``h``; KeyError when it is not held."""
        with self._lock:
            if worker not in self._workers:
                raise KeyError(h)
            tier = self._tier_of(worker)
            return (self._tree if tier == HBM else self._tiers[tier]).block_of(worker, h)

    def stats(self) -> dict:
        """Sizes: nodes, hbm_pairs, cpu_blocks, disk_blocks, offload, content, pending, nbytes."""
        with self._lock:
            return {
                "nodes": self._tree.num_nodes,
                "hbm_pairs": self._tree.num_pairs,
                "cpu_blocks": self._tiers[CPU].total_blocks,
                "disk_blocks": self._tiers[DISK].total_blocks,
                "offload": len(self._offload),
                "content": len(self._content),
                "pending": sum(len(w) for w in self._pending.values()),
                "nbytes": 0,
            }

    # -- dump and restore (kvconductor.state.dump) ----------------------------------------
    def export_hbm(self):
        """The HBM tree as ``(parents, locals, node, worker, ehash)`` arrays (see the
        compiled core): node table parents first, then the member table."""
        from array import array

        with self._lock:
            p, loc, n, w, e = self._tree.export_table()
        return array("I", p), array("Q", loc), array("I", n), array("I", w), array("Q", e)

    def restore_hbm(self, parents, local_hashes, node, worker, ehash) -> int:
        """Add an :meth:`export_hbm` table; returns the (worker, block) pairs added."""
        with self._lock:
            for w in worker:
                if self._workers.get(int(w), (0, -1))[1] != HBM:
                    raise ValueError(f"HBM table: worker {w} is unknown or not an HBM worker")
            return self._tree.restore_table(parents, local_hashes, node, worker, ehash)

    def export_tier(self, tier: int):
        """``(worker, ehash, local, parent, has_parent)`` arrays of tier 1 (CPU) or 2
        (Disk), one row per (edge, owner), root edges first in creation order."""
        from array import array

        if tier not in (CPU, DISK):
            raise ValueError(f"tier must be 1 or 2, not {tier}")
        with self._lock:
            rows = self._tiers[tier].export_rows()
        return (
            array("I", [r[0] for r in rows]),
            array("Q", [r[1] for r in rows]),
            array("Q", [r[2] for r in rows]),
            array("Q", [r[3] or 0 for r in rows]),
            array("B", [r[3] is not None for r in rows]),
        )

    def restore_tier(self, tier: int, worker, ehash, local_hashes, parent, has_parent) -> int:
        """Replay :meth:`export_tier` rows in order as one-block stores; returns the rows."""
        if tier not in (CPU, DISK):
            raise ValueError(f"tier must be 1 or 2, not {tier}")
        cols = [list(worker), u64_list(ehash), u64_list(local_hashes), u64_list(parent)]
        cols.append([int(h) for h in has_parent])
        if len({len(c) for c in cols}) > 1:
            raise ValueError("tier table: column lengths differ")
        with self._lock:
            for w in cols[0]:
                if self._workers.get(int(w), (0, -1))[1] != tier:
                    raise ValueError(f"tier table: worker {w} is unknown or not of tier {tier}")
            for i, (w, h, loc, p, hp) in enumerate(zip(*cols, strict=True)):
                if self._tiers[tier].store(w, p if hp else None, [h], [loc]) != 1:
                    raise ValueError(f"tier table: row {i} (block {h} of worker {w}) refused")
            return len(cols[0])

    def export_twophase(self):
        """``(records, waits)``: records ``(kind, ehash, local, parent, t)`` (kind 0
        offload, 1 content), waits ``(ehash, worker, t)`` newest first per hash."""
        with self._lock:
            records = [(0, h, loc, p, t) for h, (loc, p, t) in self._offload.items()]
            records += [(1, h, loc, p, t) for h, (loc, p, t) in self._content.items()]
            waits = [
                (h, w, t)
                for h, waiters in self._pending.items()
                for w, t in reversed(list(waiters.items()))
            ]
            return records, waits

    def restore_twophase(self, records, waits) -> None:
        """Add :meth:`export_twophase` entries (times on this core's clock)."""
        with self._lock:
            for kind, h, loc, p, t in records:
                if kind not in (0, 1):
                    raise ValueError(f"two-phase record of kind {kind}")
                if h in self._offload or h in self._content:
                    raise ValueError(f"two-phase record for hash {h} given twice")
                (self._offload if kind == 0 else self._content)[int(h)] = (
                    int(loc),
                    None if p is None else int(p),
                    float(t),
                )
            for h, w, t in reversed(list(waits)):
                if int(w) not in self._workers:
                    raise ValueError(f"pending wait of unknown worker {w}")
                waiters = self._pending.setdefault(int(h), {})
                if w in waiters:
                    raise ValueError(f"worker {w} waits twice for hash {h}")
                waiters[int(w)] = float(t)

    def close(self) -> None:
        """The compiled core frees its C state here; the twin has nothing to free."""

    def check_invariants(self) -> None:
        """The same checker under the compiled core's name (a dump's restore calls it)."""
        self._check_invariants()

    # -- testing aid ---------------------------------------------------------------------
    def _check_invariants(self) -> None:
        """Assert tier invariants and the two-phase invariants (for tests)."""
        self._tree._check_invariants()
        for tier in self._tiers.values():
            tier._check_invariants()
        with self._lock:
            assert not (set(self._offload) & set(self._content)), "hash in offload and content"
            assert all(self._pending.values()), "empty pending key survived"
