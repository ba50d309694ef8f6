"""GET /openapi.json: every route is described, and real answers conform to it."""

from __future__ import annotations

import falcon.testing as ft
import jsonschema
import msgspec
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from kvconductor import __version__, schema, schema_mooncake
from kvconductor.http import openapi
from kvconductor.http.api import create_app
from kvconductor.state.conductor import Conductor, ConductorConfig
from tests.helpers.api import H1, H2, RecordingSubs, events, register, stored

DOC = openapi.document()
_REGISTRY = Registry().with_resource("urn:kvc", DRAFT202012.create_resource(DOC))


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _check(instance, *where: str) -> None:
    """Validate ``instance`` against the schema at ``where`` in DOC (its $refs resolve
    inside DOC)."""
    pointer = "/".join(_escape(w) for w in where)
    jsonschema.Draft202012Validator({"$ref": f"urn:kvc#/{pointer}"}, registry=_REGISTRY).validate(
        instance
    )


def _answer_schema(path: str, method: str, status: int, ctype="application/json") -> tuple:
    return ("paths", path, method, "responses", str(status), "content", ctype, "schema")


def _request_schema(path: str, ctype="application/json") -> tuple:
    return ("paths", path, "post", "requestBody", "content", ctype, "schema")


@pytest.fixture
def client():
    c = Conductor(
        ConductorConfig(index_impl="c", maintenance_interval=3600), subscriptions=RecordingSubs
    )
    c.start()
    yield ft.TestClient(create_app(c, fast_query=True))
    assert c.stop(5.0)


def test_every_route_of_the_app_is_described(client):
    nodes = list(client.app.app._router._roots)
    routes = set()
    while nodes:  # nested routes (/debug/dump) are children of their first segment
        node = nodes.pop()
        nodes += node.children or []
        if node.resource is not None:
            routes.add(node.uri_template)
    assert routes == set(DOC["paths"])
    assert DOC["openapi"] == "3.1.0" and DOC["info"]["version"] == __version__


def test_every_ref_resolves():
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(DOC)
    names = {r.rsplit("/", 1)[1] for r in refs}
    assert names <= set(DOC["components"]["schemas"]) and "QueryRequest" in names


def test_bodies_come_from_the_schema_declarations():
    comps = DOC["components"]["schemas"]
    assert list(comps["QueryRequest"]["properties"]) == list(schema.QUERY_FIELDS)
    assert list(comps["QueryByHashRequest"]["properties"]) == list(schema.QUERY_BY_HASH_FIELDS)
    assert list(comps["InstanceMatch"]["properties"]) == list(schema.INSTANCE_MATCH_KEYS)
    # a DP's "freshness" member only comes with a freshness query (docs/api.md)
    assert list(comps["DpMatch"]["properties"]) == [*schema.DP_MATCH_KEYS, "freshness"]
    assert comps["DpMatch"]["required"] == list(schema.DP_MATCH_KEYS)
    assert comps["DpFreshness"]["required"] == ["state"]
    assert list(comps["FreshnessSummary"]["properties"]) == ["all_live", "sources", "states"]
    answer = DOC["paths"]["/query"]["post"]["responses"]["200"]["content"]
    for body in answer.values():
        assert body["schema"]["properties"] == {
            "freshness": {"$ref": "#/components/schemas/FreshnessSummary"}
        }
    assert comps["ErrorResponse"]["required"] == [schema.ERROR_KEY]
    for cls in (schema.RegisterRequest, schema.UnregisterRequest, schema.KvEventBatch):
        required = {f.encode_name for f in msgspec.structs.fields(cls) if f.required}
        assert set(comps[cls.__name__]["required"]) == required


def test_served_document_is_the_module_s(client):
    r = client.simulate_get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json == msgspec.json.decode(msgspec.json.encode(DOC))


def test_real_answers_conform(client):
    body = {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 4,
        "dp_rank": 0,
    }
    _check(body, *_request_schema("/register"))
    r = register(client)
    _check(r.json, *_answer_schema("/register", "post", 201))
    batch = {
        "instance_id": "vllm-prefill-1",
        "events": [stored(1, [H1, H2], [1, 2, 3, 4, 5, 6, 7, 8])],
    }
    _check(batch, *_request_schema("/events"))
    r = events(client, batch["events"])
    assert r.status_code == 200
    _check(r.json, *_answer_schema("/events", "post", 200))
    q = {"model": "qwen", "block_size": 4, "token_ids": list(range(1, 9)), "lora_name": None}
    _check(q, *_request_schema("/query"))
    r = client.simulate_post("/query", json=q)
    assert r.status_code == 200 and r.json["default"]["vllm-prefill-1"]["longest_matched"] == 8
    _check(r.json, *_answer_schema("/query", "post", 200))
    r = client.simulate_post(
        "/query", body=msgspec.msgpack.encode(q), headers={"Content-Type": "application/msgpack"}
    )
    _check(
        msgspec.msgpack.decode(r.content),
        *_answer_schema("/query", "post", 200, "application/msgpack"),
    )
    r = client.simulate_post(
        "/query_by_hash", json={"model": "qwen", "block_size": 4, "block_hashes": [H1]}
    )
    assert r.status_code == 200
    _check(r.json, *_answer_schema("/query_by_hash", "post", 200))
    assert "X-KV-Conductor-Top-K-Omitted" not in r.headers  # only with top_k
    for path, body in (("/query", q), ("/query_by_hash", {"model": "qwen", "block_hashes": [H1]})):
        r = client.simulate_post(path, json={**body, "top_k": 1})
        assert r.status_code == 200
        head = DOC["paths"][path]["post"]["responses"]["200"]["headers"]
        omitted = head["X-KV-Conductor-Top-K-Omitted"]
        jsonschema.validate(int(r.headers["X-KV-Conductor-Top-K-Omitted"]), omitted["schema"])
    r = client.simulate_post("/query", json={**q, "block_size": 8})  # logs a WARN
    assert r.status_code == 200 and "X-KV-Conductor-Warning" in r.headers
    r = client.simulate_get("/workers")
    assert [w["level"] for w in r.json["recent_warnings"]] == ["WARN"]
    _check(r.json, *_answer_schema("/workers", "get", 200))
    bad = {**r.json, "recent_warnings": [{"ts": "2026-11-30T00:00:00.000000Z", "level": "WARN"}]}
    with pytest.raises(jsonschema.ValidationError, match="'message' is a required property"):
        _check(bad, *_answer_schema("/workers", "get", 200))
    for model in ("qwen", "nope"):
        r = client.simulate_post("/explain", json=q | {"model": model})
        assert r.status_code == 200 and r.json["index_found"] is (model == "qwen")
        _check(r.json, *_answer_schema("/explain", "post", 200))
    r = client.simulate_post("/unregister", json=body)
    _check(r.json, *_answer_schema("/unregister", "post", 200))


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/register", {"instance_id": "x"}, 400),
        (
            "/unregister",
            {
                "instance_id": "ghost",
                "type": "vLLM",
                "modelname": "m",
                "block_size": 4,
                "dp_rank": 0,
            },
            404,
        ),
        ("/query", {"model": "nope", "block_size": 4, "token_ids": [1]}, 404),
        ("/query", {"model": "qwen", "block_size": 0, "token_ids": [1]}, 400),
        ("/query_by_hash", {"model": "qwen"}, 400),
        ("/explain", {"model": "qwen", "block_size": 0, "token_ids": [1]}, 400),
        ("/events", {"events": []}, 400),
    ],
)
def test_error_answers_conform(client, path, body, status):
    r = client.simulate_post(path, json=body)
    assert r.status_code == status, r.text
    assert str(status) in DOC["paths"][path]["post"]["responses"]
    _check(r.json, *_answer_schema(path, "post", status))
    if status == 400:  # what the server refuses, the document refuses too
        with pytest.raises(jsonschema.ValidationError):
            _check(body, *_request_schema(path))


# -- the Mooncake conductor dialect's document (GET /openapi.json on --mooncake-port) -------

MC_DOC = openapi.mooncake_document()
_MC_REGISTRY = Registry().with_resource("urn:kvc-mc", DRAFT202012.create_resource(MC_DOC))


def _mc_check(instance, *where: str) -> None:
    pointer = "/".join(_escape(w) for w in where)
    jsonschema.Draft202012Validator(
        {"$ref": f"urn:kvc-mc#/{pointer}"}, registry=_MC_REGISTRY
    ).validate(instance)


@pytest.fixture
def mc_client():
    from kvconductor.http.mooncake import create_mooncake_app

    c = Conductor(
        ConductorConfig(index_impl="c", maintenance_interval=3600), subscriptions=RecordingSubs
    )
    c.start()
    yield ft.TestClient(create_mooncake_app(c)), ft.TestClient(create_app(c))
    assert c.stop(5.0)


def test_mooncake_document_describes_every_route_and_resolves(mc_client):
    client, _ = mc_client
    routes = {n.uri_template for n in client.app._router._roots if n.resource is not None}
    assert routes == set(MC_DOC["paths"])
    assert client.simulate_get("/openapi.json").json == msgspec.json.decode(
        msgspec.json.encode(MC_DOC)
    )
    comps = MC_DOC["components"]["schemas"]
    assert list(comps["MooncakeInstanceMatch"]["properties"]) == list(
        schema_mooncake.MooncakeInstanceMatch.__struct_fields__
    )
    assert comps["MooncakeError"]["required"] == ["error", "reason"]


def test_mooncake_real_answers_conform(mc_client):
    client, v3 = mc_client
    reg = {
        "endpoint": "tcp://127.0.0.1:5557",
        "type": "vLLM",
        "modelname": "qwen",
        "instance_id": "vllm-prefill-1",
        "block_size": 4,
        "dp_rank": 0,
        "hash_profile": {
            "strategy": "vllm_v1",
            "algorithm": "sha256_cbor",
            "python_hash_seed": "0",
            "index_projection": "low64_be",
        },
    }
    _mc_check(reg, *_request_schema("/register"))
    r = client.simulate_post("/register", json=reg)
    assert r.status_code == 200
    _mc_check(r.json, *_answer_schema("/register", "post", 200))
    r = events(v3, [stored(1, [H1, H2], [1, 2, 3, 4, 5, 6, 7, 8])])
    assert r.status_code == 200
    q = {"model": "qwen", "block_size": 4, "token_ids": list(range(1, 9))}
    _mc_check(q, *_request_schema("/query"))
    r = client.simulate_post("/query", json=q)
    assert r.json["instances"]["vllm-prefill-1"]["longest_matched"] == 8
    _mc_check(r.json, *_answer_schema("/query", "post", 200))
    r = client.simulate_post(
        "/query", body=msgspec.msgpack.encode(q), headers={"Content-Type": "application/msgpack"}
    )
    _mc_check(
        msgspec.msgpack.decode(r.content),
        *_answer_schema("/query", "post", 200, "application/msgpack"),
    )
    r = client.simulate_post("/query", body=b"{")
    assert r.status_code == 400
    _mc_check(r.json, *_answer_schema("/query", "post", 400))
    un = {"instance_id": "vllm-prefill-1", "dp_rank": 0}
    _mc_check(un, *_request_schema("/unregister"))
    r = client.simulate_post("/unregister", json=un)
    assert r.status_code == 200
    _mc_check(r.json, *_answer_schema("/unregister", "post", 200))
    r = client.simulate_post("/unregister", json=un)
    assert r.status_code == 404
    _mc_check(r.json, *_answer_schema("/unregister", "post", 404))


# -- Dynamo's indexer dialect's document (GET /openapi.json on --dynamo-port) -------------

DYN_DOC = openapi.dynamo_document()
_DYN_VALIDATE = Registry().with_resource("urn:kvc-dyn", DRAFT202012.create_resource(DYN_DOC))


def test_dynamo_document_describes_every_route_and_real_answers_conform(conductor):
    """Every route of the app is in the document, and what it takes and answers (success
    and errors alike) validates against it."""
    from kvconductor.http.dynamo import create_dynamo_app

    client, v3 = ft.TestClient(create_dynamo_app(conductor)), ft.TestClient(create_app(conductor))

    def conform(instance, *where: str) -> None:
        ref = {"$ref": "urn:kvc-dyn#/" + "/".join(_escape(w) for w in where)}
        jsonschema.Draft202012Validator(ref, registry=_DYN_VALIDATE).validate(instance)

    routes = {n.uri_template for n in client.app._router._roots if n.resource is not None}
    assert routes == set(DYN_DOC["paths"])
    assert client.simulate_get("/openapi.json").json == msgspec.json.decode(
        msgspec.json.encode(DYN_DOC)
    )
    reg = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5557", "model_name": "qwen",
           "block_size": 4}  # fmt: skip
    query = {"token_ids": list(range(1, 9)), "model_name": "qwen"}
    steps = [
        ("/register", reg, 201),
        ("/register", reg, 409),
        ("/query", query, 200),
        ("/query_by_hash", {"block_hashes": [-1, 7], "model_name": "qwen"}, 200),
        ("/query", {"token_ids": [1], "model_name": "other"}, 404),
        ("/query", {"model_name": "qwen"}, 422),
        ("/unregister", {"instance_id": 1, "model_name": "qwen"}, 200),
        ("/unregister", {"instance_id": 1, "model_name": "qwen"}, 404),
    ]
    for path, body, status in steps:
        if status < 400:
            conform(body, *_request_schema(path))
        r = client.simulate_post(path, json=body)
        assert r.status_code == status, (path, r.text)
        conform(r.json, *_answer_schema(path, "post", status))
        if (path, status) == ("/register", 409):  # blocks for the queries
            r = events(v3, [stored(1, [H1, H2], list(range(1, 9)))], instance_id="1")
            assert r.status_code == 200, r.text
            assert client.simulate_post("/query", json=query).json["scores"] == {"1": {"0": 8}}
    conform(client.simulate_get("/workers").json, *_answer_schema("/workers", "get", 200))
