"""The Dynamo dialect's queries beside the real ``python -m dynamo.indexer``.

Starts ``python -m kvconductor --dynamo-port`` (``--workers N`` when asked) and ``python -m
dynamo.indexer --threads 1`` on free loopback ports, and ``--engines`` ZeroMQ publishers
(an XPUB each, vLLM 0.33's wire batches: :mod:`bench.trace_server`'s events), each
registered with both over Dynamo's ``POST /register``. Every engine stores an HBM chain of
``--depth`` blocks of 16 tokens for each of 16 prompts (engine e holds prompt p to depth
``depth - (e + p) % 8``); once both answer every engine's chains, the same 1,024-token
prompt is asked over one keep-alive connection per route, in alternating rounds: our
dialect's ``/query`` and ``/query_by_hash``, Dynamo's ``/query`` and ``/query_by_hash``,
and V3's ``/query`` for reference (``--salt``: also our dialect's ``/query`` with a
``cache_salt``, which matches nothing here). Prints the client round trip's p50 and p99
per round and whether the two services' answers were equal; nothing here asserts timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from bench.mooncake_query import ROOT, _free_port, _wait, round_trips
from bench.trace_dynamo_server import DynamoIndexer
from bench.trace_server import TOPIC, BlockStored, KVEventBatch
from bench.trace_services import Conn
from kvconductor._hash import hash_blocks

BS, PROMPTS, MODEL = 16, 16, "m"
JSON = "application/json"


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _prompt(p: int, n: int) -> list[int]:
    return [(p * 7919 + i * 31) % 50000 + 1 for i in range(n)]


def _post(conn: Conn, path: str, body: bytes, ctype: str = JSON) -> bytes:
    """``POST`` over a keep-alive connection that reconnects once when the server closed
    it (idle past ``--keep-alive-secs`` while another route was measured)."""
    r, data = conn.request("POST", path, body, {"Content-Type": ctype})
    if r.status not in (200, 201):
        raise RuntimeError(f"{path}: {r.status} {data[:200]!r}")
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--depth", type=int, default=64, help="blocks per prompt (1,024 tokens)")
    ap.add_argument("--workers", type=int, default=1, help="kv-conductor --workers N")
    ap.add_argument("--requests", type=int, default=2000, help="per route and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--salt", action="store_true", help="also our salted /query")
    args = ap.parse_args()
    v3_port, dyn_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "kvconductor", "--port", str(v3_port), "--no-snapshots"]
    cmd += ["--dynamo-port", str(dyn_port), "--log-level", "warning"]
    cmd += ["--workers", str(args.workers)]
    ours = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    ref = None
    ctx = zmq.Context()
    logdir = tempfile.mkdtemp(prefix="dynamo-query-")
    try:
        _wait(v3_port, ours)
        ref = DynamoIndexer(0, logdir, threads=1)  # python -m dynamo.indexer, its log there
        ref_port = ref.port
        conns = {
            name: Conn(port)
            for name, port in (("v3", v3_port), ("ours", dyn_port), ("dynamo", ref_port))
        }
        socks = []
        for e in range(args.engines):
            s = ctx.socket(zmq.XPUB)
            s.setsockopt(zmq.XPUB_VERBOSE, 1)  # both subscriptions, not one
            port = s.bind_to_random_port("tcp://127.0.0.1")
            socks.append(s)
            reg = {"instance_id": e, "endpoint": f"tcp://127.0.0.1:{port}", "model_name": MODEL,
                   "block_size": BS, "dp_rank": 0}  # fmt: skip
            for name in ("ours", "dynamo"):
                _post(conns[name], "/register", json.dumps(reg).encode(), JSON)
        for s in socks:  # both services subscribed before anything is sent
            for _ in range(2):
                s.recv()
        enc = msgspec.msgpack.Encoder()
        tokens = _prompt(0, args.depth * BS)
        for e, s in enumerate(socks):
            events = []
            for p in range(PROMPTS):
                n = args.depth - (e + p) % 8
                hashes = [1_000_000 * (p + 1) + b for b in range(n)]
                events.append(BlockStored(hashes, None, _prompt(p, n * BS), BS, None, "GPU", None))
            batch = enc.encode(KVEventBatch(time.time(), events, 0))
            s.send_multipart([TOPIC, (0).to_bytes(8, "big"), batch])
        q = json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()
        hashes = [_signed(h) for h in hash_blocks(tokens, BS)]
        qh = json.dumps({"block_hashes": hashes, "model_name": MODEL}).encode()
        deadline = time.monotonic() + 60
        while True:
            got = {n: json.loads(_post(conns[n], "/query", q, JSON)) for n in ("ours", "dynamo")}
            if all(len(a["scores"]) == args.engines for a in got.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not applied: {got}")
            time.sleep(0.2)
        equal = all(
            json.loads(_post(conns["ours"], path, body, JSON))
            == json.loads(_post(conns["dynamo"], path, body, JSON))
            for path, body in (("/query", q), ("/query_by_hash", qh))
        )
        v3 = json.dumps({"model": MODEL, "block_size": BS, "token_ids": tokens}).encode()
        routes = [
            ("ours /query", "ours", "/query", q),
            ("dynamo /query", "dynamo", "/query", q),
            ("ours /query_by_hash", "ours", "/query_by_hash", qh),
            ("dynamo /query_by_hash", "dynamo", "/query_by_hash", qh),
            ("V3 /query", "v3", "/query", v3),
        ]
        if args.salt:  # our dialect's salted /query (Dynamo's meaning differs: docs/api.md)
            salted = json.dumps({"token_ids": tokens, "model_name": MODEL, "cache_salt": "s"})
            routes.append(("ours /query cache_salt", "ours", "/query", salted.encode()))
        print(
            f"{args.engines} engines x {PROMPTS} prompts, {len(tokens)}-token prompt, block "
            f"size {BS}, kv-conductor --workers {args.workers}; answers equal: {equal}"
        )
        print(f"{'round':>5}  {'route':<24} {'p50 us':>8} {'p99 us':>8}")
        for rnd in range(args.rounds):
            for label, name, path, body in routes:

                def ask(conn=conns[name], path=path, body=body) -> bytes:
                    return _post(conn, path, body)

                p50, p99 = round_trips(ask, args.requests)
                print(f"{rnd:>5}  {label:<24} {p50:>8.0f} {p99:>8.0f}")
        return 0
    finally:
        ctx.destroy(linger=0)
        if ref is not None:
            ref.stop()
        ours.terminate()
        ours.wait(15)
        shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
