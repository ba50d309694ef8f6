"""The Mooncake dialect's ``/query`` against V3's on one server (bench/mooncake_query.py).

Starts ``python -m kvconductor --mooncake-port`` on free loopback ports, registers
``--instances`` instances of 2 DP ranks each over the dialect, stores one HBM chain per
rank through V3's ``POST /events`` (rank i holds 32 + i blocks of 16 tokens), then asks
the same 1,024-token prompt over one keep-alive connection per route, in alternating
rounds: V3 ``/query`` (JSON), the dialect's ``/query`` (JSON) and the dialect's
``/query`` (MessagePack, token ids as one bin of little-endian int32, as Mooncake's
proxy sends them). Prints the client round trip's p50 and p99 per round; nothing here
asserts timings.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
BS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, ctype: str) -> bytes:
    conn.request("POST", path, body, {"Content-Type": ctype})
    r = conn.getresponse()
    data = r.read()
    if r.status not in (200, 201):
        raise RuntimeError(f"{path}: {r.status} {data[:200]!r}")
    return data


def round_trips(ask: Callable[[], object], n: int) -> tuple[float, float]:
    """``n`` calls of ``ask`` one after another: the p50 and p99 of their time, in µs."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        ask()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e6, ts[int(len(ts) * 0.99)] * 1e6


def _wait(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().read() == b"OK":
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server not ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2000, help="per route and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    v3_port, mc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "kvconductor", "--port", str(v3_port)]
    cmd += ["--mooncake-port", str(mc_port), "--no-snapshots", "--log-level", "warning"]
    # the registered endpoints never connect: keep their HBM hits counting
    cmd += ["--source-down-secs", "86400", "--source-purge-secs", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait(v3_port, proc)
        v3 = http.client.HTTPConnection("127.0.0.1", v3_port)
        mc = http.client.HTTPConnection("127.0.0.1", mc_port)
        tokens = list(range(1, 1025))
        for i in range(args.instances * 2):
            iid, dp = f"prefill-{i // 2}", i % 2
            reg = {
                "endpoint": f"tcp://127.0.0.1:{_free_port()}",
                "type": "vLLM",
                "modelname": "m",
                "instance_id": iid,
                "block_size": BS,
                "dp_rank": dp,
            }
            _post(mc, "/register", json.dumps(reg).encode(), "application/json")
            n = min(32 + i, len(tokens) // BS)
            ev = {
                "event_id": 1,
                "dp_rank": dp,
                "type": "BlockStored",
                "block_hashes": list(range(100, 100 + n)),
                "parent_block_hash": None,
                "token_ids": tokens[: n * BS],
                "block_size": BS,
                "medium": "GPU",
            }
            body = json.dumps({"instance_id": iid, "events": [ev]}).encode()
            _post(v3, "/events", body, "application/json")
        q = {"model": "m", "block_size": BS, "token_ids": tokens}
        packed = dict(q, token_ids=struct.pack(f"<{len(tokens)}i", *tokens))
        routes = [
            ("V3 /query JSON", v3, json.dumps(q).encode(), "application/json"),
            ("mooncake /query JSON", mc, json.dumps(q).encode(), "application/json"),
            (
                "mooncake /query msgpack int32 bin",
                mc,
                msgspec.msgpack.encode(packed),
                "application/msgpack",
            ),
        ]
        print(f"{args.instances} instances x 2 ranks, 1,024-token prompt, block size {BS}")
        print(f"{'round':>5}  {'route':<34} {'p50 us':>8} {'p99 us':>8}")
        for rnd in range(args.rounds):
            for name, conn, body, ctype in routes:

                def ask(conn=conn, body=body, ctype=ctype) -> bytes:
                    return _post(conn, "/query", body, ctype)

                p50, p99 = round_trips(ask, args.requests)
                print(f"{rnd:>5}  {name:<34} {p50:>8.0f} {p99:>8.0f}")
        return 0
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
