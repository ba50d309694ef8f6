"""Dynamo's standalone KV indexer dialect, on its own port (``--dynamo-port``).

A client written for ``python -m dynamo.indexer`` (PyPI ``ai-dynamo-runtime`` 1.6.1:
Dynamo's router pieces, tools that ask it for overlaps) works against kvconductor
unchanged: same routes, bodies, field names, success bodies and status codes
(docs/api.md, "The Dynamo indexer dialect"; the shapes: :mod:`kvconductor.schema_dynamo`).

* ``POST /register`` ``{instance_id, endpoint, model_name, block_size, dp_rank,
  routing_group}`` is our registration of a vLLM publisher on ``endpoint`` (its HBM
  publisher; its CPU offload events arrive there too): instance ``str(instance_id)``,
  model ``model_name``, tenant ``routing_group`` (``"default"`` is our default tenant);
  201 ``{"status": "ok"}``, 409 when the (instance, DP) is already registered or the
  (model, group) has another block size (Dynamo's rules). It goes through the
  conductor's journal like a V3 one.
* ``POST /unregister`` ``{instance_id, model_name[, dp_rank]}``: one DP, or every DP of
  the instance; 404 ``instance N not found``.
* ``POST /query`` ``{token_ids, model_name[, routing_group, lora_name, cache_salt]}``
  and ``POST /query_by_hash`` ``{block_hashes: [i64], model_name}``: answered from the same index
  as V3's with the (model, group)'s block size, in Dynamo's shape and units (matched
  tokens): ``scores`` the GPU (HBM) tokens per instance and rank, ``instances`` the
  cumulative tiers per instance (:func:`dynamo_answer`); 404 ``no indexer for model=...
  routing_group=...`` when nothing is registered there.
* ``GET /workers``, ``GET /health``, ``GET /openapi.json``.

Bodies are JSON only, as Dynamo's (415 otherwise); every error is ``{"error": "..."}``
(Dynamo answers its 400/415/422 in plain text: docs/api.md). With ``--api-key``,
``/register``, ``/unregister`` and ``/workers`` (unless ``--open-workers``) need the
V3 bearer token, unless ``--dynamo-port-open``.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import falcon
import falcon.asgi
import msgspec

from kvconductor._hash import DEFAULT_SEED, lora_seed
from kvconductor.extrakeys import salted_local_hashes
from kvconductor.http.dialects import (
    DialectError,
    Door,
    HealthRoute,
    ListingRoute,
    PostRoute,
    Voice,
    dialect_app,
    register_v3,
    unregister_request,
)
from kvconductor.http.fields import UnknownFieldWarnings, unknown_fields
from kvconductor.http.mooncake import cumulative_answer
from kvconductor.http.resource import JsonDocument
from kvconductor.schema import U32_MAX, U64_MAX, RegisterRequest, decode_error_message, json_encoder
from kvconductor.schema_dynamo import (
    DynamoError,
    DynamoHashQueryRequest,
    DynamoInstanceMatch,
    DynamoListener,
    DynamoQueryHead,
    DynamoQueryRequest,
    DynamoQueryResponse,
    DynamoRegisterRequest,
    DynamoStatus,
    DynamoUnregisterRequest,
    DynamoWorker,
)
from kvconductor.state.conductor import Conductor, StateUnavailable
from kvconductor.state.protocols import QuerySource
from kvconductor.wire import WireError, parse_query

log = logging.getLogger("kvconductor.dynamo")

VOICE = Voice(log, "dynamo dialect", lambda ex: DynamoError(ex.message), msgpack=False)
OK = DynamoStatus("ok")
#: The messages of a body Dynamo's HTTP framework (axum) refuses.
MEDIA_TYPE = "Expected request with `Content-Type: application/json`"
DESERIALIZE = "Failed to deserialize the JSON body into the target type: "
PARSE = "Failed to parse the request body as JSON: "
#: Dynamo's 400 for a ``cache_salt`` (even ``""``) on ``/query_by_hash``.
SALTED_HASHES = (
    "cache_salt is not accepted by /query_by_hash; "
    "block_hashes must already include the intended cache salt"
)


def media_type(req: falcon.asgi.Request) -> None:
    """415 without a JSON content type (Dynamo's status)."""
    ctype = (req.content_type or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise DialectError(415, "unsupported_media_type", MEDIA_TYPE)


def decode(req: falcon.asgi.Request, body: bytes, shape: type[Any]) -> Any:
    """``body`` as ``shape``: 415 without a JSON content type, 400 for bad JSON, 422 for
    a body of another shape (Dynamo's statuses)."""
    media_type(req)
    try:
        doc = msgspec.json.decode(body, type=shape)
    except msgspec.ValidationError as ex:
        raise DialectError(422, "invalid_value", DESERIALIZE + decode_error_message(ex)) from None
    except (msgspec.DecodeError, RecursionError) as ex:
        raise DialectError(400, "invalid_json", f"{PARSE}{ex}") from None
    if getattr(doc, "instance_id", 0) > U64_MAX:  # the u64 bound, checked after decoding
        raise DialectError(
            422, "invalid_value", f"{DESERIALIZE}Expected `int` <= {U64_MAX} - at `$.instance_id`"
        )
    return doc


#: A V3 ``/query_by_hash`` body around a raw JSON array: V3's parser reads it as u64s.
_WIDE_HEAD = b'{"model":"dynamo","block_hashes":'
#: Where the low and the high half of a u64 stand in its two u32 items.
_LO, _HI = (0, 1) if sys.byteorder == "little" else (1, 0)


def u32_array(raw: msgspec.Raw) -> array | None:
    """``raw``, the JSON text of an array of u32, as ``array('I')``, read by V3's query
    parser (:func:`kvconductor.wire.parse_query`) straight into a C buffer: no Python
    int per token. ``None`` for anything else (the caller's typed decode says why)."""
    try:
        wide = parse_query(b"".join((_WIDE_HEAD, raw, b"}")), False, True)[3]
    except WireError:
        return None  # a negative, a float, a string, not an array, beyond u64
    halves = array("I", wide.tobytes())
    high = halves[_HI::2].tobytes()
    if high != bytes(len(high)):
        return None  # beyond u32
    return halves[_LO::2]


def decode_tokens(
    req: falcon.asgi.Request, body: bytes
) -> tuple[DynamoQueryHead | DynamoQueryRequest, array]:
    """A ``/query`` body and its token ids as ``array('I')``: the hot path reads the
    names with msgspec and the ids with V3's parser (:func:`u32_array`); a body it
    refuses is decoded again by :func:`decode`, whose error (Dynamo's status, the
    element named) is the answer, so errors are those of the typed decode."""
    media_type(req)
    try:
        head = msgspec.json.decode(body, type=DynamoQueryHead)
    except (msgspec.DecodeError, RecursionError):
        head = None
    tokens = None if head is None else u32_array(head.token_ids)
    if head is None or tokens is None:
        q = decode(req, body, DynamoQueryRequest)
        return q, array("I", q.token_ids)
    return head, tokens


def i64_as_u64(block_hashes: list[int]) -> array:
    """Dynamo's signed hashes as the index's u64 (two's complement, in C)."""
    return array("Q", array("q", block_hashes).tobytes())


def no_indexer(model: str, group: str) -> DialectError:
    return DialectError(404, "not_found", f"no indexer for model={model} routing_group={group}")


#: A Dynamo registration's ``store_only`` bound: the largest (Dynamo has none).
STORE_ONLY = {"ttl_secs": 30 * 24 * 3600, "capacity": U32_MAX}


def to_v3_register(r: DynamoRegisterRequest) -> tuple[RegisterRequest, bytes]:
    """Our registration of a Dynamo one and its V3 JSON body (what the journal logs): a
    vLLM engine publishing on ``endpoint`` (its HBM publisher), any LoRA, its CPU and
    disk events indexed as they come (``store_only`` with the largest bounds: Dynamo
    trusts an engine's offload events, no pool confirms them; docs/api.md)."""
    doc: dict[str, Any] = {
        "instance_id": str(r.instance_id),
        "type": "vLLM",
        "modelname": r.model_name,
        "block_size": r.block_size,
        "dp_rank": r.dp_rank,
        "tenant_id": r.routing_group,
        "medium_endpoints": {"npu": r.endpoint},
        "store_only": STORE_ONLY,
    }
    if r.replay_endpoint:
        doc["replay_endpoint"] = r.replay_endpoint
    body = json_encoder.encode(doc)
    return msgspec.json.decode(body, type=RegisterRequest), body


def dynamo_answer(
    hits: Iterable[tuple[str, int, int, int, int]], block_size: int
) -> DynamoQueryResponse:
    """Dynamo's answer of an index answer ``hits`` (exclusive blocks per tier per
    (instance, DP), as :func:`kvconductor.http.mooncake.cumulative_answer` takes them):
    ``instances``: per instance that matched anything, the cumulative tokens (``gpu <=
    cpu <= disk``, the maxima over its ranks, ``longest_matched`` = ``disk``) and ``dp``
    (each matching rank's GPU tokens); ``scores``: the ranks whose GPU tokens are above
    zero."""
    per = cumulative_answer([h for h in hits if h[2] or h[3] or h[4]], (), block_size)
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, DynamoInstanceMatch] = {}
    for iid, m in per.items():
        gpu = {rank: tokens for rank, tokens in m.dp.items() if tokens}
        if gpu:
            scores[iid] = gpu
        instances[iid] = DynamoInstanceMatch(m.longest_matched, m.gpu, m.dp, m.cpu, m.disk)
    return DynamoQueryResponse(scores, [], instances)


class Answers:
    """The dialect's two queries over an index ``source``: the :class:`Conductor` (one
    process, the owner) or a worker's :class:`~kvconductor.state.shared.SharedView`
    (``--workers N``: the queries answered in the worker). Both say ``get_index`` and
    ``block_sizes``, the registered block sizes per (model, tenant)."""

    voice = VOICE

    def __init__(self, source: QuerySource) -> None:
        self.source = source

    async def listing(self) -> Any:
        raise DialectError(404, "not_found", "not served here")  # the owner's

    def block_size(self, model: str, group: str) -> int:
        """The block size of (model, group)'s registrations (the smallest, if V3 added
        others; Dynamo allows one); 404 when none is registered (any thread)."""
        self.source.get_index(model, group)  # a worker's view: reloaded if it changed
        sizes = self.source.block_sizes.get((model, group))
        if not sizes:
            raise no_indexer(model, group)
        return min(sizes)

    async def query(
        self, q: DynamoQueryHead | DynamoQueryRequest, tokens: array
    ) -> DynamoQueryResponse:
        """``q``'s answer; ``tokens``: its token ids (:func:`decode_tokens`)."""
        size = self.block_size(q.model_name, q.routing_group)
        index = self.source.get_index(q.model_name, q.routing_group)
        full = len(tokens) - len(tokens) % size  # complete blocks only
        hits: Sequence[tuple[str, int, int, int, int]] = ()
        if index is not None and full:
            seed = lora_seed(q.lora_name) if q.lora_name else DEFAULT_SEED
            values = tokens if full == len(tokens) else tokens[:full]
            if not q.cache_salt:
                hits = index.query(values, size, seed).tuples()
            else:  # the salt in the first block's hash, as vLLM's (docs/api.md)
                local = salted_local_hashes(values, size, seed, q.cache_salt)
                hits = index.query_by_hash(local).tuples()
        return dynamo_answer(hits, size)

    async def query_by_hash(self, q: DynamoHashQueryRequest) -> DynamoQueryResponse:
        if q.cache_salt is not None:
            raise DialectError(400, "invalid_value", SALTED_HASHES)
        size = self.block_size(q.model_name, q.routing_group)
        index = self.source.get_index(q.model_name, q.routing_group)
        hits: Sequence[tuple[str, int, int, int, int]] = ()
        if index is not None and q.block_hashes:
            hits = index.query_by_hash(i64_as_u64(q.block_hashes)).tuples()
        return dynamo_answer(hits, size)


class Dialect(Answers):
    """The Dynamo dialect over a :class:`Conductor`: its queries (:class:`Answers`), and
    its registrations, which are the registry's (the truth of what is registered)."""

    def __init__(self, conductor: Conductor) -> None:
        super().__init__(conductor)
        self.conductor = conductor
        self.unknown = UnknownFieldWarnings(log, "dynamo dialect: register")

    # ingest thread ---------------------------------------------------------------------
    def _engines(self) -> Iterable[tuple[str, Any]]:
        for iid, entry in self.conductor.registry.instances.items():
            for ep in entry.endpoints.values():
                if not ep.is_pool:
                    yield iid, ep

    def _conflict(self, r: DynamoRegisterRequest) -> str | None:
        """Dynamo's 409s: the (instance, DP) registered, another block size in the group."""
        iid = str(r.instance_id)
        entry = self.conductor.registry.get(iid)
        if entry is not None and r.dp_rank in entry.endpoints:
            return f"instance {iid} dp_rank {r.dp_rank} already registered"
        sizes = self.conductor.block_sizes.get((r.model_name, r.routing_group), ())
        if sizes and r.block_size not in sizes:
            return (
                f"block_size mismatch for model={r.model_name} routing_group={r.routing_group}: "
                f"existing={min(sizes)}, requested={r.block_size}"
            )
        return None

    def _unregistrations(self, r: DynamoUnregisterRequest) -> list[Any] | str:
        """V3's unregistrations of a Dynamo one, or the 404's message."""
        iid = str(r.instance_id)
        entry = self.conductor.registry.get(iid)
        eps = [] if entry is None else [ep for ep in entry.endpoints.values() if not ep.is_pool]
        eps = [ep for ep in eps if ep.tenant_id == r.routing_group]
        if not eps:
            return f"instance {iid} not found"
        if eps[0].model_name != r.model_name:
            return (
                f"instance {iid} is registered for model={eps[0].model_name} "
                f"routing_group={eps[0].tenant_id}"
            )
        dps = [ep.dp_rank for ep in eps if r.dp_rank in (None, ep.dp_rank)]
        if not dps:
            return f"instance {iid} dp_rank {r.dp_rank} not found"
        reg = self.conductor.registry
        return [unregister_request(reg, iid, dp, r.routing_group) for dp in sorted(dps)]

    def _workers(self) -> list[DynamoWorker]:
        states = {
            (s["instance_id"], s["dp_rank"], s["url"]): s["state"] for s in self.conductor.sources()
        }
        out: dict[str, DynamoWorker] = {}
        for iid, ep in self._engines():
            if not (iid.isascii() and iid.isdigit()) or str(int(iid)) != iid or int(iid) > U64_MAX:
                continue  # not a name a Dynamo client can give (a u64 in decimal)
            w = out.get(iid)
            if w is None:
                w = out[iid] = DynamoWorker(
                    int(iid), "zmq", "active", ep.model_name, ep.tenant_id, ep.block_size, {}, {}
                )
            url = next(iter(ep.medium_endpoints.values()), "")
            w.endpoints[str(ep.dp_rank)] = url
            w.listeners[str(ep.dp_rank)] = DynamoListener(
                url, states.get((iid, ep.dp_rank, url), "none")
            )
        return [out[k] for k in sorted(out, key=int)]

    # event loop ------------------------------------------------------------------------
    async def register(self, r: DynamoRegisterRequest) -> None:
        problem = await self.conductor.run(self._conflict, r)
        if problem is not None:
            raise DialectError(409, "conflict", problem)
        await register_v3(self.conductor, *to_v3_register(r), "failed to register")

    async def unregister(self, r: DynamoUnregisterRequest) -> None:
        reqs = await self.conductor.run(self._unregistrations, r)
        if isinstance(reqs, str):
            raise DialectError(404, "not_found", reqs)
        for req in reqs:
            try:
                await self.conductor.mutate("unregister", json_encoder.encode(req), req)
            except StateUnavailable as ex:
                raise DialectError(
                    500, "unregister_failed", f"failed to unregister: {ex}"
                ) from None

    async def listing(self) -> list[DynamoWorker]:
        """``GET /workers``."""
        return await self.conductor.run(self._workers)


class RegisterRoute(PostRoute[Dialect]):
    status = 201

    async def answer(self, req: falcon.asgi.Request, body: bytes, msgpack: bool) -> DynamoStatus:
        r = decode(req, body, DynamoRegisterRequest)
        await self.dialect.register(r)
        self.dialect.unknown.warn(
            str(r.instance_id), unknown_fields(body, False, DynamoRegisterRequest)
        )
        log.info(
            "dynamo dialect: registered instance_id=%d dp_rank=%d model=%s routing_group=%s",
            r.instance_id,
            r.dp_rank,
            r.model_name,
            r.routing_group,
        )
        return OK


class UnregisterRoute(PostRoute[Dialect]):
    async def answer(self, req: falcon.asgi.Request, body: bytes, msgpack: bool) -> DynamoStatus:
        r = decode(req, body, DynamoUnregisterRequest)
        await self.dialect.unregister(r)
        log.info("dynamo dialect: unregistered instance_id=%d dp_rank=%s", r.instance_id, r.dp_rank)
        return OK


class QueryRoute(PostRoute[Answers]):
    async def answer(
        self, req: falcon.asgi.Request, body: bytes, msgpack: bool
    ) -> DynamoQueryResponse:
        return await self.dialect.query(*decode_tokens(req, body))


class HashQueryRoute(PostRoute[Answers]):
    async def answer(
        self, req: falcon.asgi.Request, body: bytes, msgpack: bool
    ) -> DynamoQueryResponse:
        return await self.dialect.query_by_hash(decode(req, body, DynamoHashQueryRequest))


def query_routes(answers: Answers, max_body_bytes: int) -> dict[str, object]:
    """The query routes over ``answers`` (the app's; a worker's, :func:`create_query_app`)."""
    return {
        "/query": QueryRoute(answers, max_body_bytes),
        "/query_by_hash": HashQueryRoute(answers, max_body_bytes),
    }


def create_query_app(source: QuerySource, max_body_bytes: int) -> Any:
    """The dialect's query routes over ``source`` alone: a worker of ``--workers N``
    answers them from its view of the shared index (its other routes are the owner's)."""
    return dialect_app(VOICE, query_routes(Answers(source), max_body_bytes))


def create_dynamo_app(conductor: Conductor, door: Door = Door()) -> Any:
    """The Falcon ASGI app of Dynamo's indexer dialect over ``conductor``, served on its
    own port by ``kv-conductor --dynamo-port`` with ``door``: ``/register`` and
    ``/unregister`` need its key, ``/workers`` too unless it is open; the queries,
    ``/health`` and ``/openapi.json`` stay open, as V3's queries do."""
    from kvconductor.http import openapi

    dialect = Dialect(conductor)
    limit = door.max_body_bytes
    return dialect_app(
        VOICE,
        {
            "/register": RegisterRoute(dialect, limit, door.key),
            "/unregister": UnregisterRoute(dialect, limit, door.key),
            **query_routes(dialect, limit),
            "/workers": ListingRoute(dialect, limit, door.listing_key),
            "/health": HealthRoute(""),
            "/openapi.json": JsonDocument(openapi.dynamo_document),
        },
    )
