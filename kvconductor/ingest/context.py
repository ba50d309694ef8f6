"""What a subscription knows about the engine or pool it listens to."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconductor.keys import Medium, StoreBackend


@dataclass(frozen=True)
class SubscriberContext:
    """Registration facts a subscriber needs to apply events (docs/events.md,
    "Service interface")."""

    instance_id: str  # backend_id of HBM workers it feeds
    dp_rank: int
    url: str  # ZMQ PUB endpoint
    model: str
    tenant: str
    block_size: int
    default_media: tuple[Medium, ...] = (Medium.NPU,)
    store_backend: StoreBackend = StoreBackend.MOONCAKE
    is_pool: bool = False  # a Mooncake/Memcache pool publisher (IpOnly worker resolution)
    replay_endpoint: str | None = None
    engine_type: str = "vLLM"
    extra: dict = field(default_factory=dict, compare=False)


def source_kind(is_pool: bool, engine_type: str) -> str:
    """``pool`` for pool publishers; ``vllm`` / ``sglang`` from the registration's
    ``type``; ``engine`` for any other engine type (bounded label values)."""
    if is_pool:
        return "pool"
    t = engine_type.lower()
    return t if t in ("vllm", "sglang") else "engine"
