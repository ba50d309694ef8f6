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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import falcon
import falcon.asgi
import msgspec

from kvconductor.http.auth import CHALLENGE, UNAUTHORIZED, bearer_ok
from kvconductor.http.responses import too_large_message
from kvconductor.schema import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    UnregisterRequest,
    is_msgpack_content_type,
    json_encoder,
)
from kvconductor.state.registry import Registry

_msgpack_encoder = msgspec.msgpack.Encoder()


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
    """A dialect's state object, which its routes are over: it says its :class:`Voice`."""

    @property
    def voice(self) -> Voice: ...


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


def unregister_request(
    registry: Registry, instance_id: str, dp_rank: int, tenant: str | None = None
) -> UnregisterRequest | None:
    """V3's unregistration of one registered DP (``tenant``: only in that tenant), or
    ``None`` when it is not registered (ingest thread: it reads the registry)."""
    entry = registry.get(instance_id)
    ep = None if entry is None else entry.endpoints.get(dp_rank)
    if ep is None or (tenant is not None and ep.tenant_id != tenant):
        return None
    return UnregisterRequest(
        instance_id=instance_id,
        engine_type=ep.engine_type,
        modelname=ep.model_name,
        block_size=ep.block_size,
        dp_rank=dp_rank,
        tenant_id=ep.tenant_id,
    )


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
