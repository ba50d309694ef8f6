"""The shapes of the Mooncake conductor's dialect, served on ``--mooncake-port``
(docs/api.md, "The Mooncake conductor dialect"; :mod:`kvconductor.http.mooncake`). Names
and shapes are Mooncake's (kvcache-ai/Mooncake,
mooncake-conductor/src/kvevent/event_manager.cpp). Kept beside :mod:`kvconductor.schema`
(V3's shapes), as :mod:`kvconductor.schema_dynamo` is.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from kvconductor.schema import DEFAULT_TENANT, Name, PositiveU32


class MooncakeHashProfile(Struct, forbid_unknown_fields=True):
    """A registration's ``hash_profile``: stored and shown, not interpreted (kvconductor
    matches on token ids, not on an engine's block hashes)."""

    strategy: Name
    algorithm: Name
    python_hash_seed: Name
    index_projection: Name


class MooncakeRegisterRequest(Struct, kw_only=True):
    """``POST /register`` of the Mooncake dialect (JSON or MessagePack)."""

    endpoint: str
    type: Name
    modelname: Name
    instance_id: Name
    block_size: PositiveU32
    dp_rank: Annotated[int, Meta(ge=0, le=0x7FFFFFFF)]
    replay_endpoint: str | None = None
    tenant_id: Name | None = DEFAULT_TENANT
    lora_name: Name | None = None
    cache_group: int | None = None
    hash_profile: MooncakeHashProfile | None = None
    additionalsalt: Name | None = None


class MooncakeUnregisterRequest(Struct, kw_only=True):
    """``POST /unregister`` of the Mooncake dialect: the service key
    ``(instance_id, tenant_id, dp_rank)``; older clients' extra fields are ignored."""

    instance_id: Name
    dp_rank: Annotated[int, Meta(ge=0, le=0x7FFFFFFF)]
    tenant_id: Name | None = DEFAULT_TENANT


class MooncakeQueryRequest(Struct, kw_only=True):
    """``POST /query`` of the Mooncake dialect. ``token_ids`` is an array of integers, or
    on MessagePack one bin of little-endian int32 (Mooncake's cache-aware proxy)."""

    model: Name
    block_size: PositiveU32
    token_ids: list[int] | bytes
    tenant_id: Name | None = DEFAULT_TENANT
    lora_name: Name | None = None
    instance_id: Name | None = None
    cache_salt: str | None = None


class MooncakeRegisterResponse(Struct):
    """``{"status": "registered successfully", "instance_id": ...}``."""

    status: str
    instance_id: str


class MooncakeUnregisterResponse(Struct):
    """``{"status": "unregistered successfully", "removed_instances": ["id|tenant|dp"]}``."""

    status: str
    removed_instances: list[str]


class MooncakeRankMatch(Struct):
    """Cumulative matched tokens of one DP rank: ``gpu <= cpu <= disk``."""

    gpu: int
    cpu: int
    disk: int


class MooncakeInstanceMatch(Struct):
    """One instance of a Mooncake ``/query`` answer (tokens, cumulative tiers)."""

    longest_matched: int
    dp: dict[str, int]
    rank_matches: dict[str, MooncakeRankMatch]
    gpu: int
    cpu: int
    disk: int


class MooncakeQueryResponse(Struct):
    """``{"instances": {instance_id: {...}}}``."""

    instances: dict[str, MooncakeInstanceMatch]


class MooncakeError(Struct, omit_defaults=True):
    """A Mooncake-dialect error: ``error`` and Mooncake's ``reason`` (and ``field``)."""

    error: str
    reason: str
    field: str | None = None
