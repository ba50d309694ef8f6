"""Coordinator-side HTTP client: kept for existing imports; the code lives in
:mod:`kvconductor.coordinator` (docs/client.md)."""

from kvconductor.coordinator import breaker, clients, core, exchange, registration, tokens
from kvconductor.coordinator.breaker import *
from kvconductor.coordinator.clients import *
from kvconductor.coordinator.core import *
from kvconductor.coordinator.exchange import *
from kvconductor.coordinator.registration import *
from kvconductor.coordinator.tokens import *
from kvconductor.schema import DEFAULT_PORT

__all__ = ["DEFAULT_PORT"]
__all__ += (
    breaker.__all__
    + exchange.__all__
    + core.__all__
    + clients.__all__
    + registration.__all__
    + tokens.__all__
)
