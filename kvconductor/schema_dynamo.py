"""The shapes of Dynamo's standalone indexer dialect, served on ``--dynamo-port``
(docs/api.md, "The Dynamo indexer dialect"; :mod:`kvconductor.http.dynamo`).

Names, types and defaults are those of ``python -m dynamo.indexer`` (PyPI
``ai-dynamo-runtime`` 1.6.1, Rust ``dynamo_kv_router``'s ``services/indexer``), read from
what it takes and answers: ids are u64, DP ranks u32, hashes i64, ``routing_group``
defaults to ``"default"``. Kept beside :mod:`kvconductor.schema` (V3's shapes), as
:mod:`kvconductor.schema_mooncake` is.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Raw, Struct

from kvconductor.schema import DEFAULT_TENANT, I64_MAX, I64_MIN, U32_MAX, U64, Name

U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
I64 = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
#: Dynamo's ``routing_group`` default; kvconductor's tenant of the same name.
DEFAULT_GROUP = DEFAULT_TENANT
assert DEFAULT_GROUP == "default"


class DynamoRegisterRequest(Struct, kw_only=True):
    """``POST /register``: one (instance, DP) publishing vLLM's ZeroMQ event batches on
    ``endpoint``."""

    instance_id: U64
    endpoint: str
    model_name: Name
    block_size: Annotated[int, Meta(ge=1, le=U32_MAX)]
    dp_rank: U32 = 0
    routing_group: Name = DEFAULT_GROUP
    replay_endpoint: str | None = None


class DynamoUnregisterRequest(Struct, kw_only=True):
    """``POST /unregister``: one DP, or the whole instance without ``dp_rank``."""

    instance_id: U64
    model_name: Name
    routing_group: Name = DEFAULT_GROUP
    dp_rank: U32 | None = None


class DynamoQueryRequest(Struct, kw_only=True):
    """``POST /query``: token ids, hashed with the (model, group)'s block size;
    ``cache_salt`` (a string; ``""`` and null: none) mixed into the first block's hash as
    vLLM mixes a request's salt (docs/api.md, "Extra keys")."""

    token_ids: list[U32]
    model_name: Name
    routing_group: Name = DEFAULT_GROUP
    lora_name: Name | None = None
    cache_salt: str | None = None


class DynamoQueryHead(Struct, kw_only=True):
    """``POST /query`` read for its hot path: the same fields as
    :class:`DynamoQueryRequest`, ``token_ids`` kept as the raw JSON of its array (read
    into a C buffer by V3's query parser, never a Python int per token)."""

    token_ids: Raw
    model_name: Name
    routing_group: Name = DEFAULT_GROUP
    lora_name: Name | None = None
    cache_salt: str | None = None


class DynamoHashQueryRequest(Struct, kw_only=True):
    """``POST /query_by_hash``: local block hashes (XXH3-64 seed 1337 of each block's
    token ids, the same hash as V3's ``/query_by_hash``) as signed 64-bit integers.
    ``cache_salt``: declared to be refused as Dynamo refuses it (a string: 400, the hashes
    carry any salt already; null: none)."""

    block_hashes: list[I64]
    model_name: Name
    routing_group: Name = DEFAULT_GROUP
    cache_salt: str | None = None


class DynamoStatus(Struct):
    """``{"status": "ok"}`` (``/register``: 201; ``/unregister``: 200)."""

    status: str


class DynamoError(Struct):
    """``{"error": "..."}``."""

    error: str


class DynamoInstanceMatch(Struct):
    """One instance of a ``/query`` answer: matched tokens, cumulative over the tiers
    (``gpu <= cpu <= disk``); ``dp``: the GPU tokens of each rank that matched anything."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class DynamoQueryResponse(Struct):
    """``scores``: GPU (HBM) tokens per instance and rank, those above zero only;
    ``frequencies``: always empty (no ``--threads`` frequency tracking here);
    ``instances``: every instance that matched anything."""

    scores: dict[str, dict[str, int]]
    frequencies: list[int]
    instances: dict[str, DynamoInstanceMatch]


class DynamoListener(Struct):
    """A ``/workers`` entry's listener of one DP: its endpoint and its source's state."""

    endpoint: str
    status: str


class DynamoWorker(Struct):
    """A ``GET /workers`` entry: one instance."""

    instance_id: int
    source: str
    status: str
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str]
    listeners: dict[str, DynamoListener]
