"""The public gunicorn entry points, kept at their documented path.

``gunicorn -w 1 -k kvconductor.app.KvConductorWorker 'kvconductor.app:gunicorn_app()'``
(docs/operations.md). The code lives in :mod:`kvconductor.serve.gunicorn` (the factory
and the worker class) and :mod:`kvconductor.http.api` (the Falcon app); other names this
module had before the package was split into rooms still resolve, with a
``DeprecationWarning`` naming their new home.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvconductor.serve.gunicorn import KvConductorWorker, gunicorn_app

__all__ = ["KvConductorWorker", "gunicorn_app"]

#: Public names: no warning (gunicorn's documented ``-k`` and factory paths).
_PUBLIC = {
    "KvConductorWorker": "kvconductor.serve.gunicorn",
    "gunicorn_app": "kvconductor.serve.gunicorn",
}


def __getattr__(name: str) -> object:
    # Imported on use: `import kvconductor.app` needs neither gunicorn nor the server.
    home = _PUBLIC.get(name)
    if home is None:
        api = importlib.import_module("kvconductor.http.api")
        if not hasattr(api, name):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        warnings.warn(
            f"kvconductor.app.{name} moved to kvconductor.http.api.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(api, name)
    return getattr(importlib.import_module(home), name)
