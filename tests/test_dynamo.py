"""Dynamo's standalone indexer dialect (``--dynamo-port``, kvconductor.http.dynamo).

Reference: ``python -m dynamo.indexer`` of PyPI ``ai-dynamo-runtime`` 1.6.1 (installed in
CI). Its routes, bodies, status codes and error messages were read from the live service
(its Rust source is not in the wheel); the statuses and messages asserted here are the
ones it answers. :func:`test_answers_equal_dynamos_on_the_same_events` runs the real
service beside kvconductor, both fed by the same vLLM 0.33 publishers
(tests/helpers/realpub.py), and compares their answers query for query.
"""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest

from kvconductor._hash import hash_blocks
from kvconductor.http.dynamo import dynamo_answer
from tests.helpers.publishers import free_tcp_port, wait_until
from tests.helpers.realpub import vllm_kv_events
from tests.helpers.server import (
    dialect_server,
    free_port,
    register_engine,
    running,
    tls_server,
    trusting,
)

BS = 16
MODEL = "dyn-model"


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _hashes(tokens: list[int]) -> list[int]:
    """The local hashes of ``tokens``' complete blocks, as the i64 Dynamo's JSON takes."""
    return [_signed(h) for h in hash_blocks(tokens, BS)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with dialect_server(tmp_path_factory.mktemp("dynamo"), "--dynamo-port") as (s, client):
        s.dyn = client
        yield s


def _reg(iid: int, dp: int = 0, model: str = MODEL, **extra) -> dict:
    return {
        "instance_id": iid,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "model_name": model,
        "block_size": BS,
        "dp_rank": dp,
        **extra,
    }


def _event(tokens: list[int], first: int, medium: str = "GPU", dp: int = 0) -> dict:
    """A vLLM BlockStored over V3's POST /events: blocks of ``tokens``, engine hashes
    ``first``, ``first + 1``, ... chained."""
    n = len(tokens) // BS
    return {
        "event_id": first,
        "dp_rank": dp,
        "type": "BlockStored",
        "block_hashes": list(range(first, first + n)),
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "medium": medium,
    }


def _post_events(srv, iid: int, events: list[dict], model: str = MODEL) -> None:
    r = srv.http.post(
        "/events",
        json={"instance_id": str(iid), "model": model, "tenant_id": "default", "events": events},
    )
    assert r.status_code == 200, r.text


def test_register_query_and_workers(srv):
    r = srv.dyn.post("/register", json=_reg(101))
    assert (r.status_code, r.json()) == (201, {"status": "ok"})
    r = srv.dyn.post("/register", json=_reg(101, dp=1))
    assert r.status_code == 201
    tokens = list(range(1, 4 * BS + 1))
    _post_events(srv, 101, [_event(tokens[: 3 * BS], 5000)])
    _post_events(srv, 101, [_event(tokens[: 2 * BS], 6000, "CPU", dp=1)])
    want = {
        "scores": {"101": {"0": 3 * BS}},
        "frequencies": [],
        "instances": {
            "101": {
                "longest_matched": 3 * BS,
                "gpu": 3 * BS,
                "dp": {"0": 3 * BS, "1": 0},
                "cpu": 3 * BS,
                "disk": 3 * BS,
            }
        },
    }
    r = srv.dyn.post("/query", json={"token_ids": tokens + [7], "model_name": MODEL})
    assert (r.status_code, r.json()) == (200, want)
    r = srv.dyn.post("/query_by_hash", json={"block_hashes": _hashes(tokens), "model_name": MODEL})
    assert (r.status_code, r.json()) == (200, want)
    # a V3 query of the same index says the same blocks
    v3 = srv.http.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": tokens})
    assert v3.status_code == 200
    workers = srv.dyn.get("/workers").json()
    mine = [w for w in workers if w["instance_id"] == 101]
    assert len(mine) == 1
    w = mine[0]
    assert (w["model_name"], w["routing_group"], w["block_size"], w["source"]) == (
        MODEL,
        "default",
        BS,
        "zmq",
    )
    assert sorted(w["endpoints"]) == ["0", "1"] and sorted(w["listeners"]) == ["0", "1"]
    assert w["listeners"]["0"]["endpoint"] == w["endpoints"]["0"]
    # the registration is ours too: V3's /workers lists it under its string id
    v3_workers = srv.http.get("/workers").json()["workers"]
    assert any(x["instance_id"] == "101" for x in v3_workers)
    # instances registered over V3 whose id is no u64 in decimal are not Dynamo's to list
    for other in ("prefill-a", "007", "\u00b2"):
        register_engine(srv, other, modelname=MODEL, block_size=BS)
    assert [w["instance_id"] for w in srv.dyn.get("/workers").json()] == [101]
    for other in ("prefill-a", "007", "\u00b2"):
        unregister = {"instance_id": other, "type": "vLLM", "modelname": MODEL,
                      "block_size": BS, "dp_rank": 0}  # fmt: skip
        assert srv.http.post("/unregister", json=unregister).status_code == 200
    assert srv.dyn.post("/unregister", json={"instance_id": 101, "model_name": MODEL}).json() == {
        "status": "ok"
    }
    assert not [w for w in srv.dyn.get("/workers").json() if w["instance_id"] == 101]


def test_dynamos_status_codes_and_messages(srv):
    d = srv.dyn
    assert d.post("/register", json=_reg(201)).status_code == 201
    dup = d.post("/register", json=_reg(201))
    assert (dup.status_code, dup.json()) == (
        409,
        {"error": "instance 201 dp_rank 0 already registered"},
    )
    other = d.post("/register", json={**_reg(202), "block_size": 32})
    assert (other.status_code, other.json()) == (
        409,
        {
            "error": f"block_size mismatch for model={MODEL} routing_group=default: "
            "existing=16, requested=32"
        },
    )
    missing = d.post("/query", json={"model_name": MODEL})
    assert missing.status_code == 422
    assert missing.json()["error"].startswith(
        "Failed to deserialize the JSON body into the target type: "
    )
    assert "token_ids" in missing.json()["error"]
    bad = d.post("/query", content=b"xx", headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert bad.json()["error"].startswith("Failed to parse the request body as JSON: ")
    media = d.post("/query", content=b"{}", headers={"content-type": "text/plain"})
    assert (media.status_code, media.json()) == (
        415,
        {"error": "Expected request with `Content-Type: application/json`"},
    )
    neg = d.post("/register", json={**_reg(203), "instance_id": -3})
    assert neg.status_code == 422
    nothing = d.post("/query", json={"token_ids": [1], "model_name": "nope"})
    assert (nothing.status_code, nothing.json()) == (
        404,
        {"error": "no indexer for model=nope routing_group=default"},
    )
    group = d.post(
        "/query_by_hash", json={"block_hashes": [1], "model_name": MODEL, "routing_group": "g"}
    )
    assert (group.status_code, group.json()) == (
        404,
        {"error": f"no indexer for model={MODEL} routing_group=g"},
    )
    gone = d.post("/unregister", json={"instance_id": 299, "model_name": MODEL})
    assert (gone.status_code, gone.json()) == (404, {"error": "instance 299 not found"})
    wrong = d.post("/unregister", json={"instance_id": 201, "model_name": "other"})
    assert (wrong.status_code, wrong.json()) == (
        404,
        {"error": f"instance 201 is registered for model={MODEL} routing_group=default"},
    )
    assert d.get("/query").status_code == 405
    assert d.get("/nowhere").status_code == 404
    health = d.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    empty = d.post("/query", json={"token_ids": [1, 2], "model_name": MODEL})
    assert empty.json() == {"scores": {}, "frequencies": [], "instances": {}}
    assert d.post("/unregister", json={"instance_id": 201, "model_name": MODEL}).status_code == 200
    doc = d.get("/openapi.json").json()
    assert sorted(doc["paths"]) == [
        "/health",
        "/openapi.json",
        "/query",
        "/query_by_hash",
        "/register",
        "/unregister",
        "/workers",
    ]
    assert "201" in doc["paths"]["/register"]["post"]["responses"]


def test_routing_group_is_the_tenant(srv):
    assert srv.dyn.post("/register", json=_reg(301, routing_group="team-a")).status_code == 201
    tokens = list(range(900, 900 + 2 * BS))
    r = srv.http.post(
        "/events",
        json={
            "instance_id": "301",
            "model": MODEL,
            "tenant_id": "team-a",
            "events": [_event(tokens, 7000)],
        },
    )
    assert r.status_code == 200, r.text
    q = {"token_ids": tokens, "model_name": MODEL, "routing_group": "team-a"}
    assert srv.dyn.post("/query", json=q).json()["scores"] == {"301": {"0": 2 * BS}}
    v3 = srv.http.post(
        "/query",
        json={"model": MODEL, "tenant_id": "team-a", "block_size": BS, "token_ids": tokens},
    ).json()
    assert v3["team-a"]["301"]["longest_matched"] == 2 * BS
    assert (
        srv.dyn.post(
            "/unregister", json={"instance_id": 301, "model_name": MODEL, "routing_group": "team-a"}
        ).status_code
        == 200
    )


def test_dynamo_answer_from_exclusive_rows():
    """Cumulative tiers per instance; scores only for ranks with GPU tokens."""
    rows = [("7", 0, 2, 1, 0), ("7", 1, 0, 3, 1), ("8", 0, 0, 0, 0)]
    got = dynamo_answer(rows, 4)
    assert got.scores == {"7": {"0": 8}}
    m = got.instances["7"]
    assert (m.gpu, m.cpu, m.disk, m.longest_matched, m.dp) == (8, 12, 16, 16, {"0": 8, "1": 0})
    assert "8" not in got.instances and got.frequencies == []


def test_api_key_guards_register_unregister_and_workers(tmp_path):
    port = free_port()
    with running(tmp_path, "--dynamo-port", str(port), "--api-key", "s3cret") as s:
        d = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        r = d.post("/register", json=_reg(401))
        assert r.status_code == 401 and "error" in r.json()
        assert d.get("/workers").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert d.post("/register", json=_reg(401), headers=auth).status_code == 201
        assert d.get("/workers", headers=auth).status_code == 200
        assert d.post("/query", json={"token_ids": [1], "model_name": MODEL}).status_code == 200
        assert "dynamo dialect: bad request method=POST path=/register status=401" in s.log()
    port = free_port()
    with running(
        tmp_path, "--dynamo-port", str(port), "--api-key", "s3cret", "--dynamo-port-open"
    ) as s:
        d = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        assert d.post("/register", json=_reg(402)).status_code == 201
        assert "--dynamo-port-open: the Dynamo indexer dialect" in s.log()


def test_tls_and_the_body_limit_as_on_v3(tmp_path, pki):
    """The dialect's port takes the V3 port's TLS and --max-body-mb."""
    port = free_port()
    srv = tls_server(tmp_path, pki, "--dynamo-port", str(port), "--max-body-mb", "1")
    try:
        srv.wait_ready()
        with httpx.Client(
            base_url=f"https://127.0.0.1:{port}", timeout=10.0, verify=trusting(pki)
        ) as d:
            assert d.get("/health").status_code == 200
            big = {"token_ids": list(range(300_000)), "model_name": MODEL}
            r = d.post("/query", json=big)
            assert (r.status_code, r.json()) == (
                413,
                {"error": "request body exceeds the limit of 1048576 bytes"},
            )
            r = d.post("/query", json={"token_ids": [1], "model_name": MODEL})
            assert r.status_code == 404  # served on: nothing registered yet
        with pytest.raises(httpx.HTTPError):  # no plain HTTP there
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5.0)
    finally:
        srv.terminate()


# -- --workers N: both dialects, served by the owner ----------------------------------------


def test_both_dialects_with_workers(tmp_path):
    """Both dialects' ports are the workers' (SO_REUSEPORT, as the V3 port): a
    registration made on one worker (forwarded to the owner) is answered by every worker;
    the Dynamo dialect's queries are answered in the workers from the shared index, so
    they are answered with the owner stopped (SIGSTOP; --reader-stall-ms 0: no worker is
    killed for the owner's silence)."""
    mc, dy = free_port(), free_port()
    flags = (
        "--workers",
        "2",
        "--mooncake-port",
        str(mc),
        "--dynamo-port",
        str(dy),
        "--source-down-secs",
        "86400",
        "--source-purge-secs",
        "0",
        "--reader-stall-ms",
        "0",
    )
    with running(tmp_path, *flags) as s:
        d = httpx.Client(base_url=f"http://127.0.0.1:{dy}", timeout=10.0)
        m = httpx.Client(base_url=f"http://127.0.0.1:{mc}", timeout=10.0)
        assert d.post("/register", json=_reg(501)).status_code == 201
        r = m.post(
            "/register",
            json={
                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                "type": "vLLM",
                "modelname": MODEL,
                "instance_id": "moon-1",
                "block_size": BS,
                "dp_rank": 0,
            },
        )
        assert r.status_code == 200, r.text
        tokens = list(range(50, 50 + 3 * BS))
        _post_events(s, 501, [_event(tokens, 8000)])  # through a worker, to the owner
        _post_events(s, "moon-1", [_event(tokens[: 2 * BS], 9000)])
        want_dyn = {"501": {"0": 3 * BS}, "moon-1": {"0": 2 * BS}}
        got = d.post("/query", json={"token_ids": tokens, "model_name": MODEL}).json()
        assert got["scores"] == want_dyn
        got = m.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": tokens})
        inst = got.json()["instances"]
        assert (inst["501"]["gpu"], inst["moon-1"]["gpu"]) == (3 * BS, 2 * BS)
        # the workers answer the Dynamo dialect's queries themselves: the owner stopped
        hashes = {"block_hashes": _hashes(tokens), "model_name": MODEL}
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(10):  # new connections: spread over the workers
                for path, q in (("/query", {"token_ids": tokens, "model_name": MODEL}),
                                ("/query_by_hash", hashes)):  # fmt: skip
                    r = httpx.post(f"http://127.0.0.1:{dy}{path}", json=q, timeout=5.0)
                    assert r.status_code == 200 and r.json()["scores"] == want_dyn
                    assert r.headers["date"]
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)
        # the V3 port's workers read the same shared index
        for _ in range(20):
            v3 = httpx.post(
                f"{s.url}/query", json={"model": MODEL, "block_size": BS, "token_ids": tokens}
            )
            assert v3.status_code == 200
            longest = {i: v["longest_matched"] for i, v in v3.json()["default"].items()}
            assert longest == {"501": 3 * BS, "moon-1": 2 * BS}
        assert d.post("/unregister", json={"instance_id": 501, "model_name": MODEL}).json() == {
            "status": "ok"
        }
        wait_until(
            lambda: (
                "501"
                not in d.post("/query", json={"token_ids": tokens, "model_name": MODEL}).json()[
                    "scores"
                ]
            ),
            msg="unregistered over the dialect",
        )


# -- answer for answer against the real python -m dynamo.indexer ----------------------------


#: The equivalence run: engines (instance, DP), prompt families, blocks per family.
ENGINES = ((1, 0), (2, 0), (3, 0), (4, 0), (4, 1))
FAMILIES, DEPTH = 24, 12
#: A LoRA adapter's chains: their engine hashes are offset by this.
LORA, LORA_HASHES = "adapter-a", 10**8


def _ehash(family: int, block: int) -> int:
    """A block's engine hash: the same block (family, position) on every engine, as
    vLLM's content hashes are."""
    return 1_000_000 * (family + 1) + block


class _Engine:
    """One vLLM 0.33 ZmqEventPublisher (its own code) and what it holds per family:
    a GPU prefix of ``gpu`` blocks, then ``cpu`` blocks offloaded after it (to CPU or
    to storage)."""

    def __init__(self, k, iid: int, dp: int, rng: random.Random) -> None:
        self.k, self.iid, self.dp, self.rng = k, iid, dp, rng
        port = free_tcp_port()
        # vLLM binds its endpoint's port + the DP rank
        self.pub = k.ZmqEventPublisher(
            data_parallel_rank=dp, endpoint=f"tcp://*:{port - dp}", topic="kv-events"
        )
        self.url = f"tcp://127.0.0.1:{port}"
        self.gpu = [0] * FAMILIES
        self.cpu = [0] * FAMILIES

    def publish(self, events: list) -> None:
        self.pub.publish(
            self.k.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp)
        )

    def block(self, hashes: list[int], parent: int | None, tokens: list[int], medium: str):
        """vLLM's BlockStored (its fields in order: hashes, parent, tokens, block size,
        LoRA id, medium, LoRA name)."""
        return self.k.BlockStored(hashes, parent, tokens, BS, None, medium, None)

    def stored(self, tokens: list[int], family: int, first: int, n: int, medium: str):
        parent = _ehash(family, first - 1) if first else None
        hashes = [_ehash(family, b) for b in range(first, first + n)]
        return self.block(hashes, parent, tokens[first * BS : (first + n) * BS], medium)

    def step(self, fams: list[list[int]]):
        """One random event: a GPU prefix stored or extended, a CPU or storage offload
        after it, or the GPU prefix's tail removed."""
        f = self.rng.randrange(FAMILIES)
        g, c = self.gpu[f], self.cpu[f]
        kind = self.rng.choice(("gpu", "gpu", "cpu", "remove"))
        if kind == "remove" and g > 1 and not c:
            n = self.rng.randint(1, g - 1)
            self.gpu[f] = g - n
            hashes = [_ehash(f, b) for b in range(g - n, g)]
            return self.k.BlockRemoved(block_hashes=hashes, medium="GPU")
        if kind == "cpu" and g and not c and g < DEPTH:
            n = self.rng.randint(1, DEPTH - g)
            self.cpu[f] = n
            return self.stored(fams[f], f, g, n, self.rng.choice(("CPU", "STORAGE")))
        if not c and g < DEPTH:
            n = self.rng.randint(1, DEPTH - g)
            self.gpu[f] = g + n
            return self.stored(fams[f], f, g, n, "GPU")
        return None


def _seen(clients, iid: int, dp: int, tokens: list[int]) -> bool:
    """Every service answers ``tokens`` (one block) with (iid, dp) matching."""
    for c in clients:
        r = c.post("/query", json={"token_ids": tokens, "model_name": MODEL})
        if r.status_code != 200 or str(dp) not in r.json()["instances"].get(str(iid), {}).get(
            "dp", {}
        ):
            return False
    return True


def _mark(e: _Engine, clients, tokens: list[int], ehash: int) -> None:
    """Publish a block of ``tokens`` on ``e`` until every service answers it: its
    subscriptions are connected (warm-up) or everything before it is applied (an
    engine's batches are applied in order on both)."""
    ev = e.block([ehash], None, tokens, "GPU")

    def arrived() -> bool:
        if _seen(clients, e.iid, e.dp, tokens):
            return True
        e.publish([ev])
        return False

    wait_until(arrived, timeout=30, interval=0.3, msg=f"engine {e.iid}/{e.dp} marker")


def test_answers_equal_dynamos_on_the_same_events(tmp_path, dynamo_indexer):
    """kvconductor's Dynamo dialect and the real ``python -m dynamo.indexer``, fed the same
    vLLM 0.33 publishers (4 instances, one with 2 DP ranks; GPU prefixes stored, extended
    and cut, CPU and storage offloads after them, a LoRA adapter's chains), answer 360
    ``/query`` (with and without ``lora_name``, ``cache_salt``) and ``/query_by_hash``
    (with a ``cache_salt``: Dynamo's 400) requests alike: same
    status, same JSON (docs/api.md, "The Dynamo indexer dialect": nothing to normalize
    for these)."""
    k = vllm_kv_events()
    rng = random.Random(39)
    fams = [[rng.randrange(1, 50_000) for _ in range(DEPTH * BS)] for _ in range(FAMILIES)]
    port = free_port()
    flags = ("--dynamo-port", str(port), "--source-down-secs", "86400", "--source-purge-secs", "0")
    engines = [_Engine(k, iid, dp, rng) for iid, dp in ENGINES]
    try:
        with running(tmp_path, *flags) as s:
            ours = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
            clients = (ours, dynamo_indexer)
            for e in engines:
                body = {
                    "instance_id": e.iid,
                    "endpoint": e.url,
                    "model_name": MODEL,
                    "block_size": BS,
                    "dp_rank": e.dp,
                }
                for c in clients:
                    r = c.post("/register", json=body)
                    assert r.status_code == 201, r.text
            marks = iter(range(10**9, 10**9 + 100))
            for e in engines:  # both subscribed before the events
                _mark(e, clients, [rng.randrange(60_000, 70_000) for _ in range(BS)], next(marks))
            for _ in range(30):
                for e in engines:
                    events = [ev for ev in (e.step(fams) for _ in range(3)) if ev is not None]
                    if events:
                        e.publish(events)
            for i, e in enumerate(engines):  # a LoRA adapter's chains: other blocks
                f, n = i % 4, 4 + i
                hashes = [LORA_HASHES + _ehash(f, b) for b in range(n)]
                lora = e.k.BlockStored(hashes, None, fams[f][: n * BS], BS, None, "GPU", LORA)
                e.publish([lora])
            for e in engines:  # everything applied on both
                _mark(e, clients, [rng.randrange(70_000, 80_000) for _ in range(BS)], next(marks))

            queries: list[tuple[str, dict]] = []
            for toks in fams:
                for blocks in (1, 2, 4, 6, 9, 12):
                    cut = blocks * BS + rng.randrange(BS)
                    queries.append(("/query", {"token_ids": toks[:cut], "model_name": MODEL}))
                for _ in range(2):
                    changed = list(toks)
                    changed[rng.randrange(len(changed))] += 1  # diverges at a random block
                    queries.append(("/query", {"token_ids": changed, "model_name": MODEL}))
                for blocks in (1, 3, 5, 8, 12):
                    hashes = _hashes(toks[: blocks * BS])
                    queries.append(
                        ("/query_by_hash", {"block_hashes": hashes, "model_name": MODEL})
                    )
            for _ in range(10):
                unknown = [rng.randrange(80_000, 90_000) for _ in range(4 * BS)]
                queries.append(("/query", {"token_ids": unknown, "model_name": MODEL}))
            queries.append(("/query", {"token_ids": fams[0], "model_name": "not-registered"}))
            for toks in fams[:6]:
                for name in (LORA, "another-adapter"):
                    queries.append(
                        ("/query", {"token_ids": toks, "model_name": MODEL, "lora_name": name})
                    )
            for toks in fams[6:10]:  # salts: none ("", null); one no event carries (no
                # extra keys here: both match nothing; test_extrakeys.py for salted events)
                for salt in (None, "", "salt-a"):
                    queries.append(
                        ("/query", {"token_ids": toks, "model_name": MODEL, "cache_salt": salt})
                    )
                hashes = _hashes(toks)
                for salt in (None, "", "salt-a"):  # a string: Dynamo's 400
                    body = {"block_hashes": hashes, "model_name": MODEL, "cache_salt": salt}
                    queries.append(("/query_by_hash", body))
            salted = {"block_hashes": [1], "model_name": "not-registered", "cache_salt": "s"}
            queries.append(("/query_by_hash", salted))  # Dynamo's 400 before its 404
            assert len(queries) >= 300

            differ, matched, lower, disk = [], 0, 0, 0
            for path, q in queries:
                a, b = ours.post(path, json=q), dynamo_indexer.post(path, json=q)
                if (a.status_code, a.json()) != (b.status_code, b.json()):
                    differ.append(
                        (path, q.get("token_ids", q.get("block_hashes"))[:3], a.text, b.text)
                    )
                elif a.status_code == 200 and a.json()["instances"]:
                    matched += 1
                    inst = a.json()["instances"].values()
                    lower += any(m["cpu"] > m["gpu"] for m in inst)
                    disk += any(m["disk"] > m["cpu"] for m in inst)
            assert not differ, f"{len(differ)} of {len(queries)} differ, e.g. {differ[:3]}"
            # most answers hold blocks, many of them on CPU or disk beyond the GPU run
            assert matched > len(queries) // 2 and lower > 20 and disk > 20, (matched, lower, disk)
            assert "ERROR" not in s.log()
    finally:
        for e in engines:
            e.pub.shutdown()
