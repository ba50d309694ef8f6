"""The one query door: what every way into ``POST /query`` and ``POST /query_by_hash``
does once a request's body is here, written once.

Three callers reach a query route (:class:`QueryRoute`; :class:`~kvconductor.http.query.
QueryResource` is the one kind), each reading the request its own way:

* the HTTP protocol (:mod:`kvconductor.http.direct`, ``--query-path protocol``, the
  default), below ASGI, for a whole body with a ``Content-Length``;
* the ASGI front door (:class:`~kvconductor.http.front.FrontDoor`: every query the
  protocol hands over, all of them with ``--query-path asgi``), in one process over the
  conductor and in a ``--workers N`` worker over its shared view;
* Falcon's :meth:`QueryResource.on_post <kvconductor.http.query.QueryResource.on_post>`,
  when the app is not behind a front door (``create_app`` without ``fast_query``: the
  in-process tests' app; nothing the server builds). The routes stay in the Falcon app
  for the methods the front door hands to it (``OPTIONS``: the CORS preflight; any
  other method: 405 with ``Allow``), and so its ``POST`` is this door too, not a copy.

Here: the route's answer (a crash becomes a logged 500), the ``?freshness`` parameter
(:func:`answer_target`: a bad value is a 400), the 413 of a body over the limit
(:func:`too_large`) and the bookkeeping (:func:`account`): the route's latency
histogram, its error counter (answers >= 400 but 404, a miss), the log line (404 at
INFO, other refusals at WARN) and the ``X-KV-Conductor-Warning`` of a 200. The headers
and bytes are :mod:`kvconductor.http.framing`'s. So every door answers a request with
the same status, headers (but ``Date`` and the ``Server-Timing`` duration) and body,
byte for byte (``tests/test_query_doors.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from kvconductor.http.framing import query_headers
from kvconductor.http.responses import freshness_param, too_large_message
from kvconductor.wire import encode_error

log = logging.getLogger("kvconductor.http")

#: ``(status, headers, body)`` of an answer.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]

#: ``(status, body, message or None, omitted or None)`` of a route: ``omitted``, with
#: ``top_k``, the rows tied at the cut depth it left out (the ``X-KV-Conductor-Top-K-
#: Omitted`` header of a 200), else ``None``.
RouteAnswer = tuple[int, bytes, "str | None", "int | None"]


class _Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class _Counter(Protocol):
    def inc(self) -> None: ...


class QueryRoute(Protocol):
    """What the doors need of a query route (:class:`~kvconductor.http.query.
    QueryResource` is one)."""

    @property
    def seconds(self) -> _Observer:
        """``kvconductor_query_seconds{route}`` of the route."""
        ...

    @property
    def errors(self) -> _Counter:
        """``kvconductor_query_errors_total{route}``: answers >= 400 but 404 (a miss)."""
        ...

    @property
    def large_body_bytes(self) -> int:
        """Bodies longer than this are answered off the event loop (:meth:`respond`)."""
        ...

    def answer(self, body: bytes, msgpack: bool, *, fresh: bool = False) -> RouteAnswer:
        """``(status, body, message or None, omitted or None)``, on the calling thread;
        ``fresh``: the target's ``?freshness=true``."""
        ...

    async def respond(
        self, body: bytes | bytearray | list[bytes], msgpack: bool, fresh: bool = False
    ) -> RouteAnswer:
        """:meth:`answer`, off the event loop for a body over :attr:`large_body_bytes`
        (or given as its chunks, joined off the event loop). ``fresh``: the target's
        ``?freshness=true``."""
        ...


#: A query being answered, as its door read it: ``(route, path, msgpack, origin, t0,
#: date)``: the :class:`QueryRoute` and path it went to, its encoding, its ``Origin``
#: (``None``: no CORS headers), ``t0`` (the ``perf_counter`` when its head arrived) and
#: ``date``: its answer carries a ``Date`` of its own (a worker's: its uvicorn adds
#: none). PERF: a plain tuple (a ``NamedTuple``'s construction cost ~0.5 µs per query).
Query = tuple[QueryRoute, str, bool, "str | None", float, bool]


def account(res: QueryRoute, path: str, status: int, problem: str | None, t0: float) -> str | None:
    """Count and log an answer of ``res`` (``t0``: ``perf_counter`` when its head
    arrived); its warning (``problem`` of a 200), else ``None``."""
    res.seconds.observe(time.perf_counter() - t0)
    if status >= 400 and status != 404:
        res.errors.inc()
    if problem is None or status == 200:
        return problem
    if status == 404:
        log.info("query for unknown indexer path=%s error=%s", path, problem)
    else:
        log.warning("bad request method=POST path=%s status=%d error=%s", path, status, problem)
    return None


def conclude(
    q: Query, status: int, data: bytes, problem: str | None, omitted: int | None = None
) -> Answer:
    """The answer ``(status, headers, data)`` of ``q``, counted and logged
    (:func:`account`; ``problem`` and ``omitted``: see :meth:`QueryRoute.answer`)."""
    route, path, msgpack, origin, t0, date = q
    warning = account(route, path, status, problem, t0)
    return status, query_headers(data, msgpack, path, origin, t0, warning, date, omitted), data


def _internal_error(path: str, ex: Exception, msgpack: bool) -> RouteAnswer:
    log.exception("internal error method=POST path=%s", path)
    return 500, encode_error(f"internal error: {ex}", msgpack), None, None


def answer_now(q: Query, body: bytes, fresh: bool = False) -> Answer:
    """The answer to ``q`` whose whole ``body`` is here and at most the route's
    ``large_body_bytes`` long, on the calling thread (the protocol's,
    :mod:`kvconductor.http.direct`). ``fresh``: its target asked for the answer's
    freshness."""
    route, path, msgpack = q[:3]
    try:
        if fresh:
            status, data, problem, omitted = route.answer(body, msgpack, fresh=True)
        else:
            status, data, problem, omitted = route.answer(body, msgpack)
    except Exception as ex:
        status, data, problem, omitted = _internal_error(path, ex, msgpack)
    return conclude(q, status, data, problem, omitted)


async def answer_async(
    q: Query, body: bytes | bytearray | list[bytes], fresh: bool = False
) -> Answer:
    """:func:`answer_now` for a body of any size (over the route's ``large_body_bytes``,
    or as a list of chunks: off the event loop)."""
    route, path, msgpack = q[:3]
    try:
        status, data, problem, omitted = await route.respond(body, msgpack, fresh)
    except Exception as ex:
        status, data, problem, omitted = _internal_error(path, ex, msgpack)
    return conclude(q, status, data, problem, omitted)


async def answer_target(q: Query, body: bytes | bytearray, query_string: bytes) -> Answer:
    """:func:`answer_async` for a request whose target's query string is
    ``query_string`` (``?freshness``; an invalid value is a 400)."""
    try:
        fresh = freshness_param(query_string)
    except ValueError as ex:
        problem = str(ex)
        return conclude(q, 400, encode_error(problem, q[2]), problem)
    return await answer_async(q, body, fresh)


def too_large(q: Query, length: int | None, limit: int) -> Answer:
    """The 413 of ``q`` whose body is over ``limit`` bytes (``length``: its
    ``Content-Length``, ``None`` when it is chunked), logged and counted."""
    path, msgpack = q[1:3]
    log.warning(
        "request body too large method=POST path=%s limit=%d content_length=%s",
        path,
        limit,
        length,
    )
    return conclude(q, 413, encode_error(too_large_message(limit), msgpack), None)
