"""The native answer per call: ``CoreIndex.match_rows`` beside Dynamo's ``find_matches``.

The trace of ``bench/trace_replay.py`` (conversation shape, round-robin over ``--workers``)
is replayed once into each index; then, on that final state, each times its own calls:

* ``wide``: the queries whose answer has a row for every worker (a 1,024-row answer at
  1,024 workers), ``--calls`` of them, best of ``--rounds`` passes, per call;
* ``miss``: a query of two blocks no worker holds (the fixed cost of a call);
* ``replay_store_ns_per_block``: the replay's store calls (as each index builds its
  state; the best of ``--replays`` replays into a fresh index), their time over the
  blocks they store;
* ``store_held`` (kvconductor only): a one-block store of a block the worker holds (the
  fixed cost of a store).

``per_row_ns`` is ``(wide - miss) / rows``. The two indexes are timed alternately, in the
same process. No timing is asserted anywhere (``bench/test_trace_replay.py`` runs it small).

    python bench/native_answer.py --workers 1024 --requests 3000
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from bench import trace_replay as tr

MISS = [0x1234_5678_9ABC, 0x0FED_CBA9_8765]
#: the number flags and their defaults (the issue's trace: 3,000 requests, 1,024 workers)
NUMBERS = {
    "requests": 3000,
    "seed": 0,
    "workers": 1024,
    "capacity": 2048,
    "calls": 200,
    "rounds": 30,
    "replays": 1,
}


def best_per_call(fn: Callable[[Any], Any], args: Sequence[Any], rounds: int) -> float:
    """The best pass of ``fn`` over ``args``, in µs per call."""
    best = float("inf")
    clock = time.perf_counter_ns
    for _ in range(rounds):
        t0 = clock()
        for a in args:
            fn(a)
        best = min(best, (clock() - t0) / len(args))
    return best / 1e3


def store_held(core: Any, calls: int, rounds: int) -> float:
    """µs per one-block store of a block worker 0 already holds."""
    e, h = array("Q", [7]), array("Q", [MISS[0]])
    store = core.store
    core.store(0, None, e, h)
    return best_per_call(lambda _: store(0, None, e, h), range(calls), rounds)


def replayed(stream: tr.Stream, name: str) -> tuple[tr.Backend, list[tuple[Any, int]], float]:
    """A backend with the whole stream applied; every query's argument and its rows; the
    replay's store calls in ns per stored block."""
    be = tr.BACKENDS[name](stream)
    query, store, remove = be.calls()
    fns = (query, store, remove)
    queries = []
    clock = time.perf_counter_ns
    store_ns = 0
    blocks = sum(len(op[3]) for op in stream.ops if op[0] == tr.STORE)
    for kind, _, args in be.prepare():
        if kind == tr.STORE:
            t0 = clock()
            store(*args)
            store_ns += clock() - t0
            continue
        fns[kind](*args)
        if kind == tr.Q:
            queries.append(args[0])
    return be, [(q, be.rows(query(q))) for q in queries], store_ns / max(blocks, 1)


def best_replay(stream: tr.Stream, name: str, replays: int) -> tuple[Any, Any, float]:
    """``replayed`` ``replays`` times (each into a fresh index): the last, with the best
    store time of them all."""
    best = float("inf")
    for k in range(replays):
        be, queries, store_ns = replayed(stream, name)
        best = min(best, store_ns)
        if k + 1 < replays:
            be.close()
    return be, queries, best


def measure(stream: tr.Stream, calls: int, rounds: int, replays: int = 1) -> list[dict[str, Any]]:
    names = ["kvc-core"]
    if tr.dynamo_radix_tree() is not None:
        names.append("dynamo-native")
    built = {n: best_replay(stream, n, max(replays, 1)) for n in names}
    out = []
    for name in names:
        be, queries, store_ns = built[name]
        query = be.calls()[0]
        rows = max(r for _, r in queries)
        wide = [q for q, r in queries if r == rows][:calls]
        miss = [array("Q", MISS) if name == "kvc-core" else list(MISS)] * calls
        gc.collect()
        res: dict[str, Any] = {
            "backend": name,
            "workers": stream.workers,
            "rows": rows,
            "wide_calls": len(wide),
            "wide_us": best_per_call(query, wide, rounds),
            "miss_us": best_per_call(query, miss, rounds),
        }
        res["per_row_ns"] = (res["wide_us"] - res["miss_us"]) * 1e3 / max(rows, 1)
        res["replay_store_ns_per_block"] = store_ns
        if name == "kvc-core":
            res["store_held_us"] = store_held(be.core, calls, rounds)  # type: ignore[attr-defined]
        out.append(res)
    for be, _, _ in built.values():
        be.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(tr.SHAPES), default="conversation")
    for flag, default in NUMBERS.items():
        ap.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args(argv)
    requests = tr.generate(args.shape, args.seed, args.requests)
    stream = tr.record(requests, args.workers, args.capacity, "round-robin", label=args.shape)
    for r in measure(stream, args.calls, args.rounds, args.replays):
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
