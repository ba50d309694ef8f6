"""Registry: endpoint resolution, HBM-IP index, register/unregister outcomes
(docs/api.md, POST /register)."""

from __future__ import annotations

import pytest

from kvconductor.keys import Medium, StoreBackend
from kvconductor.schema import RegisterRequest
from kvconductor.state.registry import (
    RegistrationError,
    Registry,
    drop_empty_urls,
    extract_ip,
    normalize_medium_endpoints,
    resolve_endpoints,
)

NPU, CPU, DISK, UNKNOWN = Medium.NPU, Medium.CPU, Medium.DISK, Medium.UNKNOWN


def reg(instance_id="vllm-prefill-1", dp_rank=0, **kw) -> RegisterRequest:
    kw.setdefault("engine_type", "vLLM")
    kw.setdefault("modelname", "qwen")
    kw.setdefault("block_size", 128)
    return RegisterRequest(instance_id=instance_id, dp_rank=dp_rank, **kw)


# -- extract_ip (the reference's tests) -------------------------------------------------------


def test_extract_ip_ipv4():
    assert extract_ip("tcp://10.0.0.1:5557") == "10.0.0.1"


def test_extract_ip_ipv6_bracketed():
    assert extract_ip("tcp://[::1]:5557") == "::1"
    assert extract_ip("tcp://[2001:db8::1]:15557") == "2001:db8::1"


def test_extract_ip_hostname():
    assert extract_ip("tcp://kv-conductor:13333") == "kv-conductor"


@pytest.mark.parametrize(
    "url",
    ["invalid", "tcp://", "tcp://[:5557", "http://10.0.0.1:80", "tcp://10.0.0.1", "tcp://[]:1", ""],
)
def test_extract_ip_invalid(url):
    assert extract_ip(url) is None


# -- store backends (the reference's tests) ------------------------------------------------------


def test_store_backend_from_str():
    assert StoreBackend.parse("mooncake") is StoreBackend.MOONCAKE
    assert StoreBackend.parse("MEMCACHE") is StoreBackend.MEMCACHE
    assert StoreBackend.parse("YuanRong") is StoreBackend.YUANRONG
    assert StoreBackend.parse("") is StoreBackend.UNKNOWN
    assert StoreBackend.parse("unknown") is StoreBackend.UNKNOWN
    # the reference's newest version indexes every backend's HBM IPs (node pools need them)
    assert [b.indexes_hbm_ip for b in StoreBackend] == [True, True, True, True]
    assert [b.is_pool_backend for b in StoreBackend] == [True, True, False, False]
    assert [b.has_node_pools for b in StoreBackend] == [False, False, True, True]
    assert [b.match_mode for b in StoreBackend] == ["ip_only", "ip_only", "none", "none"]


# -- endpoint resolution (docs/api.md, "Endpoint resolution") ------------------------------


def test_resolve_groups_keys_by_url():
    groups = resolve_endpoints(
        {"npu": "tcp://h:1", "cpu": "tcp://h:2", "disk": "tcp://h:2", "gpu": "tcp://h:1"}, None
    )
    assert groups == {"tcp://h:1": (NPU,), "tcp://h:2": (CPU, DISK)}


def test_resolve_unknown_medium_key():
    assert resolve_endpoints({"FS": "tcp://h:1"}, None) == {"tcp://h:1": (UNKNOWN,)}


def test_resolve_storage_key_is_disk():
    # vLLM >= 0.27 names its disk offloading tier STORAGE
    assert resolve_endpoints({"STORAGE": "tcp://h:1"}, None) == {"tcp://h:1": (DISK,)}


def test_resolve_legacy_endpoint_maps_all_media():
    assert resolve_endpoints({}, "tcp://h:1") == {"tcp://h:1": (NPU, CPU, DISK)}
    assert resolve_endpoints(None, "tcp://h:1") == {"tcp://h:1": (NPU, CPU, DISK)}


def test_resolve_medium_endpoints_win_over_endpoint():
    assert resolve_endpoints({"cpu": "tcp://h:2"}, "tcp://h:1") == {"tcp://h:2": (CPU,)}


def test_resolve_http_only():
    assert resolve_endpoints(None, None) == {}
    assert resolve_endpoints({}, None) == {}


@pytest.mark.parametrize(
    "medium_endpoints,endpoint,kept,kept_endpoint,dropped",
    [
        (None, "", {}, None, ["endpoint"]),
        ({}, "  ", {}, None, ["endpoint"]),
        (
            {"npu": "tcp://h:1", "cpu": ""},
            None,
            {"npu": "tcp://h:1"},
            None,
            ["medium_endpoints['cpu']"],
        ),
        ({"disk": ""}, "tcp://h:1", {}, "tcp://h:1", ["medium_endpoints['disk']"]),
        (
            {"xpu": "tcp://h:1", "cpu": "", "disk": " "},
            None,
            {"xpu": "tcp://h:1"},
            None,
            ["medium_endpoints['cpu']", "medium_endpoints['disk']"],
        ),
        ({"npu": "tcp://h:1"}, "tcp://h:2", {"npu": "tcp://h:1"}, "tcp://h:2", []),
    ],
)
def test_drop_empty_urls(medium_endpoints, endpoint, kept, kept_endpoint, dropped):
    assert drop_empty_urls(medium_endpoints, endpoint) == (kept, kept_endpoint, dropped)


def test_coordinator_register_post_with_empty_media_subscribes_the_rest(caplog):
    # The real Coordinator's register_post sends every medium key, unset ones as "".
    r = Registry()
    with caplog.at_level("WARNING", logger="kvconductor"):
        out = r.register(
            reg(medium_endpoints={"xpu": "tcp://10.0.0.1:5557", "cpu": "", "disk": ""})
        )
    assert [(c.url, c.default_media) for c in out.contexts] == [("tcp://10.0.0.1:5557", (NPU,))]
    assert r.get("vllm-prefill-1").endpoints[0].medium_endpoints == {"npu": "tcp://10.0.0.1:5557"}
    assert r.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0)]
    (line,) = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert "medium_endpoints['cpu'], medium_endpoints['disk']" in line
    assert "HTTP-only" not in line


@pytest.mark.parametrize(
    "kw",
    [
        {"medium_endpoints": {"xpu": "", "cpu": "", "disk": ""}},
        {"endpoint": ""},
        {"medium_endpoints": {"npu": " "}, "endpoint": ""},
    ],
)
def test_all_empty_urls_is_http_only(kw, caplog):
    r = Registry()
    with caplog.at_level("WARNING", logger="kvconductor"):
        out = r.register(reg(replay_endpoint="tcp://10.0.0.1:6667", **kw))
    assert out.contexts == [] and out.replay is None and not out.is_pool
    assert r.get("vllm-prefill-1").endpoints[0].medium_endpoints == {}
    assert "(HTTP-only registration)" in caplog.text
    # Exactly as when medium_endpoints is absent.
    plain = Registry().register(reg(replay_endpoint="tcp://10.0.0.1:6667"))
    assert (plain.contexts, plain.replay, plain.is_pool) == ([], None, False)


def test_normalized_keys():
    assert normalize_medium_endpoints(
        {"gpu": "u1", "memory": "u2", "ssd": "u3", "fs": "u4"}, None
    ) == {"npu": "u1", "cpu": "u2", "disk": "u3", "unknown": "u4"}
    assert normalize_medium_endpoints(None, "u") == {"npu": "u", "cpu": "u", "disk": "u"}
    assert normalize_medium_endpoints(None, None) == {}


# -- register -------------------------------------------------------------------------------------


def test_register_new_instance_contexts_and_replay():
    r = Registry()
    out = r.register(
        reg(medium_endpoints={"npu": "tcp://10.0.0.1:5557"}, replay_endpoint="tcp://10.0.0.1:6667")
    )
    assert not out.reregistered and not out.unchanged and out.drop_from is None
    (ctx,) = out.contexts
    assert ctx.url == "tcp://10.0.0.1:5557"
    assert (ctx.instance_id, ctx.dp_rank, ctx.model, ctx.tenant, ctx.block_size) == (
        "vllm-prefill-1",
        0,
        "qwen",
        "default",
        128,
    )
    assert ctx.default_media == (NPU,)
    assert ctx.store_backend is StoreBackend.MOONCAKE and not ctx.is_pool
    assert ctx.replay_endpoint == "tcp://10.0.0.1:6667" and ctx.engine_type == "vLLM"
    assert out.replay == ctx
    assert out.ips_added == ["10.0.0.1"]
    assert r.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0)]


def test_replay_per_instance_and_dp():
    # Every (instance, DP) gets its own replay, whether or not another DP of the instance
    # is registered (the reference replayed only the instance's first DP).
    r = Registry()
    rep = "tcp://10.0.0.1:6667"
    out0 = r.register(reg(replay_endpoint=rep, medium_endpoints={"npu": "tcp://10.0.0.1:5557"}))
    out1 = r.register(
        reg(
            dp_rank=1,
            replay_endpoint="tcp://10.0.0.1:6668",
            medium_endpoints={"npu": "tcp://10.0.0.1:5558"},
        )
    )
    assert (out0.replay.dp_rank, out0.replay.url) == (0, "tcp://10.0.0.1:5557")
    assert (out1.replay.dp_rank, out1.replay.url) == (1, "tcp://10.0.0.1:5558")
    assert not out1.reregistered and not out1.unchanged and out1.drop_from is None
    assert out1.replay.replay_endpoint == "tcp://10.0.0.1:6668"
    assert (
        Registry().register(reg(replay_endpoint="", medium_endpoints={"npu": "tcp://h:1"})).replay
        is None
    )
    # HTTP-only registration: no live subscription to replay into.
    assert Registry().register(reg(replay_endpoint=rep)).replay is None


def test_identical_reregistration_is_unchanged_and_replays_nothing():
    r = Registry()
    kw = {
        "replay_endpoint": "tcp://10.0.0.1:6667",
        "medium_endpoints": {"npu": "tcp://10.0.0.1:5557"},
    }
    assert not r.register(reg(**kw)).unchanged
    again = r.register(reg(**kw))
    assert again.reregistered and again.unchanged and again.replay is None
    assert again.drop_from is None
    assert r.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0)]
    # The Coordinator's register_post form (same URL plus empty keys) is the same registration.
    same = r.register(
        reg(
            replay_endpoint="tcp://10.0.0.1:6667",
            medium_endpoints={"xpu": "tcp://10.0.0.1:5557", "cpu": "", "disk": ""},
        )
    )
    assert same.unchanged and same.replay is None


@pytest.mark.parametrize(
    "change",
    [
        {"medium_endpoints": {"npu": "tcp://10.0.0.1:5599"}},
        {"replay_endpoint": "tcp://10.0.0.1:6699"},
        {"block_size": 64},
        {"modelname": "other"},
    ],
)
def test_changed_reregistration_resubscribes_and_replays(change):
    r = Registry()
    kw = {
        "replay_endpoint": "tcp://10.0.0.1:6667",
        "medium_endpoints": {"npu": "tcp://10.0.0.1:5557"},
    }
    r.register(reg(**kw))
    out = r.register(reg(**(kw | change)))
    assert out.reregistered and not out.unchanged
    assert out.replay is not None and out.replay.dp_rank == 0


def test_replay_prefers_the_npu_subscription():
    out = Registry().register(
        reg(
            store_backend="YuanRong",
            replay_endpoint="tcp://h:6667",
            medium_endpoints={"cpu": "tcp://h:2", "npu": "tcp://h:1"},
        )
    )
    assert out.replay.url == "tcp://h:1"


def test_pool_registration():
    r = Registry()
    out = r.register(
        reg(
            instance_id="mooncake-pool",
            endpoint="tcp://master:50001",
            modelname="default",
            store_backend="Mooncake",
        )
    )
    assert out.is_pool
    (ctx,) = out.contexts
    # NOTE: reference choice: a pool subscriber's default media are NPU, CPU and Disk.
    assert ctx.is_pool and ctx.default_media == (NPU, CPU, DISK)
    assert out.ips_added == [] and r.hbm_ip_index == {}
    entry = r.get("mooncake-pool")
    assert entry.endpoints[0].medium_endpoints == {
        "npu": "tcp://master:50001",
        "cpu": "tcp://master:50001",
        "disk": "tcp://master:50001",
    }


@pytest.mark.parametrize(
    "backend,medium_endpoints,endpoint,is_pool",
    [
        ("Mooncake", None, "tcp://m:1", True),
        ("memcache", None, "tcp://m:1", True),
        ("YuanRong", None, "tcp://m:1", False),
        ("Mooncake", {"npu": "tcp://m:1"}, "tcp://m:1", False),
        ("Mooncake", None, None, False),
    ],
)
def test_is_pool(backend, medium_endpoints, endpoint, is_pool):
    out = Registry().register(
        reg(store_backend=backend, medium_endpoints=medium_endpoints, endpoint=endpoint)
    )
    assert out.is_pool is is_pool


def test_hbm_ip_for_hbm_keys_of_every_backend():
    r = Registry()
    r.register(reg("a", store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    r.register(reg("b", store_backend="Mooncake", medium_endpoints={"cpu": "tcp://10.0.0.2:1"}))
    r.register(reg("c", store_backend="Memcache", medium_endpoints={"GPU": "tcp://10.0.0.3:1"}))
    r.register(reg("d", medium_endpoints={"xpu": "tcp://[2001:db8::1]:15557"}))
    r.register(reg("e", store_backend="other", medium_endpoints={"npu": "tcp://10.0.0.5:1"}))
    # an engine's legacy endpoint carries NPU; a Mooncake one is a pool (not indexed)
    r.register(reg("f", store_backend="YuanRong", endpoint="tcp://10.0.0.6:1"))
    r.register(reg("g", store_backend="Mooncake", endpoint="tcp://10.0.0.7:1"))
    # per-DP pool ports of the previous Coordinator generation: the npu key is indexed
    r.register(
        reg(
            "h",
            store_backend="YuanRong",
            medium_endpoints={"npu": "tcp://10.0.0.8:1", "cpu": "tcp://10.0.0.8:2"},
        )
    )
    assert r.hbm_ip_index == {
        "10.0.0.1": [("a", 0)],
        "10.0.0.3": [("c", 0)],
        "2001:db8::1": [("d", 0)],
        "10.0.0.5": [("e", 0)],
        "10.0.0.6": [("f", 0)],
        "10.0.0.8": [("h", 0)],
    }


@pytest.mark.parametrize(
    "backend,medium_endpoints,node_pool,node_ip",
    [
        # the newest Coordinator's node pool: CPU and Disk of one node, no HBM key
        (
            "YuanRong",
            {"cpu": "tcp://10.0.0.1:15558", "disk": "tcp://10.0.0.1:15558"},
            True,
            "10.0.0.1",
        ),
        ("yuanrong", {"disk": "tcp://[fd00::5]:15558"}, True, "fd00::5"),
        ("other", {"memory": "tcp://node-3:15558"}, True, "node-3"),
        (
            "YuanRong",
            {"cpu": "tcp://10.0.0.1:15558", "FS": "tcp://10.0.0.1:9"},
            True,
            "10.0.0.1",
        ),
        # any HBM key (an empty URL too) makes it a DP registration
        ("YuanRong", {"npu": "tcp://10.0.0.1:15557", "cpu": "tcp://10.0.0.1:15558"}, False, None),
        ("YuanRong", {"npu": "", "cpu": "tcp://10.0.0.1:15558"}, False, None),
        ("YuanRong", {"FS": "tcp://10.0.0.1:15558"}, False, None),
        ("YuanRong", {"STORAGE": "tcp://10.0.0.1:15558"}, True, "10.0.0.1"),
        # Mooncake/Memcache pools are cluster pools (legacy endpoint)
        ("Mooncake", {"cpu": "tcp://10.0.0.1:15558"}, False, None),
        # no URL left: HTTP-only
        ("YuanRong", {"cpu": ""}, False, None),
    ],
)
def test_node_pool_registration(backend, medium_endpoints, node_pool, node_ip):
    r = Registry()
    out = r.register(
        reg("yuanrong-pool-x-qwen", store_backend=backend, medium_endpoints=medium_endpoints)
    )
    ep = r.get("yuanrong-pool-x-qwen").endpoints[0]
    assert (ep.node_pool, ep.node_ip) == (node_pool, node_ip)
    assert out.is_pool is node_pool and ep.is_pool is node_pool
    assert all(
        (c.is_pool, c.node_pool, c.node_ip) == (node_pool, node_pool, node_ip) for c in out.contexts
    )
    if node_pool:
        assert r.hbm_ip_index == {}  # a node pool holds no HBM blocks


def test_node_pool_serves_the_dps_of_its_model_on_its_node():
    r = Registry()
    pool = {"cpu": "tcp://10.0.0.1:15558", "disk": "tcp://10.0.0.1:15558"}
    r.register(reg("yuanrong-pool-10.0.0.1-qwen", store_backend="YuanRong", medium_endpoints=pool))
    r.register(
        reg(
            "yuanrong-pool-10.0.0.1-llama",
            store_backend="YuanRong",
            medium_endpoints=pool,
            modelname="llama",
        )
    )
    r.register(reg("a", 0, store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    r.register(reg("a", 1, store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:2"}))
    r.register(reg("b", 0, store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.2:1"}))
    r.register(
        reg(
            "c",
            0,
            store_backend="YuanRong",
            medium_endpoints={"npu": "tcp://10.0.0.1:3"},
            modelname="llama",
        )
    )
    doc = {w["instance_id"]: w for w in r.snapshot()}
    assert doc["yuanrong-pool-10.0.0.1-qwen"]["endpoints"]["0"]["pool"] == {
        "kind": "node",
        "node_ip": "10.0.0.1",
        "serves": [{"instance_id": "a", "dp_rank": 0}, {"instance_id": "a", "dp_rank": 1}],
    }
    assert doc["yuanrong-pool-10.0.0.1-llama"]["endpoints"]["0"]["pool"]["serves"] == [
        {"instance_id": "c", "dp_rank": 0}
    ]
    assert "pool" not in doc["a"]["endpoints"]["0"]
    r.unregister("a", 0)
    doc = {w["instance_id"]: w for w in r.snapshot()}
    assert doc["yuanrong-pool-10.0.0.1-qwen"]["endpoints"]["0"]["pool"]["serves"] == [
        {"instance_id": "a", "dp_rank": 1}
    ]


def test_cluster_pool_shows_as_a_pool():
    r = Registry()
    r.register(reg("mooncake-pool", store_backend="Mooncake", endpoint="tcp://master:50001"))
    (w,) = r.snapshot()
    assert w["endpoints"]["0"]["pool"] == {"kind": "cluster"}


def test_hbm_ip_index_fans_out_dps_on_one_ip():
    r = Registry()
    r.register(reg("a", 0, medium_endpoints={"npu": "tcp://10.0.0.1:5557"}))
    r.register(reg("a", 1, medium_endpoints={"npu": "tcp://10.0.0.1:5558"}))
    r.register(reg("b", 0, medium_endpoints={"npu": "tcp://10.0.0.1:5559"}))
    assert r.hbm_ip_lookup("10.0.0.1") == [("a", 0), ("a", 1), ("b", 0)]
    assert r.hbm_ip_lookup("10.0.0.9") == []


def test_reregistration_same_backend_dedups_hbm_ip():
    # Unlike the reference: no duplicate entries after re-registering.
    r = Registry()
    for _ in range(3):
        out = r.register(reg(medium_endpoints={"npu": "tcp://10.0.0.1:5557"}))
    assert out.reregistered and out.drop_from is None
    assert r.hbm_ip_index == {"10.0.0.1": [("vllm-prefill-1", 0)]}


def test_reregistration_with_new_ip_removes_stale_ip():
    r = Registry()
    r.register(reg(medium_endpoints={"npu": "tcp://10.0.0.1:5557"}))
    out = r.register(reg(medium_endpoints={"npu": "tcp://10.0.0.2:5557"}))
    assert out.ips_removed == ["10.0.0.1"] and out.ips_added == ["10.0.0.2"]
    assert r.hbm_ip_index == {"10.0.0.2": [("vllm-prefill-1", 0)]}


def test_backend_change_drops_from_the_registered_index():
    r = Registry()
    r.register(reg(store_backend="YuanRong", medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    out = r.register(reg(store_backend="mooncake", medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    assert out.drop_from == ("qwen", "default")
    out = r.register(reg(store_backend="MOONCAKE", medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    assert out.drop_from is None  # case-insensitive comparison


def test_model_change_updates_the_instance_and_drops_old_data():
    # Unlike the reference: clean-up targets where the DP was registered, and the entry follows.
    r = Registry()
    r.register(reg(modelname="old", tenant_id="t1", block_size=16))
    out = r.register(reg(modelname="new", tenant_id="t2", block_size=16))
    assert out.drop_from == ("old", "t1")
    entry = r.get("vllm-prefill-1")
    assert (entry.model_name, entry.tenant_id, entry.block_size) == ("new", "t2", 16)
    assert r.index_key_of("vllm-prefill-1", 0) == ("new", "t2")
    out = r.register(reg(modelname="new", tenant_id="t2", block_size=32))
    assert out.drop_from == ("new", "t2") and r.get("vllm-prefill-1").block_size == 32


def test_each_dp_keeps_its_registered_index():
    r = Registry()
    r.register(reg(dp_rank=0, modelname="m1"))
    r.register(reg(dp_rank=1, modelname="m2"))
    assert r.index_key_of("vllm-prefill-1", 0) == ("m1", "default")
    assert r.index_key_of("vllm-prefill-1", 1) == ("m2", "default")
    assert r.index_key_of("vllm-prefill-1", 7) == ("m2", "default")  # unregistered DP
    assert r.protected() == {("m1", "default"), ("m2", "default")}


def test_register_validation_changes_nothing():
    r = Registry()
    r.register(reg(medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    with pytest.raises(RegistrationError):
        r.register(reg(instance_id="", medium_endpoints={"npu": "tcp://10.0.0.2:1"}))
    assert r.hbm_ip_index == {"10.0.0.1": [("vllm-prefill-1", 0)]}
    assert r.get("vllm-prefill-1").endpoints[0].medium_endpoints == {"npu": "tcp://10.0.0.1:1"}


def test_defaults_and_snapshot():
    r = Registry()
    r.register(
        reg(store_backend=None, tenant_id=None, medium_endpoints={"gpu": "tcp://10.0.0.1:5557"})
    )
    entry = r.get("vllm-prefill-1")
    assert entry.store_backend == "Mooncake" and entry.tenant_id == "default"
    assert r.snapshot() == [
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
    ]


# -- unregister --------------------------------------------------------------------------------


def test_unregister_unknown_instance():
    out = Registry().unregister("nope", 0)
    assert not out.found


def test_unregister_last_dp_removes_instance_and_ips():
    r = Registry()
    r.register(reg(dp_rank=0, medium_endpoints={"npu": "tcp://10.0.0.1:5557"}))
    r.register(reg(dp_rank=1, medium_endpoints={"npu": "tcp://10.0.0.1:5558"}))
    out = r.unregister("vllm-prefill-1", 0)
    assert out.found and not out.instance_removed
    assert out.ips_removed == ["10.0.0.1"] and out.index_key == ("qwen", "default")
    assert r.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 1)]
    out = r.unregister("vllm-prefill-1", 5)  # unregistered DP of a known instance
    assert out.found and out.ips_removed == [] and not out.instance_removed
    out = r.unregister("vllm-prefill-1", 1)
    assert out.instance_removed
    assert r.instances == {} and r.hbm_ip_index == {} and r.protected() == set()


def test_instance_info():
    r = Registry()
    r.register(reg(store_backend="YuanRong", medium_endpoints={"npu": "tcp://h:1"}))
    info = r.get("vllm-prefill-1").info()
    assert info["model_name"] == "qwen" and info["store_backend"] == "YuanRong"
    assert info["endpoints"][0]["medium_endpoints"] == {"npu": "tcp://h:1"}
    assert info["endpoints"][0]["model_name"] == "qwen"


# -- counts kept as registrations come and go ------------------------------------------------


def _recount(r: Registry) -> tuple[int, dict]:
    """What the counts must be: a scan of every registered DP (and the HBM-IP index's
    two directions agree)."""
    n, sizes = 0, {}
    for entry in r.instances.values():
        for ep in entry.endpoints.values():
            n += 1
            sizes.setdefault(ep.index_key, set()).add(ep.block_size)
    pairs = {(ip, p) for ip, ps in r.hbm_ip_index.items() for p in ps}
    assert pairs == {(ip, p) for p, ips in r._ips_of.items() for ip in ips}
    assert all(r.hbm_ip_index.values()) and all(r._ips_of.values())
    return n, {k: frozenset(v) for k, v in sizes.items()}


def test_counts_follow_register_unregister_and_rollback():
    """``registrations`` and ``block_sizes()`` (kept incrementally) equal a recount after
    every kind of change: new DPs, identical and changed re-registrations, unregistrations
    and the roll-back of a registration (new DP, new instance, changed DP)."""
    r = Registry()

    def check():
        assert (r.registrations, r.block_sizes()) == _recount(r)
        return r.registrations, r.block_sizes()

    ip = "tcp://10.0.0.1:{}".format
    r.register(reg("a", 0, block_size=16, medium_endpoints={"npu": ip(1)}))
    r.register(reg("a", 1, block_size=16, medium_endpoints={"npu": ip(2)}))
    r.register(reg("b", 0, block_size=32, medium_endpoints={"npu": ip(3)}))
    assert check() == (3, {("qwen", "default"): frozenset({16, 32})})
    r.register(reg("a", 0, block_size=16, medium_endpoints={"npu": ip(1)}))  # unchanged
    assert check() == (3, {("qwen", "default"): frozenset({16, 32})})
    r.register(reg("b", 0, block_size=16, medium_endpoints={"npu": ip(3)}))  # 32 gone
    assert check() == (3, {("qwen", "default"): frozenset({16})})
    r.register(reg("a", 1, modelname="m2", block_size=64))  # to another index, HTTP-only
    assert check() == (3, {("qwen", "default"): frozenset({16}), ("m2", "default"): {64}})
    # roll-backs: a changed DP, a new DP of a known instance, a new instance
    for req in (
        reg("a", 1, modelname="m3", block_size=8, medium_endpoints={"npu": ip(9)}),
        reg("a", 5, block_size=128, medium_endpoints={"npu": ip(5)}),
        reg("c", 0, block_size=256),
    ):
        before = (check(), {k: list(v) for k, v in r.hbm_ip_index.items()})
        saved = r.save_dp(req.instance_id, req.dp_rank)
        r.register(req)
        assert check() != before[0]
        r.restore_dp(saved)
        assert (check(), {k: list(v) for k, v in r.hbm_ip_index.items()}) == before
    r.unregister("a", 1)
    assert check() == (2, {("qwen", "default"): frozenset({16})})
    r.unregister("a", 7)  # a DP never registered
    assert check() == (2, {("qwen", "default"): frozenset({16})})
    r.unregister("a", 0)
    r.unregister("b", 0)
    assert check() == (0, {}) and r.instances == {} and r.hbm_ip_index == {}


def test_shared_store_registration_and_its_context():
    """A shared store (issue 36): only a cluster pool may be one; its DPs are the engine
    DPs of its (model, tenant) with its block size."""
    from kvconductor.state.registry import RegistrationError

    r = Registry()
    r.register(reg("a", medium_endpoints={"npu": "tcp://10.0.0.1:5557"}, tenant_id="A"))
    r.register(reg("a", 1, medium_endpoints={"npu": "tcp://10.0.0.1:5558"}, tenant_id="A"))
    r.register(reg("b", medium_endpoints={"npu": "tcp://10.0.0.2:5557"}, tenant_id="B"))
    r.register(reg("c", block_size=16, tenant_id="A"))
    out = r.register(reg("store", endpoint="tcp://10.0.0.9:5557", tenant_id="A", shared_store=True))
    assert out.is_pool and out.contexts[0].shared_store
    assert r.snapshot()[-1]["endpoints"]["0"]["pool"] == {"kind": "shared"}
    assert r.context_dps("qwen", "A", 128) == [("a", 0), ("a", 1)]
    assert r.context_dps("qwen", "B", 128) == [("b", 0)]
    assert r.context_dps("qwen", "A", 16) == [("c", 0)]
    for bad in (
        reg("e", medium_endpoints={"npu": "tcp://10.0.0.1:5559"}, shared_store=True),
        reg(
            "y",
            store_backend="YuanRong",
            medium_endpoints={"cpu": "tcp://10.0.0.1:1"},
            shared_store=True,
        ),
    ):
        with pytest.raises(RegistrationError, match="shared_store applies to a cluster pool"):
            r.register(bad)
