"""What the other indexers' dialects share, each on its own port: the Mooncake
conductor's (:mod:`kvconductor.http.mooncake`, ``--mooncake-port``) and Dynamo's
standalone indexer's (:mod:`kvconductor.http.dynamo`, ``--dynamo-port``).

Both are a small Falcon ASGI app over the conductor, with the V3 port's rules at their
door: the ``--api-key`` bearer check of the routes that change state (:class:`Route`,
before the body is read), the body bounded by ``--max-body-bytes`` (413), and every
error answered in the dialect's own error body with a WARN line (:class:`Voice`). A
dialect names its voice (its logger and its error document) once; the routes, the error
handlers and the app are made here (:func:`dialect_app`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import falcon
import falcon.asgi
import msgspec

from kvconductor.http.auth import CHALLENGE, UNAUTHORIZED, bearer_ok
from kvconductor.http.framing import date_header
from kvconductor.http.responses import too_large_message
from kvconductor.schema import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    RegisterRequest,
    UnregisterRequest,
    is_msgpack_content_type,
    json_encoder,
)
from kvconductor.state.conductor import Conductor, StateUnavailable
from kvconductor.state.registration import RegistrationUnavailable
from kvconductor.state.registry import RegistrationError, Registry

_msgpack_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Door:
    """What a dialect's port is served with, from the V3 port's flags: the body limit
    (``--max-body-mb``), the bearer token of the routes that change state (``--api-key``;
    ``None``: open, also with ``--NAME-port-open``) and whether the listing of what is
    registered is open without it (``--open-workers``)."""

    max_body_bytes: int = 64 * 1024 * 1024
    api_key: str | None = None
    open_listing: bool = False

    @property
    def key(self) -> str | None:
        return self.api_key or None

    @property
    def listing_key(self) -> str | None:
        return None if self.open_listing else self.key


class DialectError(Exception):
    """A request the dialect answers with ``status`` and its error body (``message``;
    the Mooncake dialect also says ``reason`` and ``field``)."""

    def __init__(self, status: int, reason: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Voice:
    """How a dialect speaks: its logger, its name in log lines, its error document, and
    whether it answers MessagePack to a MessagePack request (else JSON only)."""

    log: logging.Logger
    name: str
    error_doc: Callable[[DialectError], Any]
    msgpack: bool = True

    def encoded(self, req: falcon.asgi.Request) -> bool:
        """Whether the answer to ``req`` is MessagePack (the request's encoding)."""
        return self.msgpack and is_msgpack_content_type(req.content_type)

    def fail(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: DialectError) -> None:
        """Answer ``ex`` (its status, the dialect's error body) and log it (WARN)."""
        self.log.warning(
            "%s: bad request method=%s path=%s status=%d reason=%s error=%s",
            self.name,
            req.method,
            req.path,
            ex.status,
            ex.reason,
            ex.message,
        )
        answer(resp, ex.status, self.error_doc(ex), self.encoded(req))


def answer(resp: falcon.asgi.Response, status: int, doc: Any, msgpack: bool) -> None:
    """``doc`` encoded as JSON, or MessagePack when ``msgpack``, with ``status``."""
    resp.status = status
    if msgpack:
        resp.content_type = MSGPACK_CONTENT_TYPE
        resp.data = _msgpack_encoder.encode(doc)
    else:
        resp.content_type = JSON_CONTENT_TYPE
        resp.data = json_encoder.encode(doc)


class OnceWarnings:
    """A WARN line at most once per key per ``interval`` seconds (thread-safe)."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.log = logger
        self.interval = interval
        self._last: dict[object, float] = {}
        self._lock = threading.Lock()

    def warn(self, key: object, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                return
            self._last[key] = now
        self.log.warning(msg, *args)


class Spoken(Protocol):
    """A dialect's state object, which its routes are over: it says its :class:`Voice`,
    and lists what is registered over it (:class:`ListingRoute`)."""

    @property
    def voice(self) -> Voice: ...

    async def listing(self) -> Any: ...


_D = TypeVar("_D", bound=Spoken)


class Route(Generic[_D]):
    """A route of a dialect (``dialect``, in its voice): the bearer check and the
    bounded body read. ``api_key``: the bearer token this route needs (``None``: open)."""

    def __init__(self, dialect: _D, max_body_bytes: int, api_key: str | None = None) -> None:
        self.dialect = dialect
        self.voice = dialect.voice
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    def refused(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> bool:
        """Answer 401 (the dialect's error body, a WARN) unless the request carries the
        key; before the body is read, so a refused request changes nothing."""
        if bearer_ok(req.get_header("Authorization"), self.api_key):
            return False
        resp.set_header("WWW-Authenticate", CHALLENGE)
        self.voice.fail(req, resp, DialectError(401, "unauthorized", UNAUTHORIZED))
        return True

    async def read(self, req: falcon.asgi.Request) -> bytes:
        """The body, at most ``max_body_bytes`` (else :class:`DialectError` 413)."""
        length = req.content_length
        if length is not None and length > self.max_body_bytes:
            raise self._too_large()
        chunks, total = [], 0
        async for chunk in req.stream:
            total += len(chunk)
            if total > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> DialectError:
        return DialectError(413, "too_large", too_large_message(self.max_body_bytes))


class PostRoute(Route[_D]):
    """A ``POST`` route: the key (before the body is read), the body and the dialect's
    errors, once; :meth:`answer` reads the request and returns the answer (``status``)."""

    status = 200

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.refused(req, resp):
            return
        msgpack = self.voice.encoded(req)
        try:
            doc = await self.answer(req, await self.read(req), msgpack)
        except DialectError as ex:
            return self.voice.fail(req, resp, ex)
        answer(resp, self.status, doc, msgpack)

    async def answer(self, req: falcon.asgi.Request, body: bytes, msgpack: bool) -> Any:
        raise NotImplementedError


class ListingRoute(Route[_D]):
    """``GET`` of what is registered (Mooncake's ``/services``, Dynamo's ``/workers``):
    it names every engine's publisher URL, so it needs the key as V3's ``/workers`` does
    (unless ``--open-workers``: the route's ``api_key`` is then ``None``)."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.refused(req, resp):
            return
        answer(resp, 200, await self.dialect.listing(), False)


async def register_v3(conductor: Conductor, req: RegisterRequest, body: bytes, failed: str) -> None:
    """Our registration ``req`` (its V3 JSON ``body``, what the journal logs) made through
    the conductor's journal: a registration we refuse is a 400, a subscription that
    cannot be opened (or a replicated log out of reach) a 500 (``failed: <why>``)."""
    try:
        await conductor.mutate("register", body, req)
    except RegistrationError as ex:
        raise DialectError(400, "invalid_registration", str(ex)) from None
    except (RegistrationUnavailable, StateUnavailable) as ex:
        raise DialectError(500, "subscription_failed", f"{failed}: {ex}") from None


#: V3's ``/unregister`` fields, by their wire names.
_UNREGISTER_FIELDS = ("instance_id", "type", "modelname", "block_size", "dp_rank", "tenant_id")


def unregister_request(
    registry: Registry, instance_id: str, dp_rank: int, tenant: str | None = None
) -> UnregisterRequest | None:
    """V3's unregistration of one registered DP (``tenant``: only in that tenant), or
    ``None`` when it is not registered (ingest thread: it reads the registry)."""
    entry = registry.get(instance_id)
    ep = None if entry is None else entry.endpoints.get(dp_rank)
    if ep is None or (tenant is not None and ep.tenant_id != tenant):
        return None
    values = (instance_id, ep.engine_type, ep.model_name, ep.block_size, dp_rank, ep.tenant_id)
    fields = dict(zip(_UNREGISTER_FIELDS, values, strict=True))
    return msgspec.convert(fields, UnregisterRequest)


class HealthRoute:
    """``GET /health``: ``body`` as plain text (Mooncake: ``OK``; Dynamo: empty)."""

    def __init__(self, body: str = "OK") -> None:
        self.body = body

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = self.body


def dialect_app(voice: Voice, routes: Mapping[str, object]) -> Any:
    """The Falcon ASGI app of a dialect: ``routes`` (path -> resource), a wrong method
    405 and an unknown path 404 in the dialect's error body, an exception a 500 (logged
    with its traceback)."""

    async def http_error(
        req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: falcon.HTTPError, params: dict
    ) -> None:
        if isinstance(ex, falcon.HTTPMethodNotAllowed):
            status, reason, message = 405, "method_not_allowed", "Method not allowed"
            if ex.headers:
                resp.set_headers(ex.headers)
        elif isinstance(ex, falcon.HTTPRouteNotFound):
            status, reason, message = 404, "not_found", f"no route for {req.method} {req.path}"
        else:
            status, reason = int(str(ex.status).split()[0]), "bad_request"
            message = ex.description or ex.title or str(ex.status)
        voice.fail(req, resp, DialectError(status, reason, message))

    async def exception(
        req: falcon.asgi.Request, resp: falcon.asgi.Response, ex: Exception, params: dict
    ) -> None:
        voice.log.exception(
            "%s: internal error method=%s path=%s", voice.name, req.method, req.path
        )
        doc = voice.error_doc(DialectError(500, "internal_error", f"internal error: {ex}"))
        answer(resp, 500, doc, voice.encoded(req))

    app = falcon.asgi.App(cors_enable=False)
    for path, resource in routes.items():
        app.add_route(path, resource)
    app.add_error_handler(Exception, exception)
    app.add_error_handler(falcon.HTTPError, http_error)
    return app


class LocalFirst:
    """ASGI: the ``POST`` requests of ``paths`` answered by ``local`` (with a ``Date``,
    which a worker's uvicorn does not add), every other request by ``rest``: a dialect's
    port in a worker of ``--workers N``, its queries answered from the shared index
    there, the rest forwarded to the owner (whose answers carry their ``Date``)."""

    def __init__(self, local: Any, paths: Iterable[str], rest: Any) -> None:
        self.local = local
        self.paths = frozenset(paths)
        self.rest = rest

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.rest(scope, receive, send)

        async def dated(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [date_header(), *message.get("headers", ())]}
            await send(message)

        await self.local(scope, receive, dated)
