"""kvconductor: a KV-cache index service for LLM inference clusters."""
from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

#: The compiled modules; all must load for :func:`is_available` to be true.
COMPILED_MODULES = ("_hash", "_tree", "_lower", "_index", "_wire", "_encode", "_ingest")


def _load_compiled() -> tuple[bool, str | None]:
    if os.environ.get("KVCONDUCTOR_NO_EXTENSIONS"):
        return False, "KVCONDUCTOR_NO_EXTENSIONS is set"
    for name in COMPILED_MODULES:
        try:
            importlib.import_module(f"kvconductor.{name}")
        except ImportError as ex:
            return False, f"kvconductor.{name}: {ex}"
    return True, None


_AVAILABLE, _UNAVAILABLE_REASON = _load_compiled()


def is_available() -> bool:
    """True only when every compiled module of the index loaded."""
    return _AVAILABLE


def unavailable_reason() -> str | None:
    """Why the compiled modules did not load, or ``None``."""
    return _UNAVAILABLE_REASON
