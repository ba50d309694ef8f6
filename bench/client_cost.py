"""What the trace replay's query client costs (``python bench/client_cost.py``).

One client process sends the same request ``--requests`` times over one keep-alive
connection to the HTTP stack's floor (:class:`bench.trace_services.Floor`, answering
``--size`` bytes), once through ``http.client`` (:class:`bench.trace_services.Conn`) and
once through the raw socket (:class:`bench.trace_services.RawConn`), alternating for
``--rounds``; prints queries/s and the client's CPU per request (``time.process_time``,
the client's syscalls included).

    python bench/client_cost.py [--rounds 3] [--requests 3000] [--size 5250]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.trace_services import Conn, Floor, RawConn

BODY = bytes(300)
CTYPE = "application/msgpack"


def _timed(send, args: tuple, n: int) -> tuple[float, float]:
    t, p = time.perf_counter(), time.process_time()
    for _ in range(n):
        send(*args)
    return n / (time.perf_counter() - t), (time.process_time() - p) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--size", type=int, default=5250, help="answer bytes")
    args = ap.parse_args(argv)
    floor = Floor(args.size)
    try:
        print("| client | queries/s | client CPU per request |\n| --- | ---: | ---: |")
        for _ in range(args.rounds):
            c = Conn(floor.port)
            hdr = {"Content-Type": CTYPE}
            rate, cpu = _timed(c.request, ("POST", "/q", BODY, hdr), args.requests)
            c.close()
            print(f"| http.client | {rate:,.0f} | {cpu:.1f} µs |")
            r = RawConn(floor.port)
            head, tail = r.prepare("POST", "/q", BODY, CTYPE)
            req = head + tail
            rate, cpu = _timed(r.send, (req,), args.requests)
            r.close()
            print(f"| raw socket | {rate:,.0f} | {cpu:.1f} µs |")
    finally:
        floor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
