"""A worker process of ``kv-conductor --workers N`` (``python -m kvconductor.serve.worker``,
spawned by the owner, :mod:`kvconductor.serve.owner`, never forked: the owner has threads
and a ZeroMQ context).

A worker binds ``host:port`` with ``SO_REUSEPORT`` and listens (the kernel spreads new
connections over the workers), serves HTTP with the same limits and TLS flags as one
process, and runs the one front door (:class:`~kvconductor.http.front.FrontDoor`, built by
:func:`kvconductor.serve.bootstrap.build_service`): ``POST /query`` and ``POST
/query_by_hash`` answered here from the owner's index in shared memory
(:func:`kvconductor.http.api.query_routes` over a
:class:`~kvconductor.state.shared.SharedView`, counting in a
:class:`~kvconductor.http.metrics.QueryMetrics` the owner's ``/metrics`` sums), ``GET
/health`` answered here, and every other request forwarded to the owner over its UNIX
socket (:class:`kvconductor.serve.proxy.Forwarder`). The dialects' ports likewise
(:func:`dialect_sides`): Dynamo's queries answered here, the rest forwarded to the
owner's socket of that dialect.

**What a worker inherits**: the shared arena's and lock's descriptors (``--shared-fds
5,7``, :meth:`kvconductor.serve.owner.Owner.shared_fds`), one end of a socket pair with
the owner (``--control-fd``: :data:`READY` once it listens; :data:`STOP` and
:data:`FORCE` from the owner; the owner's pings, answered from the event loop
(:mod:`kvconductor.serve.heartbeat`); the owner's end closing ends the worker at once) and the
settings it needs as JSON (``--settings``, :func:`settings_json`: never the API key, the
owner checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import msgspec
import uvicorn

from kvconductor.logs import set_process_role
from kvconductor.serve.bootstrap import Service, StartFailed, build_service
from kvconductor.serve.heartbeat import PING, PONG
from kvconductor.serve.proxy import Forwarder, OwnerClient
from kvconductor.serve.settings import Settings
from kvconductor.serve.single import (
    KvServer,
    SideServer,
    bind_socket,
    dialect_socket_path,
    report_bind_error,
    run_beside,
    uvicorn_config,
)
from kvconductor.serve.workermetrics import serve_query_metrics

log = logging.getLogger("kvconductor.cluster")

#: Socket-pair messages: worker -> owner "listening"; owner -> worker "drain and stop",
#: "stop now" (messages, not signals: a worker that also got the signal itself, from a
#: terminal's Ctrl-C or systemd signalling the whole group, must not take the owner's
#: request for a second signal).
READY = b"R"
STOP = b"S"
FORCE = b"F"
#: ``prog`` of a worker's command line (``python -m kvconductor.serve.worker``).
WORKER_PROG = "kvconductor.serve.worker"
#: Settings a worker needs (never the API key: the owner checks it).
WORKER_FIELDS = (
    "query_path",
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
    "mooncake_port",
    "dynamo_port",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
)


def settings_json(settings: Settings) -> str:
    """The settings a worker needs, as JSON (``--settings``)."""
    return msgspec.json.encode({f: getattr(settings, f) for f in WORKER_FIELDS}).decode()


def settings_from_json(text: str) -> Settings:
    doc = msgspec.json.decode(text)
    doc["allow_origins"] = tuple(doc.get("allow_origins") or ())
    return Settings(**{k: v for k, v in doc.items() if k in WORKER_FIELDS})


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
        #: The loop serving the connections (set at startup): answers the owner's pings.
        self.loop: asyncio.AbstractEventLoop | None = None
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
        self.loop = asyncio.get_running_loop()
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
            self.control.send(READY)

    def _pong(self, n: int) -> None:
        """Answer ``n`` pings of the owner (on the event loop: a loop that does not run
        does not answer)."""
        with contextlib.suppress(OSError):
            self.control.send(PONG * n)

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
            loop = server.loop if server is not None else None
            if PING in data and loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: stopping
                    loop.call_soon_threadsafe(self._pong, data.count(PING))
            if server is None:  # still starting: nothing to drain
                if STOP in data or FORCE in data:
                    log.info("stop requested by the owner while starting")
                    logging.shutdown()
                    os._exit(0)
                continue
            # Plain flags the server's loop polls (uvicorn's own signal handler does the same).
            if STOP in data and not server.should_exit:
                log.info("stop requested by the owner, draining connections...")
                server.owner_stop = True
                server.should_exit = True
            if FORCE in data and not server.force_exit:
                log.warning("owner's second signal: closing connections without waiting")
                server.should_exit = server.force_exit = True


def _fd_list(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(",") if v.strip())


def worker_main(argv: list[str]) -> int:
    """``python -m kvconductor.serve.worker ...`` (spawned by the owner only)."""
    from kvconductor.logs import configure_logging

    p = argparse.ArgumentParser(prog=WORKER_PROG)
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
    link = _OwnerLink(control)
    link.start()
    try:
        service = build_service(
            settings, "worker", owner_socket=args.owner_socket, shared_fds=tuple(args.shared_fds)
        )
    except StartFailed:
        return 1
    try:
        sock = bind_socket(settings.host, settings.port, reuse_port=True)
    except OSError as ex:
        report_bind_error(settings, ex)
        return 1
    assert service.query_metrics is not None
    serve_query_metrics(args.metrics_socket, service.query_metrics)
    try:
        sides = dialect_sides(settings, service, os.path.dirname(args.owner_socket))
    except OSError:
        sock.close()
        return 1
    # date_header off: the owner's answers carry theirs
    config = uvicorn_config(service.app, settings, date_header=False)
    server = WorkerServer(config, link.ready)
    link.server = server

    def close() -> None:
        sock.close()
        for _, side_sock in sides:
            side_sock.close()

    if not sides:
        return service.run(lambda: server.run(sockets=[sock]), close, "worker stopped", log)
    return service.run(lambda: run_beside(server, sock, sides), close, "worker stopped", log)


def dialect_sides(
    settings: Settings, service: Service, private_dir: str
) -> list[tuple[SideServer, socket.socket]]:
    """The dialects' ports (``--mooncake-port``, ``--dynamo-port``) in this worker, bound
    with ``SO_REUSEPORT`` as the V3 port: Dynamo's queries answered here from the shared
    index (:func:`kvconductor.http.dynamo.create_query_app`), everything else forwarded
    to the owner's dialect socket (its registrations, the Mooncake dialect's queries,
    whose zero rows are the registry's). :class:`OSError` (logged) when a port cannot be
    bound."""
    from kvconductor.http.dialects import LocalFirst
    from kvconductor.http.dynamo import create_query_app
    from kvconductor.http.front import AnswerFromHead

    out: list[tuple[SideServer, socket.socket]] = []
    for name, port in (("mooncake", settings.mooncake_port), ("dynamo", settings.dynamo_port)):
        if port is None:
            continue
        try:
            sock = bind_socket(settings.host, port, reuse_port=True)
        except OSError as ex:
            report_bind_error(dataclasses.replace(settings, port=port), ex)
            for _, s in out:
                s.close()
            raise
        path = dialect_socket_path(private_dir, name)
        app: Any = Forwarder(OwnerClient(path), max_body_bytes=settings.max_body_bytes)
        if name == "dynamo" and service.view is not None:
            local = create_query_app(service.view, settings.max_body_bytes)
            app = LocalFirst(AnswerFromHead(local), ("/query", "/query_by_hash"), app)
        where = f"({name} dialect)"
        out.append((SideServer(uvicorn_config(app, settings, where, date_header=False)), sock))
    return out


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
