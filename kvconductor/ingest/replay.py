"""The vLLM/SGLang replay client: one DEALER session on the ingest thread.

Protocol (docs/events.md, "Sequence numbers, replay and loss"): send
``[b"", start_seq as 8-byte big-endian]`` to the publisher's ROUTER; it answers
every buffered batch with ``seq >= start``, each as ``[b"", seq, payload]``
(vLLM <= 0.25, SGLang <= 0.5.21) or ``[b"", topic, seq, payload]`` (vLLM >= 0.26,
SGLang >= 0.5.22; told apart by the frame count), then an end marker whose seq
frame is ``ff`` x 8.

The session never blocks: its DEALER is polled by the ingest thread like any
SUB socket, and an inactivity timer (``IngestThread.call_later``) ends it when
the ROUTER goes quiet (unreachable endpoint, lost tail under the ROUTER's send
HWM, ...); an overall deadline ends a ROUTER that trickles (one batch every few
seconds would otherwise hold the source in ``replaying`` forever). Either ends
the session with ``ok=False``, which the subscription treats as a loss. A fresh
DEALER per session means a late reply to an abandoned request can never be
mistaken for the current one. What to do with the
batches (ordering against the live stream, loss detection) is the
subscription's business: see :mod:`kvconductor.ingest.subscriber`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq

import kvconductor
from kvconductor.ingest.thread import IngestThread

try:
    from kvconductor import _recv
except ImportError:  # no compiled modules: the twins (KVCONDUCTOR_IMPL=py)
    _recv = None  # type: ignore[assignment]

log = logging.getLogger("kvconductor.ingest")

END_MARKER = b"\xff" * 8
#: Messages handled per readiness callback, so one busy replay cannot starve the
#: other sockets of the ingest thread.
DRAIN_LIMIT = 512
#: The compiled receive of :func:`drain` (None: pyzmq's ``recv_multipart``).
_recv_messages = (
    _recv.recv_messages
    if _recv is not None and _recv.AVAILABLE and kvconductor.IMPL != "py"
    else None
)


def warn_slow_receive() -> None:
    """WARN, at start, when ZeroMQ messages are received through pyzmq's
    ``recv_multipart`` although the compiled modules are in use (slower on a busy
    server: see :func:`drain`)."""
    if _recv_messages is None and kvconductor.IMPL != "py":
        why = _recv.WHY if _recv is not None else "kvconductor._recv did not load"
        log.warning("ZeroMQ batches are received through pyzmq's recv_multipart: %s", why)


def drain(
    sock: zmq.Socket,
    limit: int,
    stopped: Callable[[], bool],
    on_error: Callable[[zmq.ZMQError], None],
) -> Iterator[list[bytes]]:
    """The multipart messages already queued on ``sock``, at most ``limit`` (one
    readiness callback's share), until ``stopped()`` is true. A receive error is
    passed to ``on_error`` and ends the draining. Used by the SUB sockets too.

    PERF: received by :func:`kvconductor._recv.recv_messages`, all at once and with the
    GIL held; pyzmq's ``recv_multipart`` (used when that is not available, and with
    ``KVCONDUCTOR_IMPL=py``) hands the GIL to the event loop and waits for it back at
    every frame. The messages it received that ``stopped()`` keeps from being yielded go
    with the socket, which the caller closes (a closed subscription, a finished replay)."""
    if sock.closed:
        return
    if _recv_messages is not None:
        if stopped():
            return
        msgs: list[list[bytes]] = []
        err = _recv_messages(sock.underlying, limit, msgs)
        for frames in msgs:
            if stopped():
                return
            yield frames
        if err:
            on_error(zmq.ZMQError(err))
        return
    for _ in range(limit):
        if stopped():
            return
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        except zmq.ZMQError as ex:
            on_error(ex)
            return
        yield frames


@dataclass(slots=True, eq=False)
class ReplaySession:
    """One replay request/response exchange.

    ``on_batch(seq, payload)`` is called for every replayed batch in arrival
    order; ``on_done(ok, why)`` exactly once (``ok`` = the end marker arrived).
    """

    thread: IngestThread
    endpoint: str
    start_seq: int
    on_batch: Callable[[int, bytes], None]
    on_done: Callable[[bool, str], None]
    timeout: float = 5.0
    #: Seconds the whole replay may take.
    deadline: float = 60.0
    #: ZMQ_MAXMSGSIZE of the DEALER (-1: unlimited).
    max_msg: int = -1
    # the exchange's state, from start() on
    _ends_at: float = field(default=0.0, init=False)
    sock: zmq.Socket | None = field(default=None, init=False)
    received: int = field(default=0, init=False)
    layout: str | None = field(default=None, init=False)  # "seq,payload" | "topic,seq,payload"
    done: bool = field(default=False, init=False)
    _last_activity: float = field(default=0.0, init=False)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the DEALER, send the request and start polling (ingest thread)."""
        try:
            sock = self.thread.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by buffer_steps batches
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg)
            sock.connect(self.endpoint)
        except zmq.ZMQError as ex:
            self._finish(False, f"connect {self.endpoint!r} failed: {ex}")
            return
        self.sock = sock
        try:
            sock.send_multipart([b"", self.start_seq.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as ex:
            self._finish(False, f"request failed: {ex}")
            return
        self.thread.add_socket(sock, self._on_readable)
        self._last_activity = time.monotonic()
        self._ends_at = self._last_activity + self.deadline
        self.thread.call_later(min(self.timeout, self.deadline), self._check_timeout)

    def close(self) -> None:
        """Stop polling and close the socket (no callback)."""
        self.done = True
        sock, self.sock = self.sock, None
        if sock is not None:
            self.thread.remove_socket(sock)
            sock.close(linger=0)

    def _finish(self, ok: bool, why: str) -> None:
        if self.done:
            return
        self.close()
        self.on_done(ok, why)

    def _check_timeout(self) -> None:
        if self.done:
            return
        now = time.monotonic()
        idle = now - self._last_activity
        if idle >= self.timeout:
            self._finish(
                False,
                f"no reply from {self.endpoint} for {idle:.1f}s ({self.received} batches received)",
            )
        elif now >= self._ends_at:
            self._finish(
                False,
                f"replay from {self.endpoint} not finished within "
                f"{self.deadline:g}s ({self.received} batches received)",
            )
        else:
            self.thread.call_later(
                min(self.timeout - idle, self._ends_at - now), self._check_timeout
            )

    # -- receive --------------------------------------------------------------------------
    def _receive_error(self, ex: zmq.ZMQError) -> None:
        self._finish(False, f"receive failed: {ex}")

    def _on_readable(self, sock) -> None:
        for frames in drain(sock, DRAIN_LIMIT, lambda: self.done, self._receive_error):
            self._last_activity = time.monotonic()
            n = len(frames)
            if n == 3 and frames[0] == b"":
                seq_b, payload = frames[1], frames[2]
                layout = "seq,payload"
            elif n == 4 and frames[0] == b"":
                seq_b, payload = frames[2], frames[3]
                layout = "topic,seq,payload"
            else:
                self._finish(False, f"malformed replay reply ({n} frames)")
                return
            if seq_b == END_MARKER:
                self._finish(True, "complete")
                return
            if len(seq_b) != 8:
                self._finish(False, f"replay seq frame of {len(seq_b)} bytes")
                return
            self.layout = layout
            self.received += 1
            self.on_batch(int.from_bytes(seq_b, "big"), payload)
