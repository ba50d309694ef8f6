"""The CPU that idle subscriptions cost kv-conductor's ZeroMQ I/O threads: their ZMTP
heartbeats.

One process holds N SUB sockets with kv-conductor's heartbeat options (a PING every
``HEARTBEAT_IVL_MS``, ``HEARTBEAT_TIMEOUT_MS``), connected to N XPUB sockets in another
process that publish nothing; the SUB process's CPU is read over a few seconds, once
per I/O thread count. libzmq cancels a heartbeat's timeout timer by walking every
timer of its I/O thread, so on one I/O thread the cost grows with the square of N
(``kvconductor.serve.tuning.io_threads``: what kv-conductor sizes its context to).

    python bench/heartbeat_cost.py --sources 1024 2048 4096 --io-threads 1 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from collections.abc import Sequence

import zmq

from kvconductor.ingest.source import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS


def _publishers(n: int, conn) -> None:
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = [ctx.socket(zmq.XPUB) for _ in range(n)]
    conn.send([s.bind_to_random_port("tcp://127.0.0.1") for s in socks])
    conn.recv()  # stop
    for s in socks:
        s.close(linger=0)
    ctx.term()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def measure(sources: int, io_threads: int, heartbeats: bool = True, seconds: float = 5.0):
    """``sources`` idle subscriptions on ``io_threads`` I/O threads: the percent of a core
    this process used over ``seconds``, after the connections settled."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx_mp = mp.get_context("spawn")
    a, b = ctx_mp.Pipe()
    proc = ctx_mp.Process(target=_publishers, args=(sources, b), daemon=True)
    proc.start()
    ctx = zmq.Context(io_threads=io_threads)
    ctx.set(zmq.MAX_SOCKETS, sources + 64)
    subs = []
    try:
        for port in a.recv():
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            if heartbeats:
                s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{port}")
            subs.append(s)
        time.sleep(min(4.0, seconds))  # every connection made, the heartbeats running
        c0, w0 = _cpu_s(), time.perf_counter()
        time.sleep(seconds)
        used = (_cpu_s() - c0) / (time.perf_counter() - w0)
    finally:
        for s in subs:
            s.close(linger=0)
        ctx.term()
        a.send("stop")
        proc.join(10)
    return {
        "sources": sources,
        "io_threads": io_threads,
        "heartbeats": heartbeats,
        "core_percent": round(100 * used, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--io-threads", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--no-heartbeats", action="store_true", help="also without heartbeats")
    args = ap.parse_args(argv)
    for n in args.sources:
        for io in args.io_threads:
            print(json.dumps(measure(n, io, True, args.seconds)), flush=True)
        if args.no_heartbeats:
            print(json.dumps(measure(n, 1, False, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
