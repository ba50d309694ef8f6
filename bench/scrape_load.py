"""``GET /metrics`` at 4,096 sources, end to end: what a scrape costs and what scraping
every second does to concurrent queries (``python bench/scrape_load.py``).

Starts ``python -m kvconductor`` (one process) in a temporary directory, registers
``--sources`` engine DPs whose ZeroMQ sources all connect to one PUB socket of this
script (so every source is connected and live, and none reconnects in a loop), and
loads one 4k-token HBM chain through ``POST /events``. Then, per round:

* ``scrape``: ``--scrapes`` back-to-back ``GET /metrics`` on the idle server: round
  trip median and best, and the size of the text;
* ``off``: 4k-token full-hit ``/query`` (msgpack) from ``--conns`` keep-alive
  connections (separate client processes) for ``--seconds``: requests/s, p50, p99,
  p99.9 of the round trips;
* ``on``: the same while this script scrapes ``/metrics`` every ``--interval`` seconds
  (the scrapes' round trips are printed too).

``--old-tree DIR`` starts a second server from another checkout (its ``kvconductor``
package first on ``PYTHONPATH``; the compiled modules must be built there) beside the
first, and alternates the two within each round (new, old), ``--rounds`` times: old and
new in one run. Each (round, tree) has a server of its own, started and loaded for it
and stopped after it, so the two never share the CPU; nothing here asserts timings.

    python bench/scrape_load.py --old-tree ../kvconductor-old --rounds 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq
from e2e_query import BLOCK, MODEL, load_chain, post, register, tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, sources: int, tree: str | None, workdir: str) -> subprocess.Popen:
    """One process, no snapshots, room for ``sources``; ``tree``: a checkout whose
    package is imported instead of the installed one."""
    env = dict(os.environ, KV_CONDUCTOR_LOG="warning")
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--host", "127.0.0.1", "--port", str(port), "--no-snapshots"]
    args += ["--max-sources", str(max(4096, sources + 1)), "--log-level", "warning"]
    # the log goes to a file (the child keeps its own descriptor): a pipe nobody reads
    # would block the server once full
    with open(os.path.join(workdir, f"server-{port}.log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvconductor", *args],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server on {port} did not start (see {workdir})")


def register_sources(port: int, sources: int, url: str) -> None:
    """``sources`` engine DPs (one per instance), each with a ZeroMQ source on ``url``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for i in range(sources):
        body = {
            "instance_id": f"vllm-decode-{i}",
            "type": "vLLM",
            "modelname": "scrape",
            "block_size": BLOCK,
            "dp_rank": 0,
            "medium_endpoints": {"npu": url},
        }
        st, data, _ = post(conn, "/register", json.dumps(body).encode())
        if st != 201:
            raise SystemExit(f"/register {i}: {st} {data[:200]!r}")


def wait_live(port: int, sources: int, timeout: float = 120.0) -> int:
    """Waits until ``sources`` sources report ``kvconductor_source_up 1``; how many did."""
    deadline = time.time() + timeout
    up = 0
    while time.time() < deadline:
        _, text = scrape(port)
        up = sum(
            1
            for line in text.splitlines()
            if line.startswith("kvconductor_source_up{") and line.endswith(" 1.0")
        )
        if up >= sources:
            break
        time.sleep(1.0)
    return up


def scrape(port: int, conn: http.client.HTTPConnection | None = None) -> tuple[float, str]:
    """One ``GET /metrics``: (round trip in ms, text)."""
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    t0 = time.perf_counter()
    c.request("GET", "/metrics")
    r = c.getresponse()
    data = r.read()
    ms = (time.perf_counter() - t0) * 1e3
    if r.status != 200:
        raise SystemExit(f"/metrics: {r.status} {data[:200]!r}")
    return ms, data.decode()


def _client(port: int, body: bytes, seconds: float, q: mp.Queue) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        conn.request("POST", "/query", body=body, headers={"Content-Type": "application/msgpack"})
        r = conn.getresponse()
        r.read()
        lat.append((time.perf_counter() - t0) * 1e3)
    q.put(lat)


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def _wrk_ms(text: str) -> float:
    """A wrk duration (``152.00us``, ``1.20ms``, ``2.01s``) in ms."""
    for unit, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * f
    raise ValueError(text)


def _wrk(port: int, body_file: str, conns: int, seconds: float) -> tuple[float, dict]:
    """``wrk -t1 -c<conns> --latency``: (req/s, {"50%": ms, "75%": .., "90%": .., "99%": ..})."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--latency"]
        + ["-s", os.path.join(here, "wrk", "query.lua"), f"http://127.0.0.1:{port}/query"]
        + ["--", body_file, "application/msgpack"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"wrk: errors\n{out}")
    pct, rps = {}, 0.0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("50%", "75%", "90%", "99%"):
            pct[parts[0]] = _wrk_ms(parts[1])
        elif line.startswith("Requests/sec:"):
            rps = float(parts[1])
    return rps, pct


def queries(
    port: int, body: bytes, conns: int, seconds: float, interval: float | None, wrk: str | None
):
    """Query load; with ``interval``, a scrape every ``interval`` s meanwhile. ``wrk``: the
    body file for wrk (else Python clients, one process per connection). Returns (req/s,
    p50, p99, p99.9 or None, scrape round trips in ms)."""
    q: mp.Queue = mp.Queue()
    ps = []
    if wrk is None:
        ps = [mp.Process(target=_client, args=(port, body, seconds, q)) for _ in range(conns)]
    for p in ps:
        p.start()
    scrapes: list[float] = []
    stop = threading.Event()

    def scraper() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        nxt = time.perf_counter() + interval / 2
        while not stop.wait(max(0.0, nxt - time.perf_counter())):
            scrapes.append(scrape(port, conn)[0])
            nxt += interval

    th = None
    if interval:
        th = threading.Thread(target=scraper, daemon=True)
        th.start()
    lat: list[float] = []
    if wrk is not None:
        rps, pct = _wrk(port, wrk, conns, seconds)
    for _ in ps:
        lat.extend(q.get())
    stop.set()
    for p in ps:
        p.join()
    if th is not None:
        th.join()
    if wrk is not None:
        return rps, pct["50%"], pct["99%"], None, scrapes
    lat.sort()
    return len(lat) / seconds, _pct(lat, 0.5), _pct(lat, 0.99), _pct(lat, 0.999), scrapes


def measure(a, rnd, name, tree, workdir, url, doc, body, body_file) -> list[tuple]:
    """One server of ``tree`` (None: this checkout), started for this round alone (the
    other tree's server is not running meanwhile): its rows."""
    rows: list[tuple] = []
    port = free_port()
    proc = start_server(port, a.sources, tree, workdir)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        register(conn, "vllm-prefill-0", 0)
        load_chain(conn, "vllm-prefill-0", 0, doc, 1 << 40)
        t0 = time.perf_counter()
        register_sources(port, a.sources, url)
        up = wait_live(port, a.sources)
        print(
            f"round {rnd} {name}: {a.sources} sources registered and connected in "
            f"{time.perf_counter() - t0:.0f} s, {up} up",
            flush=True,
        )
        time.sleep(a.settle)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        times, size = [], 0
        for _ in range(a.scrapes):
            ms, text = scrape(port, conn)
            times.append(ms)
            size = len(text)
            time.sleep(0.1)
        times.sort()
        rows.append(
            (
                rnd,
                name,
                "scrape",
                f"median {statistics.median(times):.1f} ms",
                f"best {times[0]:.1f} ms",
                f"{size:,} B",
                "",
            )
        )
        print(*rows[-1], flush=True)
        for mode, interval in (("off", None), ("on", a.interval)):
            rps, p50, p99, p999, sc = queries(port, body, a.conns, a.seconds, interval, body_file)
            extra = f"{len(sc)} scrapes, median {statistics.median(sc):.1f} ms" if sc else ""
            rows.append(
                (
                    rnd,
                    name,
                    f"query, scrape {mode}",
                    f"{rps:,.0f} req/s",
                    f"p50 {p50:.3f} ms",
                    f"p99 {p99:.3f} ms",
                    (f"p99.9 {p999:.3f} ms  " if p999 is not None else "") + extra,
                )
            )
            print(*rows[-1], flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", type=int, default=4096)
    ap.add_argument("--old-tree", help="a checkout to compare with (alternating)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument("--scrapes", type=int, default=20, help="idle scrapes timed per round")
    ap.add_argument(
        "--settle", type=float, default=5.0, help="seconds of rest once the sources are up"
    )
    ap.add_argument(
        "--client",
        choices=("wrk", "python"),
        default="wrk" if shutil.which("wrk") else "python",
        help="query load: wrk -t1 -c<conns> --latency (default when installed) or one "
        "Python client process per connection (also prints p99.9)",
    )
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = a.sources + 1024
    if soft < need:  # the PUB holds one connection per source
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    url = f"tcp://127.0.0.1:{pub_port}"
    trees: list[tuple[str, str | None]] = [("new", None)]
    if a.old_tree:
        trees.append(("old", a.old_tree))
    doc = tokens(4096, 1)
    body = msgspec.msgpack.encode({"model": MODEL, "block_size": BLOCK, "token_ids": doc.tolist()})
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as workdir:
        body_file = None
        if a.client == "wrk":
            body_file = os.path.join(workdir, "q4k.body")
            with open(body_file, "wb") as f:
                f.write(body)
        try:
            for rnd in range(1, a.rounds + 1):
                for name, tree in trees:
                    rows += measure(a, rnd, name, tree, workdir, url, doc, body, body_file)
        finally:
            pub.close(0)
    print(
        f"\n{a.sources} sources, {a.conns} connections ({a.client}), {a.seconds:g} s per row, "
        f"scrapes every {a.interval:g} s when on; load {os.getloadavg()[0]:.2f}"
    )
    for r in rows:
        print(f"round {r[0]}  {r[1]:<4} {r[2]:<18} " + "  ".join(x for x in r[3:] if x))


if __name__ == "__main__":
    main()
