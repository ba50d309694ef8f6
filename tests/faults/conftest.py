"""The fault suite: the real server under message loss, restarts, floods and limits.

Every test here starts ``python -m kvconductor`` (``tests/test_server.py``'s
``Server``) and, for ZeroMQ cases, real publisher sockets
(``tests/publishers.py``); loops are bounded in count and time and talk to
loopback only. All tests carry the ``faults`` marker (``pytest -m faults``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_collection_modifyitems(items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.server)
