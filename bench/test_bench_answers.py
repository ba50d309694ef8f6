"""Answers with many holders (round-robin routing): one prefix held by 1,024 and 7,000
workers, so every answer lists every worker (``bench/many_holders.py`` has the setup and a
before/after runner). Not asserted: ``pytest bench/test_bench_answers.py --benchmark-only``."""

import pytest

from bench.many_holders import build

pytestmark = pytest.mark.benchmark(group="answers, many holders")


@pytest.fixture(scope="module", params=[1024, 7000])
def holders(request):
    ix, chain = build(request.param)
    return request.param, ix, chain


def test_query_by_hash(benchmark, holders):
    w, ix, chain = holders
    res = benchmark(ix.query_by_hash, chain)
    assert len(res) == w


def test_query_by_hash_top_k_8(benchmark, holders):
    w, ix, chain = holders
    res = benchmark(lambda: ix.query_by_hash(chain, top_k=8))
    assert len(res) == 8  # at most k rows (docs/api.md, "top_k and instances")


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_encode_result(benchmark, holders, fmt):
    from kvconductor.wire import encode_result

    w, ix, chain = holders
    res = ix.query_by_hash(chain)
    out = benchmark(encode_result, res, "default", 1, fmt == "msgpack")
    assert len(out) > 80 * w


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_encode_result_from_dphits(benchmark, holders, fmt):
    """The old path for comparison: the same answer from a list of DpHit rows."""
    from kvconductor import _encode

    w, ix, chain = holders
    hits = ix.query_by_hash(chain).hits
    out = benchmark(_encode.encode_result, hits, "default", 1, fmt == "msgpack")
    assert len(out) > 80 * w


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_encode_result_with_freshness(benchmark, holders, fmt):
    """The same answer with ``"freshness": true``: every row also says its state and age."""
    from bench.many_holders import _freshness_table, _sources
    from kvconductor.wire import encode_fresh

    w, ix, chain = holders
    res = ix.query_by_hash(chain)
    table = _freshness_table(ix, _sources(w))
    mp = fmt == "msgpack"
    fresh = (table.groups(res.names.keys), 1.0e9, table.tail[mp])
    out = benchmark(encode_fresh, res, "default", 1, mp, fresh)
    assert out.count(b"last_event_age_ms") == w
