"""Routers' predictions (``POST /predict``, ``/predict_by_hash``; kvconductor/predict.py):
through a real server and real sockets, and in process against an independent model of
the merge (docs/api.md, "POST /predict").

Block size 4; every expectation is computed by hand from the prompts and events.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvconductor._hash import hash_blocks
from kvconductor.keys import Medium, WorkerKey
from kvconductor.predict import PredictionLimits, Predictions, chain_hashes, predicted_key
from tests.helpers.http_cases import msgpack_post
from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import (
    dp_entry,
    register_engine,
    replica,
    run_cli,
    running,
    started,
)

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4 tokens
HASHES = [0xA000 + i for i in range(6)]  # engine block hashes of TOKENS' blocks
OTHER = list(range(500, 524))  # 6 blocks no event ever stores


def predict(srv, tokens, instance="eng-a", dp=0, *, expect=200, headers=None, **kw) -> dict:
    body = {"model": "qwen", "block_size": BS, "token_ids": tokens, "instance_id": instance}
    r = srv.http.post("/predict", json={**body, "dp_rank": dp, **kw}, headers=headers)
    assert r.status_code == expect, r.text
    return r.json()


def rows(srv, tokens) -> dict[tuple[str, int], tuple[int, int, int]]:
    """``/query``'s answer as ``{(instance, dp): (npu, cpu, disk)}`` (no index: none)."""
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens})
    if r.status_code == 404 and "no indexer" in r.text:
        return {}
    assert r.status_code == 200, r.text
    out = {}
    for inst, m in r.json().get("default", {}).items():
        for dp, d in m["DP"].items():
            out[(inst, int(dp))] = (d["npu_blocks"], d["cpu_blocks"], d["disk_blocks"])
    return out


def prediction_counts(srv) -> dict[str, float]:
    text = srv.http.get("/metrics").text
    out = {
        k: float(v)
        for k, v in re.findall(r'kvconductor_predictions_total\{outcome="(\w+)"\} (\S+)', text)
    }
    live = re.search(r"^kvconductor_predictions_live (\S+)$", text, re.M)
    assert live is not None, text
    out["live"] = float(live.group(1))
    return out


#: TTL 1 s, at most 2 predictions per DP and 3 in all
FLAGS = ("--prediction-ttl-s", "1", "--prediction-max-per-dp", "2", "--prediction-max", "3")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(tmp_path_factory.mktemp("pred"), *FLAGS) as srv:
        for inst in ("eng-a", "eng-b"):
            for dp in (0, 1):
                register_engine(srv, inst, dp, medium_endpoints={"npu": "tcp://127.0.0.1:1"})
        yield srv


def settle(srv) -> None:
    """Every prediction of the previous test expired (TTL 1 s, swept every 1/8 s)."""
    wait_until(lambda: prediction_counts(srv)["live"] == 0, timeout=5, msg="predictions expired")


# -- through the server -------------------------------------------------------------------------


@pytest.mark.server
def test_predict_is_answered_then_expires_without_trace(server):
    settle(server)
    before = prediction_counts(server)
    doc = predict(server, TOKENS + [1, 2], "eng-b", 1)  # 6 full blocks; the partial one is not
    assert doc == {"status": "ok", "predicted_blocks": 6, "ttl_s": 1.0}
    t0 = time.monotonic()
    # a DP that holds nothing gets a row, all of it in HBM ("will be in HBM")
    assert rows(server, TOKENS) == {("eng-b", 1): (6, 0, 0)}
    assert rows(server, TOKENS[:8] + OTHER) == {("eng-b", 1): (2, 0, 0)}
    by_hash = server.http.post(
        "/query_by_hash",
        json={"model": "qwen", "block_size": 0, "block_hashes": list(hash_blocks(TOKENS, BS))},
    ).json()
    assert dp_entry(by_hash, "eng-b", 1)["npu_blocks"] == 6
    wait_until(lambda: rows(server, TOKENS) == {}, timeout=5, msg="expired")
    assert time.monotonic() - t0 >= 1.0
    after = prediction_counts(server)
    assert after["added"] - before["added"] == 1
    assert after["expired"] - before["expired"] == 1
    assert after["live"] == 0


@pytest.mark.server
def test_predict_by_hash_and_msgpack(server):
    settle(server)
    hashes = list(hash_blocks(TOKENS[:12], BS))
    body = {
        "model": "qwen",
        "block_size": 0,
        "block_hashes": hashes,
        "instance_id": "eng-a",
        "dp_rank": 1,
    }
    status, ctype, doc = msgpack_post(server.http, "/predict_by_hash", body)
    assert (status, doc) == (200, {"status": "ok", "predicted_blocks": 3, "ttl_s": 1.0})
    assert ctype.startswith("application/msgpack")
    assert rows(server, TOKENS) == {("eng-a", 1): (3, 0, 0)}
    # a LoRA adapter's blocks are hashed with its seed: the base model's prompt misses them
    predict(server, OTHER, "eng-a", 0, lora_name="adapter-x")
    assert rows(server, OTHER) == {}


@pytest.mark.server
@pytest.mark.parametrize(
    "encoding,packed", [("json", False), ("msgpack", False), ("msgpack", True)]
)
def test_the_client_predicts_sync_and_async(server, encoding, packed):
    from kvconductor.client import AsyncConductorClient, ConductorClient, ConductorError
    from tests.helpers.coro import run_coro

    settle(server)
    opts = {"query_encoding": encoding, "packed": packed}
    with ConductorClient(server.url, **opts) as c:
        got = c.predict("qwen", "eng-b", 0, token_ids=TOKENS[:9], block_size=BS)
        assert got == {"status": "ok", "predicted_blocks": 2, "ttl_s": 1.0}
        assert rows(server, TOKENS) == {("eng-b", 0): (2, 0, 0)}
        with pytest.raises(ConductorError) as err:
            c.predict("qwen", "nobody", token_ids=TOKENS, block_size=BS)
        assert err.value.status_code == 404
        with pytest.raises(ValueError):
            c.predict("qwen", "eng-b", token_ids=TOKENS, block_hashes=[1])

    async def by_hash():
        async with AsyncConductorClient(server.url, **opts) as c:
            hs = list(hash_blocks(TOKENS[:16], BS))
            return await c.predict("qwen", "eng-b", 1, block_hashes=hs)

    assert run_coro(by_hash())["predicted_blocks"] == 4
    assert rows(server, TOKENS) == {("eng-b", 0): (2, 0, 0), ("eng-b", 1): (4, 0, 0)}


@pytest.mark.server
def test_bounds_drop_the_oldest_never_an_error(server):
    settle(server)
    before = prediction_counts(server)
    prompts = [[i * 1000 + t for t in range(8)] for i in range(1, 4)]
    for p in prompts:  # three prompts on one DP, at most two per DP
        predict(server, p, "eng-a", 0)
    assert rows(server, prompts[0]) == {}
    assert rows(server, prompts[1]) == rows(server, prompts[2]) == {("eng-a", 0): (2, 0, 0)}
    # two more on another DP: four in all, at most three: the oldest left (prompts[1])
    predict(server, prompts[0], "eng-b", 0)
    predict(server, OTHER, "eng-b", 0)
    assert rows(server, prompts[1]) == {}
    assert rows(server, prompts[2]) == {("eng-a", 0): (2, 0, 0)}
    assert rows(server, prompts[0]) == {("eng-b", 0): (2, 0, 0)}
    after = prediction_counts(server)
    assert after["dropped"] - before["dropped"] == 2
    assert after["live"] == 3


@pytest.mark.server
def test_bad_requests(server):
    http = server.http
    ok = {"model": "qwen", "block_size": BS, "token_ids": TOKENS, "instance_id": "eng-a"}
    cases = [
        ({k: v for k, v in ok.items() if k != "instance_id"}, 400, "instance_id"),
        ({**ok, "block_size": 0}, 400, "block_size"),
        ({**ok, "dp_rank": -1}, 400, "dp_rank"),
        ({**ok, "token_ids": "x"}, 400, "token_ids"),
        ({**ok, "instance_id": "a\x01"}, 400, "control"),
        ({**ok, "instance_id": "nobody"}, 404, "nobody"),
        ({**ok, "dp_rank": 7}, 404, "dp_rank 7 of instance eng-a not found (registered: 0, 1)"),
    ]
    for body, status, word in cases:
        r = http.post("/predict", json=body)
        assert r.status_code == status, (body, r.text)
        assert word in r.json()["error"], r.text
    r = http.post("/predict", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    status, _, doc = msgpack_post(http, "/predict", {"model": "qwen", "block_size": BS})
    assert status == 400 and "error" in doc
    r = http.post("/predict_by_hash", json={**ok, "token_ids": None, "block_hashes": [-1]})
    assert r.status_code == 400
    # a web page may not post it (the Origin policy of the mutating routes)
    r = http.post("/predict", json=ok, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "error" in r.json()


@pytest.mark.parametrize("value", ["-1", "x", "3601"])
def test_the_ttl_flag_is_checked(value):
    r = run_cli("--prediction-ttl-s", value)
    assert r.returncode == 2 and "--prediction-ttl-s" in r.stderr, r.stderr


@pytest.mark.server
def test_auth_and_body_limit(tmp_path):
    with started(tmp_path, "--api-key", "k", "--max-body-mb", "1") as srv:
        key = {"Authorization": "Bearer k"}
        r = srv.http.post("/register", json={**_reg("eng-a")}, headers=key)
        assert r.status_code == 201, r.text
        body = {"model": "qwen", "block_size": BS, "token_ids": TOKENS, "instance_id": "eng-a"}
        r = srv.http.post("/predict", json=body)
        assert r.status_code == 401 and "bearer token" in r.json()["error"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert srv.http.post("/predict", json=body, headers=key).status_code == 200
        big = {**body, "token_ids": [1] * 600_000}
        r = srv.http.post("/predict", json=big, headers=key)
        assert r.status_code == 413 and "error" in r.json()


@pytest.mark.server
def test_ttl_zero_turns_predictions_off(tmp_path):
    with started(tmp_path, "--prediction-ttl-s", "0") as srv:
        register_engine(srv, "eng-a")
        assert predict(srv, TOKENS) == {"status": "ok", "predicted_blocks": 0, "ttl_s": 0.0}
        assert rows(srv, TOKENS) == {}


def engine_with_a_block(srv, pub, **kw):
    """``eng-a`` (DP 0) registered with ``pub`` as its HBM publisher, its first block
    (``HASHES[0]``) indexed; the vLLM 0.33 schema the test publishes with."""
    register_engine(srv, "eng-a", medium_endpoints={"npu": pub.url}, **kw)
    v = schema("vllm", "0.33.0")
    first = v.batch([v.stored(HASHES[:1], None, TOKENS[:4], BS, medium="GPU")])
    pub.wait_subscribed()
    wait_until(  # published again until the subscription is connected
        lambda: pub.publish(first) or rows(srv, TOKENS) == {("eng-a", 0): (1, 0, 0)},
        msg="first block indexed",
    )
    return v


@pytest.mark.server
def test_events_confirm_and_removals_contradict(tmp_path):
    """Over ZeroMQ: a store of the predicted prefix confirms the prediction (it goes, the
    events answer); a removal drops the DP's predictions (no trace left)."""
    pub = FakePublisher(replay=False)
    try:
        with started(tmp_path, "--prediction-ttl-s", "30") as srv:
            v = engine_with_a_block(srv, pub, store_backend="YuanRong")
            # predicted 4 blocks: max(event 1, predicted 4) = 4
            assert predict(srv, TOKENS[:16])["predicted_blocks"] == 4
            predict(srv, TOKENS, "eng-a", 0)  # and 6, a longer prompt of the same prefix
            assert rows(srv, TOKENS) == {("eng-a", 0): (6, 0, 0)}
            # the engine stores blocks 2..4: the 4-block prediction is confirmed
            pub.publish(v.batch([v.stored(HASHES[1:4], HASHES[0], TOKENS[4:16], BS, medium="GPU")]))
            wait_until(lambda: prediction_counts(srv)["confirmed"] == 1, msg="confirmed")
            assert prediction_counts(srv)["live"] == 1
            assert rows(srv, TOKENS) == {("eng-a", 0): (6, 0, 0)}
            # the engine evicts block 4: the 6-block prediction goes too, events answer
            pub.publish(v.batch([v.removed([HASHES[3]], medium="GPU")]))
            wait_until(lambda: rows(srv, TOKENS) == {("eng-a", 0): (3, 0, 0)}, msg="contradicted")
            c = prediction_counts(srv)
            assert (c["contradicted"], c["live"]) == (1, 0)
            # an unregistration drops them too
            predict(srv, OTHER)
            assert rows(srv, OTHER) == {("eng-a", 0): (6, 0, 0)}
            r = srv.http.post("/unregister", json=_reg("eng-a"))
            assert r.status_code == 200, r.text
            assert rows(srv, OTHER) == {}
            assert prediction_counts(srv)["live"] == 0
    finally:
        pub.stop()


@pytest.mark.server
def test_a_dp_whose_source_is_down_answers_no_prediction(tmp_path):
    """Over ZeroMQ, --source-down-secs 1: the engine's publisher gone, its DP is muted and
    so are the predictions made meanwhile; back, they answer again."""
    pub = FakePublisher(replay=False)
    port = pub.port
    try:
        with started(tmp_path, "--prediction-ttl-s", "60", "--source-down-secs", "1") as srv:
            engine_with_a_block(srv, pub)
            seq = pub.seq
            pub.stop()
            wait_until(lambda: rows(srv, TOKENS) == {}, msg="muted")
            # the DP's first predictions, made while it is muted: held, muted
            assert predict(srv, TOKENS)["predicted_blocks"] == 6
            assert predict(srv, OTHER)["predicted_blocks"] == 6
            assert rows(srv, TOKENS) == rows(srv, OTHER) == {}
            assert prediction_counts(srv)["live"] == 2
            pub = FakePublisher(port=port, replay=False, start_seq=seq)  # back
            wait_until(lambda: rows(srv, TOKENS) == {("eng-a", 0): (6, 0, 0)}, msg="unmuted")
            assert rows(srv, OTHER) == {("eng-a", 0): (6, 0, 0)}
            c = prediction_counts(srv)
            assert (c["live"], c["confirmed"], c["contradicted"]) == (2, 0, 0)
    finally:
        pub.stop()


@pytest.mark.server
def test_workers_2_every_process_sees_a_prediction(tmp_path):
    with running(tmp_path, "--workers", "2", "--prediction-ttl-s", "30") as srv:
        register_engine(srv, "eng-a", dp_rank=3)
        predict(srv, TOKENS, "eng-a", 3)
        for _ in range(8):  # new connections, spread over both workers
            with httpx.Client(base_url=srv.url, timeout=10) as http:
                r = http.post(
                    "/query", json={"model": "qwen", "block_size": BS, "token_ids": TOKENS}
                )
                assert dp_entry(r.json(), "eng-a", 3)["npu_blocks"] == 6, r.text
        assert prediction_counts(srv)["live"] == 1


def _rows_everywhere(srv, tokens, n: int = 6) -> set:
    """``rows`` over ``n`` new connections (``--workers 2``: spread over both workers)."""
    out = set()
    for _ in range(n):
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            out.add(tuple(sorted(rows(SimpleNamespace(http=http), tokens).items())))
    return out


@pytest.mark.server
def test_workers_2_events_over_zeromq_confirm_a_prediction(tmp_path):
    """--workers 2: predictions posted to the workers, the engine's stores over ZeroMQ
    (applied by the owner) confirm them; every worker's answer stays exact meanwhile."""
    pub = FakePublisher(replay=False)
    try:
        with running(tmp_path, "--workers", "2", "--prediction-ttl-s", "30") as srv:
            v = engine_with_a_block(srv, pub)
            for _ in range(4):  # new connections: both workers take predictions
                with httpx.Client(base_url=srv.url, timeout=10) as http:
                    predict(SimpleNamespace(http=http), TOKENS[:16])
            c0 = prediction_counts(srv)
            assert (c0["added"], c0["live"]) == (4, 4)
            assert _rows_everywhere(srv, TOKENS) == {((("eng-a", 0), (4, 0, 0)),)}
            # the engine stores blocks 2..4: the four predictions are confirmed
            pub.publish(v.batch([v.stored(HASHES[1:4], HASHES[0], TOKENS[4:16], BS, medium="GPU")]))
            wait_until(lambda: prediction_counts(srv)["confirmed"] == 4, msg="confirmed")
            assert prediction_counts(srv)["live"] == 0
            assert _rows_everywhere(srv, TOKENS) == {((("eng-a", 0), (4, 0, 0)),)}
            # a longer one, then the engine's store of the rest: confirmed too
            predict(srv, TOKENS)
            assert _rows_everywhere(srv, TOKENS) == {((("eng-a", 0), (6, 0, 0)),)}
            pub.publish(v.batch([v.stored(HASHES[4:6], HASHES[3], TOKENS[16:], BS, medium="GPU")]))
            wait_until(lambda: prediction_counts(srv)["confirmed"] == 5, msg="confirmed")
            c = prediction_counts(srv)
            assert (c["added"], c["live"], c["contradicted"], c["expired"]) == (5, 0, 0, 0)
            assert _rows_everywhere(srv, TOKENS) == {((("eng-a", 0), (6, 0, 0)),)}
            # the predicted worker left no block behind: the index holds the engine's 6
            doc = srv.http.get("/workers").json()
            assert sum(i["hbm_blocks"] for i in doc["indexer"]) == 6
    finally:
        pub.stop()


@pytest.mark.server
def test_a_prediction_on_one_replica_is_answered_by_the_other(tmp_path, valkey_server):
    """--state-url: a prediction is a logged mutation (the prompt hashed); every replica
    applies it and expires it by its own clock."""
    with (
        replica(tmp_path, valkey_server, "a", "--prediction-ttl-s", "1") as a,
        replica(tmp_path, valkey_server, "b", "--prediction-ttl-s", "1") as b,
    ):
        assert a.http.post("/register", json=_reg("eng-a")).status_code == 201
        wait_until(lambda: b.http.get("/workers").json()["workers"] != [], msg="registered on b")
        assert predict(b, TOKENS, "eng-a", 0)["predicted_blocks"] == 6
        wait_until(lambda: rows(a, TOKENS) == {("eng-a", 0): (6, 0, 0)}, msg="on a")
        assert rows(b, TOKENS) == {("eng-a", 0): (6, 0, 0)}
        assert predict(a, TOKENS, "nobody", expect=404)["error"] == "instance nobody not found"
        for srv in (a, b):  # each replica's own sweep
            wait_until(lambda srv=srv: rows(srv, TOKENS) == {}, timeout=5, msg="expired")


def _reg(instance: str) -> dict:
    return {
        "instance_id": instance,
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": BS,
        "dp_rank": 0,
    }


# -- in process: the merge against an independent model ---------------------------------------


def merged(e: tuple[int, int, int], p: int) -> tuple[int, int, int]:
    """docs/api.md: reaches ``e0 <= e1 <= e2`` of the events' (npu, cpu, disk) and a
    predicted depth ``p`` -> the answer's exclusive counts."""
    e0, e1, e2 = e[0], e[0] + e[1], e[0] + e[1] + e[2]
    r0 = max(e0, p)
    r1 = max(e1, r0)
    r2 = max(e2, r1)
    return (r0, r1 - r0, r2 - r1)


@pytest.mark.parametrize("impl", ["c", "py"])
@pytest.mark.parametrize(
    "npu,cpu,disk", [(0, 0, 0), (2, 0, 0), (1, 2, 0), (1, 1, 2), (0, 3, 0), (5, 1, 0)]
)
@pytest.mark.parametrize("p", [0, 1, 2, 3, 4, 6])
def test_merge_is_the_per_dp_max_with_predictions_in_hbm(impl, npu, cpu, disk, p):
    from kvconductor.index import Index

    idx = Index("qwen", "default", impl=impl)
    hs = list(hash_blocks(TOKENS, BS))
    eh = [1000 + i for i in range(6)]
    if npu:
        idx.store(WorkerKey("a", "gpu", 0, Medium.NPU), None, eh[:npu], hs[:npu])
    if cpu:
        idx.store(WorkerKey("a", "cpu", 0, Medium.CPU), None, eh[: npu + cpu], hs[: npu + cpu])
    if disk:
        n = npu + cpu + disk
        idx.store(WorkerKey("a", "disk", 0, Medium.DISK), None, eh[:n], hs[:n])
    event = tuple(idx.query(TOKENS, BS).hits[0][2:]) if (npu or cpu or disk) else (0, 0, 0)
    preds = Predictions(PredictionLimits(ttl=5.0))
    preds.add(idx, "a", 0, hs[:p], now=0.0)
    got = {
        (h.instance_id, h.dp_rank): (h.npu_blocks, h.cpu_blocks, h.disk_blocks)
        for h in idx.query(TOKENS, BS).hits
    }
    want = merged(event, p)
    assert got == ({} if want == (0, 0, 0) else {("a", 0): want})
    preds.sweep(5.0)
    after = {
        (h.instance_id, h.dp_rank): (h.npu_blocks, h.cpu_blocks, h.disk_blocks)
        for h in idx.query(TOKENS, BS).hits
    }
    assert after == ({} if event == (0, 0, 0) else {("a", 0): event})
    assert idx.worker_blocks(predicted_key("a", 0)) == 0


@pytest.mark.parametrize("impl", ["c", "py"])
def test_shared_prefixes_are_held_until_their_last_prediction_goes(impl):
    from kvconductor.index import Index

    idx = Index("qwen", "default", impl=impl)
    hs = list(hash_blocks(TOKENS, BS))
    other = list(hash_blocks(TOKENS[:8] + OTHER[:8], BS))
    preds = Predictions(PredictionLimits(ttl=1.0))
    preds.add(idx, "a", 0, hs, now=0.0)
    preds.add(idx, "a", 0, other, now=0.5)
    key = predicted_key("a", 0)
    assert idx.worker_blocks(key) == 6 + 2  # two shared blocks held once
    preds.sweep(1.0)
    assert idx.worker_blocks(key) == 4
    assert idx.query_by_hash(hs).hits[0][2] == 2
    assert idx.query_by_hash(other).hits[0][2] == 4
    preds.sweep(1.5)
    assert idx.worker_blocks(key) == 0 and len(idx.query_by_hash(other)) == 0
    assert preds.counts() == {
        "added": 2,
        "confirmed": 0,
        "expired": 2,
        "dropped": 0,
        "contradicted": 0,
        "live": 0,
    }


@pytest.mark.parametrize("impl", ["c", "py"])
def test_top_k_and_instances_apply_after_the_merge(impl):
    from kvconductor.index import Index

    idx = Index("qwen", "default", impl=impl)
    hs = list(hash_blocks(TOKENS, BS))
    for i, dp in enumerate((0, 1, 2)):  # events: DP 0, 1, 2 hold 1, 2, 3 blocks
        idx.store(WorkerKey("a", "gpu", dp, Medium.NPU), None, hs[: i + 1], hs[: i + 1])
    Predictions(PredictionLimits(ttl=5.0)).add(idx, "b", 0, hs, now=0.0)  # a new DP, 6
    top = idx.query_by_hash(hs, top_k=2)
    assert [(h.instance_id, h.dp_rank, h.npu_blocks) for h in top.hits] == [
        ("a", 2, 3),
        ("b", 0, 6),
    ]
    only = idx.query_by_hash(hs, instances=["b"])
    assert [(h.instance_id, h.dp_rank, h.npu_blocks) for h in only.hits] == [("b", 0, 6)]


def _mute_dp(idx, instance: str, dp: int, muted: bool) -> None:
    """What the liveness policy does to a DP whose HBM sources are down (or back):
    ``SubscriptionManager.set_dp_muted``, every HBM worker of the DP."""
    for key in idx.workers_of(instance, dp):
        if Medium(key.medium).tier == 0:
            idx.set_muted(key, muted)


def _npu(idx, tokens) -> dict[tuple[str, int], int]:
    return {(h.instance_id, h.dp_rank): h.npu_blocks for h in idx.query(tokens, BS).hits}


@pytest.mark.parametrize("impl", ["c", "py"])
def test_a_muted_dps_predictions_give_no_hits_until_it_is_unmuted(impl):
    """Made during the mute (the DP's first) or before it: a muted DP's predictions answer
    nothing (its events' blocks do not either); unmuted, both answer again; the DP's muted
    events do not confirm a prediction at once."""
    from kvconductor.index import Index

    idx = Index("qwen", "default", impl=impl)
    hs = list(hash_blocks(TOKENS, BS))
    idx.store(WorkerKey("a", "a", 0, Medium.NPU), None, hs[:2], hs[:2])
    preds = Predictions(PredictionLimits(ttl=10.0))
    _mute_dp(idx, "a", 0, True)  # before the DP has a predicted worker
    assert preds.add(idx, "a", 0, hs[:2], now=0.0) == 2
    assert preds.add(idx, "a", 0, hs, now=0.0) == 6
    assert (preds.outcomes["confirmed"], preds.live) == (0, 2)
    assert _npu(idx, TOKENS) == {}
    _mute_dp(idx, "a", 0, False)
    assert _npu(idx, TOKENS) == {("a", 0): 6}
    _mute_dp(idx, "a", 0, True)  # muted again, with its predictions live
    assert _npu(idx, TOKENS) == {}
    _mute_dp(idx, "a", 0, False)
    assert _npu(idx, TOKENS) == {("a", 0): 6}
    preds.sweep(100.0)
    assert preds.live == 0 and _npu(idx, TOKENS) == {("a", 0): 2}
    # a DP with no events' worker is never muted by the liveness policy: it answers
    preds.add(idx, "b", 0, hs[:3], now=100.0)
    assert _npu(idx, TOKENS)[("b", 0)] == 3


def test_a_dp_the_instance_does_not_register_is_refused(conductor):
    from kvconductor.schema import PredictRecord, RegisterRequest
    from kvconductor.state.conductor import DpNotRegistered

    c = conductor
    c.call(c.register, msgspec.convert(_reg("eng-a"), RegisterRequest))
    hs = list(hash_blocks(TOKENS[:8], BS))
    with pytest.raises(DpNotRegistered, match=r"dp_rank 2 of instance eng-a not found.*: 0\)"):
        c.call(c.predict, PredictRecord("qwen", "default", "eng-a", 2, hs))
    assert c.predictions.live == 0 and c.predictions.outcomes["added"] == 0
    assert c.call(c.predict, PredictRecord("qwen", "default", "eng-a", 0, hs)) == 2


def test_the_blocks_bound_drops_the_oldest_and_refuses_a_longer_one():
    from kvconductor.index import Index

    idx = Index("qwen", "default")
    preds = Predictions(PredictionLimits(ttl=5.0, blocks=5))
    a, b = list(hash_blocks(TOKENS[:12], BS)), list(hash_blocks(OTHER[:12], BS))
    assert preds.add(idx, "x", 0, a, now=0.0) == 3
    assert preds.add(idx, "x", 1, b, now=0.0) == 3  # 6 blocks > 5: the oldest goes
    assert len(idx.query_by_hash(a)) == 0 and idx.query_by_hash(b).hits[0][2] == 3
    assert preds.add(idx, "x", 0, list(hash_blocks(TOKENS, BS)), now=0.0) == 0  # 6 > 5
    assert (preds.live, preds.blocks, preds.outcomes["dropped"]) == (1, 3, 1)


def test_chain_hashes_name_the_prefix():
    a = chain_hashes([1, 2, 3])
    assert list(chain_hashes([1, 2])) == list(a[:2])
    assert chain_hashes([9, 2, 3])[1] != a[1]  # the same block under another prefix
    assert len(set(chain_hashes([7, 7, 7, 7]))) == 4  # a repeated block: distinct hashes


@pytest.mark.parametrize("impl", ["c", "py"])
def test_a_snapshot_restores_no_prediction(impl, tmp_path):
    from kvconductor.state import dump
    from kvconductor.state.conductor import Conductor, ConductorConfig
    from tests.helpers.api import RecordingSubs

    def conductor():
        c = Conductor(
            ConductorConfig(index_impl=impl, maintenance_interval=3600), subscriptions=RecordingSubs
        )
        c.start()
        return c

    a = conductor()
    try:
        from kvconductor.schema import RegisterRequest

        a.call(a.register, msgspec.convert(_reg("eng-a"), RegisterRequest))
        rec = msgspec.convert(
            ["qwen", "default", "eng-a", 0, list(hash_blocks(TOKENS, BS))], _record()
        )
        assert a.call(a.predict, rec) == 6
        path = tmp_path / "d.kvdump"
        path.write_bytes(b"".join(a.call(lambda: list(dump.write_dump(a)))))
    finally:
        a.stop()
    b = conductor()
    try:
        b.call(dump.load_dump, b, dump.file_chunks(str(path)))
        idx = b.get_index("qwen", "default")
        assert idx is not None and len(idx.query(TOKENS, BS)) == 0
    finally:
        b.stop()


def _record():
    from kvconductor.schema import PredictRecord

    return PredictRecord


def test_explain_shows_a_predicted_row_as_predicted_with_its_age(conductor):
    from kvconductor.schema import PredictRecord, RegisterRequest
    from kvconductor.tools.explain import report

    c = conductor
    c.call(c.register, msgspec.convert(_reg("eng-a"), RegisterRequest))
    hs = list(hash_blocks(TOKENS[:16], BS))
    assert c.call(c.predict, PredictRecord("qwen", "default", "eng-a", 0, hs)) == 4
    doc = msgspec.to_builtins(c.call(c.explain, "qwen", "default", BS, TOKENS, None))
    (inst,) = doc["instances"]
    assert (inst["npu_blocks"], inst["cpu_blocks"], inst["disk_blocks"]) == (4, 0, 0)
    assert [(w["backend_id"], w["held"]) for w in inst["workers"]] == [("predicted", 4)]
    (p,) = inst["predictions"]
    assert (p["blocks"], p["predicted_blocks"]) == (4, 4)
    assert 0 <= p["age_s"] < 1.0 and 1.0 < p["expires_in_s"] <= 2.0  # the default TTL, 2 s
    assert any("predicted by a router: 4 blocks" in line for line in report(doc))
    # without predictions the document has no such member
    c.call(c.predictions.sweep, c.predictions.clock() + 3)
    doc = msgspec.to_builtins(c.call(c.explain, "qwen", "default", BS, TOKENS, None))
    assert "predictions" not in doc["instances"][0] and doc["instances"][0]["workers"] == []


# -- the lifetime rules against an independent model (Hypothesis) ------------------------------


DPS = (0, 1, 2)
PROMPT = st.lists(st.integers(1, 3), min_size=1, max_size=4)  # few blocks: prefixes collide


class PredictionMachine(RuleBasedStateMachine):
    """The index with predictions (C core) against a model: an index fed the same events
    and nothing else (the twin), plus a plain list of live predictions kept by the rules of
    docs/api.md; every query's rows are ``merged(event row, deepest covering prediction)``."""

    def __init__(self) -> None:
        super().__init__()
        from kvconductor.index import Index

        self.idx = Index("m", "t", impl="c")
        self.events = Index("m", "t", impl="py")
        self.preds = Predictions(PredictionLimits(ttl=3.0, per_dp=2, total=4))
        self.model: list[tuple[int, list[int], float]] = []  # (dp, blocks, expires), oldest first
        self.now = 0.0

    def teardown(self) -> None:
        self.idx.close()

    def _keys(self, dp: int, tier: Medium) -> WorkerKey:
        return WorkerKey("i", tier.name, dp, tier)

    def _drop_dp(self, dp: int) -> None:
        self.model = [m for m in self.model if m[0] != dp]

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5]))
    def tick(self, dt):
        self.now += dt
        self.preds.sweep(self.now)
        self.model = [m for m in self.model if m[2] > self.now]

    @rule(dp=st.sampled_from(DPS), blocks=PROMPT)
    def predict(self, dp, blocks):
        self.preds.add(self.idx, "i", dp, blocks, now=self.now)
        self.model = [m for m in self.model if m[2] > self.now]
        if self._held(dp, blocks):  # the DP's events hold it already: confirmed at once
            return
        self.model.append((dp, blocks, self.now + 3.0))
        mine = [m for m in self.model if m[0] == dp]
        if len(mine) > 2:
            self.model.remove(mine[0])
        if len(self.model) > 4:
            del self.model[0]

    @rule(dp=st.sampled_from(DPS), blocks=PROMPT, cpu=st.booleans())
    def store(self, dp, blocks, cpu):
        key = self._keys(dp, Medium.CPU if cpu else Medium.NPU)
        eh = [hash((dp, cpu, tuple(blocks[: i + 1]))) & ((1 << 63) - 1) for i in range(len(blocks))]
        for ix in (self.idx, self.events):
            ix.store(key, None, eh, blocks)
        if not cpu:  # HBM stores confirm what the DP's worker now holds whole
            self.model = [m for m in self.model if m[0] != dp or not self._held(dp, m[1])]
            assert self._held(dp, blocks)

    def _held(self, dp: int, blocks: list[int]) -> bool:
        """The DP's HBM events hold ``blocks`` whole (one HBM worker per DP here)."""
        depth = {h.dp_rank: h.npu_blocks for h in self.events.query_by_hash(blocks).hits}
        return depth.get(dp, 0) >= len(blocks)

    @rule(dp=st.sampled_from(DPS), cpu=st.booleans(), data=st.data())
    def remove(self, dp, cpu, data):
        key = self._keys(dp, Medium.CPU if cpu else Medium.NPU)
        held = sorted(self.events.worker_hashes(key))
        hs = data.draw(st.lists(st.sampled_from(held), max_size=2)) if held else []
        for ix in (self.idx, self.events):
            ix.remove(key, hs)
        self._drop_dp(dp)  # any removal of the DP contradicts its predictions

    @rule(dp=st.sampled_from(DPS))
    def clear(self, dp):
        for ix in (self.idx, self.events):
            ix.clear(self._keys(dp, Medium.NPU))
        self._drop_dp(dp)

    @invariant()
    def answers_are_the_merge(self):
        assert self.preds.live == len(self.model)
        for q in ([1], [1, 2], [1, 2, 3, 1], [2, 1, 3], [3, 3, 3, 3]):
            ev = {
                h.dp_rank: (h.npu_blocks, h.cpu_blocks, h.disk_blocks)
                for h in self.events.query_by_hash(q).hits
            }
            want = {}
            for dp in DPS:
                p = 0
                for mdp, blocks, _ in self.model:
                    if mdp == dp:
                        n = 0
                        while n < min(len(q), len(blocks)) and q[n] == blocks[n]:
                            n += 1
                        p = max(p, n)
                row = merged(ev.get(dp, (0, 0, 0)), p)
                if row != (0, 0, 0):
                    want[dp] = row
            got = {
                h.dp_rank: (h.npu_blocks, h.cpu_blocks, h.disk_blocks)
                for h in self.idx.query_by_hash(q).hits
            }
            assert got == want, (q, self.model)


TestPredictionMachine = PredictionMachine.TestCase
TestPredictionMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
