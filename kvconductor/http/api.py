"""The HTTP API (docs/api.md) as a Falcon ASGI app over a :class:`Conductor`.

Routes: ``GET /health``, ``POST /register``, ``POST /unregister``,
``POST /query``, ``POST /query_by_hash``, ``POST /explain``, ``POST /events``,
``POST /predict``, ``POST /predict_by_hash`` (:mod:`kvconductor.http.predict`), ``GET /workers``,
``GET /metrics`` (:mod:`kvconductor.http.metrics`).

Resources are thin: they read the body (bounded by ``max_body_bytes``: 413
when ``Content-Length`` says so before anything is read, or as soon as a
streamed body passes the limit; what every resource shares is
:mod:`kvconductor.http.resource`), decode it with msgspec, and either answer a
query from the index directly (:mod:`kvconductor.http.query`; large bodies in a
worker thread, so the event loop never stalls) or hand the work to the ingest
thread with ``await conductor.run(...)``. This module holds the other routes'
resources, the Origin policy, the error handlers and the app's construction.

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
import time
from collections.abc import Callable, Iterable
from typing import Any

import falcon
import falcon.asgi

from kvconductor.extrakeys import ExtraKeysError, parse_extras
from kvconductor.http import openapi
from kvconductor.http.fields import UnknownFieldWarnings, unknown_fields
from kvconductor.http.front import FrontDoor
from kvconductor.http.metrics import CONTENT_TYPE, Metrics, QueryMetrics
from kvconductor.http.predict import PredictResource
from kvconductor.http.query import FRESHNESS_UNAVAILABLE, MissWarnings, QueryResource
from kvconductor.http.resource import (
    BAD_JSON,
    DEFAULT_MAX_BODY_BYTES,
    LARGE_BODY_BYTES,
    JsonDocument,
    Resource,
    bad_json_message,
    json_answer,
)
from kvconductor.http.responses import (
    EXPOSE_HEADERS_B,
    MSGPACK_PATHS,
    MUTATING_PATHS,
    QUERY_PATHS,
    cors_origin,
    set_error,
)
from kvconductor.ingest.freshness import FreshnessUnavailable, document
from kvconductor.ingest.http_events import EventError, normalize_events
from kvconductor.schema import (
    DEFAULT_TENANT,
    EventsResponse,
    NotReadyResponse,
    ReadyResponse,
    RegisterRequest,
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
from kvconductor.state.engineroute import EngineRouteError, engine_registrations
from kvconductor.state.protocols import QuerySource
from kvconductor.state.registry import RegistrationError
from kvconductor.wire import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    WireError,
    encode_error,
    is_msgpack_content_type,
    parse_query,
)

log = logging.getLogger("kvconductor.http")

_OK = json_encoder.encode({"status": "ok"})
_EVENTS_NONE = json_encoder.encode({"status": "ok", "events_applied": 0})


class HealthResource:
    """``GET /health``: 200 ``OK`` (text/plain)."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "OK"

    async def on_head(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT


class ReadyResource(Resource[Conductor]):
    """``GET /ready``: 200 when every registered ZeroMQ source is connected and none is
    replaying; 503 naming the sources that are not (readiness, not liveness: that is
    ``/health``). Open like ``/health``; it names instances, never endpoint URLs."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        r = self.conductor.replicator
        if r is not None and not r.bootstrapped:
            resp.set_header("Retry-After", "1")
            doc = NotReadyResponse("not ready: the state store's state is not loaded yet", [])
            return json_answer(resp, 503, json_encoder.encode(doc))
        total, waiting = await self.conductor.run(self.conductor.readiness)
        if not waiting:
            json_answer(resp, 200, json_encoder.encode(ReadyResponse("ready", total)))
            return
        doc = NotReadyResponse(
            f"not ready: {len(waiting)} of {total} ZeroMQ sources are connecting or replaying",
            waiting,
        )
        resp.set_header("Retry-After", "1")
        json_answer(resp, 503, json_encoder.encode(doc))

    async def on_head(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        _, waiting = await self.conductor.run(self.conductor.readiness)
        r = self.conductor.replicator
        resp.status = 503 if waiting or (r is not None and not r.bootstrapped) else 200
        resp.content_type = falcon.MEDIA_JSON


class _Registration(Resource[Conductor]):
    """``POST`` of a registration change: the token, the body and its decoding by
    :attr:`decoder` (:meth:`~kvconductor.http.resource.Resource._decoded`) and the
    change's refusals (400 for a registration the registry refuses, 503 while the state
    cannot be changed), once; :meth:`change` makes the change and answers."""

    decoder: Any

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        decoded = await self._decoded(req, resp, self.decoder.decode)
        if decoded is None:
            return
        try:
            await self.change(resp, *decoded)
        except RegistrationError as ex:
            return self._bad(req, resp, str(ex))
        except (RegistrationUnavailable, StateUnavailable) as ex:
            return self._bad(req, resp, str(ex), status=503)
        except EngineRouteError as ex:
            return self._bad(req, resp, str(ex), status=ex.status)

    async def change(self, resp: falcon.asgi.Response, body: bytes, request: Any) -> None:
        raise NotImplementedError


class RegisterResource(_Registration):
    """``POST /register``: 201 ``{"status":"ok"}``; fields it does not know are named in
    a WARN once per (instance, field) (:mod:`kvconductor.http.fields`)."""

    decoder = register_decoder

    def __init__(self, conductor: Conductor, **kw: Any) -> None:
        super().__init__(conductor, **kw)
        self.unknown = UnknownFieldWarnings(log, "registration")

    async def change(self, resp: falcon.asgi.Response, body: bytes, request: Any) -> None:
        changes = [(body, request)]
        if request.engine_url:  # every DP rank the engine lists, read off the event loop
            policy = self.conductor.registry.url_policy
            changes = await asyncio.to_thread(engine_registrations, request, policy)
        for b, r in changes:
            await self.conductor.mutate("register", b, r)
        self.unknown.warn(request.instance_id, unknown_fields(body, False, RegisterRequest))
        json_answer(resp, 201, _OK)


class UnregisterResource(_Registration):
    """``POST /unregister``: 200, or 404 for an unknown instance."""

    decoder = unregister_decoder

    async def change(self, resp: falcon.asgi.Response, body: bytes, request: Any) -> None:
        if await self.conductor.mutate("unregister", body, request):
            json_answer(resp, 200, _OK)
        else:
            set_error(resp, 404, f"instance {request.instance_id} not found")


class ExplainResource(Resource[Conductor]):
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
            extras = await self._offload(body, parse_extras, body, msgpack)
        except (WireError, ExtraKeysError) as ex:
            kind = "msgpack" if msgpack else "JSON"
            return self._bad(req, resp, f"invalid {kind} request body: {ex}", msgpack)
        doc = await self.conductor.run(
            self.conductor.explain, model, tenant, block_size, tokens, lora_name, extras
        )
        sizes = self.conductor.block_sizes.get((model, tenant))
        if sizes and block_size not in sizes:
            doc.warnings.insert(
                0, self.misses.block_size_mismatch(model, tenant, block_size, sizes)
            )
        resp.status = 200
        resp.content_type = MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE
        resp.data = (msgpack_encoder if msgpack else json_encoder).encode(doc)


class EventsResource(Resource[Conductor]):
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
        except BAD_JSON as ex:
            return self._bad(req, resp, bad_json_message(ex))
        except EventError as ex:
            return self._bad(req, resp, str(ex))
        if not ops:
            if batch.shutdown:
                log.info("shutdown flag set in events batch instance_id=%s", batch.instance_id)
            return json_answer(resp, 200, _EVENTS_NONE)
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
            return json_answer(resp, 500, json_encoder.encode(out))
        json_answer(
            resp, 200, json_encoder.encode(EventsResponse(status="ok", events_applied=applied))
        )


class WorkersResource(Resource[Conductor]):
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
        json_answer(resp, 200, json_encoder.encode(doc))


class FreshnessResource(Resource[QuerySource]):
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
        json_answer(resp, 200, json_encoder.encode(document(table, model, tenant, time.time())))


class DumpResource(Resource[Conductor]):
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


class MetricsResource(Resource[Conductor]):
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
        set_error(
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
        if req.path in QUERY_PATHS and req.method == "POST":
            resp.set_header(*(v.decode("ascii") for v in EXPOSE_HEADERS_B))
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
    set_error(resp, 500, f"internal error: {ex}", msgpack)


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
    ``api_key`` protects ``/register``, ``/unregister``, ``/events``, ``/predict``,
    ``/predict_by_hash``, ``/workers`` and
    ``/explain`` (unless ``open_workers``) with ``Authorization: Bearer <key>``;
    ``/health`` and the queries stay open; ``/metrics`` is protected like ``/workers``
    unless ``open_metrics`` (default: ``open_workers``). With ``fast_query`` the
    Falcon app is fronted by :class:`~kvconductor.http.front.FrontDoor` (what the server
    runs); without it the query routes' ``POST`` is Falcon's, through the same query
    door (:mod:`kvconductor.http.querydoor`), so the answers are the same.
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
    app.add_route("/predict", PredictResource(conductor, by_hash=False, **kw))
    app.add_route("/predict_by_hash", PredictResource(conductor, by_hash=True, **kw))
    app.add_route("/workers", WorkersResource(conductor, open_workers=open_workers, **kw))
    app.add_route("/explain", ExplainResource(conductor, open_workers=open_workers, **kw))
    app.add_route("/ready", ReadyResource(conductor, **kw))
    app.add_route("/debug/dump", DumpResource(conductor, **kw))
    app.add_route("/freshness", FreshnessResource(conductor, **kw))
    app.add_route("/openapi.json", JsonDocument(openapi.document))
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
