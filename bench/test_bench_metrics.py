"""One ``/metrics`` scrape (collect + text exposition): over a ~1M-block index, and at
4,096 sources (``--max-sources``' default; docs/performance.md, "/metrics at 4,096
sources")."""

import time

import pytest

pytestmark = pytest.mark.benchmark(group="metrics")


def _conductor(subs):
    from kvconductor.state.conductor import Conductor, ConductorConfig
    from kvconductor.state.protocols import NoSubscriptions

    c = Conductor(ConductorConfig(maintenance_interval=3600), subscriptions=NoSubscriptions)
    c.subs = subs
    return c


def test_scrape_1m_block_index(benchmark, big_index):
    """Everything a scrape does: sizes() of the index under its read lock, the
    subscription rows (64 plain sources), the query families, and the text encoding."""
    from kvconductor.http.metrics import Metrics
    from tests.helpers.sources import manager

    c = _conductor(manager(64, odd=False, base=time.time() - 100))
    ix, _ = big_index  # bench/conftest.py build_index: ~1M (worker, block) pairs
    c.indexes[("bench", "default")] = ix
    m = Metrics(c)
    out = benchmark(m.exposition)
    assert b'kvconductor_index_blocks{model="bench",tenant="default",tier="npu"}' in out
    benchmark.extra_info["bytes"] = len(out)
    c.stop()


def server_malloc() -> None:
    """The server's glibc malloc settings (``kvconductor.serve.tuning.tune_malloc``,
    applied at start: both thresholds at 32 MiB), by hand so that an older checkout's
    run can be given the same (``MALLOC_MMAP_THRESHOLD_=33554432
    MALLOC_TRIM_THRESHOLD_=33554432`` in its environment): with glibc's defaults each
    1.2 MB exposition comes from fresh pages, ~300 page faults a scrape that the server
    does not pay."""
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 32 << 20)  # M_TRIM_THRESHOLD


@pytest.mark.parametrize(
    ("odd", "moving"),
    [(False, None), (True, None), (True, "drops"), (True, "flapping")],
    ids=["plain", "mixed", "mixed-drops", "mixed-flapping"],
)
def test_scrape_4096_sources(benchmark, odd, moving):
    """4,096 real Subscription objects (hand-built, no sockets; tests/helpers/sources.py):
    plain live vLLM sources, or mixed (escaped labels, pools of two media, every state,
    drops, a few ages past 1e6 s), last batches about 100 s ago; the server's malloc
    settings. What a scrape keeps from the one before is read again when, before each
    scrape, one source drops a message (mixed-drops: the rare counters' sums) or
    connects or disconnects (mixed-flapping: the live and muted flags, and the text of
    the two 0/1 families)."""
    from kvconductor.http.metrics import Metrics
    from tests.helpers.sources import manager

    server_malloc()
    c = _conductor(manager(4096, odd=odd, base=time.time() - 100))
    m = Metrics(c)
    scrape = m.exposition
    sub = next(iter(c.subs._subs.values()))
    if moving == "drops":

        def scrape() -> bytes:
            sub.stats.drop("message_too_large")
            return m.exposition()

    elif moving == "flapping":

        def scrape() -> bytes:
            sub.connected = not sub.connected
            return m.exposition()

    out = benchmark(scrape)
    assert out.count(b"\nkvconductor_source_up{") >= 4096
    benchmark.extra_info["bytes"] = len(out)
    # the wall time includes the pauses between slices (other threads run then); the
    # CPU time of the scraping thread is what it holds the GIL for
    cpu = []
    for _ in range(20):
        t0 = time.thread_time()
        scrape()
        cpu.append(time.thread_time() - t0)
    cpu.sort()
    benchmark.extra_info["cpu_ms_min"] = round(cpu[0] * 1e3, 2)
    benchmark.extra_info["cpu_ms_median"] = round(cpu[10] * 1e3, 2)
    c.stop()
