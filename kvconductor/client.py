"""Coordinator-side HTTP client: kept for existing imports; the code lives in
:mod:`kvconductor.coordinator` (docs/client.md)."""

from kvconductor.coordinator import clients, core, registration, tokens
from kvconductor.coordinator.clients import *
from kvconductor.coordinator.core import *
from kvconductor.coordinator.registration import *
from kvconductor.coordinator.tokens import *
from kvconductor.schema import DEFAULT_PORT

__all__ = ["DEFAULT_PORT"]
__all__ += core.__all__ + clients.__all__ + registration.__all__ + tokens.__all__
