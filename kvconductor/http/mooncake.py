"""The Mooncake conductor's HTTP dialect, on its own port (``--mooncake-port``).

A client written for Mooncake's C++ conductor (kvcache-ai/Mooncake,
``mooncake-conductor``: its cache-aware proxy example, routers that read its
``/query`` answer) works against kvconductor unchanged: same routes, bodies, field
names, success bodies and status codes (docs/api.md, "The Mooncake conductor dialect").

* ``POST /register`` is mapped onto our registration (an engine's ``endpoint`` becomes
  its HBM publisher, ``type: Mooncake`` a Mooncake pool publisher) and goes through the
  conductor's journal like a V3 one.
* ``POST /query`` is answered from the same index as V3's: the index answers per
  (instance, DP) with *exclusive* per-tier block counts; this dialect answers
  *cumulative* tokens per rank (``gpu <= cpu <= disk``), ``dp`` (the GPU tokens per
  rank), ``rank_matches`` for every registered rank (zeros included) and the
  instance's maxima (:func:`cumulative_answer`).
* ``POST /unregister`` by service key ``(instance_id, tenant_id, dp_rank)``,
  ``GET /services``, ``GET /health``, ``GET /openapi.json``.

With ``--api-key`` the routes that change state (``/register``, ``/unregister``) need the
same bearer token as V3's (:func:`kvconductor.http.auth.bearer_ok`), and ``/services``
(it lists every engine's publisher URL) needs it as V3's ``/workers`` does, unless
``--open-workers``; without it: 401 ``{"error", "reason": "unauthorized"}``, a WARN, nothing
changed. ``--mooncake-port-open`` opens the port instead, for clients that cannot send a
header (Mooncake's example proxy takes a bare base URL): the start logs a WARN saying so.

Bodies are JSON, or MessagePack when the request's ``Content-Type`` says so (Mooncake's
newest proxy sends MessagePack, token ids as a bin of little-endian int32); the answer
is encoded like the request. Errors are ``{"error", "reason"[, "field"]}`` with the
status codes of Mooncake's server: 400 for every bad body, 404 for an unknown service
on ``/unregister``, 405 for a wrong method, 500 when a subscription cannot be opened.

Why its own port: Mooncake's clients take a base URL without a path (its proxy refuses
one) and call ``/register`` and ``/query``, which V3 already answers with other bodies;
and the V3 port's query fast path (:mod:`kvconductor.http.direct`) stays untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import falcon
import falcon.asgi
import msgspec

from kvconductor._hash import DEFAULT_SEED, lora_seed
from kvconductor.extrakeys import salted_local_hashes
from kvconductor.http.dialects import (
    DialectError,
    HealthRoute,
    ListingRoute,
    OnceWarnings,
    PostRoute,
    Voice,
    dialect_app,
    register_v3,
    unregister_request,
)
from kvconductor.http.fields import UnknownFieldWarnings, unknown_fields
from kvconductor.http.resource import JsonDocument
from kvconductor.schema import (
    DEFAULT_TENANT,
    Name,
    PositiveU32,
    RegisterRequest,
    decode_error_message,
    json_encoder,
)
from kvconductor.schema_mooncake import (
    MooncakeError,
    MooncakeHashProfile,
    MooncakeInstanceMatch,
    MooncakeQueryRequest,
    MooncakeQueryResponse,
    MooncakeRankMatch,
    MooncakeRegisterRequest,
    MooncakeRegisterResponse,
    MooncakeUnregisterRequest,
    MooncakeUnregisterResponse,
)
from kvconductor.state.conductor import Conductor, StateUnavailable
from kvconductor.wire import WireError, parse_query_ext

log = logging.getLogger("kvconductor.mooncake")

#: Publisher types Mooncake's conductor takes (case-insensitive here), as we name them.
PUBLISHERS = {"vllm": "vLLM", "sglang": "SGLang", "mooncake": "Mooncake"}
REGISTERED = "registered successfully"
UNREGISTERED = "unregistered successfully"
#: The body of a request that does not decode, per route kind (Mooncake's messages).
_INVALID_BODY = "Invalid JSON"
_INVALID_QUERY = "Invalid JSON object"

_register_json = msgspec.json.Decoder(MooncakeRegisterRequest)
_register_msgpack = msgspec.msgpack.Decoder(MooncakeRegisterRequest)
_unregister_json = msgspec.json.Decoder(MooncakeUnregisterRequest)
_unregister_msgpack = msgspec.msgpack.Decoder(MooncakeUnregisterRequest)


class _QueryFields(msgspec.Struct, kw_only=True):
    """:class:`~kvconductor.schema_mooncake.MooncakeQueryRequest` with ``token_ids`` left undecoded
    (the V3 parser reads them into a C buffer): no Python int per token."""

    model: Name
    block_size: PositiveU32
    token_ids: msgspec.Raw
    tenant_id: Name | None = DEFAULT_TENANT
    lora_name: Name | None = None
    instance_id: Name | None = None
    cache_salt: str | None = None


assert _QueryFields.__struct_fields__ == MooncakeQueryRequest.__struct_fields__
_query_json = msgspec.json.Decoder(_QueryFields)
_query_msgpack = msgspec.msgpack.Decoder(_QueryFields)

#: The dialect's errors: ``{"error", "reason"[, "field"]}``, in the request's encoding.
VOICE = Voice(log, "mooncake dialect", lambda ex: MooncakeError(ex.message, ex.reason, ex.field))


def service_key(instance_id: str, tenant_id: str, dp_rank: int) -> str:
    """Mooncake's service key ``instance|tenant|dp`` (``removed_instances``)."""
    return f"{instance_id}|{tenant_id}|{dp_rank}"


def _tenant(value: str | None) -> str:
    return value or DEFAULT_TENANT


def _decode(decoder_json: Any, decoder_msgpack: Any, body: bytes, msgpack: bool, what: str):
    try:
        return (decoder_msgpack if msgpack else decoder_json).decode(body)
    except msgspec.ValidationError as ex:
        raise DialectError(
            400, "invalid_value", f"invalid {what}: {decode_error_message(ex)}"
        ) from None
    except (msgspec.DecodeError, RecursionError):
        raise DialectError(
            400, "invalid_json", _INVALID_QUERY if what == "query" else _INVALID_BODY
        ) from None


# -- registration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Service:
    """One Mooncake-dialect registration (a service key), as the client sent it."""

    instance_id: str
    tenant_id: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str
    publisher: str
    model_name: str
    lora_name: str
    block_size: int
    cache_group: int | None
    hash_profile: MooncakeHashProfile | None

    @property
    def key(self) -> str:
        return service_key(self.instance_id, self.tenant_id, self.dp_rank)

    def to_json(self) -> dict[str, Any]:
        """Mooncake's ``GET /services`` entry (its ``ServiceConfig`` field names)."""
        profile = None
        if self.hash_profile is not None:
            profile = msgspec.structs.asdict(self.hash_profile)
        return {
            "Endpoint": self.endpoint,
            "ReplayEndpoint": self.replay_endpoint,
            "Type": self.publisher,
            "ModelName": self.model_name,
            "LoraName": self.lora_name,
            "TenantID": self.tenant_id,
            "InstanceID": self.instance_id,
            "BlockSize": self.block_size,
            "DPRank": self.dp_rank,
            "CacheGroup": self.cache_group,
            "HashProfile": profile,
        }


def parse_register(body: bytes, msgpack: bool) -> tuple[Service, list[str]]:
    """A Mooncake ``/register`` body -> the :class:`Service` and the warnings to log (fields
    accepted for older clients but not used; fields it does not know are named by
    :class:`RegisterRoute`, as V3's are). :class:`DialectError` (400) on a bad one."""
    req = _decode(_register_json, _register_msgpack, body, msgpack, "registration")
    for name, value in (
        ("endpoint", req.endpoint),
        ("type", req.type),
        ("modelname", req.modelname),
        ("instance_id", req.instance_id),
    ):
        if not value:
            raise DialectError(400, "invalid_value", f"{name} must not be empty", name)
    publisher = PUBLISHERS.get(req.type.lower())
    if publisher is None:
        raise DialectError(400, "invalid_value", "type must be vLLM, SGLang or Mooncake", "type")
    if req.cache_group not in (None, 0):
        raise DialectError(400, "unsupported", "only cache group zero is supported", "cache_group")
    warnings = []
    if req.hash_profile is None and publisher != "Mooncake":
        warnings.append("no hash_profile (an older client): accepted")
    if req.additionalsalt:
        warnings.append("additionalsalt is accepted and ignored (blocks are matched by tokens)")
    svc = Service(
        instance_id=req.instance_id,
        tenant_id=_tenant(req.tenant_id),
        dp_rank=req.dp_rank,
        endpoint=req.endpoint,
        replay_endpoint=req.replay_endpoint or "",
        publisher=publisher,
        model_name=req.modelname,
        lora_name=req.lora_name or "",
        block_size=req.block_size,
        cache_group=req.cache_group,
        hash_profile=req.hash_profile,
    )
    return svc, warnings


def to_v3_register(svc: Service) -> tuple[RegisterRequest, bytes]:
    """Our registration of ``svc`` and its V3 JSON body (what the journal logs).

    An engine (vLLM, SGLang) publishes on ``endpoint``: its HBM publisher (its CPU and
    disk offload events arrive there too, with their medium). ``type: Mooncake`` is a
    Mooncake pool publisher (docs/api.md, "Pool registrations")."""
    doc: dict[str, Any] = {
        "instance_id": svc.instance_id,
        "type": svc.publisher,
        "modelname": svc.model_name,
        "block_size": svc.block_size,
        "dp_rank": svc.dp_rank,
        "tenant_id": svc.tenant_id,
        "lora_name": svc.lora_name,  # "": the base model
    }
    if svc.publisher == "Mooncake":
        doc["store_backend"] = "Mooncake"
        doc["endpoint"] = svc.endpoint
        doc["shared_store"] = True  # Mooncake's store: shared by its context
    else:
        doc["medium_endpoints"] = {"npu": svc.endpoint}
    if svc.replay_endpoint:
        doc["replay_endpoint"] = svc.replay_endpoint
    body = json_encoder.encode(doc)
    return msgspec.json.decode(body, type=RegisterRequest), body


# -- query ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """A parsed Mooncake ``/query``: tokens as a u32 buffer cut to complete blocks."""

    model: str
    block_size: int
    tenant_id: str
    tokens: Any
    lora_name: str
    instance_id: str | None
    cache_salt: str | None


def parse_query(body: bytes, msgpack: bool) -> Query:
    """A Mooncake ``/query`` body. The token ids go straight into a C buffer (the V3
    parser, which skips the fields it does not know); the other fields are checked with
    :class:`~kvconductor.schema_mooncake.MooncakeQueryRequest`. Only complete blocks count
    (Mooncake's rule), so a trailing partial block is cut off here."""
    req = _decode(_query_json, _query_msgpack, body, msgpack, "query")
    if not req.model:
        raise DialectError(400, "invalid_value", "model must not be empty", "model")
    try:
        model, block_size, _, tokens, *_ = parse_query_ext(body, msgpack, False)
    except WireError as ex:
        raise DialectError(400, "invalid_value", str(ex)) from None
    full = len(tokens) - len(tokens) % block_size
    if full != len(tokens):
        tokens = tokens[:full]
    return Query(
        model=model,
        block_size=block_size,
        tenant_id=_tenant(req.tenant_id),
        tokens=tokens,
        lora_name=req.lora_name or "",
        instance_id=req.instance_id,
        cache_salt=req.cache_salt or None,
    )


def cumulative_answer(
    hits: Iterable[tuple[str, int, int, int, int]],
    registered: Iterable[tuple[str, int]],
    block_size: int,
) -> dict[str, MooncakeInstanceMatch]:
    """The Mooncake answer of an index answer ``hits`` (exclusive blocks per tier per
    (instance, DP): ``(instance_id, dp_rank, npu, cpu, disk)`` tuples, ``QueryResult.tuples()``
    or ``DpHit`` rows), with every ``registered`` (instance, DP) present (zeros when it
    holds nothing).

    Per rank, in tokens: ``gpu`` = the HBM run; ``cpu`` = the HBM run continued on CPU
    (HBM + CPU blocks); ``disk`` = continued on disk too (all three): so ``gpu <= cpu <=
    disk`` and ``disk`` is V3's ``matched_tokens``. ``dp[rank]`` is the rank's ``gpu``;
    the instance's ``gpu``, ``cpu``, ``disk`` are the maxima over its ranks and
    ``longest_matched`` its ``disk`` (Mooncake's definitions)."""
    ranks: dict[str, dict[int, tuple[int, int, int]]] = {}
    for iid, rank in registered:
        ranks.setdefault(iid, {})[rank] = (0, 0, 0)
    for iid, rank, npu, cpu_blocks, disk_blocks in hits:
        gpu = npu * block_size
        cpu = gpu + cpu_blocks * block_size
        disk = cpu + disk_blocks * block_size
        ranks.setdefault(iid, {})[rank] = (gpu, cpu, disk)
    out: dict[str, MooncakeInstanceMatch] = {}
    for iid in sorted(ranks):
        per = ranks[iid]
        gpu = cpu = disk = 0
        dp: dict[str, int] = {}
        rank_matches: dict[str, MooncakeRankMatch] = {}
        for r in sorted(per):
            g, c, d = per[r]
            dp[str(r)] = g
            rank_matches[str(r)] = MooncakeRankMatch(g, c, d)
            gpu, cpu, disk = max(gpu, g), max(cpu, c), max(disk, d)
        out[iid] = MooncakeInstanceMatch(disk, dp, rank_matches, gpu, cpu, disk)
    return out


# -- the app --------------------------------------------------------------------------------


class Dialect:
    """The Mooncake-dialect registrations (service key -> :class:`Service`) over a
    :class:`Conductor`, read and written on its ingest thread only. The registry stays
    the truth of what is registered: a service whose (instance, DP) is no longer
    registered there (unregistered over V3, a change of model) is not listed."""

    #: Contexts whose registered ranks are kept between registration changes.
    CACHED_CONTEXTS = 4096

    voice = VOICE

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.services: dict[str, Service] = {}
        #: Fields of a registration the dialect does not know, named once per instance.
        self.unknown = UnknownFieldWarnings(log, "mooncake dialect: register")
        self.warnings = OnceWarnings(log)
        #: +1 on every change of :attr:`services` (ingest thread; read anywhere).
        self.generation = 0
        #: query context -> ((registry generation, ours), its registered ranks): a query
        #: asks the ingest thread only when a registration changed since (event loop).
        self._ranks: dict[tuple, tuple[tuple[int, int], list[tuple[str, int]]]] = {}

    # ingest thread ---------------------------------------------------------------------
    def _registered_dps(
        self, model: str, tenant: str, block_size: int, lora_name: str, instance_id: str | None
    ) -> list[tuple[str, int]]:
        """The engine (instance, DP)s of a query's context: registered in (model, tenant)
        with ``block_size``, not a pool; a Mooncake-dialect one also with ``lora_name``."""
        out = []
        by_dp = {(s.instance_id, s.dp_rank): s for s in self._live_services()}
        for iid, entry in self.conductor.registry.instances.items():
            if instance_id is not None and iid != instance_id:
                continue
            for dp, ep in entry.endpoints.items():
                if ep.is_pool or ep.index_key != (model, tenant) or ep.block_size != block_size:
                    continue
                svc = by_dp.get((iid, dp))
                if svc is not None and svc.lora_name != lora_name:
                    continue
                if svc is None and lora_name:
                    continue
                out.append((iid, dp))
        return out

    def _live_services(self) -> list[Service]:
        reg = self.conductor.registry
        out = []
        for svc in self.services.values():
            entry = reg.get(svc.instance_id)
            ep = None if entry is None else entry.endpoints.get(svc.dp_rank)
            if ep is not None and (ep.tenant_id, ep.model_name, ep.block_size) == (
                svc.tenant_id,
                svc.model_name,
                svc.block_size,
            ):
                out.append(svc)
        return sorted(out, key=lambda s: s.key)

    def _remember(self, svc: Service) -> None:
        self.services[svc.key] = svc
        live = {s.key for s in self._live_services()}
        for key in [k for k in self.services if k not in live]:
            del self.services[key]
        self.generation += 1

    def _forget(self, key: str) -> None:
        self.services.pop(key, None)
        self.generation += 1

    # event loop ------------------------------------------------------------------------
    async def register(self, svc: Service) -> None:
        await register_v3(self.conductor, *to_v3_register(svc), "Failed to subscribe")
        await self.conductor.run(self._remember, svc)

    async def unregister(self, instance_id: str, tenant: str, dp_rank: int) -> str:
        key = service_key(instance_id, tenant, dp_rank)
        reg = self.conductor.registry
        req = await self.conductor.run(unregister_request, reg, instance_id, dp_rank, tenant)
        if req is None:
            raise DialectError(404, "not_found", f"service not found: {key}")
        body = json_encoder.encode(req)
        try:
            found = await self.conductor.mutate("unregister", body, req)
        except StateUnavailable as ex:
            raise DialectError(
                500, "unregister_failed", f"Failed to unregister prefix context: {ex}"
            ) from None
        await self.conductor.run(self._forget, key)
        if not found:
            raise DialectError(404, "not_found", f"service not found: {key}")
        return key

    async def query(self, q: Query) -> MooncakeQueryResponse:
        registered = await self._registered(q)
        hits: Sequence[tuple[str, int, int, int, int]] = ()
        index = self.conductor.get_index(q.model, q.tenant_id)
        if index is not None and len(q.tokens):
            seed = lora_seed(q.lora_name) if q.lora_name else DEFAULT_SEED
            instances = None if q.instance_id is None else [q.instance_id]
            # the rows as plain tuples made in C (docs/api.md, "Reading an answer in Python")
            if q.cache_salt is None:
                hits = index.query(q.tokens, q.block_size, seed, instances=instances).tuples()
            else:  # the salt in the first block's hash, as vLLM's (docs/api.md, "Extra keys")
                local = salted_local_hashes(q.tokens, q.block_size, seed, q.cache_salt)
                hits = index.query_by_hash(local, instances=instances).tuples()
        return MooncakeQueryResponse(cumulative_answer(hits, registered, q.block_size))

    async def _registered(self, q: Query) -> list[tuple[str, int]]:
        ctx = (q.model, q.tenant_id, q.block_size, q.lora_name, q.instance_id)
        gen = (self.conductor.registry_generation, self.generation)
        hit = self._ranks.get(ctx)
        if hit is not None and hit[0] == gen:
            return hit[1]
        ranks = await self.conductor.run(self._registered_dps, *ctx)
        if len(self._ranks) >= self.CACHED_CONTEXTS:
            self._ranks.clear()
        self._ranks[ctx] = (gen, ranks)  # the generation read before: never newer than ranks
        return ranks

    async def listing(self) -> dict[str, Any]:
        """``GET /services``."""
        live = await self.conductor.run(self._live_services)
        return {"count": len(live), "services": [s.to_json() for s in live]}


class RegisterRoute(PostRoute[Dialect]):
    async def answer(
        self, req: falcon.asgi.Request, body: bytes, msgpack: bool
    ) -> MooncakeRegisterResponse:
        svc, warnings = parse_register(body, msgpack)
        for w in warnings:
            self.dialect.warnings.warn(w, "mooncake dialect: register: %s", w)
        await self.dialect.register(svc)
        self.dialect.unknown.warn(
            svc.instance_id, unknown_fields(body, msgpack, MooncakeRegisterRequest)
        )
        log.info("mooncake dialect: registered service_key=%s type=%s", svc.key, svc.publisher)
        return MooncakeRegisterResponse(REGISTERED, svc.instance_id)


class UnregisterRoute(PostRoute[Dialect]):
    async def answer(
        self, req: falcon.asgi.Request, body: bytes, msgpack: bool
    ) -> MooncakeUnregisterResponse:
        r = _decode(_unregister_json, _unregister_msgpack, body, msgpack, "unregistration")
        if not r.instance_id:
            raise DialectError(400, "invalid_value", "instance_id must not be empty", "instance_id")
        key = await self.dialect.unregister(r.instance_id, _tenant(r.tenant_id), r.dp_rank)
        return MooncakeUnregisterResponse(UNREGISTERED, [key])


class QueryRoute(PostRoute[Dialect]):
    async def answer(
        self, req: falcon.asgi.Request, body: bytes, msgpack: bool
    ) -> MooncakeQueryResponse:
        return await self.dialect.query(parse_query(body, msgpack))


def create_mooncake_app(
    conductor: Conductor,
    *,
    max_body_bytes: int = 64 * 1024 * 1024,
    api_key: str | None = None,
    open_services: bool = False,
) -> Any:
    """The Falcon ASGI app of the Mooncake dialect over ``conductor`` (served on its own
    port by ``kv-conductor --mooncake-port``).

    ``api_key``: the bearer token ``/register`` and ``/unregister`` need (the server's
    ``--api-key``, ``None`` with ``--mooncake-port-open``), and ``/services`` too unless
    ``open_services`` (``--open-workers``); ``/query``, ``/health`` and
    ``/openapi.json`` stay open, as V3's queries do."""
    from kvconductor.http import openapi

    dialect = Dialect(conductor)
    key = api_key or None
    services_key = None if open_services else key
    return dialect_app(
        VOICE,
        {
            "/register": RegisterRoute(dialect, max_body_bytes, key),
            "/unregister": UnregisterRoute(dialect, max_body_bytes, key),
            "/query": QueryRoute(dialect, max_body_bytes),
            "/services": ListingRoute(dialect, max_body_bytes, services_key),
            "/health": HealthRoute(),
            "/openapi.json": JsonDocument(openapi.mooncake_document),
        },
    )
