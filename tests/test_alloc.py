"""The one structure allocator (kvconductor/_alloc.pyx): one install of the shared arena
routes the structure memory of every compiled core module, on the installing thread
only, and one uninstall ends it."""

from __future__ import annotations

import itertools
import threading

import pytest

from kvconductor import _alloc, _index
from kvconductor._arena import Arena
from kvconductor._lower import LowerTier
from kvconductor._tree import RadixTree

# Each test maps its arena at its own address (1 GiB apart).
_slots = itertools.count()


@pytest.fixture
def arena():
    a = Arena(reserve=256 << 20, address=0x2A0000000000 + next(_slots) * (1 << 30))
    yield a
    a.check_invariants()
    a.close()


def _live(a: Arena) -> int:
    return a.stats()["live_blocks"]


def test_one_install_routes_every_module(arena):
    _alloc.install_arena(arena)
    try:
        assert _alloc.arena_writing()
        t = RadixTree()
        assert t.store(1, None, [100, 101], [1, 2]) == 2
        after_tree = _live(arena)
        assert after_tree > 0  # _tree's blocks, with no install of its own
        lt = LowerTier()
        assert lt.store(2, None, [200, 201], [1, 2]) == 2
        after_lower = _live(arena)
        assert after_lower > after_tree  # _lower's too
        core = _index.CoreIndex()
        core.set_worker(0, 0, 0)
        assert core.store(0, None, [300], [1]) == 1
        assert _live(arena) > after_lower  # and _index's
        del t, lt, core  # freed on the writer thread: back to the arena
        assert _live(arena) == 0
    finally:
        _alloc.install_arena(None)
    assert not _alloc.arena_writing()
    t = RadixTree()
    t.store(1, None, [100], [1])
    assert _live(arena) == 0  # uninstalled: plain malloc again
    assert _alloc._arena_leaks() == 0


def test_other_threads_keep_malloc(arena):
    seen = {}

    def other():
        seen["writing"] = _alloc.arena_writing()
        t = RadixTree()
        t.store(1, None, [100, 101], [1, 2])
        seen["live"] = _live(arena)

    _alloc.install_arena(arena)
    try:
        th = threading.Thread(target=other)
        th.start()
        th.join()
    finally:
        _alloc.install_arena(None)
    assert seen == {"writing": False, "live": 0}
