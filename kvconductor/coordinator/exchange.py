"""What a plan of the sans-I/O core exchanges with its driver: the :class:`Request` it
yields, the :class:`Reply` (or :class:`TransportFailure`) it is sent back, :func:`resume`
to advance it, and the reading of a reply's body (by its Content-Type) and of the
server's error message. Nothing here opens a socket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping
from typing import Any, NamedTuple, TypeVar

import msgspec

from kvconductor.schema import is_msgpack_content_type

__all__ = ["Plan", "QueryAnswer", "Reply", "Request", "TransportFailure", "resume"]


@dataclasses.dataclass
class Request:
    """One HTTP request to send (path relative to the client's base URL)."""

    method: str
    path: str
    content: bytes | None
    headers: dict[str, str]
    timeout: float
    breaker: bool = True

    @property
    def route(self) -> str:
        return f"{self.method} {self.path}"


class Reply(NamedTuple):
    """What came back: status, ``Content-Type`` header (``""`` when absent), body and,
    for a query with ``top_k``, its ``X-KV-Conductor-Top-K-Omitted`` header as an int
    (``None`` when absent: no ``top_k``, or a server without the extension)."""

    status: int
    content_type: str
    body: bytes
    top_k_omitted: int | None = None

    @property
    def text(self) -> str:
        """The body as text: the ``charset`` of the Content-Type, else UTF-8 (bad bytes
        replaced)."""
        charset = "utf-8"
        for param in self.content_type.split(";")[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "charset" and value.strip():
                charset = value.strip().strip('"')
        try:
            return self.body.decode(charset, errors="replace")
        except LookupError:
            return self.body.decode("utf-8", errors="replace")


class TransportFailure(Exception):
    """Thrown into a plan by its driver: no HTTP answer (``error``: the transport's exception)."""

    def __init__(self, error: BaseException, timed_out: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.timed_out = timed_out


T = TypeVar("T")
#: A route: yields requests, is sent a :class:`Reply` for each, returns the result.
Plan = Generator[Request, Reply, T]


def resume(plan: Plan[T], answer: Reply | TransportFailure | None = None) -> tuple[bool, Any]:
    """Advance ``plan`` with the answer to its last request (``None`` to start it): a
    :class:`Reply`, or the :class:`TransportFailure` that stands for no answer.

    Returns ``(True, next Request)`` or ``(False, the plan's result)``; a plan's
    exception propagates.
    """
    try:
        if isinstance(answer, TransportFailure):
            return True, plan.throw(answer)
        return True, (next(plan) if answer is None else plan.send(answer))
    except StopIteration as done:
        return False, done.value


class QueryAnswer(dict[str, Any]):
    """The answer of a query with ``top_k`` (docs/api.md, "top_k and instances"): the V3
    answer ``{tenant: {instance: {...}}}`` as a dict, with ``top_k_omitted``, the
    (instance, DP) rows tied at the cut depth that the server left out (its
    ``X-KV-Conductor-Top-K-Omitted`` header). A server without the extension answers a
    plain dict (the whole answer)."""

    __slots__ = ("top_k_omitted",)

    def __init__(self, data: Mapping[str, Any], top_k_omitted: int) -> None:
        super().__init__(data)
        self.top_k_omitted = top_k_omitted


def omitted_header(value: str | None) -> int | None:
    """The ``X-KV-Conductor-Top-K-Omitted`` header's value as an int, ``None`` when absent
    or not a decimal count."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


def content_type_of(reply: Reply) -> str:
    return reply.content_type.strip().lower()


def decode_reply(reply: Reply) -> Any:
    """Body by Content-Type: msgpack when it is application/(x-)msgpack, else JSON."""
    if not reply.body:
        return None
    if is_msgpack_content_type(content_type_of(reply)):
        return msgspec.msgpack.decode(reply.body)
    return msgspec.json.decode(reply.body)


def server_error(reply: Reply) -> str:
    try:
        data = decode_reply(reply)
    except (msgspec.DecodeError, ValueError):
        data = None
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, str):
            return err
        if "errors" in data:  # /events partial failure
            return f"{data.get('status', 'error')}: {data.get('errors')}"
        return str(data)
    text = reply.text.strip()
    if len(text) > 500:
        text = text[:500] + "..."
    return text or "(empty body)"
