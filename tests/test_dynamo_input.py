"""Bad input on the Dynamo dialect's port (``--dynamo-port``, kvconductor.http.dynamo), as
clients and engines produce it, through a real server, one process and ``--workers 2``.

Every bad request gets a 4xx with ``{"error": ...}`` (Dynamo's status where docs/api.md
names one: 400 bad JSON, 415 not JSON, 422 another shape, 404 nothing registered, 405 a
wrong method, 413 over ``--max-body-mb``), a WARN line, and the server answers the next
good query. :func:`test_fuzzed_bodies_never_crash` throws Hypothesis' JSON values and
bytes at every POST route.
"""

from __future__ import annotations

import json
import os
from array import array

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor.http.dialects import DialectError
from kvconductor.http.dynamo import decode, decode_tokens, i64_as_u64
from kvconductor.schema_dynamo import DynamoQueryRequest
from tests.helpers.jsonvalues import json_values
from tests.helpers.server import free_port, running

BS = 16
MODEL = "dyn-input"
TOKENS = list(range(100, 100 + 4 * BS))
GOOD = {"token_ids": TOKENS, "model_name": MODEL}
JSON = {"content-type": "application/json"}
LIMIT_MB = 1
EXAMPLES = int(os.environ.get("KVC_DIFFERENTIAL_EXAMPLES", "200")) // 4


@pytest.fixture(scope="module", params=["one", "workers"])
def dyn(request, tmp_path_factory):
    """``(server, client of the dialect's port)``, one engine registered in MODEL with
    blocks of TOKENS (over V3's ``POST /events``)."""
    port = free_port()
    flags = ["--dynamo-port", str(port), "--max-body-mb", str(LIMIT_MB)]
    flags += ["--source-down-secs", "86400", "--source-purge-secs", "0"]
    if request.param == "workers":
        flags += ["--workers", "2", "--reader-stall-ms", "0"]
    with (
        running(tmp_path_factory.mktemp("dyn-input"), *flags) as s,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as d,
    ):
        assert d.post("/register", json=_reg(1)).status_code == 201
        event = {
            "event_id": 1,
            "dp_rank": 0,
            "type": "BlockStored",
            "block_hashes": list(range(7000, 7004)),
            "parent_block_hash": None,
            "token_ids": TOKENS,
            "block_size": BS,
            "medium": "GPU",
        }
        r = s.http.post(
            "/events",
            json={"instance_id": "1", "model": MODEL, "tenant_id": "default", "events": [event]},
        )
        assert r.status_code == 200, r.text
        yield s, d


def _reg(iid: int, **extra) -> dict:
    return {
        "instance_id": iid,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "model_name": MODEL,
        "block_size": BS,
        **extra,
    }


def _still_serving(d: httpx.Client) -> None:
    """A good query answered: the engine's 4 blocks."""
    r = d.post("/query", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["scores"] == {"1": {"0": 4 * BS}}


def _refused(d: httpx.Client, s, r: httpx.Response, status: int | tuple[int, ...]) -> str:
    """``r`` is a ``status`` with Dynamo's error body, logged; the server serves on."""
    want = (status,) if isinstance(status, int) else status
    assert r.status_code in want, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert list(doc) == ["error"] and isinstance(doc["error"], str) and doc["error"]
    line = f"dynamo dialect: bad request method={r.request.method} path={r.request.url.path}"
    assert f"{line} status={r.status_code}" in s.log()
    _still_serving(d)
    return doc["error"]


def _post(d: httpx.Client, path: str, body: bytes, headers: dict | None = None):
    return d.post(path, content=body, headers=JSON if headers is None else headers)


_Q = ("/query", "/query_by_hash", "/register", "/unregister")


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{", 400),
        (b"", 400),
        (b"xx", 400),
        (b'{"token_ids": [1,], "model_name": "m"}', 400),
        (b'{"token_ids": [NaN], "model_name": "m"}', 400),
        (b'{"token_ids": [Infinity], "model_name": "m"}', 400),
        (b'{"token_ids": [-Infinity], "model_name": "m"}', 400),
        (b'{"model_name": "\xff\xfe", "token_ids": []}', 400),
        (b"\xff" * 64, 400),
        (b'{"x": ' + b"[" * 100_000, 400),
        (b"[" * 100_000, 422),  # an array where an object is expected, at its first byte
        (b"[]", 422),
        (b"[1, 2]", 422),
        (b"1", 422),
        (b'"s"', 422),
        (b"null", 422),
        (b"true", 422),
        (b"{}", 422),
    ],
    ids=lambda v: repr(v)[:24] if isinstance(v, bytes) else str(v),
)
def test_malformed_bodies(dyn, body, status):
    s, d = dyn
    for path in _Q:
        _refused(d, s, _post(d, path, body), status)


#: Per route: a good body and, per field, values of a wrong type or range (422).
_FIELDS = {
    "/query": (
        {"token_ids": [1, 2], "model_name": MODEL, "routing_group": "default", "lora_name": "x"},
        {
            "token_ids": [None, 1, "1", {}, [1.5], [-1], [2**32], [2**64], ["1"], [[1]], [True]],
            "model_name": [None, 1, [], {}, True, "x" * 10_000],
            "routing_group": [None, 1, [], {}],
            "lora_name": [1, [], {}, True],
        },
    ),
    "/query_by_hash": (
        {"block_hashes": [1, -1], "model_name": MODEL, "routing_group": "default"},
        {
            "block_hashes": [None, 1, "1", {}, [1.5], [2**63], [-(2**63) - 1], [2**64], ["1"]],
            "model_name": [None, 1, [], {}],
            "routing_group": [None, 1, [], {}],
        },
    ),
    "/register": (
        _reg(90),
        {
            "instance_id": [None, -1, 2**64, 2**70, 1.5, "1", [], {}],
            "endpoint": [None, 1, [], {}],
            "model_name": [None, 1, [], {}],
            "block_size": [None, 0, -1, 2**32, 1.5, "16"],
            "dp_rank": [None, -1, 2**32, 1.5, "0"],
            "routing_group": [None, 1, []],
            "replay_endpoint": [1, [], {}],
        },
    ),
    "/unregister": (
        {"instance_id": 90, "model_name": MODEL},
        {
            "instance_id": [None, -1, 2**64, 1.5, "1"],
            "model_name": [None, 1, []],
            "routing_group": [1, []],
            "dp_rank": [-1, 2**32, 1.5, "0"],
        },
    ),
}


@pytest.mark.parametrize("path", list(_FIELDS))
def test_every_field_of_a_wrong_type_or_range_is_a_422(dyn, path):
    s, d = dyn
    good, fields = _FIELDS[path]
    for name, values in fields.items():
        for v in values:
            body = json.dumps({**good, name: v}).encode()
            msg = _refused(d, s, _post(d, path, body), 422)
            assert msg.startswith("Failed to deserialize the JSON body into the target type: ")
            assert name in msg, (name, v, msg)


def test_numbers_dynamo_takes(dyn):
    """The edges that are in range: u32 tokens, i64 hashes, -0, an empty list, unknown
    fields and a duplicate key (the last one counts, as in Dynamo's serde_json)."""
    s, d = dyn
    edge = {"token_ids": [0, 2**32 - 1] * BS, "model_name": MODEL}
    assert d.post("/query", json=edge).json() == {"scores": {}, "frequencies": [], "instances": {}}
    r = _post(d, "/query", b'{"token_ids": [-0], "model_name": "%s"}' % MODEL.encode())
    assert r.status_code == 200, r.text
    for path, key in (("/query", "token_ids"), ("/query_by_hash", "block_hashes")):
        r = d.post(path, json={key: [], "model_name": MODEL, "extra": [1, {"a": None}]})
        assert (r.status_code, r.json()["scores"]) == (200, {})
    r = d.post("/query_by_hash", json={"block_hashes": [2**63 - 1, -(2**63)], "model_name": MODEL})
    assert (r.status_code, r.json()["scores"]) == (200, {})
    dup = b'{"model_name": "nope", "token_ids": %s, "model_name": "%s"}' % (
        json.dumps(TOKENS).encode(),
        MODEL.encode(),
    )
    r = _post(d, "/query", dup)
    assert r.json()["scores"] == {"1": {"0": 4 * BS}}


def test_huge_arrays_within_and_beyond_the_body_limit(dyn):
    s, d = dyn
    within = {"token_ids": TOKENS + [7] * 150_000, "model_name": MODEL}  # ~0.9 MB
    r = d.post("/query", json=within)
    assert r.status_code == 200 and r.json()["scores"] == {"1": {"0": 4 * BS}}
    hashes = {"block_hashes": [-(2**62)] * 45_000, "model_name": MODEL}
    assert d.post("/query_by_hash", json=hashes).status_code == 200
    beyond = {"token_ids": list(range(300_000)), "model_name": MODEL}
    for path in _Q:
        msg = _refused(d, s, d.post(path, json=beyond), 413)
        assert msg == f"request body exceeds the limit of {LIMIT_MB << 20} bytes"
        # chunked, no Content-Length: the limit counted as the body comes
        chunks = iter(
            [json.dumps(beyond).encode()[i : i + 65536] for i in range(0, 2 << 20, 65536)]
        )
        msg = _refused(d, s, d.post(path, content=chunks, headers=JSON), 413)
    chunked = iter(
        [b'{"token_ids": ', json.dumps(TOKENS).encode(), b', "model_name": "%s"}' % MODEL.encode()]
    )
    r = d.post("/query", content=chunked, headers=JSON)
    assert r.status_code == 200 and r.json()["scores"] == {"1": {"0": 4 * BS}}


def test_bodies_past_the_limit_are_413_every_time(dyn):
    """With ``--workers 2`` the owner answers a forwarded registration past the limit
    from its head and closes; a worker that wrote the body into that close lost the
    answer (503, about one in eight before the withheld body waited for the owner)."""
    s, d = dyn
    body = json.dumps({"token_ids": list(range(300_000)), "model_name": MODEL}).encode()
    got = [_post(d, path, body).status_code for _ in range(25) for path in _Q]
    assert got == [413] * len(got)
    _still_serving(d)


@pytest.mark.parametrize(
    "headers",
    [{}, {"content-type": "application/msgpack"}, {"content-type": "text/plain"}],
)
def test_a_body_that_is_not_json_is_a_415(dyn, headers):
    s, d = dyn
    for path in _Q:
        msg = _refused(d, s, _post(d, path, json.dumps(GOOD).encode(), headers), 415)
        assert msg == "Expected request with `Content-Type: application/json`"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "HEAD"])
def test_other_methods_on_post_routes_are_a_405(dyn, method):
    s, d = dyn
    for path in _Q:
        r = d.request(method, path, content=b"{}", headers=JSON)
        assert r.status_code == 405, (path, r.status_code, r.text)
        if method != "HEAD":  # a HEAD answer has no body
            assert r.json() == {"error": "Method not allowed"}
        assert f"method={method} path={path} status=405" in s.log()
        _still_serving(d)


def test_registrations_come_and_go(dyn):
    """A model never registered, unregister twice, register then unregister then query."""
    s, d = dyn
    never = d.post("/query", json={**GOOD, "model_name": "never"})
    assert _refused(d, s, never, 404) == "no indexer for model=never routing_group=default"
    other = {"model_name": "gone", "block_size": BS}
    assert d.post("/register", json=_reg(77, **other)).status_code == 201
    q = {"token_ids": TOKENS, "model_name": "gone"}
    assert d.post("/query", json=q).json()["scores"] == {}
    gone = {"instance_id": 77, "model_name": "gone"}
    assert d.post("/unregister", json=gone).json() == {"status": "ok"}
    again = d.post("/unregister", json=gone)
    assert _refused(d, s, again, 404) == "instance 77 not found"
    after = d.post("/query", json=q)
    assert _refused(d, s, after, 404) == "no indexer for model=gone routing_group=default"
    h = d.post("/query_by_hash", json={"block_hashes": [1], "model_name": "gone"})
    assert _refused(d, s, h, 404) == "no indexer for model=gone routing_group=default"


#: JSON values, with the strings that mean something to the dialect.
_values = json_values(
    ["", MODEL, "default", "tcp://127.0.0.1:1", "\u0000", "\ud7ff"],
    nan=False,
    max_size=6,
    max_leaves=20,
)
_names = st.sampled_from(
    ["token_ids", "block_hashes", "model_name", "routing_group", "lora_name", "instance_id",
     "endpoint", "block_size", "dp_rank", "replay_endpoint", "other"]
)  # fmt: skip
_bodies = st.one_of(
    st.dictionaries(_names, _values, max_size=6).map(lambda v: json.dumps(v).encode()),
    _values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.dictionaries(
        _names, st.sampled_from(["NaN", "Infinity", "-0", "1e400", "01"]), min_size=1
    ).map(lambda v: ("{" + ",".join(f'"{k}": {x}' for k, x in v.items()) + "}").encode()),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=st.sampled_from(_Q), body=_bodies)
def test_fuzzed_bodies_never_crash(dyn, path, body):
    """Any body on any POST route: an answer of the contract, never a 500 or a hang (a
    registration Hypothesis happens to make valid is answered 201, and removed)."""
    s, d = dyn
    r = _post(d, path, body)
    assert r.status_code in (200, 201, 400, 404, 409, 422), (path, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert list(r.json()) == ["error"]
    elif path == "/register":
        doc = json.loads(body)
        gone = {"instance_id": doc["instance_id"], "model_name": doc["model_name"]}
        d.post("/unregister", json={**gone, "routing_group": doc.get("routing_group", "default")})
    r = d.post("/query", json=GOOD)
    assert r.status_code == 200 and r.json()["scores"]["1"] == {"0": 4 * BS}


class _Req:
    """What the dialect's decoders read of a Falcon request."""

    content_type = "application/json"


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except DialectError as ex:
        return "error", (ex.status, ex.message)


_token_lists = st.lists(
    st.integers(min_value=0, max_value=2**32 - 1)
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.sampled_from([0, 2**32 - 1, 2**32, -1, 2**63, 2**64 - 1, 2**64]),
    max_size=40,
)
_token_values = _token_lists | _values


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(
    tokens=_token_values,
    others=st.dictionaries(_names, _values, max_size=3),
    raw=st.sampled_from([None, "[-0]", "[1.0]", "[1e3]", "[01]", "[ 1 , 2 ]", "[NaN]"]),
)
def test_the_fast_decode_answers_as_the_typed_one(tokens, others, raw):
    """``/query``'s hot-path decode (the ids read by V3's parser into an ``array('I')``)
    against the typed decode it replaced: the same ids, fields and errors for any body."""
    doc = {**others, "token_ids": tokens}
    if "model_name" not in others:
        doc["model_name"] = MODEL
    body = json.dumps(doc).encode()
    if raw is not None:
        body = body.replace(
            b'"token_ids": ' + json.dumps(tokens).encode(), b'"token_ids": ' + raw.encode()
        )
    fast = _outcome(decode_tokens, _Req, body)
    typed = _outcome(decode, _Req, body, DynamoQueryRequest)
    assert fast[0] == typed[0], (body, fast, typed)
    if fast[0] == "error":
        assert fast[1] == typed[1]
        return
    head, ids = fast[1]
    q = typed[1]
    assert ids == array("I", q.token_ids)
    assert (head.model_name, head.routing_group, head.lora_name) == (
        q.model_name,
        q.routing_group,
        q.lora_name,
    )


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40))
def test_signed_hashes_are_the_index_u64(hashes):
    assert i64_as_u64(hashes) == array("Q", [h & (2**64 - 1) for h in hashes])
