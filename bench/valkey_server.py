"""``ValkeyServer`` for the benchmarks run as scripts (``python bench/valkey_log.py``,
``python bench/replicas.py``): the test suite's helper, ``tests/helpers/valkey_server.py``,
so that one piece of code starts valkey-server for the tests and for the benchmarks.

A script run puts ``bench/`` on ``sys.path``, not the repository root, so ``tests.helpers``
is not importable by name from here; the helper (standard library only at module level) is
loaded from its file instead, and ``sys.path`` is left as it is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "valkey_server.py"
_spec = importlib.util.spec_from_file_location("kvc_bench_valkey_server", _PATH)
assert _spec is not None and _spec.loader is not None, _PATH
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

ValkeyServer = _module.ValkeyServer

__all__ = ["ValkeyServer"]
