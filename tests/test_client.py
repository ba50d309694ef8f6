"""Conductor client: offline tests on httpx.MockTransport, and live tests
(marker ``server``) against ``python -m kvconductor`` in a subprocess."""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest

from kvconductor.affinity import Candidate, KvAffinityConfig, rank
from kvconductor.client import (
    AsyncConductorClient,
    CircuitBreaker,
    CircuitOpenError,
    ConductorClient,
    ConductorError,
    KvConductorConfig,
    backend_mode,
    build_dp_registration,
    build_medium_endpoints,
    build_node_pool_registration,
    build_pool_registration,
    build_unregister_payload,
    canonical_store_backend,
    conductor_base_url,
    format_host,
    instance_name,
    missing_registrations,
    node_pool_instance_id,
    normalize_service_key,
    pack_tokens,
    resolve_endpoint,
    resolve_store_backend,
    strip_decode_instances,
    token_list,
)
from kvconductor.coordinator.exchange import QueryAnswer
from tests.helpers.coro import run_coro

BASE = "http://conductor.test:13333"

ANSWER = {
    "default": {
        "vllm-prefill-1": {
            "longest_matched": 8,
            "DP": {"0": {"matched_tokens": 8, "npu_blocks": 2, "cpu_blocks": 0, "disk_blocks": 0}},
        }
    }
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


class Recorder:
    """A MockTransport handler that records requests and replies from a function."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.reply(request)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]


def msgpack_reply(obj, status=200, ct="application/msgpack"):
    return lambda req: httpx.Response(
        status, content=msgspec.msgpack.encode(obj), headers={"content-type": ct}
    )


def json_reply(obj, status=200):
    return lambda req: httpx.Response(status, json=obj)


def negotiated_reply(obj):
    """Like the V3 server: msgpack answer to a msgpack request, JSON otherwise."""

    def reply(req):
        if req.headers["content-type"].startswith("application/msgpack"):
            return msgpack_reply(obj)(req)
        return json_reply(obj)(req)

    return reply


def refuse(req):
    raise httpx.ConnectError("[Errno 111] Connection refused", request=req)


def make(reply, **kw):
    rec = Recorder(reply)
    return ConductorClient(BASE, transport=httpx.MockTransport(rec), **kw), rec


def decode_body(req: httpx.Request):
    if req.headers["content-type"] == "application/msgpack":
        return msgspec.msgpack.decode(req.content)
    return json.loads(req.content)


# ---------------------------------------------------------------------------
# Encodings


def test_query_msgpack_by_default():
    client, rec = make(negotiated_reply(ANSWER))
    assert client.query("qwen", [1, 2, 3, 4, 5], 4) == ANSWER
    req = rec.last
    assert (req.method, req.url.path) == ("POST", "/query")
    assert req.headers["content-type"] == "application/msgpack"
    assert decode_body(req) == {
        "model": "qwen",
        "block_size": 4,
        "token_ids": [1, 2, 3, 4, 5],
        "tenant_id": "default",
    }


def test_query_json_on_request():
    client, rec = make(negotiated_reply(ANSWER), query_encoding="json")
    assert client.query("qwen", (1, 2, 3, 4), 4, tenant_id="t1") == ANSWER
    assert rec.last.headers["content-type"] == "application/json"
    assert json.loads(rec.last.content) == {
        "model": "qwen",
        "block_size": 4,
        "token_ids": [1, 2, 3, 4],
        "tenant_id": "t1",
    }


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_query_lora_name_sent_only_when_set(encoding):
    client, rec = make(negotiated_reply(ANSWER), query_encoding=encoding)
    client.query("qwen", [1, 2, 3, 4], 4, lora_name="sql-adapter")
    assert decode_body(rec.last) == {
        "model": "qwen",
        "block_size": 4,
        "token_ids": [1, 2, 3, 4],
        "tenant_id": "default",
        "lora_name": "sql-adapter",
    }
    for base in (None, ""):
        client.query("qwen", [1, 2, 3, 4], 4, lora_name=base)
        assert "lora_name" not in decode_body(rec.last)

    async def main():
        arec = Recorder(negotiated_reply(ANSWER))
        async with AsyncConductorClient(
            BASE, transport=httpx.MockTransport(arec), query_encoding=encoding
        ) as c:
            await c.query("qwen", [5], 4, lora_name="a")
        assert decode_body(arec.last)["lora_name"] == "a"

    run_coro(main())


@pytest.mark.parametrize("enc", ["JSON", " json "])
def test_encoding_case_insensitive(enc):
    assert ConductorClient(BASE, query_encoding=enc).query_encoding == "json"


@pytest.mark.parametrize("enc", ["xml", "", None])
def test_unknown_encoding_warns_and_uses_msgpack(enc, caplog):
    with caplog.at_level(logging.WARNING, logger="kvconductor.client"):
        client, rec = make(negotiated_reply(ANSWER), query_encoding=enc)
    assert client.query_encoding == "msgpack"
    assert "using msgpack" in caplog.text
    client.query("m", [1], 4)
    assert rec.last.headers["content-type"] == "application/msgpack"


@pytest.mark.parametrize(
    "ct",
    [
        "application/msgpack",
        "application/msgpack; charset=binary",
        "application/x-msgpack",
        "Application/MsgPack",
    ],
)
def test_response_decoded_as_msgpack_by_content_type(ct):
    client, _ = make(msgpack_reply(ANSWER, ct=ct), query_encoding="json")
    assert client.query("m", [1, 2, 3, 4], 4) == ANSWER


def test_json_answer_to_msgpack_request():
    # A JSON-only server answers JSON whatever the request encoding.
    client, _ = make(json_reply(ANSWER))
    assert client.query("m", [1, 2, 3, 4], 4) == ANSWER


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_query_extra_keys_sent_only_when_set(encoding):
    """``cache_salt`` and ``mm_inputs`` (docs/api.md, "Extra keys"): mappings or triples,
    sent as the server reads them; absent, None or empty: the plain body."""
    client, rec = make(negotiated_reply(ANSWER), query_encoding=encoding)
    plain = {"model": "qwen", "block_size": 4, "token_ids": [1, 2, 3, 4], "tenant_id": "default"}
    mm = [("img", 2, 8), {"identifier": "vid", "offset": 12, "length": 3}]
    client.query("qwen", [1, 2, 3, 4], 4, cache_salt="s", mm_inputs=mm)
    inputs = [{"identifier": "img", "offset": 2, "length": 8}, mm[1]]
    assert decode_body(rec.last) == {**plain, "cache_salt": "s", "mm_inputs": inputs}
    for salt, inputs in ((None, None), ("", []), (None, ())):
        client.query("qwen", [1, 2, 3, 4], 4, cache_salt=salt, mm_inputs=inputs)
        assert decode_body(rec.last) == plain


def test_query_by_hash_body():
    client, rec = make(negotiated_reply({"default": {}}))
    assert client.query_by_hash("qwen", [14643705804678351452, 7]) == {"default": {}}
    assert rec.last.url.path == "/query_by_hash"
    assert decode_body(rec.last) == {
        "model": "qwen",
        "block_size": 1,
        "block_hashes": [14643705804678351452, 7],
        "tenant_id": "default",
    }
    client.query_by_hash("qwen", array.array("Q", [5, 6]), tenant_id="t")
    assert decode_body(rec.last)["block_hashes"] == [5, 6]


def test_query_by_hash_never_packed():
    # the server has no packed form for hashes: an array even on a packed client
    client, rec = make(negotiated_reply({"default": {}}), packed=True)
    client.query_by_hash("qwen", array.array("Q", [14643705804678351452, 7]))
    assert msgspec.msgpack.decode(rec.last.content)["block_hashes"] == [14643705804678351452, 7]


def test_api_key_header():
    client, rec = make(json_reply({"status": "ok"}), api_key="s3cret")
    client.unregister(instance_id="i", dp_rank=0)
    assert rec.last.headers["authorization"] == "Bearer s3cret"
    client.query("m", [1], 4)
    assert rec.last.headers["authorization"] == "Bearer s3cret"
    client, rec = make(json_reply({"status": "ok"}))
    client.query("m", [1], 4)
    assert "authorization" not in rec.last.headers


# ---------------------------------------------------------------------------
# Packed token bodies


def _packed_body(tokens):
    client, rec = make(negotiated_reply(ANSWER), packed=True)
    client.query("m", tokens, 4)
    body = msgspec.msgpack.decode(rec.last.content)
    assert isinstance(body["token_ids"], bytes)  # a msgpack bin, not an array
    return body["token_ids"]


VALS = [1, 2, 3, 4, 5, 6, 7, 8, 0, 4294967295]


@pytest.mark.parametrize(
    "make_tokens",
    [
        lambda: list(VALS),
        lambda: tuple(VALS),
        lambda: array.array("I", VALS),
        lambda: array.array("q", VALS),
        lambda: memoryview(array.array("I", VALS)),
        lambda: memoryview(struct.pack(f"<{len(VALS)}I", *VALS)),
        lambda: struct.pack(f"<{len(VALS)}I", *VALS),
        lambda: (v for v in VALS),
    ],
    ids=[
        "list",
        "tuple",
        "array-I",
        "array-q",
        "memoryview-I",
        "memoryview-bytes",
        "bytes",
        "generator",
    ],
)
def test_packed_tokens_exact_bytes(make_tokens):
    assert _packed_body(make_tokens()) == struct.pack(f"<{len(VALS)}I", *VALS)


def test_packed_truncates_to_u32():
    # -1 -> 0xFFFFFFFF, 2**32 + 5 -> 5, 2**40 + 7 -> 7
    assert _packed_body([-1, 2**32 + 5, 2**40 + 7, 9]) == struct.pack("<4I", 0xFFFFFFFF, 5, 7, 9)


def test_packed_numpy_arrays():
    np = pytest.importorskip("numpy")
    expected = struct.pack("<4I", 1, 2, 0xFFFFFFFF, 5)
    assert _packed_body(np.array([1, 2, 0xFFFFFFFF, 5], dtype=np.uint32)) == expected
    assert _packed_body(np.array([1, 2, -1, 2**32 + 5], dtype=np.int64)) == expected
    assert _packed_body(np.array([1, 2, -1, 5], dtype=np.int32)) == expected
    with pytest.raises(TypeError, match="1-D integer"):
        pack_tokens(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="1-D integer"):
        pack_tokens(np.zeros(3, dtype=np.float32))
    # unpacked path: numpy arrays become lists of Python ints
    assert token_list(np.array([3, 4], dtype=np.int64)) == [3, 4]


def test_packed_per_call_override():
    client, rec = make(negotiated_reply(ANSWER))
    client.query("m", [1, 2], 4, packed=True)
    assert msgspec.msgpack.decode(rec.last.content)["token_ids"] == struct.pack("<2I", 1, 2)
    client.query("m", [1, 2], 4)
    assert msgspec.msgpack.decode(rec.last.content)["token_ids"] == [1, 2]


def test_packed_requires_msgpack():
    with pytest.raises(ValueError, match="msgpack"):
        ConductorClient(BASE, query_encoding="json", packed=True)
    client, _ = make(negotiated_reply(ANSWER), query_encoding="json")
    with pytest.raises(ValueError, match="msgpack"):
        client.query("m", [1], 4, packed=True)


def test_packed_bad_buffer_length():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_tokens(b"\x01\x02\x03")


def test_token_list_conversions():
    assert token_list([1, 2]) == [1, 2]
    assert token_list(array.array("I", [1, 2])) == [1, 2]
    assert token_list(memoryview(array.array("I", [7, 8]))) == [7, 8]
    assert token_list(struct.pack("<2I", 7, 0xFFFFFFFF)) == [7, 0xFFFFFFFF]
    assert token_list(range(3)) == [0, 1, 2]


def test_packed_and_plain_bodies_carry_the_same_tokens():
    tokens = [5, -1, 2**33 + 1]
    plain = token_list(tokens)
    packed = pack_tokens(tokens)
    assert [t & 0xFFFFFFFF for t in plain] == list(struct.unpack("<3I", packed))


# ---------------------------------------------------------------------------
# Timeouts


def _timeouts(req):
    return req.extensions["timeout"]


def test_timeouts_default():
    client, rec = make(
        lambda req: httpx.Response(
            201 if req.url.path == "/register" else 200, json={"status": "ok"}
        )
    )
    client.query("m", [1], 4)
    assert _timeouts(rec.last) == {"connect": 3.0, "read": 3.0, "write": 3.0, "pool": 3.0}
    client.query_by_hash("m", [1])
    assert _timeouts(rec.last)["read"] == 3.0
    client.register(instance_id="i", type="vLLM", modelname="m", block_size=4, dp_rank=0)
    assert _timeouts(rec.last) == {"connect": 15.0, "read": 15.0, "write": 15.0, "pool": 15.0}
    client.unregister(instance_id="i", dp_rank=0)
    assert _timeouts(rec.last)["read"] == 15.0


def test_timeouts_configurable():
    client, rec = make(
        json_reply({"status": "ok"}),
        query_timeout=0.25,
        register_timeout=2,
        workers_timeout=4,
        health_timeout=0.5,
    )
    client.query("m", [1], 4)
    assert _timeouts(rec.last)["read"] == 0.25
    client.unregister(instance_id="i", dp_rank=0)
    assert _timeouts(rec.last)["read"] == 2.0
    client.workers()
    assert _timeouts(rec.last)["read"] == 4.0
    client.health()
    assert _timeouts(rec.last)["read"] == 0.5
    with pytest.raises(ValueError, match="query_timeout"):
        ConductorClient(BASE, query_timeout=0)


def test_timeout_error_message():
    def slow(req):
        raise httpx.ReadTimeout("timed out", request=req)

    client, _ = make(slow)
    with pytest.raises(ConductorError) as ei:
        client.query("m", [1], 4)
    err = ei.value
    assert err.status_code is None and err.route == "POST /query"
    assert "POST /query timed out after 3 s" in str(err)
    assert BASE in str(err)


# ---------------------------------------------------------------------------
# Errors


def test_error_404_msgpack_body():
    client, _ = make(msgpack_reply({"error": "no indexer for model=m tenant=default"}, status=404))
    with pytest.raises(ConductorError) as ei:
        client.query("m", [1, 2, 3, 4], 4)
    err = ei.value
    assert (err.status_code, err.route) == (404, "POST /query")
    assert err.server_error == "no indexer for model=m tenant=default"
    assert str(err).startswith("POST /query -> HTTP 404: no indexer for model=m tenant=default")


def test_error_plain_text_body():
    client, _ = make(
        lambda req: httpx.Response(
            415, text="Expected request with `Content-Type: application/json`"
        )
    )
    with pytest.raises(ConductorError) as ei:
        client.register(instance_id="i", type="vLLM", modelname="m", block_size=4, dp_rank=0)
    assert ei.value.status_code == 415
    assert ei.value.route == "POST /register"
    assert "Content-Type: application/json" in ei.value.server_error


def test_error_500_json_body_and_events_partial():
    msg = (
        "internal error: endpoint is empty; either medium_endpoints or a valid endpoint is required"
    )
    client, _ = make(json_reply({"error": msg}, status=500))
    with pytest.raises(ConductorError, match="HTTP 500: internal error: endpoint is empty"):
        client.register(
            instance_id="i", type="vLLM", modelname="m", block_size=4, dp_rank=0, endpoint=""
        )
    client, _ = make(
        json_reply(
            {
                "status": "partial",
                "events_applied": 0,
                "errors": ["dp_rank=0: parent block not found"],
            },
            status=500,
        )
    )
    with pytest.raises(ConductorError, match="parent block not found"):
        client.post_events({"instance_id": "i", "events": []})


def test_connection_error_message():
    client, _ = make(refuse)
    with pytest.raises(ConductorError) as ei:
        client.workers()
    assert "GET /workers failed: ConnectError" in str(ei.value)
    assert "Connection refused" in str(ei.value)


def test_undecodable_body():
    client, _ = make(
        lambda req: httpx.Response(
            200, content=b"\xc1garbage", headers={"content-type": "application/msgpack"}
        )
    )
    with pytest.raises(ConductorError, match="undecodable body"):
        client.query("m", [1], 4)


def test_unexpected_shape():
    client, _ = make(json_reply([1, 2]))
    with pytest.raises(ConductorError, match="expected an object"):
        client.query("m", [1], 4)


def test_query_or_empty():
    client, _ = make(msgpack_reply({"error": "no indexer for model=m tenant=default"}, status=404))
    assert client.query_or_empty("m", [1], 4) == {}
    client, _ = make(refuse)
    assert client.query_or_empty("m", [1], 4) == {}
    client, _ = make(negotiated_reply(ANSWER))
    assert client.query_or_empty("m", [1], 4) == ANSWER


# ---------------------------------------------------------------------------
# Circuit breaker


def test_breaker_transitions_with_fake_clock():
    clock = FakeClock()
    state = {"fail": True}

    def reply(req):
        if state["fail"]:
            refuse(req)
        return negotiated_reply(ANSWER)(req)

    client, rec = make(reply, clock=clock)
    br = client.breaker
    for _i in range(3):
        assert br.state == "closed"
        with pytest.raises(ConductorError) as ei:
            client.query("m", [1], 4)
        assert not isinstance(ei.value, CircuitOpenError)
    assert br.state == "open" and br.failures == 3 and len(rec.requests) == 3

    # open: fails fast without a request, with a clear message
    with pytest.raises(CircuitOpenError) as ei:
        client.query("m", [1], 4)
    assert "circuit open after 3 consecutive failures" in str(ei.value)
    assert "next try in 30.0 s" in str(ei.value)
    assert client.query_or_empty("m", [1], 4) == {}
    with pytest.raises(CircuitOpenError):
        client.register(instance_id="i", type="vLLM", modelname="m", block_size=4, dp_rank=0)
    assert len(rec.requests) == 3

    clock.advance(29.9)
    assert br.retry_in() == pytest.approx(0.1)
    with pytest.raises(CircuitOpenError):
        client.query("m", [1], 4)
    assert len(rec.requests) == 3

    # cooldown over: one half-open try, which fails -> open again for 30 s
    clock.advance(0.1)
    with pytest.raises(ConductorError) as ei:
        client.query("m", [1], 4)
    assert not isinstance(ei.value, CircuitOpenError)
    assert len(rec.requests) == 4 and br.state == "open"
    clock.advance(10)
    with pytest.raises(CircuitOpenError):
        client.query("m", [1], 4)

    # next half-open try succeeds -> closed, count reset
    clock.advance(20)
    state["fail"] = False
    assert client.query("m", [1], 4) == ANSWER
    assert br.state == "closed" and br.failures == 0
    assert client.query("m", [1], 4) == ANSWER


def test_breaker_success_resets_count():
    clock = FakeClock()
    outcomes = iter(["fail", "fail", "ok", "fail", "fail", "ok"])

    def reply(req):
        if next(outcomes) == "fail":
            refuse(req)
        return negotiated_reply(ANSWER)(req)

    client, _ = make(reply, clock=clock)
    for _ in range(6):
        client.query_or_empty("m", [1], 4)
    assert client.breaker.state == "closed" and client.breaker.failures == 0


def test_breaker_counts_5xx_not_4xx():
    statuses = iter([500, 503, 404, 500, 500, 500])
    client, _ = make(
        lambda req: httpx.Response(next(statuses), json={"error": "x"}), clock=FakeClock()
    )
    for _ in range(5):
        client.query_or_empty("m", [1], 4)
    # 500, 503 -> 2 failures; 404 resets; 500, 500 -> 2 failures: still closed
    assert client.breaker.state == "closed" and client.breaker.failures == 2
    client.query_or_empty("m", [1], 4)
    assert client.breaker.state == "open"


def test_breaker_half_open_admits_one_probe():
    clock = FakeClock()
    br = CircuitBreaker(threshold=2, cooldown=5, clock=clock)
    br.record_failure()
    assert br.allow() and br.state == "closed"
    br.record_failure()
    assert br.state == "open" and not br.allow()
    clock.advance(5)
    assert br.allow() and br.state == "half_open"
    assert not br.allow()  # a second caller while the probe is out
    br.release()  # probe abandoned (e.g. cancelled)
    assert br.allow()
    br.record_success()
    assert br.state == "closed" and br.allow()


def test_breaker_validation():
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown=-1)


def test_health_bypasses_breaker():
    clock = FakeClock()
    client, _ = make(refuse, clock=clock)
    for _ in range(3):
        client.query_or_empty("m", [1], 4)
    assert client.breaker.state == "open"
    assert client.health() is False
    client2, rec = make(lambda req: httpx.Response(200, text="OK"), breaker=client.breaker)
    assert client2.health() is True and rec.last.url.path == "/health"
    assert client.breaker.state == "open"


# ---------------------------------------------------------------------------
# Register / unregister / workers


def test_register_payload_and_kwargs():
    client, rec = make(lambda req: httpx.Response(201, json={"status": "ok"}))
    payload = {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 128,
        "dp_rank": 0,
        "medium_endpoints": {"npu": "tcp://10.0.0.1:5557"},
    }
    assert client.register(payload, dp_rank=1) == {"status": "ok"}
    assert json.loads(rec.last.content) == {**payload, "dp_rank": 1}
    assert rec.last.headers["content-type"] == "application/json"
    assert payload["dp_rank"] == 0


def test_register_missing_fields():
    client, rec = make(json_reply({}))
    with pytest.raises(ValueError, match="modelname, block_size"):
        client.register(instance_id="i", type="vLLM", dp_rank=0)
    assert rec.requests == []


def test_unregister_fills_required_placeholders():
    client, rec = make(json_reply({"status": "ok"}))
    client.unregister(instance_id="vllm-prefill-1", dp_rank=2)
    assert json.loads(rec.last.content) == {
        "instance_id": "vllm-prefill-1",
        "dp_rank": 2,
        "type": "vLLM",
        "modelname": "",
        "block_size": 0,
    }
    with pytest.raises(ValueError, match="dp_rank"):
        client.unregister(instance_id="x")


def test_unregister_unknown_is_404_error():
    client, _ = make(json_reply({"error": "instance nope not found"}, status=404))
    with pytest.raises(ConductorError) as ei:
        client.unregister(instance_id="nope", dp_rank=0)
    assert ei.value.status_code == 404 and ei.value.server_error == "instance nope not found"


WORKERS = {
    "workers": [
        {
            "instance_id": "vllm-prefill-1",
            "model_name": "qwen",
            "tenant_id": "default",
            "block_size": 128,
            "endpoints": {
                "0": {
                    "medium_endpoints": {"npu": "tcp://10.0.0.1:5557"},
                    "engine_type": "vLLM",
                    "dp_rank": 0,
                    "replay_endpoint": None,
                }
            },
        }
    ],
    "indexer": [],
}


def test_reregister_missing():
    def reply(req):
        if req.url.path == "/workers":
            return httpx.Response(200, json=WORKERS)
        return httpx.Response(201, json={"status": "ok"})

    client, rec = make(reply)
    p0 = {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 128,
        "dp_rank": 0,
    }
    p1 = {**p0, "dp_rank": 1}
    p2 = {**p0, "instance_id": "vllm-union-2", "dp_rank": 0}
    result = client.reregister_missing([p0, p1, p2])
    assert result.present == [p0]
    assert result.registered == [p1, p2] and result.failed == []
    assert [(r.method, r.url.path) for r in rec.requests] == [
        ("GET", "/workers"),
        ("POST", "/register"),
        ("POST", "/register"),
    ]
    assert [json.loads(r.content) for r in rec.requests[1:]] == [p1, p2]


def test_reregister_falls_back_to_services_and_collects_failures():
    def reply(req):
        if req.url.path == "/workers":
            return httpx.Response(200, json={"workers": [], "indexer": []})
        if req.url.path == "/services":
            return httpx.Response(
                200, json={"services": [{"InstanceID": "vllm-prefill-1", "DPRank": 0}]}
            )
        return httpx.Response(500, json={"error": "boom"})

    client, rec = make(reply)
    p0 = {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "modelname": "q",
        "block_size": 4,
        "dp_rank": 0,
    }
    p1 = {**p0, "dp_rank": 1}
    result = client.reregister_missing([p0, p1, {}])
    assert result.present == [p0] and result.registered == []
    assert [p for p, _ in result.failed] == [p1]
    assert result.failed[0][1].status_code == 500
    assert [r.url.path for r in rec.requests] == ["/workers", "/services", "/register"]


def test_registered_services_both_failing_is_empty():
    client, _ = make(lambda req: httpx.Response(404, text="Not Found"))
    assert client.registered_services() == []


# ---------------------------------------------------------------------------
# Async client


def test_async_client_query_and_breaker():
    async def main():
        clock = FakeClock()
        rec = Recorder(negotiated_reply(ANSWER))
        async with AsyncConductorClient(
            BASE, transport=httpx.MockTransport(rec), clock=clock, packed=True
        ) as c:
            assert await c.query("m", [1, 2, 3, 4], 4) == ANSWER
            assert msgspec.msgpack.decode(rec.last.content)["token_ids"] == struct.pack(
                "<4I", 1, 2, 3, 4
            )
            assert rec.last.extensions["timeout"]["read"] == 3.0
            assert await c.query_by_hash("m", [1]) == ANSWER
        bad = Recorder(refuse)
        async with AsyncConductorClient(BASE, transport=httpx.MockTransport(bad), clock=clock) as c:
            for _ in range(3):
                assert await c.query_or_empty("m", [1], 4) == {}
            with pytest.raises(CircuitOpenError):
                await c.query("m", [1], 4)
            assert len(bad.requests) == 3
            assert await c.health() is False

    run_coro(main())


def test_async_reregister_and_errors():
    async def main():
        def reply(req):
            if req.url.path == "/workers":
                return httpx.Response(200, json=WORKERS)
            if req.url.path == "/unregister":
                return httpx.Response(404, json={"error": "instance x not found"})
            return httpx.Response(201, json={"status": "ok"})

        rec = Recorder(reply)
        async with AsyncConductorClient(BASE, transport=httpx.MockTransport(rec)) as c:
            p = {
                "instance_id": "vllm-prefill-9",
                "type": "vLLM",
                "modelname": "q",
                "block_size": 4,
                "dp_rank": 0,
            }
            result = await c.reregister_missing([p])
            assert result.registered == [p]
            with pytest.raises(ConductorError, match="HTTP 404: instance x not found"):
                await c.unregister(instance_id="x", dp_rank=0)
            assert (await c.workers()) == WORKERS

    run_coro(main())


# ---------------------------------------------------------------------------
# Registration helpers (docs/client.md, "Registration helpers"; the reference client's helper tests)


@pytest.mark.parametrize(
    "pattern,host,dp,expected",
    [
        ("tcp://*:5557", "10.0.0.1", 0, "tcp://10.0.0.1:5557"),
        ("tcp://*:6667", "10.0.0.1", 1, "tcp://10.0.0.1:6668"),
        ("tcp://*:5557", "10.0.0.3", 5, "tcp://10.0.0.3:5562"),
        ("tcp://*:5557", "2001:db8::1", 0, "tcp://[2001:db8::1]:5557"),
        ("tcp://*:5557", "[2001:db8::1]", 2, "tcp://[2001:db8::1]:5559"),
        ("tcp://*:5557", "node-a.svc", 1, "tcp://node-a.svc:5558"),
        ("tcp://10.0.0.1:5557", "10.0.0.1", 0, None),  # no "*:" -> one part
        ("tcp://*:*:5557", "10.0.0.1", 0, None),  # three parts
        ("tcp://*:abc", "10.0.0.1", 0, None),  # port not an integer
        ("", "10.0.0.1", 0, None),
        (None, "10.0.0.1", 0, None),
    ],
)
def test_resolve_endpoint(pattern, host, dp, expected):
    assert resolve_endpoint(pattern, host, dp) == expected


@pytest.mark.parametrize(
    "role,iid,expected",
    [
        ("U", 7, "vllm-union-7"),
        ("P", 3, "vllm-prefill-3"),
        ("E", 5, "vllm-prefill-5"),
        ("D", 9, "vllm-decode-9"),
        ("p", 1, "vllm-prefill-1"),
        ("ROLE_U", 2, "vllm-union-2"),
        ("decode", 4, "vllm-decode-4"),
    ],
)
def test_instance_name(role, iid, expected):
    assert instance_name(role, iid) == expected


def test_instance_name_enum_and_unknown():
    import enum

    class Role(enum.Enum):
        ROLE_P = "P"
        ROLE_X = "X"

    assert instance_name(Role.ROLE_P, 8) == "vllm-prefill-8"
    with pytest.raises(ValueError, match="no conductor instance naming"):
        instance_name(Role.ROLE_X, 8)


def test_strip_decode_instances():
    tenant = {"vllm-prefill-1": {"a": 1}, "vllm-decode-2": {"b": 2}, "vllm-union-3": {"c": 3}}
    assert strip_decode_instances(tenant) == {"vllm-prefill-1": {"a": 1}, "vllm-union-3": {"c": 3}}
    assert "vllm-decode-2" in tenant


def test_format_host_and_base_url():
    assert format_host("10.0.0.1") == "10.0.0.1"
    assert format_host("::1") == "[::1]"
    assert format_host("[::1]") == "[::1]"
    assert conductor_base_url("kv-conductor") == "http://kv-conductor:13333"
    assert conductor_base_url("2001:db8::1", 1234) == "http://[2001:db8::1]:1234"
    assert conductor_base_url("https://x:1/") == "https://x:1"
    assert ConductorClient("[::1]:13333").base_url == "http://[::1]:13333"


def test_from_config():
    assert ConductorClient.from_config({"conductor_service": ""}) is None
    c = ConductorClient.from_config(
        {"conductor_service": "::1", "http_server_port": 15555, "query_encoding": "json"}
    )
    assert c.base_url == "http://[::1]:15555" and c.query_encoding == "json"
    assert AsyncConductorClient.from_config(KvConductorConfig()) is None


@pytest.mark.parametrize(
    "raw,canon,resolved,mode",
    [
        ("Mooncake", "Mooncake", "Mooncake", "pool"),
        ("MOONCAKE", "Mooncake", "Mooncake", "pool"),
        ("memcache", "Memcache", "Memcache", "pool"),
        ("yuanrong", "YuanRong", "YuanRong", "per_dp"),
        ("", "", "Mooncake", "per_dp"),
        (None, "", "Mooncake", "per_dp"),
        (" Redis ", "Redis", "Redis", "per_dp"),
    ],
)
def test_backend_canonicalisation(raw, canon, resolved, mode):
    assert canonical_store_backend(raw) == canon
    assert resolve_store_backend(raw) == resolved
    assert backend_mode(raw) == mode


def test_unknown_backend_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="kvconductor.client"):
        assert backend_mode("Redis") == "per_dp"
    assert "unknown store_backend" in caplog.text


def test_medium_endpoints():
    # no pattern at all -> {}
    assert build_medium_endpoints({}, "10.0.0.1", 0) == {}
    assert build_medium_endpoints({"store_backend": "YuanRong"}, "10.0.0.1", 0) == {}
    # pool mode: npu only, npu > xpu > endpoint
    assert build_medium_endpoints(
        {
            "store_backend": "Mooncake",
            "npu_endpoint": "tcp://*:5557",
            "cpu_endpoint": "tcp://*:7000",
        },
        "10.0.0.1",
        1,
    ) == {"npu": "tcp://10.0.0.1:5558"}
    assert build_medium_endpoints(
        {"xpu_endpoint": "tcp://*:5600", "endpoint": "tcp://*:5557"}, "10.0.0.1", 0
    ) == {"npu": "tcp://10.0.0.1:5600"}
    assert build_medium_endpoints({"endpoint": "tcp://*:5557"}, "10.0.0.1", 0) == {
        "npu": "tcp://10.0.0.1:5557"
    }
    # per-DP (YuanRong): each medium falls back to endpoint
    assert build_medium_endpoints(
        {
            "store_backend": "YuanRong",
            "npu_endpoint": "tcp://*:5557",
            "cpu_endpoint": "tcp://*:7000",
            "disk_endpoint": "tcp://*:7000",
        },
        "10.0.0.2",
        2,
    ) == {"npu": "tcp://10.0.0.2:5559", "cpu": "tcp://10.0.0.2:7002", "disk": "tcp://10.0.0.2:7002"}
    assert build_medium_endpoints(
        {"store_backend": "yuanrong", "endpoint": "tcp://*:5557", "cpu_endpoint": "tcp://*:7000"},
        "10.0.0.2",
        0,
    ) == {"npu": "tcp://10.0.0.2:5557", "cpu": "tcp://10.0.0.2:7000", "disk": "tcp://10.0.0.2:5557"}
    assert build_medium_endpoints(
        {"store_backend": "YuanRong", "cpu_endpoint": "tcp://*:7000"}, "10.0.0.2", 0
    ) == {"cpu": "tcp://10.0.0.2:7000"}


def test_dp_registration_pool_mode():
    cfg = {
        "store_backend": "mooncake",
        "npu_endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:6667",
        "block_size": 128,
        "engine_type": "vLLM",
    }
    assert build_dp_registration(cfg, "vllm-prefill-1", "qwen", 1, "10.0.0.1") == {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "store_backend": "Mooncake",
        "modelname": "qwen",
        "block_size": 128,
        "dp_rank": 1,
        "medium_endpoints": {"npu": "tcp://10.0.0.1:5558"},
        "replay_endpoint": "tcp://10.0.0.1:6668",
    }


def test_dp_registration_http_only_and_malformed_replay():
    cfg = KvConductorConfig(store_backend="Memcache", replay_endpoint="tcp://10.0.0.1:6667")
    assert build_dp_registration(cfg, "vllm-union-2", "qwen", 0, "10.0.0.1", tenant_id="t") == {
        "instance_id": "vllm-union-2",
        "type": "vLLM",
        "store_backend": "Memcache",
        "modelname": "qwen",
        "block_size": 128,
        "dp_rank": 0,
        "tenant_id": "t",
    }


def test_dp_registration_yuanrong_ipv6():
    cfg = {"store_backend": "YuanRong", "endpoint": "tcp://*:5557", "disk_endpoint": "tcp://*:9000"}
    assert build_dp_registration(cfg, "vllm-prefill-4", "m", 0, "2001:db8::1")[
        "medium_endpoints"
    ] == {
        "npu": "tcp://[2001:db8::1]:5557",
        "cpu": "tcp://[2001:db8::1]:5557",
        "disk": "tcp://[2001:db8::1]:9000",
    }


def test_node_pool_registration_newest_coordinator_shape():
    """YuanRong as the newest Coordinator registers it: NPU per DP, CPU/Disk once per node
    and model (no DP port offset), the model in the pool's id."""
    cfg = {
        "store_backend": "yuanrong",
        "npu_endpoint": "tcp://*:15557",
        "cpu_endpoint": "tcp://*:15558",
        "disk_endpoint": "tcp://*:15558",
        "replay_endpoint": "tcp://*:6667",
    }
    assert build_dp_registration(cfg, "vllm-prefill-1", "qwen", 2, "10.0.0.1", node_pool=True) == {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "store_backend": "YuanRong",
        "modelname": "qwen",
        "block_size": 128,
        "dp_rank": 2,
        "medium_endpoints": {"npu": "tcp://10.0.0.1:15559"},
        "replay_endpoint": "tcp://10.0.0.1:6669",
    }
    assert build_node_pool_registration(cfg, "qwen", "10.0.0.1") == {
        "instance_id": "yuanrong-pool-10.0.0.1-qwen",
        "type": "vLLM",
        "store_backend": "YuanRong",
        "modelname": "qwen",
        "block_size": 128,
        "dp_rank": 0,
        "medium_endpoints": {"cpu": "tcp://10.0.0.1:15558", "disk": "tcp://10.0.0.1:15558"},
    }
    assert node_pool_instance_id("YuanRong", "fd00::5", "m") == "yuanrong-pool-fd00::5-m"
    p = build_node_pool_registration(
        {"store_backend": "YuanRong", "endpoint": "tcp://*:5557"}, "m", "fd00::5", tenant_id="t"
    )
    assert p["medium_endpoints"] == {"cpu": "tcp://[fd00::5]:5557", "disk": "tcp://[fd00::5]:5557"}
    assert p["tenant_id"] == "t"
    # only CPU/Disk patterns count; cluster-pool backends have no node pool
    assert (
        build_node_pool_registration(
            {"store_backend": "YuanRong", "npu_endpoint": "tcp://*:1"}, "m", "h"
        )
        is None
    )
    assert (
        build_node_pool_registration(
            {"store_backend": "Mooncake", "cpu_endpoint": "tcp://*:1"}, "m", "h"
        )
        is None
    )


def test_pool_registration():
    cfg = {
        "store_backend": "Mooncake",
        "pool_endpoint": "tcp://master:50051",
        "block_size": 64,
        "model_path": "/models/qwen",
    }
    assert build_pool_registration(cfg) == {
        "instance_id": "mooncake-pool",
        "endpoint": "tcp://master:50051",
        "type": "vLLM",
        "store_backend": "Mooncake",
        "modelname": "/models/qwen",
        "block_size": 64,
        "dp_rank": 0,
    }
    # no model_path -> "default"; Memcache name; empty backend means Mooncake
    p = build_pool_registration({"store_backend": "memcache", "pool_endpoint": "tcp://m:1"})
    assert (p["instance_id"], p["modelname"], p["store_backend"]) == (
        "memcache-pool",
        "default",
        "Memcache",
    )
    assert build_pool_registration({"pool_endpoint": "tcp://m:1"})["instance_id"] == "mooncake-pool"
    # not a pool backend / no endpoint -> None
    assert (
        build_pool_registration({"store_backend": "YuanRong", "pool_endpoint": "tcp://m:1"}) is None
    )
    assert build_pool_registration({"store_backend": "Mooncake"}) is None


def test_pool_registration_master_service_env(caplog):
    cfg = {"store_backend": "Mooncake", "pool_endpoint": "tcp://*:50051"}
    assert (
        build_pool_registration(cfg, env={"KVS_MASTER_SERVICE": "mc-master"})["endpoint"]
        == "tcp://mc-master:50051"
    )
    assert (
        build_pool_registration(cfg, env={"KVS_MASTER_SERVICE": "fd00::5"})["endpoint"]
        == "tcp://[fd00::5]:50051"
    )
    with caplog.at_level(logging.WARNING, logger="kvconductor.client"):
        assert build_pool_registration(cfg, env={}) is None
    assert "KVS_MASTER_SERVICE" in caplog.text


def test_unregister_payload():
    assert build_unregister_payload({"block_size": 16}, "vllm-prefill-1", "qwen", 3) == {
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 16,
        "instance_id": "vllm-prefill-1",
        "dp_rank": 3,
    }


def test_config_coerce_from_object():
    class Obj:
        conductor_service = "svc"
        block_size = 512
        replay_endpoint = None

    cfg = KvConductorConfig.coerce(Obj())
    assert (cfg.conductor_service, cfg.block_size, cfg.replay_endpoint) == ("svc", 512, "")


@pytest.mark.parametrize(
    "entry,expected",
    [
        (WORKERS["workers"][0], {("vllm-prefill-1", 0)}),
        ({"instance_id": "a", "endpoints": {"0": {}, "3": {}, "x": {}}}, {("a", 0), ("a", 3)}),
        ({"InstanceID": "b", "DPRank": 2}, {("b", 2)}),
        ({"InstanceID": "b", "DPRank": "4"}, {("b", 4)}),
        ({"InstanceID": "b"}, {("b", -1)}),
        ({"InstanceID": "b", "DPRank": "?"}, {("b", -1)}),
        ({"instance_id": "a", "endpoints": {}}, set()),
        ({}, set()),
        ("junk", set()),
    ],
)
def test_normalize_service_key(entry, expected):
    assert normalize_service_key(entry) == expected


def test_missing_registrations():
    local = [
        {"instance_id": "vllm-prefill-1", "dp_rank": 0},
        {"instance_id": "vllm-prefill-1", "dp_rank": 1},
    ]
    assert missing_registrations(WORKERS, local) == [local[1]]
    assert missing_registrations(
        {"services": [{"InstanceID": "vllm-prefill-1", "DPRank": 1}]}, local
    ) == [local[0]]
    assert missing_registrations(WORKERS["workers"], [("vllm-prefill-1", 0), ("x", 0)]) == [
        ("x", 0)
    ]
    assert missing_registrations({}, local) == local
    assert missing_registrations([], []) == []


# ---------------------------------------------------------------------------
# Live tests against the real service


REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 20.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = b""

    def start(self, *extra: str) -> bool:
        env = dict(os.environ)
        env.pop("KV_CONDUCTOR_API_KEY", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvconductor",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-snapshots",
                *extra,
            ],
            cwd=str(REPO),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        with httpx.Client(trust_env=False) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if http.get(self.url + "/health", timeout=0.5).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stderr is not None:
            self.log = self.proc.stderr.read() or b""
            self.proc.stderr.close()
        self.proc = None

    def why(self) -> str:
        tail = self.log.decode(errors="replace").strip().splitlines()[-3:]
        return (
            f"`python -m kvconductor --port {self.port}` did not become healthy within "
            f"{STARTUP_TIMEOUT:g} s (the service may not be built yet)"
            + (f": {' | '.join(tail)}" if tail else "")
        )


@pytest.fixture(scope="module")
def server():
    srv = Server()
    if not srv.start():
        pytest.skip(srv.why())
    yield srv
    srv.stop()


def _register_http_only(client: ConductorClient, iid: str, model: str, dp_rank: int) -> None:
    assert client.register(
        instance_id=iid,
        type="vLLM",
        modelname=model,
        block_size=4,
        dp_rank=dp_rank,
        store_backend="YuanRong",
    ) == {"status": "ok"}


def _store(
    client: ConductorClient, iid: str, dp_rank: int, hashes, tokens, medium: str, parent=None
) -> None:
    batch = {
        "instance_id": iid,
        "events": [
            {
                "event_id": 1,
                "dp_rank": dp_rank,
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": 4,
                "medium": medium,
            }
        ],
    }
    assert client.post_events(batch) == {"status": "ok", "events_applied": 1}


@pytest.fixture(scope="module")
def loaded(server):
    """A fresh model with three instances:

    * vllm-prefill-1 DP 0: tokens 1..8 in HBM (engine hashes 100, 200)      -> 2 NPU blocks
    * vllm-prefill-2 DP 1: tokens 1..12 in CPU, root chain (500, 600, 700)  -> 3 CPU blocks
    * vllm-prefill-3 DP 0: tokens 1..4 on Disk (900)                        -> 1 Disk block
    """
    model = f"live-{uuid.uuid4().hex[:8]}"
    with ConductorClient(server.url) as c:
        _register_http_only(c, "vllm-prefill-1", model, 0)
        _register_http_only(c, "vllm-prefill-2", model, 1)
        _register_http_only(c, "vllm-prefill-3", model, 0)
        _store(c, "vllm-prefill-1", 0, [100, 200], list(range(1, 9)), "GPU")
        _store(c, "vllm-prefill-2", 1, [500, 600, 700], list(range(1, 13)), "CPU")
        _store(c, "vllm-prefill-3", 0, [900], [1, 2, 3, 4], "DISK")
    return model


# Query tokens 1..16 = 4 blocks of 4 (V3 exclusive partition, docs/api.md "Tiers and counts"):
#   prefill-1: HBM depth 2                          -> npu 2, matched 2*4 = 8
#   prefill-2: CPU root walk over 3 edges           -> cpu 3 - npu 0 = 3, matched 12
#   prefill-3: Disk root walk over 1 edge           -> disk 1 - max(0, 0) = 1, matched 4
EXPECTED = {
    "vllm-prefill-1": {
        "longest_matched": 8,
        "DP": {"0": {"matched_tokens": 8, "npu_blocks": 2, "cpu_blocks": 0, "disk_blocks": 0}},
    },
    "vllm-prefill-2": {
        "longest_matched": 12,
        "DP": {"1": {"matched_tokens": 12, "npu_blocks": 0, "cpu_blocks": 3, "disk_blocks": 0}},
    },
    "vllm-prefill-3": {
        "longest_matched": 4,
        "DP": {"0": {"matched_tokens": 4, "npu_blocks": 0, "cpu_blocks": 0, "disk_blocks": 1}},
    },
}
PROMPT = list(range(1, 17))


@pytest.mark.server
def test_live_health_and_workers(server, loaded):
    with ConductorClient(server.url) as c:
        assert c.health() is True
        keys = set().union(*(normalize_service_key(w) for w in c.registered_services()))
        assert {("vllm-prefill-1", 0), ("vllm-prefill-2", 1), ("vllm-prefill-3", 0)} <= keys


@pytest.mark.server
@pytest.mark.parametrize(
    "encoding,packed", [("msgpack", False), ("json", False), ("msgpack", True)]
)
def test_live_query_encodings_agree(server, loaded, encoding, packed):
    with ConductorClient(server.url, query_encoding=encoding, packed=packed) as c:
        assert c.query(loaded, PROMPT, 4) == {"default": EXPECTED}


@pytest.mark.server
@pytest.mark.parametrize(
    "encoding,packed", [("msgpack", False), ("json", False), ("msgpack", True)]
)
def test_live_query_with_freshness(server, loaded, encoding, packed):
    """``freshness=True``: every DP says its state (these instances have no ZeroMQ source:
    fed over POST /events) and the answer sums up the model's sources (none)."""
    with ConductorClient(server.url, query_encoding=encoding, packed=packed) as c:
        got = c.query(loaded, PROMPT, 4, freshness=True)
        assert got.pop("freshness") == {"all_live": True, "sources": 0, "states": {}}
        for inst in got["default"].values():
            for row in inst["DP"].values():
                assert row.pop("freshness") == {"state": "no_source"}
        assert got == {"default": EXPECTED}
        by_hash = c.query_by_hash(loaded, [], freshness=True)
        assert by_hash == {
            "default": {},
            "freshness": {"all_live": True, "sources": 0, "states": {}},
        }


@pytest.mark.server
def test_live_query_top_k_says_what_it_left_out(server, loaded):
    """``top_k``: at most k rows, the header's count as the answer's ``top_k_omitted``; the
    first block is held by all three (depth 1): the instances' order breaks the tie."""
    with ConductorClient(server.url) as c:
        got = c.query(loaded, PROMPT, 4, top_k=2)
        assert isinstance(got, QueryAnswer) and got.top_k_omitted == 0
        assert set(got["default"]) == {"vllm-prefill-1", "vllm-prefill-2"}
        order = ["vllm-prefill-3", "vllm-prefill-1", "vllm-prefill-2"]
        got = c.query(loaded, PROMPT[:4], 4, top_k=1, instances=order)
        assert list(got["default"]) == ["vllm-prefill-3"] and got.top_k_omitted == 2
        got = c.query_by_hash(loaded, [14643705804678351452], top_k=2, instances=order[::-1])
        assert set(got["default"]) == {"vllm-prefill-2", "vllm-prefill-1"}
        assert got.top_k_omitted == 1
        assert type(c.query(loaded, PROMPT, 4)) is dict  # no top_k: a plain dict

    async def run():
        async with AsyncConductorClient(server.url) as ac:
            return await ac.query(loaded, PROMPT[:4], 4, top_k=1, instances=order)

    got = run_coro(run())
    assert list(got["default"]) == ["vllm-prefill-3"] and got.top_k_omitted == 2


@pytest.mark.server
def test_live_packed_token_inputs(server, loaded):
    with ConductorClient(server.url, packed=True) as c:
        assert c.query(loaded, array.array("I", PROMPT), 4) == {"default": EXPECTED}
        assert c.query(loaded, memoryview(struct.pack("<16I", *PROMPT)), 4) == {"default": EXPECTED}


@pytest.mark.server
def test_live_query_by_hash(server, loaded):
    # LocalBlockHash of [1,2,3,4] and [5,6,7,8] (docs/api.md, "Block hashing"); counts in blocks.
    hashes = [14643705804678351452, 16777012769546811212]
    for enc in ("msgpack", "json"):
        with ConductorClient(server.url, query_encoding=enc) as c:
            assert c.query_by_hash(loaded, hashes) == {
                "default": {
                    "vllm-prefill-1": {
                        "longest_matched": 2,
                        "DP": {
                            "0": {
                                "matched_tokens": 2,
                                "npu_blocks": 2,
                                "cpu_blocks": 0,
                                "disk_blocks": 0,
                            }
                        },
                    },
                    "vllm-prefill-2": {
                        "longest_matched": 2,
                        "DP": {
                            "1": {
                                "matched_tokens": 2,
                                "npu_blocks": 0,
                                "cpu_blocks": 2,
                                "disk_blocks": 0,
                            }
                        },
                    },
                    "vllm-prefill-3": {
                        "longest_matched": 1,
                        "DP": {
                            "0": {
                                "matched_tokens": 1,
                                "npu_blocks": 0,
                                "cpu_blocks": 0,
                                "disk_blocks": 1,
                            }
                        },
                    },
                }
            }


@pytest.mark.server
def test_live_errors_and_empty(server, loaded):
    for enc in ("msgpack", "json"):
        with ConductorClient(server.url, query_encoding=enc) as c:
            with pytest.raises(ConductorError) as ei:
                c.query("no-such-model-" + uuid.uuid4().hex, PROMPT, 4)
            assert ei.value.status_code == 404
            assert ei.value.server_error.startswith("no indexer for model=no-such-model-")
            assert c.query(loaded, [77, 78, 79, 80], 4) == {"default": {}}
            with pytest.raises(ConductorError) as ei:
                c.unregister(instance_id="vllm-nobody-" + uuid.uuid4().hex, dp_rank=0)
            assert ei.value.status_code == 404 and "not found" in ei.value.server_error


@pytest.mark.server
def test_live_rank_both_modes(server, loaded):
    with ConductorClient(server.url) as c:
        resp = c.query(loaded, PROMPT, 4)
    cands = [
        Candidate("vllm-prefill-1", 0, 1.0),
        Candidate("vllm-prefill-2", 1, 10.0),
        Candidate("vllm-prefill-3", 0, 0.0),
    ]
    # unified, defaults (w_disk 0): matched 8, 12, 0 -> prefill 8, 4, 16 -> score 9, 14, 16
    assert rank(resp, cands, 16, 4) == [
        ("vllm-prefill-1", 0, 9.0),
        ("vllm-prefill-2", 1, 14.0),
        ("vllm-prefill-3", 0, 16.0),
    ]
    # w_disk 1: prefill-3 matched 4 -> prefill 12 -> 12; order 9, 12, 14
    assert [r[0] for r in rank(resp, cands, 16, 4, KvAffinityConfig(w_disk=1))] == [
        "vllm-prefill-1",
        "vllm-prefill-3",
        "vllm-prefill-2",
    ]
    # load_gated (topn 2): the two lightest are prefill-3 (0) and prefill-1 (1);
    # by matched: 1 (8), 3 (0)
    assert rank(resp, cands, 16, 4, KvAffinityConfig(mode="load_gated")) == [
        ("vllm-prefill-1", 0, 1.0),
        ("vllm-prefill-3", 0, 0.0),
    ]


@pytest.mark.server
def test_live_reregister_after_unregister(server):
    model = f"live-{uuid.uuid4().hex[:8]}"
    cfg = {"store_backend": "YuanRong", "block_size": 4}
    payloads = [build_dp_registration(cfg, "vllm-union-5", model, dp, "127.0.0.1") for dp in (0, 1)]
    with ConductorClient(server.url) as c:
        c.register(payloads[0])
        result = c.reregister_missing(payloads)
        assert (
            result.present == [payloads[0]]
            and result.registered == [payloads[1]]
            and not result.failed
        )
        assert c.unregister(build_unregister_payload(cfg, "vllm-union-5", model, 1)) == {
            "status": "ok"
        }
        assert c.reregister_missing(payloads).registered == [payloads[1]]
        for dp in (0, 1):
            c.unregister(build_unregister_payload(cfg, "vllm-union-5", model, dp))


@pytest.mark.server
def test_live_api_key():
    srv = Server()
    if not srv.start("--api-key", "s3cret"):
        pytest.skip(srv.why())
    try:
        reg = {
            "instance_id": "vllm-prefill-1",
            "type": "vLLM",
            "modelname": "m",
            "block_size": 4,
            "dp_rank": 0,
        }
        with ConductorClient(srv.url) as c:
            with pytest.raises(ConductorError) as ei:
                c.register(reg)
            assert ei.value.status_code == 401 and "bearer" in ei.value.server_error.lower()
        with ConductorClient(srv.url, api_key="s3cret") as c:
            assert c.register(reg) == {"status": "ok"}
            assert c.query("m", [1, 2, 3, 4], 4) == {"default": {}}
    finally:
        srv.stop()


@pytest.mark.server
def test_live_async_client(server, loaded):
    async def main():
        async with AsyncConductorClient(server.url, packed=True) as c:
            assert await c.health() is True
            assert await c.query(loaded, PROMPT, 4) == {"default": EXPECTED}

    run_coro(main())


@pytest.mark.server
def test_live_breaker_against_stopped_server():
    srv = Server()
    if not srv.start():
        pytest.skip(srv.why())
    clock = FakeClock()
    try:
        with ConductorClient(srv.url, clock=clock) as c:
            assert c.query_or_empty("none", PROMPT, 4) == {}  # 404: server up, no failure
            assert c.breaker.failures == 0
            srv.stop()
            for _i in range(3):
                with pytest.raises(ConductorError) as ei:
                    c.query("none", PROMPT, 4)
                assert not isinstance(ei.value, CircuitOpenError)
                assert "ConnectError" in str(ei.value)
            assert c.breaker.state == "open"
            with pytest.raises(CircuitOpenError):
                c.query("none", PROMPT, 4)
            # bring it back on the same port; after the cooldown the half-open try closes
            # the breaker
            srv2 = Server(srv.port)
            if not srv2.start():
                pytest.skip(srv2.why())
            try:
                with pytest.raises(CircuitOpenError):
                    c.query("none", PROMPT, 4)
                clock.advance(30)
                with pytest.raises(ConductorError) as ei:
                    c.query("none", PROMPT, 4)
                assert ei.value.status_code == 404
                assert c.breaker.state == "closed"
            finally:
                srv2.stop()
    finally:
        srv.stop()
