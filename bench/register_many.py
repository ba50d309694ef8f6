"""Registering thousands of engines, one after another, against a running server: the
time per registration as the number of ZeroMQ sources grows.

Each registration is one engine DP with one ZeroMQ source (``tcp://127.0.0.1:<port>``,
nothing listening; one HBM IP for all, as ``tests/faults/test_sources.py`` does). The
server runs in a temporary directory without snapshots; ``--max-sources`` is raised to
fit. Prints the mean milliseconds per registration of each block of ``--block``
registrations (client round trip included) and the total.

    python bench/register_many.py --sources 2000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(i: int) -> dict:
    return {
        "instance_id": f"vllm-prefill-{i}",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 16,
        "dp_rank": 0,
        "store_backend": "YuanRong",
        "medium_endpoints": {"npu": f"tcp://127.0.0.1:{20000 + i % 40000}"},
    }


def run(sources: int, block: int) -> list[tuple[int, float]]:
    """``(registrations so far, ms per registration in that block)`` per block."""
    port = free_port()
    args = ["--port", str(port), "--log-level", "warning", "--no-snapshots"]
    args += ["--max-sources", str(max(4096, sources))]
    with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "server.log"), "wb") as log:
        # the log goes to a file: a pipe nobody reads would block the server once full
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvconductor", *args],
            cwd=d,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get("/health").text == "OK":
                        break
                except httpx.TransportError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("server did not start") from None
                    time.sleep(0.1)
            rows = []
            t0 = time.perf_counter()
            for i in range(sources):
                r = http.post("/register", json=body(i))
                if r.status_code != 201:
                    raise SystemExit(f"registration {i}: {r.status_code} {r.text}")
                if (i + 1) % block == 0 or i + 1 == sources:
                    t1 = time.perf_counter()
                    n = (i % block) + 1
                    rows.append((i + 1, 1000 * (t1 - t0) / n))
                    t0 = t1
            doc = http.get("/workers").json()
            if len(doc["sources"]) != sources:
                raise SystemExit(f"{len(doc['sources'])} sources, expected {sources}")
            return rows
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", type=int, default=2000, help="engines to register")
    ap.add_argument("--block", type=int, default=250, help="registrations per row")
    a = ap.parse_args()
    rows = run(a.sources, a.block)
    print(f"{'sources':>8} {'ms/registration':>16}")
    total = 0.0
    prev = 0
    for n, ms in rows:
        print(f"{n:>8} {ms:>16.2f}")
        total += ms * (n - prev) / 1000
        prev = n
    print(f"total {total:.1f} s for {a.sources} registrations")


if __name__ == "__main__":
    main()
