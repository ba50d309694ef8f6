"""Ids and names are at most 400 characters on every route of the real server.

A 70,000-character ``instance_id`` used to be registered (and shown, logged and kept in
every index's worker table). Each id or name of a request is now capped at
``NAME_MAX`` characters: one more is a 400 with ``{"error": ...}`` in the request's
encoding, nothing changes, and the service keeps serving.
"""

from __future__ import annotations

import pytest

from kvconductor.schema import NAME_MAX
from tests.helpers.faults import events, registration
from tests.helpers.http_cases import msgpack_post
from tests.helpers.server import started

LONG = "x" * (NAME_MAX + 1)
FULL = "é" * NAME_MAX  # characters, not bytes: 800 bytes of UTF-8 still fit
BS = 4
TOKENS = list(range(16))


def too_long(path: str, kind: str = "JSON") -> str:
    return f"invalid {kind} request body: Expected `str` of length <= {NAME_MAX} - at {path}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with started(tmp_path_factory.mktemp("names")) as srv:
        yield srv


def query(**kw) -> dict:
    return {"model": "qwen", "block_size": BS, "token_ids": TOKENS, **kw}


CASES = [
    ("/register", registration(instance_id=LONG), "`$.instance_id`"),
    ("/register", registration(type=LONG), "`$.type`"),
    ("/register", registration(modelname=LONG), "`$.modelname`"),
    ("/register", registration(tenant_id=LONG), "`$.tenant_id`"),
    ("/register", registration(node_id=LONG), "`$.node_id`"),
    ("/register", registration(store_backend=LONG), "`$.store_backend`"),
    (
        "/register",
        registration(medium_endpoints={LONG: "tcp://127.0.0.1:5557"}),
        "`key` in `$.medium_endpoints`",
    ),
    ("/unregister", registration(instance_id=LONG), "`$.instance_id`"),
    ("/unregister", registration(modelname=LONG), "`$.modelname`"),
    ("/unregister", registration(tenant_id=LONG), "`$.tenant_id`"),
    ("/events", events(instance_id=LONG), "`$.instance_id`"),
    ("/events", events(model_name=LONG), "`$.model_name`"),
    ("/events", events(tenant_id=LONG), "`$.tenant_id`"),
    ("/events", events({"backend_id": LONG}), "`$.events[0].backend_id`"),
    ("/events", events({"medium": LONG}), "`$.events[0].medium`"),
    ("/events", events({"lora_name": LONG}), "`$.events[0].lora_name`"),
    ("/query", query(model=LONG), "`$.model`"),
    ("/query", query(tenant_id=LONG), "`$.tenant_id`"),
    ("/query", query(lora_name=LONG), "`$.lora_name`"),
    ("/explain", query(model=LONG), "`$.model`"),
    (
        "/query_by_hash",
        {"model": LONG, "block_size": BS, "block_hashes": [1]},
        "`$.model`",
    ),
]


@pytest.mark.parametrize(("route", "body", "path"), CASES, ids=[f"{r} {p}" for r, _, p in CASES])
def test_an_overlong_id_or_name_is_a_json_400(server, route, body, path):
    r = server.http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"error": too_long(path)}


@pytest.mark.parametrize("route", ["/query", "/query_by_hash", "/explain"])
@pytest.mark.parametrize("positional", [False, True])
def test_an_overlong_model_is_a_msgpack_400_in_msgpack(server, route, positional):
    values = [1] if route == "/query_by_hash" else TOKENS
    doc = (
        [LONG, BS, values]
        if positional
        else {
            "model": LONG,
            "block_size": BS,
            ("block_hashes" if route == "/query_by_hash" else "token_ids"): values,
        }
    )
    status, ctype, answer = msgpack_post(server.http, route, doc)
    assert status == 400
    assert ctype.startswith("application/msgpack")
    assert answer == {"error": too_long("`$.model`", "msgpack")}


def test_nothing_changes_and_names_of_the_limit_are_served(server):
    """After the refusals nothing is registered; ids and names of exactly NAME_MAX
    characters register, take events and answer queries."""
    doc = server.http.get("/workers").json()
    assert doc["workers"] == [] and doc["indexer"] == []
    body = registration(instance_id=FULL, modelname=FULL, tenant_id=FULL)
    assert server.http.post("/register", json=body).status_code == 201
    ev = events(instance_id=FULL)
    ev["events"][0].update(
        {"blocks": [{"block_hash": 1, "tokens_hash": 5}], "backend_id": FULL, "medium": "GPU"}
    )
    r = server.http.post("/events", json=ev)
    assert r.status_code == 200, r.text
    r = server.http.post(
        "/query_by_hash",
        json={"model": FULL, "tenant_id": FULL, "block_size": BS, "block_hashes": [5]},
    )
    assert r.status_code == 200
    assert r.json() == {
        FULL: {
            FULL: {
                "longest_matched": 1,
                "DP": {
                    "0": {"matched_tokens": 1, "npu_blocks": 1, "cpu_blocks": 0, "disk_blocks": 0}
                },
            }
        }
    }
    un = registration(instance_id=FULL, modelname=FULL, tenant_id=FULL)
    assert server.http.post("/unregister", json=un).status_code == 200
    assert server.http.get("/health").text == "OK"
