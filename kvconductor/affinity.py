"""KV-affinity ranking: kept for existing imports; the code lives in
:mod:`kvconductor.coordinator.affinity` (docs/client.md)."""
from kvconductor.coordinator.affinity import *  # noqa: F401,F403
from kvconductor.coordinator.affinity import __all__  # noqa: F401
