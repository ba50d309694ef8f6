"""HTTP cases run against the real service in one process (``tests/test_server.py``) and
against ``--workers 2`` (``tests/test_cluster.py``): the same requests, the same expected
answers. Each takes a started :class:`~tests.helpers.server.Server`.
"""

from __future__ import annotations

import httpx
import msgspec

from kvconductor._hash import hash_blocks
from kvconductor.schema import TOP_K_OMITTED_HEADER
from tests.helpers.server import HAS_IPV6, registration


def register(http: httpx.Client, **kw) -> httpx.Response:
    return http.post("/register", json=registration(**kw))


def msgpack_post(http: httpx.Client, path: str, body) -> tuple[int, str, object]:
    r = http.post(
        path, content=msgspec.msgpack.encode(body), headers={"Content-Type": "application/msgpack"}
    )
    return r.status_code, r.headers["content-type"], msgspec.msgpack.decode(r.content)


def health_on_dual_stack_default_host(server) -> None:
    assert server.http.get("/health").text == "OK"
    if HAS_IPV6:
        r = httpx.get(f"http://[::1]:{server.port}/health", timeout=10)
        assert r.status_code == 200 and r.text == "OK"
    assert (
        f"KV conductor starting on [::]:{server.port}" in server.log()
        or f"KV conductor starting on 0.0.0.0:{server.port}" in server.log()
    )


def json_and_msgpack_end_to_end(server) -> None:
    http = server.http
    r = register(http, medium_endpoints={"npu": "tcp://127.0.0.1:1"}, store_backend="YuanRong")
    assert r.status_code == 201 and r.json() == {"status": "ok"}
    r = http.post(
        "/events",
        json={
            "instance_id": "vllm-prefill-1",
            "events": [
                {
                    "event_id": 1,
                    "dp_rank": 0,
                    "type": "BlockStored",
                    "block_hashes": [100, 200],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    "block_size": 4,
                    "medium": "GPU",
                },
                {
                    "event_id": 2,
                    "dp_rank": 0,
                    "type": "BlockStored",
                    "block_hashes": [300],
                    "parent_block_hash": 200,
                    "token_ids": [9, 10, 11, 12],
                    "block_size": 4,
                    "medium": "cpu",
                },
            ],
        },
    )
    assert r.status_code == 200 and r.json() == {"status": "ok", "events_applied": 2}
    query = {"model": "qwen", "block_size": 4, "token_ids": list(range(1, 17))}
    r = http.post("/query", json=query)
    expected = {
        "default": {
            "vllm-prefill-1": {
                "longest_matched": 12,
                "DP": {
                    "0": {"matched_tokens": 12, "npu_blocks": 2, "cpu_blocks": 1, "disk_blocks": 0}
                },
            }
        }
    }
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == expected
    code, ct, doc = msgpack_post(http, "/query", query)
    assert (code, ct, doc) == (200, "application/msgpack", expected)
    code, ct, doc = msgpack_post(http, "/query", ["qwen", 4, list(range(1, 17)), "default"])
    assert doc == expected
    hashes = [14643705804678351452, 16777012769546811212]
    code, ct, doc = msgpack_post(
        http, "/query_by_hash", {"model": "qwen", "block_size": 4, "block_hashes": hashes}
    )
    assert code == 200 and doc["default"]["vllm-prefill-1"]["longest_matched"] == 2
    code, ct, doc = msgpack_post(http, "/query", {"model": "x", "block_size": 4, "token_ids": []})
    assert (code, ct, doc) == (
        404,
        "application/msgpack",
        {"error": "no indexer for model=x tenant=default"},
    )
    workers = http.get("/workers").json()
    assert workers["workers"][0]["instance_id"] == "vllm-prefill-1"
    assert workers["indexer"][0]["total_blocks"] == 3
    assert [s["url"] for s in workers["sources"]] == ["tcp://127.0.0.1:1"]
    r = http.post(
        "/unregister",
        json={
            "instance_id": "vllm-prefill-1",
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": 4,
            "dp_rank": 0,
        },
    )
    assert r.status_code == 200
    doc = http.get("/workers").json()
    assert isinstance(doc.pop("recent_warnings"), list)  # other tests of this server warn
    doc.pop("processes", None)  # --workers N (tests/test_cluster.py runs this test too)
    assert doc == {"workers": [], "indexer": [], "sources": []}


def large_msgpack_query(server) -> None:
    http = server.http
    assert register(http, instance_id="big").status_code == 201
    tokens = list(range(1, 9)) + [7] * 200_000
    r = http.post(
        "/events",
        json={
            "instance_id": "big",
            "events": [
                {
                    "event_id": 1,
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "token_ids": list(range(1, 9)),
                    "block_size": 4,
                }
            ],
        },
    )
    assert r.json()["events_applied"] == 1
    code, _, doc = msgpack_post(
        http, "/query", {"model": "qwen", "block_size": 4, "token_ids": tokens}
    )
    assert code == 200 and doc["default"]["big"]["DP"]["0"]["npu_blocks"] == 2
    http.post(
        "/unregister",
        json={
            "instance_id": "big",
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": 4,
            "dp_rank": 0,
        },
    )


def errors_over_http(server) -> None:
    http = server.http
    r = http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]
    r = http.put("/register")
    assert r.status_code == 405 and r.json()["error"]
    r = http.post("/register", content=b"{oops", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("invalid JSON request body")
    r = http.post(
        "/query", content=b"\xc1\xff\x00", headers={"Content-Type": "application/msgpack"}
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["error"].startswith("invalid msgpack request body")
    r = http.post("/events", json={"instance_id": "x", "events": [{"event_id": 1, "type": "?"}]})
    assert r.status_code == 400
    assert http.get("/health").text == "OK"


def body_limit_over_http(server) -> None:
    http = server.http
    big = b"[" + b"1," * 600_000 + b"1]"  # > 1 MiB
    r = http.post("/query", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    r = http.post("/events", content=chunks())  # chunked: no Content-Length
    assert r.status_code == 413 and r.json()["error"]
    assert http.get("/health").text == "OK"


def _topk_fixture(http: httpx.Client) -> tuple[list[int], dict]:
    """Six (instance, DP) groups of model ``topk`` holding 1..5 blocks of one prompt:
    a/0 5, a/1 2, b/0 4, c/0 4, d/0 1, e/0 3 blocks (HBM); returns the prompt and the
    full V3 answer (block_size 4)."""
    tokens = list(range(1, 25))  # 6 blocks of 4
    held = {("a", 0): 5, ("a", 1): 2, ("b", 0): 4, ("c", 0): 4, ("d", 0): 1, ("e", 0): 3}
    for n, ((iid, dp), blocks) in enumerate(held.items()):
        r = register(http, instance_id=iid, dp_rank=dp, modelname="topk")
        assert r.status_code == 201, r.text
        ev = {
            "event_id": 1,
            "dp_rank": dp,
            "type": "BlockStored",
            "block_hashes": [1000 * (n + 1) + b for b in range(blocks)],
            "token_ids": tokens[: 4 * blocks],
            "block_size": 4,
        }
        r = http.post("/events", json={"instance_id": iid, "events": [ev]})
        assert r.json() == {"status": "ok", "events_applied": 1}, r.text
    full: dict = {}
    for (iid, dp), blocks in held.items():
        inst = full.setdefault(iid, {"longest_matched": 0, "DP": {}})
        inst["DP"][str(dp)] = {
            "matched_tokens": 4 * blocks,
            "npu_blocks": blocks,
            "cpu_blocks": 0,
            "disk_blocks": 0,
        }
        inst["longest_matched"] = max(inst["longest_matched"], 4 * blocks)
    return tokens, full


def _cut(full: dict, keep: set) -> dict:
    out = {}
    for iid, inst in full.items():
        dps = {dp: v for dp, v in inst["DP"].items() if (iid, int(dp)) in keep}
        if dps:
            best = max(v["matched_tokens"] for v in dps.values())
            out[iid] = {"longest_matched": best, "DP": dps}
    return out


def top_k_and_instances_over_http(server) -> None:
    http = server.http
    tokens, full = _topk_fixture(http)
    try:
        q = {"model": "topk", "block_size": 4, "token_ids": tokens}
        # without the extension: exactly the V3 answer, every (instance, DP)
        assert http.post("/query", json=q).json() == {"default": full}
        full_keys = {("a", 0), ("a", 1), ("b", 0), ("c", 0), ("d", 0), ("e", 0)}
        # top_k=1: a/0 (5 blocks); top_k=2: a/0 and one of b/0, c/0 (tied at 4 blocks): the
        # instances' order picks it; top_k=3: a/0, b/0, c/0. (extra, rows, omitted header)
        cases = [
            ({"top_k": 1}, {("a", 0)}, "0"),
            ({"top_k": 2, "instances": ["c", "b", "a"]}, {("a", 0), ("c", 0)}, "1"),
            ({"top_k": 2, "instances": ["a", "b", "c"]}, {("a", 0), ("b", 0)}, "1"),
            ({"top_k": 3}, {("a", 0), ("b", 0), ("c", 0)}, "0"),
            ({"top_k": 100}, full_keys, "0"),
            ({"instances": ["a", "d", "nobody"]}, {("a", 0), ("a", 1), ("d", 0)}, None),
            ({"instances": ["d", "e"], "top_k": 1}, {("e", 0)}, "0"),
            ({"instances": []}, set(), None),
            ({"top_k": None, "instances": None}, full_keys, None),
        ]
        for extra, keep, omitted in cases:
            want = {"default": _cut(full, keep)}
            r = http.post("/query", json={**q, **extra})
            assert r.status_code == 200 and r.json() == want, extra
            assert r.headers.get(TOP_K_OMITTED_HEADER) == omitted, extra
            code, ct, doc = msgpack_post(http, "/query", {**q, **extra})
            assert (code, ct, doc) == (200, "application/msgpack", want), extra
            # the positional form: top_k and instances are the 6th and 7th elements
            row = ["topk", 4, tokens, None, None, extra.get("top_k"), extra.get("instances")]
            assert msgpack_post(http, "/query", row)[2] == want, extra
            # /query_by_hash: the same rows, counts in blocks
            hq = {"model": "topk", "block_hashes": list(hash_blocks(tokens, 4)), **extra}
            code, _, doc = msgpack_post(http, "/query_by_hash", hq)
            assert code == 200
            assert {i: v["longest_matched"] for i, v in doc["default"].items()} == {
                i: v["longest_matched"] // 4 for i, v in want["default"].items()
            }
        # top_k=2 without instances: one of the two tied rows, the same for the same request
        # in every encoding (the rotation is seeded by the request's token ids)
        both = [{"default": _cut(full, {("a", 0), tied})} for tied in (("b", 0), ("c", 0))]
        r = http.post("/query", json={**q, "top_k": 2})
        assert r.json() in both and r.headers[TOP_K_OMITTED_HEADER] == "1"
        assert msgpack_post(http, "/query", {**q, "top_k": 2})[2] == r.json()
        hq = {"model": "topk", "block_hashes": list(hash_blocks(tokens, 4)), "top_k": 2}
        r = http.post("/query_by_hash", json=hq)
        assert len(r.json()["default"]) == 2 and r.headers[TOP_K_OMITTED_HEADER] == "1"
        # bad values: 400 with {"error": ...} in the request's encoding
        for extra, detail in (
            ({"top_k": 0}, "top_k must be between 1 and 4294967295"),
            ({"top_k": -3}, "top_k must be between 1 and 4294967295"),
            ({"top_k": "2"}, "invalid type for `top_k`: expected an integer or null"),
            (
                {"instances": "a"},
                "invalid type for `instances`: expected an array of strings or null",
            ),
        ):
            r = http.post("/query", json={**q, **extra})
            assert r.status_code == 400
            assert r.json() == {"error": f"invalid JSON request body: {detail}"}
            code, ct, doc = msgpack_post(http, "/query_by_hash", {**hq, **extra})
            assert (code, ct) == (400, "application/msgpack")
            assert doc == {
                "error": "invalid msgpack request body: " + detail.replace("null", "nil")
            }
        assert http.get("/health").text == "OK"  # still serving
    finally:
        for iid, dp in (("a", 0), ("a", 1), ("b", 0), ("c", 0), ("d", 0), ("e", 0)):
            body = {"instance_id": iid, "type": "vLLM", "modelname": "topk", "block_size": 4}
            http.post("/unregister", json={**body, "dp_rank": dp})
