"""Coordinator-side HTTP client: kept for existing imports; the code lives in
:mod:`kvconductor.coordinator` (docs/client.md)."""

from kvconductor.coordinator import clients, core, registration, tokens
from kvconductor.coordinator.clients import *  # noqa: F403
from kvconductor.coordinator.core import *  # noqa: F403
from kvconductor.coordinator.registration import *  # noqa: F403
from kvconductor.coordinator.tokens import *  # noqa: F403
from kvconductor.settings import DEFAULT_PORT

__all__ = ["DEFAULT_PORT"]
__all__ += core.__all__ + clients.__all__ + registration.__all__ + tokens.__all__
