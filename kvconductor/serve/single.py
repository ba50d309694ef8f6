"""Run the app with uvicorn in this process: bind, serve, drain on a signal, stop.

One process, one uvicorn worker (uvloop + httptools when installed): the
process owns the index, so there is nothing to share between workers.

``::`` binds one dual-stack socket (``IPV6_V6ONLY`` off) so IPv4 clients
reach it too; when the host has no IPv6 it falls back to ``0.0.0.0`` and
logs it. On SIGTERM/SIGINT uvicorn stops accepting, lets in-flight requests
finish (at most :data:`GRACEFUL_SECS`), closes what is left (one WARN line, no
tracebacks), then the conductor closes its subscriptions and stops the ingest
thread; a second signal ends the drain at once. Exit status 0 either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Coroutine, Generator, Sequence
from types import FrameType
from typing import Any

import uvicorn

from kvconductor.http.front import AnswerFromHead, FrontDoor
from kvconductor.http.limits import HttpLimits, h11_buffer_limit, protocol_class
from kvconductor.serve.bootstrap import (
    STOP_SECS,
    StartFailed,
    build_service,
)
from kvconductor.serve.portlock import PortInUse, PortLock
from kvconductor.serve.settings import Settings
from kvconductor.serve.tuning import TRIM_SECS, open_file_limits, trim_heap
from kvconductor.state.conductor import Conductor

log = logging.getLogger("kvconductor")

#: Seconds uvicorn waits for in-flight requests after a shutdown signal.
GRACEFUL_SECS = 3
_NO_IPV6 = {errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT}
#: File descriptors kept for everything but HTTP connections: listener, epoll, log
#: files, threads, and the ZeroMQ context and sockets of the subscriptions (about 4
#: per subscribed URL). See docs/security.md, "File descriptors".
FD_RESERVE = 256


def bind_socket(
    host: str, port: int, *, reuse_port: bool = False, listen: bool = True
) -> socket.socket:
    """A listening TCP socket on ``host`` (an IP literal); ``::`` is dual-stack.

    ``reuse_port``: set ``SO_REUSEPORT`` (``kv-conductor --workers N``: every worker
    binds the same address and the kernel spreads connections). ``listen=False``:
    bound only (the owner of ``--workers`` holds the port this way; a bound socket
    that does not listen takes no connections).

    Raises :class:`OSError` when the address cannot be bound.
    """
    ip = ipaddress.ip_address(host)
    if ip.version == 6:
        try:
            return _listen(
                socket.AF_INET6,
                (host, port, 0, 0),
                dual_stack=ip.is_unspecified,
                reuse_port=reuse_port,
                listen=listen,
            )
        except OSError as ex:
            if not ip.is_unspecified or ex.errno not in _NO_IPV6:
                raise
            log.warning("IPv6 unavailable (%s); falling back to 0.0.0.0", ex.strerror or ex)
            host = "0.0.0.0"
    return _listen(
        socket.AF_INET, (host, port), dual_stack=False, reuse_port=reuse_port, listen=listen
    )


def _listen(
    family: int, addr: tuple, dual_stack: bool, reuse_port: bool = False, listen: bool = True
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        sock.bind(addr)
        if listen:
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


class KvServer(uvicorn.Server):
    """uvicorn server with a quiet shutdown.

    * The first SIGTERM/SIGINT logs ``received shutdown signal, draining
      connections...`` and starts the drain; a second one (either signal) logs
      a warning and ends the drain at once. Signals are not re-raised after.
    * Over TLS, a handshake must finish within the request deadline
      (:meth:`startup`).
    * :meth:`shutdown` replaces uvicorn's: stop accepting, close idle
      connections, wait up to ``timeout_graceful_shutdown`` for requests in
      flight, then close the remaining connections (their requests read a
      disconnect and end) and cancel what still runs. One WARN line says so;
      uvicorn's ERROR lines and the CancelledError tracebacks of cancelled
      requests (see :class:`_EndQuietlyOnShutdown`) are not produced.
    * ``trim_heap=True`` (the worker processes of ``--workers N``, which have no ingest
      thread to do it): every ``TRIM_SECS`` the event loop gives freed heap memory back
      to the system (:func:`kvconductor.serve.tuning.trim_heap`), so a worker that answered
      a few very long prompts does not keep their parse buffers' pages.
    """

    def __init__(self, config: uvicorn.Config, trim_heap: bool = False) -> None:
        super().__init__(config)
        if not isinstance(config.app, str):
            config.app = _EndQuietlyOnShutdown(config.app, self)
        self._trim_ticks = round(TRIM_SECS * 10) if trim_heap else 0  # on_tick: every 0.1 s

    async def on_tick(self, counter: int) -> bool:
        if self._trim_ticks and counter and counter % self._trim_ticks == 0:
            trim_heap()
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if not self.should_exit:
            log.info("received shutdown signal, draining connections... signal=%s", name)
            self.should_exit = True
        elif not self.force_exit:
            log.warning(
                "second shutdown signal (%s): closing connections without waiting for "
                "requests in flight",
                name,
            )
            self.force_exit = True

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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, with a TLS handshake deadline of ``--request-timeout-secs``.

        asyncio gives a TLS handshake 60 s, and the protocol (so the request
        deadline and the connection cap) only sees a connection once its
        handshake is done.
        """
        config = self.config
        limits = getattr(getattr(config, "http_protocol_class", None), "limits", None)
        if config.ssl is None or sockets is None or not isinstance(limits, HttpLimits):
            return await super().startup(sockets=sockets)
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(3)  # uvicorn's STARTUP_FAILURE

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=_loop,
            )

        loop = asyncio.get_running_loop()
        self.servers = []
        for sock in sockets:
            self.servers.append(
                await loop.create_server(
                    create_protocol,
                    sock=sock,
                    ssl=config.ssl,
                    backlog=config.backlog,
                    ssl_handshake_timeout=limits.request_timeout,
                )
            )
        self.started = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        state = self.server_state
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for conn in list(state.connections):
            conn.shutdown()  # idle: closed now; busy: closed after its response
        grace = self.config.timeout_graceful_shutdown
        if grace is None:  # gunicorn's worker leaves it unset
            grace = GRACEFUL_SECS
        deadline = loop.time() + grace
        while (state.connections or state.tasks) and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if state.connections:
            why = "second signal" if self.force_exit else f"drain exceeded {grace:g}s"
            log.warning(
                "shutdown: closing %d connection(s) with requests in flight (%s)",
                len(state.connections),
                why,
            )
            for conn in list(state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            await asyncio.sleep(0.05)  # connection_lost: requests now read a disconnect
        deadline = loop.time() + STOP_SECS / 3
        while state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if state.tasks:
            tasks = list(state.tasks)
            log.warning("shutdown: cancelling %d request(s) still running", len(tasks))
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=STOP_SECS / 3)
        for server in self.servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        # Always (uvicorn skips it on a forced exit): under gunicorn this stops the conductor.
        await self.lifespan.shutdown()


class _EndQuietlyOnShutdown:
    """ASGI wrapper: a request cancelled by a stopping server ends with an INFO line.

    uvicorn logs an app that raises ``CancelledError`` at ERROR with a
    traceback; at shutdown that is the expected end of a request whose client
    was cut off.
    """

    #: Nothing to do for a query the protocol answers itself (kvconductor.http.direct):
    #: such a request is never cancelled.
    transparent = True

    def __init__(self, app: Any, server: uvicorn.Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.server.should_exit:
                raise
            log.info(
                "request cancelled by shutdown method=%s path=%s",
                scope.get("method"),
                scope.get("path"),
            )


def fit_connection_cap(limits: HttpLimits) -> tuple[HttpLimits, int | None]:
    """``limits`` with ``max_connections`` fitted to the open-file limit, and that
    limit (``None``: unlimited or unknown).

    The limit was raised at start (:func:`~kvconductor.serve.tuning.raise_fd_limit`). If
    ``max_connections + FD_RESERVE`` does not fit in it, the cap is lowered (to
    ``max(limit - FD_RESERVE, limit // 2)``) with a warning, so a flood of connections
    meets the cap before accept() fails with EMFILE.
    """
    soft, hard = open_file_limits()
    if soft is None:
        return limits, None
    if limits.max_connections + FD_RESERVE <= soft:
        return limits, soft
    room = max(soft - FD_RESERVE, soft // 2, 1)
    log.warning(
        "the open-file limit %d (hard %s) leaves room for %d HTTP connections; "
        "--max-connections lowered from %d to %d (raise it with ulimit -n or "
        "LimitNOFILE=)",
        soft,
        "unlimited" if hard is None else hard,
        room,
        limits.max_connections,
        room,
    )
    return dataclasses.replace(limits, max_connections=room), soft


def uvicorn_options(settings: Settings, http: str, where: str = "") -> dict:
    """The ``uvicorn.Config`` options of the HTTP limits (and TLS) of ``settings``.

    ``http``: ``"httptools"`` or ``"h11"``, the parser the protocol builds on.
    ``where``: said in the log line after ``HTTP limits`` (``kv-conductor --workers``:
    ``(owner socket)``).
    """
    limits, fd_limit = fit_connection_cap(settings.http_limits())
    log.info(
        "HTTP limits%s %s fd_limit=%s %s",
        where and f" {where}",
        limits.describe(),
        "unlimited" if fd_limit is None else fd_limit,
        settings.describe_http(),
    )
    options: dict = {
        "http": protocol_class(limits, http, direct=settings.query_path_used() == "protocol"),
        "ws": "none",  # no WebSocket routes: upgrades are plain requests
        "timeout_keep_alive": limits.keep_alive,
        "h11_max_incomplete_event_size": h11_buffer_limit(limits),
    }
    if settings.tls_cert:
        options.update(
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
            ssl_ca_certs=settings.tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_client_ca else ssl.CERT_NONE,
        )
    return options


def uvicorn_config(app: Any, settings: Settings, where: str = "", **extra: Any) -> uvicorn.Config:
    """The ``uvicorn.Config`` kv-conductor serves ``app`` with: uvloop and httptools when
    installed, no lifespan, no log config of uvicorn's, access log at debug level, the
    drain of :data:`GRACEFUL_SECS`, no ``Server`` header, and :func:`uvicorn_options`
    (``where``: see there); ``extra`` adds or overrides options."""
    loop, http = _uvicorn_impls()
    options: dict[str, Any] = {
        "loop": loop,
        "lifespan": "off",
        "log_config": None,
        "access_log": logging.getLogger().isEnabledFor(logging.DEBUG),
        "timeout_graceful_shutdown": GRACEFUL_SECS,
        "server_header": False,
        **uvicorn_options(settings, http, where),
    }
    options.update(extra)
    if isinstance(app, FrontDoor) and options.get("proxy_headers", True):
        # the proxy headers apply to the front door's rest only (FrontDoor.trust_proxies)
        options["proxy_headers"] = False
        config = uvicorn.Config(app, **options)
        app.trust_proxies(config.forwarded_allow_ips or "127.0.0.1")
        return config
    return uvicorn.Config(app, **options)


def _uvicorn_impls() -> tuple[str, str]:
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if (loop, http) != ("uvloop", "httptools"):
        log.warning("uvloop/httptools not installed; using loop=%s http=%s", loop, http)
    return loop, http


def report_bind_error(settings: Settings, ex: OSError) -> None:
    """The ERROR line and the stderr line of a port that cannot be bound."""
    log.error(
        "failed to bind TCP listener host=%s port=%d error=%s", settings.host, settings.port, ex
    )
    print(
        f"kv-conductor: error: failed to bind TCP listener on {settings.host} port "
        f"{settings.port}: {ex.strerror or ex}",
        file=sys.stderr,
    )


class SideServer(KvServer):
    """A second server in the main server's event loop (a dialect's port: ``--mooncake-port``,
    ``--dynamo-port``): it leaves the signals to the main one, which stops it after its
    own drain (:func:`run_beside`)."""

    #: ``--workers N``: the dialect's public port, bound and held by the owner (its
    #: workers listen there), and its lock (a second ``--workers`` server of the same
    #: user could share the port otherwise), released with the server's own socket.
    held: socket.socket | None = None
    lock: PortLock | None = None

    def release(self) -> None:
        for held in (self.held, self.lock):
            if held is not None:
                held.close()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def dialect_socket_path(private_dir: str, name: str) -> str:
    """The owner's UNIX socket of dialect ``name`` in its private directory (``--workers
    N``: its workers forward there what they do not answer themselves)."""
    return os.path.join(private_dir, f"{name}.sock")


#: The dialects' ports: the flag's name (``--NAME-port``, ``--NAME-port-open``, the
#: settings' ``NAME_port`` and ``NAME_open``) and the name in the start line.
_DIALECTS = (("mooncake", "Mooncake conductor"), ("dynamo", "Dynamo indexer"))


def _dialect_app(name: str, conductor: Conductor, settings: Settings, key: str | None) -> Any:
    from kvconductor.http.dialects import Door
    from kvconductor.http.dynamo import create_dynamo_app
    from kvconductor.http.mooncake import create_mooncake_app

    limit, open_workers = settings.max_body_bytes, settings.open_workers
    if name == "mooncake":
        app = create_mooncake_app(
            conductor, max_body_bytes=limit, api_key=key, open_services=open_workers
        )
    else:
        app = create_dynamo_app(conductor, Door(limit, key, open_workers))
    return AnswerFromHead(app)  # 401 and 413 from the head, as on the V3 port


def dialect_servers(
    settings: Settings, conductor: Conductor, private: tuple[str, Settings] | None = None
) -> list[tuple[SideServer, socket.socket]]:
    """The dialects' servers of ``settings`` (``--mooncake-port``, ``--dynamo-port``), each
    with its socket, over ``conductor``: one process's, on the dialect's port with the V3
    port's HTTP limits and TLS; or the owner's of ``--workers N`` (``private``: its
    private directory and the settings of its private socket), on a UNIX socket there
    (:func:`dialect_socket_path`), the public port bound and held (``SideServer.held``)
    for its workers, which listen on it. :class:`OSError` (logged, the sockets bound so
    far closed) when a port cannot be bound."""
    out: list[tuple[SideServer, socket.socket]] = []
    for name, title in _DIALECTS:
        port = getattr(settings, f"{name}_port")
        if port is None:
            continue
        try:
            sock = bind_socket(settings.host, port, reuse_port=bool(private), listen=not private)
        except OSError as ex:
            report_bind_error(dataclasses.replace(settings, port=port), ex)
            for server, s in out:
                s.close()
                server.release()
            raise
        is_open = getattr(settings, f"{name}_open")
        key = None if is_open else settings.api_key
        app = _dialect_app(name, conductor, settings, key)
        where = format_address(sock)
        served_as = settings
        if private is not None:
            try:
                lock = PortLock.acquire(sock.getsockname()[1])
            except (PortInUse, OSError) as ex:
                log.error("%s", ex)
                print(f"kv-conductor: error: {ex}", file=sys.stderr)
                sock.close()
                for server, s in out:
                    s.close()
                    server.release()
                raise OSError(str(ex)) from None
            held, served_as = sock, private[1]
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(dialect_socket_path(private[0], name))
            sock.listen(2048)
        side = SideServer(uvicorn_config(app, served_as, f"({name} dialect)"))
        if private is not None:
            side.held, side.lock = held, lock
        out.append((side, sock))
        log.info("%s dialect listening on %s auth=%s", title, where, "token" if key else "off")
        if settings.api_key and is_open:
            log.warning(
                "--%s-port-open: the %s dialect on %s takes /register and /unregister "
                "without the --api-key: anyone who reaches it can re-point or remove any "
                "engine's registration",
                name,
                title,
                where,
            )
    return out


def run_beside(
    server: KvServer, sock: socket.socket, sides: Sequence[tuple[KvServer, socket.socket]]
) -> None:
    """Serve ``server`` on ``sock`` and each of ``sides`` on its socket in one event loop
    until a shutdown signal (the main server's); the sides drain after ``server``."""

    async def all_of_them() -> None:
        tasks = [asyncio.ensure_future(side.serve(sockets=[s])) for side, s in sides]
        try:
            await server.serve(sockets=[sock])
        finally:
            for side, _ in sides:
                side.should_exit = True
            await asyncio.gather(*tasks)

    run_in_loop(all_of_them(), server.config.loop)


def run_in_loop(main: Coroutine[Any, Any, None], loop: str) -> None:
    """Run ``main`` to its end in a new event loop of the kind ``loop`` names (the
    ``uvicorn.Config``'s ``loop``: ``"uvloop"`` or ``"asyncio"``), as ``uvicorn.Server.run``
    does for one server. Our own code, not uvicorn's: its loop setup moved between the
    releases of the tested range (``Config.setup_event_loop`` before 0.36,
    ``Config.get_loop_factory`` and the private ``uvicorn._compat`` after)."""
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main)
        return
    event_loop = factory()  # pragma: no cover (Python 3.10)
    asyncio.set_event_loop(event_loop)
    try:
        event_loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        event_loop.close()


def serve(settings: Settings) -> int:
    """Serve in this one process until a shutdown signal; returns the process exit status
    (``--workers N > 1`` is :func:`kvconductor.serve.owner.serve_owner`). With
    ``--mooncake-port`` and ``--dynamo-port`` the dialects are served on those ports too,
    in the same event loop (:func:`dialect_servers`)."""
    try:
        service = build_service(settings, "single")
    except StartFailed:
        return 1
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as ex:
        report_bind_error(settings, ex)
        return 1
    try:
        assert service.conductor is not None
        sides = dialect_servers(settings, service.conductor)
    except OSError:
        sock.close()
        return 1
    server = KvServer(uvicorn_config(service.app, settings))
    service.log_start(format_address(sock))

    def close() -> None:
        sock.close()
        for _, side_sock in sides:
            side_sock.close()

    if not service.start():
        close()
        return 1
    if not sides:
        return service.run(lambda: server.run(sockets=[sock]), close, "KV conductor shut down")
    return service.run(lambda: run_beside(server, sock, sides), close, "KV conductor shut down")
