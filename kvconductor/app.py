"""The public gunicorn entry points, kept at their documented path.

``gunicorn -w 1 -k kvconductor.app.KvConductorWorker 'kvconductor.app:gunicorn_app()'``
(docs/operations.md). The code lives in :mod:`kvconductor.serve.gunicorn` (the factory
and the worker class) and :mod:`kvconductor.http.api` (the Falcon app; its query
resources in :mod:`kvconductor.http.query`, what they share in
:mod:`kvconductor.http.resource`); other names this module had before the package was
split into rooms still resolve, with a ``DeprecationWarning`` naming their new home.
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


#: Where the other old names went: the Falcon app and the rooms split out of it.
_MOVED = ("kvconductor.http.api", "kvconductor.http.query", "kvconductor.http.resource")


def __getattr__(name: str) -> object:
    # Imported on use: `import kvconductor.app` needs neither gunicorn nor the server.
    home = _PUBLIC.get(name)
    if home is None:
        for moved in _MOVED:
            module = importlib.import_module(moved)
            if name in vars(module):
                break
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        # The module that defines it, when it only imports it from there.
        obj = getattr(module, name)
        where = getattr(obj, "__module__", None)
        if where in _MOVED:
            moved = where
        warnings.warn(
            f"kvconductor.app.{name} moved to {moved}.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return obj
    return getattr(importlib.import_module(home), name)
