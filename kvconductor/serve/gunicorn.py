"""gunicorn: the app factory and the worker class
(``gunicorn -k kvconductor.app.KvConductorWorker 'kvconductor.app:gunicorn_app()'``).

uvicorn's ``UvicornWorker`` builds its ``uvicorn.Config`` before the app
(and so the kv-conductor flags) is loaded, and serves with uvicorn's stock
protocols: no request-head limit, no request deadline, no connection cap.
This subclass applies the flags of :func:`gunicorn_app`
(``--max-header-kb``, ``--request-timeout-secs``, ``--keep-alive-secs``,
``--max-connections`` and the ``--tls-*`` files) to that Config once the app
is loaded, and serves with kv-conductor's server class (quiet shutdown, TLS
handshake deadline), exactly like ``kv-conductor`` does.

gunicorn's own ``--keep-alive`` is replaced by ``--keep-alive-secs``; its
``--certfile``/``--keyfile``/``--ca-certs`` still work when no ``--tls-*``
flag is given.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shlex
import sys
from types import FrameType
from typing import Any

import falcon.asgi
from gunicorn.arbiter import Arbiter
from uvicorn_worker import UvicornWorker

from kvconductor.serve.bootstrap import build_service
from kvconductor.serve.single import KvServer, uvicorn_options

log = logging.getLogger("kvconductor.http")

#: Seconds a gunicorn worker's start waits for the snapshot directory's lock: on a
#: reload the old worker drains (3 s), writes its last snapshot and lets go first. Below
#: gunicorn's default worker timeout (30 s), which also bounds the lifespan startup.
GUNICORN_LOCK_WAIT = 20.0


class KvConductorWorker(UvicornWorker):
    """``UvicornWorker`` with kv-conductor's HTTP limits, TLS flags and shutdown."""

    async def _serve(self) -> None:
        settings = getattr(self.wsgi, "kvc_settings", None)
        if settings is not None:
            http = self.config.http
            if http not in ("httptools", "h11"):  # "auto"
                http = "httptools" if importlib.util.find_spec("httptools") else "h11"
            for name, value in uvicorn_options(settings, http).items():
                setattr(self.config, name, value)
        self.config.app = self.wsgi
        server = KvServer(config=self.config)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)


def _gunicorn_cfg() -> Any:
    """The parsed ``cfg`` of the gunicorn loading this app; ``None`` outside gunicorn.

    gunicorn calls the factory from its worker (or, with ``--preload``, from
    its application object); both hold it on the call stack.
    """
    try:
        from gunicorn.config import Config
    except ImportError:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        cfg = getattr(frame.f_locals.get("self"), "cfg", None)
        if isinstance(cfg, Config):
            return cfg
        frame = frame.f_back
    return None


def _gunicorn_port() -> int | None:
    """The port of the first TCP address gunicorn binds (``-b``); None outside gunicorn
    or with UNIX sockets only."""
    cfg = _gunicorn_cfg()
    for addr in getattr(cfg, "address", None) or ():
        if isinstance(addr, tuple) and len(addr) >= 2 and isinstance(addr[1], int):
            return addr[1]
    return None


def _gunicorn_workers() -> int | None:
    """``workers`` of the gunicorn loading this app (``-w``, ``WEB_CONCURRENCY``, config)."""
    cfg = _gunicorn_cfg()
    return None if cfg is None else cfg.workers


def gunicorn_app(*argv: str) -> falcon.asgi.App:
    """App factory for ``gunicorn -w 1 -k kvconductor.app.KvConductorWorker``.

    Flags are those of ``kv-conductor`` (``--host``/``--port`` are ignored:
    gunicorn binds), taken from ``KV_CONDUCTOR_ARGS`` and then ``argv``. The
    conductor starts on the ASGI lifespan startup, in the worker process.

    The HTTP limits and TLS flags are applied by :class:`KvConductorWorker`
    (kept on the returned app as ``kvc_settings``); under the stock
    ``uvicorn_worker.UvicornWorker`` the limits are not enforced (logged as a
    warning).

    A bad flag, or more than one worker (each would hold its own partial
    index), raises gunicorn's ``AppImportError``: the worker exits with
    gunicorn's "app failed to load" status and the master stops with the
    message, instead of restarting workers forever.
    """
    from gunicorn.errors import AppImportError

    from kvconductor.logs import configure_logging
    from kvconductor.serve.cli import FlagError, build_parser, settings_from_args

    args = shlex.split(os.environ.get("KV_CONDUCTOR_ARGS", "")) + list(argv)
    try:
        settings = settings_from_args(build_parser(raise_errors=True).parse_args(args))
    except FlagError as ex:
        raise AppImportError(
            f"{ex} [flags from KV_CONDUCTOR_ARGS and the factory: {shlex.join(args)}]"
        ) from None
    workers = _gunicorn_workers()
    if workers is not None and workers > 1:
        raise AppImportError(
            f"kv-conductor: error: gunicorn started with {workers} workers; the index lives in "
            "one process, so each worker would hold a different, partial index. "
            "Run with -w 1 (WEB_CONCURRENCY=1), or run `kv-conductor --workers "
            f"{workers}` (one process keeps the index, {workers} worker processes serve HTTP)."
        )
    if settings.workers > 1:
        raise AppImportError(
            "kv-conductor: error: --workers is not supported under gunicorn (gunicorn "
            "forks the workers itself); run `kv-conductor --workers N` instead"
        )
    for flag, port in (
        ("--mooncake-port", settings.mooncake_port),
        ("--dynamo-port", settings.dynamo_port),
    ):
        if port is not None:
            raise AppImportError(
                f"kv-conductor: error: {flag} is not supported under gunicorn (gunicorn "
                f"binds one address); run `kv-conductor {flag} PORT` instead"
            )
    configure_logging(settings.log_level, settings.log_format)
    # The default snapshot directory is that of the port gunicorn binds; a reload
    # (SIGHUP) starts the new worker before the old one stops: wait for its lock.
    settings = dataclasses.replace(
        settings.with_snapshot_default(_gunicorn_port()),
        snapshot_lock_wait=GUNICORN_LOCK_WAIT,
    )
    worker_class = getattr(_gunicorn_cfg(), "worker_class", None)
    if worker_class is not None and not _is_kv_worker(worker_class) and settings.tls_cert:
        raise AppImportError(
            "kv-conductor: error: --tls-cert needs gunicorn -k kvconductor.app.KvConductorWorker "
            "(other workers would serve plain HTTP; or use gunicorn's --certfile/--keyfile)"
        )
    if worker_class is not None and not _is_kv_worker(worker_class):
        log.warning(
            "worker class %s does not enforce the HTTP limits (--max-header-kb, "
            "--request-timeout-secs, --keep-alive-secs, --max-connections); run "
            "gunicorn with -k kvconductor.app.KvConductorWorker",
            getattr(worker_class, "__qualname__", worker_class),
        )
        # uvicorn's own protocol: every query goes through the ASGI app (the start line says so)
        settings = dataclasses.replace(settings, query_path="asgi")
    # The same process tuning, conductor, app and start line as `kv-conductor`; the ASGI
    # lifespan starts and stops the service in the worker process.
    service = build_service(settings, "gunicorn")
    service.log_start(gunicorn_workers=workers)
    app = service.app
    app.kvc_settings = settings  # read by KvConductorWorker
    return app


def _is_kv_worker(worker_class: Any) -> bool:
    return isinstance(worker_class, type) and issubclass(worker_class, KvConductorWorker)
