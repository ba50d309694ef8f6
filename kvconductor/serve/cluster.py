"""``kv-conductor --workers N``: one owner process, N HTTP worker processes on one port.

The **owner** (the process started by ``kv-conductor``) keeps everything that holds
state: the :class:`~kvconductor.state.conductor.Conductor` (the single ingest thread: ZeroMQ
subscriptions, ``POST /events``, registrations, maintenance) and the full app of
:func:`kvconductor.http.api.create_app`, served by uvicorn on a private UNIX socket in a
fresh temporary directory (``kv-conductor-<pid>-*``, mode 0700, removed at exit; the
directories of owners killed before they could remove theirs are removed by the next
owner that starts, :func:`remove_stale_private_dirs`). It binds the public
``host:port`` with ``SO_REUSEPORT`` but never listens on it: a port in use fails at
once (same message as one process), port 0 resolves to a real port, and the socket
held for the whole run takes no connections.

Each **worker** (``python -m kvconductor.serve.cluster worker ...``, spawned, never forked:
the owner has threads and a ZeroMQ context) binds ``host:port`` with ``SO_REUSEPORT``
and listens (the kernel spreads new connections over the workers), serves HTTP with
the same limits and TLS flags as one process, answers ``POST /query`` and ``POST
/query_by_hash`` itself from the owner's index in shared memory, and forwards every
other request to the owner over a pool of keep-alive HTTP/1.1 connections on the UNIX
socket (:func:`create_worker_app`). ``GET /health`` is answered by the worker itself.

**Queries.** They go through :attr:`WorkerApp.query_handler`, an ASGI callable: in a
worker, :func:`kvconductor.http.api.create_query_app` over a
:class:`~kvconductor.state.shared.SharedView` (the default, without shared descriptors,
forwards), counting in :attr:`WorkerApp.query_metrics`, which the owner's
``/metrics`` sums.

**Shared index** (:mod:`kvconductor.state.shared`): the owner's conductor gets a
:class:`~kvconductor.state.shared.SharedIndexes` (:data:`SHARED`); :func:`shared_fds` gives
its arena and lock descriptors, which every worker inherits (``--shared-fds``;
:data:`SHARED_FDS` in the worker); :data:`on_worker_exit` (owner: called with the pid
of a worker that exited) clears the dead worker's reader slots.

**Supervision** (owner, on its main thread's event loop): a worker that exits is
logged (WARN), :data:`on_worker_exit` is called, and it is spawned again after a
back-off (1 s doubling to 30 s; back to 1 s once a worker stayed up 60 s). With no
other worker listening, starting or due within :data:`RESPAWN_ALL_DOWN`, the back-off
is cut to that (1 s), so the public port is never without a listener for long. A
worker the ingest thread killed for stalling the shared lock (``--reader-stall-ms``:
the lock's stall log, :meth:`Owner.check_stalls`, logs each stall at WARN) is
restarted after 1 s, its back-off unchanged.
Each worker holds one end of a socket pair with the owner: it writes one byte
when it listens (the owner logs ``worker-3 pid=1234 ready``) and exits at once
(status 1) when the owner's end closes, i.e. when the owner is gone, even by
SIGKILL (``PR_SET_PDEATHSIG`` sends it SIGTERM too, on Linux).

**Shutdown**: SIGTERM/SIGINT to the owner asks every worker to stop (a message on its
socket pair; a worker signalled directly too, by a terminal's Ctrl-C or systemd, drains
once), each drains like one process, the owner waits
:data:`~kvconductor.serve.single.GRACEFUL_SECS` plus :data:`STOP_MARGIN` (then SIGKILL), stops
its own server and the conductor, and exits 0. A second signal makes the workers close
their connections at once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import email.utils
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import msgspec
import uvicorn
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvconductor._shlock import SLOTS, owner_alive, proc_stamp
from kvconductor.http.api import MSGPACK_PATHS, PUBLIC_READ_PATHS, QUERY_PATHS, too_large_message
from kvconductor.http.metrics import Metrics, QueryMetrics, Sample, query_samples
from kvconductor.logs import set_process_role
from kvconductor.serve.settings import Settings
from kvconductor.serve.single import (
    GRACEFUL_SECS,
    SWITCH_INTERVAL,
    KvServer,
    _version,
    bind_socket,
    format_address,
    report_bind_error,
    serving_app,
    start_conductor,
    stop_conductor,
    uvicorn_config,
)
from kvconductor.state.conductor import Conductor, raise_fd_limit, tune_malloc
from kvconductor.state.shared import SharedIndexes
from kvconductor.wire import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    encode_error,
    is_msgpack_content_type,
)

log = logging.getLogger("kvconductor.cluster")

#: First respawn delay of a worker that exited (seconds); doubles up to RESPAWN_MAX.
RESPAWN_FIRST = 1.0
RESPAWN_MAX = 30.0
#: A worker up this long resets its back-off to RESPAWN_FIRST.
RESPAWN_RESET = 60.0
#: With no worker listening, the next start is at most this far away (seconds) whatever
#: the back-off, so the public port refuses connections for about this plus a start-up.
RESPAWN_ALL_DOWN = 1.0
#: While the ingest thread waits for a stalled reader that is not dead (not killable,
#: or not dying), a WARN this often (seconds).
STALL_NAG_SECS = 5.0
#: Stalls kept for ``/workers`` (``processes.shared_lock.recent_stalls``).
RECENT_STALLS = 16
#: The owner's private directory: ``<tmp>/kv-conductor-<pid>-<random>`` (mode 0700).
PRIVATE_PREFIX = "kv-conductor-"
#: In it: "<pid> <start stamp>" of the owner, so a later owner can tell it is stale.
OWNER_FILE = "owner.pid"
#: A directory of an older version (no pid in its name) is judged only this old (seconds).
LEGACY_DIR_AGE = 60.0
#: Seconds past GRACEFUL_SECS the owner waits for its workers to stop before SIGKILL.
STOP_MARGIN = 2.0
#: Seconds a worker has to hand its query metrics to the owner's ``/metrics``.
METRICS_TIMEOUT = 0.5
#: Keep-alive of the owner's UNIX-socket connections (the workers' pools).
OWNER_KEEP_ALIVE = 120.0
#: A pooled connection idle this long is closed instead of reused.
POOL_IDLE_SECS = 60.0
#: Idle connections a worker keeps to the owner at most.
POOL_MAX_IDLE = 64
#: Socket-pair messages: worker -> owner "listening"; owner -> worker "drain and stop",
#: "stop now" (messages, not signals: a worker that also got the signal itself, from a
#: terminal's Ctrl-C or systemd signalling the whole group, must not take the owner's
#: request for a second signal).
_READY = b"R"
_STOP = b"S"
_FORCE = b"F"
_CHUNK = 1 << 16
#: Threads of a worker answering large queries (the event loop answers the others).
WORKER_QUERY_THREADS = 2
#: Settings a worker needs (never the API key: the owner checks it).
WORKER_FIELDS = (
    "host",
    "port",
    "log_level",
    "log_format",
    "max_body_mb",
    "max_header_kb",
    "request_timeout_secs",
    "keep_alive_secs",
    "max_connections",
    "allow_origins",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
)


#: (Owner) the shared arena, lock and directory of the index (kvconductor.state.shared), set by
#: :func:`serve_owner`.
SHARED: Any = None


def shared_fds() -> list[int]:
    """(Owner) file descriptors every worker inherits (``--shared-fds 5,7``): the shared
    arena and lock of the index. In a worker they are :data:`SHARED_FDS`, same numbers.
    """
    return SHARED.fds() if SHARED is not None else []


#: (Owner) callbacks called with the pid of a worker that exited (any cause), on the
#: owner's main thread, before it is spawned again. An exception is logged and ignored.
on_worker_exit: list[Callable[[int], None]] = []

#: (Worker) the descriptors of ``--shared-fds`` (from :func:`shared_fds` of the owner).
SHARED_FDS: tuple[int, ...] = ()


def settings_json(settings: Settings) -> str:
    """The settings a worker needs, as JSON (``--settings``)."""
    return msgspec.json.encode({f: getattr(settings, f) for f in WORKER_FIELDS}).decode()


def settings_from_json(text: str) -> Settings:
    doc = msgspec.json.decode(text)
    doc["allow_origins"] = tuple(doc.get("allow_origins") or ())
    return Settings(**{k: v for k, v in doc.items() if k in WORKER_FIELDS})


# --------------------------------------------------------------------------- owner

#: Process states of ``/proc/<pid>/stat`` (field 3), for the stall lines.
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep",
    "T": "stopped",
    "t": "traced",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}


def _proc_state(pid: int) -> str:
    """The state letter of ``pid`` now (``?`` when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "?"
    return stat[stat.rindex(b")") + 2 :][:1].decode("ascii", "replace") or "?"


def _stale(path: str, name: str, mtime: float) -> bool:
    """Whether the private directory ``path`` (``name``, modified at ``mtime``) of an
    owner is stale: its owner (``kv-conductor-<pid>-...``, with ``owner.pid`` holding pid
    and start stamp) is no longer running; for a directory of an older version (no pid
    in its name), nothing listens on its ``owner.sock`` any more and it is older than
    :data:`LEGACY_DIR_AGE` (an owner starting now binds its socket before it listens)."""
    rest = name[len(PRIVATE_PREFIX) :]
    pid_text, sep, _ = rest.partition("-")
    if sep and pid_text.isdigit():
        pid = int(pid_text)
        stamp = 0
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(path, OWNER_FILE)) as f:
                fpid, fstamp = f.read().split()
            if int(fpid) == pid:
                stamp = int(fstamp)
        # no owner file yet: a starting owner, judged by its pid alone
        return not owner_alive(pid, stamp)
    sock_path = os.path.join(path, "owner.sock")
    if not os.path.exists(sock_path) or time.time() - mtime < LEGACY_DIR_AGE:
        return False  # not ours to judge, or too young to tell
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(sock_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


def remove_stale_private_dirs(base: str | None = None) -> list[str]:
    """Remove the private directories (``kv-conductor-*``, this user's) that owners
    killed without a chance to clean up left in ``base`` (default: the temporary
    directory); returns their paths."""
    base = base or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PRIVATE_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != uid:
            continue
        if _stale(entry.path, entry.name, st.st_mtime):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    return removed


def make_private_dir() -> str:
    """The owner's private directory for its UNIX sockets: stale ones of dead owners
    removed first, then ``<tmp>/kv-conductor-<pid>-<random>`` (mode 0700) with
    ``owner.pid``."""
    for path in remove_stale_private_dirs():
        log.info("removed stale directory %s (its owner process is gone)", path)
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{pid}-")  # mode 0700
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(f"{pid} {proc_stamp(pid)}\n")
    return path


@dataclasses.dataclass
class _Slot:
    """One worker number: its current process (``None`` while waiting to respawn)."""

    number: int
    metrics_path: str
    proc: subprocess.Popen | None = None
    control: socket.socket | None = None
    started: float = 0.0
    ready: bool = False
    backoff: float = RESPAWN_FIRST
    restarts: int = 0
    #: When its pending start is due (monotonic seconds; 0: none pending).
    due: float = 0.0

    @property
    def name(self) -> str:
        return f"worker-{self.number}"


class Owner:
    """The owner's worker supervision (main thread, in its event loop)."""

    def __init__(self, settings: Settings, tmpdir: str, owner_path: str, host: str, port: int):
        self.settings = settings
        self.owner_path = owner_path
        self.host = host
        self.port = port
        self.slots = [
            _Slot(n, os.path.join(tmpdir, f"worker-{n}.metrics.sock"))
            for n in range(1, settings.workers + 1)
        ]
        self.restarts = 0
        self.stopping = False
        self.force = False
        self._lock = threading.Lock()  # the fields below: read by /metrics scrapes
        # pid -> (name, pid, metrics path) of the workers running and listening
        self._live: dict[int, tuple[str, int, str]] = {}
        self._last: dict[int, list[Sample]] = {}  # pid -> last query samples reported
        self._retired: dict[tuple, Sample] = {}  # summed samples of exited workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()
        self._settings_json = settings_json(dataclasses.replace(settings, host=host, port=port))
        # stalled readers of the shared lock (main thread; the deque read by /workers)
        self._names: dict[int, str] = {}  # pid -> worker name, of every worker started
        self._stall_seq = 0  # last entry of the lock's stall log logged
        self._stall_killed: dict[int, dict[str, Any]] = {}  # pid -> its stall, killed
        self._recent_stalls: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=RECENT_STALLS
        )
        self._stall_nagged = 0.0

    # -- spawning (main thread only: PR_SET_PDEATHSIG follows the spawning thread)

    def spawn(self, slot: _Slot) -> None:
        assert threading.current_thread() is threading.main_thread()
        parent, child = socket.socketpair()
        extra = [int(fd) for fd in shared_fds()]
        cmd = [
            sys.executable,
            "-m",
            "kvconductor.serve.cluster",
            "worker",
            "--number",
            str(slot.number),
            "--owner-socket",
            self.owner_path,
            "--owner-pid",
            str(os.getpid()),
            "--control-fd",
            str(child.fileno()),
            "--metrics-socket",
            slot.metrics_path,
            "--settings",
            self._settings_json,
        ]
        if extra:
            cmd += ["--shared-fds", ",".join(str(fd) for fd in extra)]
        try:
            proc = subprocess.Popen(cmd, pass_fds=[child.fileno(), *extra], close_fds=True)
        except OSError as ex:
            parent.close()
            child.close()
            log.error("cannot start %s: %s", slot.name, ex)
            self._schedule_respawn(slot)
            return
        child.close()
        parent.setblocking(False)
        slot.proc, slot.control, slot.started, slot.ready = proc, parent, time.monotonic(), False
        self._names[proc.pid] = slot.name
        if len(self._names) > 4 * len(self.slots) + RECENT_STALLS:
            for pid in list(self._names)[: len(self._names) // 2]:
                del self._names[pid]
        assert self._loop is not None
        self._loop.add_reader(parent.fileno(), self._on_control, slot)
        log.info("%s pid=%d started", slot.name, proc.pid)

    def _on_control(self, slot: _Slot) -> None:
        sock = slot.control
        if sock is None:
            return
        try:
            data = sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the worker is gone; supervise() reaps it
            self._close_control(slot)
            return
        if _READY in data and not slot.ready and slot.proc is not None:
            slot.ready = True
            with self._lock:
                self._live[slot.proc.pid] = (slot.name, slot.proc.pid, slot.metrics_path)
            log.info(
                "%s pid=%d ready (listening on %s port %d)",
                slot.name,
                slot.proc.pid,
                self.host,
                self.port,
            )

    def _close_control(self, slot: _Slot) -> None:
        if slot.control is not None:
            if self._loop is not None:
                self._loop.remove_reader(slot.control.fileno())
            slot.control.close()
            slot.control = None

    # -- supervision

    async def supervise(self) -> None:
        while True:
            self.check_stalls()
            self.reap()
            await asyncio.sleep(0.1)

    def check_stalls(self) -> None:
        """Log what the ingest thread did about readers of the shared lock stalled past
        ``--reader-stall-ms`` (the lock's stall log), and keep reminding while it still
        waits for one that is not dead."""
        if SHARED is None:
            return
        lock = SHARED.lock
        for e in lock.stall_log(after=self._stall_seq):
            self._stall_seq = e["seq"]
            pid = e["pid"]
            name = self._names.get(pid, "reader")
            row = {
                "worker": name,
                "pid": pid,
                "waited_ms": round(e["waited_s"] * 1000, 1),
                "state": e["state"],
                "killed": e["killed"],
                "ts": time.time(),
            }
            with self._lock:
                self._recent_stalls.append(row)
            if e["killed"]:
                self._stall_killed[pid] = row
                what = "killed it (SIGKILL); the other workers' queries went on"
            else:
                what = (
                    "it is no worker process of this owner and is not killed: queries go "
                    "on, events wait until it leaves its read section"
                )
            log.warning(
                "%s pid=%d held a read section of the shared index for %d ms (process state "
                "%s, %s) while the ingest thread waited (--reader-stall-ms %d); %s",
                name,
                pid,
                int(e["waited_s"] * 1000),
                e["state"],
                _STATES.get(e["state"], "unknown"),
                self.settings.reader_stall_ms,
                what,
            )
        cur = lock.stalling()
        now = time.monotonic()
        if (
            cur is not None
            and cur["seconds"] >= STALL_NAG_SECS
            and now - self._stall_nagged >= STALL_NAG_SECS
        ):
            self._stall_nagged = now
            pid = cur["pid"]
            state = _proc_state(pid)
            killed = " after SIGKILL" if pid in self._stall_killed else ""
            log.warning(
                "the ingest thread has waited %.0fs for %s pid=%d to leave its read "
                "section of the shared index (process state %s, %s%s); queries go on, "
                "events wait",
                cur["seconds"],
                self._names.get(pid, "reader"),
                pid,
                state,
                _STATES.get(state, "unknown"),
                killed,
            )

    def reap(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                self._exited(slot)

    def _exited(self, slot: _Slot) -> None:
        proc = slot.proc
        assert proc is not None
        code = proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        slot.proc = None
        self._close_control(slot)
        with self._lock:
            self._live.pop(proc.pid, None)
            for sample in self._last.pop(proc.pid, ()):
                name, labels, value = sample
                key = (name, tuple(sorted(labels.items())))
                old = self._retired.get(key)
                self._retired[key] = (name, labels, value + (old[2] if old else 0.0))
        for hook in list(on_worker_exit):
            try:
                hook(proc.pid)
            except Exception:
                log.exception("on_worker_exit hook failed for %s pid=%d", slot.name, proc.pid)
        if self.stopping:
            log.info("%s pid=%d stopped (%s)", slot.name, proc.pid, how)
            return
        self.check_stalls()  # a stall kill logged before the exit it caused
        stalled = self._stall_killed.pop(proc.pid, None) is not None and code == -signal.SIGKILL
        if time.monotonic() - slot.started >= RESPAWN_RESET:
            slot.backoff = RESPAWN_FIRST
        # killed for stalling the shared index: no crash, its back-off stays as it was
        delay = self._respawn_delay(slot, RESPAWN_FIRST if stalled else None)
        if stalled:
            log.warning(
                "%s pid=%d exited (%s, killed for stalling the shared index); restarting it in %gs",
                slot.name,
                proc.pid,
                how,
                delay,
            )
        else:
            log.warning(
                "%s pid=%d exited unexpectedly (%s); restarting it in %gs",
                slot.name,
                proc.pid,
                how,
                delay,
            )
        self._call_respawn(slot, delay)

    def _call_respawn(self, slot: _Slot, delay: float) -> None:
        slot.due = time.monotonic() + delay
        assert self._loop is not None
        self._loop.call_later(delay, self._respawn, slot)

    def _coming(self, slot: _Slot, within: float) -> bool:
        """``slot`` listens, or is starting, or starts within ``within`` seconds."""
        if slot.proc is not None:
            return slot.proc.poll() is None
        return slot.due != 0.0 and slot.due <= time.monotonic() + within

    def _respawn_delay(self, slot: _Slot, delay: float | None = None) -> float:
        """Seconds until ``slot`` is started again: ``delay``, else its back-off (which
        doubles, up to RESPAWN_MAX). When no other worker listens, is starting or
        starts within RESPAWN_ALL_DOWN, this one starts in RESPAWN_ALL_DOWN at most: the
        public port is never left without a listener for long, and only one worker
        of a crash loop restarts that fast."""
        if delay is None:
            delay = slot.backoff
            slot.backoff = min(slot.backoff * 2, RESPAWN_MAX)
        if delay > RESPAWN_ALL_DOWN and not any(
            self._coming(s, RESPAWN_ALL_DOWN) for s in self.slots if s is not slot
        ):
            log.warning(
                "no worker is listening on port %d: %s is started in %gs instead of %gs "
                "(its back-off)",
                self.port,
                slot.name,
                RESPAWN_ALL_DOWN,
                delay,
            )
            delay = RESPAWN_ALL_DOWN
        return delay

    def _schedule_respawn(self, slot: _Slot) -> None:
        self._call_respawn(slot, self._respawn_delay(slot))

    def _respawn(self, slot: _Slot) -> None:
        slot.due = 0.0
        if self.stopping or slot.proc is not None:
            return
        self.restarts += 1
        slot.restarts += 1
        self.spawn(slot)

    # -- running and stopping

    async def run(self, serve: Callable[[], Any], server: KvServer) -> None:
        """Serve the owner app (``serve()``), start the workers, supervise until a
        shutdown signal, stop the workers, then the owner's server."""
        self._loop = loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        serving = asyncio.ensure_future(serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if serving.done():
            await serving
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        for slot in self.slots:
            self.spawn(slot)
        supervisor = asyncio.ensure_future(self.supervise())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([stop, serving], return_when=asyncio.FIRST_COMPLETED)
            if not self._stop.is_set():
                log.error("the owner's HTTP server stopped; stopping the workers")
                self.stopping = True
            await self.stop_workers()
        finally:
            stop.cancel()
            supervisor.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            self.kill_all()
            server.should_exit = True
            server.force_exit = self.force
        await serving

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self.stopping:
            log.info(
                "received shutdown signal, stopping %d worker(s)... signal=%s",
                sum(s.proc is not None for s in self.slots),
                name,
            )
            self.stopping = True
            self._stop.set()
            return
        if not self.force:
            log.warning(
                "second shutdown signal (%s): workers close connections without waiting for "
                "requests in flight",
                name,
            )
            self.force = True
            self._tell_all(_FORCE)

    def _tell_all(self, message: bytes) -> None:
        """Send ``message`` (:data:`_STOP`, :data:`_FORCE`) to every worker over its socket
        pair; SIGTERM to one whose socket is gone."""
        for slot in self.slots:
            if slot.proc is None or slot.proc.poll() is not None:
                continue
            try:
                if slot.control is None:
                    raise OSError("no control socket")
                slot.control.send(message)
            except OSError:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGTERM)

    async def stop_workers(self) -> None:
        self._tell_all(_STOP)
        bound = GRACEFUL_SECS + STOP_MARGIN
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            self.reap()
            if all(s.proc is None for s in self.slots):
                return
            await asyncio.sleep(0.05)
        for slot in self.slots:
            if slot.proc is not None:
                log.warning(
                    "%s pid=%d did not stop within %gs; killing it", slot.name, slot.proc.pid, bound
                )
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL and reap every worker still running."""
        for slot in self.slots:
            if slot.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    slot.proc.wait(5)
                self._exited(slot)

    # -- metrics (any thread: /metrics scrapes run in a worker thread)

    def live_workers(self) -> int:
        with self._lock:
            return len(self._live)

    def info(self) -> dict[str, Any]:
        """``GET /workers``' ``processes`` (any thread): each worker process and the
        shared lock's counters (docs/api.md, GET /workers)."""
        now = time.monotonic()
        workers = []
        for slot in self.slots:
            proc = slot.proc
            workers.append(
                {
                    "name": slot.name,
                    "pid": proc.pid if proc is not None else None,
                    "state": "restarting"
                    if proc is None
                    else ("ready" if slot.ready else "starting"),
                    "up_s": round(now - slot.started, 1) if proc is not None else None,
                    "restarts": slot.restarts,
                }
            )
        doc: dict[str, Any] = {"workers": workers, "restarts": self.restarts}
        if SHARED is not None:
            st = SHARED.stats()
            hist = SHARED.wait_histogram()
            stall_ms, _ = SHARED.lock.stall_policy()
            cur = SHARED.lock.stalling()
            with self._lock:
                recent = [dict(r) for r in self._recent_stalls]
            doc["shared_lock"] = {
                "reader_stall_ms": stall_ms,
                "write_sections": hist["count"],
                "writer_wait_seconds": round(hist["sum"], 6),
                "writer_waits": st["writer_waits"],
                "stalled_readers": st["stalled_readers"],
                "readers_killed": st["readers_killed"],
                "reclaimed_reader_slots": st["reclaimed_reader_slots"],
                "stalling": None
                if cur is None
                else {
                    "worker": self._names.get(cur["pid"], "reader"),
                    "pid": cur["pid"],
                    "seconds": round(cur["seconds"], 3),
                },
                "recent_stalls": recent,
            }
        return doc

    def worker_query_samples(self) -> list[list[Sample]]:
        """The query samples of exited workers (summed) and of every live one (asked
        now; one that does not answer within METRICS_TIMEOUT counts with its last report)."""
        with self._lock:
            live = list(self._live.values())
            out: list[list[Sample]] = [list(self._retired.values())]
        for name, pid, path in live:
            try:
                samples = fetch_query_samples(path)
            except FileNotFoundError:  # starting: has not counted anything yet
                samples = None
            except (OSError, ValueError, msgspec.DecodeError) as ex:
                log.warning("%s pid=%d did not report its query metrics: %s", name, pid, ex)
                samples = None
            with self._lock:
                if samples is not None and pid in self._live:
                    self._last[pid] = samples
                out.append(self._last.get(pid, []))
        return out


#: The shared index's metrics: (family, name, help, key of SharedIndexes.stats()).
_SHARED_METRICS = (
    (
        GaugeMetricFamily,
        "kvconductor_shared_arena_bytes",
        "Bytes of index structures in the shared arena (blocks in use, headers included)",
        "bytes_in_use",
    ),
    (
        GaugeMetricFamily,
        "kvconductor_shared_arena_committed_bytes",
        "Size of the shared arena's file (its pages are only counted once touched)",
        "committed",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_directory_publishes",
        "Directories (indexes, group names, block sizes, LoRA seeds) published to workers",
        "generation",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_reader_slots_reclaimed",
        "Reader slots of the shared lock cleared after their worker died",
        "reclaimed_reader_slots",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_writer_waits",
        "Waits of the ingest thread for worker queries inside a read section",
        "writer_waits",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_stalled_readers",
        "Worker reads of the shared index still running --reader-stall-ms after the ingest "
        "thread started waiting for them (stopped, frozen or swapping processes)",
        "stalled_readers",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_readers_killed",
        "Worker processes killed (SIGKILL) for stalling a read of the shared index",
        "readers_killed",
    ),
)


class WorkerCollector(Collector):
    """``kvconductor_worker_processes``, ``kvconductor_worker_restarts_total`` and the
    shared index's ``kvconductor_shared_*``."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvconductor_worker_processes",
            "HTTP worker processes running and listening (kv-conductor --workers N)",
            value=self.owner.live_workers(),
        )
        yield CounterMetricFamily(
            "kvconductor_worker_restarts",
            "Worker processes started again after one exited",
            value=self.owner.restarts,
        )
        if SHARED is None:
            return
        st = SHARED.stats()
        for family, name, doc, key in _SHARED_METRICS:
            yield family(name, doc, value=st[key])
        hist = SHARED.wait_histogram()
        buckets = []
        total = 0
        for bound, count in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
            total += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
        yield HistogramMetricFamily(
            "kvconductor_shared_writer_wait_seconds",
            "How long each write section of the ingest thread waited for worker queries "
            "inside a read section of the shared index",
            buckets=buckets,
            sum_value=hist["sum"],
        )


def fetch_query_samples(path: str, timeout: float = METRICS_TIMEOUT) -> list[Sample]:
    """The query samples a worker serves on its metrics socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        chunks = []
        while True:
            data = sock.recv(_CHUNK)
            if not data:
                break
            chunks.append(data)
    rows = msgspec.json.decode(b"".join(chunks))
    return [(str(n), {str(k): str(x) for k, x in lab.items()}, float(v)) for n, lab, v in rows]


class OwnerServer(KvServer):
    """The owner's uvicorn server: signals are the :class:`Owner`'s (workers first)."""

    def __init__(self, config: uvicorn.Config, owner: Owner) -> None:
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await self.owner.run(lambda: super(OwnerServer, self).serve(sockets=sockets), self)


def _reclaim_reader_slots(pid: int) -> None:
    """A worker exited: clear its reader slots of the shared lock now (the writer would
    reclaim them too, after its first 10 ms wait on one)."""
    if SHARED is not None:
        n = SHARED.reclaim_dead()
        if n:
            log.warning("cleared %d reader slots of exited worker pid=%d", n, pid)


def serve_owner(settings: Settings) -> int:
    """``kv-conductor --workers N`` (N > 1): the owner process. Returns the exit status."""

    set_process_role("owner")
    sys.setswitchinterval(SWITCH_INTERVAL)
    raise_fd_limit(settings.max_sources, settings.max_connections * settings.workers)
    conductor = Conductor(settings.conductor_config())
    readers = settings.workers * (1 + WORKER_QUERY_THREADS)
    if readers > SLOTS:
        msg = (
            f"--workers {settings.workers} needs {readers} reader slots of the shared index "
            f"(1 + {WORKER_QUERY_THREADS} query threads per worker); at most {SLOTS} exist: "
            f"use --workers {SLOTS // (1 + WORKER_QUERY_THREADS)} or fewer"
        )
        log.error("%s", msg)
        print(f"kv-conductor: error: {msg}", file=sys.stderr)
        return 1
    global SHARED
    try:
        SHARED = conductor.shared = SharedIndexes()
    except OSError as ex:
        log.error("cannot create the shared index arena: %s", ex)
        print(f"kv-conductor: error: cannot create the shared index arena: {ex}", file=sys.stderr)
        return 1
    SHARED.set_stall_policy(settings.reader_stall_ms, kill=True)
    on_worker_exit.append(_reclaim_reader_slots)
    try:
        port_sock = bind_socket(settings.host, settings.port, reuse_port=True, listen=False)
    except OSError as ex:
        report_bind_error(settings, ex)
        return 1
    host = settings.host
    if port_sock.family == socket.AF_INET and ":" in host:  # no IPv6: fell back
        host = "0.0.0.0"
    port = port_sock.getsockname()[1]
    try:
        tmpdir = make_private_dir()
    except OSError as ex:
        port_sock.close()
        log.error("cannot create the owner's private directory: %s", ex)
        print(f"kv-conductor: error: cannot create a private directory: {ex}", file=sys.stderr)
        return 1
    owner_path = os.path.join(tmpdir, "owner.sock")
    owner = Owner(settings, tmpdir, owner_path, host, port)
    conductor.processes = owner.info
    unix_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        unix_sock.bind(owner_path)
        unix_sock.listen(2048)
        metrics = Metrics(
            conductor, other_queries=owner.worker_query_samples, extra=[WorkerCollector(owner)]
        )
        app = serving_app(conductor, settings, metrics=metrics)
        # The owner's socket is private: plain HTTP, long keep-alive for the workers'
        # pools, room for the requests in flight of every worker.
        private = dataclasses.replace(
            settings,
            tls_cert=None,
            tls_key=None,
            tls_client_ca=None,
            keep_alive_secs=max(settings.keep_alive_secs, OWNER_KEEP_ALIVE),
            max_connections=settings.max_connections * settings.workers,
        )
        server = OwnerServer(uvicorn_config(app, private, "(owner socket)"), owner)
        log.info(
            "KV conductor starting on %s workers=%d reader_stall=%dms version=%s %s "
            "switch_interval=%s",
            format_address(port_sock),
            settings.workers,
            settings.reader_stall_ms,
            _version(),
            settings.describe(),
            sys.getswitchinterval(),
        )
        if not start_conductor(conductor, settings):
            return 1
        try:
            server.run(sockets=[unix_sock])
        finally:
            owner.kill_all()
            stop_conductor(conductor)
            log.info("KV conductor shut down")
    finally:
        unix_sock.close()
        port_sock.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------- worker

_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"expect",
        b"content-length",
    )
)
_RESP_HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding"))


class OwnerUnavailable(Exception):
    """The owner's socket refused or dropped a request before its answer began."""


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class OwnerClient:
    """HTTP/1.1 client of the owner's UNIX socket: a pool of keep-alive connections;
    each request has a connection to itself."""

    def __init__(self, path: str, max_idle: int = POOL_MAX_IDLE) -> None:
        self.path = path
        self.max_idle = max_idle
        self._idle: list[_Conn] = []

    async def _acquire(self) -> tuple[_Conn, bool]:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < POOL_IDLE_SECS and not conn.reader.at_eof():
                return conn, True
            conn.close()
        reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        return _Conn(reader, writer), False

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def forward(
        self, head: bytes, body: bytes, send: Any, *, head_only: bool, reuse: bool = True
    ) -> None:
        """Send one request (``head`` + ``body``) and relay the answer to ASGI ``send``.

        ``head_only``: the answer has no body (HEAD). Raises :class:`OwnerUnavailable`
        when the owner cannot be reached or closes before answering (nothing was sent
        to the client then). A stale pooled connection is retried once on a new one.
        ``reuse=False``: the connection is closed after the answer (a body was withheld).
        """
        for attempt in (0, 1):
            try:
                conn, reused = await self._acquire()
            except OSError as ex:
                raise OwnerUnavailable(str(ex)) from None
            try:
                conn.writer.write(head + body if len(body) < _CHUNK else head)
                if len(body) >= _CHUNK:
                    conn.writer.write(body)
                await conn.writer.drain()
                status, headers = await _read_head(conn.reader)
            except (OSError, asyncio.IncompleteReadError, ValueError) as ex:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise OwnerUnavailable(str(ex) or type(ex).__name__) from None
            break
        try:
            keep = await self._relay(conn, status, headers, send, head_only)
        except BaseException:
            conn.close()
            raise
        if keep and reuse:
            self._release(conn)
        else:
            conn.close()

    async def _relay(
        self, conn: _Conn, status: int, headers: list, send: Any, head_only: bool
    ) -> bool:
        length = None
        chunked = close = False
        out = []
        for k, v in headers:
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding":
                chunked = b"chunked" in v.lower()
            elif k == b"connection":
                close = b"close" in v.lower()
            if k not in _RESP_HOP:
                out.append((k, v))
        await send({"type": "http.response.start", "status": status, "headers": out})
        reader = conn.reader
        if head_only or status in (204, 304):
            await send({"type": "http.response.body", "body": b""})
            return not close
        if length is not None:
            left = length
            while left > _CHUNK:
                data = await reader.readexactly(_CHUNK)
                left -= _CHUNK
                await send({"type": "http.response.body", "body": data, "more_body": True})
            data = await reader.readexactly(left)
            await send({"type": "http.response.body", "body": data})
            return not close
        if chunked:
            while True:
                line = await reader.readuntil(b"\r\n")
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailers
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return not close
        while data := await reader.read(_CHUNK):  # until the owner closes
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return False


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, list]:
    """Status and headers (lower-case names) of the next final response."""
    while True:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        if 100 <= status < 200:
            continue  # interim (100 Continue)
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        return status, headers


def _request_head(scope: dict, content_length: int | None) -> bytes:
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    lines = [scope["method"].encode() + b" " + target + b" HTTP/1.1"]
    forwarded = None
    for k, v in scope["headers"]:
        if k in _HOP:
            continue
        if k == b"x-forwarded-for":
            forwarded = v
            continue
        lines.append(k + b": " + v)
    client = scope.get("client")
    if client:
        ip = str(client[0]).encode()
        lines.append(b"x-forwarded-for: " + (forwarded + b", " + ip if forwarded else ip))
    elif forwarded is not None:
        lines.append(b"x-forwarded-for: " + forwarded)
    if content_length is not None:
        lines.append(b"content-length: " + str(content_length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


class WorkerApp:
    """The ASGI app of a worker process (:func:`create_worker_app`)."""

    def __init__(
        self,
        owner_socket: str,
        *,
        max_body_bytes: int,
        allow_origins: Iterable[str] = (),
        query_handler: Callable[[dict, Any, Any], Awaitable[None]] | None = None,
        query_metrics: QueryMetrics | None = None,
    ) -> None:
        self.owner = OwnerClient(owner_socket)
        self.max_body_bytes = max_body_bytes
        self.allow_origins = frozenset(allow_origins)
        self.query_metrics = query_metrics if query_metrics is not None else QueryMetrics()
        #: The seam: ``POST /query`` and ``POST /query_by_hash`` (an ASGI callable).
        self.query_handler = query_handler if query_handler is not None else self.forward
        self._unavailable_logged = 0.0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/health":
            return await self._health(scope, send)
        if method == "POST" and path in QUERY_PATHS:
            await self.query_handler(scope, receive, send)
            return
        await self.forward(scope, receive, send)

    async def forward(self, scope: dict, receive: Any, send: Any) -> None:
        """Forward the request to the owner and relay its answer unchanged."""
        t0 = time.perf_counter()
        length = None
        ctype = origin = None
        for k, v in scope["headers"]:
            if k == b"content-length":
                with contextlib.suppress(ValueError):
                    length = int(v)
            elif k == b"content-type":
                ctype = v.decode("latin-1")
            elif k == b"origin":
                origin = v.decode("latin-1")
        msgpack = scope["path"] in MSGPACK_PATHS and is_msgpack_content_type(ctype)
        head_only = scope["method"] == "HEAD"
        body = bytearray()
        more = True
        if length is not None and length > self.max_body_bytes:
            # The owner answers from the head and the first chunk (413, or whatever comes
            # first for that route: 401, 403, 404): send those, never buffer the rest.
            msg = await receive()
            if msg["type"] != "http.request":
                return
            more = msg.get("more_body", False)
            if more:
                head = _request_head(scope, length)
                try:
                    await self.owner.forward(
                        head,
                        msg.get("body", b""),
                        _CloseAfter(send),
                        head_only=head_only,
                        reuse=False,
                    )
                except OwnerUnavailable as ex:
                    await self._unavailable(send, scope, msgpack, str(ex))
                return
            body += msg.get("body", b"")
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client gone: nothing to answer
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_body_bytes:  # chunked: no Content-Length to check
                return await self._too_large(scope, send, msgpack, origin, t0)
        has_body = body or length is not None or scope["method"] in ("POST", "PUT", "PATCH")
        head = _request_head(scope, len(body) if has_body else None)
        try:
            await self.owner.forward(head, bytes(body), send, head_only=head_only)
        except OwnerUnavailable as ex:
            await self._unavailable(send, scope, msgpack, str(ex))

    async def _too_large(
        self, scope: dict, send: Any, msgpack: bool, origin: str | None, t0: float
    ) -> None:
        """413 for a chunked body past the limit, as the owner writes it."""
        path = scope["path"]
        log.warning(
            "request body too large method=%s path=%s limit=%d content_length=None",
            scope["method"],
            path,
            self.max_body_bytes,
        )
        data = encode_error(too_large_message(self.max_body_bytes), msgpack)
        headers = [
            (b"content-type", (MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE).encode()),
            (b"content-length", str(len(data)).encode()),
        ]
        if path in QUERY_PATHS and scope["method"] == "POST":
            self.query_metrics.route_seconds[path].observe(time.perf_counter() - t0)
            self.query_metrics.route_errors[path].inc()
        if origin is not None:
            if path in PUBLIC_READ_PATHS:
                headers.append((b"access-control-allow-origin", b"*"))
            elif origin in self.allow_origins:
                headers.append((b"access-control-allow-origin", origin.encode("latin-1")))
                headers.append((b"vary", b"Origin"))
        await _send(send, 413, headers, data)

    async def _unavailable(self, send: Any, scope: dict, msgpack: bool, why: str) -> None:
        now = time.monotonic()
        if now - self._unavailable_logged >= 5.0:
            self._unavailable_logged = now
            log.warning(
                "owner process unavailable method=%s path=%s error=%s",
                scope["method"],
                scope["path"],
                why,
            )
        data = encode_error("the index owner process is unavailable; retry later", msgpack)
        ctype = MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(data)).encode())]
        await _send(send, 503, headers, data)

    async def _health(self, scope: dict, send: Any) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"2"),
        ]
        if any(k == b"origin" for k, _ in scope["headers"]):
            headers.append((b"access-control-allow-origin", b"*"))
        await _send(send, 200, headers, b"OK")


class _CloseAfter:
    """ASGI ``send`` wrapper for a request whose body was not read: the answer closes
    the client connection (``Connection: close``), as the owner's server would."""

    def __init__(self, send: Any) -> None:
        self.send = send

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message["headers"] if h[0] != b"connection"]
            message = dict(message, headers=[*headers, (b"connection", b"close")])
        await self.send(message)


async def _send(send: Any, status: int, headers: list, data: bytes) -> None:
    headers = [*headers, (b"date", email.utils.formatdate(usegmt=True).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def create_worker_app(
    owner_socket: str,
    *,
    max_body_bytes: int,
    allow_origins: Iterable[str] = (),
    query_handler: Callable[[dict, Any, Any], Awaitable[None]] | None = None,
    query_metrics: QueryMetrics | None = None,
) -> WorkerApp:
    """The ASGI app of a worker: forward requests to the owner at ``owner_socket``.

    Method, target (path and query string), headers (plus ``X-Forwarded-For``) and body
    go to the owner over keep-alive HTTP/1.1 connections; its status, headers and body
    come back unchanged. ``GET /health`` is answered here (``OK``). The body limit
    ``max_body_bytes`` is the owner's: a ``Content-Length`` past it is sent on without
    the body (the owner answers from the head: 413, or 401/403/404 first, as with one
    process) and the client connection is closed; a chunked body past it gets the
    owner's 413 from here. The owner unreachable: 503 ``{"error": ...}`` (MessagePack
    for a MessagePack query).

    **The query seam**: ``query_handler`` is the ASGI callable that answers ``POST
    /query`` and ``POST /query_by_hash`` (default: forward to the owner). A worker with
    a shared view of the index passes a
    :class:`~kvconductor.http.api.QueryFastPath`-like handler over it, counting in
    ``query_metrics`` (the app's :attr:`WorkerApp.query_metrics`): the owner's
    ``/metrics`` sums those of every worker. In a worker process the descriptors of
    :func:`shared_fds` are in :data:`SHARED_FDS` before this app is created
    (:func:`worker_main`).
    """
    return WorkerApp(
        owner_socket,
        max_body_bytes=max_body_bytes,
        allow_origins=allow_origins,
        query_handler=query_handler,
        query_metrics=query_metrics,
    )


class WorkerServer(KvServer):
    """A worker's uvicorn server: tells the owner once it listens. A signal that arrives
    after the owner's stop message is the same shutdown (a signal to the whole process
    group reaches the owner, which tells the workers, and the workers themselves, in any
    order), not a second one."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config, trim_heap=True)  # no ingest thread here to do it
        self.on_started = on_started
        #: Set by the owner link when the owner asked this worker to stop.
        self.owner_stop = False
        self._signal_after_owner = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.owner_stop and not self.force_exit and not self._signal_after_owner:
            self._signal_after_owner = True
            log.info(
                "shutdown signal %s after the owner's stop request: already draining",
                signal.Signals(sig).name,
            )
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.on_started()


def _set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    """Linux: ``sig`` to this process when the thread that spawned it ends."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG


class _OwnerLink:
    """A worker's end of its socket pair with the owner, read by a daemon thread."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.server: WorkerServer | None = None  # set once serving

    def start(self) -> None:
        threading.Thread(target=self._watch, name="owner-watch", daemon=True).start()

    def ready(self) -> None:
        with contextlib.suppress(OSError):
            self.control.send(_READY)

    def _watch(self) -> None:
        """Exit at once (status 1) when the owner's end closes; stop on its request."""
        while True:
            try:
                data = self.control.recv(64)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                log.error("owner process gone; exiting")
                logging.shutdown()
                os._exit(1)
            server = self.server
            if server is None:  # still starting: nothing to drain
                if _STOP in data or _FORCE in data:
                    log.info("stop requested by the owner while starting")
                    logging.shutdown()
                    os._exit(0)
                continue
            # Plain flags the server's loop polls (uvicorn's own signal handler does the same).
            if _STOP in data and not server.should_exit:
                log.info("stop requested by the owner, draining connections...")
                server.owner_stop = True
                server.should_exit = True
            if _FORCE in data and not server.force_exit:
                log.warning("owner's second signal: closing connections without waiting")
                server.should_exit = server.force_exit = True


def _serve_metrics(path: str, qm: QueryMetrics) -> None:
    """Serve :func:`~kvconductor.http.metrics.query_samples` of ``qm`` on the UNIX socket
    ``path`` (one JSON document per connection), in a daemon thread."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(METRICS_TIMEOUT)
                with contextlib.suppress(OSError):
                    conn.sendall(msgspec.json.encode(query_samples(qm)))

    threading.Thread(target=loop, name="query-metrics", daemon=True).start()


def _fd_list(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(",") if v.strip())


def worker_main(argv: list[str]) -> int:
    """``python -m kvconductor.serve.cluster worker ...`` (spawned by the owner only)."""
    from kvconductor.logs import configure_logging

    p = argparse.ArgumentParser(prog="kvconductor.serve.cluster")
    p.add_argument("role", choices=["worker"])
    p.add_argument("--number", type=int, required=True)
    p.add_argument("--owner-socket", required=True)
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--metrics-socket", required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--shared-fds", type=_fd_list, default=())
    args = p.parse_args(argv)
    _set_pdeathsig()
    control = socket.socket(fileno=args.control_fd)
    settings = settings_from_json(args.settings)
    configure_logging(settings.log_level, settings.log_format)
    set_process_role(f"worker-{args.number}")
    if os.getppid() != args.owner_pid:
        log.error("owner process gone before this worker started; exiting")
        return 1
    global SHARED_FDS
    SHARED_FDS = tuple(args.shared_fds)
    link = _OwnerLink(control)
    link.start()
    sys.setswitchinterval(SWITCH_INTERVAL)
    raise_fd_limit(1, settings.max_connections)
    tune_malloc()  # large answers reuse heap pages (kvconductor.state.conductor.tune_malloc)
    try:
        sock = bind_socket(settings.host, settings.port, reuse_port=True)
    except OSError as ex:
        report_bind_error(settings, ex)
        return 1
    app = create_worker_app(
        args.owner_socket,
        max_body_bytes=settings.max_body_bytes,
        allow_origins=settings.allow_origins,
    )
    if len(SHARED_FDS) >= 2:
        # /query and /query_by_hash answered here, from the owner's index in shared memory
        from kvconductor.http.api import create_query_app
        from kvconductor.state.shared import SharedView

        try:
            view = SharedView.attach(
                SHARED_FDS[0], SHARED_FDS[1], query_threads=WORKER_QUERY_THREADS
            )
        except (OSError, RuntimeError, ValueError) as ex:
            log.error("cannot attach the shared index: %s", ex)
            return 1
        app.query_handler = create_query_app(
            view, app.forward, max_body_bytes=settings.max_body_bytes, metrics=app.query_metrics
        )
        log.info(
            "shared index attached at %#x (directory generation %d)",
            view.arena.address,
            view.generation,
        )
    _serve_metrics(args.metrics_socket, app.query_metrics)
    # date_header off: the owner's answers carry theirs
    config = uvicorn_config(app, settings, date_header=False)

    server = WorkerServer(config, link.ready)
    link.server = server
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        app.owner.close()
        log.info("worker stopped")
    return 0


if __name__ == "__main__":
    from kvconductor.serve import (
        cluster as _cluster,  # module state lives in kvconductor.serve.cluster
    )

    sys.exit(_cluster.worker_main(sys.argv[1:]))
