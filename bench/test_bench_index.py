"""In-process index benchmarks: hashing, store throughput, match latency, memory."""

import array

import pytest

from bench.conftest import BLOCK, EVENT_BLOCKS, make_tokens

pytestmark = pytest.mark.benchmark(group="index")


@pytest.mark.parametrize("ntok", [1_000, 16_000, 128_000, 1_000_000])
def test_hash_tokens(benchmark, ntok):
    from kvconductor._hash import hash_blocks

    toks = make_tokens(ntok, 7)
    benchmark.group = "hash"
    out = benchmark(hash_blocks, toks, BLOCK)
    assert len(out) == -(-ntok // BLOCK)


@pytest.mark.parametrize("ntok", [1_000, 16_000, 128_000, 1_000_000])
def test_match_full_hit(benchmark, big_index, ntok):
    """Match a prompt that 8 workers hold entirely (the worst case: a full walk)."""
    ix, doc = big_index
    prompt = array.array("I", doc[:ntok])
    benchmark.group = "match (hash + HBM walk), 1M-pair index"
    res = benchmark(ix.query, prompt, BLOCK)
    assert len(res) == 8 and res.hits[0].npu_blocks == -(-ntok // BLOCK) - (
        1 if ntok % BLOCK else 0
    )


@pytest.mark.parametrize("ntok", [1_000_000])
def test_match_full_hit_python_list(benchmark, big_index, ntok):
    """The same full hit with the prompt as a Python list of ints (in-process callers):
    the list becomes a u32 buffer through array's own C loop first."""
    ix, doc = big_index
    prompt = doc[:ntok].tolist()
    benchmark.group = "match (hash + HBM walk), 1M-pair index"
    res = benchmark(ix.query, prompt, BLOCK)
    assert len(res) == 8 and res.hits[0].npu_blocks == ntok // BLOCK


def test_tokens_from_python_list_1m(benchmark):
    """1M Python ints -> u32 buffer (``to_u32_tokens``), alone."""
    from kvconductor._hash import to_u32_tokens

    toks = make_tokens(1_000_000, 5).tolist()
    benchmark.group = "hash"
    out = benchmark(to_u32_tokens, toks)
    assert len(out) == 1_000_000 and out[0] == toks[0]


def test_match_miss_1m(benchmark, big_index):
    """A 1M-token prompt that matches nothing after 0 blocks: lazy hashing pays off."""
    ix, _ = big_index
    prompt = make_tokens(1_000_000, 99)
    benchmark.group = "match (hash + HBM walk), 1M-pair index"
    res = benchmark(ix.query, prompt, BLOCK)
    assert len(res) == 0


# -- many holders: round-robin routing over thousands of workers ------------------------------
# A system prompt's first block on every worker, then each worker a 24-block prompt of its
# own (Mooncake's conversation trace routed round-robin): every answer lists every worker.
MANY_CONT = 24


def _many_holders_events(workers):
    """Per worker one store event from the root: the shared block (its own engine hash),
    then its own 24 blocks; and one query per worker (the prompt it holds)."""
    import random

    rnd = random.Random(workers)
    first = rnd.getrandbits(64)
    events, queries = [], []
    for w in range(workers):
        locs = array.array("Q", [first] + [rnd.getrandbits(64) for _ in range(MANY_CONT)])
        seqs = array.array("Q", range((w + 1) << 40, ((w + 1) << 40) + len(locs)))
        events.append((w, None, seqs, locs))
        queries.append(locs)
    return events, queries


def _many_holders_core(workers):
    from kvconductor._index import CoreIndex

    events, queries = _many_holders_events(workers)
    core = CoreIndex()
    for w in range(workers):
        core.set_worker(w, w, 0)
    for ev in events:
        core.store(*ev)
    return core, queries


@pytest.mark.parametrize("workers", [1_024, 7_000])
def test_match_many_holders(benchmark, workers):
    """``CoreIndex.match`` of one worker's prompt when its first block is on every worker:
    the answer has a row per worker (the walk, and the Python rows of ``match``)."""
    core, queries = _many_holders_core(workers)
    rnd = iter(range(10**9))
    benchmark.group = "match, first block on every worker (round-robin shape)"
    res = benchmark(lambda: core.match(queries[next(rnd) * 7919 % workers]))
    assert len(res) == workers and max(r[1] for r in res) == 1 + MANY_CONT
    benchmark.extra_info["wide_nodes"] = core.hbm_layout().get("wide_nodes", 0)
    core.close()


WALKS_PER_CALL = 100


@pytest.mark.parametrize("workers", [1_024, 7_000])
def test_walk_many_holders(benchmark, workers):
    """The same queries through the HBM tree's walk alone (``RadixTree._match_count``:
    the C match, no Python row per result), 100 queries per call."""
    from kvconductor._tree import RadixTree

    events, queries = _many_holders_events(workers)
    t = RadixTree()
    for ev in events:
        t.store(*ev)
    picked = [queries[i * 7919 % workers] for i in range(WALKS_PER_CALL)]
    hashes = array.array("Q", [h for q in picked for h in q])
    ends = array.array("Q", range(len(picked[0]), len(hashes) + 1, len(picked[0])))
    benchmark.group = "walk alone, first block on every worker, 100 queries per call"
    total = benchmark(t._match_count, hashes, ends)
    assert total == WALKS_PER_CALL * workers
    benchmark.extra_info["queries_per_call"] = WALKS_PER_CALL


@pytest.mark.parametrize("workers", [1_024, 7_000])
def test_store_many_holders(benchmark, workers):
    """The index above built: one 25-block store event per worker, every one through the
    shared first block."""
    from kvconductor._index import CoreIndex

    events, _ = _many_holders_events(workers)

    def run():
        core = CoreIndex()
        for w in range(workers):
            core.set_worker(w, w, 0)
        for ev in events:
            core.store(*ev)
        return core

    benchmark.group = "store, first block on every worker (round-robin shape)"
    core = benchmark.pedantic(run, rounds=3, iterations=1)
    assert core.stats()["hbm_pairs"] == workers * (1 + MANY_CONT)
    benchmark.extra_info["stores_per_round"] = workers
    benchmark.extra_info["bytes_per_pair"] = round(
        core.stats()["nbytes"] / core.stats()["hbm_pairs"], 1
    )


def test_store_throughput(benchmark):
    """Blocks stored per second (32-block events, 64 workers, precomputed hashes)."""
    from kvconductor._hash import hash_blocks
    from kvconductor._index import CoreIndex

    toks = make_tokens(4096 * BLOCK, 3)
    hashes = hash_blocks(toks, BLOCK)
    seqs = [
        array.array("Q", range((w + 1) << 32, ((w + 1) << 32) + len(hashes))) for w in range(64)
    ]
    events = []
    for w in range(64):
        for i in range(0, len(hashes), EVENT_BLOCKS):
            parent = None if i == 0 else seqs[w][i - 1]
            events.append((w, parent, seqs[w][i : i + EVENT_BLOCKS], hashes[i : i + EVENT_BLOCKS]))

    def run():
        core = CoreIndex()
        for w in range(64):
            core.set_worker(w, w, 0)
        for w, parent, s, h in events:
            core.store(w, parent, s, h)
        return core

    benchmark.group = "store"
    core = benchmark.pedantic(run, rounds=3, iterations=1)
    assert core.stats()["hbm_pairs"] == 64 * len(hashes)
    benchmark.extra_info["blocks_per_round"] = 64 * len(hashes)


def _memory_info(core):
    s = core.stats()
    lay = core.hbm_layout()
    pairs = s["hbm_pairs"]
    return {
        "pairs": pairs,
        "nodes": s["nodes"],
        "nbytes": s["nbytes"],
        "bytes_per_pair": round(s["nbytes"] / pairs, 1),
        "used_bytes_per_pair": round(lay["used_bytes"] / pairs, 1),
        "member_records": lay["records_live"],
        "edge_slots": lay["edge_slots"],
        "rev_slots": lay["rev_slots"],
    }


def test_memory_per_pair(big_index, benchmark):
    """Bytes of C structures per (worker, block) pair on the mixed index (reported in
    extra_info: ``bytes_per_pair`` allocated, ``used_bytes_per_pair`` touched)."""
    ix, _ = big_index
    benchmark.group = "memory"
    info = _memory_info(ix.core)
    benchmark.extra_info.update(info)
    benchmark(ix.core.stats)
    assert info["pairs"] > 900_000


def test_memory_per_pair_disjoint(benchmark):
    """The same on 64 disjoint 15,625-block chains (1M pairs, every node held by one
    worker: no sharing to amortise a node over)."""
    from kvconductor._hash import hash_blocks
    from kvconductor._index import CoreIndex

    core = CoreIndex()
    for w in range(64):
        core.set_worker(w, w, 0)
        hashes = hash_blocks(make_tokens(15_625 * BLOCK, 500 + w), BLOCK)
        seqs = array.array("Q", range((w + 1) << 40, ((w + 1) << 40) + len(hashes)))
        parent = None
        for i in range(0, len(hashes), EVENT_BLOCKS):
            core.store(w, parent, seqs[i : i + EVENT_BLOCKS], hashes[i : i + EVENT_BLOCKS])
            parent = seqs[min(i + EVENT_BLOCKS, len(hashes)) - 1]
    benchmark.group = "memory"
    info = _memory_info(core)
    benchmark.extra_info.update(info)
    benchmark(core.stats)
    assert info["pairs"] == info["nodes"] == 1_000_000 and info["member_records"] == 0
