"""Every HTTP body of the V3 API as a msgspec Struct (docs/api.md).

Requests are decoded with the module-level decoders below (thread-safe, reused).
Field names, defaults and required fields follow the reference; where we are
more lenient it is said on the field (``null`` accepted for a defaulted string,
for example). Integer ranges that fit int64 are checked by msgspec; the u64
ranges (hashes, ``event_id``) are checked after decoding because msgspec
cannot express bounds beyond int64 (:func:`to_u64`, and the ``event_id`` check of
:mod:`kvconductor.ingest.http_events`).

The ``/query`` and ``/query_by_hash`` hot path does not use these Structs: it
goes through :mod:`kvconductor.wire`, whose compiled parser never builds a list of
token ints. :class:`QueryRequest` and :class:`QueryByHashRequest` document the shape
and serve clients and tests.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeAlias

import msgspec
from msgspec import Meta, Struct, field

#: A JSON document's value, and a JSON object (what the state floor and ingest report).
JSONValue: TypeAlias = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject = dict[str, JSONValue]

#: The port ``kv-conductor`` listens on by default, and a Coordinator's default.
DEFAULT_PORT = 13333
MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"
_MSGPACK_TYPES = frozenset((MSGPACK_CONTENT_TYPE, "application/x-msgpack"))


def is_msgpack_content_type(content_type: str | None) -> bool:
    """True for ``application/msgpack`` / ``application/x-msgpack`` (params and case ignored)."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() in _MSGPACK_TYPES


U32_MAX = 0xFFFFFFFF
#: The tenant of a request or registration that names none.
DEFAULT_TENANT = "default"
U64_MAX = 0xFFFFFFFFFFFFFFFF
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1

#: The longest id or name a request may carry, in characters (docs/api.md, "Ids and
#: names").
NAME_MAX = 400

#: What an id or a name may not hold: control characters (C0 with NUL, newline and ESC,
#: DEL, C1), which would forge or garble a line of the text log or a terminal (docs/api.md,
#: "Ids and names"). A JSON Schema pattern too (the OpenAPI documents carry it).
NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

#: An id or a name: at most :data:`NAME_MAX` characters, no control character.
Name = Annotated[str, Meta(max_length=NAME_MAX, pattern=NAME_PATTERN)]

#: An id or a name inside an ``/events`` event (``event_type``, ``medium``, ``backend_id``,
#: ...): a :data:`Name`, whose control characters are looked for after decoding
#: (:func:`kvconductor.ingest.http_events.normalize_events`, with ``str.isprintable`` in
#: C; a pattern per string would cost a regex call per event, and a batch holds up to
#: thousands). The JSON Schema says the same pattern.
EventName = Annotated[str, Meta(max_length=NAME_MAX, extra_json_schema={"pattern": NAME_PATTERN})]
#: An event's :data:`EventName` fields, by attribute and by wire name.
EVENT_NAME_FIELDS: tuple[tuple[str, str], ...] = (
    ("event_type", "event_type"),
    ("type_", "type"),
    ("legacy_type", "legacy_type"),
    ("medium", "medium"),
    ("backend_id", "backend_id"),
    ("lora_name", "lora_name"),
)

#: An id or a name of a V3 query (``/query``, ``/query_by_hash``, ``/explain``): at most
#: :data:`NAME_MAX` characters. Control characters are not looked for there: the compiled
#: parser reads these, a query changes nothing, such a model names no index, and the log
#: escapes whatever it writes (:func:`kvconductor.logs.escape_controls`).
QueryName = Annotated[str, Meta(max_length=NAME_MAX)]

#: How msgspec words a :data:`Name` with a control character, and how the errors word it.
_PATTERN_WORDS = f"Expected `str` matching regex {NAME_PATTERN!r}"
CONTROL_WORDS = "Expected `str` without control characters (U+0000-U+001F, U+007F-U+009F)"


def has_control_character(s: str) -> bool:
    """True when ``s`` holds a character a :data:`Name` may not hold (``isprintable`` first:
    a C loop, false for every one of them; the regex only when it is false)."""
    return not s.isprintable() and _CONTROL.search(s) is not None


def decode_error_message(ex: Exception) -> str:
    """The text of a msgspec decode error, a :data:`Name`'s pattern said in words:
    ``Expected `str` without control characters (...) - at `$.instance_id```."""
    return str(ex).replace(_PATTERN_WORDS, CONTROL_WORDS)


def name_too_long(path: str) -> str:
    """The error of an id or name over :data:`NAME_MAX` at ``path`` (``$.model``), worded as
    msgspec words it for the Struct-decoded bodies."""
    return f"Expected `str` of length <= {NAME_MAX} - at `{path}`"


#: An unsigned 32-bit integer (dp ranks, block sizes).
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
#: A block size that must be at least 1.
PositiveU32 = Annotated[int, Meta(ge=1, le=U32_MAX)]
#: A non-negative integer; the u64 upper bound is checked after decoding (see above).
U64 = Annotated[int, Meta(ge=0)]


class WireValueError(ValueError):
    """A decoded body holds a value outside its documented range."""


def to_u64(value: int, what: str) -> int:
    """Return ``value`` as u64; negative i64 values wrap (two's complement).

    Raises :class:`WireValueError` outside ``[-2**63, 2**64)``.
    """
    if value < 0:
        if value < I64_MIN:
            raise WireValueError(f"{what} {value} is out of range (i64/u64 expected)")
        return value & U64_MAX
    if value > U64_MAX:
        raise WireValueError(f"{what} {value} is out of range (i64/u64 expected)")
    return value


# ---------------------------------------------------------------------------------------
# /register, /unregister (docs/api.md, POST /register and POST /unregister)
# ---------------------------------------------------------------------------------------


#: Defaults of a store-only source's bound (docs/api.md, "Store-only sources").
STORE_ONLY_TTL_SECS = 600.0
STORE_ONLY_CAPACITY = 1_000_000


class StoreOnly(Struct, kw_only=True, forbid_unknown_fields=True):
    """``store_only`` of ``POST /register`` as an object: the bound of a publisher that
    never sends removals for its CPU/Disk blocks (LMCache multiprocess mode). Our own
    extension, so a key it does not know is a 400 (a misspelled ``ttl`` would otherwise
    leave the 600 s default in place)."""

    #: Seconds a block stays after its last announcement.
    ttl_secs: Annotated[float, Meta(gt=0, le=30 * 86400)] = STORE_ONLY_TTL_SECS
    #: Blocks (of the registered ``block_size``) kept per source; the oldest go first.
    capacity: Annotated[int, Meta(ge=1, le=U32_MAX)] = STORE_ONLY_CAPACITY


class RegisterRequest(Struct, kw_only=True):
    """``POST /register``.

    ``block_size`` must be at least 1 here (the reference accepted 0, which no
    engine publishes). ``null`` is accepted for every defaulted field. Ids and names
    (``medium_endpoints`` keys included) are at most :data:`NAME_MAX` characters.
    """

    instance_id: Name
    engine_type: Name = field(name="type")
    modelname: Name
    block_size: PositiveU32
    dp_rank: U32
    medium_endpoints: dict[Name, str] | None = None
    endpoint: str | None = None
    store_backend: Name | None = "Mooncake"
    replay_endpoint: str | None = None
    tenant_id: Name | None = DEFAULT_TENANT
    node_id: Name | None = None
    #: Extension: the engine publisher's CPU/Disk stores are never followed by removals
    #: (LMCache multiprocess mode): index them directly, bounded by a TTL and a capacity.
    #: ``true`` takes the default bound.
    store_only: bool | StoreOnly | None = None
    #: Extension: a cluster pool whose blocks every DP of its (model, tenant) and block
    #: size shares (Mooncake's store, as its conductor reads it): ``backend_id`` names the
    #: store, not a node; blocks are keyed by the engines' block hashes.
    shared_store: bool | None = None
    #: Extension: the LoRA adapter this registration is of (``""``: the base model; the
    #: Mooncake dialect's ``lora_name``). A pool's blocks of another adapter are not an
    #: engine DP's; a pool's are of this adapter unless its events name one. None: any.
    lora_name: Name | None = None
    engine_url: str | None = None  # extension: the engine's HTTP base URL (docs/engines.md)


class UnregisterRequest(Struct, kw_only=True):
    """``POST /unregister``: every field but ``tenant_id`` is required (as in the reference)."""

    instance_id: Name
    engine_type: Name = field(name="type")
    modelname: Name
    block_size: U32
    dp_rank: U32
    tenant_id: Name | None = DEFAULT_TENANT


class StatusResponse(Struct):
    """``{"status": "ok"}``."""

    status: str = "ok"


class ErrorResponse(Struct):
    """``{"error": "<message>"}``: every 4xx/5xx body except the /events partial one."""

    error: str


# ---------------------------------------------------------------------------------------
# /query, /query_by_hash (docs/api.md, POST /query and POST /query_by_hash)
# ---------------------------------------------------------------------------------------


class QueryRequest(Struct, kw_only=True):
    """``POST /query``; with :data:`QUERY_FIELDS`, the one declaration of its fields.

    Also accepted positionally on MessagePack, in the order of :data:`QUERY_FIELDS`:
    ``[model, block_size, token_ids, tenant_id?, lora_name?]``. ``token_ids`` may
    also be a msgpack bin of little-endian u32 (packed tokens).
    """

    model: QueryName
    block_size: PositiveU32
    token_ids: list[int]
    tenant_id: QueryName = DEFAULT_TENANT


class QueryByHashRequest(Struct, kw_only=True):
    """``POST /query_by_hash``; ``block_size`` is required here but ignored (docs/api.md)."""

    model: QueryName
    block_size: U32
    block_hashes: list[int]
    tenant_id: QueryName = DEFAULT_TENANT


#: The optional last field of both query bodies (string or null; null, absent or ``""``
#: mean the base model). Not a Struct field: clients add it only when set, so their
#: base-model bodies carry no ``lora_name`` key.
LORA_FIELD = "lora_name"
#: Extension fields of both query bodies, beyond the V3 contract (docs/api.md, "top_k and
#: instances"): at most ``top_k`` (instance, DP) rows, the deepest, ties at the cut by the
#: order of ``instances`` else a rotation the request seeds (an int in [1, 2**32) or
#: null), only the named instances (an array of strings or null). Absent or null: the
#: V3 answer. Positional MessagePack form: the 6th and 7th elements.
TOP_K_FIELD = "top_k"
INSTANCES_FIELD = "instances"
#: The response header of a query with ``top_k`` (docs/api.md, "top_k and instances"):
#: how many (instance, DP) rows tied at the cut depth the answer leaves out.
TOP_K_OMITTED_HEADER = "X-KV-Conductor-Top-K-Omitted"
#: Extensions: "freshness" (a boolean or null; true adds the state and age of the sources
#: behind each answered (instance, DP)), positional element 8; "Extra keys", 9 and 10.
FRESHNESS_FIELD = "freshness"
EXTENSION_FIELDS: tuple[str, ...] = (TOP_K_FIELD, INSTANCES_FIELD, FRESHNESS_FIELD)
EXTENSION_FIELDS += (CACHE_SALT_FIELD := "cache_salt", MM_INPUTS_FIELD := "mm_inputs")
#: Field names of a ``/query`` body, in the order of the positional MessagePack form.
QUERY_FIELDS: tuple[str, ...] = (*QueryRequest.__struct_fields__, LORA_FIELD, *EXTENSION_FIELDS)
#: Field names of a ``/query_by_hash`` body, in the order of the positional form.
QUERY_BY_HASH_FIELDS: tuple[str, ...] = (
    *QueryByHashRequest.__struct_fields__,
    LORA_FIELD,
    *EXTENSION_FIELDS,
)


class DpMatch(Struct):
    """Per-DP counts of a query response (V3 exclusive partition)."""

    matched_tokens: int
    npu_blocks: int
    cpu_blocks: int
    disk_blocks: int


class InstanceMatch(Struct):
    """Per-instance entry of a query response; ``DP`` is keyed by the decimal rank."""

    longest_matched: int
    DP: dict[str, DpMatch]


#: ``{tenant: {instance_id: InstanceMatch}}`` (exactly one tenant key).
QueryResponse = dict[str, dict[str, InstanceMatch]]


class DpFreshness(Struct, omit_defaults=True):
    """A DP's ``"freshness"`` member in an answer to a query with ``freshness``
    (docs/api.md, "freshness"): the worst state of its own sources (``live``,
    ``remote``, ``connecting``, ``replaying``, ``degraded``, ``muted``; ``no_source``),
    the age of their newest event and, while degraded, the time since the loss."""

    state: str
    last_event_age_ms: int | None = None
    degraded_for_ms: int | None = None


class FreshnessSummary(Struct):
    """The answer's own ``"freshness"`` member, beside the tenant: the (model, tenant)'s
    sources, pools included, per state, and whether all of them are live."""

    all_live: bool
    sources: int
    states: dict[str, int]


class FreshnessDocument(Struct):
    """``GET /freshness`` (docs/api.md): per (instance, DP) with sources of its own
    ``[instance_id, dp_rank, state, newest event, degraded since]`` (wall times or null),
    the server's time, and the :class:`FreshnessSummary` fields."""

    model: str
    tenant: str
    time: float
    dps: list[tuple[str, int, str, float | None, float | None]]
    all_live: bool
    sources: int
    states: dict[str, int]


#: Keys of a response's per-instance and per-DP maps (what ``kvconductor._encode`` writes).
INSTANCE_MATCH_KEYS: tuple[str, ...] = InstanceMatch.__struct_fields__
DP_MATCH_KEYS: tuple[str, ...] = DpMatch.__struct_fields__
#: The key of every error body.
ERROR_KEY: str = ErrorResponse.__struct_fields__[0]


# ---------------------------------------------------------------------------------------
# /explain (docs/api.md, POST /explain)
# ---------------------------------------------------------------------------------------

#: Why a tier's walk stopped where it did (docs/api.md, POST /explain, "Stop reasons").
STOP_END_OF_PROMPT = "end_of_prompt"
STOP_PARENT_MISMATCH = "parent_mismatch"
STOP_NOT_HELD = "not_held"
STOP_NO_FIRST_BLOCK = "no_first_block"
STOP_TIER_EXHAUSTED = "tier_exhausted"
STOP_MUTED = "muted"
STOP_NO_WORKER = "no_worker"
#: The reasons in the order of the index core's stop codes (``CoreIndex.trace``): the code
#: of a reason is its position. ``no_worker`` is never a core code (no worker, no walk).
STOP_REASONS: tuple[str, ...] = (
    STOP_END_OF_PROMPT,
    STOP_PARENT_MISMATCH,
    STOP_NOT_HELD,
    STOP_NO_FIRST_BLOCK,
    STOP_TIER_EXHAUSTED,
    STOP_MUTED,
    STOP_NO_WORKER,
)
#: The tier keys of an explain answer, in walk order (HBM, then CPU, then Disk).
EXPLAIN_TIERS: tuple[str, ...] = ("npu", "cpu", "disk")


class ExplainTier(Struct):
    """One tier of one (instance, DP): ``blocks`` is the tier's exclusive count (what
    ``/query`` reports), ``at_block`` the absolute position (blocks from the start of the
    prompt) the walk reached through this tier, ``stop`` why it went no further there,
    ``held`` the blocks the DP's workers hold on this tier (any content)."""

    blocks: int
    at_block: int
    stop: str
    held: int


class ExplainWorker(Struct):
    """One block holder of the (instance, DP): its medium, backend and walk."""

    medium: str
    backend_id: str
    held: int
    at_block: int
    stop: str


class ExplainLoss(Struct):
    """The last loss of a source: when (wall-clock seconds) and why."""

    at: float
    why: str


class ExplainSource(Struct):
    """A ZeroMQ subscription of the (instance, DP) (or of a pool, in ``pool_sources``):
    ``state`` as in ``GET /workers`` (``connecting``, ``replaying``, ``degraded``,
    ``live``); ``last_event_age_s``: seconds since its last batch, or since it was opened
    when none came yet; ``losses``, ``last_loss``, ``degraded_since`` and ``dropped`` as
    in ``GET /workers``."""

    url: str
    media: list[str]
    is_pool: bool
    state: str
    connected: bool
    events: int
    blocks: int
    last_event_age_s: float
    losses: int = 0
    degraded_since: float | None = None
    last_loss: ExplainLoss | None = None
    dropped: dict[str, int] = {}


class ExplainPrediction(Struct):
    """A live prediction of the (instance, DP) (``POST /predict``): the query's leading
    blocks it covers, its own length, its age and the seconds it has left."""

    blocks: int
    predicted_blocks: int
    age_s: float
    expires_in_s: float


class ExplainInstance(Struct, omit_defaults=True):
    """One (instance, DP): ``registered`` false for a holder of blocks of this index that no
    registration names (data under a DP rank nobody registered, say); ``predictions``
    only when it has live ones; ``engine_url``, ``engine_url_state`` and
    ``engine_url_error`` (as in ``GET /workers``) only when it was registered from an
    engine URL."""

    instance_id: str
    dp_rank: int
    registered: bool
    block_size: int | None
    npu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    tiers: dict[str, ExplainTier]
    workers: list[ExplainWorker]
    sources: list[ExplainSource]
    predictions: list[ExplainPrediction] = []
    engine_url: str | None = None
    engine_url_state: str | None = None
    engine_url_error: str | None = None


class ExplainResponse(Struct):
    """``POST /explain``: why each (instance, DP) of (model, tenant) did or did not match."""

    model: str
    tenant: str
    lora_name: str | None
    index_found: bool
    block_size: int
    registered_block_sizes: list[int]
    query_blocks: int
    offload_pending: int
    pool_pending: int
    warnings: list[str]
    instances: list[ExplainInstance]
    pool_sources: list[ExplainSource]


# ---------------------------------------------------------------------------------------
# /events (docs/api.md, POST /events)
# ---------------------------------------------------------------------------------------


class StoredBlock(Struct):
    """One stored block: engine hash and LocalBlockHash (u64, or negative i64 wrapped)."""

    block_hash: int
    tokens_hash: int


class EventPayload(Struct, kw_only=True):
    """The payload fields of an event: flat on the event, or inside its ``data`` object.

    ``event_type`` has the alias ``type`` and ``parent_hash`` the alias
    ``parent_block_hash``; both spellings are fields here and are merged by
    :meth:`kind_name` and :meth:`parent`.
    """

    event_type: EventName | None = None
    type_: EventName | None = field(default=None, name="type")
    legacy_type: EventName | None = None
    blocks: list[StoredBlock] | None = None
    parent_hash: int | None = None
    parent_block_hash: int | None = None
    token_ids: list[int] | None = None
    block_size: U32 = 0
    seq_hashes: list[int] | None = None
    block_hashes: list[int] | None = None
    medium: EventName | None = None
    backend_id: EventName | None = None
    #: LoRA adapter of a ``token_ids`` store: its blocks are hashed with ``lora_seed(name)``.
    lora_name: EventName | None = None

    def kind_name(self) -> str:
        """The declared type string (``event_type``, else ``type``, else ``legacy_type``)."""
        return self.event_type or self.type_ or self.legacy_type or ""

    def parent(self) -> int | None:
        """``parent_hash`` (or its alias) as u64."""
        p = self.parent_hash if self.parent_hash is not None else self.parent_block_hash
        return None if p is None else to_u64(p, "parent_hash")


class KvCacheEvent(EventPayload, kw_only=True):
    """One event of ``POST /events``: flat payload fields or a nested ``data`` object."""

    event_id: U64
    dp_rank: U32 = 0
    data: Any = None


class KvEventBatch(Struct, kw_only=True):
    """``POST /events``."""

    instance_id: Name
    model_name: Name | None = None
    tenant_id: Name | None = None
    block_size: U32 = 128
    events: list[KvCacheEvent] | None = None
    shutdown: bool = False


class ReadyResponse(Struct):
    """``GET /ready`` 200: every registered ZeroMQ source (``sources`` of them) is ready."""

    status: str
    sources: int


class SourceNotReady(Struct):
    """A ZeroMQ source ``GET /ready`` waits for: ``state`` is ``connecting`` or
    ``replaying``."""

    instance_id: str
    dp_rank: int
    state: str


class NotReadyResponse(Struct):
    """``GET /ready`` 503: the error sentence and the sources that are not ready."""

    error: str
    sources: list[SourceNotReady]


class RecentWarning(Struct):
    """One of ``GET /workers``' ``recent_warnings``: a WARN or ERROR log record of the
    process (``level`` is ``WARN`` or ``ERROR``, ``ts`` RFC 3339 UTC as in the log)."""

    ts: str
    level: str
    message: str


class EventsResponse(Struct, kw_only=True, omit_defaults=True):
    """``{"status": "ok"|"partial", "events_applied": N[, "errors": [...]]}``."""

    status: str
    events_applied: int
    errors: list[str] = []


class PredictTarget(Struct, kw_only=True):
    """``POST /predict`` and ``/predict_by_hash`` (docs/api.md): the body of ``/query``
    (``/query_by_hash``), as a map, plus the (instance, DP) the router chose."""

    instance_id: Name
    dp_rank: U32 = 0


class PredictRecord(Struct, array_like=True):
    """A prediction as the journal logs and applies it: the prompt's full blocks hashed."""

    model: str
    tenant_id: str
    instance_id: str
    dp_rank: int
    block_hashes: list[int]


class PredictResponse(Struct):
    """``{"status": "ok", "predicted_blocks": N, "ttl_s": T}`` (0 blocks: predictions off)."""

    status: str
    predicted_blocks: int
    ttl_s: float


# ---------------------------------------------------------------------------------------
# Shared decoders (msgspec decoders are thread-safe)
# ---------------------------------------------------------------------------------------

register_decoder = msgspec.json.Decoder(RegisterRequest)
unregister_decoder = msgspec.json.Decoder(UnregisterRequest)
events_decoder = msgspec.json.Decoder(KvEventBatch)
#: A logged prediction (the journal's ``predict`` entry: :class:`PredictRecord`, JSON).
predict_record_decoder = msgspec.json.Decoder(PredictRecord)
predict_target_decoders = (
    msgspec.json.Decoder(PredictTarget),
    msgspec.msgpack.Decoder(PredictTarget),
)
json_encoder = msgspec.json.Encoder()
msgpack_encoder = msgspec.msgpack.Encoder()
