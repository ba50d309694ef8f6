"""The single event-ingest thread: the only writer of every index.

It owns every ZeroMQ socket (SUB subscribers, replay DEALERs) and polls them
together with a wake-up pipe through one :class:`zmq.Poller`. Other threads
hand it work with :meth:`IngestThread.submit` (returns a
:class:`concurrent.futures.Future`) or :meth:`IngestThread.run` (awaitable);
the work runs on this thread, in submission order, so index mutations never
race each other.

**Threading: sockets registered here are created, used and closed on the
ingest thread only. ``submit``/``run``/``stop`` may be called from any
thread; ``add_socket``/``remove_socket``/``call_later`` only from the ingest
thread (i.e. from submitted work or socket handlers).** When nothing is due the
poll blocks without a timeout, so an idle ingest thread uses no CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("kvconductor.ingest")


class IngestThread:
    """One thread: ZMQ sockets + submitted commands + timers."""

    def __init__(self, context: zmq.Context | None = None, name: str = "kv-ingest") -> None:
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.ident: int | None = None
        self.ctx = context or zmq.Context.instance()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        #: Guards ``_wake_w``: once the thread closed it (-1), the number may belong to
        #: another file of the process, so nothing may write to it any more.
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._handlers: dict[Any, Callable[[Any], None]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._stopped = threading.Event()
        #: Exceptions raised by handlers/timers (logged, counted, never fatal).
        self.errors = 0

    # -- any thread ---------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the ingest thread; the future gets its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            fut.set_exception(RuntimeError("ingest thread is stopped"))
            return fut
        self._cmds.put((fn, args, fut))
        self._wake()
        return fut

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Await ``fn(*args)`` executed on the ingest thread."""
        if self.on_thread():
            return fn(*args)
        return await asyncio.wrap_future(self.submit(fn, *args))

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
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
    def add_socket(self, sock: Any, handler: Callable[[Any], None]) -> None:
        """Poll ``sock`` (zmq socket or fd) for input and call ``handler(sock)``."""
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: Any) -> None:
        """Stop polling ``sock`` (the caller closes it)."""
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

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

    def _run_timers(self) -> float | None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            self._guard(fn)
            now = time.monotonic()
        if not self._timers:
            return None
        return max(0.0, self._timers[0][0] - now)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            self.errors += 1
            log.exception("ingest handler failed")

    def _loop(self) -> None:
        self.ident = threading.get_ident()
        while True:
            self._drain_commands()
            if self._stopping:
                break
            wait = self._run_timers()
            timeout_ms = None if wait is None else max(1, int(wait * 1000))
            try:
                events = self._poller.poll(timeout_ms)
            except zmq.ZMQError as ex:
                if ex.errno == zmq.ETERM:
                    break
                self.errors += 1
                log.warning("ingest poll failed: %s", ex)
                continue
            for sock, _ in events:
                if sock == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                handler = self._handlers.get(sock)
                if handler is not None:
                    self._guard(handler, sock)
        self._shutdown()

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
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._stopped.set()
