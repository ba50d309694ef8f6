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
def conductor(impl):
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


def test_vllm_033_storage_offload_joins_into_the_disk_tier(conductor):
    k = vllm_kv_events()
    eng = Applier(_ctx(), conductor)
    pool = Applier(_pool_ctx(), conductor)
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
    idx = conductor.indexes[("m", "t")]
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


def test_pool_confirmation_with_storage_medium_lands_on_disk_not_hbm(conductor):
    k = vllm_kv_events()
    eng = Applier(_ctx(), conductor)
    pool = Applier(_pool_ctx(), conductor)
    eng.apply_payload(
        _vllm_batch(k, [_vllm_stored(k, [1000, 1001, 1002, 1003], None, TOK, "STORAGE")])
    )
    assert pool.apply_payload(_confirm([1000, 1001, 1002, 1003], k.MEDIUM_STORAGE))
    idx = conductor.indexes[("m", "t")]
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
    from tests.test_subscriber import Harness

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
