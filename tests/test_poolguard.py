"""kvconductor.ingest.poolguard: a vLLM/SGLang batch on a pool's subscription is dropped
(counted, warned); pool events on it and engine batches on an engine's are applied."""

from __future__ import annotations

from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.ops import Cleared, PoolBatch, VllmBatch
from kvconductor.ingest.poolguard import ENGINE_BATCH_ON_POOL, engine_batch_on_pool
from kvconductor.keys import Medium, StoreBackend
from tests.helpers.publishers import FakeConductor, InstanceInfo, hits, mooncake_tuple, schema

BS = 4
V = schema("vllm", "0.33.0")
NODE = "127.0.0.1"
DP0 = "vllm-prefill-1"
POOL = "yuanrong-pool-127.0.0.1-m"
TOK = list(range(100, 108))


def _ctx(iid, media, is_pool):
    return SubscriberContext(
        instance_id=iid,
        dp_rank=0,
        url=f"tcp://{NODE}:5557",
        model="m",
        tenant="t",
        block_size=BS,
        default_media=media,
        store_backend=StoreBackend.YUANRONG,
        is_pool=is_pool,
        node_pool=is_pool,
        node_ip=NODE if is_pool else None,
    )


def _fake(impl):
    c = FakeConductor(impl)
    c.ip_index[NODE] = [(DP0, 0)]
    c.instances[DP0] = InstanceInfo("m", "t", BS)
    return c


def test_only_engine_batches_on_pools_are_refused():
    pool = _ctx(POOL, (Medium.CPU, Medium.DISK), True)
    engine = _ctx(DP0, (Medium.NPU,), False)
    assert engine_batch_on_pool(pool, VllmBatch(0, 0, [Cleared()], "map")) is not None
    assert engine_batch_on_pool(pool, VllmBatch(0, 0, [], "map")) is None  # no kind
    assert engine_batch_on_pool(pool, PoolBatch(0, 0, [], "tuple")) is None
    assert engine_batch_on_pool(engine, VllmBatch(0, 0, [], "map")) is None


def test_a_pool_drops_the_engine_batches_on_its_url(impl):
    fake = _fake(impl)
    pool = Applier(_ctx(POOL, (Medium.CPU, Medium.DISK), True), fake)
    dp0 = Applier(_ctx(DP0, (Medium.NPU,), False), fake)
    batch = V.batch([V.stored([1, 2], None, TOK, BS, medium="GPU")])
    assert not pool.apply_payload(batch)
    assert pool.stats.dropped == {ENGINE_BATCH_ON_POOL: 1}
    assert pool.stats.batches == 0 and pool.stats.blocks == 0
    assert dp0.apply_payload(batch)
    idx = fake.indexes[("m", "t")]
    assert hits(idx, TOK, BS) == {(DP0, 0): (2, 0, 0)}
    # the pool's own events are applied as before
    ev = {"event_id": 1, "event_type": "BlockStored", "medium": "cpu", "seq_hashes": [1, 2]}
    assert pool.apply_payload(mooncake_tuple([ev]))
    assert pool.stats.dropped == {ENGINE_BATCH_ON_POOL: 1}
    assert (pool.stats.batches, pool.stats.blocks) == (1, 2)
