"""kvconductor: a KV-cache index service for LLM inference clusters.

The compiled modules are mandatory: they are imported here, and an install
without them (or with a broken one) fails at this import. The pure-Python twins
(``kvconductor._py``, ``kvconductor.wire.py_*``, the general ingest path) are test
oracles, not a runtime fallback; they still use the compiled block hasher.

Which implementation serves is chosen here, once, for the whole package:
``KVCONDUCTOR_IMPL=c`` (the default) or ``py`` (the twins: index core, query
parser and encoder, token scanner, ingest fast path off), read at import into
:data:`IMPL`. ``Index(impl=...)`` and ``Applier(..., fast=False)`` pick per object.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

#: The compiled modules (setup.py ``MODULES``); every one is imported here.
COMPILED_MODULES = (
    "_hash",
    "_alloc",
    "_tree",
    "_lower",
    "_index",
    "_wire",
    "_encode",
    "_ingest",
    "_arena",
    "_shlock",
)

for _name in COMPILED_MODULES:
    # NOTE: an ImportError here is a broken install; it must never be swallowed.
    importlib.import_module(f"kvconductor.{_name}")
del _name


def _impl_from_env() -> str:
    impl = os.environ.get("KVCONDUCTOR_IMPL") or "c"
    if impl not in ("c", "py"):
        raise ValueError(f"KVCONDUCTOR_IMPL={impl!r}: expected 'c' or 'py'")
    return impl


#: ``"c"``: the compiled modules serve; ``"py"``: the pure-Python twins (tests, bench).
IMPL = _impl_from_env()


def is_available() -> bool:
    """True when every compiled module loaded (always, once this package imported)."""
    return True


def unavailable_reason() -> str | None:
    """Why the compiled modules did not load: ``None`` (a failed load fails the import)."""
    return None
