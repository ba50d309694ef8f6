"""The shared-memory arena (kvconductor/_arena.pyx): size classes, runs, coalescing,
punch-hole, growth, exhaustion, attach from another process, and the checker."""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from kvconductor._arena import DEFAULT_ADDRESS, DEFAULT_RESERVE, Arena
from kvconductor._py.arena import BLOCK_HDR, CHUNK, DATA_OFF, PAGE, chunk_bytes
from kvconductor._shlock import SharedLock

MiB = 1 << 20
KiB = 1 << 10
# Each test maps its arenas at its own addresses (1 GiB apart, below the default one).
_slots = itertools.count()


def next_address() -> int:
    return 0x300000000000 + next(_slots) * (1 << 30)


@pytest.fixture
def arena():
    a = Arena(reserve=256 * MiB, address=next_address())
    yield a
    a.check_invariants()
    a.close()


def off(a: Arena, p: int) -> int:
    return p - a.address


def test_default_geometry():
    a = Arena()
    try:
        assert a.address == DEFAULT_ADDRESS == 0x3F0000000000
        assert a.stats()["reserve"] == DEFAULT_RESERVE == 64 << 30
        p = a.malloc(10)
        a.write(p, b"0123456789")
        assert a.read(p, 10) == b"0123456789"
        a.check_invariants()
    finally:
        a.close()


def test_size_classes_share_a_chunk(arena):
    p1 = arena.malloc(1)
    p2 = arena.malloc(48)  # 48 + 16 = 64: still the smallest class
    p3 = arena.malloc(49)  # 128-byte class: its own chunk
    assert off(arena, p1) == DATA_OFF + PAGE + BLOCK_HDR
    assert p2 - p1 == 64
    assert off(arena, p3) == DATA_OFF + (chunk_bytes(0) + PAGE) + PAGE + BLOCK_HDR
    s = arena.stats()
    assert s["chunks"] == 2 and s["live_blocks"] == 3 and s["bytes_in_use"] == 64 + 64 + 128
    # the largest class (16 KiB) takes 32 blocks per chunk; one byte more is a run
    big = [arena.malloc(16 * KiB - BLOCK_HDR) for _ in range(33)]
    assert big[1] - big[0] == 16 * KiB
    assert arena.stats()["chunks"] == 4
    run = arena.malloc(16 * KiB - BLOCK_HDR + 1)
    assert (off(arena, run) - BLOCK_HDR) % PAGE == 0 and arena.stats()["chunks"] == 4


def test_reuse_after_free(arena):
    ps = [arena.malloc(100) for _ in range(5)]
    arena.free(ps[2])
    arena.free(ps[4])
    assert arena.malloc(112) == ps[4]  # LIFO per class
    assert arena.malloc(90) == ps[2]
    assert arena.stats()["live_blocks"] == 5


def test_runs_are_page_aligned_and_coalesce(arena):
    n = 3 * PAGE - BLOCK_HDR  # exactly three pages with the header
    a, b, c, guard = (arena.malloc(MiB + n) for _ in range(4))
    for p in (a, b, c, guard):
        assert (p - BLOCK_HDR) % PAGE == 0
    size = MiB + 3 * PAGE
    assert b - a == c - b == size
    arena.free(a)
    arena.free(c)
    assert arena.stats()["free_runs"] == 2
    arena.check_invariants()
    arena.free(b)  # merges with both neighbours
    s = arena.stats()
    assert s["free_runs"] == 1 and s["free_run_bytes"] == 3 * size
    assert arena.malloc(3 * size - BLOCK_HDR) == a


def test_best_fit_splits_the_smallest_run(arena):
    big = arena.malloc(5 * MiB)
    sep1 = arena.malloc(MiB + 100)
    small = arena.malloc(2 * MiB)
    sep2 = arena.malloc(MiB + 100)
    arena.free(big)
    arena.free(small)
    p = arena.malloc(MiB + 200)
    assert p == small  # the smaller free run fits: best fit, split at the front
    s = arena.stats()
    assert s["free_runs"] == 2
    arena.check_invariants()
    for q in (p, sep1, sep2):
        arena.free(q)
    s = arena.stats()
    assert (s["top"], s["free_runs"], s["live_blocks"]) == (DATA_OFF, 0, 0)


def test_freeing_the_last_run_lowers_top(arena):
    a = arena.malloc(3 * MiB)
    top = arena.stats()["top"]
    b = arena.malloc(3 * MiB)
    assert arena.stats()["top"] > top
    arena.free(b)
    assert arena.stats()["top"] == top and arena.stats()["free_runs"] == 0
    arena.free(a)
    assert arena.stats()["top"] == DATA_OFF


def test_realloc(arena):
    p = arena.malloc(100)
    arena.write(p, b"x" * 100)
    assert arena.realloc(p, 110) == p  # same 128-byte class
    q = arena.realloc(p, 1000)
    assert q != p and arena.read(q, 100) == b"x" * 100
    r = arena.realloc(q, 3 * MiB)
    assert arena.read(r, 100) == b"x" * 100
    assert arena.realloc(r, 3 * MiB + 10) == r  # same run size
    s = arena.realloc(r, 50)
    assert arena.read(s, 50) == b"x" * 50
    assert arena.stats()["live_blocks"] == 1
    assert arena.realloc(s, 1 << 40) == 0  # larger than the reservation: old block kept
    assert arena.read(s, 50) == b"x" * 50
    z = arena.realloc(0, 10)  # realloc(NULL) is malloc
    assert z and arena.stats()["live_blocks"] == 2


def _run(kib: int) -> int:
    """A request that takes a run of exactly ``kib`` KiB (its header included)."""
    return kib * KiB - BLOCK_HDR


def test_realloc_grows_the_top_run_in_place(arena):
    p = arena.malloc(_run(100))
    arena.write(p, b"a" * 64)
    arena.write(p + _run(100) - 64, b"z" * 64)
    top = arena.stats()["top"]
    assert off(arena, p) - BLOCK_HDR + 100 * KiB == top  # the run ends at top
    q = arena.realloc(p, _run(3 * 1024))  # 3 MiB: past the committed file too
    assert q == p
    assert arena.read(q, 64) == b"a" * 64
    assert arena.read(q + _run(100) - 64, 64) == b"z" * 64
    st = arena.stats()
    assert st["top"] == top - 100 * KiB + 3 * MiB
    assert st["committed"] >= st["top"] and st["live_blocks"] == 1
    assert st["bytes_in_use"] == 3 * MiB
    arena.check_invariants()


def test_realloc_grows_into_the_free_run_above(arena):
    a = arena.malloc(_run(64))
    b = arena.malloc(_run(256))
    c = arena.malloc(_run(64))  # keeps b's space below top
    arena.write(a, b"a" * 100)
    arena.free(b)
    assert arena.stats()["free_runs"] == 1
    q = arena.realloc(a, _run(128))  # takes the front of the free run
    assert q == a and arena.read(q, 100) == b"a" * 100
    st = arena.stats()
    assert st["free_runs"] == 1 and st["free_run_bytes"] == 192 * KiB
    assert st["bytes_in_use"] == 128 * KiB + 64 * KiB
    arena.check_invariants()
    q = arena.realloc(a, _run(320))  # all of it: nothing left free below c
    assert q == a and arena.read(q, 100) == b"a" * 100
    st = arena.stats()
    assert st["free_runs"] == 0 and st["free_run_bytes"] == 0
    arena.check_invariants()  # c no longer marked as following a free run
    arena.free(c)
    arena.free(q)
    assert arena.stats()["top"] == DATA_OFF


def test_realloc_moves_a_run_that_cannot_grow_in_place(arena):
    a = arena.malloc(_run(64))
    b = arena.malloc(_run(64))
    arena.write(a, b"a" * 100)
    q = arena.realloc(a, _run(128))  # b is live above it: a new run, contents copied
    assert q != a and arena.read(q, 100) == b"a" * 100
    arena.check_invariants()
    c = arena.malloc(_run(64))  # above q
    arena.free(b)  # a 128 KiB free run (a's and b's) below q
    r = arena.malloc(_run(4))
    arena.write(r, b"r" * 10)
    s = arena.realloc(r, _run(256))  # the free run above r is too small
    assert s != r and arena.read(s, 10) == b"r" * 10
    arena.check_invariants()
    for x in (c, q, s):
        arena.free(x)


def test_growth_by_ftruncate(arena):
    fd = arena.fileno()
    assert os.fstat(fd).st_size == arena.stats()["committed"] == DATA_OFF
    p = arena.malloc(9 * MiB)
    committed = arena.stats()["committed"]
    assert committed >= off(arena, p) + 9 * MiB and committed % CHUNK == 0
    assert os.fstat(fd).st_size == committed
    arena.write(p + 9 * MiB - 4, b"tail")
    arena.free(p)
    assert os.fstat(fd).st_size == committed  # never shrinks


def test_punch_hole_releases_freed_runs(arena):
    keep = arena.malloc(MiB + 1)
    p = arena.malloc(8 * MiB)
    guard = arena.malloc(MiB + 1)  # so the run is listed, not merged into top
    arena.write(p, b"\xa5" * (8 * MiB))
    fd = arena.fileno()
    before = os.fstat(fd).st_blocks
    arena.free(p)
    if arena.stats()["punched"] == 0:
        pytest.skip("fallocate(PUNCH_HOLE) unsupported here")
    after = os.fstat(fd).st_blocks
    assert before - after >= (8 * MiB - 2 * PAGE) // 512
    q = arena.malloc(8 * MiB)  # the punched run is reused, reading zeros
    assert q == p and arena.read(q + MiB, 16) == bytes(16)
    for x in (keep, guard, q):
        arena.free(x)


def test_exhaustion_returns_zero_and_stays_valid():
    a = Arena(reserve=4 * MiB, address=next_address())
    try:
        assert a.malloc(8 * MiB) == 0
        assert a.malloc(1 << 62) == 0
        got = []
        while (p := a.malloc(100_000)) != 0:
            got.append(p)
        assert got and a.malloc(3 * MiB) == 0
        a.check_invariants()
        assert a.stats()["committed"] == 4 * MiB == os.fstat(a.fileno()).st_size
        for p in got:
            a.free(p)
        a.check_invariants()
        assert a.stats()["live_blocks"] == 0
        # 100 kB is a run: all freed, they merged into free space from the first one on
        assert a.malloc(100_000) == got[0]
    finally:
        a.close()


def test_invalid_free_and_closed_arena(arena):
    p = arena.malloc(10)
    with pytest.raises(ValueError, match="no live block"):
        arena.free(p + 8)
    arena.free(p)
    with pytest.raises(ValueError, match="no live block"):
        arena.free(p)  # double free
    with pytest.raises(ValueError, match="outside"):
        arena.read(arena.address + (1 << 30), 1)
    arena.free(0)  # free(NULL)
    a = Arena(reserve=4 * MiB, address=next_address())
    a.close()
    with pytest.raises(ValueError, match="closed"):
        a.malloc(1)


CHILD = textwrap.dedent(
    """
    import sys
    from kvconductor._arena import Arena
    fd, address, reserve = (int(x) for x in sys.argv[1:4])
    a = Arena.attach(fd, address, reserve)
    for line in sys.stdin:
        addr, n = (int(x) for x in line.split())
        print(a.read(addr, n).hex(), a.stats()["committed"], flush=True)
    """
)


def test_attach_in_a_child_process(arena):
    p = arena.malloc(64)
    arena.write(p, b"parent wrote this")
    fd = arena.fileno()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(fd), str(arena.address), str(256 * MiB)],
        pass_fds=(fd,),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{p} 17\n")
        child.stdin.flush()
        data, committed = child.stdout.readline().split()
        assert bytes.fromhex(data) == b"parent wrote this"
        assert int(committed) == arena.stats()["committed"]
        # the file grows after the child mapped it: the child sees the new pages
        q = arena.malloc(20 * MiB)
        arena.write(q + 20 * MiB - 5, b"grown")
        child.stdin.write(f"{q + 20 * MiB - 5} 5\n")
        child.stdin.flush()
        data, committed = child.stdout.readline().split()
        assert bytes.fromhex(data) == b"grown"
        assert int(committed) == arena.stats()["committed"] > 20 * MiB
        child.stdin.close()
        assert child.wait() == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_attach_refuses_a_taken_range(arena):
    with pytest.raises(OSError, match="range is taken"):
        Arena.attach(arena.fileno(), arena.address, 256 * MiB)
    with pytest.raises(OSError, match="range is taken"):  # overlapping, not equal
        Arena.attach(arena.fileno(), arena.address + 128 * MiB, 256 * MiB)


def test_attach_checks_the_header(arena):
    # the same arena mapped a second time elsewhere in this process reads the same header
    view = Arena.attach(arena.fileno(), next_address(), 256 * MiB)
    try:
        with pytest.raises(RuntimeError, match="never allocates"):
            view.malloc(1)
        p = arena.malloc(10)
        arena.write(p, b"same bytes")
        assert view.read(view.address + off(arena, p), 10) == b"same bytes"
    finally:
        view.close()
    with pytest.raises(OSError, match="reserve"):
        Arena.attach(arena.fileno(), next_address(), 128 * MiB)
    fd = os.memfd_create("not-an-arena")
    try:
        with pytest.raises(OSError, match="no arena"):  # too small for a header
            Arena.attach(fd, next_address(), 4 * MiB)
        os.ftruncate(fd, DATA_OFF)
        with pytest.raises(OSError, match="bad magic"):
            Arena.attach(fd, next_address(), 4 * MiB)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("block_magic", "bad block magic"),
        ("live_count", "live_blocks"),
        ("free_list", "class 0 free list"),
    ],
)
def test_checker_catches_corruption(kind, message):
    a = Arena(reserve=16 * MiB, address=next_address())
    try:
        ps = [a.malloc(n) for n in (10, 20, 3 * MiB)]
        a.free(ps[1])
        a.check_invariants()
        a._corrupt_for_test(kind)
        with pytest.raises(AssertionError, match=message):
            a.check_invariants()
    finally:
        a.close()


def test_read_record_copies_header_and_data_in_one_read_section(arena):
    lock = SharedLock()
    rec = arena.malloc(32)
    data = arena.malloc(100)
    arena.write(data, bytes(range(100)))
    arena.write(rec, struct.pack("<QQQQ", 7, 9, data, 100))
    assert arena.read_record(lock, rec) == ((7, 9, data, 100), bytes(range(100)))
    arena.write(rec, struct.pack("<QQQQ", 1, 2, 0, 0))
    assert arena.read_record(lock, rec) == ((1, 2, 0, 0), b"")
    arena.write(rec, struct.pack("<QQQQ", 1, 2, data, 1 << 40))  # past the file
    with pytest.raises(ValueError, match="outside"):
        arena.read_record(lock, rec)
    st = lock.stats()
    assert st["active"] == 0 and st["slots_in_use"] == 1  # left the section every time
    lock.read_enter()
    with pytest.raises(RuntimeError, match="inside a read section"):
        arena.read_record(lock, rec)
    lock.read_exit()
