"""Query throughput by worker count (``python bench/workers_curve.py``).

For each N (``--workers 1 2 ...``; default 1 .. the number of CPUs) starts
``kv-conductor --workers N`` on a free loopback port (N = 1 is the single-process
server), waits until every worker listens, loads the benchmark chain (the document
``bench/load_chain.py`` loads, ``--tokens`` long, through ``POST /events``), then
measures:

1. 4k-token full-hit ``/query`` from ``--connections`` keep-alive connections (default
   4 per worker): requests/s, p50 and p99 (``wrk`` when it is on PATH, else Python
   client processes, which need a core of their own);
2. the same 4k queries while one client per worker sends 1M-token queries back to back:
   4k p99 and the 1M-token query rate;
3. the summed PSS (proportional set size: shared pages counted once over all
   processes) of every server process, from ``/proc/<pid>/smaps_rollup``.

Prints one table; nothing asserts timings. On a machine with more cores, run it there
to see the curve.

    python bench/workers_curve.py [--workers 1 2 4] [--seconds 5] [--tokens 5000000]
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from e2e_query import MODEL, bodies, free_port, load_chain, register, tokens

INSTANCE = "vllm-prefill-0"
DOC_SEED = 1
BASE_HASH = 1 << 40


def start(port: int, workers: int) -> subprocess.Popen:
    env = dict(os.environ, KV_CONDUCTOR_LOG="warning")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconductor", "--host", "127.0.0.1", "--port", str(port)]
        + ["--no-snapshots"]
        + (["--workers", str(workers)] if workers > 1 else []),
        env=env,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/metrics")
            r = c.getresponse()
            text = r.read().decode()
            if r.status == 200 and (workers == 1 or _gauge(text) == workers):
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server with {workers} workers did not start")


def _gauge(text: str) -> int:
    m = re.search(r"^kvconductor_worker_processes (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def server_pids(proc: subprocess.Popen) -> list[int]:
    """The server and its worker processes (children of the owner)."""
    pids = [proc.pid]
    for task in os.listdir(f"/proc/{proc.pid}/task"):
        try:
            with open(f"/proc/{proc.pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


def pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _client(port: int, body: bytes, seconds: float, out) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        conn.request("POST", "/query", body=body, headers={"Content-Type": "application/msgpack"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}")
        lat.append(time.perf_counter() - t0)
    out.put(lat)


def python_load(port: int, body: bytes, conns: int, seconds: float) -> dict:
    q = mp.Queue()
    procs = [mp.Process(target=_client, args=(port, body, seconds, q)) for _ in range(conns)]
    for p in procs:
        p.start()
    lat = []
    for _ in procs:
        lat += q.get()
    for p in procs:
        p.join()
    lat.sort()
    return {
        "rps": len(lat) / seconds,
        "p50": 1e3 * lat[len(lat) // 2],
        "p99": 1e3 * lat[int(len(lat) * 0.99)],
        "tool": "python",
    }


def _ms(value: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", value)
    if not m:
        return float("nan")
    v = float(m.group(1))
    return v / 1e3 if m.group(2) == "us" else v * 1e3 if m.group(2) == "s" else v


def wrk_load(port: int, body_file: str, conns: int, threads: int, seconds: float) -> dict:
    lua = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrk", "query.lua")
    out = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{conns}",
            f"-d{seconds:g}s",
            "--latency",
            "-s",
            lua,
            f"http://127.0.0.1:{port}/query",
            "--",
            body_file,
            "application/msgpack",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"^\s*50%\s+(\S+)", out, re.M).group(1))
    p99 = _ms(re.search(r"^\s*99%\s+(\S+)", out, re.M).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {
        "rps": rps,
        "p50": p50,
        "p99": p99,
        "tool": "wrk",
        "errors": int(bad.group(1)) if bad else 0,
    }


def _big_loop(port: int, body: bytes, seconds: float, out) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        conn.request("POST", "/query", body=body, headers={"Content-Type": "application/msgpack"})
        r = conn.getresponse()
        r.read()
        n += r.status == 200
    out.put(n)


def measure(n: int, args, q4k: bytes, q4k_file: str, q1m: bytes) -> dict:
    port = free_port()
    proc = start(port, n)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        register(conn, INSTANCE, 0)
        load_chain(conn, INSTANCE, 0, tokens(args.tokens, DOC_SEED), BASE_HASH)
        conns = args.connections or 4 * n
        use_wrk = shutil.which("wrk") is not None and not args.python_clients

        def load(c: int) -> dict:
            if use_wrk:
                threads = args.wrk_threads or n
                return wrk_load(port, q4k_file, c, max(1, min(c, threads)), args.seconds)
            return python_load(port, q4k, c, args.seconds)

        load(conns)  # warm up every worker's connections and code paths
        row = {"workers": n, "conns": conns, **load(conns)}
        row["pss_mib"] = pss_mib(server_pids(proc))
        # 4k queries while every worker gets 1M-token queries back to back
        q = mp.Queue()
        bigs = [
            mp.Process(target=_big_loop, args=(port, q1m, args.seconds + 1, q)) for _ in range(n)
        ]
        for b in bigs:
            b.start()
        time.sleep(0.5)
        mixed = load(max(2, conns // 2))
        big = sum(q.get() for _ in bigs)
        for b in bigs:
            b.join()
        row.update(mixed_rps=mixed["rps"], mixed_p99=mixed["p99"], big_qps=big / (args.seconds + 1))
        return row
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=None)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=5_000_000, help="loaded document length")
    ap.add_argument("--connections", type=int, default=0, help="4k connections (0: 4 per worker)")
    ap.add_argument("--wrk-threads", type=int, default=0, help="wrk threads (0: one per worker)")
    ap.add_argument("--python-clients", action="store_true", help="do not use wrk")
    args = ap.parse_args()
    ns = args.workers or list(range(1, (os.cpu_count() or 1) + 1))
    doc4k = tokens(4096, DOC_SEED)
    q4k = bodies(doc4k)["msgpack"][0]
    q1m = bodies(tokens(1_000_000, DOC_SEED))["msgpack"][0]
    with tempfile.NamedTemporaryFile(suffix=".body") as f:
        f.write(q4k)
        f.flush()
        rows = [measure(n, args, q4k, f.name, q1m) for n in ns]
    print(f"model {MODEL!r}, {args.tokens:,}-token document, {os.cpu_count()} CPUs")
    hdr = (
        f"{'workers':>7} {'conns':>5} {'tool':>6} {'4k req/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'PSS MiB':>8} {'mixed 4k req/s':>14} {'mixed p99 ms':>12} {'1M q/s':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    base = rows[0]["rps"]
    for r in rows:
        print(
            f"{r['workers']:>7} {r['conns']:>5} {r['tool']:>6} {r['rps']:>9,.0f} "
            f"{r['p50']:>7.3f} {r['p99']:>7.3f} {r['pss_mib']:>8.1f} {r['mixed_rps']:>14,.0f} "
            f"{r['mixed_p99']:>12.3f} {r['big_qps']:>7.1f}   x{r['rps'] / base:.2f}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
