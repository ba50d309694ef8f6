"""Query answers written by the HTTP protocol itself, below ASGI.

A ``POST /query`` or ``POST /query_by_hash`` with a ``Content-Length`` (at most
``--max-body-mb``) is answered by the connection's protocol: :class:`DirectQueries`
collects the body from the parser's callbacks, and once it is complete has the one
query door answer it (:mod:`kvconductor.http.querydoor`, over the routes of the
:class:`~kvconductor.http.front.FrontDoor` the server serves: the same resource,
statuses, bodies, headers, metrics and log lines as its ASGI path) and writes the whole
response with one ``write`` (:func:`~kvconductor.http.framing.write_response`). A body
of at most the route's ``large_body_bytes`` is answered at once, on the event loop
(:func:`~kvconductor.http.querydoor.answer_now`); a larger one off it, on the query
threads (:func:`~kvconductor.http.querydoor.answer_async`), while the connection waits
in order (:class:`_InFlight`). No ASGI scope, task, ``receive``/``send`` messages,
header validation or body copies per request: that machinery is most of what uvicorn
costs per small request, more than the query itself, and for a 4 MB body its copies and
per-chunk wake-ups cost more than the match (docs/performance.md, "The request path
against the HTTP stack's floor").

Everything else goes to the app as before, and so does a query that could not be
answered in order: one arriving while an earlier request of the connection is still
being answered (pipelining) or while the transport's write buffer is full, a chunked
body, one over the body limit (the app's 413), ``Expect: 100-continue``, HTTP/1.0, an
upgrade, a target with percent-escapes or a query string (but the ``freshness``
parameter alone, :data:`FRESHNESS_TARGETS`), and every request of a server
with uvicorn's access log on (``--log-level debug``), a ``root_path`` or
``limit_concurrency``. The request limits (:mod:`kvconductor.http.limits`) apply to
both paths: the head limit, the deadline (a direct query whose body stops arriving gets
its ``408``) and the connection cap.

Only with httptools: the h11 protocol has no parser callbacks to hook.
"""

from __future__ import annotations

import time
from typing import Any

from kvconductor.http.framing import write_response
from kvconductor.http.front import FrontDoor, scan_headers
from kvconductor.http.querydoor import Query, QueryRoute, answer_async, answer_now

#: The query strings answered here, and whether each asks for the answer's freshness
#: (docs/api.md, "freshness"; :func:`~kvconductor.http.responses.freshness_param` reads
#: the same spellings on the app's path). Any other query string goes to the app.
FRESHNESS_TARGETS = {
    b"?freshness=true": True,
    b"?freshness=1": True,
    b"?freshness": True,
    b"?freshness=false": False,
    b"?freshness=0": False,
}


class _InFlight:
    """uvicorn's current cycle while a large query is answered off the event loop: what
    the protocols read of a cycle (uvicorn's connection loss and shutdown, the limits'
    refusals set ``disconnected`` and ``keep_alive``)."""

    __slots__ = ("disconnected", "keep_alive", "message_event", "response_complete")

    response_started = True  # nothing else may be written before its answer
    transport = None

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_complete = False
        self.message_event = _NoEvent()


class _NoEvent:
    """``cycle.message_event`` of :class:`_InFlight`: nobody waits on it."""

    __slots__ = ()

    def set(self) -> None:
        pass


class DirectQueries:
    """Mixin over kv-conductor's httptools protocol (``LimitedHttpToolsProtocol`` of
    :mod:`kvconductor.http.limits`): small queries answered by the protocol (module doc).

    Runs on the event loop's thread, like the protocol it extends; the index is read as
    any query route reads it (the resource's own rules)."""

    _front: FrontDoor | None = None
    #: The query being answered here, while its body arrives; ``None`` otherwise.
    _direct: Query | None = None
    _fresh = False  # its target asked for the answer's freshness
    _direct_keep_alive = True
    _length = 0  # the Content-Length of that query

    # The attributes of the protocols this mixin extends (uvicorn's, kv-conductor's).
    app: Any
    access_log: bool
    root_path: str
    limit_concurrency: int | None
    parser: Any
    transport: Any
    flow: Any
    cycle: Any
    pipeline: Any
    server_state: Any
    loop: Any
    url: bytes
    headers: list[tuple[bytes, bytes]]
    expect_100_continue: bool
    scope: Any
    _idle_since: float | None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        app = self.app
        while getattr(app, "transparent", False):  # a wrapper with nothing to do here
            app = app.app
        if (
            isinstance(app, FrontDoor)
            and not self.access_log
            and not self.root_path
            and self.limit_concurrency is None
        ):
            self._front = app
            self._targets: dict[bytes, tuple[str, QueryRoute, bool]] = {}
            for p, r in app.routes.items():
                raw = p.encode("ascii")
                self._targets[raw] = (p, r, False)
                for query, fresh in FRESHNESS_TARGETS.items():
                    self._targets[raw + query] = (p, r, fresh)
            self._chunks: list[bytes] = []

    # -- parser callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._front is None:
            return super().on_message_begin()  # type: ignore[misc]
        # PERF: the ASGI scope is built only for a request that goes to the app
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None

    def on_headers_complete(self) -> None:
        if self._front is not None:
            hit = self._targets.get(self.url)
            if hit is not None and self._start(*hit):
                return
            self._build_scope()
        super().on_headers_complete()  # type: ignore[misc]

    def on_body(self, body: bytes) -> None:
        if self._direct is not None:
            self._chunks.append(body)
        else:
            super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        direct = self._direct
        if direct is None:
            return super().on_message_complete()  # type: ignore[misc]
        self._direct = None
        chunks = self._chunks
        self._chunks = []
        self._request_complete()  # type: ignore[attr-defined]
        if self._length > direct[0].large_body_bytes:
            # PERF: the chunks are joined on a query thread (bytes.join lets go of the
            # GIL), not in one ~0.5 ms copy of 4 MB on the event loop
            return self._answer_later(direct, chunks)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        status, headers, data = answer_now(direct, body, self._fresh)
        keep_alive = self._direct_keep_alive
        default_headers = self.server_state.default_headers
        write_response(self.transport, status, default_headers, headers, data, keep_alive)
        self.server_state.total_requests += 1
        if not keep_alive:
            self.transport.close()
            return
        # PERF: the keep-alive is a time stamp the pool's sweep reads, not uvicorn's
        # timer armed and cancelled per request (3-4 µs with uvloop)
        self._idle_since = self.loop.time()
        self._response_complete()  # type: ignore[attr-defined]

    def _answer_later(self, direct: Query, body: list[bytes]) -> None:
        """A large body: answered off the event loop (the route's ``respond``), written
        when done. Meanwhile :class:`_InFlight` stands as uvicorn's current cycle, so a
        request arriving behind it waits in uvicorn's pipeline, in order."""
        cycle = _InFlight(self._direct_keep_alive)
        self.cycle = cycle
        task = self.loop.create_task(self._respond(direct, self._fresh, body, cycle))
        tasks = self.server_state.tasks  # a graceful shutdown waits for them
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _respond(
        self, direct: Query, fresh: bool, body: list[bytes], cycle: _InFlight
    ) -> None:
        status, headers, data = await answer_async(direct, body, fresh)
        cycle.response_complete = True
        if cycle.disconnected:
            return  # the connection is gone (closed, refused or shut): nobody to answer
        default_headers = self.server_state.default_headers
        write_response(self.transport, status, default_headers, headers, data, cycle.keep_alive)
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()  # type: ignore[attr-defined]  # uvicorn's: next in line

    # -- the decision -------------------------------------------------------------------------
    def _start(self, path: str, route: QueryRoute, fresh: bool) -> bool:
        """Take the request whose head just arrived here, if it can be answered here."""
        parser = self.parser
        if (
            self.expect_100_continue
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or parser.should_upgrade()
        ):
            return False
        cycle = self.cycle
        if (
            (cycle is not None and not cycle.response_complete)
            or self.pipeline
            or self.flow.write_paused
            or self.transport.is_closing()
        ):
            return False  # answered in order, by the app
        front = self._front
        assert front is not None
        msgpack, length, origin, chunked = scan_headers(self.headers)
        if chunked or length is None or length > front.max_body_bytes:
            return False  # a 413 or a body without a length: the app's
        self._head_complete()  # type: ignore[attr-defined]
        self._direct_keep_alive = bool(parser.should_keep_alive())
        self._length = length
        self._direct = (route, path, msgpack, origin, time.perf_counter(), front.date)
        self._fresh = fresh
        return True

    def _build_scope(self) -> None:
        """uvicorn's scope of the request whose head just arrived (its own
        ``on_message_begin``, which :meth:`on_message_begin` deferred)."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()  # type: ignore[misc]
        self.url = url
        self.headers = headers
        self.scope["headers"] = headers
        self.expect_100_continue = expect

    # -- the rest of the connection's life ----------------------------------------------------
    def shutdown(self) -> None:
        if self._direct is not None:
            self._direct_keep_alive = False  # answer the query, then close
            return
        super().shutdown()  # type: ignore[misc]

    def _can_answer(self) -> bool:
        if self._direct is not None:
            return True  # a refusal (408) answers the query being received
        return bool(super()._can_answer())  # type: ignore[misc]

    def _reject(self, status: int, message: str) -> None:
        super()._reject(status, message)  # type: ignore[misc]
        self._direct = None
