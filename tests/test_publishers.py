"""Publishers beyond vLLM's GPU events, tested with the publishers' own code where pip has it.

vLLM disk offload: the offloading connector of vLLM >= 0.27 announces blocks on its
secondary tier with ``medium="STORAGE"`` (``vllm.distributed.kv_events.MEDIUM_STORAGE``);
that is the Disk tier, with the Disk tier's semantics (docs/api.md, "Tiers and counts").
The events are built and encoded by vLLM 0.33.0's own classes and, over tcp, sent by its
own ``ZmqEventPublisher`` (tests/helpers/realpub.py).
"""

from __future__ import annotations

import time

import msgspec
import pytest

from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.keys import Medium, StoreBackend, parse_medium
from tests.helpers.api import events, query, register, stored
from tests.helpers.harness import Harness
from tests.helpers.publishers import (
    FakeConductor,
    InstanceInfo,
    PoolPublisher,
    free_tcp_port,
    hits,
    mooncake_tuple,
    wait_until,
)
from tests.helpers.realpub import vllm_kv_events

BS = 4
IID = "vllm-prefill-a"
TOK = list(range(100, 116))  # 4 blocks of 4
NODE = "127.0.0.1"


def _ctx(iid=IID, media=(Medium.NPU,), is_pool=False, model="m", url="tcp://127.0.0.1:1", **kw):
    return SubscriberContext(
        instance_id=iid,
        dp_rank=0,
        url=url,
        model=model,
        tenant="t",
        block_size=BS,
        default_media=tuple(media),
        store_backend=StoreBackend.MOONCAKE,
        is_pool=is_pool,
        **kw,
    )


def _pool_ctx(url="tcp://127.0.0.1:2"):
    return _ctx(
        "mooncake-pool",
        media=(Medium.NPU, Medium.CPU, Medium.DISK),
        is_pool=True,
        model="default",
        url=url,
    )


def _vllm_stored(k, hashes, parent, tokens, medium):
    """A BlockStored as vLLM 0.33's offloading connector builds its self-describing
    events (offloading/events.py: tokens, per-block hashes, the chunk's parent)."""
    return k.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def _vllm_batch(k, events) -> bytes:
    """What ZmqEventPublisher._publisher_thread sends: ``Encoder().encode(batch)``."""
    return msgspec.msgpack.Encoder().encode(
        k.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
    )


def _confirm(hashes, medium, kind="stored"):
    return mooncake_tuple(
        [{"event_id": 1, "event_type": kind, "backend_id": NODE, "medium": medium,
          "seq_hashes": hashes}]
    )  # fmt: skip


@pytest.fixture
def fake(impl):
    c = FakeConductor(impl)
    c.ip_index[NODE] = [(IID, 0)]
    c.instances[IID] = InstanceInfo("m", "t", BS)
    return c


# --- vLLM disk offload (STORAGE) ------------------------------------------------------------


def test_vllm_storage_medium_is_disk():
    k = vllm_kv_events()
    assert k.MEDIUM_STORAGE == "STORAGE"
    assert parse_medium(k.MEDIUM_STORAGE) is Medium.DISK
    assert parse_medium("storage") is Medium.DISK
    assert parse_medium(k.MEDIUM_CPU) is Medium.CPU
    assert parse_medium(k.MEDIUM_GPU) is Medium.NPU
    assert parse_medium("Storage") is Medium.UNKNOWN  # the table is case-sensitive


def test_vllm_033_storage_offload_joins_into_the_disk_tier(fake):
    k = vllm_kv_events()
    eng = Applier(_ctx(), fake)
    pool = Applier(_pool_ctx(), fake)
    # blocks 0-1 in HBM, blocks 2-3 offloaded to the engine's STORAGE tier
    assert eng.apply_payload(
        _vllm_batch(
            k,
            [
                _vllm_stored(k, [1000, 1001], None, TOK[:8], k.MEDIUM_GPU),
                _vllm_stored(k, [1002, 1003], 1001, TOK[8:], k.MEDIUM_STORAGE),
            ],
        )
    )
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 0)}  # phase 1 only: not yet held
    assert idx.summary()["offload"] == 2
    # the pool confirms them on Disk: the Disk tier continues the DP's HBM run
    assert pool.apply_payload(_confirm([1002, 1003], "disk"))
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 2)}
    # vLLM's BlockRemoved on STORAGE evicts from the Disk tier
    assert eng.apply_payload(
        _vllm_batch(k, [k.BlockRemoved(block_hashes=[1003], medium="STORAGE")])
    )
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 1)}
    # Disk blocks 2-3 continue the DP's HBM run: without HBM block 1 they count no more
    assert eng.apply_payload(_vllm_batch(k, [k.BlockRemoved(block_hashes=[1001], medium="GPU")]))
    assert hits(idx, TOK, BS) == {(IID, 0): (1, 0, 0)}


def test_pool_confirmation_with_storage_medium_lands_on_disk_not_hbm(fake):
    k = vllm_kv_events()
    eng = Applier(_ctx(), fake)
    pool = Applier(_pool_ctx(), fake)
    eng.apply_payload(
        _vllm_batch(k, [_vllm_stored(k, [1000, 1001, 1002, 1003], None, TOK, "STORAGE")])
    )
    assert pool.apply_payload(_confirm([1000, 1001, 1002, 1003], k.MEDIUM_STORAGE))
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (0, 0, 4)}
    # exclusive partition, priority HBM > CPU > Disk: HBM 0-1, CPU 0-2, Disk 0-3
    eng.apply_payload(_vllm_batch(k, [_vllm_stored(k, [1000, 1001], None, TOK[:8], "GPU")]))
    eng.apply_payload(_vllm_batch(k, [_vllm_stored(k, [1000, 1001, 1002], None, TOK[:12], "CPU")]))
    pool.apply_payload(_confirm([1000, 1001, 1002], "cpu"))
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 1, 1)}
    # a pool removal on STORAGE leaves CPU and HBM alone
    pool.apply_payload(_confirm([1003], "STORAGE", kind="removed"))
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 1, 0)}


def test_vllm_033_zmq_publisher_storage_over_tcp():
    """vLLM 0.33's own ZmqEventPublisher (PUB + replay ROUTER) -> subscription -> Disk tier."""
    k = vllm_kv_events()
    port, rport = free_tcp_port(), free_tcp_port()
    pub = k.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        topic="kv-events",
    )
    pool = PoolPublisher()
    h = Harness()
    try:
        h.conductor.ip_index[NODE] = [(IID, 0)]
        h.conductor.instances[IID] = InstanceInfo("m", "t", BS)
        url = f"tcp://127.0.0.1:{port}"
        h.subscribe(_ctx(url=url, replay_endpoint=f"tcp://127.0.0.1:{rport}"), replay=True)
        h.subscribe(_pool_ctx(pool.url))
        pub.publish(
            k.KVEventBatch(
                ts=time.time(),
                events=[
                    _vllm_stored(k, [1000, 1001], None, TOK[:8], k.MEDIUM_GPU),
                    _vllm_stored(k, [1002, 1003], 1001, TOK[8:], k.MEDIUM_STORAGE),
                ],
            )
        )

        def offloaded():
            idx = h.index()
            if idx is not None and idx.summary()["offload"] == 2:
                return True
            pub.publish(k.KVEventBatch(ts=time.time(), events=[]))  # a later seq: gap -> replay
            return False

        wait_until(offloaded, msg="vLLM batch applied (live or replayed)", interval=0.2)
        assert h.hits(TOK) == {(IID, 0): (2, 0, 0)}

        def confirmed():
            if h.hits(TOK) == {(IID, 0): (2, 0, 2)}:
                return True
            pool.publish(_confirm([1002, 1003], "STORAGE"))
            return False

        wait_until(confirmed, msg="Disk confirmation", interval=0.2)
        src = h.source(IID, 0, url)
        assert src["dropped"] == {}
    finally:
        h.close()
        pool.stop()
        pub.shutdown()
    assert h.thread.errors == 0


# --- LMCache multiprocess mode (store-only CPU) ---------------------------------------------
#
# LMCache 0.5.6 (PyPI lmcache==0.5.6) in multiprocess mode publishes through the vLLM
# engine's own ZmqEventPublisher (so on the engine's topic, kv@<emitter>@<model> in llm-d
# deployments): its vLLM connector turns LMCache cache events into vLLM BlockStored events
# (lmcache/integration/vllm/lmcache_mp_connector.py, get_kv_connector_kv_cache_events).
# When the LMCache server does not advertise its KV-event capability, a worker reports only
# its own completed stores and never a removal (vllm_multi_process_adapter.py,
# _resolve_kv_event_source and _build_store_kv_events): one BlockStored per LMCache chunk,
# one hash, the previous chunk's hash as parent, the chunk's tokens, block_size = the chunk
# size (256 by default, a multiple of vLLM's block size), medium "CPU", lora_id and
# lora_name None. LMCache's modules import torch, so its code cannot run here without a GPU
# stack: the events below are built field for field as those two functions build them, with
# vLLM 0.33.0's own BlockStored/KVEventBatch, and sent by vLLM's own publisher. The hash
# values are arbitrary u64s (LMCache's are blake3 digests cut to 64 bits by vLLM's
# maybe_convert_block_hash): kvconductor hashes the tokens itself and uses them only to link
# a chunk to its parent.

CHUNK = 8  # LMCache tokens per chunk: two registered blocks of 4
C0, C1 = 0x8F1D_26A0_5C3E_7B11, 0x1B7E_0C44_93AF_2D58  # LMCache chunk hashes


def _lmcache_store(k, chunk_hash, parent, tokens):
    """lmcache_mp_connector.get_kv_connector_kv_cache_events for one CacheStoreEvent of
    _build_store_kv_events: the keyword arguments in that function's order."""
    return k.BlockStored(
        block_hashes=[chunk_hash],
        parent_block_hash=parent,
        token_ids=tokens,
        lora_id=None,
        block_size=CHUNK,
        medium="CPU",
        lora_name=None,
    )


def _lmcache_chunks(k):
    return [_lmcache_store(k, C0, None, TOK[:8]), _lmcache_store(k, C1, C0, TOK[8:16])]


def test_lmcache_store_only_chunks_are_held_on_cpu(fake):
    k = vllm_kv_events()
    eng = Applier(_ctx(store_only=(600.0, 1000)), fake)
    gpu = _vllm_stored(k, [1000, 1001], None, TOK[:8], "GPU")
    assert eng.apply_payload(_vllm_batch(k, [gpu, *_lmcache_chunks(k)]))
    idx = fake.indexes[("m", "t")]
    # HBM blocks 0-1, LMCache's CPU copy of blocks 0-3: exclusive, HBM first
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 2, 0)}
    assert eng.stats.dropped == {}
    assert eng.store_bound is not None and eng.store_bound.info() == {
        "ttl_secs": 600.0,
        "capacity": 1000,
        "blocks": 4,
        "expired_blocks": 0,
        "evicted_blocks": 0,
        "removed_blocks": 0,
    }
    # a continuation chunk links on the previous chunk's hash (kept by its last block)
    more = list(range(500, 508))
    eng.apply_payload(_vllm_batch(k, [_lmcache_store(k, 77, C1, more)]))
    assert hits(idx, TOK + more, BS) == {(IID, 0): (2, 4, 0)}


def test_lmcache_chunks_without_store_only_are_dropped(fake):
    """Not store-only: the chunk size is not the registered block size (and a CPU store
    would wait for a pool's confirmation that LMCache never sends)."""
    k = vllm_kv_events()
    eng = Applier(_ctx(), fake)
    assert eng.apply_payload(_vllm_batch(k, _lmcache_chunks(k)))
    assert eng.stats.dropped == {"block_size_mismatch": 2}
    assert hits(fake.indexes[("m", "t")], TOK, BS) == {}


def test_lmcache_store_only_ttl(fake):
    k = vllm_kv_events()
    eng = Applier(_ctx(store_only=(30.0, 1000)), fake)
    eng.apply_payload(_vllm_batch(k, _lmcache_chunks(k)))
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (0, 4, 0)}
    now = time.monotonic()
    assert eng.expire_store_only(now + 29) == 0
    assert hits(idx, TOK, BS) == {(IID, 0): (0, 4, 0)}
    assert eng.expire_store_only(now + 31) == 4
    assert hits(idx, TOK, BS) == {}
    assert eng.store_bound.info()["expired_blocks"] == 4
    assert eng.store_bound.info()["blocks"] == 0


def test_lmcache_store_only_reannouncement_refreshes_the_ttl(fake):
    k = vllm_kv_events()
    eng = Applier(_ctx(store_only=(30.0, 1000)), fake)
    eng.apply_payload(_vllm_batch(k, _lmcache_chunks(k)))
    eng.store_bound.held = type(eng.store_bound.held)(
        (kh, (d - 20, k)) for kh, (d, k) in eng.store_bound.held.items()
    )  # announced 20 s ago
    eng.apply_payload(_vllm_batch(k, _lmcache_chunks(k)[:1]))  # chunk 0 again, now
    assert eng.expire_store_only(time.monotonic() + 15) == 2  # chunk 1 only
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (0, 2, 0)}


def test_lmcache_store_only_capacity_evicts_the_oldest(fake):
    k = vllm_kv_events()
    eng = Applier(_ctx(store_only=(600.0, 2)), fake)
    eng.apply_payload(_vllm_batch(k, _lmcache_chunks(k)[:1]))
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (0, 2, 0)}
    other = list(range(900, 908))
    eng.apply_payload(_vllm_batch(k, [_lmcache_store(k, 55, None, other)]))
    assert eng.store_bound.info()["blocks"] == 2
    assert eng.store_bound.info()["evicted_blocks"] == 2
    assert hits(idx, TOK, BS) == {}
    assert hits(idx, other, BS) == {(IID, 0): (0, 2, 0)}


def test_register_store_only_shows_in_workers(client, conductor):
    register(
        client,
        medium_endpoints={"npu": "tcp://10.0.0.1:5557"},
        store_only={"ttl_secs": 120, "capacity": 5000},
    )
    register(client, "vllm-prefill-2", medium_endpoints={"npu": "tcp://10.0.0.2:5557"})
    register(
        client, "vllm-prefill-3", medium_endpoints={"npu": "tcp://10.0.0.3:5557"}, store_only=True
    )
    doc = client.simulate_get("/workers").json
    eps = {w["instance_id"]: w["endpoints"]["0"] for w in doc["workers"]}
    assert eps["vllm-prefill-1"]["store_only"] == {"ttl_secs": 120.0, "capacity": 5000}
    assert "store_only" not in eps["vllm-prefill-2"]
    assert eps["vllm-prefill-3"]["store_only"] == {"ttl_secs": 600.0, "capacity": 1_000_000}
    # the subscriptions apply under the bound (their /workers sources[] entry: below)
    subs = conductor.subs.subs
    assert subs[("vllm-prefill-1", 0, "tcp://10.0.0.1:5557")].store_only == (120.0, 5000)
    assert subs[("vllm-prefill-2", 0, "tcp://10.0.0.2:5557")].store_only is None


@pytest.mark.parametrize(
    "kw,error",
    [
        ({"store_only": {"ttl_secs": 0}}, "store_only.ttl_secs"),
        ({"store_only": {"capacity": 0}}, "store_only.capacity"),
        ({"store_only": "yes"}, "store_only"),
        (
            {"store_only": True, "endpoint": "tcp://10.0.0.9:50001", "instance_id": "mc-pool"},
            "not to a pool registration",
        ),
    ],
)
def test_register_store_only_rejects(client, kw, error):
    kw.setdefault("medium_endpoints", {"npu": "tcp://10.0.0.1:5557"})
    if "endpoint" in kw:
        del kw["medium_endpoints"]
    r = register(client, expect=400, **kw)
    assert error in r.json["error"]
    assert client.simulate_get("/workers").json["workers"] == []


def test_lmcache_over_tcp_with_vllm_publisher_and_source_check():
    """vLLM 0.33's ZmqEventPublisher carrying LMCache's chunks to a store-only
    subscription; the periodic source check ages them out."""
    k = vllm_kv_events()
    port = free_tcp_port()
    pub = k.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic="kv@pod-a@m")
    h = Harness()
    try:
        url = f"tcp://127.0.0.1:{port}"
        h.subscribe(_ctx(url=url, store_only=(60.0, 1000)))

        def held():
            if h.hits(TOK) == {(IID, 0): (0, 4, 0)}:
                return True
            pub.publish(k.KVEventBatch(ts=time.time(), events=_lmcache_chunks(k)))
            return False

        wait_until(held, msg="LMCache chunks on CPU", interval=0.2)
        assert h.source(IID, 0, url)["store_only"]["blocks"] == 4
        # a re-registration with another bound keeps the blocks and their deadlines
        h.call(h.mgr.replace, IID, 0, [_ctx(url=url, store_only=(30.0, 1000))])
        so = h.source(IID, 0, url)["store_only"]
        assert (so["ttl_secs"], so["blocks"]) == (30.0, 4)
        h.call(h.mgr.check_sources, time.monotonic() + 61)
        assert h.hits(TOK) == {}
        so = h.source(IID, 0, url)["store_only"]
        assert (so["blocks"], so["expired_blocks"]) == (0, 4)
    finally:
        h.close()
        pub.shutdown()
    assert h.thread.errors == 0


def test_store_only_survives_a_dump_round_trip():
    import msgspec

    from kvconductor.schema import RegisterRequest
    from kvconductor.state.dump import _registration
    from kvconductor.state.registry import Registry

    r = Registry()
    req = RegisterRequest(
        instance_id="vllm-prefill-1",
        engine_type="vLLM",
        modelname="qwen",
        block_size=16,
        dp_rank=0,
        medium_endpoints={"npu": "tcp://10.0.0.1:5557"},
        store_only=True,
    )
    out = r.register(req)
    assert [c.store_only for c in out.contexts] == [(600.0, 1_000_000)]
    entry = r.get("vllm-prefill-1")
    doc = _registration(entry, entry.endpoints[0])
    assert doc["store_only"] == {"ttl_secs": 600.0, "capacity": 1_000_000}
    again = Registry().register(msgspec.convert(doc, RegisterRequest))
    assert [c.store_only for c in again.contexts] == [(600.0, 1_000_000)]


# --- llm-d storage offloading (filesystem / object store backends) --------------------------
#
# llm-d/llm-d-kv-cache, kv_connectors/llmd_fs_backend/llmd_fs_backend/event_publisher.py
# (StorageEventPublisher, commit 0774186d6552104222097186c46c520e8bae1916; its own test
# tests/cpu/test_storage_events.py pins the same layout): one event per call,
# ["BlockStored", [hash, ...], 0, [], 0, None, "SHARED_STORAGE"] (hashes masked to 64 bits,
# parent 0 = unknown, no token ids, block size 0) or ["BlockRemoved", [hash, ...],
# "SHARED_STORAGE"], each packed on its own with msgpack.packb(use_bin_type=True) and sent
# as a **bin** inside [time.time(), [bin]] on topic kv@SHARED_STORAGE@<model>, seq from 1.
# The frames below are those bytes for hashes 0xABCDEF0123456789 and 7, ts 1782281033.484.
# The hashes are vLLM's own block hashes (FileMapper: the low 64 bits), so they join with
# the engine's offload of the same blocks.

H_A, H_B = 0xABCDEF0123456789, 7
LLMD_STORED = bytes.fromhex(
    "92"
    "cb41da8edcd25ef9db"  # [ts (float64),
    "91"
    "c42b"  # [bin of 43 bytes:
    "97"
    "ab426c6f636b53746f726564"  # ["BlockStored",
    "92"
    "cfabcdef0123456789"
    "07"  # [H_A, H_B],
    "00"
    "90"
    "00"
    "c0"  # 0, [], 0, None,
    "ae5348415245445f53544f52414745"  # "SHARED_STORAGE"]]]
)
LLMD_REMOVED = bytes.fromhex(
    "92cb41da8edcd25ef9db91c41f93ac426c6f636b52656d6f7665649107ae5348415245445f53544f52414745"
)  # [ts, [bin(["BlockRemoved", [H_B], "SHARED_STORAGE"])]]


def test_llmd_frames_decode():
    from kvconductor.ingest.ops import Removed, Stored
    from kvconductor.ingest.recognize import decode_payload

    (ev,) = decode_payload(LLMD_STORED).events
    assert type(ev) is Stored
    assert list(ev.block_hashes) == [H_A, H_B] and ev.parent is None
    assert (len(ev.tokens), ev.block_size, ev.medium) == (0, 0, "SHARED_STORAGE")
    assert parse_medium(ev.medium) is Medium.DISK
    (rm,) = decode_payload(LLMD_REMOVED).events
    assert type(rm) is Removed and list(rm.block_hashes) == [H_B]


@pytest.mark.parametrize("order", ["engine_first", "storage_first"])
def test_llmd_storage_events_confirm_the_engines_offload_on_disk(fake, order):
    """The engine (vLLM 0.33's own classes) offloads blocks 2-3 with their tokens; llm-d's
    storage publisher, registered as the DP's Disk URL, confirms them by engine hash."""
    k = vllm_kv_events()
    eng = Applier(_ctx(), fake)
    fs = Applier(_ctx(media=(Medium.DISK,), url="tcp://127.0.0.1:3"), fake)
    gpu = _vllm_stored(k, [1000, 1001], None, TOK[:8], k.MEDIUM_GPU)
    off = _vllm_stored(k, [H_A, H_B], 1001, TOK[8:], k.MEDIUM_STORAGE)
    eng.apply_payload(_vllm_batch(k, [gpu]))
    if order == "engine_first":
        eng.apply_payload(_vllm_batch(k, [off]))
        assert fs.apply_payload(LLMD_STORED)
    else:
        assert fs.apply_payload(LLMD_STORED)
        idx = fake.indexes[("m", "t")]
        assert idx.summary()["pending_pool"] == 2
        eng.apply_payload(_vllm_batch(k, [off]))
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 2)}
    assert fs.stats.dropped == {} and fs.stats.blocks == 2
    assert fs.apply_payload(LLMD_REMOVED)
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 1)}


def test_llmd_storage_event_without_the_engines_offload_holds_nothing(fake):
    fs = Applier(_ctx(media=(Medium.DISK,), url="tcp://127.0.0.1:3"), fake)
    assert fs.apply_payload(LLMD_STORED)
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {}
    assert idx.summary()["pending_pool"] == 2  # waits --pending-ttl-secs for the offload


# --- TensorRT-LLM ZeroMQ tee (tokens_hashes instead of token ids) ---------------------------
#
# TensorRT-LLM's KV-cache-event ZeroMQ tee, KvZmqPublisher (deepinfra/TensorRT-LLM,
# tensorrt_llm/serve/kv_zmq_publisher.py, commit 9ed399a0918e046f924be7e5381009c6fa2a09c2):
# per event one batch [time.time(), [event], attention_dp_rank], msgspec-encoded; a
# BlockStored map {"type", "block_hashes", "parent_block_hash", "tokens_hashes",
# "block_size"} with every hash as a signed int64 and no token ids: tokens_hashes[i] is
# XXH3-64 (seed 1337) of block i's token ids as little-endian u32, which is kvconductor's
# LocalBlockHash. The engine's block hashes come from KV cache manager V2
# (tensorrt_llm/runtime/kv_cache_manager_v2/_event_manager.py: v2_sha256_64 = the first
# 8 bytes of the radix key, big-endian; consecutive blocks of one sequence coalesced into
# one stored event, later blocks naming the previous one as parent). Frames for tokens
# 1..8 (block size 4), then block 9..12 under it, then a removal, ts 1782281033.484, DP 0.

TRT_STORED = bytes.fromhex(
    "93"
    "cb41da8edcd25ef9db"
    "91"
    "85"  # [ts, [{5 keys
    "a474797065"
    "ab426c6f636b53746f726564"  # "type": "BlockStored",
    "ac626c6f636b5f686173686573"
    "92"
    "d3c3a15e279b04d6f8"
    "cf1d2c3b4a59687786"
    "b1706172656e745f626c6f636b5f68617368"
    "c0"  # "parent_block_hash": nil,
    "ad746f6b656e735f686173686573"
    "92"
    "d3cb38e4d7fb2dca5c"
    "d3e8d3ec39b907b74c"
    "aa626c6f636b5f73697a65"
    "04"  # "block_size": 4}],
    "00"  # 0]
)
TRT_CONTINUED = bytes.fromhex(
    "93cb41da8edcd25ef9db9185a474797065ab426c6f636b53746f726564"
    "ac626c6f636b5f686173686573"
    "91"
    "cf0f0e0d0c0b0a0908"
    "b1706172656e745f626c6f636b5f68617368"
    "cf1d2c3b4a59687786"
    "ad746f6b656e735f686173686573"
    "91"
    "cf06b748f1777d599c"
    "aa626c6f636b5f73697a65"
    "04"
    "00"
)
TRT_REMOVED = bytes.fromhex(
    "93cb41da8edcd25ef9db9182a474797065ac426c6f636b52656d6f766564"
    "ac626c6f636b5f686173686573"
    "91"
    "cf1d2c3b4a59687786"
    "00"
)


def test_trtllm_tokens_hashes_are_local_block_hashes():
    from kvconductor._hash import hash_blocks
    from kvconductor.ingest.ops import Stored
    from kvconductor.ingest.recognize import decode_payload

    (ev,) = decode_payload(TRT_STORED).events
    assert type(ev) is Stored and len(ev.tokens) == 0
    assert list(ev.local_hashes) == list(hash_blocks(list(range(1, 9)), 4))
    assert list(ev.block_hashes) == [0xC3A15E279B04D6F8, 0x1D2C3B4A59687786]


@pytest.mark.parametrize("fast", [True, False])
def test_trtllm_tee_frames_index_hbm(fake, fast):
    eng = Applier(_ctx(), fake, fast=fast)
    toks = list(range(1, 13))
    assert eng.apply_payload(TRT_STORED)
    idx = fake.indexes[("m", "t")]
    assert hits(idx, toks, BS) == {(IID, 0): (2, 0, 0)}
    assert eng.apply_payload(TRT_CONTINUED)  # coalesced chain: parent = the last block
    assert hits(idx, toks, BS) == {(IID, 0): (3, 0, 0)}
    assert eng.apply_payload(TRT_REMOVED)
    assert hits(idx, toks, BS) == {(IID, 0): (1, 0, 0)}
    assert eng.stats.dropped == {}


def test_trtllm_frames_decline_the_compiled_fast_path():
    from kvconductor import _ingest

    if kvconductor_impl() == "py":
        pytest.skip("compiled fast path off")
    fb = _ingest.FastBatch(1337)
    assert fb.parse(TRT_STORED, BS) < 0
    assert fb.parse(TRT_REMOVED, BS) >= 0


# --- TensorRT-LLM through NVIDIA Dynamo's ZeroMQ publisher (token ids, signed hashes) --------
#
# ai-dynamo/dynamo, components/src/dynamo/trtllm/publisher.py, ZmqKvEventPublisher (commit
# ecd2979910e8ddc97f9aaf02f4dba7b61ae7d930): per event one batch
# msgspec.msgpack.encode([time.time(), [event], attention_dp_rank]) in the frames
# [topic, 8-byte big-endian sequence, payload]; a BlockStored map {"type", "block_hashes",
# "parent_block_hash", "token_ids", "block_size"} with the engine's hashes as signed int64
# (its _to_signed_i64), a BlockRemoved map {"type", "block_hashes"}. Built here the way it
# builds them (fixed time), one hash above 2**63 (int64 0xd3 on the wire).
def _dynamo_trt(event: dict) -> bytes:
    return msgspec.msgpack.encode([1782281033.484, [event], 0])


_H1, _H2, _H3 = 0xC3A15E279B04D6F8 - 2**64, 0x1D2C3B4A59687786, 0x0F0E0D0C0B0A0908
DYN_STORED = _dynamo_trt(
    {"type": "BlockStored", "block_hashes": [_H1, _H2], "parent_block_hash": None,
     "token_ids": list(range(1, 9)), "block_size": 4}
)  # fmt: skip
DYN_CONTINUED = _dynamo_trt(
    {"type": "BlockStored", "block_hashes": [_H3], "parent_block_hash": _H2,
     "token_ids": list(range(9, 13)), "block_size": 4}
)  # fmt: skip
DYN_REMOVED = _dynamo_trt({"type": "BlockRemoved", "block_hashes": [_H2]})


@pytest.mark.parametrize("fast", [True, False])
def test_dynamo_trtllm_publisher_frames_index_hbm(fake, fast):
    assert b"\xd3\xc3\xa1\x5e\x27\x9b\x04\xd6\xf8" in DYN_STORED  # the signed int64 hash
    eng = Applier(_ctx(), fake, fast=fast)
    toks = list(range(1, 13))
    assert eng.apply_payload(DYN_STORED)
    idx = fake.indexes[("m", "t")]
    assert hits(idx, toks, BS) == {(IID, 0): (2, 0, 0)}
    assert eng.apply_payload(DYN_CONTINUED)
    assert hits(idx, toks, BS) == {(IID, 0): (3, 0, 0)}
    assert eng.apply_payload(DYN_REMOVED)  # the middle block: the prefix stops at 1
    assert hits(idx, toks, BS) == {(IID, 0): (1, 0, 0)}
    assert eng.stats.dropped == {}


def test_trtllm_tokens_hashes_length_must_match(fake):
    bad = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                "tokens_hashes": [3], "block_size": 4}], 0]
    )  # fmt: skip
    eng = Applier(_ctx(), fake)
    eng.apply_payload(bad)
    assert eng.stats.dropped == {"invalid_event": 1}


def kvconductor_impl() -> str:
    import kvconductor

    return kvconductor.IMPL


def test_llmd_publisher_over_tcp_numbers_from_one():
    """llm-d's StorageEventPublisher: topic kv@SHARED_STORAGE@<model>, seq from 1, no
    replay. Its first batch counts as one loss (batch 0 never came); it is applied."""
    k = vllm_kv_events()
    port = free_tcp_port()
    pub = k.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
    fs = PoolPublisher(topic=b"kv@SHARED_STORAGE@m")
    fs.seq = 1  # StorageEventPublisher._send_batch: self._seq += 1 before the first send
    h = Harness()
    try:
        eng_url = f"tcp://127.0.0.1:{port}"
        h.subscribe(_ctx(url=eng_url))
        h.subscribe(_ctx(media=(Medium.DISK,), url=fs.url))
        fs.wait_subscribed()
        fs.publish(LLMD_STORED)
        wait_until(lambda: (h.source(IID, 0, fs.url) or {}).get("batches"), msg="llm-d batch")
        src = h.source(IID, 0, fs.url)
        assert (src["losses"], src["dropped"]) == (1, {})

        def held():
            if h.hits(TOK) == {(IID, 0): (2, 0, 2)}:
                return True
            gpu = _vllm_stored(k, [1000, 1001], None, TOK[:8], "GPU")
            off = _vllm_stored(k, [H_A, H_B], 1001, TOK[8:], "STORAGE")
            pub.publish(k.KVEventBatch(ts=time.time(), events=[gpu, off]))
            return False

        wait_until(held, msg="Disk blocks joined", interval=0.2)
    finally:
        h.close()
        fs.stop()
        pub.shutdown()
    assert h.thread.errors == 0


def test_store_only_bound_takes_the_blocks_held_when_it_opens(fake):
    """A warm start: the index (from a dump) holds the DP's CPU blocks before its
    store-only subscription opens; they join the bound and age out like the rest."""
    k = vllm_kv_events()
    first = Applier(_ctx(store_only=(30.0, 1000)), fake)
    first.apply_payload(_vllm_batch(k, _lmcache_chunks(k)))
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (0, 4, 0)}
    again = Applier(_ctx(store_only=(30.0, 1000)), fake)  # a new process, same index
    assert again.store_bound.info()["blocks"] == 4
    assert again.expire_store_only(time.monotonic() + 31) == 4
    assert hits(idx, TOK, BS) == {}


def test_http_events_storage_medium_is_disk(client):
    """POST /events with vLLM's STORAGE medium feeds the Disk tier (was the HBM tree)."""
    register(client)
    r = events(
        client,
        [
            stored(1, [101, 102], [1, 2, 3, 4, 5, 6, 7, 8], medium="GPU"),
            stored(2, [201, 202, 203], list(range(1, 13)), medium="STORAGE"),
        ],
    )
    assert r.status_code == 200, r.text
    dp = query(client, list(range(1, 13)))["default"]["vllm-prefill-1"]["DP"]["0"]
    assert (dp["npu_blocks"], dp["cpu_blocks"], dp["disk_blocks"]) == (2, 0, 1)


def test_vllm_own_offloading_without_a_pool_with_store_only(fake):
    """vLLM's offloading connector keeps its CPU/STORAGE blocks itself: registered
    store_only, its self-describing events (vLLM 0.33's classes) are held at once, its
    removals apply, and the bound covers what it never removes."""
    k = vllm_kv_events()
    eng = Applier(_ctx(store_only=(600.0, 1000)), fake)
    eng.apply_payload(
        _vllm_batch(
            k,
            [
                _vllm_stored(k, [1000, 1001], None, TOK[:8], k.MEDIUM_GPU),
                _vllm_stored(k, [1002, 1003], 1001, TOK[8:], k.MEDIUM_STORAGE),
            ],
        )
    )
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 2)}
    eng.apply_payload(_vllm_batch(k, [k.BlockRemoved(block_hashes=[1003], medium="STORAGE")]))
    assert hits(idx, TOK, BS) == {(IID, 0): (2, 0, 1)}
