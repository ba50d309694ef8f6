"""CoreIndex and kvconductor.index.Index: the reference's indexer tests (with V3 values) and
two-phase tests, the worked examples of docs/api.md "Tiers and counts", maintenance and the
V3 response shape, with the fixes of docs/design.md.

All queries use block_size 4 over real token lists hashed with hash_blocks.
Engine hashes ("seq") are opaque; blocks replicated on several tiers of one
engine carry the same engine hashes (a CPU/Disk chain continues an HBM run by engine
hash, docs/design.md "CoreIndex: query"). Every expected value is worked
out by hand in the comment above it.
"""

import pytest

from kvconductor._hash import hash_blocks
from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound
from kvconductor.index import U32_MAX, DpHit, Index, QueryResult
from kvconductor.keys import Medium, WorkerKey

BS = 4
TOK = list(range(1000, 1024))  # 6 full blocks of 4 tokens
H = list(hash_blocks(TOK, BS))  # their LocalBlockHashes
E = [11, 12, 13, 14, 15, 16]  # one engine's hashes of those blocks
TENANT = "default"


def toks(first, last=None):
    """Tokens of blocks [first, last) (or [0, first) with one argument)."""
    if last is None:
        first, last = 0, first
    return TOK[first * BS : last * BS]


def key(inst, medium, dp=0, backend=None):
    return WorkerKey(inst, backend or inst, dp, medium)


NPU_A, CPU_A, DISK_A = (key("inst-a", m) for m in (Medium.NPU, Medium.CPU, Medium.DISK))
NPU_B, CPU_B, DISK_B = (key("inst-b", m) for m in (Medium.NPU, Medium.CPU, Medium.DISK))


def dp(npu, cpu, disk, block_size=BS):
    return {
        "matched_tokens": (npu + cpu + disk) * block_size,
        "npu_blocks": npu,
        "cpu_blocks": cpu,
        "disk_blocks": disk,
    }


def query(ix, nblocks):
    """The tenant's part of the V3 /query answer for the first ``nblocks`` blocks."""
    out = ix.query(toks(nblocks), BS).to_dict(TENANT, BS)
    assert list(out) == [TENANT]
    return out[TENANT]


@pytest.fixture
def ix(impl):
    return Index("model", TENANT, impl=impl)


# -- the reference's indexer tests (V3+ expectations) and tier-partition worked examples ------


def test_indexer_get_or_create_and_query(ix):
    assert query(ix, 2) == {}
    assert ix.store_tokens(NPU_A, None, E[:2], toks(2), BS) == 2
    # 2 HBM blocks -> npu 2, 8 tokens; a longer prompt matches the same 2 blocks
    expected = {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}
    assert query(ix, 2) == expected
    assert query(ix, 4) == expected


def test_per_tier_aggregation(ix):
    a0_x = key("inst-a", Medium.NPU, dp=0, backend="x")
    a0_y = key("inst-a", Medium.NPU, dp=0, backend="y")
    ix.store_tokens(a0_x, None, E[:2], toks(2), BS)
    ix.store_tokens(a0_y, None, E[:1], toks(1), BS)
    ix.store_tokens(key("inst-a", Medium.CPU, dp=1), None, E[:3], toks(3), BS)
    ix.store_tokens(DISK_B, None, E[:1], toks(1), BS)
    # inst-a dp0: two HBM workers fold into one DP, max depth 2 -> 8 tokens
    # inst-a dp1: CPU root chain of 3 -> 12 tokens; longest over the DPs 12
    # inst-b dp0: Disk root block -> 4 tokens
    assert query(ix, 4) == {
        "inst-a": {"longest_matched": 12, "DP": {"0": dp(2, 0, 0), "1": dp(0, 3, 0)}},
        "inst-b": {"longest_matched": 4, "DP": {"0": dp(0, 0, 1)}},
    }


def test_cpu_continuation_from_hbm_breakpoint(ix):
    # NPU [0,2) + CPU tail chained after NPU block 2 -> 2/1/0, 12, longest 12
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(CPU_A, E[1], E[2:3], toks(2, 3), BS)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(2, 1, 0)}}}


def test_cpu_replica_reported_when_hbm_hits_same_dp(ix):
    # same 1-block prefix on NPU and CPU -> npu 1, cpu max(0, 1-1) = 0, 4 tokens
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(CPU_A, None, E[:1], toks(1), BS)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}


def test_cpu_root_used_when_no_hbm_on_dp(ix):
    # CPU only -> root walk, 0/1/0, 4 tokens
    ix.store_tokens(CPU_A, None, E[:1], toks(1), BS)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


def test_cpu_root_chains_of_differently_seeded_engines_both_count(ix):
    """inst-a and inst-b hold the same 3 blocks on CPU under different engine hashes
    (random NONE_HASH per process): both get their own root walk, 0/3/0 = 12 tokens,
    however the stores interleave. The reference let the first writer own the root."""
    cpu_b = key("inst-b", Medium.CPU)
    other = [e + 1000 for e in E]
    ix.store_tokens(CPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(cpu_b, None, other[:2], toks(2), BS)
    ix.store_tokens(CPU_A, E[0], E[1:3], toks(1, 3), BS)
    ix.store_tokens(cpu_b, other[1], other[2:3], toks(2, 3), BS)
    assert query(ix, 3) == {
        "inst-a": {"longest_matched": 12, "DP": {"0": dp(0, 3, 0)}},
        "inst-b": {"longest_matched": 12, "DP": {"0": dp(0, 3, 0)}},
    }
    # inst-a's root block is evicted: only inst-b still holds a root chain
    ix.remove(CPU_A, E[:1])
    assert query(ix, 3) == {"inst-b": {"longest_matched": 12, "DP": {"0": dp(0, 3, 0)}}}


def test_disk_continuation_from_cpu_breakpoint(ix):
    # NPU 1 + CPU 1 after it + Disk 1 after the CPU block -> 1/1/1, 12
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(CPU_A, E[0], E[1:2], toks(1, 2), BS)
    ix.store_tokens(DISK_A, E[1], E[2:3], toks(2, 3), BS)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(1, 1, 1)}}}


def test_disk_continuation_from_cpu_root_walk(ix):
    # CPU root chain [0,2) (end 2, last E1); Disk after E1 -> end 3: 0/2/1, 12
    ix.store_tokens(CPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(DISK_A, E[1], E[2:3], toks(2, 3), BS)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(0, 2, 1)}}}


def test_overlapping_npu_cpu_disk_replicas_do_not_inflate_matched_tokens(ix):
    # same 2-block chain on NPU, CPU, Disk -> ends 2, 2, 2 -> 2/0/0, 8
    for k in (NPU_A, CPU_A, DISK_A):
        ix.store_tokens(k, None, E[:2], toks(2), BS)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}


def test_shorter_hbm_breakpoint_does_not_overcount_cpu_overlap(ix):
    # two HBM workers of one DP: depth 2 (last E1) and depth 1 (last E0); the CPU block
    # continues after E0 -> CPU end 2 = npu end 2 -> cpu 0 (V2 said cpu 1); 8 tokens
    ix.store_tokens(key("inst-a", Medium.NPU, backend="x"), None, E[:2], toks(2), BS)
    ix.store_tokens(key("inst-a", Medium.NPU, backend="y"), None, E[:1], toks(1), BS)
    ix.store_tokens(CPU_A, E[0], E[1:2], toks(1, 2), BS)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}


def test_disk_continuation_from_hbm_when_cpu_miss(ix):
    # NPU [0,1), Disk block chained after E0 -> 1/0/1, 8
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(DISK_A, E[0], E[1:2], toks(1, 2), BS)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(1, 0, 1)}}}


def test_disk_replica_reported_when_cpu_hits_same_dp(ix):
    # CPU and Disk hold the same root block -> cpu 1, disk max(0, 1-1) = 0, 4
    ix.store_tokens(CPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(DISK_A, None, E[:1], toks(1), BS)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


def test_disk_replica_reported_when_hbm_hits_same_dp(ix):
    # NPU and Disk hold the same root block -> npu 1, disk 0, 4
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(DISK_A, None, E[:1], toks(1), BS)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}


def test_lower_tier_longer_replica_extends_coverage(ix):
    # NPU 1 block + Disk full 3-block root chain -> npu 1, disk 3 - 1 = 2, 12
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(DISK_A, None, E[:3], toks(3), BS)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(1, 0, 2)}}}


def test_no_hits_gives_empty_tenant_map(ix):
    # (the reference's test_no_indexer_error is the registry's 404; here: an index without hits)
    assert query(ix, 3) == {}
    ix.store_tokens(NPU_A, None, E[:1], toks(1, 2), BS)  # content of block 1 at the root
    assert query(ix, 3) == {}
    assert len(ix.query(toks(3), BS)) == 0


def test_hbm_cleared_removes_empty_worker_lookup(ix):
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    assert ix.core.worker_blocks(ix.worker_id(NPU_A)) == 2
    assert ix.clear(NPU_A) == 2
    assert ix.core.worker_blocks(ix.worker_id(NPU_A)) == 0
    assert ix.is_empty()
    assert ix.summary()["worker_count"] == 0
    assert query(ix, 2) == {}


def test_maintenance_expires_offload_and_removes_empty_entry(ix):
    ix.offload(E[:1], H[:1], None, now=100.0)
    assert not ix.is_empty()
    # offload_ttl 0: age 0 >= 0 -> removed; nothing else left
    assert ix.maintenance(now=100.0, offload_ttl=0.0) == 1
    assert ix.is_empty()


def test_v4_readme_example_under_v3_semantics(ix):
    # inst-a HBM [0,3); inst-b CPU [0,2) and [3,5) (gap at 2, the tail chained after E2).
    # V4 pools ownership-blindly (a: 3+2, b: 0+2). Here (design.md): a's breakpoint (3, E2)
    # is only continued by a's own CPU workers (none) -> a: 3/0/0 = 12; b: root walk
    # stops at the gap -> 0/2/0 = 8.
    ix.store_tokens(NPU_A, None, E[:3], toks(3), BS)
    ix.store_tokens(CPU_B, None, E[:2], toks(2), BS)
    ix.store_tokens(CPU_B, E[2], E[3:5], toks(3, 5), BS)
    assert query(ix, 5) == {
        "inst-a": {"longest_matched": 12, "DP": {"0": dp(3, 0, 0)}},
        "inst-b": {"longest_matched": 8, "DP": {"0": dp(0, 2, 0)}},
    }


def test_hbm_breakpoint_not_shared_across_instances(ix):
    # inst-a HBM [0,2); inst-b CPU tail chained after inst-a's E1 (no cross-DP
    # borrowing, unlike the reference):
    # inst-a is not credited with inst-b's CPU block -> 2/0/0 = 8; inst-b has no root
    # edge and borrows no breakpoint -> absent.
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(CPU_B, E[1], E[2:3], toks(2, 3), BS)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}


def test_hbm_breakpoint_not_shared_across_dps_of_one_instance(ix):
    # a DP is the unit: inst-a dp1's CPU tail after dp0's HBM block -> dp1 absent
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(key("inst-a", Medium.CPU, dp=1), E[1], E[2:3], toks(2, 3), BS)
    ix.store_tokens(key("inst-a", Medium.DISK, dp=1), E[1], E[2:4], toks(2, 4), BS)
    assert query(ix, 4) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}


def test_disk_walks_from_every_breakpoint_of_the_group(ix):
    # One DP: HBM [0,2) (end 2, last E1); CPU root chain [0,3) with other engine hashes
    # (end 3, last 23); Disk chain after E1 over blocks 2..4.
    # Disk from the HBM breakpoint: end 5 (the farther CPU breakpoint (3, 23) finds none).
    # npu 2, cpu 3-2 = 1, disk 5-3 = 2 -> 20 tokens.
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(CPU_A, None, [21, 22, 23], toks(3), BS)
    ix.store_tokens(DISK_A, E[1], E[2:5], toks(2, 5), BS)
    assert query(ix, 5) == {"inst-a": {"longest_matched": 20, "DP": {"0": dp(2, 1, 2)}}}


def test_lower_walk_needs_ownership(ix):
    # CPU_A holds (None,H0)->E0 and CPU_B continues with (E0,H1)->E1: a's walk stops at 1
    # (CPU_B does not own (None,H0) and its tail is not after a breakpoint of its group)
    ix.store_tokens(CPU_A, None, E[:1], toks(1), BS)
    ix.store_tokens(CPU_B, E[0], E[1:2], toks(1, 2), BS)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


# -- two-phase (the reference's two-phase tests; docs/design.md "CoreIndex: two-phase state") ---

AAA, BBB, CCC = 0xAAA, 0xBBB, 0xCCC


def stats(ix, *names):
    s = ix.core.stats()
    return tuple(s[n] for n in names)


def blocks(ix, k):
    return ix.core.worker_blocks(ix.worker_id(k))


def test_non_hbm_event_cached_not_in_tree(ix):
    assert ix.offload([AAA], H[:1], None, now=0.0) == 0
    assert stats(ix, "offload", "content", "pending") == (1, 0, 0)
    assert stats(ix, "nodes", "hbm_pairs", "cpu_blocks", "disk_blocks") == (0, 0, 0, 0)
    assert query(ix, 1) == {}


def test_pool_backend_store_matches_cached_block(ix):
    ix.offload([AAA], H[:1], None, now=0.0)
    # offload[AAA] moves to content and is applied for CPU_A at the root
    assert ix.pool_store(CPU_A, [AAA], now=1.0) == (1, 0)
    assert stats(ix, "offload", "content", "pending", "cpu_blocks") == (0, 1, 0, 1)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


def test_pool_backend_store_ignores_unknown_hash(ix):
    assert ix.pool_store(CPU_A, [CCC], now=0.0) == (0, 1)
    assert stats(ix, "offload", "content", "pending", "cpu_blocks") == (0, 0, 1, 0)
    assert query(ix, 1) == {}


def test_pool_backend_remove_evicts_cache(ix):
    ix.offload([AAA, BBB], H[:2], None, now=0.0)  # AAA at root, BBB after AAA
    assert ix.pool_store(CPU_A, [AAA, BBB], now=1.0) == (2, 0)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(0, 2, 0)}}}
    # AAA is no longer in offload nor pending -> plain index removal
    assert ix.evict(CPU_A, [AAA]) == 1
    assert blocks(ix, CPU_A) == 1  # BBB stays in the CPU tier
    assert stats(ix, "cpu_blocks") == (1,)
    assert query(ix, 2) == {}  # root edge gone: chain broken


def test_pool_arrives_before_offload(ix):
    assert ix.pool_store(CPU_A, [AAA], now=0.0) == (0, 1)
    # Phase 1 finds the waiter: content[AAA], applied for CPU_A
    assert ix.offload([AAA], H[:1], None, now=1.0) == 1
    assert stats(ix, "offload", "content", "pending", "cpu_blocks") == (0, 1, 0, 1)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


def test_pool_arrives_before_offload_multi_worker(ix):
    assert ix.pool_store(CPU_A, [AAA], now=0.0) == (0, 1)
    assert ix.pool_store(CPU_B, [AAA], now=0.5) == (0, 1)
    assert stats(ix, "pending") == (2,)
    assert ix.offload([AAA], H[:1], None, now=1.0) == 2
    assert stats(ix, "pending", "content", "cpu_blocks") == (0, 1, 2)
    assert query(ix, 1) == {
        "inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}},
        "inst-b": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}},
    }


def test_pool_before_offload_chains_under_recorded_parent(ix):
    # the pool confirms BBB first; Phase 1 of [AAA, BBB] applies BBB under parent AAA
    assert ix.pool_store(CPU_A, [BBB], now=0.0) == (0, 1)
    assert ix.offload([AAA, BBB], H[:2], None, now=1.0) == 1
    assert stats(ix, "offload", "content", "pending") == (1, 1, 0)
    assert query(ix, 2) == {}  # no root edge yet
    assert ix.pool_store(CPU_A, [AAA], now=2.0) == (1, 0)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(0, 2, 0)}}}


def test_offload_records_the_event_parent(ix):
    # Phase 1 of [AAA, BBB] after engine block E0 held in HBM: AAA under E0, BBB under AAA
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    assert ix.offload([AAA, BBB], H[1:3], E[0], now=0.0) == 0
    assert ix.pool_store(CPU_A, [AAA, BBB], now=1.0) == (2, 0)
    # npu 1, CPU continues from (1, E0) to end 3 -> cpu 2, 12 tokens
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(1, 2, 0)}}}


def test_pool_removal_cleans_pending(ix):
    ix.pool_store(CPU_A, [AAA], now=0.0)
    # CPU_A waits on AAA, content[AAA] absent -> no index removal
    assert ix.evict(CPU_A, [AAA]) == 0
    assert stats(ix, "pending") == (0,)
    # Phase 1 now finds nobody waiting
    assert ix.offload([AAA], H[:1], None, now=1.0) == 0
    assert stats(ix, "offload", "cpu_blocks") == (1, 0)


def test_offload_then_vllm_removal(ix):
    ix.offload([AAA], H[:1], None, now=0.0)
    # offload[AAA] present: drop it (and content), no index removal
    assert ix.evict(CPU_A, [AAA]) == 0
    assert stats(ix, "offload", "content", "cpu_blocks") == (0, 0, 0)
    # a later confirmation can no longer be resolved
    assert ix.pool_store(CPU_A, [AAA], now=1.0) == (0, 1)
    assert query(ix, 1) == {}


def test_removal_after_both_matched(ix):
    ix.offload([AAA], H[:1], None, now=0.0)
    ix.pool_store(CPU_A, [AAA], now=1.0)
    assert ix.evict(CPU_A, [AAA]) == 1
    # removed from the index; content survives removals (migration window)
    assert stats(ix, "cpu_blocks", "content", "offload") == (0, 1, 0)
    assert query(ix, 1) == {}


def test_vllm_removal_after_pool_queued(ix):
    ix.pool_store(CPU_A, [AAA], now=0.0)
    # another worker's removal: not pending there -> index removal of nothing, waiter kept
    assert ix.evict(CPU_B, [AAA]) == 0
    assert stats(ix, "pending") == (1,)
    # the waiter's own removal: dropped from pending, content absent -> no index removal
    assert ix.evict(CPU_A, [AAA]) == 0
    assert stats(ix, "pending", "cpu_blocks") == (0, 0)


def test_evict_of_pending_worker_with_content_removes_from_index(ix):
    assert ix.pool_store(CPU_A, [AAA], now=0.0) == (0, 1)
    assert ix.store(CPU_A, None, [AAA], H[:1]) == 1  # /events path, no two-phase
    # CPU_B's confirmation resolves through the CPU tier's lookup_block -> content[AAA]
    assert ix.pool_store(CPU_B, [AAA], now=1.0) == (1, 0)
    assert stats(ix, "content", "pending", "cpu_blocks") == (1, 1, 2)
    # CPU_A is pending on AAA and content[AAA] exists -> index removal for CPU_A
    assert ix.evict(CPU_A, [AAA]) == 1
    assert stats(ix, "content", "pending", "cpu_blocks") == (1, 0, 1)
    assert query(ix, 1) == {"inst-b": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


def test_duplicate_pool_stored_idempotent(ix):
    assert ix.pool_store(CPU_A, [AAA], now=0.0) == (0, 1)
    assert ix.pool_store(CPU_A, [AAA], now=30.0) == (0, 0)
    assert stats(ix, "pending") == (1,)
    # the first insert time (0.0) is kept: age 59.5 < 60 survives, age 60 goes
    assert ix.maintenance(now=59.5) == 0
    assert ix.maintenance(now=60.0) == 1
    assert stats(ix, "pending") == (0,)


def test_pending_worker_cleanup(ix):
    ix.pool_store(CPU_A, [AAA], now=0.0)
    ix.pool_store(CPU_B, [AAA], now=0.0)
    assert stats(ix, "pending") == (2,)
    # clear returns index blocks removed (CPU_A holds none); its wait is dropped
    assert ix.clear(CPU_A) == 0
    assert stats(ix, "pending") == (1,)
    assert ix.offload([AAA], H[:1], None, now=1.0) == 1  # only CPU_B applied
    assert query(ix, 1) == {"inst-b": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}


def test_cleared_cleans_pending(ix):
    ix.store(CPU_A, None, [E[3]], H[3:4])
    ix.pool_store(CPU_A, [AAA, BBB], now=0.0)
    assert stats(ix, "pending", "cpu_blocks") == (2, 1)
    assert ix.clear(CPU_A) == 1
    assert stats(ix, "pending", "cpu_blocks") == (0, 0)
    assert ix.offload([AAA], H[:1], None, now=1.0) == 0
    assert stats(ix, "offload") == (1,)


def test_sweep_stale_caches(ix):
    ix.offload([AAA], H[:1], None, now=0.0)  # stays in offload
    ix.offload([BBB], H[1:2], None, now=0.0)
    ix.pool_store(CPU_A, [BBB], now=0.0)  # -> content
    ix.pool_store(CPU_A, [CCC], now=0.0)  # -> pending
    assert stats(ix, "offload", "content", "pending", "cpu_blocks") == (1, 1, 1, 1)
    assert ix.maintenance(now=0.0, pending_ttl=0.0, content_ttl=0.0, offload_ttl=0.0) == 3
    # the applied CPU block is index state, not a cache: it stays
    assert stats(ix, "offload", "content", "pending", "cpu_blocks") == (0, 0, 0, 1)
    assert not ix.is_empty()
    ix.evict(CPU_A, [BBB])
    assert ix.is_empty()


# -- Disk promotion ----------------------------------------------------------------------------


def test_disk_promotion_resolves_through_content_after_cpu_eviction(ix):
    ix.offload(E[:2], H[:2], None, now=0.0)
    assert ix.pool_store(CPU_A, E[:2], now=1.0) == (2, 0)
    assert ix.evict(CPU_A, E[:2]) == 2  # CPU eviction
    assert stats(ix, "cpu_blocks", "content") == (0, 2)  # content retained
    # the Disk confirmation resolves each hash through content (local, parent)
    assert ix.pool_store(DISK_A, E[:2], now=2.0) == (2, 0)
    assert query(ix, 2) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(0, 0, 2)}}}


def test_disk_promotion_resolves_through_cpu_tier_lookup(ix):
    # no two-phase state: CPU_A got its blocks over /events
    ix.store(CPU_A, None, E[:2], H[:2])
    assert ix.pool_store(DISK_B, E[:2], now=5.0) == (2, 0)  # lookup_block on the CPU tier
    assert stats(ix, "content", "disk_blocks") == (2, 2)
    assert query(ix, 2) == {
        "inst-a": {"longest_matched": 8, "DP": {"0": dp(0, 2, 0)}},
        "inst-b": {"longest_matched": 8, "DP": {"0": dp(0, 0, 2)}},
    }


def test_pool_store_resolves_through_disk_tier_lookup(ix):
    ix.store(DISK_A, None, E[:1], H[:1])
    # not in offload, content or the CPU tier: the Disk tier resolves it
    assert ix.pool_store(CPU_B, E[:1], now=0.0) == (1, 0)
    assert query(ix, 1) == {
        "inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 0, 1)}},
        "inst-b": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}},
    }


# -- TTLs with explicit times -------------------------------------------------------------------


def test_ttl_sweeps_at_their_boundaries(ix):
    ix.offload([AAA], H[:1], None, now=1000.0)  # offload, t=1000
    ix.offload([BBB], H[1:2], None, now=900.0)
    ix.pool_store(CPU_A, [BBB], now=1000.0)  # content, t=1000
    ix.pool_store(CPU_B, [CCC], now=1000.0)  # pending, t=1000
    # defaults: pending 60, content 300, offload 600; removal when age >= ttl
    assert ix.maintenance(now=1059.5) == 0
    assert ix.maintenance(now=1060.0) == 1
    assert stats(ix, "offload", "content", "pending") == (1, 1, 0)
    assert ix.maintenance(now=1299.5) == 0
    assert ix.maintenance(now=1300.0) == 1
    assert stats(ix, "offload", "content", "pending") == (1, 0, 0)
    assert ix.maintenance(now=1599.5) == 0
    assert ix.maintenance(now=1600.0) == 1
    assert stats(ix, "offload", "content", "pending") == (0, 0, 0)
    assert stats(ix, "cpu_blocks") == (1,)


def test_content_time_not_refreshed_on_reuse(ix):
    ix.offload([AAA], H[:1], None, now=0.0)
    ix.pool_store(CPU_A, [AAA], now=1000.0)  # content at 1000
    assert ix.pool_store(CPU_B, [AAA], now=1200.0) == (1, 0)  # reuse: time stays 1000
    assert ix.maintenance(now=1299.5) == 0
    assert ix.maintenance(now=1300.0) == 1


def test_content_time_refreshed_on_tier_lookup(ix):
    ix.offload([AAA], H[:1], None, now=0.0)
    ix.pool_store(CPU_A, [AAA], now=0.0)  # content at 0
    assert ix.maintenance(now=300.0) == 1  # content expired
    # CPU_A still holds AAA: the lookup path re-creates content at 2000
    assert ix.pool_store(DISK_A, [AAA], now=2000.0) == (1, 0)
    assert stats(ix, "content") == (1,)
    assert ix.maintenance(now=2299.5) == 0
    assert ix.maintenance(now=2300.0) == 1


def test_maintenance_and_is_empty(ix):
    assert ix.is_empty()
    assert ix.maintenance(now=0.0) == 0
    ix.pool_store(CPU_A, [AAA], now=0.0)
    assert not ix.is_empty()
    assert ix.maintenance(now=59.0) == 0
    assert ix.maintenance(now=61.0) == 1
    assert ix.is_empty()
    ix.store_tokens(NPU_A, None, E[:1], toks(1), BS)
    assert not ix.is_empty()
    assert ix.maintenance(now=1e9) == 0  # index blocks have no TTL
    ix.remove(NPU_A, E[:1])
    assert ix.is_empty()


# -- HBM workers in the two-phase paths (CoreIndex) ---------------------------------------------


def test_hbm_waiter_with_unknown_parent_is_swallowed(CoreIndex):
    c = CoreIndex()
    c.set_worker(0, 0, 0)  # HBM worker 0, group 0
    assert c.offload([AAA, BBB], H[:2], None, 0.0) == 0
    # BBB's parent AAA is not a block of worker 0: ParentBlockNotFound swallowed, 0 applied,
    # but BBB still moved from offload to content
    assert c.pool_store(0, [BBB], 1.0) == (0, 0)
    assert (c.stats()["offload"], c.stats()["content"]) == (1, 1)
    # now AAA (root) then BBB (under AAA) both apply
    assert c.pool_store(0, [AAA, BBB], 2.0) == (2, 0)
    assert c.match(H[:2]) == [(0, 2, 0, 0)]
    assert (c.stats()["nodes"], c.stats()["hbm_pairs"]) == (2, 2)


def test_hbm_evict_is_a_plain_tree_remove(CoreIndex):
    c = CoreIndex()
    c.set_worker(0, 0, 0)
    c.store(0, None, [AAA], H[:1])
    c.offload([AAA], H[:1], None, 0.0)  # the same block also offloaded by the engine
    # deviation from the reference: the HBM removal is not held back by offload[AAA]
    assert c.evict(0, [AAA]) == 1
    assert c.match(H[:1]) == []
    assert c.stats()["offload"] == 1


def test_direct_remove_ignores_two_phase_state(CoreIndex):
    c = CoreIndex()
    c.set_worker(1, 0, 1)  # CPU worker
    c.store(1, None, [AAA], H[:1])
    c.offload([AAA], H[:1], None, 0.0)
    # evict would only drop offload[AAA]; remove removes the block and leaves offload alone
    assert c.remove(1, [AAA]) == 1
    assert (c.stats()["cpu_blocks"], c.stats()["offload"]) == (0, 1)


def test_evict_with_offload_present_drops_offload_only(CoreIndex):
    c = CoreIndex()
    c.set_worker(1, 0, 1)
    c.store(1, None, [AAA], H[:1])
    c.offload([AAA], H[:1], None, 0.0)
    assert c.evict(1, [AAA]) == 0
    assert (c.stats()["cpu_blocks"], c.stats()["offload"]) == (1, 0)


def test_offload_replaces_stale_content(CoreIndex):
    c = CoreIndex()
    c.set_worker(1, 0, 1)
    c.offload([AAA], H[:1], None, 0.0)
    c.pool_store(1, [AAA], 1.0)  # content[AAA]
    # a new Phase 1 for AAA with nobody waiting: content dropped, offload re-created
    assert c.offload([AAA], H[1:2], None, 2.0) == 0
    s = c.stats()
    assert (s["offload"], s["content"]) == (1, 0)


# -- CoreIndex API shape ------------------------------------------------------------------------


def test_core_stats_keys_and_errors(CoreIndex):
    c = CoreIndex()
    assert set(c.stats()) == {
        "nodes",
        "hbm_pairs",
        "cpu_blocks",
        "disk_blocks",
        "offload",
        "content",
        "pending",
        "nbytes",
    }
    c.set_worker(0, 0, 0)
    c.set_worker(1, 0, 1)
    c.set_worker(2, 0, 2)
    with pytest.raises(ParentBlockNotFound):
        c.store(0, 999, [1], H[:1])
    with pytest.raises(InvalidBlockSequence):
        c.store(0, None, [1, 1], H[:2])
    # lower tiers never raise
    assert c.store(1, 999, [1], H[:1]) == 1
    assert c.store(2, None, [1, 1], H[:2]) == 1
    s = c.stats()
    assert (s["nodes"], s["hbm_pairs"], s["cpu_blocks"], s["disk_blocks"]) == (0, 0, 1, 1)
    assert (c.worker_blocks(0), c.worker_blocks(1), c.worker_blocks(2)) == (0, 1, 1)


def test_core_hbm_layout_counts_the_tree():
    """The compiled CoreIndex's HBM layout: a block one worker holds costs a node and no
    member record; a second holder moves both members into records."""
    core = pytest.importorskip("kvconductor._index").CoreIndex()
    core.set_worker(0, 0, 0)
    core.set_worker(1, 1, 0)
    core.store(0, None, [10, 11, 12], H[:3])
    lay = core.hbm_layout()
    assert (lay["nodes"], lay["records_live"]) == (4, 0)  # the root and three
    core.store(1, None, [20], H[:1])
    lay = core.hbm_layout()
    assert (lay["nodes"], lay["records_live"], lay["records"]) == (4, 2, 2)
    # the tree is part of the index's allocated bytes
    assert 0 < lay["used_bytes"] <= lay["nbytes"] < core.stats()["nbytes"]
    core.remove(1, [20])
    assert core.hbm_layout()["records_live"] == 0
    core.check_invariants()


def test_core_match_rows_sorted_by_group(CoreIndex):
    c = CoreIndex()
    c.set_worker(0, 5, 0)  # HBM, group 5
    c.set_worker(1, 2, 1)  # CPU, group 2
    c.set_worker(2, 5, 2)  # Disk, group 5
    c.store(0, None, E[:1], H[:1])
    c.store(1, None, E[:3], H[:3])
    c.store(2, E[0], E[1:2], H[1:2])
    # group 2: cpu root walk 3 -> (2, 0, 3, 0); group 5: npu 1, disk after E0 -> end 2
    assert [tuple(r) for r in c.match(H[:4])] == [(2, 0, 3, 0), (5, 1, 0, 1)]
    assert c.match([]) == []


def test_lower_tiers_continue_many_groups_from_an_edge_many_own(CoreIndex):
    """40 groups: every HBM worker holds block 0, every CPU worker blocks 0-2 and the
    even groups' Disk workers blocks 0-3, all under the same engine hashes (one edge
    per block, owned by every worker of the tier). Each group continues from its own
    breakpoints only: its candidates are found among its own workers, not by walking
    the edge's 40 owners for each of the 40 breakpoints."""
    c = CoreIndex()
    groups = 40
    for g in range(groups):
        for tier in range(3):
            c.set_worker(3 * g + tier, g, tier)
        c.store(3 * g, None, E[:1], H[:1])
        n = 2 if g == 7 else 3
        c.store(3 * g + 1, None, E[:n], H[:n])
        if g % 2 == 0:
            c.store(3 * g + 2, None, E[:4], H[:4])
    c.set_muted(3 * 5 + 1, True)  # group 5's CPU worker: no hits
    want = []
    for g in range(groups):
        cpu_end = 0 if g == 5 else 2 if g == 7 else 3
        disk_end = 4 if g % 2 == 0 else 0
        want.append((g, 1, max(0, cpu_end - 1), max(0, disk_end - max(1, cpu_end))))
    assert [tuple(r) for r in c.match(H[:5])] == want
    check = getattr(c, "check_invariants", None)
    if check is not None:
        check()


def test_core_store_and_match_tokens(CoreIndex):
    c = CoreIndex()
    c.set_worker(0, 0, 0)
    assert c.store_tokens(0, None, E[:2], toks(2), BS) == 2
    assert c.store_tokens(0, None, E[:2], toks(2), 0) == 0  # block_size 0: no hashes
    assert [tuple(r) for r in c.match_tokens(toks(3), BS)] == [(0, 2, 0, 0)]
    assert c.match_tokens(toks(3), 0) == []
    # another seed gives other hashes
    assert c.match_tokens(toks(2), BS, 7) == []
    assert c.store_tokens(0, None, [31], toks(1), BS, 7) == 1
    assert [tuple(r) for r in c.match_tokens(toks(2), BS, 7)] == [(0, 1, 0, 0)]


# -- query rendering ----------------------------------------------------------------------------


def test_query_by_hash_equals_query(ix):
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(CPU_A, E[1], E[2:3], toks(2, 3), BS)
    ix.store_tokens(DISK_B, None, E[:4], toks(4), BS)
    by_tokens = ix.query(toks(4), BS)
    by_hash = ix.query_by_hash(H[:4])
    assert by_hash.hits == by_tokens.hits
    # a: 2/1/0; b: disk 4; /query_by_hash renders with block_size 1 (blocks)
    assert by_hash.to_dict(TENANT, 1) == {
        TENANT: {
            "inst-a": {"longest_matched": 3, "DP": {"0": dp(2, 1, 0, block_size=1)}},
            "inst-b": {"longest_matched": 4, "DP": {"0": dp(0, 0, 4, block_size=1)}},
        }
    }
    assert by_hash.hits == [DpHit("inst-a", 0, 2, 1, 0), DpHit("inst-b", 0, 0, 0, 4)]


def test_partial_trailing_block_and_longer_prompt(ix):
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    # 10 tokens -> 3 hashes, the third of the partial block [8, 9]: still 2 blocks
    out = ix.query(TOK[:10], BS).to_dict(TENANT, BS)
    assert out == {TENANT: {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}}


def test_tokens_truncated_to_u32(ix):
    big = [t + 2**32 for t in toks(1)]  # same low 32 bits
    ix.store_tokens(NPU_A, None, E[:1], big, BS)
    assert query(ix, 1) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}
    neg = [-1, -2, -3, -4]  # = 2**32-1, 2**32-2, ...
    ix.store_tokens(NPU_B, None, [99], neg, BS)
    res = ix.query([2**32 - 1, 2**32 - 2, 2**32 - 3, 2**32 - 4], BS).to_dict(TENANT, BS)
    assert res == {TENANT: {"inst-b": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}}


def test_empty_input_gives_no_hits(ix):
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    assert len(ix.query([], BS)) == 0
    assert ix.query([], BS).to_dict(TENANT, BS) == {TENANT: {}}
    assert ix.query_by_hash([]).to_dict(TENANT, 1) == {TENANT: {}}
    assert ix.query(toks(2), 0).to_dict(TENANT, 0) == {TENANT: {}}  # block_size 0


def test_matched_tokens_saturate_in_u32(ix):
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    res = ix.query(toks(2), BS)
    # 2 blocks x 2**31 = 2**32 > U32_MAX -> saturated; block counts are small
    big = res.to_dict(TENANT, 2**31)[TENANT]["inst-a"]
    assert big == {
        "longest_matched": U32_MAX,
        "DP": {
            "0": {"matched_tokens": U32_MAX, "npu_blocks": 2, "cpu_blocks": 0, "disk_blocks": 0}
        },
    }
    assert U32_MAX == 2**32 - 1
    # 2 x (2**31 - 1) = 2**32 - 2 still fits
    fits = res.to_dict(TENANT, 2**31 - 1)[TENANT]["inst-a"]
    assert fits["longest_matched"] == 2**32 - 2
    # block counts saturate too
    huge = QueryResult([DpHit("x", 3, 2**33, 0, 0)]).to_dict(TENANT, 1)
    assert huge == {
        TENANT: {
            "x": {
                "longest_matched": U32_MAX,
                "DP": {
                    "3": {
                        "matched_tokens": U32_MAX,
                        "npu_blocks": U32_MAX,
                        "cpu_blocks": 0,
                        "disk_blocks": 0,
                    }
                },
            }
        }
    }


def test_summary_counts(ix):
    ix.store_tokens(NPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(NPU_B, None, E[:1], toks(1), BS)
    ix.store_tokens(CPU_A, None, E[:3], toks(3), BS)
    ix.offload([AAA], H[:1], None, now=0.0)
    ix.pool_store(DISK_B, [CCC], now=0.0)
    s = ix.summary()
    # HBM: 2 nodes, 3 pairs; CPU 3 blocks; 3 workers hold blocks (DISK_B only waits)
    assert {
        k: s[k]
        for k in (
            "worker_count",
            "total_blocks",
            "hbm_blocks",
            "cpu_blocks",
            "disk_blocks",
            "hbm_nodes",
            "offload",
            "pending_pool",
            "content",
        )
    } == {
        "worker_count": 3,
        "total_blocks": 6,
        "hbm_blocks": 3,
        "cpu_blocks": 3,
        "disk_blocks": 0,
        "hbm_nodes": 2,
        "offload": 1,
        "pending_pool": 1,
        "content": 0,
    }


# -- the C invariant checker (compiled index only) -----------------------------------------------
# check_invariants() walks the tree, both tiers and the two-phase state; each
# _corrupt_for_test kind breaks exactly one invariant, so these tests fail if the checker
# stops seeing that kind of damage.


def _c_index():
    index = pytest.importorskip("kvconductor._index")
    c = index.CoreIndex()
    for w, (g, tier) in enumerate([(0, 0), (0, 1), (1, 1), (1, 2)]):
        c.set_worker(w, g, tier)
    c.store(0, None, [1, 2, 3], [4, 5, 6])
    c.store(1, None, [1, 2], [4, 5])
    c.offload([9, 10], [4, 5], None, 0.0)  # offload entries
    c.pool_store(2, [11, 12], 0.0)  # pending waiters
    c.pool_store(1, [9], 0.0)  # content entry, applied
    c.check_invariants()
    return c


def test_check_invariants_holds_through_two_phase():
    c = _c_index()
    c.offload([11], [7], None, 1.0)  # a waiter applied
    c.check_invariants()
    c.evict(1, [9, 2])
    c.clear(2)
    c.check_invariants()
    c.sweep(10.0, 0.0, 0.0, 0.0)
    c.check_invariants()
    assert c.stats()["pending"] == c.stats()["offload"] == c.stats()["content"] == 0


@pytest.mark.parametrize("kind", ["npending", "record_freed", "hbm_pairs", "cpu_total"])
def test_check_invariants_sees_corruption(kind):
    c = _c_index()
    c._corrupt_for_test(kind)
    with pytest.raises(AssertionError):
        c.check_invariants()


# -- Index.trace (POST /explain) ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_trace_counts_equal_query_on_random_stores(ix, seed):
    """Seeded random stores in all tiers (several instances, DPs and backends, shared and
    forked chains); for random prompts, every group's trace counts are the query's."""
    import random

    rng = random.Random(seed)
    keys = [
        key(inst, medium, dp, backend)
        for inst in ("inst-a", "inst-b")
        for dp in (0, 1)
        for medium, backend in ((Medium.NPU, None), (Medium.CPU, "10.0.0.1"), (Medium.DISK, None))
    ]
    for _ in range(40):
        k = rng.choice(keys)
        start = rng.randrange(0, 6)
        n = rng.randrange(1, 7 - start)
        # engine hashes: mostly the shared ones (chains meet), sometimes another seed's
        base = rng.choice([0, 0, 0, 100])
        ehashes = [E[i] + base for i in range(start, start + n)]
        parent = None if start == 0 else E[start - 1] + rng.choice([0, 0, 100])
        tokens = toks(start, start + n)
        if rng.random() < 0.2:
            tokens = [t + 1 for t in tokens]  # other content at these positions
        try:
            ix.store(k, parent, ehashes, list(hash_blocks(tokens, BS)))
        except (ParentBlockNotFound, InvalidBlockSequence):
            pass
    for _ in range(20):
        n = rng.randrange(0, 7)
        prompt = toks(n)
        if n and rng.random() < 0.3:
            i = rng.randrange(len(prompt))
            prompt = prompt[:i] + [7] + prompt[i + 1 :]
        hits = {(h.instance_id, h.dp_rank): h[2:] for h in ix.query(prompt, BS).hits}
        traced = {(g.instance_id, g.dp_rank): g.blocks for g in ix.trace(prompt, BS)}
        assert {k: v for k, v in traced.items() if sum(v)} == hits, prompt
        for g in ix.trace(prompt, BS):
            for t in range(3):
                assert g.reach[t] == sum(g.blocks[: t + 1])
                assert g.held[t] == sum(
                    ix.worker_blocks(w.key) for w in g.workers if Medium(w.key.medium).tier == t
                )


# -- muted workers (a source down past --source-down-secs) ----------------------------------


def test_muted_hbm_worker_gives_no_hits_and_no_breakpoint(ix):
    ix.store_tokens(NPU_A, None, E[:3], toks(3), BS)
    ix.store_tokens(CPU_A, E[2], E[3:4], toks(3, 4), BS)  # continues after HBM block 3
    ix.store_tokens(NPU_B, None, E[:1], toks(1), BS)
    both = {
        "inst-a": {"longest_matched": 16, "DP": {"0": dp(3, 1, 0)}},
        "inst-b": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}},
    }
    assert query(ix, 4) == both
    assert ix.set_muted(NPU_A, True) is True
    assert ix.is_muted(NPU_A) and not ix.is_muted(CPU_A)
    # inst-a's HBM run is gone, and with it the breakpoint its CPU tail continued from;
    # inst-b is untouched
    assert query(ix, 4) == {"inst-b": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}
    # state is kept and still takes updates while muted
    assert ix.worker_blocks(NPU_A) == 3
    ix.store_tokens(NPU_A, E[2], E[3:5], toks(3, 5), BS)
    assert ix.worker_blocks(NPU_A) == 5
    assert query(ix, 5) == {"inst-b": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}
    ix.set_muted(NPU_A, False)
    assert query(ix, 5) == {
        "inst-a": {"longest_matched": 20, "DP": {"0": dp(5, 0, 0)}},
        "inst-b": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}},
    }


def test_muted_lower_worker_gives_no_root_walk(ix):
    ix.store_tokens(CPU_A, None, E[:2], toks(2), BS)
    ix.store_tokens(DISK_A, E[1], E[2:3], toks(2, 3), BS)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(0, 2, 1)}}}
    ix.set_muted(CPU_A, True)
    assert query(ix, 3) == {}
    ix.set_muted(DISK_A, True)
    ix.set_muted(CPU_A, False)
    assert query(ix, 3) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(0, 2, 0)}}}


def test_mute_of_an_unknown_worker(ix):
    assert ix.set_muted(NPU_A, True) is False
    assert not ix.is_muted(NPU_A)
    with pytest.raises(KeyError):
        ix.core.set_muted(99, True)


def test_trace_of_a_muted_worker(ix):
    ix.store_tokens(NPU_A, None, E[:3], toks(3), BS)
    ix.store_tokens(CPU_A, E[2], E[3:4], toks(3, 4), BS)
    ix.set_muted(NPU_A, True)
    (g,) = ix.trace(toks(4), BS)
    # the muted HBM run gives no breakpoint: the CPU block after it cannot be reached, and
    # the CPU tier holds no first block of its own
    assert g.blocks == (0, 0, 0) and g.reach == (0, 0, 0)
    assert g.stops == ("muted", "no_first_block", "no_worker") and g.held == (3, 1, 0)
    assert [(w.key, w.reach, w.stop) for w in g.workers] == [
        (NPU_A, 0, "muted"),
        (CPU_A, 0, "no_first_block"),
    ]
    ix.set_muted(NPU_A, False)
    (g,) = ix.trace(toks(4), BS)
    assert g.blocks == (3, 1, 0) and g.stops == ("tier_exhausted", "end_of_prompt", "no_worker")


# -- dump and restore (kvconductor.state.dump) -----------------------------------------------------


def _core_with_workers(impl):
    core = Index("model", TENANT, impl=impl).core
    core.set_worker(0, 0, 0)  # HBM
    core.set_worker(1, 1, 0)  # HBM
    core.set_worker(2, 0, 1)  # CPU
    return core


def test_block_of_gives_the_parent_and_local_hash_on_every_tier(impl):
    """``block_of``: ``parent_of``'s parent and the block's local hash (a shared store
    places a block after its HBM holder's chain with them)."""
    core = _core_with_workers(impl)
    core.store(0, None, [1, 2, 3], [11, 12, 13])
    assert [core.block_of(0, h) for h in (1, 2, 3)] == [(None, 11), (1, 12), (2, 13)]
    core.remove(0, [1])
    assert core.block_of(0, 2) == (None, 12)  # the parent is no longer held
    with pytest.raises(KeyError):
        core.block_of(0, 1)
    with pytest.raises(KeyError):
        core.block_of(99, 1)
    core.store(2, 7, [5, 6], [15, 16])  # CPU: the parent is kept as stored
    assert core.block_of(2, 5) == (7, 15) and core.block_of(2, 6) == (5, 16)


def test_restore_hbm_keeps_a_block_whose_parent_its_worker_no_longer_holds(impl):
    core = _core_with_workers(impl)
    core.store(0, None, [1, 2, 3], [11, 12, 13])
    core.store(1, None, [21, 22], [11, 12])
    core.remove(0, [1])  # worker 0 keeps 2 and 3 under a node it no longer holds
    parents, locs, node, worker, ehash = core.export_hbm()
    assert list(parents) == [0xFFFFFFFF, 0, 1]  # every parent before its children
    assert list(locs) == [11, 12, 13]
    fresh = _core_with_workers(impl)
    assert fresh.restore_hbm(parents, locs, node, worker, ehash) == 4
    assert fresh.parent_of(0, 2) is None and fresh.parent_of(0, 3) == 2
    assert fresh.parent_of(1, 22) == 21
    for q in ([11], [11, 12], [11, 12, 13], [12, 13]):
        assert fresh.match(q) == core.match(q), q
    assert dict(fresh.stats(), nbytes=0) == dict(core.stats(), nbytes=0)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (([0, 0xFFFFFFFF], [11, 12], [0], [0], [5]), "parent row follows its child"),
        (([0xFFFFFFFF], [11], [1], [0], [5]), "out of range"),
        (([0xFFFFFFFF], [11, 12], [0], [0], [5]), "column lengths differ"),
        (([0xFFFFFFFF], [11], [0], [2], [5]), "worker 2 is unknown or not an HBM worker"),
        (([0xFFFFFFFF], [11], [0], [7], [5]), "worker 7 is unknown or not an HBM worker"),
        (([0xFFFFFFFF], [11], [0, 0], [0, 0], [5, 6]), "holds a block twice"),
    ],
)
def test_restore_hbm_refuses_a_malformed_table(impl, table, message):
    with pytest.raises(ValueError, match=message):
        _core_with_workers(impl).restore_hbm(*table)


def test_restore_tier_refuses_rows_of_another_tier_or_refused_rows(impl):
    core = _core_with_workers(impl)
    with pytest.raises(ValueError, match="worker 0 is unknown or not of tier 1"):
        core.restore_tier(1, [0], [5], [11], [0], [0])
    with pytest.raises(ValueError, match="column lengths differ"):
        core.restore_tier(1, [2], [5], [11], [0], [0, 0])
    # the edge (root, 11) -> 5 exists; the same worker cannot map 5 under another key
    assert core.restore_tier(1, [2], [5], [11], [0], [0]) == 1
    with pytest.raises(ValueError, match=r"row 0 \(block 5 of worker 2\) refused"):
        core.restore_tier(1, [2], [5], [12], [9], [1])


def test_restore_twophase_keeps_times_and_refuses_duplicates(impl):
    core = _core_with_workers(impl)
    core.restore_twophase([(0, 7, 77, None, 5.0), (1, 8, 88, 7, 6.0)], [(9, 2, 4.0), (9, 0, 3.0)])
    records, waits = core.export_twophase()
    assert sorted(records) == [(0, 7, 77, None, 5.0), (1, 8, 88, 7, 6.0)]
    assert waits == [(9, 2, 4.0), (9, 0, 3.0)]  # newest first, as given
    assert core.sweep(7.0, 3.5, 1000.0, 1000.0) == 1  # the wait of t=3.0 is 4s old
    with pytest.raises(ValueError, match="two-phase record for hash 7 given twice"):
        core.restore_twophase([(1, 7, 77, None, 5.0)], [])
    with pytest.raises(ValueError, match="worker 2 waits twice for hash 9"):
        core.restore_twophase([], [(9, 2, 1.0)])
    with pytest.raises(ValueError, match="pending wait of unknown worker 5"):
        core.restore_twophase([], [(9, 5, 1.0)])
    with pytest.raises(ValueError, match="two-phase record of kind 3"):
        core.restore_twophase([(3, 1, 1, None, 1.0)], [])


def test_a_reannounced_block_goes_with_one_removal(ix):
    """vLLM's per-request ``kv_cache_report_mode="full"`` re-announces blocks reused from the
    prefix cache as BlockStored: a re-announcement is no second holding (llm-d's review
    found the opposite), so one BlockRemoved removes the block, on every tier."""
    h = H[:3]
    ix.store_tokens(NPU_A, None, E[:3], toks(3), BS)
    # the full chain again, then its middle again under its parent
    ix.store_tokens(NPU_A, None, E[:3], toks(3), BS)
    ix.store_tokens(NPU_A, E[0], E[1:3], toks(1, 3), BS)
    assert ix.worker_blocks(NPU_A) == 3
    assert query(ix, 3) == {"inst-a": {"longest_matched": 12, "DP": {"0": dp(3, 0, 0)}}}
    # one removal of the last block: 2 blocks left, a second removal finds nothing
    assert ix.evict(NPU_A, [E[2]]) == 1
    assert ix.worker_blocks(NPU_A) == 2
    assert ix.evict(NPU_A, [E[2]]) == 0
    assert query(ix, 3) == {"inst-a": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}
    # the rest, once each: nothing is left
    assert ix.evict(NPU_A, [E[1]]) == 1
    assert ix.evict(NPU_A, [E[0]]) == 1
    assert ix.worker_blocks(NPU_A) == 0
    assert query(ix, 3) == {}
    # a CPU block held directly (a store-only source), announced twice, removed once
    ix.store(CPU_A, None, E[:2], h[:2])
    ix.store(CPU_A, None, E[:2], h[:2])
    assert ix.worker_blocks(CPU_A) == 2
    assert ix.remove(CPU_A, [E[1]]) == 1
    assert ix.worker_blocks(CPU_A) == 1
    assert query(ix, 2) == {"inst-a": {"longest_matched": 4, "DP": {"0": dp(0, 1, 0)}}}
