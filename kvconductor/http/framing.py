"""The bytes of the answers kv-conductor writes itself, written only here.

Every door to ``/query`` and ``/query_by_hash`` frames its answer here: the protocol
(:mod:`kvconductor.http.direct`: the whole response, :func:`write_response`), the ASGI
front door (:class:`~kvconductor.http.front.FrontDoor`, one process and a ``--workers
N`` worker: :func:`query_headers` sent with :func:`send_answer`) and Falcon's
``QueryResource`` (the same :func:`query_headers` on its response), all three through
:mod:`kvconductor.http.querydoor`. So do the answers the server gives without the app:
the connection limits' refusals (:func:`refusal`: 400, 408, 431, 503), a worker's 413
and 503 (:func:`error_answer`) and its ``GET /health``; and uvicorn's own answers go out
in one call (:func:`write`, :class:`~kvconductor.http.limits.OneWrite`).

* :data:`STATUS_LINE`: the status line of every code, as uvicorn writes it for the ASGI
  path (the same table: an answer is the same bytes through either path,
  ``tests/test_uvicorn_fence.py`` ties them);
* the headers, in the order every door writes them: ``Date`` (:func:`date_header`: one
  process's uvicorn adds it to the app's answers, a worker's answers carry it from here),
  ``Content-Type``, ``Content-Length``, ``Server-Timing``, the CORS headers
  (:func:`cors_headers`, of :func:`~kvconductor.http.responses.cors_origin`'s policy),
  ``X-KV-Conductor-Warning`` and ``Connection: close`` (:func:`closing` on an ASGI
  answer given before its request's body was read);
* :data:`JOIN_BYTES`: a response is one ``write`` (head and body joined) up to this
  body size, one ``writelines`` above it (the body uncopied).
"""

from __future__ import annotations

import email.utils
import http
import time
from typing import Any

from kvconductor.http.responses import (
    CT_JSON,
    CT_MSGPACK,
    EXPOSE_HEADERS_B,
    TOP_K_OMITTED_HEADER_B,
    WARNING_HEADER_B,
    cors_origin,
    header_text,
)
from kvconductor.wire import encode_error

__all__ = [
    "JOIN_BYTES",
    "STATUS_LINE",
    "closing",
    "cors_headers",
    "date_header",
    "error_answer",
    "query_headers",
    "refusal",
    "send_answer",
    "write",
    "write_response",
]


def _status_line(code: int) -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase)


#: ``b"HTTP/1.1 <code> <reason>\r\n"`` of every status code (an unknown one: no reason).
STATUS_LINE = {code: _status_line(code) for code in range(100, 600)}
#: Bodies up to this size are joined to the head; larger ones follow it in the same
#: ``writelines`` call, uncopied.
JOIN_BYTES = 16 * 1024

_CT = {False: (b"content-type", CT_JSON), True: (b"content-type", CT_MSGPACK)}
_CLOSE = b"connection: close\r\n"
_date: list = [0, (b"date", b"")]  # [the second, its header]


def date_header() -> tuple[bytes, bytes]:
    """``Date`` (RFC 9110) of an answer written here where uvicorn adds none (a worker's,
    a refusal): formatted once per second, as uvicorn's own (its ``default_headers``,
    refreshed on each tick of its main loop)."""
    now = int(time.time())
    if now != _date[0]:
        _date[1] = (b"date", email.utils.formatdate(now, usegmt=True).encode())
        _date[0] = now
    return _date[1]


def cors_headers(
    path: str, origin: str | None, allow_origins: frozenset[str] = frozenset()
) -> list[tuple[bytes, bytes]]:
    """The CORS headers (ASGI) of an answer to a request from ``origin`` (none without
    one): the policy is :func:`~kvconductor.http.responses.cors_origin`'s."""
    if origin is None:
        return []
    allow, vary = cors_origin(path, origin, allow_origins)
    if allow is None:
        return []
    if vary:
        return [(b"access-control-allow-origin", allow.encode("latin-1")), (b"vary", b"Origin")]
    return [(b"access-control-allow-origin", allow.encode("latin-1"))]


def query_headers(
    data: bytes,
    msgpack: bool,
    path: str,
    origin: str | None,
    t0: float,
    warning: str | None = None,
    date: bool = False,
    omitted: int | None = None,
) -> list[tuple[bytes, bytes]]:
    """The headers of a query route's answer ``data`` (ASGI pairs): ``Date`` when
    ``date`` (a worker), the content type and length, ``Server-Timing`` (since ``t0``,
    ``perf_counter`` when the request's head arrived), CORS for ``origin``,
    ``warning``'s header and, with ``top_k``, the count of rows ``omitted`` at the cut.
    A CORS answer names those two headers in ``Access-Control-Expose-Headers``, so a
    web page can read them."""
    headers = [
        _CT[msgpack],
        (b"content-length", b"%d" % len(data)),
        (b"server-timing", b"app;dur=%.3f" % ((time.perf_counter() - t0) * 1e3)),
    ]
    if date:
        headers.insert(0, date_header())
    if origin is not None:
        cors = cors_headers(path, origin)
        if cors:
            headers += cors
            headers.append(EXPOSE_HEADERS_B)
    if warning is not None:
        headers.append((WARNING_HEADER_B, header_text(warning).encode("ascii")))
    if omitted is not None:
        headers.append((TOP_K_OMITTED_HEADER_B, b"%d" % omitted))
    return headers


def closing(start: dict) -> dict:
    """The ASGI ``http.response.start`` message ``start`` with ``Connection: close`` (an
    answer given before its request's body was read: the connection is not reused)."""
    headers = [h for h in start["headers"] if h[0] != b"connection"]
    return dict(start, headers=[*headers, (b"connection", b"close")])


def error_answer(message: str, msgpack: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """ASGI headers (content type and length) and body of an error answer."""
    data = encode_error(message, msgpack)
    return [_CT[msgpack], (b"content-length", b"%d" % len(data))], data


async def send_answer(send: Any, status: int, headers: list, data: bytes) -> None:
    """A whole answer in two ASGI messages."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def write_response(
    transport: Any,
    status: int,
    default_headers: list[tuple[bytes, bytes]],
    headers: list[tuple[bytes, bytes]],
    data: bytes,
    keep_alive: bool = True,
) -> None:
    """A whole answer the protocol writes, in one call: the status line, uvicorn's
    ``default_headers`` first (its ``Date`` in one process, as on the ASGI path), then
    ``headers``, ``Connection: close`` unless ``keep_alive``, and ``data``."""
    out = [STATUS_LINE[status]]
    for name, value in default_headers:
        out += (name, b": ", value, b"\r\n")
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    if not keep_alive:
        out.append(_CLOSE)
    out.append(b"\r\n")
    if len(data) <= JOIN_BYTES:
        out.append(data)
        transport.write(b"".join(out))
    else:
        transport.writelines((b"".join(out), data))


def write(transport: Any, head: bytes, data: bytes) -> None:
    """A response ``head`` uvicorn wrote and the first body bytes ``data``, in one call
    (:class:`~kvconductor.http.limits.OneWrite`): joined up to :data:`JOIN_BYTES`."""
    if len(data) <= JOIN_BYTES:
        transport.write(head + data)
    else:
        transport.writelines((head, data))


def refusal(status: int, message: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with a JSON error body (and a
    ``Date``, RFC 9110, as every answer of both process models): what the connection
    limits answer (:mod:`kvconductor.http.limits`)."""
    headers, body = error_answer(message, False)
    out = [STATUS_LINE[status], b"date: %s\r\n" % date_header()[1]]
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    out.append(_CLOSE)
    if status == 503:
        out.append(b"retry-after: 1\r\n")
    out += (b"\r\n", body)
    return b"".join(out)
