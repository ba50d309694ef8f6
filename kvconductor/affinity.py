"""KV-affinity ranking: kept for existing imports; the code lives in
:mod:`kvconductor.coordinator.affinity` (docs/client.md)."""

from kvconductor.coordinator import affinity
from kvconductor.coordinator.affinity import *

__all__ = []
__all__ += affinity.__all__
