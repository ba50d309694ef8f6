"""kv-conductor's query rate as a fraction of the HTTP stack's floor (``python bench/floor.py``).

The floor is :mod:`floor_app`: a bare ASGI app on the same uvicorn (uvloop +
httptools) that reads the same request body and answers the same bytes, with no
routing, parsing, matching or metrics. In one run, alternating, for each process
model (one process; ``--workers 2``, against ``uvicorn --workers 2``) it starts the
floor, then kv-conductor (the chain loaded through ``POST /events``, so every query
is a full hit), and measures each with the same load: 4k- and 32k-token msgpack
``/query`` bodies over 1 and 4 keep-alive connections (``wrk -t1`` when it is on
PATH, else Python client processes, which share the cores and so measure less well).

Prints requests/s and p50/p99 of each, our rate as a fraction of the floor's and our
p50 as a multiple of the floor's. ``--also NAME=DIR`` adds another kv-conductor source
tree (built in place: ``python setup.py build_ext --inplace``), started with
``PYTHONPATH=DIR``, measured in the same rounds (an older tree, side by side).

    python bench/floor.py [--rounds 2] [--seconds 5] [--workers 1 2] [--also old=../kvc-old]

Nothing asserts timings: the targets are ratios read off this table.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time

from e2e_query import MODEL, bodies, free_port, load_chain, post, register, tokens
from workers_curve import python_load, wrk_load

HERE = os.path.dirname(os.path.abspath(__file__))
INSTANCE = "vllm-prefill-0"
DOC_SEED = 1
BASE_HASH = 1 << 40
SIZES = (4096, 32768)


def _wait(port: int, proc: subprocess.Popen, path: str, workers: int) -> None:
    deadline = time.time() + 60
    ok = 0
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            ok = ok + 1 if r.status == 200 else 0
            if ok >= 3 * workers:  # every worker listens (a few answers in a row)
                return
        except OSError:
            ok = 0
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def start_floor(port: int, workers: int, answer_file: str) -> subprocess.Popen:
    env = dict(os.environ, FLOOR_ANSWER=answer_file)
    cmd = [sys.executable, "-m", "uvicorn", "floor_app:app", "--app-dir", HERE]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--loop", "uvloop", "--http", "httptools"]
    cmd += ["--lifespan", "off", "--no-access-log", "--log-level", "warning"]
    if workers > 1:
        cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, env=env)
    _wait(port, proc, "/", workers)
    return proc


def start_conductor(port: int, workers: int, tree: str | None) -> subprocess.Popen:
    env = dict(os.environ, KV_CONDUCTOR_LOG="warning")
    if tree:
        env["PYTHONPATH"] = tree
    cmd = [sys.executable, "-m", "kvconductor", "--host", "127.0.0.1", "--port", str(port)]
    if _supports(tree, "--no-snapshots"):  # trees before warm restarts have no snapshots
        cmd.append("--no-snapshots")
    cmd += ["--workers", str(workers)] if workers > 1 else []
    proc = subprocess.Popen(cmd, env=env, cwd=tree or None)
    _wait(port, proc, "/health", workers)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    register(conn, INSTANCE, 0)
    load_chain(conn, INSTANCE, 0, tokens(max(SIZES), DOC_SEED), BASE_HASH)
    conn.close()
    return proc


_HELP: dict = {}


def _supports(tree: str | None, flag: str) -> bool:
    if tree not in _HELP:
        env = dict(os.environ, PYTHONPATH=tree) if tree else None
        _HELP[tree] = subprocess.run(
            [sys.executable, "-m", "kvconductor", "--help"],
            env=env,
            cwd=tree or None,
            capture_output=True,
            text=True,
        ).stdout
    return flag in _HELP[tree]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(port: int, files: dict, bodies_: dict, args) -> dict:
    use_wrk = shutil.which("wrk") is not None and not args.python_clients
    out = {}
    for size in SIZES:
        for conns in args.connections:
            if use_wrk:
                wrk_load(port, files[size], conns, 1, 1)  # warm-up
                out[(size, conns)] = wrk_load(port, files[size], conns, 1, args.seconds)
                if out[(size, conns)]["errors"]:
                    raise SystemExit(f"{out[(size, conns)]['errors']} answers were not 200")
            else:
                out[(size, conns)] = python_load(port, bodies_[size], conns, args.seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--also", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--python-clients", action="store_true", help="do not use wrk")
    args = ap.parse_args()
    doc = tokens(max(SIZES), DOC_SEED)
    bodies_ = {n: bodies(doc[:n])["msgpack"][0] for n in SIZES}
    contenders = [("floor", None), ("kvc", None)]
    for spec in args.also:
        name, _, tree = spec.partition("=")
        contenders.append((name, os.path.abspath(tree)))
    results: dict = {}  # (contender, workers, size, conns) -> [row per round]
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n, body in bodies_.items():
            files[n] = os.path.join(tmp, f"q{n}.body")
            with open(files[n], "wb") as f:
                f.write(body)
        # the floor answers what kv-conductor answers to the 4k query (same bytes back)
        port = free_port()
        proc = start_conductor(port, 1, None)
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            st, data, _ = post(c, "/query", bodies_[4096], "application/msgpack")
        finally:
            stop(proc)
        if st != 200:
            raise SystemExit(f"/query failed: {st} {data[:200]!r}")
        answer = os.path.join(tmp, "answer.bin")
        with open(answer, "wb") as f:
            f.write(data)
        for rnd in range(args.rounds):
            for workers in args.workers:
                for name, tree in contenders:
                    if workers > 1 and tree and not _supports(tree, "--workers"):
                        continue  # a tree from before --workers: one process only
                    port = free_port()
                    if name == "floor":
                        proc = start_floor(port, workers, answer)
                    else:
                        proc = start_conductor(port, workers, tree)
                    try:
                        rows = measure(port, files, bodies_, args)
                    finally:
                        stop(proc)
                    for (size, conns), row in rows.items():
                        results.setdefault((name, workers, size, conns), []).append(row)
                    print(f"round {rnd + 1} workers={workers} {name}: done", file=sys.stderr)
    print_table(results, contenders, args)


def print_table(results: dict, contenders: list, args) -> None:
    print(f"model {MODEL!r}, {os.cpu_count()} CPUs, {args.seconds:g} s per cell, wrk -t1")
    hdr = (
        f"{'workers':>7} {'tokens':>6} {'conns':>5} {'round':>5} {'who':>6} "
        f"{'req/s':>8} {'p50 µs':>7} {'p99 µs':>7} {'of floor':>8} {'p50 x':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for workers in args.workers:
        for size in SIZES:
            for conns in args.connections:
                floors = results[("floor", workers, size, conns)]
                for i, floor in enumerate(floors):
                    for name, _ in contenders:
                        if (name, workers, size, conns) not in results:
                            continue
                        row = results[(name, workers, size, conns)][i]
                        print(
                            f"{workers:>7} {size:>6} {conns:>5} {i + 1:>5} {name:>6} "
                            f"{row['rps']:>8,.0f} {row['p50'] * 1e3:>7.0f} "
                            f"{row['p99'] * 1e3:>7.0f} {row['rps'] / floor['rps']:>8.2f} "
                            f"{row['p50'] / floor['p50']:>6.2f}"
                        )
    one = {k[1:]: v for k, v in results.items() if k[0] == "kvc"}
    if 1 in args.workers and 2 in args.workers:
        for size in SIZES:
            for conns in args.connections:
                r1 = [r["rps"] for r in one[(1, size, conns)]]
                r2 = [r["rps"] for r in one[(2, size, conns)]]
                ratios = " / ".join(f"{b / a:.2f}" for a, b in zip(r1, r2, strict=True))
                print(f"kvc --workers 2 over one process, {size} tokens, {conns} conns: {ratios}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
