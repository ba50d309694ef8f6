"""kvconductor.keys: worker identity and the node a pool event's backend id names."""

import pytest

from kvconductor.keys import node_of_backend_id


@pytest.mark.parametrize(
    "backend_id,node",
    [
        ("10.0.0.1", "10.0.0.1"),
        ("10.0.0.1:5558", "10.0.0.1"),
        ("tcp://10.0.0.1:5558", "10.0.0.1"),
        ("tcp://[::1]:5558", "::1"),
        ("[fd00::5]:1", "fd00::5"),
        ("fd00::5", "fd00::5"),
        ("node-3", "node-3"),
        ("node-3:x", "node-3:x"),
        ("tcp://", ""),
    ],
)
def test_node_of_backend_id(backend_id, node):
    assert node_of_backend_id(backend_id) == node
