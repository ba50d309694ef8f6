"""The owner's heartbeat of its ``--workers N`` worker processes.

A worker stopped (SIGSTOP, a debugger, a swap storm) *outside* a read section of the
shared index holds the ingest thread back in nothing, so the shared lock's stall bound
never fires; but the kernel goes on handing it its share of new connections
(``SO_REUSEPORT``) and its keep-alive connections wait too, for the whole stop. So the
owner pings every ready worker over the socket pair it already has (:data:`PING`, every
:data:`INTERVAL`); the worker answers (:data:`PONG`) from its event loop, the one that
serves its connections, so a stopped process or a blocked loop does not answer. A worker
silent past :func:`timeout_for` (``--reader-stall-ms``, at least :data:`MIN_TIMEOUT`) is
killed (SIGKILL: a stopped process dies at once; its listening socket goes with it, so
new connections go to the other workers) and started again like one killed for stalling
the shared lock. ``--reader-stall-ms 0`` (wait for a stalled worker without bound) kills
none: silences are still shown (``/workers`` ``processes.heartbeat``).

:class:`Heartbeat` is one worker's state, without I/O or clock; :class:`Watch` pings,
judges and kills, on the owner's main thread (:class:`kvconductor.serve.owner.Owner`
calls it from its supervision loop and reads the answers).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

log = logging.getLogger("kvconductor.cluster")

#: Socket-pair messages (see :mod:`kvconductor.serve.worker`): owner -> worker "are you
#: there", worker -> owner "here" (one answer per ping).
PING = b"P"
PONG = b"O"
#: How often the owner pings each ready worker (seconds).
INTERVAL = 0.1
#: A worker silent this long (seconds) is killed, whatever a lower ``--reader-stall-ms``.
MIN_TIMEOUT = 0.5
#: Heartbeat kills kept for ``/workers`` (``processes.heartbeat.recent_kills``).
RECENT_KILLS = 16


def timeout_for(reader_stall_ms: int) -> float | None:
    """Seconds of silence after which a worker is killed: ``--reader-stall-ms`` (the bound
    of a worker stalled inside a read), at least :data:`MIN_TIMEOUT`; None (never) for
    ``--reader-stall-ms 0``."""
    if reader_stall_ms <= 0:
        return None
    return max(reader_stall_ms / 1000.0, MIN_TIMEOUT)


class Heartbeat:
    """The pings of one worker process: at most one unanswered at a time (a stopped
    worker is not sent a ping per tick)."""

    def __init__(self) -> None:
        self.last_sent = -math.inf
        #: When the unanswered ping was sent (None: none is unanswered).
        self.pending: float | None = None
        self.answers = 0
        #: Killed for its silence (it is not pinged or killed again).
        self.killed = False

    def due(self, now: float) -> bool:
        """A ping is to be sent now."""
        # half an interval: a tick of the owner's loop a hair early still pings
        return not self.killed and self.pending is None and now - self.last_sent >= INTERVAL / 2

    def sent(self, now: float) -> None:
        self.last_sent = now
        self.pending = now

    def answered(self, n: int = 1) -> None:
        """``n`` answers read (one ping is out at a time: any answer clears it)."""
        self.answers += n
        self.pending = None

    def silent(self, now: float) -> float:
        """Seconds since the unanswered ping was sent (0.0 with none)."""
        return 0.0 if self.pending is None else max(0.0, now - self.pending)

    def expired(self, now: float, timeout: float | None) -> bool:
        """Silent past ``timeout`` (never with None, or once killed)."""
        return timeout is not None and not self.killed and self.silent(now) > timeout

    def forgive(self, now: float) -> None:
        """The owner itself did not run for a while (its own loop stalled): the silence
        counts from now, a fresh ping is sent."""
        if self.pending is not None:
            self.pending = None
            self.last_sent = -math.inf


#: Process states of ``/proc/<pid>/stat`` (field 3), for the stall and silence lines.
STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep",
    "T": "stopped",
    "t": "traced",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` now (``?`` when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "?"
    return stat[stat.rindex(b")") + 2 :][:1].decode("ascii", "replace") or "?"


class Worker(Protocol):
    """What :class:`Watch` uses of the owner's slot of a worker."""

    @property
    def name(self) -> str: ...

    proc: subprocess.Popen | None
    control: socket.socket | None
    heartbeat: Heartbeat | None


class Watch:
    """The owner's heartbeat of every worker (its main thread; :meth:`info` any thread).

    ``drain(slot)`` reads what the worker wrote on its socket pair (answers included)
    before it is judged, so an owner that was busy does not take answers waiting in
    its socket for silence."""

    def __init__(self, reader_stall_ms: int, drain: Callable[[Any], None]) -> None:
        self.timeout = timeout_for(reader_stall_ms)
        self.drain = drain
        self.kills = 0
        self._tick = 0.0
        self._killed: set[int] = set()  # pids killed for silence, not yet reaped
        self._lock = threading.Lock()
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_KILLS)

    def check(self, slots: Iterable[Worker], now: float) -> None:
        """Ping the ready workers that are due, kill those silent past the bound."""
        # the owner's own loop did not run for a while: nobody was pinged meanwhile
        late = self._tick != 0.0 and now - self._tick > (self.timeout or 1.0) / 2
        self._tick = now
        for slot in slots:
            hb = slot.heartbeat
            if hb is None or slot.proc is None:
                continue
            self.drain(slot)
            if slot.control is None:  # gone: reaped by the owner
                continue
            if late:
                hb.forgive(now)
            elif hb.expired(now, self.timeout):
                self._kill(slot, hb, now)
                continue
            if hb.due(now):
                with contextlib.suppress(OSError):  # a full buffer: unanswered anyway
                    slot.control.send(PING)
                hb.sent(now)

    def _kill(self, slot: Worker, hb: Heartbeat, now: float) -> None:
        proc = slot.proc
        assert proc is not None and self.timeout is not None
        hb.killed = True
        state = proc_state(proc.pid)
        silent = hb.silent(now)
        with self._lock:
            self.kills += 1
            self._recent.append(
                {
                    "worker": slot.name,
                    "pid": proc.pid,
                    "silent_ms": round(silent * 1000, 1),
                    "state": state,
                    "ts": time.time(),
                }
            )
        self._killed.add(proc.pid)
        log.warning(
            "%s pid=%d did not answer the owner's heartbeat for %d ms (process state %s, %s; "
            "bound %d ms, --reader-stall-ms); killed it (SIGKILL): its connections are "
            "closed, new ones go to the other workers",
            slot.name,
            proc.pid,
            int(silent * 1000),
            state,
            STATES.get(state, "unknown"),
            int(self.timeout * 1000),
        )
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    def reaped(self, pid: int, code: int) -> bool:
        """Worker ``pid`` exited with ``code``: whether it was killed for its silence."""
        if pid not in self._killed:
            return False
        self._killed.discard(pid)
        return code == -signal.SIGKILL

    def info(self) -> dict[str, Any]:
        """``/workers`` ``processes.heartbeat`` (any thread)."""
        with self._lock:
            return {
                "interval_ms": round(INTERVAL * 1000),
                "timeout_ms": None if self.timeout is None else round(self.timeout * 1000),
                "kills": self.kills,
                "recent_kills": [dict(r) for r in self._recent],
            }
