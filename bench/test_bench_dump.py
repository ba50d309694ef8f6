"""The index dump (``GET /debug/dump``, ``--load-dump``) of a ~1M-pair index, and
``/explain``'s per-worker trace next to the plain match it explains."""

import pytest

from bench.conftest import BLOCK, make_tokens

pytestmark = pytest.mark.benchmark(group="dump")


def _conductor(ix=None):
    from kvconductor.state.conductor import Conductor

    c = Conductor()
    if ix is not None:
        c.indexes[("bench", "default")] = ix
    return c


def _dump(c):
    """``write_dump`` minus the hop to the ingest thread (this thread stands in for it:
    nothing else writes the index here)."""
    from kvconductor.state.dump import encode, snapshot

    return encode(snapshot(c))


@pytest.fixture(scope="module")
def dumped(big_index):
    ix, _ = big_index
    return b"".join(_dump(_conductor(ix)))


def test_snapshot_and_encode_1m_pairs(benchmark, big_index):
    """What ``GET /debug/dump`` does: the snapshot (on the ingest thread in the service)
    and the record encoding (streamed)."""
    ix, _ = big_index
    c = _conductor(ix)
    size = benchmark(lambda: sum(len(b) for b in _dump(c)))
    benchmark.extra_info["dump_bytes"] = size
    assert size > 1_000_000 * 20  # ehash + member rows of every pair at least


def test_load_1m_pairs(benchmark, big_index, dumped):
    """``--load-dump``: decode, restore the core tables, check the invariants."""
    from kvconductor.state.dump import load_dump

    ix, _ = big_index

    def load():
        c = _conductor()
        assert load_dump(c, [dumped]) == {
            "sources": 0,
            "registrations": 0,
            "indexes": 1,
            "skipped": 0,
        }
        return c

    c = benchmark.pedantic(load, rounds=3, iterations=1)
    want = {k: v for k, v in ix.summary().items() if k != "bytes"}
    got = {k: v for k, v in c.indexes[("bench", "default")].summary().items() if k != "bytes"}
    assert got == want


@pytest.fixture(scope="module")
def hit_4k(big_index):
    _, doc = big_index
    return doc[: 256 * BLOCK]  # 4k tokens, cached by 8 workers


def test_match_4k_hit(benchmark, big_index, hit_4k):
    ix, _ = big_index
    rows = benchmark(ix.query, hit_4k, BLOCK)
    assert len(rows) == 8


def test_trace_4k_hit(benchmark, big_index, hit_4k):
    """``/explain``'s core step for the same prompt: one row per worker (64)."""
    ix, _ = big_index
    groups = benchmark(ix.trace, hit_4k, BLOCK)
    assert groups


def test_trace_4k_miss(benchmark, big_index):
    ix, _ = big_index
    groups = benchmark(ix.trace, make_tokens(256 * BLOCK, 99), BLOCK)
    assert groups
