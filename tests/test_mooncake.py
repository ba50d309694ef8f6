"""The Mooncake conductor's dialect (``--mooncake-port``, kvconductor.http.mooncake).

Reference data: the repository kvcache-ai/Mooncake, folder ``mooncake-conductor/``:

* the cache-aware proxy's conductor tests (what a Mooncake client sends and expects):
  ``tests/cache_aware_proxy/test_cache_aware_proxy_conductor.py`` at commit
  36bbe8f4af9a9331bfce0efef4dd3238c73a939e (JSON bodies) and
  ``tests/cache_aware_proxy/_support.py`` with ``example/cache_aware_disagg_proxy.py`` at
  commit 1d9dff9ad98443d9a1f77d046f57ebdf19979d39 (MessagePack bodies, token ids as one
  bin of little-endian int32, the answer's ``instances`` read for ``longest_matched``);
* the query semantics (cumulative ``gpu <= cpu <= disk`` per rank, ``dp``,
  ``rank_matches`` for every registered rank, instance maxima):
  ``tests/prefix_indexer_test.cpp`` at commit 08e552e178a05a380b3de067814918a9e0be58be
  (the ``TEST(Query, ...)`` cases; block size 16, tokens ``1..N``);
* routes, bodies, success bodies and status codes: ``src/kvevent/event_manager.cpp`` at
  commit 13d50e57c02132cd80636601cc12f5f5eba572e6, and the request example of
  ``docs/source/design/conductor/indexer-api-design.md`` at commit
  02785988328c373a45f0026e52517c953343d0fd.

Our tests assert the values those tests assert, against a live kvconductor. Mooncake's
CPU and disk tiers are shared by every rank (a cluster store); ours are held per (instance,
DP) (docs/api.md, "The Mooncake conductor dialect"), so where a Mooncake case stores a
block in its shared store, the case here stores it for each DP that continues onto it.
"""

from __future__ import annotations

import itertools
import struct

import msgspec
import pytest

from kvconductor import schema
from kvconductor.http import mooncake
from kvconductor.index import DpHit
from kvconductor.serve import cli
from tests.helpers.server import dialect_server, free_port

BS = 16
_event_ids = itertools.count(1)

# The proxy's shared prefill config and registrations (its _support.valid_config_dict).
PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}
PROXY_REGISTRATIONS = [
    {
        "endpoint": endpoint,
        "type": "vLLM",
        "modelname": "test-model",
        "instance_id": iid,
        "block_size": 16,
        "dp_rank": dp,
        "tenant_id": "tenant-a",
        "lora_name": "adapter-a",
        "hash_profile": PROFILE,
    }
    for iid, dp, endpoint in (
        ("prefill-a", 0, "tcp://prefill-a.test:5557"),
        ("prefill-a", 1, "tcp://prefill-a.test:5558"),
        ("prefill-b", 0, "tcp://prefill-b.test:5557"),
    )
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with dialect_server(tmp_path_factory.mktemp("mooncake"), "--mooncake-port") as (s, client):
        s.mc = client
        yield s


def _tokens(n: int) -> list[int]:
    return list(range(1, n + 1))


def _register(srv, model: str, iid: str, dp: int = 0, **extra) -> None:
    body = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "type": "vLLM",
        "modelname": model,
        "instance_id": iid,
        "block_size": BS,
        "dp_rank": dp,
        "hash_profile": PROFILE,
        **extra,
    }
    r = srv.mc.post("/register", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "registered successfully", "instance_id": iid}


def _store(srv, iid: str, dp: int, medium: str, blocks: list[int], parent: int | None) -> None:
    """Blocks ``blocks`` (0-based indexes into the prompt 1..N, consecutive) of one DP on
    ``medium``, as a vLLM BlockStored over V3's POST /events; engine hash of block i is
    1000 + i."""
    tokens = [t for b in blocks for t in range(b * BS + 1, (b + 1) * BS + 1)]
    event = {
        "event_id": next(_event_ids),
        "dp_rank": dp,
        "type": "BlockStored",
        "block_hashes": [1000 + b for b in blocks],
        "parent_block_hash": None if parent is None else 1000 + parent,
        "token_ids": tokens,
        "block_size": BS,
        "medium": medium,
    }
    r = srv.http.post("/events", json={"instance_id": iid, "events": [event]})
    assert r.status_code == 200, r.text


def _query(srv, model: str, n: int, **extra) -> dict:
    body = {"model": model, "block_size": BS, "token_ids": _tokens(n), **extra}
    r = srv.mc.post("/query", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json()


def _inst(longest, gpu, cpu, disk, ranks: dict[int, tuple[int, int, int]]) -> dict:
    return {
        "longest_matched": longest,
        "dp": {str(r): g for r, (g, _, _) in ranks.items()},
        "rank_matches": {str(r): {"gpu": g, "cpu": c, "disk": d} for r, (g, c, d) in ranks.items()},
        "gpu": gpu,
        "cpu": cpu,
        "disk": disk,
    }


# -- the query's meaning: Mooncake's prefix_indexer_test.cpp cases ----------------------------


def test_exact_two_instance_shared_cache_example(srv):
    # TEST(Query, ExactTwoInstanceSharedCacheExample): instance-1 rank 0 holds blocks 0-1
    # on GPU; blocks 0-2 are on CPU and on disk (Mooncake: a shared store; here: held by
    # both DPs). Every block of the prompt is in two or three tiers.
    m = "mc-two"
    _register(srv, m, "instance-1", 0)
    _register(srv, m, "instance-2", 1)
    _store(srv, "instance-1", 0, "GPU", [0, 1], None)
    for iid, dp in (("instance-1", 0), ("instance-2", 1)):
        _store(srv, iid, dp, "CPU", [0, 1, 2], None)
        _store(srv, iid, dp, "DISK", [0, 1, 2], None)
    assert _query(srv, m, 48) == {
        "instances": {
            "instance-1": _inst(48, 32, 48, 48, {0: (32, 48, 48)}),
            "instance-2": _inst(48, 0, 48, 48, {1: (0, 48, 48)}),
        }
    }
    # The same data in V3's exclusive counts, on the V3 port: HBM 2, CPU 1, Disk 0.
    v3 = srv.http.post("/query", json={"model": m, "block_size": BS, "token_ids": _tokens(48)})
    assert v3.json()["default"]["instance-1"]["DP"]["0"] == {
        "matched_tokens": 48,
        "npu_blocks": 2,
        "cpu_blocks": 1,
        "disk_blocks": 0,
    }


def test_gpu_cpu_and_disk_extend_one_cumulative_prefix(srv):
    # TEST(Query, GpuCpuAndDiskExtendOneCumulativePrefix)
    m = "mc-extend"
    _register(srv, m, "instance-a")
    _store(srv, "instance-a", 0, "GPU", [0, 1], None)
    _store(srv, "instance-a", 0, "CPU", [2], 1)
    _store(srv, "instance-a", 0, "DISK", [3], 2)
    assert _query(srv, m, 64)["instances"] == {
        "instance-a": _inst(64, 32, 48, 64, {0: (32, 48, 64)})
    }


def test_empty_cpu_phase_falls_through_to_disk_at_same_block(srv):
    # TEST(Query, EmptyCpuPhaseFallsThroughToDiskAtSameBlock)
    m = "mc-fall"
    _register(srv, m, "instance-a")
    _store(srv, "instance-a", 0, "GPU", [0], None)
    _store(srv, "instance-a", 0, "DISK", [1, 2], 0)
    assert _query(srv, m, 48)["instances"] == {
        "instance-a": _inst(48, 16, 16, 48, {0: (16, 16, 48)})
    }


def test_complete_gpu_coverage_carries_through_lower_tier_boundaries(srv):
    # TEST(Query, CompleteGpuCoverageCarriesThroughLowerTierBoundaries)
    m = "mc-full"
    _register(srv, m, "instance-a")
    _store(srv, "instance-a", 0, "GPU", [0, 1, 2], None)
    assert _query(srv, m, 48)["instances"] == {
        "instance-a": _inst(48, 48, 48, 48, {0: (48, 48, 48)})
    }


def test_duplicate_tier_presence_is_attributed_once(srv):
    # TEST(Query, DuplicateTierPresenceIsAttributedOnce): block 0 on GPU, CPU and disk,
    # block 1 on CPU and disk, block 2 on disk.
    m = "mc-dup"
    _register(srv, m, "instance-a")
    _store(srv, "instance-a", 0, "GPU", [0], None)
    _store(srv, "instance-a", 0, "CPU", [0, 1], None)
    _store(srv, "instance-a", 0, "DISK", [0, 1, 2], None)
    assert _query(srv, m, 48)["instances"] == {
        "instance-a": _inst(48, 16, 32, 48, {0: (16, 32, 48)})
    }


def test_lower_tier_phase_never_returns_to_higher_tier(srv):
    # TEST(Query, LowerTierPhaseNeverReturnsToHigherTier): GPU 0, CPU 2, disk 1 and 3.
    m = "mc-noreturn"
    _register(srv, m, "instance-a")
    _store(srv, "instance-a", 0, "GPU", [0], None)
    _store(srv, "instance-a", 0, "CPU", [2], 1)
    _store(srv, "instance-a", 0, "DISK", [1], 0)
    _store(srv, "instance-a", 0, "DISK", [3], 2)
    assert _query(srv, m, 64)["instances"] == {
        "instance-a": _inst(32, 16, 16, 32, {0: (16, 16, 32)})
    }


def test_different_ranks_never_fabricate_one_gpu_prefix(srv):
    # TEST(Query, DifferentRanksNeverFabricateOneGpuPrefix)
    m = "mc-ranks"
    _register(srv, m, "instance-a", 0)
    _register(srv, m, "instance-a", 1)
    _store(srv, "instance-a", 0, "GPU", [0], None)
    # Our index refuses rank 1's block 1 after a parent rank 1 does not hold (Mooncake
    # stores it and ignores it); rank 1 holds the same tokens as a root block instead.
    ev = {
        "event_id": next(_event_ids),
        "dp_rank": 1,
        "type": "BlockStored",
        "block_hashes": [1001],
        "parent_block_hash": 1000,
        "token_ids": _tokens(32)[16:],
        "block_size": BS,
        "medium": "GPU",
    }
    r = srv.http.post("/events", json={"instance_id": "instance-a", "events": [ev]})
    assert r.json()["errors"] == ["dp_rank=1: parent block not found"]
    _store(srv, "instance-a", 1, "GPU", [1], None)
    assert _query(srv, m, 32)["instances"] == {
        "instance-a": _inst(16, 16, 16, 16, {0: (16, 16, 16), 1: (0, 0, 0)})
    }


def test_instance_summary_is_realized_by_maximum_gpu_rank(srv):
    # TEST(Query, InstanceSummaryIsRealizedByMaximumGpuRank): rank 1's GPU run ends at
    # block 1, which only rank 0 holds, so the CPU and disk blocks after it are not its.
    m = "mc-summary"
    _register(srv, m, "instance-a", 0)
    _register(srv, m, "instance-a", 1)
    _store(srv, "instance-a", 0, "GPU", [0, 1], None)
    _store(srv, "instance-a", 1, "GPU", [0], None)
    for dp in (0, 1):
        _store(srv, "instance-a", dp, "CPU", [2], 1)
        _store(srv, "instance-a", dp, "DISK", [3], 2)
    got = _query(srv, m, 64)["instances"]["instance-a"]
    assert got == _inst(64, 32, 48, 64, {0: (32, 48, 64), 1: (16, 16, 16)})
    assert got["gpu"] == got["rank_matches"]["0"]["gpu"]
    assert got["longest_matched"] == got["rank_matches"]["0"]["disk"]


def test_registered_zero_hit_ranks_and_incomplete_tail_are_retained(srv):
    # TEST(Query, RegisteredZeroHitRanksAndIncompleteTailAreRetained): 31 tokens, ranks 0
    # and 2 registered, nothing stored.
    m = "mc-zero"
    _register(srv, m, "instance-a", 0)
    _register(srv, m, "instance-a", 2)
    assert _query(srv, m, 31) == {
        "instances": {"instance-a": _inst(0, 0, 0, 0, {0: (0, 0, 0), 2: (0, 0, 0)})}
    }


def test_only_complete_blocks_count(srv):
    # TEST(Query, WholeBlockRunIsUnaffectedByThePromptLengthClamp) under the vllm_v1
    # profile: 40 tokens over block size 16 are two blocks; the tail of 8 never counts.
    m = "mc-tail"
    _register(srv, m, "instance-a")
    _store(srv, "instance-a", 0, "DISK", [0, 1], None)
    assert _query(srv, m, 40)["instances"] == {"instance-a": _inst(32, 0, 0, 32, {0: (0, 0, 32)})}


def test_instance_filter_and_unknown_context(srv):
    # TEST(Query, InstanceFilterAndUnknownContextAreLookupOnly)
    m = "mc-filter"
    _register(srv, m, "instance-a", 0)
    _register(srv, m, "instance-b", 1)
    assert list(_query(srv, m, 16, instance_id="instance-b")["instances"]) == ["instance-b"]
    assert _query(srv, m, 16, instance_id="unknown-instance") == {"instances": {}}
    assert _query(srv, "missing", 16) == {"instances": {}}
    # another block size is another context (Mooncake's ContextKey has the block size)
    r = srv.mc.post("/query", json={"model": m, "block_size": 32, "token_ids": _tokens(32)})
    assert r.json() == {"instances": {}}


# -- what Mooncake's cache-aware proxy sends and expects ------------------------------------


def test_proxy_json_registration_and_query(srv):
    # test_registration_payloads_follow_current_contract and
    # test_query_payload_forwards_optional_cache_salt_and_timeout (JSON bodies).
    for payload in PROXY_REGISTRATIONS:
        r = srv.mc.post("/register", json=payload)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "status": "registered successfully",
            "instance_id": payload["instance_id"],
        }
    body = {
        "model": "test-model",
        "block_size": 16,
        "token_ids": [1, 2, 3],
        "tenant_id": "tenant-a",
        "lora_name": "adapter-a",
        "cache_salt": "salt-a",
    }
    r = srv.mc.post("/query", json=body, headers={"X-Request-Id": "request-1"})
    assert r.status_code == 200
    got = r.json()["instances"]
    assert sorted(got) == ["prefill-a", "prefill-b"]
    assert got["prefill-a"]["rank_matches"] == {
        "0": {"gpu": 0, "cpu": 0, "disk": 0},
        "1": {"gpu": 0, "cpu": 0, "disk": 0},
    }
    assert all(
        type(v["longest_matched"]) is int and v["longest_matched"] == 0 for v in got.values()
    )


def test_proxy_msgpack_registration_and_query_pick_the_longest(srv):
    # _support.registration_success_handler / request_msgpack and the proxy's
    # ConductorClient at 1d9dff9a: msgpack bodies, token ids packed as "<i" int32.
    regs = [dict(p, modelname="test-model-mp") for p in PROXY_REGISTRATIONS]
    for payload in regs:
        r = srv.mc.post(
            "/register",
            content=msgspec.msgpack.encode(payload),
            headers={"Content-Type": "application/msgpack"},
        )
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/msgpack"
        assert msgspec.msgpack.decode(r.content) == {
            "status": "registered successfully",
            "instance_id": payload["instance_id"],
        }
    lora = {"lora_name": "adapter-a"}
    tokens = _tokens(40)
    for iid, blocks in (("prefill-a", [0]), ("prefill-b", [0, 1])):
        ev = {
            "event_id": next(_event_ids),
            "dp_rank": 0,
            "type": "BlockStored",
            "block_hashes": [2000 + b for b in blocks],
            "parent_block_hash": None,
            "token_ids": tokens[: len(blocks) * BS],
            "block_size": BS,
            "medium": "GPU",
            **lora,
        }
        r = srv.http.post("/events", json={"instance_id": iid, "events": [ev]})
        assert r.status_code == 200, r.text
    payload = {
        "model": "test-model-mp",
        "block_size": 16,
        "token_ids": struct.pack(f"<{len(tokens)}i", *tokens),
        "tenant_id": "tenant-a",
        "lora_name": "adapter-a",
    }
    r = srv.mc.post(
        "/query",
        content=msgspec.msgpack.encode(payload),
        headers={"Content-Type": "application/msgpack", "X-Request-Id": "request-1"},
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/msgpack"
    instances = msgspec.msgpack.decode(r.content)["instances"]
    assert instances["prefill-a"] == _inst(16, 16, 16, 16, {0: (16, 16, 16), 1: (0, 0, 0)})
    assert instances["prefill-b"] == _inst(32, 32, 32, 32, {0: (32, 32, 32)})
    # the proxy's select_prefill: the largest longest_matched wins
    candidates = {iid: v["longest_matched"] for iid, v in instances.items()}
    assert max(candidates, key=candidates.__getitem__) == "prefill-b"
    # the base model (no lora_name) does not see the adapter's blocks
    payload.pop("lora_name")
    r = srv.mc.post(
        "/query",
        content=msgspec.msgpack.encode(payload),
        headers={"Content-Type": "application/msgpack"},
    )
    assert msgspec.msgpack.decode(r.content) == {"instances": {}}


def test_design_doc_register_example_and_services(srv):
    # indexer-api-design.md's POST /register example (additionalsalt of older clients).
    body = {
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
        "type": "vLLM",
        "modelname": "deepseek",
        "lora_name": "sql-adapter",
        "tenant_id": "default",
        "instance_id": "vllm-prefill-node1",
        "block_size": 128,
        "dp_rank": 0,
        "additionalsalt": "w8a8",
    }
    r = srv.mc.post("/register", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "registered successfully", "instance_id": "vllm-prefill-node1"}
    # an identical re-registration (a restarted proxy) is a success too
    assert srv.mc.post("/register", json=body).status_code == 200
    # fields Mooncake's server refuses are accepted, with a WARN
    r = srv.mc.post("/register", json={**body, "lora_id": 7})
    assert r.status_code == 200
    log = srv.log()
    assert "register: additionalsalt is accepted and ignored" in log
    assert "register: fields ignored: lora_id" in log
    services = srv.mc.get("/services").json()
    entry = [s for s in services["services"] if s["InstanceID"] == "vllm-prefill-node1"]
    assert entry == [
        {
            "Endpoint": "tcp://127.0.0.1:5557",
            "ReplayEndpoint": "tcp://127.0.0.1:5558",
            "Type": "vLLM",
            "ModelName": "deepseek",
            "LoraName": "sql-adapter",
            "TenantID": "default",
            "InstanceID": "vllm-prefill-node1",
            "BlockSize": 128,
            "DPRank": 0,
            "CacheGroup": None,
            "HashProfile": None,
        }
    ]
    assert services["count"] == len(services["services"])
    # our registration: an engine whose HBM publisher is the endpoint
    ep = srv.http.get("/workers").json()["workers"]
    node = [w for w in ep if w["instance_id"] == "vllm-prefill-node1"][0]
    assert node["endpoints"]["0"]["medium_endpoints"] == {"npu": "tcp://127.0.0.1:5557"}
    assert node["endpoints"]["0"]["replay_endpoint"] == "tcp://127.0.0.1:5558"


def test_unregister_by_service_key(srv):
    # indexer-api-design.md: removed_instances names "instance|tenant|dp"; an unknown
    # service is a 404 (event_manager.cpp's /unregister handler).
    m = "mc-unreg"
    _register(srv, m, "instance-u", 0, tenant_id="tenant-u")
    _register(srv, m, "instance-u", 1, tenant_id="tenant-u")
    r = srv.mc.post("/unregister", json={"instance_id": "instance-u", "dp_rank": 0})
    assert r.status_code == 404
    assert r.json()["error"] == "service not found: instance-u|default|0"
    r = srv.mc.post(
        "/unregister", json={"instance_id": "instance-u", "tenant_id": "tenant-u", "dp_rank": 0}
    )
    assert r.status_code == 200
    assert r.json() == {
        "status": "unregistered successfully",
        "removed_instances": ["instance-u|tenant-u|0"],
    }
    got = _query(srv, m, 16, tenant_id="tenant-u")["instances"]
    assert got == {"instance-u": _inst(0, 0, 0, 0, {1: (0, 0, 0)})}
    again = {"instance_id": "instance-u", "tenant_id": "tenant-u", "dp_rank": 0}
    assert srv.mc.post("/unregister", json=again).status_code == 404


# -- errors: Mooncake's status codes, our {"error": ...} bodies --------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "invalid_json"),
        (b"[1, 2]", "invalid_value"),
        (b'{"type":"vLLM","modelname":"m","instance_id":"i","block_size":16,"dp_rank":0}', None),
        (
            b'{"endpoint":"tcp://127.0.0.1:1","type":"TensorRT","modelname":"m",'
            b'"instance_id":"i","block_size":16,"dp_rank":0}',
            "invalid_value",
        ),
        (
            b'{"endpoint":"tcp://127.0.0.1:1","type":"vLLM","modelname":"m",'
            b'"instance_id":"i","block_size":0,"dp_rank":0}',
            "invalid_value",
        ),
        (
            b'{"endpoint":"tcp://127.0.0.1:1","type":"vLLM","modelname":"m",'
            b'"instance_id":"i","block_size":16,"dp_rank":-1}',
            "invalid_value",
        ),
        (
            b'{"endpoint":"tcp://127.0.0.1:1","type":"vLLM","modelname":"m",'
            b'"instance_id":"i","block_size":16,"dp_rank":0,"cache_group":1}',
            "unsupported",
        ),
        (
            b'{"endpoint":"10.0.0.1:5557","type":"vLLM","modelname":"m",'
            b'"instance_id":"i","block_size":16,"dp_rank":0}',
            "invalid_registration",
        ),
        (
            b'{"endpoint":"","type":"vLLM","modelname":"m",'
            b'"instance_id":"i","block_size":16,"dp_rank":0}',
            "invalid_value",
        ),
    ],
)
def test_register_errors_are_400(srv, body, reason):
    r = srv.mc.post("/register", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    doc = r.json()
    assert doc["error"]
    if reason is not None:
        assert doc["reason"] == reason
    assert srv.mc.get("/health").text == "OK"  # still serving


def test_query_errors(srv):
    r = srv.mc.post("/query", content=b"{", headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (
        400,
        {"error": "Invalid JSON object", "reason": "invalid_json"},
    )
    r = srv.mc.post("/query", json={"model": "m", "block_size": 16, "token_ids": ["x"]})
    assert r.status_code == 400 and r.json()["reason"] == "invalid_value"
    r = srv.mc.post("/query", json={"model": "m", "token_ids": [1]})
    assert r.status_code == 400 and "block_size" in r.json()["error"]
    # a MessagePack request gets its error in MessagePack
    r = srv.mc.post(
        "/query",
        content=msgspec.msgpack.encode({"model": "m"}),
        headers={"Content-Type": "application/msgpack"},
    )
    assert r.status_code == 400
    assert msgspec.msgpack.decode(r.content)["reason"] == "invalid_value"


def test_wrong_method_is_405_and_unknown_path_404(srv):
    for path in ("/query", "/register", "/unregister"):
        r = srv.mc.get(path)
        assert r.status_code == 405
        assert r.json() == {"error": "Method not allowed", "reason": "method_not_allowed"}
    assert srv.mc.post("/services").status_code == 405
    assert srv.mc.get("/global_view_nope").status_code == 404


def test_openapi_document_on_the_dialect_port(srv):
    doc = srv.mc.get("/openapi.json").json()
    assert set(doc["paths"]) == {
        "/register",
        "/unregister",
        "/query",
        "/services",
        "/health",
        "/openapi.json",
    }
    # the V3 port's document is unchanged: no Mooncake route there
    assert "MooncakeQueryRequest" not in srv.http.get("/openapi.json").text


# -- the mapping on its own --------------------------------------------------------------------


def test_cumulative_answer_from_exclusive_rows():
    hits = [
        DpHit("a", 0, 2, 1, 0),  # HBM 2, CPU 1 beyond: cumulative 2, 3, 3 blocks
        DpHit("a", 1, 0, 0, 4),  # disk only
        DpHit("b", 3, 1, 0, 0),
    ]
    got = mooncake.cumulative_answer(hits, [("a", 0), ("a", 1), ("a", 2), ("c", 0)], 16)
    enc = msgspec.json.decode(msgspec.json.encode(got))
    assert enc == {
        "a": _inst(64, 32, 48, 64, {0: (32, 48, 48), 1: (0, 0, 64), 2: (0, 0, 0)}),
        "b": _inst(16, 16, 16, 16, {3: (16, 16, 16)}),
        "c": _inst(0, 0, 0, 0, {0: (0, 0, 0)}),
    }
    for inst in got.values():
        for rm in inst.rank_matches.values():
            assert rm.gpu <= rm.cpu <= rm.disk


def test_register_maps_onto_our_registration():
    svc, warnings = mooncake.parse_register(msgspec.json.encode(PROXY_REGISTRATIONS[1]), False)
    assert (svc.key, svc.lora_name, warnings) == ("prefill-a|tenant-a|1", "adapter-a", [])
    req, body = mooncake.to_v3_register(svc)
    assert msgspec.json.decode(body) == {
        "instance_id": "prefill-a",
        "type": "vLLM",
        "modelname": "test-model",
        "block_size": 16,
        "dp_rank": 1,
        "tenant_id": "tenant-a",
        "lora_name": "adapter-a",  # the DP's adapter: a pool's other adapters are not its
        "medium_endpoints": {"npu": "tcp://prefill-a.test:5558"},
    }
    assert isinstance(req, schema.RegisterRequest) and req.medium_endpoints == {
        "npu": "tcp://prefill-a.test:5558"
    }
    pool = dict(PROXY_REGISTRATIONS[0], type="Mooncake", endpoint="tcp://10.0.0.9:50051")
    svc, _ = mooncake.parse_register(msgspec.json.encode(pool), False)
    req, _ = mooncake.to_v3_register(svc)
    assert (req.store_backend, req.endpoint, req.medium_endpoints) == (
        "Mooncake",
        "tcp://10.0.0.9:50051",
        None,
    )
    assert (req.shared_store, req.lora_name) == (True, "adapter-a")


def test_cli_mooncake_port_flag():
    p = cli.build_parser(raise_errors=True)
    assert cli.settings_from_args(p.parse_args(["--mooncake-port", "13334"])).mooncake_port == 13334
    assert cli.settings_from_args(p.parse_args([])).mooncake_port is None
    # served by the owner with --workers N (tests/test_dynamo.py, both dialects)
    ns = p.parse_args(["--mooncake-port", "13334", "--workers", "2"])
    assert cli.settings_from_args(ns).mooncake_port == 13334
    with pytest.raises(cli.FlagError, match="is the V3 port"):
        p.parse_args(["--port", "13334", "--mooncake-port", "13334"])


def test_body_over_the_limit_is_413_and_the_port_keeps_serving():
    import falcon.testing as ft

    from kvconductor.state.conductor import Conductor, ConductorConfig
    from tests.helpers.api import RecordingSubs

    c = Conductor(
        ConductorConfig(index_impl="c", maintenance_interval=3600), subscriptions=RecordingSubs
    )
    c.start()
    try:
        client = ft.TestClient(mooncake.create_mooncake_app(c, max_body_bytes=64))
        big = {"model": "m", "block_size": 16, "token_ids": _tokens(100)}
        r = client.simulate_post("/query", json=big)
        assert r.status_code == 413
        assert r.json == {
            "error": "request body exceeds the limit of 64 bytes",
            "reason": "too_large",
        }
        r = client.simulate_post("/query", json={"model": "m", "block_size": 16, "token_ids": [1]})
        assert (r.status_code, r.json) == (200, {"instances": {}})
    finally:
        assert c.stop(5.0)


def test_answer_follows_registrations_of_either_dialect(srv):
    # The registered ranks a query lists are kept between queries; every change of the
    # registrations (over V3 too) is seen by the next query.
    m = "mc-follow"
    _register(srv, m, "instance-f", 0)
    assert list(_query(srv, m, 16)["instances"]["instance-f"]["dp"]) == ["0"]
    v3 = {"instance_id": "instance-f", "type": "vLLM", "modelname": m, "block_size": BS}
    assert srv.http.post("/register", json={**v3, "dp_rank": 1}).status_code == 201
    assert list(_query(srv, m, 16)["instances"]["instance-f"]["dp"]) == ["0", "1"]
    assert srv.http.post("/unregister", json={**v3, "dp_rank": 0}).status_code == 200
    assert list(_query(srv, m, 16)["instances"]["instance-f"]["dp"]) == ["1"]
    assert all(s["InstanceID"] != "instance-f" for s in srv.mc.get("/services").json()["services"])
    # a rank registered under another lora_name is listed only under it
    _register(srv, m, "instance-g", 0, lora_name="adapter-g")
    assert "instance-g" not in _query(srv, m, 16)["instances"]
    assert "instance-g" in _query(srv, m, 16, lora_name="adapter-g")["instances"]


def test_mooncake_publisher_is_a_pool_and_never_an_instance_of_the_answer(srv):
    # type "Mooncake" (a Mooncake store publisher): our cluster pool registration
    m = "mc-pool"
    _register(srv, m, "engine-p", 0)
    body = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "type": "Mooncake",
        "modelname": m,
        "instance_id": "mooncake-store",
        "block_size": BS,
        "dp_rank": 0,
    }
    r = srv.mc.post("/register", json=body)
    assert r.status_code == 200 and r.json()["instance_id"] == "mooncake-store"
    workers = srv.http.get("/workers").json()["workers"]
    store = [w for w in workers if w["instance_id"] == "mooncake-store"][0]
    # a store shared by its context, as Mooncake's conductor reads it (issue 36)
    assert store["endpoints"]["0"]["pool"] == {"kind": "shared"}
    assert list(_query(srv, m, 16)["instances"]) == ["engine-p"]


def test_services_drop_a_rank_re_registered_over_v3_with_another_model(srv):
    _register(srv, "mc-moved", "instance-m", 0, lora_name="adapter-m")
    assert any(s["InstanceID"] == "instance-m" for s in srv.mc.get("/services").json()["services"])
    v3 = {"instance_id": "instance-m", "type": "vLLM", "modelname": "mc-moved-2", "block_size": BS}
    assert srv.http.post("/register", json={**v3, "dp_rank": 0}).status_code == 201
    assert all(s["InstanceID"] != "instance-m" for s in srv.mc.get("/services").json()["services"])
    # now a V3 registration: listed for the base model of its new model, not the adapter
    assert "instance-m" in _query(srv, "mc-moved-2", 16)["instances"]
    assert _query(srv, "mc-moved-2", 16, lora_name="adapter-m") == {"instances": {}}


def test_api_key_guards_the_routes_that_change_state_and_services():
    """``create_mooncake_app(api_key=...)``: /register, /unregister and /services need the
    bearer token (the same check as V3's); /query and /health do not; a refusal changes
    nothing. ``open_services`` (``--open-workers``) opens /services only."""
    import falcon.testing as ft

    from kvconductor.state.conductor import Conductor, ConductorConfig
    from tests.helpers.api import RecordingSubs

    c = Conductor(
        ConductorConfig(index_impl="c", maintenance_interval=3600), subscriptions=RecordingSubs
    )
    c.start()
    try:
        client = ft.TestClient(mooncake.create_mooncake_app(c, api_key="k"))
        reg = dict(PROXY_REGISTRATIONS[0])
        unauthorized = {
            "error": "missing or invalid bearer token (Authorization: Bearer <api key>)",
            "reason": "unauthorized",
        }
        for headers in ({}, {"Authorization": "Bearer x"}, {"Authorization": "Token k"}):
            r = client.simulate_post("/register", json=reg, headers=headers)
            assert (r.status_code, r.json) == (401, unauthorized)
            assert r.headers["www-authenticate"] == 'Bearer realm="kv-conductor"'
        assert c.registry.instances == {}
        r = client.simulate_post("/register", json=reg, headers={"Authorization": "bearer  k "})
        assert r.status_code == 200, r.text
        unreg = {"instance_id": "prefill-a", "tenant_id": "tenant-a", "dp_rank": 0}
        assert client.simulate_post("/unregister", json=unreg).status_code == 401
        assert client.simulate_get("/services").status_code == 401
        assert client.simulate_get("/health").status_code == 200
        q = {"model": "test-model", "block_size": 16, "token_ids": [1], "tenant_id": "tenant-a"}
        assert client.simulate_post("/query", json=q).status_code == 200
        r = client.simulate_get("/services", headers={"Authorization": "Bearer k"})
        assert r.json["count"] == 1
        opened = ft.TestClient(mooncake.create_mooncake_app(c, api_key="k", open_services=True))
        # (another app: its own dialect's services, none yet)
        assert opened.simulate_get("/services").json == {"count": 0, "services": []}
        assert opened.simulate_post("/unregister", json=unreg).status_code == 401
        r = client.simulate_post("/unregister", json=unreg, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200, r.text
    finally:
        assert c.stop(5.0)


def test_cli_mooncake_port_open_flag():
    p = cli.build_parser(raise_errors=True)
    args = ["--mooncake-port", "13334", "--mooncake-port-open"]
    assert cli.settings_from_args(p.parse_args(args)).mooncake_open is True
    assert cli.settings_from_args(p.parse_args(args[:2])).mooncake_open is False
    with pytest.raises(cli.FlagError, match="--mooncake-port-open needs --mooncake-port"):
        p.parse_args(["--mooncake-port-open"])
