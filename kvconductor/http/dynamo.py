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
* ``POST /query`` ``{token_ids, model_name[, routing_group, lora_name]}`` and ``POST
  /query_by_hash`` ``{block_hashes: [i64], model_name}``: answered from the same index
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
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import falcon
import falcon.asgi
import msgspec

from kvconductor._hash import DEFAULT_SEED, lora_seed
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
    DynamoQueryRequest,
    DynamoQueryResponse,
    DynamoRegisterRequest,
    DynamoStatus,
    DynamoUnregisterRequest,
    DynamoWorker,
)
from kvconductor.state.conductor import Conductor, StateUnavailable
from kvconductor.state.protocols import QuerySource

log = logging.getLogger("kvconductor.dynamo")

VOICE = Voice(log, "dynamo dialect", lambda ex: DynamoError(ex.message), msgpack=False)
OK = DynamoStatus("ok")
#: The messages of a body Dynamo's HTTP framework (axum) refuses.
MEDIA_TYPE = "Expected request with `Content-Type: application/json`"
DESERIALIZE = "Failed to deserialize the JSON body into the target type: "
PARSE = "Failed to parse the request body as JSON: "


def decode(req: falcon.asgi.Request, body: bytes, shape: type[Any]) -> Any:
    """``body`` as ``shape``: 415 without a JSON content type, 400 for bad JSON, 422 for
    a body of another shape (Dynamo's statuses)."""
    ctype = (req.content_type or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise DialectError(415, "unsupported_media_type", MEDIA_TYPE)
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

    async def query(self, q: DynamoQueryRequest) -> DynamoQueryResponse:
        size = self.block_size(q.model_name, q.routing_group)
        index = self.source.get_index(q.model_name, q.routing_group)
        full = len(q.token_ids) - len(q.token_ids) % size  # complete blocks only
        hits: Sequence[tuple[str, int, int, int, int]] = ()
        if index is not None and full:
            seed = lora_seed(q.lora_name) if q.lora_name else DEFAULT_SEED
            hits = index.query(array("I", q.token_ids[:full]), size, seed).tuples()
        return dynamo_answer(hits, size)

    async def query_by_hash(self, q: DynamoHashQueryRequest) -> DynamoQueryResponse:
        size = self.block_size(q.model_name, q.routing_group)
        index = self.source.get_index(q.model_name, q.routing_group)
        hits: Sequence[tuple[str, int, int, int, int]] = ()
        if index is not None and q.block_hashes:
            hashes = array("Q", [h & U64_MAX for h in q.block_hashes])  # i64 -> u64
            hits = index.query_by_hash(hashes).tuples()
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
        return await self.dialect.query(decode(req, body, DynamoQueryRequest))


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
