"""The single event-ingest thread: the only writer of every index.

It owns every ZeroMQ socket (SUB subscribers, replay DEALERs) and waits for them
together with a wake-up pipe in one :mod:`selectors` selector (epoll on Linux). Other threads
hand it work with :meth:`IngestThread.submit` (returns a
:class:`concurrent.futures.Future`) or :meth:`IngestThread.run` (awaitable);
the work runs on this thread, in submission order, so index mutations never
race each other.

**Threading: sockets registered here are created, used and closed on the
ingest thread only. ``submit``/``run``/``stop`` may be called from any
thread; ``add_socket``/``remove_socket``/``call_later`` only from the ingest
thread (i.e. from submitted work or socket handlers).** When nothing is due the
wait blocks without a timeout, so an idle ingest thread uses no CPU.

PERF: a wake-up costs O(the sockets that have something), not O(every socket). A
:class:`zmq.Poller` asks libzmq for every socket's state on every wake-up (several
microseconds each: with thousands of sources that was most of a registration's time,
docs/performance.md). Here the selector watches each ZeroMQ socket's ``ZMQ_FD``, which
becomes readable when the socket has news to process, and only the sockets it reports,
the sockets added since the last round and those whose handler ran in the last round
have their ``ZMQ_EVENTS`` read. That fd is edge-like: a ``recv``/``send`` on the
socket may take in news without it ever becoming readable again. This is why **a
registered ZeroMQ socket may be used only by its own handler** (which the loop
checks again after every call, as libzmq asks), and before ``add_socket``. A handler
that leaves messages queued (a drain limit, for fairness) is called again in the next
round, as with a poller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import os
import queue
import selectors
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import zmq

log = logging.getLogger("kvconductor.ingest")


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


#: What the ingest poller watches: a ZeroMQ socket, a file descriptor or an object with
#: ``fileno()``.
Pollable = zmq.Socket | int | _HasFileno
_S = TypeVar("_S", bound=Pollable)


class _Key(Protocol):
    """What :meth:`IngestThread._ready` reads of a ``selectors.SelectorKey``."""

    @property
    def data(self) -> object: ...


_T = TypeVar("_T")
if TYPE_CHECKING:
    from typing_extensions import TypeVarTuple, Unpack

    _Ts = TypeVarTuple("_Ts")


def lower_priority(nice: int) -> int | None:
    """Add ``nice`` to the calling thread's nice value (Linux: each thread has its own;
    elsewhere nothing is changed) and return the value it has then; None when nothing was
    changed (not Linux, or refused). Lowering one's own priority needs no privilege; a
    refusal (a sandbox) is logged and changes nothing.

    PERF: the one-process server's ingest thread runs at nice 5
    (:data:`kvconductor.serve.tuning.INGEST_NICE`). When it and the event loop answering
    queries both want a CPU that other processes share, the scheduler gives the event loop
    about three times its share (CFS weights 1024 against 335), so a query waits less for
    a CPU; a quiet event loop leaves the ingest thread all it needs. At 1,024 round-robin
    engines and saturation the queries' p99 went to a median of 0.86 ms from 1.21 ms, at
    more ops/s and the same event-to-visible times (docs/performance.md, "The ingest
    thread's priority, and the floor with a SUB per engine")."""
    if not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid) + nice
        os.setpriority(os.PRIO_PROCESS, tid, now)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as ex:
        log.warning(
            "%s: could not lower its priority by %d: %s", threading.current_thread().name, nice, ex
        )
        return None


class IngestThread:
    """One thread: ZMQ sockets + submitted commands + timers."""

    def __init__(
        self, context: zmq.Context | None = None, name: str = "kv-ingest", nice: int = 0
    ) -> None:
        """``nice``: added to the thread's own nice value when it starts (Linux, where a
        thread has one of its own; 0: as the process), see :func:`lower_priority`."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.ident: int | None = None
        self.nice = nice
        self.ctx = context or zmq.Context.instance()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        #: Guards ``_wake_w``: once the thread closed it (-1), the number may belong to
        #: another file of the process, so nothing may write to it any more.
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._handlers: dict[Pollable, Callable[[Pollable], None]] = {}
        #: What each socket is registered under in the selector (its ``ZMQ_FD``, or the
        #: fd/object given), and its registration number: a round calls the handlers in
        #: the order the sockets were added, as :class:`zmq.Poller` does.
        self._selector_key: dict[Pollable, int | _HasFileno] = {}
        self._order: dict[Pollable, int] = {}
        self._added = itertools.count()
        #: ZeroMQ sockets whose ``ZMQ_EVENTS`` the next round reads whatever the
        #: selector says: just added, or their handler ran (module docstring).
        self._recheck: set[zmq.Socket] = set()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._stopped = threading.Event()
        #: Exceptions raised by handlers/timers (logged, counted, never fatal).
        self.errors = 0

    # -- any thread ---------------------------------------------------------------
    def submit(
        self, fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts]
    ) -> concurrent.futures.Future[_T]:
        """Run ``fn(*args)`` on the ingest thread; the future gets its result."""
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self._stopping:
            fut.set_exception(RuntimeError("ingest thread is stopped"))
            return fut
        self._cmds.put((fn, args, fut))
        self._wake()
        return fut

    async def run(self, fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts]) -> _T:
        """Await ``fn(*args)`` executed on the ingest thread."""
        if self.on_thread():
            return fn(*args)
        return await asyncio.wrap_future(self.submit(fn, *args))

    def call(
        self, fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts], timeout: float | None = None
    ) -> _T:
        """Blocking variant of :meth:`run` for plain threads (and tests)."""
        if self.on_thread():
            return fn(*args)
        return self.submit(fn, *args).result(timeout)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def on_thread(self) -> bool:
        """True when called from the ingest thread itself."""
        return threading.get_ident() == self.ident

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask the thread to finish its queue, close its sockets and exit."""
        self._stopping = True
        self._wake()
        if self._thread.is_alive() and not self.on_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # the thread has exited
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # NOTE: the pipe is full, so a wake-up is already pending.

    # -- ingest thread only ----------------------------------------------------------
    def add_socket(self, sock: _S, handler: Callable[[_S], None]) -> None:
        """Poll ``sock`` (zmq socket or fd) for input and call ``handler(sock)``.

        From then on until :meth:`remove_socket`, only ``handler`` may use a ZeroMQ
        ``sock`` (module docstring)."""
        if sock in self._handlers:
            self._handlers[sock] = cast("Callable[[Pollable], None]", handler)
            return
        key = cast(int, sock.getsockopt(zmq.FD)) if isinstance(sock, zmq.Socket) else sock
        self._selector.register(key, selectors.EVENT_READ, sock)
        self._handlers[sock] = cast("Callable[[Pollable], None]", handler)
        self._selector_key[sock] = key
        self._order[sock] = next(self._added)
        if isinstance(sock, zmq.Socket):
            self._recheck.add(sock)  # it may hold messages already

    def remove_socket(self, sock: Pollable) -> None:
        """Stop polling ``sock`` (the caller closes it)."""
        if self._handlers.pop(sock, None) is not None:
            self._selector.unregister(self._selector_key.pop(sock))
            del self._order[sock]
            self._recheck.discard(sock)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on this thread after ``delay`` seconds."""
        heapq.heappush(self._timers, (time.monotonic() + max(0.0, delay), next(self._seq), fn))

    # -- loop ------------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                fn, args, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as ex:
                fut.set_exception(ex)

    def pause_point(self) -> None:
        """Between two messages: give the GIL and the CPU to a thread that waits for
        them (the event loop answering queries), after every message.

        PERF: the ingest keeps the GIL through short batches (``kvconductor._recv``); a
        voluntary release is taken back at once, so a waiting event loop would wait for
        the switch interval, and longer when the OS deschedules the ingest thread while it
        holds the GIL. ``os.sched_yield`` releases the GIL and lets the woken thread run;
        with nobody waiting it costs one system call. After every message rather than
        every 0.3 ms of them: at 1,024 round-robin engines and saturation the queries'
        p99 went to a median of 1.12 ms from 1.46 ms, at the same ops/s and ingest rate
        (docs/performance.md, "The ingest thread's yield, after every message")."""
        os.sched_yield()

    def _run_timers(self) -> float | None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            self._guard(fn)
            now = time.monotonic()
        if not self._timers:
            return None
        return max(0.0, self._timers[0][0] - now)

    def _guard(self, fn: Callable[[Unpack[_Ts]], None], *args: Unpack[_Ts]) -> None:
        try:
            fn(*args)
        except Exception:
            self.errors += 1
            log.exception("ingest handler failed")

    def _loop(self) -> None:
        self.ident = threading.get_ident()
        if self.nice:
            lower_priority(self.nice)
        while True:
            self._drain_commands()
            if self._stopping:
                break
            wait = self._run_timers()
            timeout_ms = None if wait is None else max(1, int(wait * 1000))
            if self._recheck:
                timeout_ms = 0
            try:
                events = self._selector.select(None if timeout_ms is None else timeout_ms / 1000)
            except OSError as ex:
                self.errors += 1
                log.warning("ingest poll failed: %s", ex)
                continue
            try:
                ready = self._ready(events)
            except zmq.ZMQError as ex:  # the context was terminated
                if ex.errno == zmq.ETERM:
                    break
                raise
            for sock in ready:
                handler = self._handlers.get(sock)
                if handler is not None:
                    self._guard(handler, sock)
                    if isinstance(sock, zmq.Socket) and sock in self._handlers:
                        self._recheck.add(sock)  # libzmq: read ZMQ_EVENTS after a recv
        self._shutdown()

    def _ready(self, events: Sequence[tuple[_Key, int]]) -> list[Pollable]:
        """The sockets whose handlers this round calls, in the order they were added: the
        plain fds the selector reports, and the ZeroMQ sockets it reports or that are to be
        checked again whose ``ZMQ_EVENTS`` has ``POLLIN``."""
        check, self._recheck = self._recheck, set()
        plain: list[Pollable] = []
        for key, _ in events:
            sock = key.data
            if sock is None:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif isinstance(sock, zmq.Socket):
                check.add(sock)
            else:
                plain.append(cast("Pollable", sock))
        ready = plain
        for sock in check:
            if sock not in self._handlers:
                continue
            try:
                has_input = cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN
            except zmq.ZMQError as ex:
                if ex.errno == zmq.ETERM:
                    raise
                self.errors += 1  # e.g. closed by someone else: not polled any more
                log.warning("ingest poll failed: %s", ex)
                continue
            if has_input:
                ready.append(sock)
        if len(ready) > 1:
            ready.sort(key=self._order.__getitem__)
        return ready

    def _shutdown(self) -> None:
        for sock in list(self._handlers):
            self.remove_socket(sock)
            if hasattr(sock, "close"):
                try:
                    sock.close(linger=0)
                except Exception:
                    pass
        # Fail whatever was submitted after the stop request.
        while True:
            try:
                _, _, fut = self._cmds.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("ingest thread is stopped"))
        self._selector.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._stopped.set()
