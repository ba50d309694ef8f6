"""Coordinator-side HTTP client: kept for existing imports; the code lives in
:mod:`kvconductor.coordinator` (docs/client.md)."""
from kvconductor.coordinator.clients import *  # noqa: F401,F403
from kvconductor.coordinator.clients import __all__ as _clients
from kvconductor.coordinator.core import *  # noqa: F401,F403
from kvconductor.coordinator.core import __all__ as _core
from kvconductor.coordinator.registration import *  # noqa: F401,F403
from kvconductor.coordinator.registration import __all__ as _registration
from kvconductor.coordinator.tokens import *  # noqa: F401,F403
from kvconductor.coordinator.tokens import __all__ as _tokens
from kvconductor.settings import DEFAULT_PORT  # noqa: F401

__all__ = ["DEFAULT_PORT", *_core, *_clients, *_registration, *_tokens]
