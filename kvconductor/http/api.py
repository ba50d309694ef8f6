"""The HTTP API (docs/api.md) as a Falcon ASGI app over a :class:`Conductor`.

Routes: ``GET /health``, ``POST /register``, ``POST /unregister``,
``POST /query``, ``POST /query_by_hash``, ``POST /explain``, ``POST /events``, ``GET /workers``,
``GET /metrics`` (:mod:`kvconductor.http.metrics`).

Resources are thin: they read the body (bounded by ``max_body_bytes``: 413
when ``Content-Length`` says so before anything is read, or as soon as a
streamed body passes the limit), decode it with msgspec, and either answer a
query from the index directly (large bodies in a worker thread, so the event
loop never stalls) or hand the work to the ingest thread with
``await conductor.run(...)``.

Every error body is ``{"error": "..."}``; on the query routes it is encoded
like the request (MessagePack when the request was), elsewhere JSON. Unlike
the reference (axum), data errors are 400, not 422, and a non-JSON
``Content-Type`` is not a 415: the body is parsed as JSON regardless.

Two ways to serve it (one process, one worker: the process owns the index):

* ``kv-conductor`` / ``python -m kvconductor`` (:mod:`kvconductor.serve.single`);
* gunicorn with the kv-conductor worker (uvicorn's, plus the HTTP limits,
  TLS flags and quiet shutdown of ``kv-conductor``), flags in
  ``KV_CONDUCTOR_ARGS`` or as factory arguments::

      gunicorn -w 1 -k kvconductor.app.KvConductorWorker -b '[::]:13333' \\
          'kvconductor.app:gunicorn_app("--maintenance-interval-secs", "10")'

Network security (Origin rule, CORS, ``/workers`` token, limits, TLS):
``docs/security.md``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, cast

import falcon
import falcon.asgi
import msgspec

from kvconductor._hash import DEFAULT_SEED, lora_seed
from kvconductor.http import openapi
from kvconductor.http.auth import CHALLENGE, UNAUTHORIZED, bearer_ok
from kvconductor.http.fields import UnknownFieldWarnings, unknown_fields
from kvconductor.http.front import FrontDoor
from kvconductor.http.metrics import CONTENT_TYPE, DeferredMetrics, Metrics, QueryMetrics
from kvconductor.http.responses import (
    MSGPACK_PATHS,
    MUTATING_PATHS,
    WARNING_HEADER,
    cors_origin,
    freshness_param,
    header_text,
    set_error,
    too_large_message,
)
from kvconductor.index import QueryResult
from kvconductor.ingest.freshness import FreshnessUnavailable, document
from kvconductor.ingest.http_events import EventError, normalize_events
from kvconductor.schema import (
    DEFAULT_TENANT,
    FRESHNESS_FIELD,
    EventsResponse,
    NotReadyResponse,
    ReadyResponse,
    RegisterRequest,
    decode_error_message,
    events_decoder,
    json_encoder,
    msgpack_encoder,
    register_decoder,
    unregister_decoder,
)
from kvconductor.state.conductor import (
    Conductor,
    InstanceNotRegistered,
    RegistrationUnavailable,
    StateUnavailable,
)
from kvconductor.state.protocols import QuerySource
from kvconductor.state.registry import RegistrationError
from kvconductor.wire import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    WireError,
    encode_error,
    encode_fresh,
    encode_result,
    is_msgpack_content_type,
    parse_query,
    parse_query_ext,
)

log = logging.getLogger("kvconductor.http")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: Query bodies above this size are parsed, hashed and matched in a worker thread.
LARGE_BODY_BYTES = 256 * 1024
_OK = json_encoder.encode({"status": "ok"})
#: A ``"freshness"`` query whose tenant is named ``freshness`` (the answer's own
#: ``"freshness"`` member would be a second key of that name).
FRESHNESS_TENANT = (
    "tenant_id 'freshness' cannot be answered with freshness: the answer's "
    '"freshness" member would repeat the tenant\'s key'
)
#: A ``"freshness"`` query where the states of the sources are not known.
FRESHNESS_UNAVAILABLE = "freshness is not available"
_EVENTS_NONE = json_encoder.encode({"status": "ok", "events_applied": 0})


class BodyTooLarge(Exception):
    """The request body exceeds the configured limit."""


class BodyIncomplete(Exception):
    """The connection closed (or was closed by the request deadline) before the whole
    ``Content-Length`` arrived."""


async def read_body(req: falcon.asgi.Request, limit: int) -> bytes:
    """The whole request body; raises :class:`BodyTooLarge` past ``limit`` bytes and
    :class:`BodyIncomplete` when fewer than ``Content-Length`` bytes arrived."""
    length = req.content_length
    if length is not None:
        if length > limit:
            raise BodyTooLarge
        body = await req.stream.read()
        if len(body) < length:
            # Falcon hands over what arrived when the client disconnects: never act on it.
            raise BodyIncomplete
        return body
    chunks = []
    total = 0
    async for chunk in req.stream:
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _json(resp: falcon.asgi.Response, status: int, data: bytes) -> None:
    resp.status = status
    resp.content_type = JSON_CONTENT_TYPE
    resp.data = data


#: What a malformed JSON body raises in msgspec: a decode error, or (objects nested
#: thousands deep) a RecursionError, which is the client's fault as much as any other.
_BAD_JSON = (msgspec.DecodeError, RecursionError)


def _bad_json(ex: Exception) -> str:
    if isinstance(ex, RecursionError):
        return "invalid JSON request body: nesting too deep"
    return f"invalid JSON request body: {decode_error_message(ex)}"


#: Every error answer of the resources (:mod:`kvconductor.http.responses`).
_error = set_error


#: What a resource answers from: the :class:`Conductor`, or for the query resources any
#: :class:`~kvconductor.state.protocols.QuerySource` (a worker's shared view too).
_Source = TypeVar("_Source", bound=QuerySource)


class _Resource(Generic[_Source]):
    def __init__(
        self,
        conductor: _Source,
        *,
        max_body_bytes: int,
        api_key: str | None,
        large_body_bytes: int,
    ) -> None:
        self.conductor = conductor
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key or None
        self.large_body_bytes = large_body_bytes

    def _authorized(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> bool:
        if bearer_ok(req.get_header("Authorization"), self.api_key):
            return True
        log.warning("unauthorized request method=%s path=%s", req.method, req.path)
        resp.set_header("WWW-Authenticate", CHALLENGE)
        _error(resp, 401, UNAUTHORIZED)
        return False

    async def _body(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, msgpack: bool = False
    ) -> bytes | None:
        try:
            return await read_body(req, self.max_body_bytes)
        except BodyTooLarge:
            log.warning(
                "request body too large method=%s path=%s limit=%d content_length=%s",
                req.method,
                req.path,
                self.max_body_bytes,
                req.content_length,
            )
            _error(resp, 413, too_large_message(self.max_body_bytes), msgpack)
            # NOTE: the unread rest of the body is discarded by the server after the reply.
            return None
        except BodyIncomplete:
            log.debug(
                "request body incomplete (client gone) method=%s path=%s content_length=%s",
                req.method,
                req.path,
                req.content_length,
            )
            _error(resp, 400, "request body shorter than its Content-Length", msgpack)
            return None

    def _bad(
        self,
        req: falcon.asgi.Request,
        resp: falcon.asgi.Response,
        message: str,
        msgpack: bool = False,
        status: int = 400,
    ) -> None:
        log.warning(
            "bad request method=%s path=%s status=%d error=%s",
            req.method,
            req.path,
            status,
            message,
        )
        _error(resp, status, message, msgpack)

    async def _offload(self, body: bytes | bytearray, fn, *args: Any) -> Any:
        """``fn(*args)`` inline for small bodies, in a worker thread for large ones."""
        if len(body) <= self.large_body_bytes:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.conductor.executor, fn, *args)


class HealthResource:
    """``GET /health``: 200 ``OK`` (text/plain)."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "OK"

    async def on_head(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT


class ReadyResource(_Resource[Conductor]):
    """``GET /ready``: 200 when every registered ZeroMQ source is connected and none is
    replaying; 503 naming the sources that are not (readiness, not liveness: that is
    ``/health``). Open like ``/health``; it names instances, never endpoint URLs."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        r = self.conductor.replicator
        if r is not None and not r.bootstrapped:
            resp.set_header("Retry-After", "1")
            doc = NotReadyResponse("not ready: the state store's state is not loaded yet", [])
            return _json(resp, 503, json_encoder.encode(doc))
        total, waiting = await self.conductor.run(self.conductor.readiness)
        if not waiting:
            _json(resp, 200, json_encoder.encode(ReadyResponse("ready", total)))
            return
        doc = NotReadyResponse(
            f"not ready: {len(waiting)} of {total} ZeroMQ sources are connecting or replaying",
            waiting,
        )
        resp.set_header("Retry-After", "1")
        _json(resp, 503, json_encoder.encode(doc))

    async def on_head(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        _, waiting = await self.conductor.run(self.conductor.readiness)
        r = self.conductor.replicator
        resp.status = 503 if waiting or (r is not None and not r.bootstrapped) else 200
        resp.content_type = falcon.MEDIA_JSON


class OpenApiResource:
    """``GET /openapi.json``: the API's OpenAPI 3.1 document (:mod:`kvconductor.http.openapi`)."""

    def __init__(self) -> None:
        self._body = msgspec.json.encode(openapi.document())

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = self._body


class RegisterResource(_Resource[Conductor]):
    """``POST /register``: 201 ``{"status":"ok"}``; fields it does not know are named in
    a WARN once per (instance, field) (:mod:`kvconductor.http.fields`)."""

    def __init__(self, conductor: Conductor, **kw: Any) -> None:
        super().__init__(conductor, **kw)
        self.unknown = UnknownFieldWarnings(log, "registration")

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self._authorized(req, resp):
            return
        body = await self._body(req, resp)
        if body is None:
            return
        try:
            request = register_decoder.decode(body)
        except _BAD_JSON as ex:
            return self._bad(req, resp, _bad_json(ex))
        try:
            await self.conductor.mutate("register", body, request)
        except RegistrationError as ex:
            return self._bad(req, resp, str(ex))
        except (RegistrationUnavailable, StateUnavailable) as ex:
            return self._bad(req, resp, str(ex), status=503)
        self.unknown.warn(request.instance_id, unknown_fields(body, False, RegisterRequest))
        _json(resp, 201, _OK)


class UnregisterResource(_Resource[Conductor]):
    """``POST /unregister``: 200, or 404 for an unknown instance."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self._authorized(req, resp):
            return
        body = await self._body(req, resp)
        if body is None:
            return
        try:
            request = unregister_decoder.decode(body)
        except _BAD_JSON as ex:
            return self._bad(req, resp, _bad_json(ex))
        try:
            found = await self.conductor.mutate("unregister", body, request)
        except StateUnavailable as ex:
            return self._bad(req, resp, str(ex), status=503)
        if found:
            _json(resp, 200, _OK)
        else:
            _error(resp, 404, f"instance {request.instance_id} not found")


class QueryResource(_Resource[QuerySource]):
    """``POST /query`` (``by_hash=False``) and ``POST /query_by_hash``, answered from a
    :class:`~kvconductor.state.protocols.QuerySource` (the conductor, or a worker's
    shared view)."""

    def __init__(
        self,
        conductor: QuerySource,
        *,
        by_hash: bool,
        metrics: QueryMetrics | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(conductor, **kw)
        self.by_hash = by_hash
        self.metrics = metrics or QueryMetrics()
        #: ``kvconductor_query_seconds{route}`` of this route.
        self.seconds = self.metrics.route_seconds["/query_by_hash" if by_hash else "/query"]
        #: ``kvconductor_query_errors_total{route}``: answers >= 400 but 404 (a miss).
        self.errors = self.metrics.route_errors["/query_by_hash" if by_hash else "/query"]
        #: Warnings of queries that cannot match (``/query``: block size not registered).
        self.misses = MissWarnings()

    def answer(
        self,
        body: bytes,
        msgpack: bool,
        metrics: QueryMetrics | DeferredMetrics | None = None,
        fresh: bool = False,
    ) -> tuple[int, bytes, str | None]:
        """Parse, match and encode: ``(status, body, message or None)``. With a 4xx the
        message is what to log; with a 200 it is a warning for the
        ``X-KV-Conductor-Warning`` header (a query that cannot match, logged here).
        ``metrics``: where the answer's blocks and misses are counted (default: the
        route's; off the event loop a :class:`~kvconductor.http.metrics.DeferredMetrics`).
        ``fresh``: the answer says how fresh it is (``?freshness=true``; the body's
        ``"freshness": true`` too)."""
        try:
            model, block_size, tenant, values, lora_name, top_k, instances, in_body = (
                parse_query_ext(body, msgpack, self.by_hash)
            )
        except WireError as ex:
            return self._invalid(str(ex), msgpack)
        fresh = fresh or in_body
        if fresh and tenant == FRESHNESS_FIELD:
            return self._invalid(FRESHNESS_TENANT, msgpack)
        m = self.metrics if metrics is None else metrics
        index = self.conductor.get_index(model, tenant)
        if index is None:
            m.unknown_index.inc()
            msg = f"no indexer for model={model} tenant={tenant}"
            return 404, encode_error(msg, msgpack), msg
        # PERF: the answer stays in the core's C arrays (QueryResult over MatchRows): the
        # metrics take its C sums and the encoder renders it without a Python object per
        # (instance, DP) row.
        if self.by_hash:
            # NOTE: the request's block_size is ignored; counts are in blocks (docs/api.md,
            # POST /query_by_hash).
            result = index.query_by_hash(values, top_k=top_k, instances=instances)
            if len(result):
                m.count_blocks(*result.sums())
            else:
                m.no_match.inc()
            return self._ok(result, model, tenant, 1, msgpack, fresh)
        # LoRA blocks are hashed with the adapter's seed, so base-model queries never see
        # them and the other way round.
        seed = lora_seed(lora_name) if lora_name else DEFAULT_SEED
        result = index.query(values, block_size, seed, top_k=top_k, instances=instances)
        warning = None
        if len(result):
            m.count_blocks(*result.sums())
        else:
            sizes = self.conductor.block_sizes.get((model, tenant))
            if sizes and block_size not in sizes:
                m.block_size_mismatch.inc()
                warning = self.misses.block_size_mismatch(model, tenant, block_size, sizes)
            elif lora_name and seed not in self.conductor.lora_seeds.get((model, tenant), ()):
                m.unknown_lora.inc()
                warning = self.misses.unknown_lora(model, tenant, lora_name)
            else:
                m.no_match.inc()
        return self._ok(result, model, tenant, block_size, msgpack, fresh, warning)

    def _ok(
        self,
        result: QueryResult,
        model: str,
        tenant: str,
        block_size: int,
        msgpack: bool,
        fresh: bool,
        warning: str | None = None,
    ) -> tuple[int, bytes, str | None]:
        if not fresh:
            return 200, encode_result(result, tenant, block_size, msgpack), warning
        try:
            table = self.conductor.freshness(model, tenant)
        except FreshnessUnavailable as ex:
            msg = f"{FRESHNESS_UNAVAILABLE}: {ex}"
            return 503, encode_error(msg, msgpack), msg
        if table is None:
            return 501, encode_error(FRESHNESS_UNAVAILABLE, msgpack), FRESHNESS_UNAVAILABLE
        fr = (table.groups(result.names.keys), time.time(), table.tail[msgpack])
        return 200, encode_fresh(result, tenant, block_size, msgpack, fr), warning

    @staticmethod
    def _invalid(detail: str, msgpack: bool) -> tuple[int, bytes, str]:
        return (
            400,
            encode_error(
                f"invalid {'msgpack' if msgpack else 'JSON'} request body: {detail}", msgpack
            ),
            detail,
        )

    async def respond(
        self, body: bytes | bytearray | list[bytes], msgpack: bool, fresh: bool = False
    ) -> tuple[int, bytes, str | None]:
        """:meth:`answer`, in a worker thread for a large body (the front door's call).
        ``body`` may be the chunks of a large body: they are joined in that thread.
        PERF: a bytearray is parsed as it is (the parsers take any buffer), not copied;
        ``bytes.join`` lets go of the GIL for a large join, so joining 4 MB there does
        not stop the event loop for the ~0.5 ms of the copy."""
        if isinstance(body, list):
            fn: Any = self._answer_chunks
        else:
            fn = self.answer
            if len(body) <= self.large_body_bytes:
                return self.answer(cast(bytes, body), msgpack, None, fresh)
        loop = asyncio.get_running_loop()
        deferred = DeferredMetrics()  # QueryMetrics has one writer: this loop
        out = await loop.run_in_executor(
            self.conductor.executor, fn, body, msgpack, deferred, fresh
        )
        deferred.replay(self.metrics)
        return cast(tuple[int, bytes, "str | None"], out)

    def _answer_chunks(
        self, chunks: list[bytes], msgpack: bool, metrics: DeferredMetrics, fresh: bool = False
    ) -> tuple[int, bytes, str | None]:
        return self.answer(b"".join(chunks), msgpack, metrics, fresh)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        t0 = time.perf_counter()
        msgpack = is_msgpack_content_type(req.content_type)
        body = await self._body(req, resp, msgpack)
        if body is None:
            self.seconds.observe(time.perf_counter() - t0)
            self.errors.inc()
            return
        problem: str | None
        try:
            fresh = freshness_param(req.query_string.encode("latin-1"))
        except ValueError as ex:
            status, data, problem = 400, encode_error(str(ex), msgpack), str(ex)
        else:
            status, data, problem = await self.respond(body, msgpack, fresh)
        # Server-side time (body read, parse, hash, match, encode) for clients and benches.
        dt = time.perf_counter() - t0
        self.seconds.observe(dt)
        if status >= 400 and status != 404:
            self.errors.inc()
        resp.set_header("Server-Timing", f"app;dur={dt * 1e3:.3f}")
        if status == 200 and problem is not None:
            resp.set_header(WARNING_HEADER, header_text(problem))
        elif problem is not None:
            if status == 404:
                log.info("query for unknown indexer path=%s error=%s", req.path, problem)
            else:
                log.warning(
                    "bad request method=POST path=%s status=%d error=%s", req.path, status, problem
                )
        resp.status = status
        resp.content_type = MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE
        resp.data = data


class MissWarnings:
    """Silent misses made loud: the sentence of a query that cannot match, logged at WARN
    at most once per (model, tenant, block size or LoRA name) per ``interval`` seconds.
    Thread-safe (large queries are answered on worker threads)."""

    def __init__(self, interval: float = 60.0, clock=time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def block_size_mismatch(
        self, model: str, tenant: str, block_size: int, registered: frozenset[int]
    ) -> str:
        sizes = ", ".join(str(s) for s in sorted(registered))
        sentence = (
            f"block_size {block_size} matches no registration of model={model} "
            f"tenant={tenant} (registered block sizes: {sizes}); blocks are hashed per "
            "block size, so this query cannot find any"
        )
        return self._warn((model, tenant, block_size), sentence)

    def unknown_lora(self, model: str, tenant: str, lora_name: str) -> str:
        sentence = (
            f"lora_name {lora_name!r} was carried by no event of model={model} "
            f"tenant={tenant}; blocks of a LoRA adapter are hashed with its name, so this "
            "query cannot find any (does the engine publish lora_name? vLLM 0.14+, "
            "SGLang 0.5.22+)"
        )
        return self._warn((model, tenant, "lora:" + lora_name), sentence)

    def _warn(self, key: tuple, sentence: str) -> str:
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            due = last is None or now - last >= self.interval
            if due:
                if len(self._last) > 10_000:  # bounded: forget everything, warn again
                    self._last.clear()
                self._last[key] = now
        if due:
            log.warning("query cannot match: %s", sentence)
        return sentence


class ExplainResource(_Resource[Conductor]):
    """``POST /explain``: the body of ``/query`` (JSON or MessagePack, same 4xx answers),
    answered in the request's encoding with why each (instance, DP) did or did not match
    (docs/api.md, POST /explain).

    It names instances, endpoint URLs and source states, like ``/workers``: with an API
    key it needs the bearer token too, unless ``open_workers``.
    """

    def __init__(self, conductor: Conductor, *, open_workers: bool = False, **kw: Any) -> None:
        super().__init__(conductor, **kw)
        self.open_workers = open_workers
        #: The block size mismatch sentence of ``/query`` (logged at most once a minute).
        self.misses = MissWarnings()

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        msgpack = is_msgpack_content_type(req.content_type)
        if not self.open_workers and not self._authorized(req, resp):
            return
        body = await self._body(req, resp, msgpack)
        if body is None:
            return
        try:
            model, block_size, tenant, tokens, lora_name = await self._offload(
                body, parse_query, body, msgpack, False
            )
        except WireError as ex:
            kind = "msgpack" if msgpack else "JSON"
            return self._bad(req, resp, f"invalid {kind} request body: {ex}", msgpack)
        doc = await self.conductor.run(
            self.conductor.explain, model, tenant, block_size, tokens, lora_name
        )
        sizes = self.conductor.block_sizes.get((model, tenant))
        if sizes and block_size not in sizes:
            doc.warnings.insert(
                0, self.misses.block_size_mismatch(model, tenant, block_size, sizes)
            )
        resp.status = 200
        resp.content_type = MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE
        resp.data = (msgpack_encoder if msgpack else json_encoder).encode(doc)


class EventsResource(_Resource[Conductor]):
    """``POST /events``: HTTP event ingestion (JSON)."""

    @staticmethod
    def parse(body: bytes):
        batch = events_decoder.decode(body)
        return batch, normalize_events(batch)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self._authorized(req, resp):
            return
        body = await self._body(req, resp)
        if body is None:
            return
        try:
            batch, ops = await self._offload(body, self.parse, body)
        except _BAD_JSON as ex:
            return self._bad(req, resp, _bad_json(ex))
        except EventError as ex:
            return self._bad(req, resp, str(ex))
        if not ops:
            if batch.shutdown:
                log.info("shutdown flag set in events batch instance_id=%s", batch.instance_id)
            return _json(resp, 200, _EVENTS_NONE)
        try:
            applied, errors = await self.conductor.mutate("events", body, batch, ops)
        except StateUnavailable as ex:
            return self._bad(req, resp, str(ex), status=503)
        except InstanceNotRegistered as ex:
            # Register first: events of an unknown instance would build an index that no
            # unregistration could remove.
            return self._bad(req, resp, str(ex), status=404)
        if errors:
            out = EventsResponse(status="partial", events_applied=applied, errors=errors)
            return _json(resp, 500, json_encoder.encode(out))
        _json(resp, 200, json_encoder.encode(EventsResponse(status="ok", events_applied=applied)))


class WorkersResource(_Resource[Conductor]):
    """``GET /workers``: registrations, index summaries and subscription sources.

    It lists every engine and pool endpoint, so with an API key it needs the
    bearer token too, unless ``open_workers`` (``--open-workers``).
    """

    def __init__(self, conductor: Conductor, *, open_workers: bool = False, **kw: Any) -> None:
        super().__init__(conductor, **kw)
        self.open_workers = open_workers

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self.open_workers and not self._authorized(req, resp):
            return
        doc = await self.conductor.run(self.conductor.workers)
        _json(resp, 200, json_encoder.encode(doc))


class FreshnessResource(_Resource[QuerySource]):
    """``GET /freshness?model=M[&tenant=T]``: the states behind the (model, tenant)'s
    answers (docs/api.md, "freshness"): per (instance, DP) with sources of its own its
    state, the wall time of its newest event and of its degradation, and the sources per
    state. Open like the query routes, whose ``"freshness"`` answers tell the same; a
    worker of ``--workers N`` reads its owner's here."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        model = req.get_param("model")
        if not model:
            return self._bad(req, resp, "missing query parameter `model`")
        tenant = req.get_param("tenant") or DEFAULT_TENANT
        try:
            table = self.conductor.freshness(model, tenant)
        except FreshnessUnavailable as ex:
            return self._bad(req, resp, f"{FRESHNESS_UNAVAILABLE}: {ex}", status=503)
        if table is None:
            return self._bad(req, resp, FRESHNESS_UNAVAILABLE, status=501)
        _json(resp, 200, json_encoder.encode(document(table, model, tenant, time.time())))


class DumpResource(_Resource[Conductor]):
    """``GET /debug/dump``: the index and registry as a streamed msgpack dump
    (:mod:`kvconductor.state.dump`, docs/dump.md). With an API key it needs the bearer
    token, like ``/workers``, and ``--open-workers`` does not open it: it holds every
    block hash of every engine.

    Consistency: the snapshot (registry plus every index's export) is taken in ONE
    call on the ingest thread, so it is one instant of the whole service: no event
    applies between two indexes or between the registry and the indexes. The
    export copies the structures into flat arrays (about 40 bytes per block; the
    ingest thread waits for that copy, not for the encoding); the response is then
    encoded and sent record by record (at most 65536 blocks each), never as one
    bytes object.
    """

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self._authorized(req, resp):
            return
        from kvconductor.state import dump

        snap = await self.conductor.run(dump.snapshot, self.conductor)

        async def stream():
            for chunk in dump.encode(snap):
                yield chunk

        resp.status = falcon.HTTP_200
        resp.content_type = MSGPACK_CONTENT_TYPE
        resp.set_header("Content-Disposition", 'attachment; filename="kvconductor.dump"')
        resp.stream = stream()


class MetricsResource(_Resource[Conductor]):
    """``GET /metrics``: Prometheus text exposition (:mod:`kvconductor.http.metrics`).

    Protected like ``/workers`` (its labels name every instance and model): with an
    API key it needs the bearer token, unless ``open_metrics``.
    """

    def __init__(
        self, conductor: Conductor, *, metrics: Metrics, open_metrics: bool = False, **kw: Any
    ) -> None:
        super().__init__(conductor, **kw)
        self.metrics = metrics
        self.open_metrics = open_metrics

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self.open_metrics and not self._authorized(req, resp):
            return
        # In a worker thread: an index's read lock may wait behind a large write.
        data = await asyncio.to_thread(self.metrics.exposition)
        resp.status = 200
        resp.content_type = CONTENT_TYPE
        resp.data = data


class OriginPolicy:
    """Origin checks and CORS headers (replaces Falcon's allow-everything CORS).

    Browsers send ``Origin`` on every cross-site POST, including the "simple"
    ``text/plain`` ones that need no preflight; curl, the Coordinator and other
    programs send none. So:

    * ``/register``, ``/unregister``, ``/events``: a request whose ``Origin``
      is present and not in ``allow_origins`` (``--allow-origin``) gets 403
      ``{"error": ...}`` and a WARN line, before authentication or the body;
      preflights (OPTIONS) included. Allowed origins get
      ``Access-Control-Allow-Origin: <origin>`` and ``Vary: Origin``; no
      wildcard, ever;
    * ``/health``, ``/query``, ``/query_by_hash`` (reads) keep
      ``Access-Control-Allow-Origin: *`` for any origin, preflights included
      (the front door, :class:`~kvconductor.http.front.FrontDoor`, adds it on its POSTs);
    * ``/workers`` (it lists every endpoint) and anything else: CORS headers
      only for allowed origins, so other sites' pages cannot read them.
    """

    def __init__(self, allow_origins: Iterable[str] = ()) -> None:
        self.allow_origins = frozenset(allow_origins)

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        origin = req.get_header("Origin")
        if origin is None or req.path not in MUTATING_PATHS or origin in self.allow_origins:
            return
        log.warning(
            "cross-origin request refused method=%s path=%s origin=%s", req.method, req.path, origin
        )
        _error(
            resp,
            403,
            f"origin {origin} is not allowed to call {req.path} "
            "(requests from web pages need --allow-origin)",
        )
        resp.complete = True

    async def process_response(
        self,
        req: falcon.asgi.Request,
        resp: falcon.asgi.Response,
        resource: object,
        req_succeeded: bool,
    ) -> None:
        origin = req.get_header("Origin")
        if origin is None:
            return
        allow, vary = cors_origin(req.path, origin, self.allow_origins)
        if allow is None:
            return
        if vary:
            resp.append_header("Vary", "Origin")
        resp.set_header("Access-Control-Allow-Origin", allow)
        if req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method"):
            # Preflight: the methods of the route (Falcon's OPTIONS responder sets Allow).
            methods = resp.get_header("Allow")
            if methods is None:
                resp.delete_header("Access-Control-Allow-Origin")
                return
            resp.delete_header("Allow")
            resp.set_header("Access-Control-Allow-Methods", methods)
            resp.set_header(
                "Access-Control-Allow-Headers",
                req.get_header("Access-Control-Request-Headers", default="*"),
            )
            resp.set_header("Access-Control-Max-Age", "86400")


class _Lifecycle:
    """ASGI lifespan: ``start`` on startup (False: the start failed, the worker does not
    serve), ``stop`` on shutdown. The process that builds the app decides what they do
    (gunicorn: the service's warm start, snapshots and replication, as ``kv-conductor``
    does); by default the conductor's own ``start``/``stop``."""

    def __init__(self, start: Callable[[], object], stop: Callable[[], object]) -> None:
        self.start = start
        self.stop = stop

    async def process_startup(self, scope: dict, event: dict) -> None:
        if await asyncio.to_thread(self.start) is False:
            raise RuntimeError("kv-conductor: warm start failed (see the log)")
        log.info("KV conductor started (lifespan)")

    async def process_shutdown(self, scope: dict, event: dict) -> None:
        await asyncio.to_thread(self.stop)
        log.info("KV conductor shut down")


async def _handle_http_error(
    req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: falcon.HTTPError, params: dict
) -> None:
    if isinstance(ex, falcon.HTTPRouteNotFound):
        message = f"no route for {req.method} {req.path}"
    elif isinstance(ex, falcon.HTTPMethodNotAllowed):
        message = f"method {req.method} not allowed on {req.path}"
    else:
        message = ex.description or ex.title or str(ex.status)
    log.warning(
        "request rejected method=%s path=%s status=%s error=%s",
        req.method,
        req.path,
        ex.status,
        message,
    )
    resp.status = ex.status
    if ex.headers:
        resp.set_headers(ex.headers)
    msgpack = req.path in MSGPACK_PATHS and is_msgpack_content_type(req.content_type)
    resp.content_type = MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE
    resp.data = encode_error(message, msgpack)


async def _handle_exception(
    req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: Exception, params: dict
) -> None:
    log.exception("internal error method=%s path=%s", req.method, req.path)
    msgpack = req.path in MSGPACK_PATHS and is_msgpack_content_type(req.content_type)
    _error(resp, 500, f"internal error: {ex}", msgpack)


#: The front door's name before both process models shared it.
QueryFastPath = FrontDoor


def create_app(
    conductor: Conductor,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
    large_body_bytes: int = LARGE_BODY_BYTES,
    manage_lifecycle: bool = False,
    fast_query: bool = False,
    allow_origins: Iterable[str] = (),
    open_workers: bool = False,
    open_metrics: bool | None = None,
    metrics: Metrics | None = None,
    lifecycle: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> Any:
    """Build the ASGI app over ``conductor``.

    With ``manage_lifecycle`` the app starts/stops the conductor on ASGI
    lifespan events (gunicorn), with ``lifecycle``'s ``(start, stop)`` when given
    (the service's warm start and snapshots too); otherwise the caller does (server,
    tests).
    ``api_key`` protects ``/register``, ``/unregister``, ``/events``, ``/workers`` and
    ``/explain`` (unless ``open_workers``) with ``Authorization: Bearer <key>``;
    ``/health`` and the queries stay open; ``/metrics`` is protected like ``/workers``
    unless ``open_metrics`` (default: ``open_workers``). With ``fast_query`` the
    Falcon app is fronted by :class:`~kvconductor.http.front.FrontDoor` (what the server
    runs).
    ``allow_origins``: web origins allowed on the mutating routes
    (:class:`OriginPolicy`). ``metrics``: the registry ``/metrics`` serves (default: a
    new :class:`~kvconductor.http.metrics.Metrics` of ``conductor``; ``kv-conductor
    --workers N`` passes one that adds the workers' query metrics).
    """
    middleware: list[Any] = [OriginPolicy(allow_origins)]
    if manage_lifecycle:
        start, stop = lifecycle or (conductor.start, conductor.stop)
        middleware.append(_Lifecycle(start, stop))
    app = falcon.asgi.App(middleware=middleware, cors_enable=False)
    kw: dict[str, Any] = {
        "max_body_bytes": max_body_bytes,
        "api_key": api_key,
        "large_body_bytes": large_body_bytes,
    }
    app.add_route("/health", HealthResource())
    app.add_route("/register", RegisterResource(conductor, **kw))
    app.add_route("/unregister", UnregisterResource(conductor, **kw))
    if metrics is None:
        metrics = Metrics(conductor)
    query = QueryResource(conductor, by_hash=False, metrics=metrics.query, **kw)
    query_by_hash = QueryResource(conductor, by_hash=True, metrics=metrics.query, **kw)
    app.add_route("/query", query)
    app.add_route("/query_by_hash", query_by_hash)
    app.add_route("/events", EventsResource(conductor, **kw))
    app.add_route("/workers", WorkersResource(conductor, open_workers=open_workers, **kw))
    app.add_route("/explain", ExplainResource(conductor, open_workers=open_workers, **kw))
    app.add_route("/ready", ReadyResource(conductor, **kw))
    app.add_route("/debug/dump", DumpResource(conductor, **kw))
    app.add_route("/freshness", FreshnessResource(conductor, **kw))
    app.add_route("/openapi.json", OpenApiResource())
    if open_metrics is None:
        open_metrics = open_workers
    app.add_route(
        "/metrics", MetricsResource(conductor, metrics=metrics, open_metrics=open_metrics, **kw)
    )
    app.add_error_handler(Exception, _handle_exception)
    app.add_error_handler(falcon.HTTPError, _handle_http_error)
    if fast_query:
        return FrontDoor(app, {"/query": query, "/query_by_hash": query_by_hash}, max_body_bytes)
    return app


def query_routes(
    view: Any,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    large_body_bytes: int = LARGE_BODY_BYTES,
    metrics: QueryMetrics | None = None,
) -> dict[str, QueryResource]:
    """``POST /query`` and ``POST /query_by_hash`` over ``view`` (a conductor, or a
    :class:`kvconductor.state.shared.SharedView`: the owner's index in shared memory) for
    a :class:`~kvconductor.http.front.FrontDoor`: the same :class:`QueryResource` code as
    :func:`create_app`'s, so statuses, bodies, headers and warnings are identical.
    ``metrics`` counts the queries answered."""
    kw: dict[str, Any] = {
        "max_body_bytes": max_body_bytes,
        "api_key": None,  # the query routes are open (docs/security.md)
        "large_body_bytes": large_body_bytes,
    }
    qm = metrics if metrics is not None else QueryMetrics()
    return {
        "/query": QueryResource(view, by_hash=False, metrics=qm, **kw),
        "/query_by_hash": QueryResource(view, by_hash=True, metrics=qm, **kw),
    }


def create_query_app(
    view: QuerySource,
    forward: Any,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    large_body_bytes: int = LARGE_BODY_BYTES,
    metrics: QueryMetrics | None = None,
) -> FrontDoor:
    """A front door that answers the query routes from ``view`` (:func:`query_routes`)
    and hands every other request to the ASGI app ``forward``."""
    routes = query_routes(
        view, max_body_bytes=max_body_bytes, large_body_bytes=large_body_bytes, metrics=metrics
    )
    return FrontDoor(forward, routes, max_body_bytes)
