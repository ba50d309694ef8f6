"""The sans-I/O client core driven by hand: requests out, replies in, no HTTP."""

from __future__ import annotations

import msgspec
import pytest

from kvconductor.coordinator.breaker import CircuitBreaker, CircuitOpenError, ConductorError
from kvconductor.coordinator.core import ConductorCore
from kvconductor.coordinator.exchange import (
    QueryAnswer,
    Reply,
    TransportFailure,
    omitted_header,
    resume,
)

JSON = "application/json"


def json_reply(body, status=200):
    return Reply(status, JSON, msgspec.json.encode(body))


def test_query_plan_builds_one_request_and_returns_the_decoded_answer():
    core = ConductorCore("conductor:13333", query_encoding="json")
    plan = core.query_plan("qwen", [1, 2, 3], 128, lora_name="a")
    more, req = resume(plan)
    assert more and (req.method, req.path, req.timeout) == ("POST", "/query", 3.0)
    assert req.headers == {"content-type": JSON, "accept": f"{JSON}, {JSON}"}
    assert msgspec.json.decode(req.content) == {
        "model": "qwen",
        "block_size": 128,
        "token_ids": [1, 2, 3],
        "tenant_id": "default",
        "lora_name": "a",
    }
    assert resume(plan, json_reply({"default": {}})) == (False, {"default": {}})


def test_a_transport_failure_becomes_a_conductor_error_and_counts_for_the_breaker():
    core = ConductorCore("http://c", breaker=CircuitBreaker(threshold=1))
    plan = core.workers_plan()
    resume(plan)
    with pytest.raises(
        ConductorError, match=r"GET /workers timed out after 15 s \(TimeoutError\) \[http://c\]"
    ):
        resume(plan, TransportFailure(TimeoutError("slow"), timed_out=True))
    with pytest.raises(CircuitOpenError):
        resume(core.workers_plan())  # refused before any request is yielded


def test_an_abandoned_exchange_frees_the_half_open_slot():
    now = [0.0]
    core = ConductorCore(
        "http://c", breaker=CircuitBreaker(threshold=1, cooldown=1, clock=lambda: now[0])
    )
    core.breaker.record_failure()
    now[0] = 2.0
    plan = core.workers_plan()
    resume(plan)  # takes the half-open slot
    assert not core.breaker.allow()
    plan.close()  # the driver was cancelled
    assert core.breaker.allow()


def test_status_errors_map_to_conductor_error_with_the_server_message():
    core = ConductorCore("http://c")
    plan = core.query_by_hash_plan("m", [7])
    resume(plan)
    with pytest.raises(ConductorError) as info:
        resume(plan, json_reply({"error": "no indexer"}, status=404))
    assert (info.value.status_code, info.value.server_error) == (404, "no indexer")
    assert core.breaker.failures == 0


def test_health_plan_never_raises():
    core = ConductorCore("http://c")
    plan = core.health_plan()
    _, req = resume(plan)
    assert (req.path, req.breaker) == ("/health", False)
    assert resume(plan, TransportFailure(OSError("refused"), timed_out=False)) == (False, False)


def test_reregister_missing_plan_asks_workers_then_registers_what_is_missing():
    core = ConductorCore("http://c")
    have = {"instance_id": "a", "type": "vLLM", "modelname": "m", "block_size": 4, "dp_rank": 0}
    lack = {**have, "instance_id": "b"}
    plan = core.reregister_missing_plan([have, lack])
    _, req = resume(plan)
    assert req.path == "/workers"
    _, req = resume(plan, json_reply({"workers": [{"instance_id": "a", "endpoints": {"0": {}}}]}))
    assert req.path == "/register" and msgspec.json.decode(req.content)["instance_id"] == "b"
    more, result = resume(plan, json_reply({"status": "ok"}))
    assert not more and (result.present, result.registered, result.failed) == ([have], [lack], [])


def test_reply_text_honours_the_charset():
    assert Reply(500, "text/plain; charset=latin-1", "é".encode("latin-1")).text == "é"
    assert Reply(500, "", b"\xff").text == "\ufffd"


def test_the_affinity_module_and_the_old_names_stay_light():
    """``kvconductor.affinity`` needs only the standard library (docs/client.md)."""
    import subprocess
    import sys

    code = (
        "import sys, kvconductor.affinity, kvconductor.coordinator.affinity; "
        "from kvconductor.coordinator import affinity, rank; "
        "print('httpx' in sys.modules, 'msgspec' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_top_k_answer_carries_the_omitted_count():
    core = ConductorCore("conductor:13333", query_encoding="json")
    answer = {"default": {"a": {"longest_matched": 4, "DP": {}}}}
    body = msgspec.json.encode(answer)
    for plan in (
        core.query_plan("qwen", [1, 2], 4, top_k=1),
        core.query_by_hash_plan("qwen", [5], top_k=1),
    ):
        resume(plan)
        more, got = resume(plan, Reply(200, JSON, body, 1016))
        assert not more and got == answer
        assert isinstance(got, QueryAnswer) and got.top_k_omitted == 1016
    # no header (no top_k, or a server without the extension): a plain dict
    plan = core.query_plan("qwen", [1, 2], 4, top_k=1)
    resume(plan)
    got = resume(plan, Reply(200, JSON, body))[1]
    assert type(got) is dict and got == answer
    assert [omitted_header(v) for v in (None, "", "x", "-1", " 7 ", "0")] == [
        None,
        None,
        None,
        None,
        7,
        0,
    ]


def test_query_plans_send_top_k_and_instances_only_when_set():
    for enc, decode in (("json", msgspec.json.decode), ("msgpack", msgspec.msgpack.decode)):
        core = ConductorCore("conductor:13333", query_encoding=enc)
        _, plain = resume(core.query_plan("qwen", [1, 2], 4))
        assert "top_k" not in decode(plain.content) and "instances" not in decode(plain.content)
        _, req = resume(core.query_plan("qwen", [1, 2], 4, top_k=8, instances=("a", "b")))
        assert decode(req.content) == {
            "model": "qwen",
            "block_size": 4,
            "token_ids": [1, 2],
            "tenant_id": "default",
            "top_k": 8,
            "instances": ["a", "b"],
        }
        _, req = resume(core.query_by_hash_plan("qwen", [5, 6], instances=[]))
        assert req.path == "/query_by_hash"
        assert decode(req.content) == {
            "model": "qwen",
            "block_size": 1,
            "block_hashes": [5, 6],
            "tenant_id": "default",
            "instances": [],
        }
        _, req = resume(core.query_by_hash_plan("qwen", [5], top_k=1))
        assert decode(req.content)["top_k"] == 1
        assert "freshness" not in decode(plain.content)
        _, req = resume(core.query_plan("qwen", [1, 2], 4, freshness=True))
        assert decode(req.content)["freshness"] is True
        _, req = resume(core.query_by_hash_plan("qwen", [5], freshness=True))
        assert decode(req.content)["freshness"] is True
    core = ConductorCore("conductor:13333")
    for bad in ({"top_k": 0}, {"top_k": -2}, {"top_k": True}, {"instances": "ab"}):
        with pytest.raises(ValueError):
            resume(core.query_plan("qwen", [1], 4, **bad))
