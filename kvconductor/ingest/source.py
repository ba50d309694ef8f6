"""The sockets of one ZeroMQ source: a SUB to the publisher and the SUB's monitor.

:class:`SubSource` opens, polls and closes them on the ingest thread; what a message,
a handshake or a disconnect means is decided by its :class:`SourceEvents` (the
:class:`~kvconductor.ingest.subscription.Subscription`). Nothing here knows sequence
numbers, payloads or the index.

* SUB ``RCVHWM = 1_000_000`` messages. The reference left ZMQ's default of 1000,
  so a burst larger than that was dropped silently by ZMQ. vLLM's PUB side
  queues up to ``hwm = 100_000`` per subscriber and its replay buffer holds
  10 000 batches; a million batches is far beyond any burst we can still
  recover, yet it stays bounded (0 = unlimited would let a stuck ingest thread
  grow memory without limit). Loss beyond it shows up as a seq gap and is
  recovered by replay.
* Reconnects: ZMQ's own ``RECONNECT_IVL`` 100 ms doubling up to
  ``RECONNECT_IVL_MAX`` 1 s (the reference let it grow to 30 s, so an engine back
  after a long outage waited up to 30 s for us; a refused connect per second and
  dead source costs nothing worth that). ZMTP heartbeats and TCP keepalive
  detect a silently dead peer. A socket that cannot be opened at all (out of
  sockets or files) raises: the registration that asked for it is undone (503).
* The monitor socket reports HANDSHAKE_SUCCEEDED/DISCONNECTED (a TCP connect alone is
  not a connection: a frozen host's kernel still accepts one).
* ``--workers N``: each drain of the SUB runs inside one shared write section
  (:class:`~kvconductor.ingest.host.SharedWrites`), ticked after every message.
"""

from __future__ import annotations

import logging
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvconductor.ingest.host import SharedWrites, WriteSection
from kvconductor.ingest.replay import drain
from kvconductor.ingest.thread import IngestThread
from kvconductor.urls import is_bind_url

log = logging.getLogger("kvconductor.ingest")

RCVHWM = 1_000_000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1_000
#: ZMTP PING every second; no traffic for 3 s drops the connection (a dead host is
#: noticed within seconds, well inside the default --source-down-secs).
HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 3_000
#: Messages handled per readiness callback (fairness between sockets).
DRAIN_LIMIT = 256

#: A source is *connected* once the ZMTP handshake succeeded, not at the TCP connect: the
#: kernel of a frozen or overloaded host still accepts TCP connections.
_MON_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
#: A ZMTP handshake not done within this drops the connection (libzmq's default: 30 s).
HANDSHAKE_IVL_MS = 3_000


class SourceEvents(Protocol):
    """What a :class:`SubSource` reports (ingest thread)."""

    @property
    def closed(self) -> bool:
        """Stop draining: the subscription is closed."""

    def handshake(self) -> None:
        """A ZMTP handshake succeeded (a publisher is connected)."""

    def disconnected(self) -> None:
        """The connection to the publisher is gone (ZeroMQ reconnects by itself)."""

    def message(self, frames: list[bytes]) -> None:
        """One multipart message of the SUB."""

    def receive_error(self, ex: zmq.ZMQError) -> None:
        """Receiving failed (the drain stops until the next readiness)."""


class SubSource:
    """One SUB socket to (or bound at) one URL, and its monitor."""

    def __init__(
        self, thread: IngestThread, events: SourceEvents, shared: SharedWrites | None
    ) -> None:
        self.thread = thread
        self.events = events
        self.shared = shared
        self.sock: zmq.Socket | None = None
        self.mon: zmq.Socket | None = None
        #: The SUB is bound (``--allow-bind-endpoints``): publishers connect to it.
        self.bound = False

    @property
    def is_open(self) -> bool:
        return self.sock is not None

    def open(self, url: str, max_message_bytes: int) -> None:
        """Create and connect (or bind) the SUB socket and its monitor.

        Raises ``zmq.ZMQError`` (nothing left open) when that fails: out of
        sockets or files, or a bind-mode port in use. Once open, ZeroMQ reconnects
        by itself.
        """
        sock = self.thread.ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            # Hard guard: libzmq drops a peer that sends more than twice the limit before
            # it is ever buffered; messages up to that are refused and counted (Limits).
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
            # The monitor's PAIR first: once the SUB is monitored, a monitor event sent
            # with no PAIR connected blocks whichever thread sends it (libzmq), at the
            # latest its reaper when the SUB closes, and then no closed socket gives its
            # files back. pyzmq's get_monitor_socket creates the PAIR last, so running out
            # of files just there left the process unable to recover.
            mon = self.thread.ctx.socket(zmq.PAIR)
            try:
                addr = f"inproc://monitor.s-{sock.FD}"
                sock.monitor(addr, _MON_EVENTS)
                mon.connect(addr)
            except zmq.ZMQError:
                mon.close(linger=0)
                raise
            try:
                if is_bind_url(url):
                    # --allow-bind-endpoints: the engine PUB connects to us ("bind stable").
                    sock.bind(url)
                    self.bound = True
                else:
                    sock.connect(url)
            except zmq.ZMQError:
                sock.disable_monitor()
                mon.close(linger=0)
                raise
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.sock, self.mon = sock, mon
        self.thread.add_socket(mon, self._on_monitor)
        self.thread.add_socket(sock, self._on_readable)

    def close(self) -> None:
        sock, mon = self.sock, self.mon
        self.sock = self.mon = None
        if mon is not None:
            self.thread.remove_socket(mon)
        if sock is not None:
            self.thread.remove_socket(sock)
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sock.close(linger=0)
        if mon is not None:
            mon.close(linger=0)

    def _on_monitor(self, mon: zmq.Socket) -> None:
        while True:
            try:
                evt = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            e = evt["event"]
            if e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.events.handshake()
            elif e == zmq.EVENT_DISCONNECTED:
                self.events.disconnected()
            elif e == zmq.EVENT_MONITOR_STOPPED:
                return

    def _on_readable(self, sock: zmq.Socket) -> None:
        shared = self.shared
        if shared is None:
            self._drain(sock, None)
            return
        # --workers N: one shared write section over the drain (kvconductor.state.shared)
        batch = shared.batch()
        with batch:
            self._drain(sock, batch)

    def _drain(self, sock: zmq.Socket, batch: WriteSection | None) -> None:
        events = self.events
        pause = self.thread.pause_point
        for frames in drain(sock, DRAIN_LIMIT, lambda: events.closed, events.receive_error):
            if batch is not None:
                batch.tick()
                events.message(frames)
            else:  # one process: the event loop shares the GIL (never inside a write section)
                events.message(frames)
                pause()
