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
    #: A pool publisher (IpOnly worker resolution): a Mooncake/Memcache cluster pool or a
    #: YuanRong/Unknown node pool.
    is_pool: bool = False
    replay_endpoint: str | None = None
    engine_type: str = "vLLM"
    #: A node pool (CPU/Disk of one node; ``is_pool`` too): its blocks belong to the DPs of
    #: its (model, tenant) registered with an HBM URL on ``node_ip``.
    node_pool: bool = False
    #: The node a node pool serves (the host of its URL), for events without a usable
    #: ``backend_id``; ``None`` when the URL names no host (``ipc://``, bind mode).
    node_ip: str | None = None
    #: A store-only engine publisher (``store_only`` of the registration): ``(ttl_secs,
    #: capacity)`` bounding the CPU/Disk blocks it announces, which it never removes.
    store_only: tuple[float, int] | None = None
    #: A shared store (``shared_store`` of a cluster pool's registration): its blocks
    #: belong to every DP registered in its (model, tenant) with its block size.
    shared_store: bool = False
    #: The LoRA adapter of the registration (``lora_name``; ``""`` the base model, None
    #: any): a pool's context when its events name none.
    lora_name: str | None = None
    extra: dict = field(default_factory=dict, compare=False)


def source_kind(is_pool: bool, engine_type: str) -> str:
    """``pool`` for pool publishers; ``vllm`` / ``sglang`` from the registration's
    ``type``; ``engine`` for any other engine type (bounded label values)."""
    if is_pool:
        return "pool"
    t = engine_type.lower()
    return t if t in ("vllm", "sglang") else "engine"
