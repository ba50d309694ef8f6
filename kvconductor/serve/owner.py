"""``kv-conductor --workers N``: the owner's supervision of its worker processes.

Modelled on uvicorn's ``supervisors/multiprocess.py``: this module starts the workers
(:mod:`kvconductor.serve.worker`), watches them, starts them again and stops them; it
serves nothing itself but its private sockets (the V3 app, and each dialect's,
``--mooncake-port``, ``--dynamo-port``, whose public ports it holds for the workers).
What the processes are and how they share the index: docs/design.md, "Processes"; the
workers' way to the owner: :mod:`kvconductor.serve.proxy`; their metrics:
:mod:`kvconductor.serve.workermetrics`.

**The port and the private directory**: the owner holds the public port bound (never
listening) and the port's lock (:mod:`kvconductor.serve.portlock`: a second ``--workers``
server on the same port refuses to start), and its UNIX sockets live in a private
directory (:mod:`kvconductor.serve.privatedir`).

**Supervision** (:class:`Owner`, on the owner's main thread's event loop): a worker that
exits is logged (WARN), :data:`on_worker_exit` is called, and it is spawned again after a
back-off (1 s doubling to 30 s; back to 1 s once a worker stayed up 60 s). With no other
worker listening, starting or due within :data:`RESPAWN_ALL_DOWN`, the back-off is cut to
that (1 s), so the public port is never without a listener for long. A worker the ingest
thread killed for stalling the shared lock (``--reader-stall-ms``: the lock's stall log,
which :mod:`kvconductor.serve.stalls` logs at WARN), or one the owner killed for not
answering its heartbeat (:mod:`kvconductor.serve.heartbeat`: stopped or frozen outside
a read), is restarted after 1 s, its back-off unchanged. Each worker holds one end of a
socket pair with the owner: it writes one byte when it listens (the owner logs
``worker-3 pid=1234 ready``), answers the owner's pings from its event loop, and exits
at once (status 1) when the owner's end closes, i.e. when the owner is gone, even by
SIGKILL (``PR_SET_PDEATHSIG`` sends it SIGTERM too, on Linux).

**Shutdown**: SIGTERM/SIGINT to the owner asks every worker to stop (a message on its
socket pair; a worker signalled directly too, by a terminal's Ctrl-C or systemd, drains
once), each drains like one process, the owner waits
:data:`~kvconductor.serve.single.GRACEFUL_SECS` plus :data:`STOP_MARGIN` (then SIGKILL),
stops its own server and the conductor, and exits 0. A second signal makes the workers
close their connections at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import uvicorn

from kvconductor.http.metrics import Sample
from kvconductor.logs import set_process_role
from kvconductor.serve.bootstrap import StartFailed, build_service
from kvconductor.serve.heartbeat import INTERVAL as HEARTBEAT_INTERVAL
from kvconductor.serve.heartbeat import PONG, Heartbeat, Watch
from kvconductor.serve.portlock import PortInUse, PortLock
from kvconductor.serve.privatedir import make_private_dir
from kvconductor.serve.settings import Settings
from kvconductor.serve.single import (
    GRACEFUL_SECS,
    KvServer,
    bind_socket,
    dialect_servers,
    format_address,
    report_bind_error,
    run_beside,
    uvicorn_config,
)
from kvconductor.serve.stalls import RECENT_STALLS, StallLog
from kvconductor.serve.worker import FORCE, READY, STOP, settings_json
from kvconductor.serve.workermetrics import fetch_query_samples

log = logging.getLogger("kvconductor.cluster")

#: First respawn delay of a worker that exited (seconds); doubles up to RESPAWN_MAX.
RESPAWN_FIRST = 1.0
RESPAWN_MAX = 30.0
#: A worker up this long resets its back-off to RESPAWN_FIRST.
RESPAWN_RESET = 60.0
#: With no worker listening, the next start is at most this far away (seconds) whatever
#: the back-off, so the public port refuses connections for about this plus a start-up.
RESPAWN_ALL_DOWN = 1.0
#: Seconds past GRACEFUL_SECS the owner waits for its workers to stop before SIGKILL.
STOP_MARGIN = 2.0
#: Keep-alive of the owner's UNIX-socket connections (the workers' pools).
OWNER_KEEP_ALIVE = 120.0
#: The module ``python -m`` runs in a worker process.
WORKER_MODULE = "kvconductor.serve.worker"

#: (Owner) callbacks called with the pid of a worker that exited (any cause), on the
#: owner's main thread, before it is spawned again. An exception is logged and ignored.
on_worker_exit: list[Callable[[int], None]] = []


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
    #: Its process's pings (from READY on; None before).
    heartbeat: Heartbeat | None = None

    @property
    def name(self) -> str:
        return f"worker-{self.number}"


class Owner:
    """The owner's worker supervision (main thread, in its event loop)."""

    def __init__(
        self, settings: Settings, tmpdir: str, owner_path: str, shared: Any = None
    ) -> None:
        #: The flags, with the address the public port is bound to (``host``, ``port``).
        self.settings = settings
        #: The shared index (:class:`~kvconductor.state.shared.SharedIndexes`): its
        #: descriptors go to every worker, its lock's stalls are logged here.
        self.shared = shared
        self.owner_path = owner_path
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
        self._settings_json = settings_json(settings)
        # stalled readers of the shared lock (main thread; the deque read by /workers)
        self._names: dict[int, str] = {}  # pid -> worker name, of every worker started
        self.stalls = StallLog(shared, settings.reader_stall_ms, self._names)
        #: Workers stopped or frozen outside a read: pinged, killed when silent.
        self.heartbeat = Watch(settings.reader_stall_ms, self._on_control)

    # -- spawning (main thread only: PR_SET_PDEATHSIG follows the spawning thread)

    def spawn(self, slot: _Slot) -> None:
        assert threading.current_thread() is threading.main_thread()
        parent, child = socket.socketpair()
        extra = self.shared_fds()
        cmd = [
            sys.executable,
            "-m",
            WORKER_MODULE,
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
        slot.heartbeat = None
        self._names[proc.pid] = slot.name
        if len(self._names) > 4 * len(self.slots) + RECENT_STALLS:
            for pid in list(self._names)[: len(self._names) // 2]:
                del self._names[pid]
        assert self._loop is not None
        self._loop.add_reader(parent.fileno(), self._on_control, slot)
        log.info("%s pid=%d started", slot.name, proc.pid)

    def shared_fds(self) -> list[int]:
        """File descriptors every worker inherits (``--shared-fds 5,7``): the shared
        arena and lock of the index; same numbers in the worker."""
        return [int(fd) for fd in self.shared.fds()] if self.shared is not None else []

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
        if PONG in data and slot.heartbeat is not None:
            slot.heartbeat.answered(data.count(PONG))
        if READY in data and not slot.ready and slot.proc is not None:
            slot.ready = True
            slot.heartbeat = Heartbeat()
            with self._lock:
                self._live[slot.proc.pid] = (slot.name, slot.proc.pid, slot.metrics_path)
            log.info(
                "%s pid=%d ready (listening on %s port %d)",
                slot.name,
                slot.proc.pid,
                self.settings.host,
                self.settings.port,
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
            self.stalls.check()
            if not self.stopping:
                self.heartbeat.check(self.slots, time.monotonic())
            self.reap()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

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
        for hook in [self._reclaim_reader_slots, *on_worker_exit]:
            try:
                hook(proc.pid)
            except Exception:
                log.exception("on_worker_exit hook failed for %s pid=%d", slot.name, proc.pid)
        if self.stopping:
            log.info("%s pid=%d stopped (%s)", slot.name, proc.pid, how)
            return
        self.stalls.check()  # a stall kill logged before the exit it caused
        stalled = self.stalls.reaped(proc.pid, code)
        silenced = self.heartbeat.reaped(proc.pid, code)
        if time.monotonic() - slot.started >= RESPAWN_RESET:
            slot.backoff = RESPAWN_FIRST
        # killed for stalling the shared index or for its silence: no crash, its back-off
        # stays as it was
        delay = self._respawn_delay(slot, RESPAWN_FIRST if stalled or silenced else None)
        if stalled or silenced:
            log.warning(
                "%s pid=%d exited (%s, killed for %s); restarting it in %gs",
                slot.name,
                proc.pid,
                how,
                "stalling the shared index" if stalled else "not answering the owner's heartbeat",
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

    def _reclaim_reader_slots(self, pid: int) -> None:
        """A worker exited: clear its reader slots of the shared lock now (the writer
        would reclaim them too, after its first 10 ms wait on one)."""
        if self.shared is not None:
            n = self.shared.reclaim_dead()
            if n:
                log.warning("cleared %d reader slots of exited worker pid=%d", n, pid)

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
                self.settings.port,
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
            self._tell_all(FORCE)

    def _tell_all(self, message: bytes) -> None:
        """Send ``message`` (:data:`STOP`, :data:`FORCE`) to every worker over its socket
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
        self._tell_all(STOP)
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

    @property
    def heartbeat_kills(self) -> int:
        return self.heartbeat.kills

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
                    "silent_ms": None
                    if proc is None or slot.heartbeat is None
                    else round(slot.heartbeat.silent(now) * 1000, 1),
                }
            )
        doc: dict[str, Any] = {
            "workers": workers,
            "restarts": self.restarts,
            "heartbeat": self.heartbeat.info(),
        }
        if self.shared is not None:
            doc["shared_lock"] = self.stalls.info()
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


class _Ports:
    """The owner's sockets and private directory, made once the shared index exists
    (:func:`serve_owner`), closed and removed at the end."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port_sock: socket.socket | None = None
        self.port_lock: PortLock | None = None
        self.tmpdir: str | None = None

    def supervise(self, shared: Any) -> Owner:
        """Bind the public port (held, never listened on), take its lock, make the private
        directory, and the :class:`Owner` over them (``build_service``'s ``supervise``)."""
        settings = self.settings
        try:
            self.port_sock = bind_socket(
                settings.host, settings.port, reuse_port=True, listen=False
            )
        except OSError as ex:
            report_bind_error(settings, ex)
            raise StartFailed(str(ex)) from None
        host = settings.host
        if self.port_sock.family == socket.AF_INET and ":" in host:  # no IPv6: fell back
            host = "0.0.0.0"
        port = self.port_sock.getsockname()[1]
        try:
            self.port_lock = PortLock.acquire(port)
        except (PortInUse, OSError) as ex:
            log.error("%s", ex)
            print(f"kv-conductor: error: {ex}", file=sys.stderr)
            raise StartFailed(str(ex)) from None
        try:
            self.tmpdir = make_private_dir()
        except OSError as ex:
            log.error("cannot create the owner's private directory: %s", ex)
            print(f"kv-conductor: error: cannot create a private directory: {ex}", file=sys.stderr)
            raise StartFailed(str(ex)) from None
        owner_path = os.path.join(self.tmpdir, "owner.sock")
        bound = dataclasses.replace(settings, host=host, port=port)
        return Owner(bound, self.tmpdir, owner_path, shared)

    def close(self) -> None:
        if self.port_sock is not None:
            self.port_sock.close()
        if self.port_lock is not None:
            self.port_lock.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def serve_owner(settings: Settings) -> int:
    """``kv-conductor --workers N`` (N > 1): the owner process. Returns the exit status."""
    set_process_role("owner")
    ports = _Ports(settings)
    try:
        try:
            service = build_service(settings, "owner", supervise=ports.supervise)
        except StartFailed:
            return 1
        owner = service.supervisor
        assert isinstance(owner, Owner) and ports.port_sock is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix_sock:
            unix_sock.bind(owner.owner_path)
            unix_sock.listen(2048)
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
            server = OwnerServer(uvicorn_config(service.app, private, "(owner socket)"), owner)
            assert service.conductor is not None
            try:  # the dialects' ports: the workers' too, the rest forwarded here
                private_dir = os.path.dirname(owner.owner_path)
                sides = dialect_servers(settings, service.conductor, (private_dir, private))
            except OSError:
                return 1

            def serve() -> None:
                if sides:
                    run_beside(server, unix_sock, sides)
                else:
                    server.run(sockets=[unix_sock])

            def close() -> None:
                owner.kill_all()
                for side, side_sock in sides:
                    side_sock.close()
                    side.release()

            service.log_start(format_address(ports.port_sock))
            if not service.start():
                close()
                return 1
            return service.run(serve, close, "KV conductor shut down", log)
    finally:
        ports.close()
