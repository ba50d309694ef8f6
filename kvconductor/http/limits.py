"""HTTP/1.1 connection limits on top of uvicorn's protocols.

uvicorn (the releases of :mod:`kvconductor.http.fence`) leaves three holes that a
client, broken or hostile, can use to take the service down:

* **no bound on a request head** with httptools (llhttp): a 256 MB header line
  is buffered whole and the request is served;
* **no deadline for a request**: its keep-alive timer only runs *between*
  requests, so a connection that never sends anything, sends its head one
  byte at a time, or sends a body shorter than its ``Content-Length`` stays
  open forever (1,100 such sockets exhaust a 1024-fd limit);
* ``limit_concurrency`` counts idle sockets too and answers 503 only after
  reading a head, so idle sockets are enough to make ``/health`` fail.

The protocols here (:func:`protocol_class`, a subclass of uvicorn's
``HttpToolsProtocol`` or ``H11Protocol``) add, per connection:

* a **head limit** (:attr:`HttpLimits.max_head_bytes`, request line plus
  headers): bytes are counted as they arrive, before the parser buffers them;
  past the limit the connection gets ``431`` ``{"error": ...}`` and is closed;
  the rest of the head is never read into memory;
* a **request deadline** (:attr:`HttpLimits.request_timeout`): armed when a
  connection opens and when the first byte of each further request arrives,
  cleared when the request (head and body) is complete. It is a time stamp, not
  a timer: one sweep per server, every :func:`sweep_interval` seconds (a quarter of
  the deadline, at most 1 s), closes what is past it. When it fires, a
  connection that has sent part of a request gets ``408`` ``{"error": ...}``;
  one that sent nothing is just closed. The request, if it reached the app,
  sees a disconnect and is not acted on;
* a **connection cap** (:attr:`HttpLimits.max_connections`, one
  :class:`ConnectionPool` per server): at the cap a new connection evicts the
  connection with no request in the app (idle keep-alive, or a head still
  arriving) that was active least recently; when every connection has a
  request in the app it is refused with ``503`` ``{"error": ...}``.

With httptools, each response is also written in one call (:class:`OneWrite`):
head and body together, one system call and, for a small answer, one TCP segment.

Between requests, idle keep-alive connections are closed after
:attr:`HttpLimits.keep_alive` seconds: by uvicorn's ``timeout_keep_alive`` timer after an
answer of the app, by the same sweep after a query the protocol answered itself
(:mod:`kvconductor.http.direct`; a time stamp, not a timer per request, so such a
connection is closed between ``keep_alive`` and one sweep interval later).

Refusals (431, 408, 503, and 400 for a request the parser rejects; bytes that do not
parse after complete requests get their 400 once those are answered; their bytes are
:func:`kvconductor.http.framing.refusal`'s) are sent
with ``Connection: close``, then the write side is shut and what the client
still sends is read and dropped for at most :data:`LINGER_SECS` before the
socket is closed, so the client can read the answer instead of getting a reset.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from kvconductor.http.framing import refusal, write

log = logging.getLogger("kvconductor.http")

#: Seconds a refused connection is drained (its input dropped) before it is closed.
LINGER_SECS = 1.0


@dataclass(frozen=True)
class HttpLimits:
    """Per-server HTTP limits (flags ``--max-header-kb``, ``--request-timeout-secs``,
    ``--keep-alive-secs``, ``--max-connections``)."""

    max_head_bytes: int = 64 * 1024
    request_timeout: float = 30.0
    keep_alive: float = 5.0
    max_connections: int = 1000

    def describe(self) -> str:
        return (
            f"max_header_bytes={self.max_head_bytes} request_timeout={self.request_timeout:g}s "
            f"keep_alive={self.keep_alive:g}s max_connections={self.max_connections}"
        )


class _Throttle:
    """At most one log line per ``interval`` seconds per kind; counts the rest."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def __call__(self, kind: str, level: int, msg: str, *args: Any) -> None:
        if not log.isEnabledFor(level):
            return
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        if skipped:
            msg += " (%d more like this in the last %gs)"
            args = (*args, skipped, self.interval)
        log.log(level, msg, *args)


_throttle = _Throttle()


class ConnectionPool:
    """The admitted connections of one server, their request deadlines and, for the
    cap, which of them may be evicted.

    PERF: nothing here runs a timer or moves a container per request. A connection
    keeps its own ``_started`` (loop time its request began, ``None`` between
    requests), ``_evictable`` (no request in the app) and ``_seen`` (a tick of
    :attr:`tick` taken when bytes arrive or its response completes: the LRU order).
    One sweep per server (:meth:`sweep`, every :func:`sweep_interval` seconds while any
    connection is open) closes the connections past their deadline; eviction at the cap
    picks the evictable member with the oldest ``_seen`` (a scan, only at the cap).
    """

    def __init__(self, limit: int, request_timeout: float = 30.0, keep_alive: float = 5.0) -> None:
        self.limit = limit
        self.request_timeout = request_timeout
        self.keep_alive = keep_alive
        self.interval = sweep_interval(request_timeout, keep_alive)
        self.members: set[Any] = set()
        self.tick = 0
        self.evicted = 0
        self.refused = 0
        self._sweeper: asyncio.TimerHandle | None = None

    def admit(self, conn: Any) -> bool:
        """Add ``conn``, evicting the least recently active evictable one at the cap."""
        if len(self.members) >= self.limit:
            victim = self._least_recent()
            if victim is None:
                self.refused += 1
                return False
            self.members.discard(victim)
            self.evicted += 1
            victim._evict(len(self.members) + 1, self.limit)
        self.members.add(conn)
        conn._evictable = True
        self.tick += 1
        conn._seen = self.tick
        if self._sweeper is None:
            self._schedule(conn.loop)
        return True

    def _least_recent(self) -> Any:
        victim = None
        for conn in self.members:
            if conn._evictable and (victim is None or conn._seen < victim._seen):
                victim = conn
        return victim

    def remove(self, conn: Any) -> None:
        self.members.discard(conn)
        conn._evictable = False

    # -- deadlines -------------------------------------------------------------------------
    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweeper = loop.call_later(self.interval, self.sweep, loop)

    def sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Time out every member whose request deadline has passed, close those idle
        past the keep-alive since a direct answer (``_idle_since``); runs again while
        any connection is open."""
        self._sweeper = None
        now = loop.time()
        timeout = self.request_timeout
        late = [c for c in self.members if c._started is not None and now - c._started >= timeout]
        for conn in late:
            conn._timed_out()
        keep = self.keep_alive
        idle = [
            c for c in self.members if c._idle_since is not None and now - c._idle_since >= keep
        ]
        for conn in idle:
            conn._idle_out()
        if self.members:
            self._schedule(loop)


def sweep_interval(request_timeout: float, keep_alive: float = 4.0) -> float:
    """Seconds between two deadline sweeps: a quarter of the deadline or of the
    keep-alive, at most 1 s (a request is cut between its deadline and that much later)."""
    return min(1.0, request_timeout / 4, keep_alive / 4)


def _pool(server_state: Any, limits: HttpLimits) -> ConnectionPool:
    pool = getattr(server_state, "kvc_pool", None)
    if pool is None:
        pool = server_state.kvc_pool = ConnectionPool(
            limits.max_connections, limits.request_timeout, limits.keep_alive
        )
    return pool


class _Limits:
    """The limits, as a mixin over uvicorn's ``HttpToolsProtocol`` / ``H11Protocol``.

    Hooks for the subclasses: :meth:`_head_complete` (a request head was
    parsed and handed to the app), :meth:`_request_complete` (its body is
    complete too) and :meth:`_in_app` (a request is in the app).
    """

    limits: HttpLimits = HttpLimits()

    # -- connection -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._started: float | None = None  # loop time the request began (its deadline)
        self._idle_since: float | None = None  # loop time of a direct answer, while idle
        self._seen = 0  # the pool's tick at its last activity (LRU order at the cap)
        self._evictable = False  # no request in the app
        self._linger: asyncio.TimerHandle | None = None
        self._rejected = False
        self._head_open = True  # waiting for (the rest of) a request head
        self._head_bytes = 0  # bytes of that head so far
        #: The 400 owed once the complete requests before bytes that do not parse are
        #: answered (:meth:`send_400_response`); ``None``: none.
        self._bad_tail: str | None = None
        self._pool = _pool(self.server_state, self.limits)  # type: ignore[attr-defined]
        if not self._pool.admit(self):
            _throttle(
                "refused",
                logging.WARNING,
                "connection refused: %d connections open, each with a request in "
                "progress (--max-connections %d) client=%s",
                len(self._pool.members),
                self._pool.limit,
                _peer(self),
            )
            self._reject(
                503, f"too many open connections (limit {self._pool.limit}); try again later"
            )
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._pool.remove(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._rejected or self._bad_tail is not None:
            return  # draining before close, or past bytes that do not parse
        if not self._head_open:
            return self._feed(data)
        if self._started is None:
            self._arm()  # first bytes of the next request on a keep-alive connection
        pool = self._pool
        pool.tick += 1
        self._seen = pool.tick
        # Feed at most the rest of the head budget; if the head is not complete within
        # it, the request is refused without the parser ever buffering more.
        if len(data) <= self.limits.max_head_bytes - self._head_bytes:  # PERF: one piece
            self._head_bytes += len(data)
            return self._feed(data)
        while data and self._head_open:
            budget = self.limits.max_head_bytes - self._head_bytes
            if budget <= 0:
                return self._head_too_large()
            piece, data = (data, b"") if len(data) <= budget else (data[:budget], data[budget:])
            self._head_bytes += len(piece)
            self._feed(piece)
            if self._rejected or self.transport.is_closing():  # type: ignore[attr-defined]
                return
        if data:
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]

    # -- request progress (called by the subclasses) -----------------------------------------
    def _head_complete(self) -> None:
        self._head_open = False
        self._evictable = False

    def _request_complete(self) -> None:
        self._started = None
        self._head_open = True
        self._head_bytes = 0

    def _response_complete(self) -> None:
        if not self._rejected and not self._in_app():
            pool = self._pool
            if self in pool.members:
                self._evictable = True
                pool.tick += 1
                self._seen = pool.tick

    def _in_app(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is not None and not cycle.response_complete

    # -- deadline (checked by the pool's sweep) -----------------------------------------------
    def _arm(self) -> None:
        self._started = self.loop.time()  # type: ignore[attr-defined]
        self._idle_since = None

    def _disarm(self) -> None:
        self._started = None
        self._idle_since = None

    def _idle_out(self) -> None:
        """Idle for the keep-alive since a direct answer (the sweep): close, as uvicorn's
        keep-alive timer does."""
        self._idle_since = None
        if self._started is None:
            self._close_now()

    def _timed_out(self) -> None:
        self._started = None
        if self._rejected or self.transport.is_closing():  # type: ignore[attr-defined]
            return
        secs = self.limits.request_timeout
        if self._head_open and self._head_bytes == 0:
            # Nothing of a request arrived: just close (what a client's pool expects).
            log.debug(
                "closing connection that sent no request within %gs client=%s", secs, _peer(self)
            )
            self._close_now()
            return
        part = "head" if self._head_open else "body"
        _throttle(
            "timeout",
            logging.WARNING,
            "request timeout: request %s not complete within %gs, closing connection client=%s",
            part,
            secs,
            _peer(self),
        )
        self._reject(
            408,
            f"request not complete within {secs:g} s (request {part} "
            "incomplete); connection closed",
        )

    # -- refusals -----------------------------------------------------------------------------
    def _head_too_large(self) -> None:
        _throttle(
            "head",
            logging.WARNING,
            "request head too large: over %d bytes (--max-header-kb), answering 431 client=%s",
            self.limits.max_head_bytes,
            _peer(self),
        )
        self._reject(
            431, f"request line and headers exceed the limit of {self.limits.max_head_bytes} bytes"
        )

    def _can_answer(self) -> bool:
        """True when a refusal may be written: nothing else is being answered and the
        request being refused has not been answered yet."""
        if getattr(self, "pipeline", None):
            return False  # an earlier pipelined response is still pending
        cycle = self.cycle  # type: ignore[attr-defined]
        if self._head_open:  # the refused request has no cycle yet; the last one must be done
            return cycle is None or cycle.response_complete
        return cycle is not None and not cycle.response_started

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` (when nothing else is being answered), shut, drain, close."""
        self._rejected = True
        self._disarm()
        self._pool.remove(self)
        transport = self.transport  # type: ignore[attr-defined]
        answer = self._can_answer()
        cycle = self.cycle  # type: ignore[attr-defined]
        if cycle is not None and not cycle.response_complete:
            # The app's request will never complete: it reads a disconnect, sends nothing.
            cycle.disconnected = True
            cycle.message_event.set()
        if not answer:
            self._close_now()
            return
        transport.write(refusal(status, message))
        if transport.can_write_eof():
            try:
                transport.write_eof()
                transport.resume_reading()
            except (OSError, RuntimeError):
                self._close_now()
                return
            self._linger = self.loop.call_later(LINGER_SECS, self._close_now)  # type: ignore
        else:
            transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse, as ``{"error": ...}``.

        Bytes that do not parse *after* complete requests still being answered (they
        came in the same packet, or while the app worked): those are answered first, in
        order, then the 400 (:meth:`_answered`), as when the protocol answered them
        itself (:mod:`kvconductor.http.direct`). Nothing more is read meanwhile. Bytes
        that do not parse inside a request (its body) refuse it at once."""
        message = f"invalid HTTP request: {msg}"
        if self._head_open and not self._rejected and self._answers_pending():
            self._bad_tail = message
            self._disarm()
            return
        self._reject(400, message)

    def _answers_pending(self) -> bool:
        """Complete requests not answered yet (one in the app, others in line)."""
        if getattr(self, "pipeline", None):
            return True
        return self._in_app()

    def _answered(self) -> None:
        """A response is complete: the 400 owed past the last complete request goes out
        once every one before it is answered."""
        message = self._bad_tail
        if message is None or self._answers_pending():
            return
        self._bad_tail = None
        if self.transport.is_closing():  # type: ignore[attr-defined]
            return  # the answer closed the connection: nothing more to say
        self._reject(400, message)

    def _evict(self, count: int, limit: int) -> None:
        _throttle(
            "evict",
            logging.WARNING,
            "evicted idle connection: %d connections open (--max-connections %d) client=%s",
            count,
            limit,
            _peer(self),
        )
        self._rejected = True
        self._disarm()
        self._close_now()

    def _close_now(self) -> None:
        self._linger = None
        transport = self.transport  # type: ignore[attr-defined]
        if not transport.is_closing():
            transport.close()


def _peer(conn: Any) -> str:
    client = getattr(conn, "client", None)
    if not client:
        return "-"
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class OneWrite:
    """The transport one request's response is written through: the response head
    waits for the first body bytes and goes out with them, so a response is one
    ``write`` (one system call, one TCP segment for a small answer) instead of two.

    uvicorn writes the head when the app sends ``http.response.start`` and the body
    when it sends ``http.response.body``; an ASGI app cannot send both at once. A
    ``100 Continue`` (written before the response starts) passes at once; a response
    without body bytes (``HEAD``) is flushed when it completes (:meth:`flush`); closing
    flushes first.
    """

    __slots__ = ("cycle", "head", "transport")

    def __init__(self, transport: Any, cycle: Any) -> None:
        self.transport = transport
        self.cycle = cycle  # None once the head was taken
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self.head
        if head is not None:
            self.head = None
            return write(self.transport, head, data)
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.cycle = None
            self.head = data  # the response head: wait for the body
            return
        self.transport.write(data)

    def flush(self) -> None:
        head = self.head
        if head is not None:
            self.head = None
            self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())


def _httptools_class() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(_Limits, HttpToolsProtocol):
        """``HttpToolsProtocol`` with kv-conductor's head limit, deadline and cap, and
        each response written in one call (:class:`OneWrite`)."""

        def on_headers_complete(self) -> None:
            self._head_complete()
            super().on_headers_complete()
            cycle = self.cycle
            # not a pipelined request (queued, answered later): its cycle writes as is
            if cycle is not None and not self.pipeline and cycle.transport is self.transport:
                cycle.transport = cast(asyncio.Transport, OneWrite(self.transport, cycle))

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._request_complete()

        def on_response_complete(self) -> None:
            transport = self.cycle.transport if self.cycle is not None else None
            if type(transport) is OneWrite:
                transport.flush()
            super().on_response_complete()
            self._response_complete()
            self._answered()

    return LimitedHttpToolsProtocol


def _h11_class() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    done = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    class LimitedH11Protocol(_Limits, H11Protocol):
        """``H11Protocol`` with kv-conductor's head limit, deadline and cap.

        h11 has no parser callbacks: progress is read from the connection's
        state after each batch of events (a new ``cycle`` is a new request head;
        ``their_state`` DONE means its body is complete).
        """

        _seen: Any = None
        _body_done = True

        def _feed(self, data: bytes) -> None:
            super()._feed(data)
            self._sync()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request
            self._sync()
            self._response_complete()
            self._answered()

        def _sync(self) -> None:
            if self._rejected:
                return
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen:
                self._seen = cycle
                self._body_done = False
                self._head_complete()
            if cycle is not None and not self._body_done and self.conn.their_state in done:
                self._body_done = True
                self._request_complete()

    return LimitedH11Protocol


def protocol_class(limits: HttpLimits, http: str = "httptools", direct: bool = True) -> type:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits`` (with
    httptools and ``direct``, small queries are answered by the protocol itself:
    :mod:`kvconductor.http.direct`; ``direct=False`` is ``--query-path asgi``, every
    request goes to the app).

    ``http``: ``"httptools"`` or ``"h11"``. With h11 set the Config's
    ``h11_max_incomplete_event_size`` to :func:`h11_buffer_limit` as well.
    """
    if http == "httptools" and direct:
        from kvconductor.http.direct import DirectQueries

        bases: tuple[type, ...] = (DirectQueries, _httptools_class())
    elif http == "httptools":
        bases = (_httptools_class(),)
    else:
        bases = (_h11_class(),)
    return type(bases[-1].__name__, bases, {"limits": limits, "__module__": __name__})


def h11_buffer_limit(limits: HttpLimits) -> int:
    """h11's own head-buffer bound: just above ours, so ours answers first (431 JSON)."""
    return limits.max_head_bytes + 1024
