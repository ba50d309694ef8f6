"""The Coordinator side of kvconductor (docs/client.md): what a request router in
front of the engines uses to talk to the conductor and to pick a prefill endpoint.

* :mod:`~kvconductor.coordinator.core`: the sans-I/O client core (requests built,
  answers decoded and mapped to errors, the route plans);
* :mod:`~kvconductor.coordinator.breaker`: the client's errors and its circuit breaker;
* :mod:`~kvconductor.coordinator.exchange`: what a plan exchanges with its driver
  (``Request``, ``Reply``, ``TransportFailure``, ``resume``) and the reading of a reply;
* :mod:`~kvconductor.coordinator.clients`: ``ConductorClient`` and
  ``AsyncConductorClient``, which only send what the core builds (``httpx``);
* :mod:`~kvconductor.coordinator.tokens`: token-id encodings of query bodies;
* :mod:`~kvconductor.coordinator.registration`: the Coordinator configuration
  and its registration payloads;
* :mod:`~kvconductor.coordinator.affinity`: KV-affinity ranking (standard library only).

The names of all seven are importable from here; they are loaded on first use, so
``import kvconductor.coordinator.affinity`` does not import ``httpx``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Searched in this order: the ones that import less first.
_MODULES = ("affinity", "tokens", "registration", "breaker", "exchange", "core", "clients")


def __getattr__(name: str) -> Any:
    if name in _MODULES:  # ``from kvconductor.coordinator import affinity``
        return importlib.import_module(f"{__name__}.{name}")
    for mod in _MODULES:
        module = importlib.import_module(f"{__name__}.{mod}")
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(
        n for mod in _MODULES for n in importlib.import_module(f"{__name__}.{mod}").__all__
    )
