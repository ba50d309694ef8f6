"""The one ASGI front door of both process models.

:class:`FrontDoor` answers ``POST /query`` and ``POST /query_by_hash`` itself and hands
every other request to a *rest* ASGI callable:

* one process (``kv-conductor``, gunicorn): the routes are the Falcon app's own
  :class:`~kvconductor.http.query.QueryResource` objects over the conductor, the rest is
  the Falcon app (:func:`kvconductor.http.api.create_app` with ``fast_query``);
* a worker of ``kv-conductor --workers N``: the routes answer from the owner's index in
  shared memory (:func:`kvconductor.http.api.query_routes` over a
  :class:`~kvconductor.state.shared.SharedView`), the rest is the forwarder to the owner
  (:class:`kvconductor.serve.proxy.Forwarder`), and ``GET /health`` is answered here
  (``health=True``: a worker is alive while it listens).

PERF: the two hot routes skip Falcon's per-request objects: the body is collected
straight from ASGI ``receive`` and answered by the one query door
(:mod:`kvconductor.http.querydoor`: the route's answer, metrics, log line and headers, as
the protocol's and Falcon's ``POST``), sent with two ``send`` calls. Every other method on
these paths (CORS preflight included) goes to the rest.

A request for the rest that announces a body is handed over with :class:`HeadFirst`'s
``receive`` and ``send``, so what the rest refuses from the head (401, 403, 404, 405,
413) is answered before the body arrives, in both process models.

The bytes of the answers written here are :mod:`kvconductor.http.framing`'s, as the
protocol's are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from kvconductor.http.framing import closing, cors_headers, date_header, send_answer
from kvconductor.http.querydoor import Query, QueryRoute, answer_target, too_large
from kvconductor.http.responses import QUERY_PATHS
from kvconductor.wire import is_msgpack_content_type

#: Raw ``Content-Type`` values clients send, and whether each is msgpack (any other
#: value is parsed by :func:`~kvconductor.wire.is_msgpack_content_type`).
_CONTENT_TYPES = {
    b"application/msgpack": True,
    b"application/x-msgpack": True,
    b"application/json": False,
    b"application/json; charset=utf-8": False,
}

#: An ASGI application: ``await app(scope, receive, send)``.
ASGIApp = Callable[[dict, Any, Any], Awaitable[None]]


class _TooLarge(Exception):
    """The body passed the limit (:func:`_collect`)."""


async def _collect(receive: Any, limit: int) -> bytes | None:
    """The request body from ASGI ``receive``: the one chunk as it is, or the chunks
    joined once; ``None`` on a disconnect. Raises :class:`_TooLarge` as soon as the
    chunks pass ``limit`` bytes (nothing more is read).

    PERF: the chunks are kept and joined at the end, one copy at the body's size. Grown
    chunk by chunk, a 4 MB body was reallocated about 35 times, and with the server's
    malloc settings (large blocks kept in the heap, not mapped) each growth may copy
    the whole body where glibc's ``mremap`` would not. Memory follows what arrived, not
    the ``Content-Length`` a client announced."""
    msg = await receive()
    if msg["type"] != "http.request":
        return None
    chunk = msg.get("body", b"")
    if not msg.get("more_body", False):
        return chunk
    chunks = [chunk]
    size = len(chunk)
    while True:
        if size > limit:
            raise _TooLarge
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk = msg.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not msg.get("more_body", False):
            break
    if size > limit:
        raise _TooLarge
    return b"".join(chunks)


def scan_headers(headers: list[tuple[bytes, bytes]]) -> tuple[bool, int | None, str | None, bool]:
    """``(msgpack, content length, origin, chunked)`` of a query's (lower-case) headers."""
    msgpack = False
    length = None
    origin = None
    chunked = False
    for k, v in headers:
        if k == b"content-type":
            # PERF: the raw value of a known content type is looked up, not parsed
            known = _CONTENT_TYPES.get(v)
            msgpack = known if known is not None else is_msgpack_content_type(v.decode("latin-1"))
        elif k == b"content-length":
            try:
                length = int(v)
            except ValueError:
                length = None
        elif k == b"origin":
            origin = v.decode("latin-1")
        elif k == b"transfer-encoding":
            chunked = True
    return msgpack, length, origin, chunked


def body_pending(scope: dict) -> bool:
    """The (lower-case) headers of ``scope`` announce a body: a ``Content-Length`` other
    than 0, or ``Transfer-Encoding``. Headers given as a one-pass iterable (ASGI allows
    any iterable of iterables; Falcon's test client passes iterators) are made a list
    of pairs first."""
    headers = scope["headers"]
    if not isinstance(headers, list):
        headers = scope["headers"] = [tuple(h) for h in headers]
    for k, v in headers:
        if k == b"content-length":
            return v.strip() not in (b"0", b"")
        if k == b"transfer-encoding":
            return True
    return False


class HeadFirst:
    """``receive`` and ``send`` for the rest of a request that announces a body: the app
    may answer from the head while the body is still on its way.

    Falcon waits for a first ``http.request`` message before it routes, and uvicorn
    gives none before body bytes arrive: a refusal the app decides from the head (401,
    403, 404, 405, a ``Content-Length`` over the limit: 413) waited for the body, and a
    client that sends none until it has an answer (``Expect``-less clients holding a
    large upload, a body that never comes) got the request timeout's 408 instead. Here
    the first :meth:`receive` returns the body's first message if it is already here
    (the same messages as before), else at once an empty chunk with ``more_body`` (ASGI
    allows empty chunks), the real one coming on the next call. An answer that starts
    before the whole body was received closes the connection (``Connection: close``):
    what the client still sends is never read as a next request; unless ``close`` is
    false (the owner of ``--workers N``, whose client is a worker: it closes the
    connection itself once it has the answer, and a close here while it still writes
    the body could reset its read of that answer)."""

    __slots__ = ("_close", "_first", "_receive", "_send", "complete")

    def __init__(self, receive: Any, send: Any, close: bool = True) -> None:
        self._receive = receive
        self._send = send
        self._close = close
        self._first: asyncio.Future | None = None
        #: The body was received whole (or the client is gone).
        self.complete = False

    async def receive(self) -> dict:
        first = self._first
        if first is None:
            first = self._first = asyncio.ensure_future(self._receive())
            if not first.done():
                await asyncio.sleep(0)  # a body already here is handed over at once
            if not first.done():
                return {"type": "http.request", "body": b"", "more_body": True}
        if first is not _TAKEN:
            self._first = _TAKEN
            msg = await first
        else:
            msg = await self._receive()
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            self.complete = True
        return msg

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start" and not self.complete and self._close:
            message = closing(message)
        await self._send(message)

    def close(self) -> None:
        """The app is done: a receive still waiting for the body is not waited for."""
        first = self._first
        if first is not None and first is not _TAKEN and not first.done():
            first.cancel()


class AnswerFromHead:
    """ASGI wrapper: every request of ``app`` that announces a body gets its
    :class:`HeadFirst` (the Mooncake dialect's port; the front door does the same for
    the rest of the V3 port)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and body_pending(scope):
            head_first = HeadFirst(receive, send)
            try:
                return await self.app(scope, head_first.receive, head_first.send)
            finally:
                head_first.close()
        await self.app(scope, receive, send)


#: :attr:`HeadFirst._first` once its message was handed over.
_TAKEN: asyncio.Future = cast(asyncio.Future, object())


class FrontDoor:
    """ASGI front door: the query routes here, the rest to ``rest`` (module doc).

    ``routes``: path -> :class:`QueryRoute` answered here (``POST`` only).
    ``query_handler``: an ASGI callable for the query paths that have no route here
    (a seam for tests; default: the rest). ``health``: answer ``GET /health`` here.
    ``date``: add ``Date`` to the query answers written here (a worker, whose uvicorn
    adds none; one process's uvicorn adds its own).
    """

    def __init__(
        self,
        rest: ASGIApp,
        routes: Mapping[str, QueryRoute] | None = None,
        max_body_bytes: int = 64 * 1024 * 1024,
        *,
        query_handler: ASGIApp | None = None,
        health: bool = False,
        date: bool = False,
    ) -> None:
        self.rest = rest
        self.routes: dict[str, QueryRoute] = dict(routes or {})
        self.max_body_bytes = max_body_bytes
        self.query_handler = query_handler
        self.health = health
        self.date = date
        #: An answer of the rest before its request's body arrived closes the
        #: connection (:class:`HeadFirst`); the owner of ``--workers N`` sets it false.
        self.close_early = True

    @property
    def app(self) -> ASGIApp:
        """The rest (the name this attribute had in one process)."""
        return self.rest

    def trust_proxies(self, forwarded_allow_ips: str | list[str]) -> None:
        """Apply ``X-Forwarded-For``/``-Proto`` from these hosts (uvicorn's
        ``--forwarded-allow-ips``) to the rest only, for a server that turned uvicorn's
        own proxy-headers middleware off. PERF: that middleware parses the client's
        address (``ipaddress``) on every request; the query routes never read the
        client's address, so they skip it."""
        from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

        if not isinstance(self.rest, ProxyHeadersMiddleware):
            wrapped = ProxyHeadersMiddleware(
                cast(Any, self.rest), trusted_hosts=forwarded_allow_ips
            )
            self.rest = cast(ASGIApp, wrapped)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            method = scope["method"]
            if method == "POST":
                path = scope["path"]
                res = self.routes.get(path)
                if res is not None:
                    return await self._serve(res, scope, receive, send)
                if self.query_handler is not None and path in QUERY_PATHS:
                    return await self.query_handler(scope, receive, send)
            elif method == "GET" and self.health and scope["path"] == "/health":
                return await self._health(scope, send)
            if body_pending(scope):
                head_first = HeadFirst(receive, send, self.close_early)
                try:
                    return await self.rest(scope, head_first.receive, head_first.send)
                finally:
                    head_first.close()
        await self.rest(scope, receive, send)

    async def _serve(self, res: QueryRoute, scope: dict, receive: Any, send: Any) -> None:
        t0 = time.perf_counter()
        msgpack, length, origin, _ = scan_headers(scope["headers"])
        q: Query = (res, scope["path"], msgpack, origin, t0, self.date)
        limit = self.max_body_bytes
        if length is not None and length > limit:
            return await send_answer(send, *too_large(q, length, limit))
        try:
            body = await _collect(receive, limit)
        except _TooLarge:
            return await send_answer(send, *too_large(q, None, limit))
        if body is None:
            return  # http.disconnect: nobody to answer
        answer = await answer_target(q, body, scope.get("query_string", b""))
        await send_answer(send, *answer)

    @staticmethod
    async def _health(scope: dict, send: Any) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"2"),
        ]
        for k, v in scope["headers"]:
            if k == b"origin":
                headers += cors_headers("/health", v.decode("latin-1"))
                break
        headers.append(date_header())
        await send_answer(send, 200, headers, b"OK")
