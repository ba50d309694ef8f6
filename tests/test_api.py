"""The HTTP API in-process with falcon.testing (docs/api.md, and the reference's integration tests).

Values are real: block size 4, golden hashes of docs/api.md "Block hashing", counts computed
by hand. The request helpers are tests/helpers/api.py; the ``conductor`` and ``client``
fixtures are tests/conftest.py's.
"""

from __future__ import annotations

import falcon.testing as ft
import msgspec
import pytest

import kvconductor.http.api as app_module
import kvconductor.http.query as query_module
from kvconductor import _encode, _hash, _wire, wire
from kvconductor.http.api import create_app
from kvconductor.http.query import MissWarnings
from kvconductor.http.resource import BodyTooLarge, read_body
from kvconductor.http.responses import header_text
from kvconductor.state.conductor import Conductor, ConductorConfig
from tests.helpers.api import H1, H2, events, query, register, stored, unregister
from tests.helpers.coro import run_coro

MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.fixture(params=["py", "c"])
def wire_impl(request, monkeypatch):
    """Run a test over the msgspec wire twin ("py") and the compiled one ("c")."""
    if request.param == "c":
        monkeypatch.setattr(wire, "_parse_impl", _wire.parse_query)
        encode_result, encode_error = wire.c_encode_result, _encode.encode_error
    else:
        monkeypatch.setattr(wire, "_parse_impl", wire.py_parse_query)
        encode_result, encode_error = wire.py_encode_result, wire.py_encode_error
    # The query resources (http/query.py) encode answers and errors; the app's error
    # handlers (http/api.py) errors.
    monkeypatch.setattr(query_module, "encode_result", encode_result)
    for module in (app_module, query_module):
        monkeypatch.setattr(module, "encode_error", encode_error)
    return request.param


def query_msgpack(client, body: dict, path="/query", content_type="application/msgpack"):
    r = client.simulate_post(
        path, body=msgspec.msgpack.encode(body), headers={"Content-Type": content_type}
    )
    assert r.headers["content-type"] == "application/msgpack"
    return r.status_code, msgspec.msgpack.decode(r.content)


def dp(npu, cpu, disk, block_size=4):
    return {
        "matched_tokens": (npu + cpu + disk) * block_size,
        "npu_blocks": npu,
        "cpu_blocks": cpu,
        "disk_blocks": disk,
    }


# -- basics (the reference's integration tests) ----------------------------------------------


def test_health_endpoint(client):
    r = client.simulate_get("/health")
    assert r.status_code == 200 and r.text == "OK"
    assert r.headers["content-type"].startswith("text/plain")
    assert client.simulate_head("/health").status_code == 200


def test_register_and_query(client):
    r = register(client, medium_endpoints={"npu": "tcp://10.0.0.1:5557"})
    assert r.json == {"status": "ok"} and r.headers["content-type"] == "application/json"
    assert query(client, [1, 2, 3, 4]) == {"default": {}}
    assert query(client, []) == {"default": {}}


def test_query_after_kv_events(client, wire_impl):
    register(client)
    r = events(client, [stored(1, [100, 200], list(range(1, 9)))])
    assert r.status_code == 200 and r.json == {"status": "ok", "events_applied": 1}
    assert query(client, list(range(1, 11))) == {
        "default": {"vllm-prefill-1": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}
    }
    assert query(client, [1, 2, 3, 4, 9, 9, 9, 9]) == {
        "default": {"vllm-prefill-1": {"longest_matched": 4, "DP": {"0": dp(1, 0, 0)}}}
    }
    # As in the reference's integration tests: events without instance_id are rejected.
    r = client.simulate_post("/events", json={"events": []})
    assert r.status_code == 400 and "instance_id" in r.json["error"]


def test_tiers_exclusive_partition(client):
    # Exclusive partition (docs/api.md, "Tiers and counts"): NPU 1 + CPU 1 (chained) + Disk 1
    # (chained after CPU) -> 1/1/1, matched 12.
    register(client, store_backend="YuanRong")
    r = events(
        client,
        [
            stored(1, [100], [1, 2, 3, 4]),
            stored(2, [200], [5, 6, 7, 8], parent=100, medium="cpu"),
            stored(3, [300], [9, 10, 11, 12], parent=200, medium="disk"),
        ],
    )
    assert r.json == {"status": "ok", "events_applied": 3}
    assert query(client, list(range(1, 13)))["default"]["vllm-prefill-1"] == {
        "longest_matched": 12,
        "DP": {"0": dp(1, 1, 1)},
    }
    # Same block on NPU and CPU counts once, on NPU.
    r = events(
        client,
        [
            stored(4, [100], [1, 2, 3, 4], medium="cpu", dp_rank=1),
            stored(5, [100], [1, 2, 3, 4], dp_rank=1),
        ],
    )
    assert query(client, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"] == {
        "0": dp(1, 0, 0),
        "1": dp(1, 0, 0),
    }


def test_lora_queries_hit_only_lora_blocks(client, wire_impl):
    """Events with ``lora_name`` are hashed with that adapter's seed; ``/query`` takes the
    same ``lora_name`` (JSON and msgpack, map and positional form)."""
    from kvconductor._hash import hash_blocks, lora_seed

    register(client)
    toks = list(range(1, 13))
    r = events(
        client,
        [
            stored(1, [100, 101, 102], toks) | {"lora_name": "sql-adapter"},
            stored(2, [200], toks[:4], dp_rank=1),
        ],
    )
    assert r.status_code == 200 and r.json["events_applied"] == 2
    lora_hit = {"default": {"vllm-prefill-1": {"longest_matched": 12, "DP": {"0": dp(3, 0, 0)}}}}
    base_hit = {"default": {"vllm-prefill-1": {"longest_matched": 4, "DP": {"1": dp(1, 0, 0)}}}}
    body = {"model": "qwen", "block_size": 4, "token_ids": toks}
    for extra, want in (
        ({}, base_hit),
        ({"lora_name": None}, base_hit),
        ({"lora_name": ""}, base_hit),
        ({"lora_name": "sql-adapter"}, lora_hit),
        ({"lora_name": "other-adapter"}, {"default": {}}),
    ):
        r = client.simulate_post("/query", json=body | extra)
        assert r.status_code == 200 and r.json == want, (extra, r.text)
        assert query_msgpack(client, body | extra) == (200, want)
    # Positional msgpack form: [model, block_size, token_ids, tenant_id, lora_name].
    assert query_msgpack(client, ["qwen", 4, toks, None, "sql-adapter"]) == (200, lora_hit)
    assert query_msgpack(client, ["qwen", 4, toks, "default", None]) == (200, base_hit)
    # /query_by_hash takes precomputed hashes: the LoRA ones hit the LoRA blocks.
    by_hash = {
        "model": "qwen",
        "block_size": 4,
        "block_hashes": list(hash_blocks(toks, 4, lora_seed("sql-adapter"))),
    }
    r = client.simulate_post("/query_by_hash", json=by_hash)
    assert r.json["default"]["vllm-prefill-1"]["DP"] == {"0": dp(3, 0, 0, block_size=1)}
    r = client.simulate_post("/query", json=body | {"lora_name": 7})
    assert r.status_code == 400 and "lora_name" in r.json["error"]


def test_query_by_hash_counts_blocks(client, wire_impl):
    register(client)
    events(client, [stored(1, [100, 200], list(range(1, 9)))])
    r = client.simulate_post(
        "/query_by_hash", json={"model": "qwen", "block_size": 128, "block_hashes": [H1, H2, 12345]}
    )
    assert r.status_code == 200
    assert r.json == {
        "default": {
            "vllm-prefill-1": {"longest_matched": 2, "DP": {"0": dp(2, 0, 0, block_size=1)}}
        }
    }
    hashes = list(_hash.hash_blocks(list(range(1, 9)), 4))
    code, doc = query_msgpack(
        client,
        {"model": "qwen", "block_size": 4, "block_hashes": hashes},
        "/query_by_hash",
        "application/x-msgpack",
    )
    assert code == 200 and doc == r.json


def test_query_tenants_are_isolated(client):
    register(client, tenant_id="t1")
    events(client, [stored(1, [100], [1, 2, 3, 4])])
    assert query(client, [1, 2, 3, 4], tenant="t1")["t1"]["vllm-prefill-1"]["DP"]["0"] == dp(
        1, 0, 0
    )
    r = client.simulate_post("/query", json={"model": "qwen", "block_size": 4, "token_ids": [1]})
    assert r.status_code == 404
    assert r.json == {"error": "no indexer for model=qwen tenant=default"}


# -- msgpack negotiation (docs/api.md, "MessagePack"; the reference's V3 tests) -----------------


def test_query_msgpack_endpoint(client, wire_impl):
    register(client)
    events(client, [stored(1, [100, 200], list(range(1, 9)))])
    body = {"model": "qwen", "block_size": 4, "token_ids": list(range(1, 13))}
    as_json = client.simulate_post("/query", json=body).json
    for ct in ("application/msgpack", "application/x-msgpack", "Application/MsgPack; charset=x"):
        code, doc = query_msgpack(client, body, content_type=ct)
        assert code == 200 and doc == as_json
    assert as_json["default"]["vllm-prefill-1"]["DP"]["0"] == dp(2, 0, 0)
    # Positional array form and packed u32 tokens.
    code, doc = query_msgpack(client, ["qwen", 4, list(range(1, 13)), "default"])
    assert code == 200 and doc == as_json
    packed = {
        "model": "qwen",
        "block_size": 4,
        "token_ids": b"".join(t.to_bytes(4, "little") for t in range(1, 13)),
    }
    code, doc = query_msgpack(client, packed)
    assert code == 200 and doc == as_json
    code, doc = query_msgpack(client, {"model": "qwen", "block_size": 4, "token_ids": [7]})
    assert code == 200 and doc == {"default": {}}


def test_query_msgpack_error_paths(client, wire_impl):
    register(client)
    code, doc = query_msgpack(client, {"model": "nope", "block_size": 4, "token_ids": [1]})
    assert code == 404 and doc == {"error": "no indexer for model=nope tenant=default"}
    r = client.simulate_post("/query", body=b"\xc1\xff\x00", headers=MSGPACK)
    assert r.status_code == 400 and r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["error"].startswith("invalid msgpack request body: ")
    r = client.simulate_post(
        "/query", body=b"\xc1\xff\x00", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json["error"].startswith("invalid JSON request body: ")
    # No Content-Type at all: JSON (no 415 on query endpoints).
    r = client.simulate_post("/query", body=b'{"model":"qwen","block_size":4,"token_ids":[1]}')
    assert r.status_code == 200 and r.json == {"default": {}}
    code, doc = query_msgpack(client, {"model": "qwen", "block_size": 0, "token_ids": [1]})
    assert code == 400 and "block_size" in doc["error"]
    r = client.simulate_get("/query", headers=MSGPACK)
    assert r.status_code == 405 and msgspec.msgpack.decode(r.content)["error"]


@pytest.mark.parametrize("block_size", [0, -1, 2**32, "4", None])
def test_query_block_size_must_be_positive_u32(client, block_size):
    register(client)
    r = client.simulate_post(
        "/query", json={"model": "qwen", "block_size": block_size, "token_ids": [1, 2]}
    )
    assert r.status_code == 400 and r.json["error"].startswith("invalid JSON request body: ")


def test_large_queries_run_in_a_worker_thread(conductor):
    client = ft.TestClient(create_app(conductor, large_body_bytes=0))
    register(client)
    events(client, [stored(1, [100, 200], list(range(1, 9)))])
    assert query(client, list(range(1, 9)))["default"]["vllm-prefill-1"]["DP"]["0"] == dp(2, 0, 0)
    code, doc = query_msgpack(client, {"model": "x", "block_size": 4, "token_ids": [1]})
    assert code == 404
    tokens = list(range(1, 9)) + [0] * 200_000
    assert query(client, tokens)["default"]["vllm-prefill-1"]["DP"]["0"] == dp(2, 0, 0)


# -- /register, /unregister, /workers (docs/api.md; the reference's integration tests) ------


def test_unregister(client):
    register(client)
    r = unregister(client)
    assert r.status_code == 200 and r.json == {"status": "ok"}
    assert client.simulate_get("/workers").json["workers"] == []


def test_unregister_nonexistent(client):
    r = unregister(client, "ghost")
    assert r.status_code == 404 and r.json == {"error": "instance ghost not found"}


def test_unregister_unknown_dp_of_known_instance(client):
    register(client)
    assert unregister(client, dp_rank=9).status_code == 200


def test_unregister_requires_all_fields(client):
    r = client.simulate_post("/unregister", json={"instance_id": "a", "dp_rank": 0})
    assert r.status_code == 400 and "invalid JSON request body" in r.json["error"]


def test_workers_endpoint_empty(client):
    r = client.simulate_get("/workers")
    assert r.status_code == 200 and r.json == {
        "workers": [],
        "indexer": [],
        "sources": [],
        "recent_warnings": [],
    }


def _views(doc: dict) -> dict:
    """``/workers`` without its ``recent_warnings`` (a rejected request logs one)."""
    return {k: v for k, v in doc.items() if k != "recent_warnings"}


def test_same_backend_reregistration_is_accepted_and_preserves_tree(client):
    register(client, store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:1"})
    events(client, [stored(1, [100], [1, 2, 3, 4])])
    register(client, store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:1"})
    assert query(client, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"]["0"] == dp(1, 0, 0)


def test_reregister_different_backend_drops_tree(client):
    register(client, store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:1"})
    events(client, [stored(1, [100], [1, 2, 3, 4]), stored(2, [100], [1, 2, 3, 4], medium="cpu")])
    register(client, store_backend="Mooncake", medium_endpoints={"npu": "tcp://10.0.0.1:1"})
    assert query(client, [1, 2, 3, 4]) == {"default": {}}


@pytest.mark.parametrize("backend", ["Mooncake", "Memcache"])
def test_hbm_plus_pool_registration(client, conductor, backend):
    register(
        client,
        "vllm-prefill-1",
        store_backend=backend,
        medium_endpoints={"npu": "tcp://10.0.0.1:5557"},
        replay_endpoint="tcp://10.0.0.1:6667",
    )
    register(
        client,
        f"{backend.lower()}-pool",
        store_backend=backend,
        endpoint="tcp://10.0.0.9:50001",
        modelname="default",
    )
    doc = client.simulate_get("/workers").json
    assert [w["instance_id"] for w in doc["workers"]] == [
        f"{backend.lower()}-pool",
        "vllm-prefill-1",
    ]
    pool = doc["workers"][0]["endpoints"]["0"]
    assert pool["medium_endpoints"] == dict.fromkeys(("npu", "cpu", "disk"), "tcp://10.0.0.9:50001")
    assert conductor.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0)]
    assert conductor.hbm_ip_lookup("10.0.0.9") == []
    assert {s["url"] for s in doc["sources"]} == {"tcp://10.0.0.1:5557", "tcp://10.0.0.9:50001"}
    assert {i["model_name"] for i in doc["indexer"]} == {"qwen", "default"}
    # Duplicate registrations are accepted, and the IP index stays de-duplicated.
    register(
        client,
        "vllm-prefill-1",
        store_backend=backend,
        medium_endpoints={"npu": "tcp://10.0.0.1:5557"},
    )
    register(
        client,
        f"{backend.lower()}-pool",
        store_backend=backend,
        endpoint="tcp://10.0.0.9:50001",
        modelname="default",
    )
    assert conductor.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0)]
    assert len(conductor.subs.replays) == 1
    # Unregistering the HBM worker removes it and its IP.
    assert unregister(client, "vllm-prefill-1").status_code == 200
    assert [w["instance_id"] for w in client.simulate_get("/workers").json["workers"]] == [
        f"{backend.lower()}-pool"
    ]
    assert conductor.hbm_ip_lookup("10.0.0.1") == []


def test_yuanrong_multi_port_registration(client):
    eps = {
        "npu": "tcp://10.0.0.1:5557",
        "cpu": "tcp://10.0.0.1:5600",
        "disk": "tcp://10.0.0.1:5600",
    }
    register(client, store_backend="YuanRong", medium_endpoints=eps, dp_rank=2)
    doc = client.simulate_get("/workers").json
    (w,) = doc["workers"]
    assert w == {
        "instance_id": "vllm-prefill-1",
        "model_name": "qwen",
        "tenant_id": "default",
        "block_size": 4,
        "endpoints": {
            "2": {
                "medium_endpoints": eps,
                "engine_type": "vLLM",
                "dp_rank": 2,
                "replay_endpoint": None,
            }
        },
    }
    assert len(doc["sources"]) == 2  # one subscriber per distinct URL


def test_unknown_backend_and_http_only(client):
    register(client, store_backend="Something")
    register(client, "vllm-union-2")
    names = [w["instance_id"] for w in client.simulate_get("/workers").json["workers"]]
    assert names == ["vllm-prefill-1", "vllm-union-2"]


@pytest.mark.parametrize(
    "kw,media",
    [
        ({"endpoint": ""}, {}),
        ({"medium_endpoints": {"xpu": "", "cpu": "", "disk": ""}}, {}),
        ({"medium_endpoints": {"npu": "tcp://h:1", "cpu": ""}}, {"npu": "tcp://h:1"}),
        (
            {"medium_endpoints": {"disk": ""}, "endpoint": "tcp://h:1"},
            {"npu": "tcp://h:1", "cpu": "tcp://h:1", "disk": "tcp://h:1"},
        ),
    ],
)
def test_register_empty_urls_are_dropped(client, kw, media):
    # The Coordinator's register_post sends unset media as "": 201, the rest subscribed.
    register(client, expect=201, **kw)
    (worker,) = client.simulate_get("/workers").json["workers"]
    assert worker["endpoints"]["0"]["medium_endpoints"] == media


def test_workers_indexer_and_sources(client):
    register(client, medium_endpoints={"gpu": "tcp://10.0.0.1:5557"})
    events(
        client,
        [
            stored(1, [100, 200], list(range(1, 9))),
            stored(2, [300], [9, 9, 9, 9], parent=200, medium="cpu"),
        ],
    )
    doc = client.simulate_get("/workers").json
    assert doc["workers"][0]["endpoints"]["0"]["medium_endpoints"] == {"npu": "tcp://10.0.0.1:5557"}
    (idx,) = doc["indexer"]
    assert idx["worker_count"] == 2 and idx["total_blocks"] == 3
    assert idx["hbm_blocks"] == 2 and idx["cpu_blocks"] == 1
    assert doc["sources"] == [
        {
            "instance_id": "vllm-prefill-1",
            "dp_rank": 0,
            "url": "tcp://10.0.0.1:5557",
            "state": "test",
        }
    ]


# -- /events (docs/api.md, POST /events, with its differences from the reference) -------------


def test_events_empty(client):
    r = events(client, [], instance_id="anyone")
    assert r.status_code == 200 and r.json == {"status": "ok", "events_applied": 0}
    r = client.simulate_post("/events", json={"instance_id": "x", "shutdown": True})
    assert r.json == {"status": "ok", "events_applied": 0}


def test_events_partial(client):
    register(client)
    r = events(
        client,
        [
            stored(1, [100], [1, 2, 3, 4]),
            stored(2, [300], [1, 2, 3, 4], dp_rank=1),
            stored(3, [400], [5, 6, 7, 8], parent=0xDEAD, dp_rank=1),
        ],
    )
    assert r.status_code == 500
    assert r.json == {
        "status": "partial",
        "events_applied": 1,
        "errors": ["dp_rank=1: parent block not found"],
    }


def test_events_unregistered_instance_is_404_and_creates_nothing(client):
    for kw in ({}, {"model_name": "m"}, {"model_name": "m", "tenant_id": "t"}):
        r = events(client, [stored(1, [100], [1, 2, 3, 4])], instance_id="ghost", **kw)
        assert r.status_code == 404 and r.json == {"error": "instance ghost not found"}
    assert query(client, [1, 2, 3, 4], model="m", expect=404) == {
        "error": "no indexer for model=m tenant=default"
    }
    assert client.simulate_get("/workers").json["indexer"] == []
    # model_name still redirects a registered instance's events to another index.
    register(client, "ghost")
    r = events(client, [stored(1, [100], [1, 2, 3, 4])], instance_id="ghost", model_name="m")
    assert r.json == {"status": "ok", "events_applied": 1}
    assert query(client, [1, 2, 3, 4], model="m")["default"]["ghost"]["DP"]["0"] == dp(1, 0, 0)


def test_events_nested_shape(client):
    register(client)
    events(client, [stored(1, [100, 200], list(range(1, 9)))])
    r = events(
        client,
        [
            {
                "event_id": 2,
                "dp_rank": 0,
                "data": {
                    "stored": {
                        "parent_hash": 200,
                        "blocks": [
                            {
                                "block_hash": 300,
                                "tokens_hash": _hash.hash_blocks([9, 10, 11, 12], 4)[0],
                            }
                        ],
                    }
                },
            }
        ],
    )
    assert r.json == {"status": "ok", "events_applied": 1}
    assert query(client, list(range(1, 13)))["default"]["vllm-prefill-1"]["DP"]["0"] == dp(3, 0, 0)


def test_events_unknown_type_is_400_and_applies_nothing(client):
    register(client)
    events(client, [stored(1, [100], [1, 2, 3, 4])])
    r = events(
        client, [{"event_id": 2, "type": "AllBlocksCleared"}, {"event_id": 3, "type": "Mystery"}]
    )
    assert r.status_code == 400 and "'Mystery'" in r.json["error"]
    r = events(client, [{"event_id": 4, "data": {"event_id": 9}}])
    assert r.status_code == 400 and "missing event type" in r.json["error"]
    assert query(client, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"]["0"] == dp(1, 0, 0)


def test_events_full_u64_parent(client):
    register(client)
    r = events(
        client,
        [
            stored(1, [2**64 - 1], [1, 2, 3, 4]),
            stored(2, [5], [5, 6, 7, 8], parent=2**64 - 1),
            stored(3, [2**63], [9, 9, 9, 9], parent=5),
        ],
    )
    assert r.json == {"status": "ok", "events_applied": 3}
    r = events(client, [stored(4, [6], [7, 7, 7, 7], parent=-(2**63))])  # == 2**63
    assert r.json == {"status": "ok", "events_applied": 1}
    assert query(client, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 7, 7, 7, 7])["default"][
        "vllm-prefill-1"
    ]["DP"]["0"] == dp(4, 0, 0)
    r = events(client, [stored(5, [1], [1, 2, 3, 4], parent=2**64)])
    assert r.status_code == 400 and "out of range" in r.json["error"]


# -- auth -----------------------------------------------------------------------------------


def test_api_key(conductor):
    client = ft.TestClient(create_app(conductor, api_key="s3cret"))
    good = {"Authorization": "Bearer s3cret"}
    for bad in (None, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
        r = register(client, expect=401, headers=bad)
        assert r.json["error"] and r.headers["www-authenticate"].startswith("Bearer")
        assert unregister(client, headers=bad).status_code == 401
        assert events(client, [], headers=bad).status_code == 401
    register(client, headers=good)
    assert events(client, [stored(1, [100], [1, 2, 3, 4])], headers=good).status_code == 200
    r = client.simulate_get("/workers")  # it lists every endpoint: protected too
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert client.simulate_get("/workers", headers=good).status_code == 200
    assert client.simulate_get("/health").status_code == 200
    assert query(client, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"]["0"] == dp(1, 0, 0)
    assert unregister(client, headers={"Authorization": "bearer s3cret"}).status_code == 200


def test_open_workers(conductor):
    client = ft.TestClient(create_app(conductor, api_key="s3cret", open_workers=True))
    assert client.simulate_get("/workers").status_code == 200
    assert register(client, expect=401).status_code == 401


def test_cors(client):
    r = client.simulate_get("/health", headers={"Origin": "http://example.com"})
    assert r.headers["access-control-allow-origin"] == "*"


# -- bad input everywhere ----------------------------------------------------------------------

BAD = [
    ("GET", "/nope", {}, 404),
    ("POST", "/health", {}, 405),
    ("DELETE", "/register", {}, 405),
    ("GET", "/events", {}, 405),
    ("POST", "/register", {"body": b"{not json"}, 400),
    ("POST", "/register", {"body": b""}, 400),
    ("POST", "/register", {"json": [1, 2]}, 400),
    ("POST", "/register", {"json": {"instance_id": "a"}}, 400),
    (
        "POST",
        "/register",
        {
            "json": {
                "instance_id": "a",
                "type": "v",
                "modelname": "m",
                "block_size": 0,
                "dp_rank": 0,
            }
        },
        400,
    ),
    (
        "POST",
        "/register",
        {
            "json": {
                "instance_id": "a",
                "type": "v",
                "modelname": "m",
                "block_size": 4,
                "dp_rank": 2**40,
            }
        },
        400,
    ),
    (
        "POST",
        "/register",
        {"json": {"instance_id": "", "type": "v", "modelname": "m", "block_size": 4, "dp_rank": 0}},
        400,
    ),
    ("POST", "/unregister", {"body": b"\x00\x01"}, 400),
    ("POST", "/events", {"body": b"{"}, 400),
    ("POST", "/events", {"json": {"instance_id": "a", "events": [{"type": "stored"}]}}, 400),
    ("POST", "/events", {"json": {"instance_id": "a", "events": [{"event_id": -1}]}}, 400),
    ("POST", "/events", {"json": {"instance_id": "a", "events": "x"}}, 400),
    (
        "POST",
        "/events",
        {
            "json": {
                "instance_id": "a",
                "events": [{"event_id": 1, "type": "stored", "block_hashes": [10**30]}],
            }
        },
        400,
    ),
    (
        "POST",
        "/events",
        {
            "json": {
                "instance_id": "a",
                "events": [{"event_id": 1, "type": "stored", "token_ids": [1.5], "block_size": 4}],
            }
        },
        400,
    ),
    (
        "POST",
        "/events",
        {
            "json": {
                "instance_id": "a",
                "events": [{"event_id": 1, "type": "stored", "block_size": -4}],
            }
        },
        400,
    ),
    (
        "POST",
        "/events",
        {"json": {"instance_id": "a", "events": [{"event_id": 1, "type": "bogus"}]}},
        400,
    ),
    (
        "POST",
        "/events",
        {"json": {"instance_id": "a", "events": [{"event_id": 1, "data": 5}]}},
        400,
    ),
    ("POST", "/query", {"body": b"[]"}, 400),
    ("POST", "/query", {"json": {"model": "qwen", "block_size": 4, "token_ids": [10**30]}}, 400),
    ("POST", "/query", {"json": {"model": "qwen", "block_size": 4, "token_ids": None}}, 400),
    ("POST", "/query_by_hash", {"json": {"model": "qwen", "block_hashes": [-5]}}, 400),
    ("POST", "/query_by_hash", {"json": {"model": "qwen", "block_hashes": [2**64]}}, 400),
]


def test_bad_input_barrage_keeps_serving(client, conductor, caplog):
    register(client)
    for method, path, kw, status in BAD:
        r = client.simulate_request(method, path, **kw)
        assert r.status_code == status, (method, path, kw, r.text)
        assert isinstance(r.json["error"], str) and r.json["error"], r.text
    assert conductor.thread.is_alive() and conductor.thread.errors == 0
    assert sum("bad request" in m or "request rejected" in m for m in caplog.messages) >= len(BAD)
    r = events(client, [stored(1, [100, 200], list(range(1, 9)))])
    assert r.json == {"status": "ok", "events_applied": 1}
    assert query(client, list(range(1, 9)))["default"]["vllm-prefill-1"]["DP"]["0"] == dp(2, 0, 0)


def test_body_limit_by_content_length(conductor):
    client = ft.TestClient(create_app(conductor, max_body_bytes=200))
    big = {"model": "qwen", "block_size": 4, "token_ids": list(range(300))}
    r = client.simulate_post("/query", json=big)
    assert r.status_code == 413 and "limit" in r.json["error"]
    r = client.simulate_post("/query", body=msgspec.msgpack.encode(big), headers=MSGPACK)
    assert r.status_code == 413 and msgspec.msgpack.decode(r.content)["error"]
    for path in ("/register", "/unregister", "/events"):
        r = client.simulate_post(path, body=b" " * 201)
        assert r.status_code == 413 and r.json["error"]
    register(client)  # small bodies still pass


class _Stream:
    def __init__(self, chunks):
        self.chunks = chunks
        self.consumed = 0

    async def _gen(self):
        for c in self.chunks:
            self.consumed += 1
            yield c

    def __aiter__(self):
        return self._gen()


class _Req:
    content_length = None

    def __init__(self, chunks):
        self.stream = _Stream(chunks)


def test_body_limit_while_streaming():
    req = _Req([b"x" * 60] * 10)
    with pytest.raises(BodyTooLarge):
        run_coro(read_body(req, 100))
    assert req.stream.consumed == 2  # stopped as soon as the limit was passed
    assert run_coro(read_body(_Req([b"ab", b"cd"]), 4)) == b"abcd"


def test_with_the_real_subscription_manager(impl):
    pytest.importorskip("kvconductor.ingest.subscriber")
    c = Conductor(ConductorConfig(index_impl=impl, maintenance_interval=3600))
    c.start()
    try:
        client = ft.TestClient(create_app(c))
        eps = {"npu": "tcp://127.0.0.1:1", "cpu": "tcp://127.0.0.1:2"}
        for _ in range(2):
            register(
                client,
                store_backend="YuanRong",
                medium_endpoints=eps,
                replay_endpoint="tcp://127.0.0.1:3",
            )
        sources = client.simulate_get("/workers").json["sources"]
        assert sorted(s["url"] for s in sources) == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        assert all(s["instance_id"] == "vllm-prefill-1" and s["dp_rank"] == 0 for s in sources)
        events(client, [stored(1, [100], [1, 2, 3, 4])])
        assert query(client, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"]["0"] == dp(1, 0, 0)
        assert unregister(client).status_code == 200
        assert _views(client.simulate_get("/workers").json) == {
            "workers": [],
            "indexer": [],
            "sources": [],
        }
    finally:
        assert c.stop(5.0)


@pytest.mark.parametrize("path", ["/register", "/unregister", "/events"])
@pytest.mark.parametrize("where", ["top", "field"])
def test_deeply_nested_json_is_400(client, path, where):
    """Nesting that exhausts the decoder's recursion is a bad body (400), never a 500."""
    deep = b'{"a":' * 200_000 + b"1" + b"}" * 200_000
    if where == "top":
        body = deep
    else:
        body = (
            b'{"instance_id":"x","type":"vLLM","modelname":"m","block_size":4,"dp_rank":0,'
            b'"events":[{"event_id":1,"data":' + deep + b'}],"medium_endpoints":' + deep + b"}"
        )
    r = client.simulate_post(path, body=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json["error"].startswith("invalid JSON request body: ")
    assert client.simulate_get("/health").status_code == 200


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"medium_endpoints": {"npu": "tcp://10.0.0.1"}}, "medium_endpoints['npu']"),
        ({"medium_endpoints": {"npu": "tcp://*:5557"}}, "medium_endpoints['npu']"),
        ({"medium_endpoints": {"npu": "ipc:///tmp/x"}}, "medium_endpoints['npu']"),
        ({"endpoint": "inproc://x"}, "endpoint"),
        (
            {"medium_endpoints": {"npu": "tcp://10.0.0.1:5557"}, "replay_endpoint": "tcp://h:0"},
            "replay_endpoint",
        ),
    ],
)
def test_register_rejects_unsafe_or_malformed_urls(client, kw, field):
    r = register(client, expect=400, **kw)
    assert r.json["error"].startswith(f"{field} "), r.json
    assert _views(client.simulate_get("/workers").json) == {
        "workers": [],
        "indexer": [],
        "sources": [],
    }


def test_block_size_mismatch_is_loud(client, caplog):
    """A query whose block size no registration has: 200 in the V3 shape, plus the
    warning header, one WARN line per (model, tenant, block size) per minute."""
    register(client, dp_rank=0)  # block_size 4
    register(client, dp_rank=1, block_size=16)
    assert events(client, [stored(1, [100], [1, 2, 3, 4])]).status_code == 200
    want = (
        "block_size 8 matches no registration of model=qwen tenant=default "
        "(registered block sizes: 4, 16); blocks are hashed per block size, so this query "
        "cannot find any"
    )
    caplog.set_level("WARNING", logger="kvconductor.http")
    for body, headers in (
        (msgspec.json.encode({"model": "qwen", "block_size": 8, "token_ids": [1] * 16}), None),
        (msgspec.msgpack.encode({"model": "qwen", "block_size": 8, "token_ids": [1]}), MSGPACK),
    ):
        r = client.simulate_post("/query", body=body, headers=headers)
        assert r.status_code == 200
        got = msgspec.msgpack.decode(r.content) if headers else r.json
        assert got == {"default": {}}
        assert r.headers["x-kv-conductor-warning"] == want
    warns = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert warns == [f"query cannot match: {want}"]  # the second query within the minute
    # A matching block size: no header.
    r = client.simulate_post("/query", json={"model": "qwen", "block_size": 4, "token_ids": [1]})
    assert r.status_code == 200 and "x-kv-conductor-warning" not in r.headers


def test_unknown_lora_name_is_loud(client, caplog):
    """A query naming a LoRA adapter no event carried: 200 V3 body, the warning header, one
    WARN line per (model, tenant, adapter) per minute; a known adapter gets no warning."""
    register(client)
    sql = dict(stored(1, [100], [1, 2, 3, 4]), lora_name="sql")
    assert events(client, [sql]).status_code == 200
    caplog.set_level("WARNING", logger="kvconductor.http")
    want = (
        "lora_name 'chat' was carried by no event of model=qwen tenant=default; blocks of a "
        "LoRA adapter are hashed with its name, so this query cannot find any (does the "
        "engine publish lora_name? vLLM 0.14+, SGLang 0.5.22+)"
    )
    body = {"model": "qwen", "block_size": 4, "token_ids": [1, 2, 3, 4]}
    for _ in range(2):
        r = client.simulate_post("/query", json=dict(body, lora_name="chat"))
        assert (r.status_code, r.json) == (200, {"default": {}})
        assert r.headers["x-kv-conductor-warning"] == want
    warns = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert warns == [f"query cannot match: {want}"]
    r = client.simulate_post("/query", json=dict(body, lora_name="sql"))
    assert r.json["default"]["vllm-prefill-1"]["DP"]["0"]["npu_blocks"] == 1
    assert "x-kv-conductor-warning" not in r.headers
    r = client.simulate_post("/query", json=dict(body, lora_name="sql", token_ids=[9, 9, 9, 9]))
    assert (r.json, "x-kv-conductor-warning" in r.headers) == ({"default": {}}, False)
    # the base model is never "unknown"
    r = client.simulate_post("/query", json=dict(body, token_ids=[9, 9, 9, 9]))
    assert "x-kv-conductor-warning" not in r.headers


def test_miss_warnings_are_rate_limited_per_key(caplog):
    now = [1000.0]
    w = MissWarnings(interval=60.0, clock=lambda: now[0])
    caplog.set_level("WARNING", logger="kvconductor.http")
    sizes = frozenset((4, 16))
    first = w.block_size_mismatch("m", "t", 8, sizes)
    assert first == (
        "block_size 8 matches no registration of model=m tenant=t (registered block "
        "sizes: 4, 16); blocks are hashed per block size, so this query cannot find any"
    )
    assert w.block_size_mismatch("m", "t", 8, sizes) == first  # same sentence, not logged
    w.block_size_mismatch("m", "t", 32, sizes)  # another block size: logged
    now[0] += 59.9
    w.block_size_mismatch("m", "t", 8, sizes)  # within the minute: not logged
    now[0] += 0.1
    w.block_size_mismatch("m", "t", 8, sizes)  # a minute on: logged again
    logged = [r.getMessage().removeprefix("query cannot match: ") for r in caplog.records]
    assert [m.split()[1] for m in logged] == ["8", "32", "8"]


def test_warning_header_cannot_be_split_by_a_name(client):
    """Names come from request bodies: a registration refuses control characters (400),
    a query's model naming no index is a 404 (its JSON body escapes them), and a warning
    header's text escapes them anyway (defence in depth)."""
    r = register(client, modelname="q\r\nSet-Cookie: x=1", expect=400)
    assert r.json["error"].endswith(
        "control characters (U+0000-U+001F, U+007F-U+009F) - at `$.modelname`"
    )
    r = client.simulate_post(
        "/query", json={"model": "q\r\nSet-Cookie: x=1", "block_size": 8, "token_ids": [1]}
    )
    assert r.status_code == 404 and "set-cookie" not in r.headers
    assert "x-kv-conductor-warning" not in r.headers
    assert header_text("model=q\r\nSet-Cookie: x=1") == "model=q\\x0d\\x0aSet-Cookie: x=1"
