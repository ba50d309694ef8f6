"""One ``/metrics`` scrape (collect + text exposition) over a ~1M-block index."""

import pytest

pytestmark = pytest.mark.benchmark(group="metrics")

SOURCES = 64


class _Sources:
    """64 subscriptions' rows, as ``SubscriptionManager.metrics_snapshot`` gives them."""

    def metrics_snapshot(self):
        from kvconductor.ingest.subscriber import RetiredTotals, SourceMetrics
        from kvconductor.keys import Medium

        rows = [
            SourceMetrics(
                f"inst-{i // 8}",
                i % 8,
                (Medium.NPU,),
                "vllm",
                1000,
                {"parent_not_found": 1},
                0,
                1,
                0,
                True,
                0.0,
                False,
                0,
                0,
            )
            for i in range(SOURCES)
        ]
        return rows, RetiredTotals()


def test_scrape_1m_block_index(benchmark, big_index):
    """Everything a scrape does: sizes() of the index under its read lock, the
    subscription rows, the query families, and the text encoding."""
    from kvconductor.http.metrics import Metrics
    from kvconductor.state.conductor import Conductor

    c = Conductor()
    ix, _ = big_index  # bench/conftest.py build_index: ~1M (worker, block) pairs
    c.indexes[("bench", "default")] = ix
    c.subs = _Sources()
    m = Metrics(c)
    out = benchmark(m.exposition)
    assert b'kvconductor_index_blocks{model="bench",tenant="default",tier="npu"}' in out
    benchmark.extra_info["bytes"] = len(out)
