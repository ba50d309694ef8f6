"""The Coordinator side of kvconductor (docs/client.md): what a request router in
front of the engines uses to talk to the conductor and to pick a prefill endpoint.

* :mod:`~kvconductor.coordinator.affinity`: KV-affinity ranking (standard library only).

Their names are importable from here; they are loaded on first use, so
``import kvconductor.coordinator.affinity`` imports nothing else.
"""
from __future__ import annotations

import importlib
from typing import Any

_MODULES = ("affinity",)


def __getattr__(name: str) -> Any:
    for mod in _MODULES:
        module = importlib.import_module(f"{__name__}.{mod}")
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(n for mod in _MODULES for n in importlib.import_module(f"{__name__}.{mod}").__all__)
