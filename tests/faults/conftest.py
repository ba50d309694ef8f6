"""The fault suite: the real server under message loss, restarts, floods and limits.

Every test here starts ``python -m kvconductor`` (``Server`` of
``tests/helpers/server.py``) and, for ZeroMQ cases, real publisher sockets
(``tests/helpers/publishers.py``; one engine registered with one server is
``tests/helpers/faults.py``'s ``Rig``, with the bodies, pool events and Mooncake-dialect
server the tests share; ``pubs`` below stops the publishers a test made); loops are
bounded in count and time and talk to loopback only. All tests carry the ``faults``
marker (``pytest -m faults``).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.server)


@pytest.fixture
def pubs():
    """Publishers a test creates (it appends them), stopped at teardown."""
    made: list = []
    yield made
    for p in made:
        p.stop()
