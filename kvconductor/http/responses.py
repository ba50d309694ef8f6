"""What the answers of both process models say, decided only here (their bytes are
written by :mod:`kvconductor.http.framing`).

* **Error bodies**: ``{"error": "..."}``, JSON or, on the routes of
  :data:`MSGPACK_PATHS` when the request was MessagePack, MessagePack
  (:func:`set_error` for a Falcon response, :func:`~kvconductor.http.framing.error_answer`
  for an ASGI one); the sentences of the 413 (:func:`too_large_message`) and of the 503
  of a worker whose owner process cannot be reached (:data:`OWNER_UNAVAILABLE`).
* **CORS**: which ``Access-Control-Allow-Origin`` a request gets (:func:`cors_origin`):
  ``*`` on the public reads (:data:`PUBLIC_READ_PATHS`), the origin itself (with ``Vary:
  Origin``) when it is allowed (``--allow-origin``), none otherwise. The Falcon app's
  :class:`~kvconductor.http.api.OriginPolicy`, the query doors
  (:func:`~kvconductor.http.framing.cors_headers`) and a worker's forwarder
  (:mod:`kvconductor.serve.proxy`) all ask it.
* The ``X-KV-Conductor-Warning`` header text (:func:`header_text`).

One process serves the Falcon app behind the front door; ``kv-conductor --workers N``
serves the front door in each worker and the Falcon app in the owner: an answer decided
here is byte for byte the same in both (docs/security.md, "CORS").
"""

from __future__ import annotations

import re
from typing import Any

from kvconductor.schema import TOP_K_OMITTED_HEADER
from kvconductor.wire import JSON_CONTENT_TYPE, MSGPACK_CONTENT_TYPE, encode_error

QUERY_PATHS = frozenset(("/query", "/query_by_hash"))
#: Routes whose error bodies are encoded like the request (JSON or MessagePack).
MSGPACK_PATHS = QUERY_PATHS | {"/explain", "/predict", "/predict_by_hash"}
#: Routes that change state: a request with an ``Origin`` not in the allow-list is 403.
MUTATING_PATHS = frozenset(("/register", "/unregister", "/events", "/predict", "/predict_by_hash"))
#: Routes any web page may read (``Access-Control-Allow-Origin: *``).
PUBLIC_READ_PATHS = frozenset(("/health", "/query", "/query_by_hash"))

#: ``content-type`` header values (ASGI: bytes).
CT_JSON = JSON_CONTENT_TYPE.encode()
CT_MSGPACK = MSGPACK_CONTENT_TYPE.encode()
#: The ``error`` of a worker's 503 when its owner process cannot be reached.
OWNER_UNAVAILABLE = "the index owner process is unavailable; retry later"
#: Response header of a 200 query answer that could not match for a reason an operator
#: can fix (the body keeps the V3 shape).
WARNING_HEADER = "X-KV-Conductor-Warning"
WARNING_HEADER_B = WARNING_HEADER.lower().encode()
TOP_K_OMITTED_HEADER_B = TOP_K_OMITTED_HEADER.lower().encode()
#: A query answer's own headers that a web page reading it across origins may see (a
#: browser hides every response header but a few safe ones unless the answer names it).
EXPOSE_HEADERS_B = (
    b"access-control-expose-headers",
    f"{WARNING_HEADER}, {TOP_K_OMITTED_HEADER}".encode("ascii"),
)

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def too_large_message(max_body_bytes: int) -> str:
    """The ``error`` of a 413 answer."""
    return f"request body exceeds the limit of {max_body_bytes} bytes"


def freshness_param(query_string: bytes) -> bool:
    """``?freshness=`` of a query route's target (docs/api.md, "freshness"): ``true``,
    ``1`` or no value mean True; ``false``, ``0`` or no such parameter False; any other
    value is a ``ValueError`` (its message is the 400's). Other parameters are ignored."""
    if not query_string:
        return False
    on = False
    for part in query_string.split(b"&"):
        name, _, value = part.partition(b"=")
        if name != b"freshness":
            continue
        v = value.lower()
        if v in (b"", b"true", b"1"):
            on = True
        elif v in (b"false", b"0"):
            on = False
        else:
            text = value[:40].decode("latin-1")
            raise ValueError(
                f"invalid query parameter `freshness`: expected true, false, 1 or 0 (got {text!r})"
            )
    return on


def content_type(msgpack: bool) -> str:
    return MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE


def set_error(resp: Any, status: int, message: str, msgpack: bool = False) -> None:
    """The same error answer on a Falcon response."""
    resp.status = status
    resp.content_type = content_type(msgpack)
    resp.data = encode_error(message, msgpack)


def cors_origin(path: str, origin: str, allow_origins: frozenset[str]) -> tuple[str | None, bool]:
    """``Access-Control-Allow-Origin`` of a request from ``origin`` to ``path`` (``None``:
    no CORS headers), and whether ``Vary: Origin`` goes with it."""
    if path in PUBLIC_READ_PATHS:
        return "*", False
    if origin in allow_origins:
        return origin, True
    return None, False


def header_text(sentence: str) -> str:
    """``sentence`` as a header value: printable ASCII only. Non-ASCII and control
    characters (a model name may hold ``\\r\\n``) are escaped, so no name can end the
    header or start another."""
    text = sentence.encode("ascii", "backslashreplace").decode("ascii")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
