"""Engine batches arriving on a pool's URL (docs/events.md, "Drop reasons").

A pool (a cluster pool of Mooncake/Memcache, a node pool of YuanRong) publishes pool
events only; it never holds blocks itself (docs/api.md, "Node pools"). A vLLM/SGLang
batch on a pool subscription is an engine's publisher at the same URL: the newest
Coordinator with only the legacy ``endpoint`` setting resolves a node pool's CPU/Disk URL
to DP 0's engine publisher. The DP's own subscription applies that batch; the pool's
copy would index the engine's blocks as blocks of the pool's own id, which would then
show in ``/query`` answers. The reference drops such batches; so do we, counted as
``engine_batch_on_pool`` with a WARN (rate-limited per source).
"""

from __future__ import annotations

from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.ops import PoolBatch, VllmBatch

#: The drop reason of an engine batch on a pool subscription.
ENGINE_BATCH_ON_POOL = "engine_batch_on_pool"


def engine_batch_on_pool(ctx: SubscriberContext, batch: VllmBatch | PoolBatch) -> str | None:
    """Why ``batch`` must be dropped on this subscription (the WARN's detail), or None. An
    empty batch names no kind (its envelope is a pool tuple's too): it passes."""
    if not ctx.is_pool or not isinstance(batch, VllmBatch) or not batch.events:
        return None
    return (
        f"a vLLM/SGLang batch of {len(batch.events)} event(s) on the pool {ctx.instance_id}'s "
        f"URL {ctx.url}: an engine publishes there (a node pool registered with the engine's "
        "URL, e.g. a Coordinator with only the legacy `endpoint` setting); the engine's own "
        "registration applies it, the pool never holds blocks (set cpu_endpoint/disk_endpoint "
        "to the pool's port)"
    )
