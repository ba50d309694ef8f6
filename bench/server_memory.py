"""Where the running server's memory goes: ``python bench/server_memory.py``.

Starts ``kv-conductor`` on a loopback port, registers ``--workers`` engines (one DP each,
block size 16), each with its own vLLM-format ZeroMQ publisher process, and has them
publish ``--blocks`` blocks in all (two 32-block BlockStored events per batch, as
engines do). Then it reads, from outside the server:

* RSS growth per held (worker, block) pair (``/proc/PID/status``);
* the index's own bytes (``kvconductor_index_bytes``, the structures' allocated capacity);
* the growth split by mapping (``/proc/PID/smaps``): the main heap, anonymous mappings
  (thread arenas of glibc malloc, large allocations), and the rest;

so that the gap between the index's bytes and the RSS growth is named, not guessed.
``--env NAME=VALUE`` (repeatable) runs the server with allocator settings, e.g.
``--env MALLOC_ARENA_MAX=2``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

from bench_ingest import _publisher
from e2e_query import free_port, rss_kb

BS = 16


def smaps(pid: int) -> dict[str, int]:
    """Resident KiB by kind of mapping."""
    out = {"heap": 0, "anon": 0, "other": 0}
    kind = "other"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else ""
                kind = "heap" if name == "[heap]" else ("anon" if not name else "other")
            elif line.startswith("Rss:"):
                out[kind] += int(line.split()[1])
    return out


def http(port: int, method: str, path: str, doc=None) -> tuple[int, bytes]:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = None if doc is None else json.dumps(doc).encode()
    c.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


def index_bytes(port: int) -> int:
    _, text = http(port, "GET", "/metrics")
    return sum(
        int(float(m.group(1)))
        for m in re.finditer(rb"^kvconductor_index_bytes\{[^}]*\} (\S+)$", text, re.M)
    )


def hbm_pairs(port: int) -> int:
    _, body = http(port, "GET", "/workers")
    return sum(s["hbm_blocks"] for s in json.loads(body)["indexer"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks published in all")
    ap.add_argument("--workers", type=int, default=8, help="engines (one DP each)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server")
    ap.add_argument(
        "--settle", type=float, default=12.0, help="seconds to wait after the load (default 12)"
    )
    ap.add_argument(
        "--distinct",
        action="store_true",
        help="every engine publishes its own documents (disjoint chains, one member per "
        "node) instead of the same ones (every node held by all the engines)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    port = free_port()
    env = dict(os.environ, KV_CONDUCTOR_LOG="warning")
    env.update(dict(e.split("=", 1) for e in args.env))
    srv = subprocess.Popen(
        [sys.executable, "-m", "kvconductor", "--host", "127.0.0.1", "--port", str(port)]
        + ["--no-snapshots"],
        env=env,
    )
    pubs = []
    try:
        end = time.time() + 30
        while True:
            try:
                if http(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > end:
                raise SystemExit("server did not start")
            time.sleep(0.1)
        # 64 blocks per batch; make_batches removes about one block in eight
        batches = args.blocks // args.workers // 64
        for w in range(args.workers):
            parent, child = mp.Pipe()
            seed = 1000 + w if args.distinct else None
            p = mp.Process(target=_publisher, args=(child, BS, batches, 0, 32, seed), daemon=True)
            p.start()
            pub_port, _ = parent.recv()
            st, body = http(
                port,
                "POST",
                "/register",
                {
                    "instance_id": f"eng-{w}",
                    "type": "vLLM",
                    "modelname": "bench",
                    "block_size": BS,
                    "dp_rank": 0,
                    "medium_endpoints": {"npu": f"tcp://127.0.0.1:{pub_port}"},
                },
            )
            assert st == 201, body
            pubs.append((p, parent))
        for _, conn in pubs:  # until each SUB receives
            for _ in range(50):
                conn.send("warm")
                conn.recv()
            time.sleep(0.05)
        time.sleep(1.0)
        before_rss, before_maps = rss_kb(srv.pid), smaps(srv.pid)
        before_index = index_bytes(port)
        t0 = time.perf_counter()
        for _, conn in pubs:
            conn.send(0)
        for _, conn in pubs:
            conn.recv()
        last, stable = -1, 0
        while stable < 5:  # until the pair count stops moving
            time.sleep(0.2)
            n = hbm_pairs(port)
            stable = stable + 1 if n == last else 0
            last = n
        took = time.perf_counter() - t0
        time.sleep(args.settle)  # the ingest thread trims the heap every 10 s
        after_rss, after_maps = rss_kb(srv.pid), smaps(srv.pid)
        after_index = index_bytes(port)
        _, body = http(port, "GET", "/workers")
        summary = json.loads(body)["indexer"]
        pairs = last
        grown = (after_rss - before_rss) * 1024
        idx = after_index - before_index
        out = {
            "pairs": pairs,
            "seconds": round(took, 2),
            "rss_growth_bytes_per_pair": round(grown / pairs, 1),
            "index_bytes_per_pair": round(idx / pairs, 1),
            "rss_over_index": round(grown / max(1, idx), 2),
            "growth_kib_by_mapping": {k: after_maps[k] - before_maps[k] for k in after_maps},
            "env": args.env,
            "distinct": args.distinct,
            "indexer": summary,
        }
    finally:
        for p, conn in pubs:
            try:
                conn.send("stop")
            except OSError:
                pass
            p.join(5)
        srv.terminate()
        srv.wait(20)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
