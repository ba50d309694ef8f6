"""Run the app with uvicorn in this process: bind, serve, drain on a signal, stop.

One process, one uvicorn worker (uvloop + httptools when installed): the
process owns the index, so there is nothing to share between workers.

``::`` binds one dual-stack socket (``IPV6_V6ONLY`` off) so IPv4 clients
reach it too; when the host has no IPv6 it falls back to ``0.0.0.0`` and
logs it. On SIGTERM/SIGINT uvicorn stops accepting, lets in-flight requests
finish (at most :data:`GRACEFUL_SECS`), then the conductor closes its
subscriptions and stops the ingest thread; a second signal forces the exit.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from kvconductor.app import create_app
from kvconductor.cli import Settings
from kvconductor.service import Conductor, fds_needed, raise_fd_limit

log = logging.getLogger("kvconductor")

#: GIL switch interval of the serving process (seconds; Python's default is 0.005).
SWITCH_INTERVAL = 0.0005
#: Seconds uvicorn waits for in-flight requests after a shutdown signal.
GRACEFUL_SECS = 3
#: Seconds the conductor gets to close subscriptions and stop the ingest thread.
STOP_SECS = 3.0
_NO_IPV6 = {errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT}


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (an IP literal); ``::`` is dual-stack.

    Raises :class:`OSError` when the address cannot be bound.
    """
    ip = ipaddress.ip_address(host)
    if ip.version == 6:
        try:
            return _listen(socket.AF_INET6, (host, port, 0, 0), dual_stack=ip.is_unspecified)
        except OSError as ex:
            if not ip.is_unspecified or ex.errno not in _NO_IPV6:
                raise
            log.warning("IPv6 unavailable (%s); falling back to 0.0.0.0", ex.strerror or ex)
            host = "0.0.0.0"
    return _listen(socket.AF_INET, (host, port), dual_stack=False)


def _listen(family: int, addr: tuple, dual_stack: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def format_address(sock: socket.socket) -> str:
    """``[::]:13333`` / ``0.0.0.0:13333`` (Rust ``SocketAddr`` style)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn server that logs the signal and does not re-raise it after draining."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("received shutdown signal, draining connections... signal=%s",
                     signal.Signals(sig).name)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _uvicorn_impls() -> tuple[str, str]:
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if (loop, http) != ("uvloop", "httptools"):
        log.warning("uvloop/httptools not installed; using loop=%s http=%s", loop, http)
    return loop, http


def serve(settings: Settings) -> int:
    """Serve until a shutdown signal; returns the process exit status."""
    # PERF: large queries hash and match in worker threads without the GIL, but
    # hand it back between steps; a short switch interval keeps the event loop's
    # small queries from waiting the default 5 ms for it.
    sys.setswitchinterval(SWITCH_INTERVAL)
    raise_fd_limit(fds_needed(settings.max_sources))
    conductor = Conductor(settings.conductor_config())
    app = create_app(conductor, max_body_bytes=settings.max_body_bytes, api_key=settings.api_key,
                     fast_query=True)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as ex:
        log.error("failed to bind TCP listener host=%s port=%d error=%s",
                  settings.host, settings.port, ex)
        print(f"kv-conductor: error: failed to bind TCP listener on {settings.host} port "
              f"{settings.port}: {ex.strerror or ex}", file=sys.stderr)
        return 1
    loop, http = _uvicorn_impls()
    config = uvicorn.Config(
        app, loop=loop, http=http, lifespan="off", log_config=None,
        access_log=logging.getLogger().isEnabledFor(logging.DEBUG),
        timeout_graceful_shutdown=GRACEFUL_SECS, server_header=False,
    )
    server = _Server(config)
    log.info("KV conductor starting on %s version=%s %s switch_interval=%s",
             format_address(sock), _version(), settings.describe(), sys.getswitchinterval())
    conductor.start()
    try:
        server.run(sockets=[sock])
    finally:
        if not conductor.stop(STOP_SECS):
            log.warning("ingest thread did not stop within %ss", STOP_SECS)
        sock.close()
        log.info("KV conductor shut down")
    return 0


def _version() -> str:
    from kvconductor import __version__

    return __version__
