"""A worker's way to the owner: an HTTP/1.1 client of the owner's UNIX socket.

``kv-conductor --workers N``: each worker answers the query routes itself
(:class:`~kvconductor.http.front.FrontDoor`) and hands every other request to a
:class:`Forwarder`, the front door's *rest*: method, target, headers (plus
``X-Forwarded-For``) and body go to the owner over a pool of keep-alive connections
(:class:`OwnerClient`); its status, headers and body come back unchanged.

The reading side is small and strict (the owner is kv-conductor's own uvicorn, but a
malformed answer must never turn into a 500 or a hang): :func:`read_head` (status line
and headers of the next final answer, 1xx skipped; the body's framing: ``Content-Length``,
chunked, or until close) and :func:`read_chunk` (one chunk of a chunked body) raise
:class:`BadResponse` for what is not HTTP/1.1, and asyncio's ``IncompleteReadError``
when the owner closes mid-answer. ``tests/test_proxy.py`` feeds them byte sequences.

The answers a worker writes itself (413 for a chunked body past the limit, 503 when the
owner cannot be reached) are decided by :mod:`kvconductor.http.responses` and written by
:mod:`kvconductor.http.framing`, like the owner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

import msgspec

from kvconductor.http.framing import (
    closing,
    cors_headers,
    date_header,
    error_answer,
    send_answer,
)
from kvconductor.http.metrics import QueryMetrics
from kvconductor.http.responses import (
    MSGPACK_PATHS,
    OWNER_UNAVAILABLE,
    QUERY_PATHS,
    too_large_message,
)
from kvconductor.ingest.freshness import FreshnessUnavailable
from kvconductor.schema import FreshnessDocument
from kvconductor.wire import is_msgpack_content_type

log = logging.getLogger("kvconductor.cluster")

#: A pooled connection idle this long is closed instead of reused.
POOL_IDLE_SECS = 60.0
#: Idle connections a worker keeps to the owner at most.
POOL_MAX_IDLE = 64
#: Bytes of an answer's head (and of a chunk-size line) read at most.
HEAD_LIMIT = 1 << 20
_CHUNK = 1 << 16
#: How long a worker waits for the owner to answer a request from its head alone (a
#: body past the limit: 413) before it sends the withheld body's first chunk.
HEAD_ANSWER_SECS = 0.5

#: Request headers not forwarded (hop-by-hop, and the framing the worker sets itself).
_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"expect",
        b"content-length",
    )
)
#: Response headers not relayed (the worker's own server frames its answer).
_RESP_HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding"))


class OwnerUnavailable(Exception):
    """The owner's socket refused or dropped a request before its answer began."""


class BadResponse(ValueError):
    """The owner's answer is not HTTP/1.1 as this client reads it."""


@dataclasses.dataclass(slots=True)
class Head:
    """The head of an answer: status, the headers to relay (lower-case names, hop-by-hop
    ones left out) and how its body is framed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    #: ``Content-Length`` (``None``: chunked, or until the owner closes).
    length: int | None = None
    chunked: bool = False
    #: ``Connection: close``: the connection is not reused.
    close: bool = False


async def _read_line(reader: asyncio.StreamReader, end: bytes) -> bytes:
    try:
        return await reader.readuntil(end)
    except asyncio.LimitOverrunError:
        raise BadResponse(f"line longer than {HEAD_LIMIT} bytes") from None


async def read_head(reader: asyncio.StreamReader) -> Head:
    """The head of the next final answer on ``reader`` (interim 1xx answers skipped).

    Raises :class:`BadResponse` for a malformed status line, header line or
    ``Content-Length``, ``asyncio.IncompleteReadError`` when the connection closes
    before the head is complete."""
    while True:
        raw = await _read_line(reader, b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise BadResponse(f"bad status line {lines[0][:80]!r}")
        code = parts[1]
        if len(code) != 3 or not code.isdigit():
            raise BadResponse(f"bad status code {code[:80]!r}")
        status = int(code)
        if 100 <= status < 200:
            continue  # interim (100 Continue)
        head = Head(status, [])
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            name = name.strip().lower()
            if not colon or not name:
                raise BadResponse(f"bad header line {line[:80]!r}")
            value = value.strip()
            if name == b"content-length":
                if not value.isdigit():
                    raise BadResponse(f"bad Content-Length {value[:80]!r}")
                head.length = int(value)
            elif name == b"transfer-encoding":
                head.chunked = b"chunked" in value.lower()
            elif name == b"connection":
                head.close = b"close" in value.lower()
            if name not in _RESP_HOP:
                head.headers.append((name, value))
        if head.chunked:
            head.length = None  # chunked framing wins over a Content-Length (RFC 9112 6.3)
        return head


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """The data of the next chunk of a chunked body; ``b""`` for the last one (its
    trailers read and dropped). Raises :class:`BadResponse` for a malformed size line or
    chunk end, ``asyncio.IncompleteReadError`` when the connection closes mid-body."""
    line = await _read_line(reader, b"\r\n")
    text = line[:-2].split(b";", 1)[0].strip()
    if not text or len(text) > 16 or text.strip(b"0123456789abcdefABCDEF"):
        raise BadResponse(f"bad chunk size {line[:80]!r}")
    size = int(text, 16)
    if size == 0:
        while await _read_line(reader, b"\r\n") != b"\r\n":
            pass  # trailers
        return b""
    data = await reader.readexactly(size)
    if await reader.readexactly(2) != b"\r\n":
        raise BadResponse("chunk not followed by CRLF")
    return data


async def relay_body(
    reader: asyncio.StreamReader, head: Head, send: Any, head_only: bool = False
) -> bool:
    """Relay the body framed by ``head`` to ASGI ``send`` (``http.response.body``
    messages; the start was sent). Returns whether the connection can be reused."""
    if head_only or head.status in (204, 304):
        await send({"type": "http.response.body", "body": b""})
        return not head.close
    if head.length is not None:
        left = head.length
        while left > _CHUNK:
            data = await reader.readexactly(_CHUNK)
            left -= _CHUNK
            await send({"type": "http.response.body", "body": data, "more_body": True})
        data = await reader.readexactly(left)
        await send({"type": "http.response.body", "body": data})
        return not head.close
    if head.chunked:
        while data := await read_chunk(reader):
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return not head.close
    while data := await reader.read(_CHUNK):  # until the owner closes
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
    return False


def request_head(scope: dict, content_length: int | None) -> bytes:
    """The request line and headers that forward ASGI ``scope`` (hop-by-hop headers
    left out, the client's address added to ``X-Forwarded-For``)."""
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    lines = [scope["method"].encode() + b" " + target + b" HTTP/1.1"]
    forwarded = None
    for k, v in scope["headers"]:
        if k in _HOP:
            continue
        if k == b"x-forwarded-for":
            forwarded = v
            continue
        lines.append(k + b": " + v)
    client = scope.get("client")
    if client:
        ip = str(client[0]).encode()
        lines.append(b"x-forwarded-for: " + (forwarded + b", " + ip if forwarded else ip))
    elif forwarded is not None:
        lines.append(b"x-forwarded-for: " + forwarded)
    if content_length is not None:
        lines.append(b"content-length: " + str(content_length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


_FRESHNESS = msgspec.json.Decoder(FreshnessDocument)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class OwnerFreshness:
    """A worker's reader of its owner's ``GET /freshness`` (the states behind
    ``"freshness"`` answers, :meth:`kvconductor.state.shared.SharedView.freshness`).

    Blocking, on the thread that answers the query (the event loop's for a small one):
    one request over a kept connection to the owner's UNIX socket, about 0.2 ms, at most
    once per (model, tenant) per ``FRESHNESS_TTL``. One connection per thread. A stalled
    owner holds it at most ``timeout`` seconds (no second try after a timeout; a kept
    connection the owner closed is tried once more, anew).
    :class:`~kvconductor.ingest.freshness.FreshnessUnavailable` when the owner cannot be
    reached in time or answers anything but 200."""

    def __init__(self, path: str, timeout: float = 0.5) -> None:
        self.path = path
        self.timeout = timeout
        self._local = threading.local()

    def __call__(self, model: str, tenant: str) -> FreshnessDocument:
        target = "/freshness?" + urllib.parse.urlencode({"model": model, "tenant": tenant})
        while True:
            conn = getattr(self._local, "conn", None)
            kept = conn is not None
            if conn is None:
                conn = self._local.conn = _UnixHTTPConnection(self.path, self.timeout)
            try:
                conn.request("GET", target)
                r = conn.getresponse()
                body = r.read()
            except (OSError, http.client.HTTPException) as ex:
                conn.close()
                self._local.conn = None
                if kept and not isinstance(ex, TimeoutError):
                    continue  # the owner closed the kept connection: once more, anew
                raise FreshnessUnavailable(f"the owner cannot be reached ({ex!r})") from None
            if r.status != 200:
                raise FreshnessUnavailable(f"the owner answered {r.status}")
            try:
                return _FRESHNESS.decode(body)
            except msgspec.DecodeError as ex:
                raise FreshnessUnavailable(f"the owner's answer is malformed ({ex})") from None


class OwnerClient:
    """HTTP/1.1 client of the owner's UNIX socket: a pool of keep-alive connections;
    each request has a connection to itself."""

    def __init__(self, path: str, max_idle: int = POOL_MAX_IDLE) -> None:
        self.path = path
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _acquire(self) -> tuple[_Conn, bool]:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < POOL_IDLE_SECS and not conn.reader.at_eof():
                return conn, True
            conn.close()
        reader, writer = await asyncio.open_unix_connection(self.path, limit=HEAD_LIMIT)
        return _Conn(reader, writer), False

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def forward(
        self, head: bytes, body: bytes, send: Any, *, head_only: bool, reuse: bool = True
    ) -> None:
        """Send one request (``head`` + ``body``) and relay the answer to ASGI ``send``.

        ``head_only``: the answer has no body (HEAD). Raises :class:`OwnerUnavailable`
        when the owner cannot be reached, closes before answering or answers with a
        malformed head (nothing was sent to the client then). A stale pooled connection
        is retried once on a new one. ``reuse=False``: the connection is closed after
        the answer (a body was withheld): the head goes first, and ``body`` only when
        the owner has not answered from the head within :data:`HEAD_ANSWER_SECS`.
        """
        for attempt in (0, 1):
            try:
                conn, reused = await self._acquire()
            except OSError as ex:
                raise OwnerUnavailable(str(ex)) from None
            try:
                answer = await self._exchange(conn, head, body, early=not reuse)
            except (OSError, asyncio.IncompleteReadError, ValueError) as ex:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise OwnerUnavailable(str(ex) or type(ex).__name__) from None
            break
        try:
            await send(
                {"type": "http.response.start", "status": answer.status, "headers": answer.headers}
            )
            keep = await relay_body(conn.reader, answer, send, head_only)
        except BaseException:
            conn.close()
            raise
        if keep and reuse:
            self._release(conn)
        else:
            conn.close()

    @staticmethod
    async def _exchange(conn: _Conn, head: bytes, body: bytes, *, early: bool) -> Head:
        """Write one request and read the head of its answer. ``early``: the owner
        is expected to answer from the head alone (413 for a body past the limit, 401,
        404), then close without reading the body; writing the body into that close
        would fail, and asyncio drops an answer already on its way when a write fails
        (the transport closes), so the body waits for the owner's silence."""
        heading = None
        try:
            try:
                if early and body:
                    conn.writer.write(head)
                    await conn.writer.drain()
                    heading = asyncio.ensure_future(read_head(conn.reader))
                    done, _ = await asyncio.wait((heading,), timeout=HEAD_ANSWER_SECS)
                    if done:
                        return heading.result()
                    conn.writer.write(body)
                else:
                    conn.writer.write(head + body if len(body) < _CHUNK else head)
                    if len(body) >= _CHUNK:
                        conn.writer.write(body)
                await conn.writer.drain()
            except OSError:
                # The owner may have answered from the head (401, 413: it reads no
                # body then) and closed before taking all of it: read that answer.
                # A stale pooled connection has none: retried by the caller.
                pass
            if heading is None:
                return await read_head(conn.reader)
            return await heading
        finally:
            if heading is not None and not heading.done():
                heading.cancel()


class CloseAfter:
    """ASGI ``send`` wrapper for a request whose body was not read: the answer closes
    the client connection (``Connection: close``), as the owner's server would."""

    def __init__(self, send: Any) -> None:
        self.send = send

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            message = closing(message)
        await self.send(message)


class _ClientGone(Exception):
    """The client disconnected while its body was being streamed to the owner."""


class _BodyTooLarge(Exception):
    """A streamed chunked body passed the limit."""


class Forwarder:
    """ASGI app: forward the request to the owner and relay its answer unchanged (a
    worker front door's *rest*).

    The body limit ``max_body_bytes`` is the owner's: a ``Content-Length`` past it is
    sent on without the body (the owner answers from the head: 413, or 401/403/404
    first, as with one process) and the client connection is closed; a chunked body
    past it gets the owner's 413 from here (CORS as the owner's, ``allow_origins``;
    counted in ``query_metrics`` on a query route). A body still arriving is streamed
    to the owner (:meth:`_stream`), so what it refuses from the head comes back at once.
    The owner unreachable: 503 ``{"error": ...}`` (MessagePack for a MessagePack query).
    """

    def __init__(
        self,
        client: OwnerClient,
        *,
        max_body_bytes: int,
        allow_origins: Iterable[str] = (),
        query_metrics: QueryMetrics | None = None,
    ) -> None:
        self.owner = client
        self.max_body_bytes = max_body_bytes
        self.allow_origins = frozenset(allow_origins)
        self.query_metrics = query_metrics if query_metrics is not None else QueryMetrics()
        self._unavailable_logged = 0.0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        length = None
        ctype = origin = None
        for k, v in scope["headers"]:
            if k == b"content-length":
                with contextlib.suppress(ValueError):
                    length = int(v)
            elif k == b"content-type":
                ctype = v.decode("latin-1")
            elif k == b"origin":
                origin = v.decode("latin-1")
        msgpack = scope["path"] in MSGPACK_PATHS and is_msgpack_content_type(ctype)
        head_only = scope["method"] == "HEAD"
        body = bytearray()
        more = True
        if length is not None and length > self.max_body_bytes:
            # The owner answers from the head and the first chunk (413, or whatever comes
            # first for that route: 401, 403, 404): send those, never buffer the rest.
            msg = await receive()
            if msg["type"] != "http.request":
                return
            more = msg.get("more_body", False)
            if more:
                head = request_head(scope, length)
                try:
                    await self.owner.forward(
                        head,
                        msg.get("body", b""),
                        CloseAfter(send),
                        head_only=head_only,
                        reuse=False,
                    )
                except OwnerUnavailable as ex:
                    await self._unavailable(send, scope, msgpack, str(ex))
                return
            body += msg.get("body", b"")
        elif length != 0:
            # The front door hands over what of the body is here (an empty chunk when
            # nothing is, :class:`~kvconductor.http.front.HeadFirst`): a body still on
            # its way is streamed, so the owner may answer from the head meanwhile.
            msg = await receive()
            if msg["type"] != "http.request":
                return
            more = msg.get("more_body", False)
            if more:
                return await self._stream(
                    scope, msg.get("body", b""), length, receive, send, (msgpack, origin, t0)
                )
            body += msg.get("body", b"")
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client gone: nothing to answer
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_body_bytes:  # chunked: no Content-Length to check
                return await self._too_large(scope, send, msgpack, origin, t0)
        has_body = body or length is not None or scope["method"] in ("POST", "PUT", "PATCH")
        head = request_head(scope, len(body) if has_body else None)
        try:
            await self.owner.forward(head, bytes(body), send, head_only=head_only)
        except OwnerUnavailable as ex:
            await self._unavailable(send, scope, msgpack, str(ex))

    async def _stream(
        self,
        scope: dict,
        first: bytes,
        length: int | None,
        receive: Any,
        send: Any,
        answer: tuple[bool, str | None, float],
    ) -> None:
        """Forward a request whose body is still arriving: the head and what is here go
        to the owner at once (on a connection of its own), the rest as it arrives
        (chunked to the owner when the client's body is chunked). The owner answers
        from the head what it refuses there (401, 403, 404, 405, 413, as one process
        does): that answer is relayed at once and the client connection closed, the
        rest of the body never read; otherwise the answer follows the whole body.
        ``answer``: ``(msgpack, origin, t0)`` of the worker's own 413 and 503."""
        msgpack, origin, t0 = answer
        chunked = length is None
        head = request_head(scope, length)
        if chunked:
            head = head[:-2] + b"transfer-encoding: chunked\r\n\r\n"
        try:
            reader, writer = await asyncio.open_unix_connection(self.owner.path, limit=HEAD_LIMIT)
        except OSError as ex:
            return await self._unavailable(send, scope, msgpack, str(ex))
        conn = _Conn(reader, writer)

        def framed(data: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(data), data) if chunked and data else data

        async def pump() -> None:
            size = len(first)
            writer.write(head + framed(first))
            await writer.drain()
            more = True
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    raise _ClientGone
                data = msg.get("body", b"")
                more = msg.get("more_body", False)
                size += len(data)
                if chunked and size > self.max_body_bytes:
                    raise _BodyTooLarge
                if data:
                    writer.write(framed(data))
                    await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()

        pumping = asyncio.ensure_future(pump())
        heading = asyncio.ensure_future(read_head(reader))
        try:
            await asyncio.wait((pumping, heading), return_when=asyncio.FIRST_COMPLETED)
            if pumping.done() and not pumping.cancelled():
                problem = pumping.exception()
                if isinstance(problem, (_ClientGone, _BodyTooLarge)):
                    heading.cancel()
                    if isinstance(problem, _BodyTooLarge):
                        await self._too_large(scope, send, msgpack, origin, t0)
                    return
                # written whole, or the owner closed its side after an early answer
            try:
                head_in = await heading
            except (OSError, asyncio.IncompleteReadError, ValueError) as ex:
                return await self._unavailable(send, scope, msgpack, str(ex) or type(ex).__name__)
            early = not pumping.done()
            out = CloseAfter(send) if early else send
            await out(
                {
                    "type": "http.response.start",
                    "status": head_in.status,
                    "headers": head_in.headers,
                }
            )
            await relay_body(reader, head_in, out, scope["method"] == "HEAD")
        finally:
            for task in (pumping, heading):
                if not task.done():
                    task.cancel()
            with contextlib.suppress(BaseException):
                await pumping
            conn.close()

    async def _too_large(
        self, scope: dict, send: Any, msgpack: bool, origin: str | None, t0: float
    ) -> None:
        """413 for a chunked body past the limit, as the owner writes it."""
        path = scope["path"]
        log.warning(
            "request body too large method=%s path=%s limit=%d content_length=None",
            scope["method"],
            path,
            self.max_body_bytes,
        )
        headers, data = error_answer(too_large_message(self.max_body_bytes), msgpack)
        if path in QUERY_PATHS and scope["method"] == "POST":
            self.query_metrics.route_seconds[path].observe(time.perf_counter() - t0)
            self.query_metrics.route_errors[path].inc()
        headers += cors_headers(path, origin, self.allow_origins)
        await send_answer(send, 413, [*headers, date_header()], data)

    async def _unavailable(self, send: Any, scope: dict, msgpack: bool, why: str) -> None:
        now = time.monotonic()
        if now - self._unavailable_logged >= 5.0:
            self._unavailable_logged = now
            log.warning(
                "owner process unavailable method=%s path=%s error=%s",
                scope["method"],
                scope["path"],
                why,
            )
        headers, data = error_answer(OWNER_UNAVAILABLE, msgpack)
        await send_answer(send, 503, [*headers, date_header()], data)
