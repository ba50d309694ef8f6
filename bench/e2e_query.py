"""End-to-end query benchmarks against the real server (``python bench/e2e_query.py``).

Starts ``python -m kvconductor`` on a free loopback port, loads one engine's
HBM chain through ``POST /events``, then measures:

1. ``/query`` round trip by prompt size (1k .. 5M tokens) for JSON, msgpack and
   packed-token msgpack bodies (medians of several runs; the server's own time
   from its ``Server-Timing`` header when present);
2. 4k-token full-hit queries from 4 keep-alive connections (separate client
   processes): requests/s and p50/p99 latency;
3. 32k-token full-hit server latency;
4. small-query p99 while 1M-token queries run concurrently;
5. RSS per (worker, block) after loading 64 workers.

``--workers N`` starts ``kv-conductor --workers N`` instead of one process: the queries
are then answered by the worker processes (the events go through them to the owner).

Every number is printed in one table; nothing here asserts timings.
"""

from __future__ import annotations

import argparse
import array
import http.client
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import msgspec

BLOCK = 16
MODEL = "bench"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, workers: int = 1) -> subprocess.Popen:
    env = dict(os.environ, KV_CONDUCTOR_LOG="warning")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconductor", "--host", "127.0.0.1", "--port", str(port)]
        + ["--no-snapshots", "--workers", str(workers)],
        env=env,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def post(conn, path, body: bytes, ctype="application/json"):
    conn.request("POST", path, body=body, headers={"Content-Type": ctype})
    r = conn.getresponse()
    data = r.read()
    return r.status, data, r.getheader("Server-Timing")


def tokens(n: int, seed: int) -> array.array:
    rnd = random.Random(seed)
    return array.array("I", (rnd.randrange(1, 150_000) for _ in range(n)))


def load_chain(conn, instance: str, dp: int, toks: array.array, base: int) -> None:
    """Store ``toks`` as one HBM chain of ``instance``/``dp`` in 16k-block events."""
    nb = len(toks) // BLOCK
    step = 16_384
    parent = None
    for i in range(0, nb, step):
        j = min(i + step, nb)
        ev = {
            "event_id": i,
            "dp_rank": dp,
            "type": "BlockStored",
            "block_hashes": list(range(base + i, base + j)),
            "parent_block_hash": parent,
            "token_ids": toks[i * BLOCK : j * BLOCK].tolist(),
            "block_size": BLOCK,
            "medium": "GPU",
        }
        body = json.dumps({"instance_id": instance, "model_name": MODEL, "events": [ev]}).encode()
        st, data, _ = post(conn, "/events", body)
        if st != 200:
            raise SystemExit(f"/events failed: {st} {data[:200]!r}")
        parent = base + j - 1


def register(conn, instance: str, dp: int) -> None:
    body = json.dumps(
        {
            "instance_id": instance,
            "type": "vLLM",
            "modelname": MODEL,
            "block_size": BLOCK,
            "dp_rank": dp,
        }
    ).encode()
    st, data, _ = post(conn, "/register", body)
    if st != 201:
        raise SystemExit(f"/register failed: {st} {data!r}")


def bodies(toks: array.array) -> dict[str, tuple[bytes, str]]:
    lst = toks.tolist()
    q = {"model": MODEL, "block_size": BLOCK, "token_ids": lst}
    packed = {"model": MODEL, "block_size": BLOCK, "token_ids": toks.tobytes()}
    return {
        "json": (msgspec.json.encode(q), "application/json"),
        "msgpack": (msgspec.msgpack.encode(q), "application/msgpack"),
        "packed": (msgspec.msgpack.encode(packed), "application/msgpack"),
    }


def server_ms(header: str | None) -> float | None:
    if not header:
        return None
    for part in header.split(","):
        for kv in part.split(";"):
            kv = kv.strip()
            if kv.startswith("dur="):
                return float(kv[4:])
    return None


def time_query(port, body, ctype, runs) -> tuple[float, float, float | None, int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    rt, srv = [], []
    size = 0
    for _ in range(runs):
        t0 = time.perf_counter()
        st, data, timing = post(conn, "/query", body, ctype)
        rt.append((time.perf_counter() - t0) * 1e3)
        if st != 200:
            raise SystemExit(f"/query failed: {st} {data[:200]!r}")
        size = len(data)
        ms = server_ms(timing)
        if ms is not None:
            srv.append(ms)
    conn.close()
    return (statistics.median(rt), min(rt), statistics.median(srv) if srv else None, size)


def _load_worker(port, body, ctype, seconds, q):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat, srv = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        conn.request("POST", "/query", body=body, headers={"Content-Type": ctype})
        r = conn.getresponse()
        r.read()
        lat.append((time.perf_counter() - t0) * 1e3)
        ms = server_ms(r.getheader("Server-Timing"))
        if ms is not None:
            srv.append(ms)
    q.put((lat, srv))


def load(port, body, ctype, conns, seconds) -> tuple[float, float, float, float]:
    q = mp.Queue()
    ps = [
        mp.Process(target=_load_worker, args=(port, body, ctype, seconds, q)) for _ in range(conns)
    ]
    for p in ps:
        p.start()
    lat, srv = [], []
    for _ in ps:
        a, b = q.get()
        lat.extend(a)
        srv.extend(b)
    for p in ps:
        p.join()
    lat.sort()
    srv.sort()
    srv99 = srv[int(len(srv) * 0.99)] if srv else float("nan")
    return (len(lat) / seconds, lat[len(lat) // 2], lat[int(len(lat) * 0.99)], srv99)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=5_000_000)
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="kv-conductor --workers N (N > 1: the queries answered by the worker "
        "processes; the RSS row is the owner's)",
    )
    args = ap.parse_args()
    port = free_port()
    proc = start_server(port, args.workers)
    rows = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        register(conn, "vllm-prefill-0", 0)
        doc = tokens(args.max_tokens, 1)
        load_chain(conn, "vllm-prefill-0", 0, doc, 1 << 40)
        for n in (1_000, 16_000, 128_000, 1_000_000, 5_000_000):
            if n > args.max_tokens:
                continue
            for enc, (body, ctype) in bodies(doc[:n]).items():
                runs = args.runs if n < 1_000_000 else max(3, args.runs // 2)
                med, best, srv, size = time_query(port, body, ctype, runs)
                rows.append(
                    (
                        f"/query {n:>9,} tokens {enc}",
                        f"{med:.3f} ms",
                        f"best {best:.3f} ms",
                        f"server {srv:.3f} ms" if srv else "-",
                        f"body {len(body):,} B",
                    )
                )
        b4 = bodies(doc[:4096])["msgpack"]
        rps, p50, p99, s99 = load(port, b4[0], b4[1], 4, args.seconds)
        rows.append(
            (
                "4k full hit, 4 conns (msgpack)",
                f"{rps:,.0f} req/s",
                f"p50 {p50:.3f} ms",
                f"p99 {p99:.3f} ms",
                f"server p99 {s99:.3f} ms",
            )
        )
        b32 = bodies(doc[:32768])["msgpack"]
        med, best, srv, _ = time_query(port, b32[0], b32[1], 50)
        rows.append(
            (
                "32k full hit round trip (msgpack)",
                f"{med:.3f} ms",
                f"best {best:.3f} ms",
                f"server {srv:.3f} ms" if srv else "-",
                "",
            )
        )
        # small-query p99 while 1M-token queries keep running
        big = bodies(doc[:1_000_000])["packed"]
        q = mp.Queue()
        bigp = mp.Process(target=_load_worker, args=(port, big[0], big[1], args.seconds, q))
        bigp.start()
        rps2, p50b, p99b, s99b = load(port, b4[0], b4[1], 2, args.seconds)
        bigl, _ = q.get()
        bigp.join()
        rows.append(
            (
                "4k queries while 1M queries run",
                f"{rps2:,.0f} req/s",
                f"p50 {p50b:.3f} ms",
                f"p99 {p99b:.3f} ms",
                f"server p99 {s99b:.3f} ms; 1M queries: {len(bigl)}",
            )
        )
        if not args.skip_rss:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            before = rss_kb(proc.pid)
            pairs = 0
            for w in range(1, 64):
                inst = f"vllm-prefill-{w // 8 + 1}"
                register(conn, inst, w % 8)
                toks = tokens(16_000 * BLOCK, 1000 + w)
                load_chain(conn, inst, w % 8, toks, (w + 1) << 40)
                pairs += 16_000
            after = rss_kb(proc.pid)
            rows.append(
                (
                    "RSS per (worker, block), 63 workers x 16k blocks",
                    f"{(after - before) * 1024 / pairs:.1f} B",
                    f"pairs {pairs:,}",
                    f"RSS {after / 1024:.0f} MiB",
                    "",
                )
            )
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measurement':<{width}}  result")
    for r in rows:
        print(f"{r[0]:<{width}}  " + "  ".join(x for x in r[1:] if x))


if __name__ == "__main__":
    main()
