"""Applying decoded events to a real Index (both implementations) via a fake conductor."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvconductor._hash import lora_seed
from kvconductor.ingest.apply import Applier, kind_rejected
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.stats import WarnLimiter
from kvconductor.keys import Medium, StoreBackend, WorkerKey
from tests.helpers.publishers import FakeConductor, InstanceInfo, hits, schema

BS = 4
V23 = schema("vllm", "0.23.0")
V33 = schema("vllm", "0.33.0")
SGL = schema("sglang", "0.5.23")
TOK = list(range(100, 116))  # 4 blocks of 4


@pytest.fixture
def conductor(impl):
    return FakeConductor(impl)


def ctx(
    iid="vllm-prefill-a",
    dp=0,
    media=(Medium.NPU,),
    is_pool=False,
    model="m",
    tenant="t",
    backend=StoreBackend.MOONCAKE,
    bs=BS,
):
    return SubscriberContext(
        instance_id=iid,
        dp_rank=dp,
        url="tcp://127.0.0.1:1",
        model=model,
        tenant=tenant,
        block_size=bs,
        default_media=tuple(media),
        store_backend=backend,
        is_pool=is_pool,
    )


def chain(s, tokens=TOK, start=0, n=None, parent=None, base=1000, **kw):
    """A BlockStored of blocks [start, start+n) of ``tokens`` with hashes base+i."""
    nb = len(tokens) // BS if n is None else n
    hs = [base + i for i in range(start, start + nb)]
    return s.stored(hs, parent, tokens[start * BS : (start + nb) * BS], BS, **kw)


def test_hbm_store_and_query(conductor):
    a = Applier(ctx(dp=2), conductor)
    assert a.apply_payload(
        V23.batch(
            [chain(V23, medium="GPU", group_idx=0, kv_cache_spec_kind="full_attention")], dp=7
        )
    )
    idx = conductor.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {
        ("vllm-prefill-a", 2): (4, 0, 0)
    }  # subscription's DP, not the batch's
    assert hits(idx, TOK[:8] + [1, 2, 3, 4], BS) == {("vllm-prefill-a", 2): (2, 0, 0)}
    assert a.stats.batches == 1 and a.stats.events == 1 and a.stats.blocks == 4
    # chained continuation under a parent
    more = list(range(500, 508))
    a.apply_payload(
        V33.batch([V33.stored([2000, 2001], 1003, more, BS, medium="GPU", group_idx=0)])
    )
    assert hits(idx, TOK + more, BS) == {("vllm-prefill-a", 2): (6, 0, 0)}


def test_v09_no_medium_goes_to_hbm_only(conductor):
    v09 = schema("vllm", "0.9.2")
    a = Applier(ctx(media=(Medium.NPU, Medium.CPU, Medium.DISK)), conductor)
    a.apply_payload(v09.batch([chain(v09)]))
    idx = conductor.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {("vllm-prefill-a", 0): (4, 0, 0)}
    s = idx.summary()
    assert s["hbm_blocks"] == 4 and s["cpu_blocks"] == 0 and s["disk_blocks"] == 0


@pytest.mark.parametrize("fast", [True, False])
def test_block_size_filter_and_zero(conductor, fast, caplog):
    caplog.set_level("WARNING", logger="kvconductor.ingest")
    a = Applier(ctx(), conductor, warn=WarnLimiter(), fast=fast)
    a.apply_payload(V33.batch([V33.stored([1, 2], None, TOK[:16], 8, medium="GPU")]))
    assert a.stats.dropped == {"block_size_mismatch": 1}
    # not silent: the WARN line says what to fix
    assert [r.getMessage() for r in caplog.records] == [
        f"{a.source}: dropped (block_size_mismatch) BlockStored with block_size 8, but this "
        "DP was registered with block_size 4 and none of its blocks is indexed; register "
        "the engine's block size (vLLM --block-size)"
    ]
    # block_size 0: accepted, engine hashes double as content hashes
    a.apply_payload(V33.batch([V33.stored([11, 12], None, [], 0, medium="GPU")]))
    idx = conductor.indexes[("m", "t")]
    assert idx.summary()["hbm_blocks"] == 2
    assert hits(idx, TOK, BS) == {}
    assert {h.npu_blocks for h in idx.query_by_hash([11, 12]).hits} == {2}
    # once blocks are indexed, a mismatch is a partial prompt tail (vLLM >= 0.24): no WARN
    a._warn = WarnLimiter()
    a.apply_payload(V33.batch([V33.stored([13], 12, TOK[4:6], 2, medium="GPU")]))
    assert a.stats.dropped == {"block_size_mismatch": 2} and len(caplog.records) == 1


@pytest.mark.parametrize(
    "kind,accepted",
    [
        (None, True),
        ("full_attention", True),
        ("mla_attention", True),
        ("sink_full_attention", True),
        ("something_new", True),
        ("sliding_window", False),
        ("SlidingWindow_MLA", False),
        ("mamba", False),
        ("chunked_local_attention", False),
        ("encoder_only_attention", False),
        ("cross_attention", False),
    ],
)
def test_attention_kind_filter(conductor, kind, accepted):
    assert kind_rejected(kind) is (not accepted)
    a = Applier(ctx(), conductor)
    a.apply_payload(V23.batch([chain(V23, medium="GPU", kv_cache_spec_kind=kind)]))
    got = hits(conductor.indexes[("m", "t")], TOK, BS)
    assert got == ({("vllm-prefill-a", 0): (4, 0, 0)} if accepted else {})
    assert a.stats.dropped == ({} if accepted else {"attention_kind": 1})


def test_lora_salt(conductor):
    a = Applier(ctx(), conductor)
    a.apply_payload(V33.batch([chain(V33, medium="GPU", lora_name="sql-adapter")]))
    idx = conductor.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {}
    assert hits(idx, TOK, BS, lora_seed("sql-adapter")) == {("vllm-prefill-a", 0): (4, 0, 0)}


def test_removed_and_cleared(conductor):
    a = Applier(ctx(), conductor)
    a.apply_payload(V33.batch([chain(V33, medium="GPU", group_idx=0)]))
    idx = conductor.indexes[("m", "t")]
    a.apply_payload(V33.batch([V33.removed([1003], medium="GPU", group_idx=0)]))
    assert hits(idx, TOK, BS) == {("vllm-prefill-a", 0): (3, 0, 0)}
    a.apply_payload(V33.batch([V33.cleared()]))
    assert hits(idx, TOK, BS) == {} and idx.summary()["hbm_blocks"] == 0


def test_sglang_negative_hashes_roundtrip(conductor):
    a = Applier(ctx(), conductor)
    evs = [
        SGL.stored([-5], None, TOK[:4], BS, medium="GPU"),
        SGL.stored([-6], -5, TOK[4:8], BS, medium="GPU"),
    ]
    a.apply_payload(SGL.batch(evs))
    idx = conductor.indexes[("m", "t")]
    assert hits(idx, TOK[:8], BS) == {("vllm-prefill-a", 0): (2, 0, 0)}
    a.apply_payload(SGL.batch([SGL.removed([-6], medium="GPU")]))
    assert hits(idx, TOK[:8], BS) == {("vllm-prefill-a", 0): (1, 0, 0)}


def test_parent_not_found_is_counted(conductor):
    a = Applier(ctx(), conductor)
    a.apply_payload(V33.batch([V33.stored([7], 999, TOK[:4], BS, medium="GPU")]))
    assert a.stats.dropped == {"parent_not_found": 1}


def _pool_ctx(**kw):
    return ctx(
        iid="mooncake-pool",
        media=(Medium.NPU, Medium.CPU, Medium.DISK),
        is_pool=True,
        model="default",
        **kw,
    )


def _mooncake(events, dp=0):
    return msgspec.msgpack.encode([1782281033484, events, dp])


@pytest.mark.parametrize("pool_first", [False, True])
def test_two_phase_offload_then_pool(conductor, pool_first):
    """Engine offload (Phase 1) + Mooncake pool confirmation (Phase 2) in either order."""
    conductor.ip_index["10.0.0.1"] = [
        ("vllm-prefill-a", 0),
        ("vllm-prefill-a", 1),
        ("vllm-prefill-a", 0),
    ]
    conductor.instances["vllm-prefill-a"] = InstanceInfo("m", "t", BS)
    eng = Applier(ctx(), conductor)
    pool = Applier(_pool_ctx(), conductor)
    # blocks 0-1 on GPU, 2-3 offloaded to CPU
    gpu = chain(V33, n=2, medium="GPU")
    cpu = chain(V33, start=2, n=2, parent=1001, medium="CPU")
    confirm = _mooncake(
        [
            {
                "event_id": 1,
                "event_type": "stored",
                "backend_id": "10.0.0.1",
                "medium": "cpu",
                "seq_hashes": [1002, 1003],
            }
        ]
    )
    eng.apply_payload(V33.batch([gpu]))
    if pool_first:
        pool.apply_payload(confirm)
        eng.apply_payload(V33.batch([cpu]))
    else:
        eng.apply_payload(V33.batch([cpu]))
        pool.apply_payload(confirm)
    # FIX: pool registered with model "default" but confirmations land in the
    # instance's index ("m") via instance_info (the reference used the pool's index)
    assert ("default", "t") not in conductor.indexes or conductor.indexes[
        ("default", "t")
    ].is_empty()
    idx = conductor.indexes[("m", "t")]
    # DP 1 on the same node got the CPU blocks too, but without its own HBM prefix they
    # are not reachable (no cross-DP borrowing, unlike the reference)
    assert hits(idx, TOK, BS) == {("vllm-prefill-a", 0): (2, 2, 0)}
    assert idx.summary()["cpu_blocks"] == 4
    # pool removal of block 3 for every DP on the node
    pool.apply_payload(
        _mooncake(
            [
                {
                    "event_type": "removed",
                    "backend_id": "10.0.0.1",
                    "medium": "cpu",
                    "seq_hashes": [1003],
                }
            ]
        )
    )
    assert hits(idx, TOK, BS)[("vllm-prefill-a", 0)] == (2, 1, 0)
    pool.apply_payload(
        _mooncake([{"event_type": "cleared", "backend_id": "10.0.0.1", "medium": "cpu"}])
    )
    assert hits(idx, TOK, BS)[("vllm-prefill-a", 0)] == (2, 0, 0)


def test_pool_unknown_ip_and_model_override(conductor):
    conductor.ip_index["10.0.0.1"] = [("vllm-prefill-a", 0), ("vllm-prefill-b", 0)]
    conductor.instances["vllm-prefill-a"] = InstanceInfo("other", "x", BS)
    conductor.instances["vllm-prefill-b"] = InstanceInfo("m", "t", BS)
    pool = Applier(_pool_ctx(), conductor)
    pool.apply_payload(
        _mooncake(
            [
                {"event_type": "stored", "backend_id": "10.9.9.9", "seq_hashes": [1]},
                {"event_type": "stored", "seq_hashes": [1]},
                {"event_type": "stored", "backend_id": "10.0.0.1"},
                {"event_type": "updated", "backend_id": "10.0.0.1", "seq_hashes": [1]},
            ]
        )
    )
    assert pool.stats.dropped == {
        "backend_id_not_in_hbm_ip_index": 1,
        "no_backend_id": 1,
        "no_hashes": 1,
        "unknown_event_type": 1,
    }
    # explicit model_name/tenant_id win, and only the node's DPs registered in them get
    # the blocks (vllm-prefill-b, of ("m", "t"), does not); no medium -> the pool's
    # non-HBM default media
    pool.apply_payload(
        msgspec.msgpack.encode(
            {
                "events": [
                    {
                        "event_type": "stored",
                        "backend_id": "10.0.0.1",
                        "seq_hashes": ["0x10"],
                        "model_name": "other",
                        "tenant_id": "x",
                    }
                ]
            }
        )
    )
    idx = conductor.indexes[("other", "x")]
    assert idx.summary()["pending_pool"] == 2  # waiting on CPU and DISK workers, none on NPU
    keys = set(idx.workers_of("vllm-prefill-a", 0))
    assert keys == {
        WorkerKey("vllm-prefill-a", "vllm-prefill-a", 0, Medium.CPU),
        WorkerKey("vllm-prefill-a", "vllm-prefill-a", 0, Medium.DISK),
    }
    assert not idx.workers_of("vllm-prefill-b", 0) and ("m", "t") not in conductor.indexes
    assert pool.stats.dropped.get("no_dp_of_pool_context") is None


def _node_pool_ctx(node_ip="10.0.0.1", model="m"):
    return SubscriberContext(
        instance_id=f"yuanrong-pool-{node_ip}-{model}",
        dp_rank=0,
        url=f"tcp://{node_ip}:15558",
        model=model,
        tenant="t",
        block_size=BS,
        default_media=(Medium.CPU, Medium.DISK),
        store_backend=StoreBackend.YUANRONG,
        is_pool=True,
        node_pool=True,
        node_ip=node_ip,
    )


def test_node_pool_credits_the_dps_of_its_model_on_its_node(conductor, caplog):
    """A YuanRong node pool: every DP of its (model, tenant) with an HBM URL on its node,
    whatever backend_id form the event names; other models' DPs there are not its."""
    caplog.set_level("WARNING", logger="kvconductor.ingest")
    conductor.ip_index["10.0.0.1"] = [("a", 0), ("a", 1), ("x", 0)]
    conductor.instances["a"] = InstanceInfo("m", "t", BS, "YuanRong")
    conductor.instances["x"] = InstanceInfo("other", "t", BS, "YuanRong")
    eng = Applier(ctx(iid="a", backend=StoreBackend.YUANRONG), conductor)
    pool = Applier(_node_pool_ctx(), conductor, warn=WarnLimiter(0))
    eng.apply_payload(
        V33.batch(
            [chain(V33, n=1, medium="GPU"), chain(V33, start=1, n=3, parent=1000, medium="CPU")]
        )
    )
    pool.apply_payload(
        _mooncake(
            [
                # backend_id as a URL or host:port names the node
                {
                    "event_type": "stored",
                    "backend_id": "tcp://10.0.0.1:15558",
                    "medium": "cpu",
                    "seq_hashes": [1001],
                },
                {
                    "event_type": "stored",
                    "backend_id": "10.0.0.1:15558",
                    "medium": "cpu",
                    "seq_hashes": [1002],
                },
                # none: the node of the pool's URL
                {"event_type": "stored", "medium": "disk", "seq_hashes": [1003]},
            ]
        )
    )
    idx = conductor.indexes[("m", "t")]
    # DP 1 holds them too, unreachable without its own HBM prefix
    assert hits(idx, TOK, BS) == {("a", 0): (1, 2, 1)}
    assert set(idx.workers_of("a", 1)) == {
        WorkerKey("a", "a", 1, Medium.CPU),
        WorkerKey("a", "a", 1, Medium.DISK),
    }
    assert not idx.workers_of("x", 0) and ("other", "t") not in conductor.indexes
    assert not idx.workers_of("yuanrong-pool-10.0.0.1-m", 0)
    # a backend_id that names no registered node (the pool daemon's): the pool's node
    pool.apply_payload(
        _mooncake(
            [
                {
                    "event_type": "stored",
                    "backend_id": "10.9.9.9",
                    "medium": "cpu",
                    "seq_hashes": [1003],
                }
            ]
        )
    )
    assert hits(idx, TOK, BS) == {("a", 0): (1, 3, 0)}
    # an event naming its model serves that model's DPs of the node
    pool.apply_payload(
        _mooncake(
            [{"event_type": "stored", "medium": "cpu", "model_name": "other", "seq_hashes": [7]}]
        )
    )
    assert hits(idx, TOK, BS) == {("a", 0): (1, 3, 0)}
    other = conductor.indexes[("other", "t")]
    assert other.summary()["pending_pool"] == 1  # awaits x's engine's offload of block 7
    assert set(other.workers_of("x", 0)) == {WorkerKey("x", "x", 0, Medium.CPU)}
    assert pool.stats.dropped == {}
    assert caplog.records == []
    # a node with no DP of the pool's model: dropped, counted and said
    lone = Applier(_node_pool_ctx("10.0.0.2"), conductor, warn=WarnLimiter(0))
    lone.apply_payload(_mooncake([{"event_type": "stored", "seq_hashes": [1001]}]))
    assert lone.stats.dropped == {"no_dp_on_node": 1}
    (rec,) = caplog.records
    assert "dropped (no_dp_on_node) no DP is registered with an HBM URL on 10.0.0.2" in (
        rec.getMessage()
    )


def test_yuanrong_per_port_media(conductor):
    """YuanRong: the cpu port and the disk port publish pool events tied to the registration."""
    eng = Applier(ctx(iid="yr-1", dp=1, backend=StoreBackend.YUANRONG), conductor)
    cpu_port = Applier(
        ctx(iid="yr-1", dp=1, media=(Medium.CPU,), backend=StoreBackend.YUANRONG), conductor
    )
    disk_port = Applier(
        ctx(iid="yr-1", dp=1, media=(Medium.DISK,), backend=StoreBackend.YUANRONG), conductor
    )
    eng.apply_payload(
        V33.batch(
            [chain(V33, n=1, medium="GPU"), chain(V33, start=1, n=3, parent=1000, medium="CPU")]
        )
    )
    # backend_id and dp_rank of the event are ignored: the port belongs to (yr-1, dp 1)
    cpu_port.apply_payload(
        _mooncake(
            [
                {
                    "event_type": "stored",
                    "backend_id": "whatever",
                    "dp_rank": 5,
                    "seq_hashes": [1001, 1002],
                }
            ]
        )
    )
    disk_port.apply_payload(_mooncake([{"event_type": "stored", "seq_hashes": [1001, 1002, 1003]}]))
    idx = conductor.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {("yr-1", 1): (1, 2, 1)}


def test_undecodable_payloads_are_counted(conductor):
    a = Applier(ctx(), conductor)
    rng = random.Random(3)
    for _ in range(500):
        a.apply_payload(bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 50))))
    good = V33.batch([chain(V33, medium="GPU")])
    for cut in range(len(good)):
        a.apply_payload(good[:cut])
    a.apply_payload(msgspec.msgpack.encode([1.0, [["BlockStored", "x", None, [1], 4]], 0]))
    assert sum(a.stats.dropped.values()) >= 500
    a.apply_payload(good)
    assert hits(conductor.indexes[("m", "t")], TOK, BS) == {("vllm-prefill-a", 0): (4, 0, 0)}


def test_clear_all(conductor):
    conductor.ip_index["10.0.0.1"] = [("vllm-prefill-a", 0)]
    eng = Applier(ctx(), conductor)
    eng.apply_payload(V33.batch([chain(V33, medium="GPU")]))
    assert eng.clear_all() == 4
    assert hits(conductor.indexes[("m", "t")], TOK, BS) == {}
    conductor.instances["vllm-prefill-a"] = InstanceInfo("m", "t", BS)
    pool = Applier(_pool_ctx(), conductor)
    eng.apply_payload(V33.batch([chain(V33, medium="CPU")]))
    pool.apply_payload(
        _mooncake(
            [
                {
                    "event_type": "stored",
                    "backend_id": "10.0.0.1",
                    "medium": "cpu",
                    "seq_hashes": [1000, 1001, 1002, 1003],
                }
            ]
        )
    )
    assert hits(conductor.indexes[("m", "t")], TOK, BS) == {("vllm-prefill-a", 0): (0, 4, 0)}
    assert pool.clear_all() == 4
    assert hits(conductor.indexes[("m", "t")], TOK, BS) == {}


def test_instance_info_dict_form(conductor):
    """The service's instance_info returns a dict (model_name/tenant_id, per-DP endpoints)."""
    from kvconductor.ingest.poolroute import registered_index

    class DictConductor(FakeConductor):
        def instance_info(self, iid):
            return {
                "instance_id": iid,
                "model_name": "m-old",
                "tenant_id": "t",
                "endpoints": {0: {"model_name": "m", "tenant_id": "t"}},
            }

    c = DictConductor(conductor.impl)
    c.ip_index["10.0.0.1"] = [("vllm-prefill-a", 0)]
    pool = Applier(_pool_ctx(), c)
    pool.apply_payload(
        _mooncake(
            [{"event_type": "stored", "backend_id": "10.0.0.1", "medium": "cpu", "seq_hashes": [5]}]
        )
    )
    assert set(c.indexes) == {("m", "t")} and c.indexes[("m", "t")].summary()["pending_pool"] == 1
    assert registered_index(None, 0) == (None, None)
    assert registered_index({"model_name": "a", "tenant_id": "b"}, 3) == ("a", "b")
    assert registered_index(
        {
            "model_name": "a",
            "tenant_id": "b",
            "endpoints": {"3": {"model_name": "c", "tenant_id": "d"}},
        },
        3,
    ) == ("c", "d")
    assert registered_index(InstanceInfo("x", "y", 4), 0) == ("x", "y")


# -- bounds on one message and one source -------------------------------------------------------


@pytest.mark.parametrize("fast", [True, False])
def test_message_and_source_limits_refuse_whole_messages(conductor, fast):
    from kvconductor.ingest.stats import Limits

    lim = Limits(max_message_bytes=4096, max_blocks_per_message=4, max_blocks_per_source=6)
    a = Applier(ctx(), conductor, fast=fast, limits=lim)
    big = list(range(1000, 1000 + 5 * BS))
    assert not a.apply_payload(V33.batch([chain(V33, big, medium="GPU")]))  # 5 blocks > 4
    assert a.stats.dropped == {"message_too_many_blocks": 1}
    assert ("m", "t") not in conductor.indexes or hits(conductor.indexes[("m", "t")], big, BS) == {}
    assert a.apply_payload(V33.batch([chain(V33, medium="GPU")]))  # 4 blocks: ok
    idx = conductor.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {("vllm-prefill-a", 0): (4, 0, 0)}
    more = list(range(500, 500 + 3 * BS))
    # 4 held + 3 > 6: the whole message is refused, nothing of it applied
    assert not a.apply_payload(
        V33.batch([V33.stored([2000, 2001, 2002], 1003, more, BS, medium="GPU")])
    )
    assert a.stats.dropped["source_block_limit"] == 1
    assert hits(idx, TOK + more, BS) == {("vllm-prefill-a", 0): (4, 0, 0)}
    assert a.apply_payload(
        V33.batch([V33.stored([2000, 2001], 1003, more[:8], BS, medium="GPU")])
    )  # 4 + 2 = 6: ok
    assert hits(idx, TOK + more, BS) == {("vllm-prefill-a", 0): (6, 0, 0)}
    # Bytes are checked before anything is decoded.
    huge = V33.batch([chain(V33, medium="GPU")] * 200)
    assert len(huge) > 4096 and not a.apply_payload(huge)
    assert a.stats.dropped["message_too_large"] == 1
    assert a.stats.blocks == 6


def test_source_limit_counts_blocks_held_before_this_applier(conductor):
    """A new Applier (a re-registration's hand-over) reads what its worker already holds
    on its first message: the per-source bound is not reset by a hand-over."""
    from kvconductor.ingest.stats import Limits

    a1 = Applier(ctx(), conductor, limits=Limits(max_blocks_per_source=100))
    assert a1.apply_payload(V33.batch([chain(V33, medium="GPU")]))  # 4 held
    a2 = Applier(ctx(), conductor, limits=Limits(max_blocks_per_source=6))
    more = list(range(500, 500 + 3 * BS))
    assert not a2.apply_payload(
        V33.batch([V33.stored([2000, 2001, 2002], 1003, more, BS, medium="GPU")])
    )  # 4 + 3 > 6
    assert a2.stats.dropped == {"source_block_limit": 1}
    assert a2.apply_payload(
        V33.batch([V33.stored([2000, 2001], 1003, more[:8], BS, medium="GPU")])
    )  # 4 + 2 = 6
    assert not a2.apply_payload(
        V33.batch([V33.stored([2002], 2001, more[8:], BS, medium="GPU")])
    )  # 6 + 1 > 6
    assert a2.stats.dropped == {"source_block_limit": 2}
