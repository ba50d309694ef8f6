"""GET /debug/dump, load-dump and --load-dump (kvconductor/dump.py), through real servers.

A server with an API key is filled over ZeroMQ (a vLLM publisher: HBM blocks and an
engine offload waiting for its pool) and over HTTP ``/events`` (HBM, CPU and Disk
blocks of two (model, tenant)s, with removals that leave blocks whose parent their
worker no longer holds). Its dump, loaded by a second server (``--load-dump``), must
give the same ``/workers`` counts and the same ``/query`` answers on random prompts.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import msgspec
import pytest

from kvconductor.state import dump
from tests.helpers.publishers import (
    FakePublisher,
    PoolPublisher,
    free_tcp_port,
    mooncake_tuple,
    schema,
    wait_until,
)
from tests.helpers.server import ROOT, running

pytestmark = pytest.mark.server

BS = 4
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = [("qwen", "default"), ("llama", "team-b")]
#: Token blocks the prompts are made of: few enough that random prompts share prefixes.
ALPHABET = [[1000 + 4 * b + i for i in range(BS)] for b in range(6)]


def chains(rng: random.Random, n: int) -> list[list[list[int]]]:
    """``n`` random chains of 1..6 token blocks over ALPHABET."""
    return [[rng.choice(ALPHABET) for _ in range(rng.randint(1, 6))] for _ in range(n)]


def events_for(rng: random.Random, instance: str, dp: int, base: int) -> list[dict]:
    """BlockStored chains on GPU, CPU and DISK, then some BlockRemoved."""
    out: list[dict] = []
    eid = 0
    h = base
    held: list[int] = []
    for medium in ("GPU", "GPU", "CPU", "DISK"):
        for chain in chains(rng, 4):
            hashes = list(range(h, h + len(chain)))
            h += len(chain)
            out.append(
                {
                    "event_id": eid,
                    "dp_rank": dp,
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": [t for blk in chain for t in blk],
                    "block_size": BS,
                    "medium": medium,
                }
            )
            eid += 1
            if medium == "GPU":
                held += hashes
    # remove some first blocks: their children stay, without their parent
    removed = rng.sample(held, len(held) // 4)
    out.append(
        {
            "event_id": eid,
            "dp_rank": dp,
            "type": "BlockRemoved",
            "block_hashes": removed,
            "medium": "GPU",
        }
    )
    return out


def register(server, instance: str, model: str, tenant: str, dp: int = 0, **fields) -> None:
    body = {
        "instance_id": instance,
        "type": "vLLM",
        "modelname": model,
        "tenant_id": tenant,
        "block_size": BS,
        "dp_rank": dp,
        **fields,
    }
    r = server.http.post("/register", json=body, headers=AUTH)
    assert r.status_code == 201, r.text


def query(server, model: str, tenant: str, tokens: list[int]) -> dict:
    body = {"model": model, "tenant_id": tenant, "block_size": BS, "token_ids": tokens}
    r = server.http.post("/query", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def indexer(server) -> list[dict]:
    r = server.http.get("/workers", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["indexer"]


def fill(server, pub: FakePublisher, pool: PoolPublisher, rng: random.Random) -> None:
    register(server, "eng", "qwen", "default", medium_endpoints={"npu": pub.url})
    register(server, "pool", "qwen", "default", store_backend="Mooncake", endpoint=pool.url)
    for k, (model, tenant) in enumerate(MODELS):
        for dp in (0, 1):
            register(server, f"http-{k}", model, tenant, dp=dp)
            batch = {
                "instance_id": f"http-{k}",
                "events": events_for(rng, f"http-{k}", dp, 10**6 * (k * 2 + dp + 1)),
            }
            r = server.http.post("/events", json=batch, headers=AUTH)
            assert r.status_code == 200, r.text
    v = schema("vllm", "0.33.0")
    toks = [t for blk in ALPHABET[:4] for t in blk]
    hbm = v.batch([v.stored([0xA0, 0xA1], None, toks[:8], BS, medium="GPU")])
    # an engine offload to CPU the pool has not confirmed: a two-phase record
    cpu = v.batch([v.stored([0xA2, 0xA3], 0xA1, toks[8:16], BS, medium="CPU")])

    # the pool confirms blocks no engine offloaded (yet): pending waits
    confirm = mooncake_tuple(
        [
            {
                "event_id": 1,
                "event_type": "stored",
                "backend_id": "127.0.0.1",
                "medium": medium,
                "seq_hashes": [0xB0, 0xB1],
            }
            for medium in ("cpu", "disk")
        ]
    )

    def indexed():
        pub.publish(hbm)
        pub.publish(cpu)
        pool.publish(confirm)
        s = {x["model_name"]: x for x in indexer(server)}.get("qwen", {})
        return s.get("offload") == 2 and s.get("pending_pool") == 4

    pub.wait_subscribed()
    pool.wait_subscribed()
    wait_until(indexed, msg="engine blocks and offload indexed")


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[t for blk in chain for t in blk] for chain in chains(rng, n)]


def counts(summaries: list[dict]) -> list[dict]:
    """The /workers index summaries without ``bytes`` (allocated capacity: a restored
    index is built in one go and may size its tables differently)."""
    return [{k: v for k, v in s.items() if k != "bytes"} for s in summaries]


def test_dump_then_load_dump_gives_the_same_index(tmp_path):
    rng = random.Random(1313)
    pub = FakePublisher(replay=False)
    pool = PoolPublisher()
    path = tmp_path / "kvc.dump"
    try:
        with running(tmp_path, "--api-key", KEY) as a:
            fill(a, pub, pool, rng)
            r = a.http.get("/debug/dump")
            assert r.status_code == 401
            assert r.json() == {
                "error": "missing or invalid bearer token (Authorization: Bearer <api key>)"
            }
            r = a.http.get("/debug/dump", headers=AUTH)
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/msgpack"
            path.write_bytes(r.content)
            want = indexer(a)
            # load-dump --url: download the live dump, then load it (no sockets)
            fetched = tmp_path / "fetched.dump"
            out = subprocess.run(
                [sys.executable, "-m", "kvconductor", "load-dump", str(fetched), "--url", a.url],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                env=dict(os.environ, KV_CONDUCTOR_API_KEY=KEY),
            )
            assert out.returncode == 0, out.stderr
            assert counts(msgspec.json.decode(out.stdout)["indexer"]) == counts(want)
            out = subprocess.run(
                [sys.executable, "-m", "kvconductor", "load-dump", str(fetched), "--url", a.url],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                env={k: v for k, v in os.environ.items() if k != "KV_CONDUCTOR_API_KEY"},
            )
            assert out.returncode == 1
            assert out.stderr.startswith(
                f"kv-conductor load-dump: {fetched}: GET {a.url}/debug/dump answered 401: "
            )
            assert out.stderr.count("\n") == 1
            qs = [(m, t, p) for m, t in MODELS for p in prompts(rng, 30)]
            answers = [query(a, m, t, p) for m, t, p in qs]
            workers = a.http.get("/workers", headers=AUTH).json()["workers"]
        assert {s["model_name"] for s in want} == {"qwen", "llama"}
        for s in want:
            assert s["hbm_blocks"] and s["cpu_blocks"] and s["disk_blocks"], s
        assert sum(1 for ans in answers if any(ans.values())) >= 30  # prompts do hit

        # the header record, then framed records
        first = next(dump._records([path.read_bytes()]))
        assert (first["format"], first["version"]) == ("kvconductor-dump", 2)

        with running(tmp_path, "--api-key", KEY, "--load-dump", str(path)) as b:
            got = indexer(b)
            assert counts(got) == counts(want)
            assert b.http.get("/workers", headers=AUTH).json()["workers"] == workers
            for (m, t, p), ans in zip(qs, answers, strict=True):
                assert query(b, m, t, p) == ans, (m, t, p)
            assert "warm start from" in b.log()

        # kv-conductor load-dump: in-process, no sockets; the same counts
        out = subprocess.run(
            [sys.executable, "-m", "kvconductor", "load-dump", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        doc = msgspec.json.decode(out.stdout)
        assert doc["loaded"] == {"sources": 2, "registrations": 6, "indexes": 2, "skipped": 0}
        assert counts(doc["indexer"]) == counts(want)
    finally:
        pub.stop()
        pool.stop()


def _sample_dump() -> bytes:
    snap = {"registrations": [], "indexes": []}
    return b"".join(dump.encode(snap))


def _last_frame(data: bytes) -> int:
    """Offset of the last framed record (the end record) of a dump."""
    pos = last = 0
    while pos < len(data):
        last = pos
        pos += 5 + int.from_bytes(data[pos + 1 : pos + 5], "big")
    return last


def _load(data: bytes):
    from kvconductor.state.conductor import Conductor, ConductorConfig

    c = Conductor(ConductorConfig(maintenance_interval=3600), subscriptions=dump._NoSubscriptions)
    return dump.load_dump(c, [data])


def test_bad_dumps_are_refused_with_the_reason(tmp_path):
    data = _sample_dump()
    assert _load(data) == {"sources": 0, "registrations": 0, "indexes": 0, "skipped": 0}
    # one changed byte anywhere (here a digit of the header's time) fails the checksum
    pos = data.index(b"created") + 12
    bad = data[:pos] + bytes([data[pos] ^ 1]) + data[pos + 1 :]
    with pytest.raises(ValueError, match="^corrupt dump: checksum mismatch"):
        _load(bad)
    with pytest.raises(ValueError, match="^corrupt dump: checksum mismatch"):
        dump.verify([bad])
    assert dump.verify([data])["version"] == 2
    # version 1 (no checksum, no cursors) still loads
    v1 = dump._frame({"format": "kvconductor-dump", "version": 1}) + dump._frame(
        {"t": "end", "registrations": 0, "indexes": 0}
    )
    assert _load(v1) == {"sources": 0, "registrations": 0, "indexes": 0, "skipped": 0}
    with pytest.raises(ValueError, match="^truncated dump: the input ends inside a record$"):
        _load(data[:-3])
    end = _last_frame(data)
    with pytest.raises(ValueError, match="^truncated dump: no end record$"):
        _load(data[:end])
    header = {"format": "kvconductor-dump", "version": 3}
    with pytest.raises(
        ValueError, match="^unsupported dump version 3: this kvconductor reads versions 1 and 2$"
    ):
        _load(dump._frame(header) + data[end:])
    with pytest.raises(ValueError, match="^not a kvconductor dump: byte 0x7b where a record"):
        _load(b'{"format": "json"}')
    # load-dump: one line on stderr, exit 1
    bad = tmp_path / "bad.dump"
    bad.write_bytes(data[:-3])
    out = subprocess.run(
        [sys.executable, "-m", "kvconductor", "load-dump", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr == (
        f"kv-conductor load-dump: {bad}: truncated dump: the input ends inside a record\n"
    )
    assert out.stdout == ""


def test_warm_start_refuses_a_bad_dump(tmp_path):
    from tests.helpers.server import Server

    bad = tmp_path / "bad.dump"
    bad.write_bytes(_sample_dump()[:-3])
    srv = Server(tmp_path, "--load-dump", str(bad))
    try:
        assert srv.proc.wait(60) == 1
    finally:
        srv.http.close()
        srv._log.close()
    assert f"cannot load dump {bad}: truncated dump: the input ends inside a record" in srv.log()


def test_registrations_load_back_identical():
    """Every registration shape recreates the same registry entry (sources, pool flag,
    HBM-IP index), without sockets."""
    from kvconductor.schema import RegisterRequest
    from kvconductor.state.conductor import Conductor, ConductorConfig

    def conductor():
        c = Conductor(
            ConductorConfig(maintenance_interval=3600), subscriptions=dump._NoSubscriptions
        )
        c.start()
        return c

    a, b = conductor(), conductor()
    try:
        for body in [
            {"instance_id": "http-only", "dp_rank": 0},
            {
                "instance_id": "two-urls",
                "dp_rank": 1,
                "node_id": "n1",
                "medium_endpoints": {"NPU": "tcp://10.0.0.1:1", "cpu": "tcp://10.0.0.1:2"},
                "replay_endpoint": "tcp://10.0.0.1:3",
            },
            {
                "instance_id": "legacy",
                "dp_rank": 0,
                "store_backend": "YuanRong",
                "endpoint": "tcp://10.0.0.2:1",
            },
            {"instance_id": "pool", "dp_rank": 0, "endpoint": "tcp://10.0.0.3:1"},
            {  # a shared store of one LoRA adapter (the Mooncake dialect's type Mooncake)
                "instance_id": "store",
                "dp_rank": 0,
                "endpoint": "tcp://10.0.0.3:2",
                "shared_store": True,
                "lora_name": "ad-1",
            },
            {
                "instance_id": "yuanrong-pool-10.0.0.2-qwen",
                "dp_rank": 0,
                "store_backend": "YuanRong",
                "medium_endpoints": {"cpu": "tcp://10.0.0.2:5", "disk": "tcp://10.0.0.2:5"},
            },
            {
                "instance_id": "lmcache",
                "dp_rank": 0,
                "medium_endpoints": {"npu": "tcp://10.0.0.5:1"},
                "store_only": {"ttl_secs": 60, "capacity": 100},
            },
            {
                "instance_id": "mc",
                "dp_rank": 0,
                "tenant_id": "t",
                "medium_endpoints": {
                    "npu": "tcp://10.0.0.4:1",
                    "cpu": "tcp://10.0.0.4:1",
                    "disk": "tcp://10.0.0.4:1",
                },
            },
        ]:
            req = {"type": "vLLM", "modelname": "qwen", "block_size": BS, **body}
            a.call(a.register, msgspec.convert(req, RegisterRequest))
        data = b"".join(dump.write_dump(a))
        assert b.call(dump.load_dump, b, [data]) == {
            "sources": 0,
            "registrations": 8,
            "indexes": 2,
            "skipped": 0,
        }
        assert b.registry.instances == a.registry.instances
        store = b.registry.get("store").endpoints[0]
        assert (store.shared_store, store.lora_name) == (True, "ad-1")
        assert b.registry.get("yuanrong-pool-10.0.0.2-qwen").endpoints[0].node_pool
        assert b.registry.hbm_ip_index == a.registry.hbm_ip_index
        assert b.registry.hbm_ip_index  # the Mooncake engine's HBM IP
        assert b.call(b.workers) == a.call(a.workers)
    finally:
        a.stop()
        b.stop()


def test_store_only_blocks_loaded_from_a_dump_are_bounded():
    """A store-only DP's CPU blocks come back from a dump after its registration opened
    the subscription: load_dump puts them under the bound, so they still age out."""
    import time

    from kvconductor.keys import Medium, WorkerKey
    from kvconductor.schema import RegisterRequest
    from kvconductor.state.conductor import Conductor, ConductorConfig

    iid = "vllm-lmcache-1"
    req = msgspec.convert(
        {"instance_id": iid, "type": "vLLM", "modelname": "qwen", "block_size": BS,
         "dp_rank": 0, "medium_endpoints": {"npu": f"tcp://127.0.0.1:{free_tcp_port()}"},
         "store_only": {"ttl_secs": 60, "capacity": 100}},
        RegisterRequest,
    )  # fmt: skip
    tokens = list(range(1, 4 * BS + 1))
    key = WorkerKey(iid, iid, 0, Medium.CPU)
    a = Conductor(ConductorConfig(maintenance_interval=3600))
    b = Conductor(ConductorConfig(maintenance_interval=3600))
    a.start()
    b.start()
    try:
        a.call(a.register, req)
        idx = a.call(a.get_or_create_index, "qwen", "default")
        a.call(idx.store_tokens, key, None, [11, 12, 13, 14], tokens, BS)
        data = b"".join(a.call(lambda: list(dump.write_dump(a))))
        b.call(dump.load_dump, b, [data])
        held = b.call(lambda: b.indexes[("qwen", "default")].worker_blocks(key))
        assert held == 4
        (src,) = b.call(b.subs.sources)
        assert src["store_only"]["blocks"] == 4
        b.call(b.subs.check_sources, time.monotonic() + 61)
        assert b.call(lambda: b.indexes[("qwen", "default")].worker_blocks(key)) == 0
    finally:
        a.stop()
        b.stop()
