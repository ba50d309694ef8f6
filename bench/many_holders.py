"""Answers with thousands of holders: one prefix held by every worker (round-robin routing).

W workers (one instance each, DP 0) hold the first 1 + w % 4 blocks of one 8-block chain
(plus 4 blocks of their own), so a query of that chain hits every worker at depth 1..4:
the answer lists W (instance, DP) rows. Measured per call (p50, p99, ops/s):

* ``core.match``: the core alone, returning a Python list of rows (the floor of the old path);
* ``Index.query_by_hash``: the in-process API (the old code built a DpHit per row here);
* ``answer msgpack`` / ``answer json``: the server's whole ``/query_by_hash`` answer
  without HTTP (``QueryResource.answer``: parse, match, metrics, encode);
* ``answer msgpack top_k=8``: the same with the extension (only on trees that have it);
* ``answer msgpack/json freshness``: the answer of a ``"freshness": true`` query (every
  holder with one source, every tenth degraded), and the states' rebuild after a change
  (``freshness table``: ``collect`` over one source per holder, the table, its groups);
  the per-row cost of the flag is printed (only on trees that have it).

Runs against whatever ``kvconductor`` is importable (``PYTHONPATH=<other tree>`` measures
another checkout with the same file), so before/after runs alternate on one machine::

    python bench/many_holders.py --workers 1024 7000 --repeat 3

glibc's malloc is tuned as the server processes tune it (``kvconductor.serve.tuning.
tune_malloc``, applied here by hand so that older checkouts are measured the same way);
``--glibc-defaults`` leaves it alone (each large answer then faults its pages in again).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import msgspec


def build(workers: int) -> tuple[Any, list[int]]:
    from kvconductor.index import Index
    from kvconductor.keys import Medium, WorkerKey

    ix = Index("m", "default")
    chain = [0x1000 + b for b in range(8)]
    for w in range(workers):
        key = WorkerKey(f"worker-{w}", f"worker-{w}", 0, Medium.NPU)
        d = 1 + w % 4
        own = [0x10_0000 + 8 * w + b for b in range(4)]
        ehashes = [w * 64 + b for b in range(d + 4)]
        ix.store(key, None, ehashes, chain[:d] + own)
    return ix, chain


def _fake_conductor(ix: Any, table: Any = None) -> Any:
    class C:
        block_sizes: dict = {}
        lora_seeds: dict = {}

        def get_index(self, model: str, tenant: str) -> Any:
            return ix

        def freshness(self, model: str, tenant: str) -> Any:
            return table

    return C()


def _sources(workers: int) -> list[Any]:
    """One source per holder, as ``kvconductor.ingest.freshness.collect`` reads them."""
    from types import SimpleNamespace

    now = time.time()
    return [
        SimpleNamespace(
            ctx=SimpleNamespace(
                model="m", tenant="default", is_pool=False, instance_id=f"worker-{w}", dp_rank=0
            ),
            state="degraded" if w % 10 == 0 else "live",
            muted=False,
            closed=False,
            stats=SimpleNamespace(last_event=now - w * 1e-3),
            tracker=SimpleNamespace(degraded_since=now - 5.0 if w % 10 == 0 else None),
        )
        for w in range(workers)
    ]


def _freshness_table(ix: Any, subs: list[Any]) -> Any:
    from kvconductor.ingest.freshness import FreshnessTable, collect

    by_key, counts = collect(subs, "m", "default")
    table = FreshnessTable(by_key, counts)
    table.groups(ix.names.keys)
    return table


def timed(fn: Any, n: int) -> tuple[float, float, float]:
    """(p50 µs, p99 µs, ops/s) of ``n`` calls after a short warm-up."""
    for _ in range(min(20, n)):
        fn()
    times = []
    t_all = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    total = time.perf_counter() - t_all
    times.sort()
    return times[len(times) // 2] / 1e3, times[int(len(times) * 0.99)] / 1e3, n / total


def run(workers: int, calls: int) -> list[tuple[str, float, float, float]]:
    from kvconductor.http.metrics import QueryMetrics
    from kvconductor.http.query import QueryResource

    ix, chain = build(workers)
    try:
        subs = _sources(workers)
        table = _freshness_table(ix, subs)
    except ImportError:  # a tree without freshness
        subs, table = [], None
    res = QueryResource(
        _fake_conductor(ix, table),
        by_hash=True,
        metrics=QueryMetrics(),
        max_body_bytes=1 << 20,
        api_key=None,
        large_body_bytes=1 << 20,
    )
    body = {"model": "m", "block_hashes": chain}
    mp, js = msgspec.msgpack.encode(body), msgspec.json.encode(body)
    status, data, *_ = res.answer(mp, True)
    assert status == 200 and len(msgspec.msgpack.decode(data)["default"]) == workers, data[:200]
    rows: list[tuple[str, float, float, float]] = [
        ("core.match", *timed(lambda: ix.core.match(chain), calls)),
        ("Index.query_by_hash", *timed(lambda: ix.query_by_hash(chain), calls)),
        ("answer msgpack", *timed(lambda: res.answer(mp, True), calls)),
        ("answer json", *timed(lambda: res.answer(js, False), calls)),
    ]
    ext = msgspec.msgpack.encode({**body, "top_k": 8})
    status, data, *_ = res.answer(ext, True)
    if status == 200 and len(msgspec.msgpack.decode(data)["default"]) < workers:
        n = len(msgspec.msgpack.decode(data)["default"])
        print(f"# answer top_k=8: msgpack {len(data)} bytes, {n} instances")
        rows.append(("answer msgpack top_k=8", *timed(lambda: res.answer(ext, True), calls)))
    if table is not None:
        fmp = msgspec.msgpack.encode({**body, "freshness": True})
        fjs = msgspec.json.encode({**body, "freshness": True})
        status, data, *_ = res.answer(fmp, True)
        assert status == 200 and b"degraded_for_ms" in data, data[:200]
        rows.append(("answer msgpack freshness", *timed(lambda: res.answer(fmp, True), calls)))
        rows.append(("answer json freshness", *timed(lambda: res.answer(fjs, False), calls)))
        rows.append(("freshness table", *timed(lambda: _freshness_table(ix, subs), calls)))
    sizes = len(res.answer(mp, True)[1]), len(res.answer(js, False)[1])
    print(f"# answer bytes: msgpack {sizes[0]}, json {sizes[1]}")
    return rows


def tune_malloc() -> None:
    """``kvconductor.serve.tuning.tune_malloc``'s settings (both thresholds at 32 MiB)."""
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 32 << 20)  # M_TRIM_THRESHOLD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1024, 7000])
    ap.add_argument("--calls", type=int, default=0, help="calls per measure (default by size)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--glibc-defaults", action="store_true", help="do not tune malloc")
    args = ap.parse_args()
    if not args.glibc_defaults:
        tune_malloc()
    import kvconductor

    print(f"# kvconductor from {kvconductor.__file__}; malloc tuned: {not args.glibc_defaults}")
    for w in args.workers:
        calls = args.calls or max(200, 2_000_000 // w)
        runs = [run(w, calls) for _ in range(args.repeat)]
        print(f"workers={w} calls={calls} repeat={args.repeat} (median of the repeats)")
        print(f"  {'measure':26s} {'p50 µs':>9s} {'p99 µs':>9s} {'ops/s':>9s}")
        for i, (name, *_) in enumerate(runs[0]):
            p50 = statistics.median(r[i][1] for r in runs)
            p99 = statistics.median(r[i][2] for r in runs)
            ops = statistics.median(r[i][3] for r in runs)
            print(f"  {name:26s} {p50:9.1f} {p99:9.1f} {ops:9.0f}")
        p50s = {r[0]: statistics.median(x[i][1] for x in runs) for i, r in enumerate(runs[0])}
        for fmt in ("msgpack", "json"):
            if f"answer {fmt} freshness" in p50s:
                extra = p50s[f"answer {fmt} freshness"] - p50s[f"answer {fmt}"]
                print(f"  freshness adds {extra / w * 1e3:.0f} ns per (instance, DP) ({fmt})")
        if "freshness table" in p50s:
            print(f"  states rebuilt: {p50s['freshness table'] / w * 1e3:.0f} ns per source")


if __name__ == "__main__":
    main()
