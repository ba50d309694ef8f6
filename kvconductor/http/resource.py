"""What every resource of the Falcon app (:mod:`kvconductor.http.api`) shares: the
request body read within ``max_body_bytes`` (413 when ``Content-Length`` says so before
anything is read, or as soon as a streamed body passes the limit; 400 when the client
left before the whole body arrived), the bearer-token check, the logged 400 answer, and
the offloading of large bodies to a worker thread (so the event loop never stalls).

Every error body is ``{"error": "..."}`` (:func:`~kvconductor.http.responses.set_error`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import falcon
import falcon.asgi
import msgspec

from kvconductor.http.auth import CHALLENGE, UNAUTHORIZED, bearer_ok
from kvconductor.http.responses import set_error, too_large_message
from kvconductor.schema import decode_error_message
from kvconductor.state.protocols import QuerySource
from kvconductor.wire import JSON_CONTENT_TYPE

__all__ = [
    "BAD_JSON",
    "DEFAULT_MAX_BODY_BYTES",
    "LARGE_BODY_BYTES",
    "BodyIncomplete",
    "BodyTooLarge",
    "JsonDocument",
    "Resource",
    "bad_json_message",
    "json_answer",
    "read_body",
]

log = logging.getLogger("kvconductor.http")

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: Query bodies above this size are parsed, hashed and matched in a worker thread.
LARGE_BODY_BYTES = 256 * 1024


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


def json_answer(resp: falcon.asgi.Response, status: int, data: bytes) -> None:
    resp.status = status
    resp.content_type = JSON_CONTENT_TYPE
    resp.data = data


#: What a malformed JSON body raises in msgspec: a decode error, or (objects nested
#: thousands deep) a RecursionError, which is the client's fault as much as any other.
BAD_JSON = (msgspec.DecodeError, RecursionError)


def bad_json_message(ex: Exception) -> str:
    if isinstance(ex, RecursionError):
        return "invalid JSON request body: nesting too deep"
    return f"invalid JSON request body: {decode_error_message(ex)}"


class JsonDocument:
    """``GET`` of a JSON document built and encoded once (``/openapi.json`` of the V3
    port and of the Mooncake dialect's)."""

    def __init__(self, document: Callable[[], Any]) -> None:
        self._body = msgspec.json.encode(document())

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = self._body


#: What a resource answers from: the :class:`Conductor`, or for the query resources any
#: :class:`~kvconductor.state.protocols.QuerySource` (a worker's shared view too).
_Source = TypeVar("_Source", bound=QuerySource)
_Decoded = TypeVar("_Decoded")


class Resource(Generic[_Source]):
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
        set_error(resp, 401, UNAUTHORIZED)
        return False

    async def _decoded(
        self,
        req: falcon.asgi.Request,
        resp: falcon.asgi.Response,
        decode: Callable[[bytes], _Decoded],
    ) -> tuple[bytes, _Decoded] | None:
        """An authorized request's JSON body and what ``decode`` makes of it; ``None``
        once it is answered (401, 413, 400)."""
        if not self._authorized(req, resp):
            return None
        body = await self._body(req, resp)
        if body is None:
            return None
        try:
            return body, decode(body)
        except BAD_JSON as ex:
            self._bad(req, resp, bad_json_message(ex))
            return None

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
            set_error(resp, 413, too_large_message(self.max_body_bytes), msgpack)
            # NOTE: the unread rest of the body is discarded by the server after the reply.
            return None
        except BodyIncomplete:
            log.debug(
                "request body incomplete (client gone) method=%s path=%s content_length=%s",
                req.method,
                req.path,
                req.content_length,
            )
            set_error(resp, 400, "request body shorter than its Content-Length", msgpack)
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
        set_error(resp, status, message, msgpack)

    async def _offload(self, body: bytes | bytearray, fn, *args: Any) -> Any:
        """``fn(*args)`` inline for small bodies, in a worker thread for large ones."""
        if len(body) <= self.large_body_bytes:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.conductor.executor, fn, *args)
