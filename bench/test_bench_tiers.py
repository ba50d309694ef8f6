"""Tiered query (HBM + CPU + Disk), two-phase join throughput, lower-tier memory."""

import array

import pytest

from bench.conftest import BLOCK, DOC_BLOCKS, EVENT_BLOCKS, make_tokens

GROUPS = 8


def _tiered_index():
    """8 (instance, DP) groups hold the 1M-token document across three tiers:
    HBM blocks [0, N/4), CPU [N/4, N/2) chained after HBM, Disk [N/2, N) after CPU."""
    from kvconductor._hash import hash_blocks
    from kvconductor.index import Index
    from kvconductor.keys import Medium, WorkerKey

    ix = Index("bench", "default")
    doc = make_tokens(DOC_BLOCKS * BLOCK, 1)
    H = hash_blocks(doc, BLOCK)
    q1, q2 = DOC_BLOCKS // 4, DOC_BLOCKS // 2
    for g in range(GROUPS):
        seqs = array.array("Q", range((g + 1) << 40, ((g + 1) << 40) + DOC_BLOCKS))
        for medium, lo, hi in (
            (Medium.NPU, 0, q1),
            (Medium.CPU, q1, q2),
            (Medium.DISK, q2, DOC_BLOCKS),
        ):
            key = WorkerKey("inst", "inst", g, medium)
            for i in range(lo, hi, EVENT_BLOCKS):
                j = min(i + EVENT_BLOCKS, hi)
                ix.store(key, None if i == 0 else seqs[i - 1], seqs[i:j], H[i:j])
    return ix, doc


@pytest.fixture(scope="module")
def tiered():
    return _tiered_index()


@pytest.mark.parametrize("ntok", [1_000, 16_000, 128_000, 1_000_000])
def test_tiered_query(benchmark, tiered, ntok):
    ix, doc = tiered
    prompt = array.array("I", doc[:ntok])
    benchmark.group = "tiered query (hash + HBM + CPU + Disk)"
    res = benchmark(ix.query, prompt, BLOCK)
    full = ntok // BLOCK
    h = res.hits[0]
    assert len(res) == GROUPS and h.npu_blocks + h.cpu_blocks + h.disk_blocks == min(
        full, DOC_BLOCKS
    )


def test_two_phase_join(benchmark):
    """Engine offload of 32-block events, then the pool confirms them for 8 DPs."""
    from kvconductor._hash import hash_blocks
    from kvconductor._index import CoreIndex

    H = hash_blocks(make_tokens(8192 * BLOCK, 5), BLOCK)
    seqs = array.array("Q", range(1 << 40, (1 << 40) + len(H)))

    def run():
        core = CoreIndex()
        for w in range(8):
            core.set_worker(w, w, 1)
        for i in range(0, len(H), EVENT_BLOCKS):
            j = i + EVENT_BLOCKS
            core.offload(seqs[i:j], H[i:j], None if i == 0 else seqs[i - 1], 0.0)
            for w in range(8):
                core.pool_store(w, seqs[i:j], 1.0)
        return core

    benchmark.group = "two-phase join"
    core = benchmark.pedantic(run, rounds=3, iterations=1)
    assert core.stats()["cpu_blocks"] == 8 * len(H)
    benchmark.extra_info["blocks_confirmed_per_round"] = 8 * len(H)


def test_lower_tier_memory(benchmark, tiered):
    ix, _ = tiered
    s = ix.core.stats()
    lower = s["cpu_blocks"] + s["disk_blocks"]
    benchmark.group = "memory"
    benchmark.extra_info.update(lower_blocks=lower, nbytes=s["nbytes"])
    benchmark(ix.core.stats)
    assert lower == GROUPS * (DOC_BLOCKS - DOC_BLOCKS // 4)


def test_lower_tier_store(benchmark):
    """Blocks stored per second into one lower tier (64 workers, 32-block chained stores;
    every worker has its own engine hashes for the same content)."""
    from kvconductor._hash import hash_blocks
    from kvconductor._lower import LowerTier

    H = hash_blocks(make_tokens(4096 * BLOCK, 6), BLOCK)
    seqs = [array.array("Q", range((w + 1) << 32, ((w + 1) << 32) + len(H))) for w in range(64)]
    events = [
        (
            w,
            None if i == 0 else seqs[w][i - 1],
            seqs[w][i : i + EVENT_BLOCKS],
            H[i : i + EVENT_BLOCKS],
        )
        for w in range(64)
        for i in range(0, len(H), EVENT_BLOCKS)
    ]

    def run():
        tier = LowerTier()
        for w, parent, s, h in events:
            tier.store(w, parent, s, h)
        return tier

    benchmark.group = "store"
    tier = benchmark.pedantic(run, rounds=3, iterations=1)
    assert tier.total_blocks == 64 * len(H)
    benchmark.extra_info["blocks_per_round"] = 64 * len(H)
