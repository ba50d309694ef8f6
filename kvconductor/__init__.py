"""kvconductor: a KV-cache index service for LLM inference clusters.

The compiled modules are mandatory for the service: :func:`load_compiled` imports
every one, and the index (:mod:`kvconductor.index`, which every server path imports)
calls it, so an install without them (or with a broken one) fails there. Importing
the package itself loads none of them: a Coordinator that only uses
:mod:`kvconductor.coordinator` needs no compiler output. The pure-Python twins
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

#: The compiled modules (setup.py ``MODULES``); :func:`load_compiled` imports every one.
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
    "_recv",
)


def load_compiled() -> None:
    """Import every compiled module; an ``ImportError`` is a broken install (the service
    calls this through :mod:`kvconductor.index` and must never swallow it)."""
    for name in COMPILED_MODULES:
        importlib.import_module(f"kvconductor.{name}")


def _impl_from_env() -> str:
    impl = os.environ.get("KVCONDUCTOR_IMPL") or "c"
    if impl not in ("c", "py"):
        raise ValueError(f"KVCONDUCTOR_IMPL={impl!r}: expected 'c' or 'py'")
    return impl


#: ``"c"``: the compiled modules serve; ``"py"``: the pure-Python twins (tests, bench).
IMPL = _impl_from_env()


def is_available() -> bool:
    """True when every compiled module loads (they are imported to find out)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the compiled modules do not load (the ``ImportError``'s text); ``None`` when
    they all do."""
    try:
        load_compiled()
    except ImportError as ex:
        return f"{type(ex).__name__}: {ex}"
    return None
