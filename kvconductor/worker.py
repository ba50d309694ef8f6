"""gunicorn worker class: ``gunicorn -k kvconductor.app.KvConductorWorker``.

uvicorn's ``UvicornWorker`` builds its ``uvicorn.Config`` before the app
(and so the kv-conductor flags) is loaded, and serves with uvicorn's stock
protocols: no request-head limit, no request deadline, no connection cap.
This subclass applies the flags of :func:`kvconductor.app.gunicorn_app`
(``--max-header-kb``, ``--request-timeout-secs``, ``--keep-alive-secs``,
``--max-connections`` and the ``--tls-*`` files) to that Config once the app
is loaded, and serves with kv-conductor's server class (quiet shutdown, TLS
handshake deadline), exactly like ``kv-conductor`` does.

gunicorn's own ``--keep-alive`` is replaced by ``--keep-alive-secs``; its
``--certfile``/``--keyfile``/``--ca-certs`` still work when no ``--tls-*``
flag is given.
"""

from __future__ import annotations

import importlib.util
import sys

from gunicorn.arbiter import Arbiter
from uvicorn_worker import UvicornWorker


class KvConductorWorker(UvicornWorker):
    """``UvicornWorker`` with kv-conductor's HTTP limits, TLS flags and shutdown."""

    async def _serve(self) -> None:
        from kvconductor.server import KvServer, uvicorn_options

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
