"""The ingest loop's own CPU per message, apart from what a message's handler does.

One :class:`~kvconductor.ingest.thread.IngestThread` polls N SUB sockets, each connected
over TCP to a PUB of this process; every handler only receives what is queued
(:func:`kvconductor.ingest.replay.drain`, as a subscription's drain does) and counts it.
The PUBs send one message per socket in turn, as round-robin engines do, in bursts of
64; the ingest thread's CPU (``/proc``, user + system) over the run, per message: the
selector's round, the ``ZMQ_EVENTS`` checks, the receive and the wake-ups that one
socket per engine costs.

    python bench/ingest_loop.py --sockets 256 --messages 20000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Sequence

import zmq

from kvconductor.ingest.replay import drain
from kvconductor.ingest.thread import IngestThread

PAYLOAD = [b"topic", bytes(8), b"x" * 300]


def _thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(sockets: int, messages: int) -> dict[str, float | int]:
    """``messages`` over ``sockets`` SUBs on one ingest thread: its CPU per message."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * sockets + 64)
    thread = IngestThread(ctx)
    thread.start()
    got = [0]

    def handler(sock: zmq.Socket) -> None:
        for _ in drain(sock, 256, lambda: False, lambda ex: None):
            got[0] += 1

    pubs = [ctx.socket(zmq.PUB) for _ in range(sockets)]
    try:
        ports = [p.bind_to_random_port("tcp://127.0.0.1") for p in pubs]

        def subscribe() -> None:
            for port in ports:
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://127.0.0.1:{port}")
                thread.add_socket(s, handler)

        thread.submit(subscribe).result(30)
        time.sleep(1.0)  # every subscription reached its PUB (else the PUB drops)
        tid = thread.submit(threading.get_native_id).result(5)
        c0, w0 = _thread_cpu_s(tid), time.perf_counter()
        for j in range(messages):
            pubs[j % sockets].send_multipart(PAYLOAD)
            if j % 64 == 63:
                time.sleep(0.0002)
        while got[0] < messages and time.perf_counter() - w0 < 60:
            time.sleep(0.005)
        cpu, wall = _thread_cpu_s(tid) - c0, time.perf_counter() - w0
    finally:
        thread.stop()
        for p in pubs:
            p.close(linger=0)
        ctx.term()
    n = got[0]
    return {
        "sockets": sockets,
        "messages": n,
        "sent": messages,
        "cpu_us_per_message": round(cpu / n * 1e6, 2) if n else float("nan"),
        "wall_s": round(wall, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sockets", type=int, nargs="+", default=[256])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    for n in args.sockets:
        for _ in range(args.runs):
            print(json.dumps(measure(n, args.messages)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
