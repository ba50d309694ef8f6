"""The cross-process reader/writer lock (kvconductor/_shlock.pyx): mutual exclusion
across threads and processes, a reader killed inside its read section, the pid-reuse
defence, writer preference and the single-writer guard."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvconductor import _shlock
from kvconductor._shlock import SharedLock, SharedLockError, proc_stamp

# A reader process: attaches to the lock (fd argv[1]) and the shared flags (fd argv[2]:
# byte 0 = "a writer is inside", byte 1 = "stop"), loops read sections checking that no
# writer is inside, and prints "<sections> <violations>".
READER = """
import mmap, sys
from kvconductor._shlock import SharedLock
lock = SharedLock.attach(int(sys.argv[1]))
flags = mmap.mmap(int(sys.argv[2]), 4096)
n = bad = 0
print("ready", flush=True)
while not flags[1]:
    with lock.reading():
        if flags[0]:
            bad += 1
        n += 1
print(n, bad, flush=True)
"""

# A reader process that enters a read section and stays there until killed.
STUCK = """
import sys
from kvconductor._shlock import SharedLock
lock = SharedLock.attach(int(sys.argv[1]))
lock.read_enter()
print("inside", flush=True)
sys.stdin.read()
"""


def _spawn(script: str, *fds: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, fds)],
        pass_fds=fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    first = p.stdout.readline().strip()
    assert first in ("ready", "inside"), first
    return p


def test_mutual_exclusion_threads_and_processes():
    lock = SharedLock()
    fd = os.memfd_create("flags")
    os.ftruncate(fd, 4096)
    flags = mmap.mmap(fd, 4096)
    procs = [_spawn(READER, lock.fileno(), fd) for _ in range(2)]
    stop = threading.Event()
    counts = []
    bad = []

    def reader():
        n = b = 0
        while not stop.is_set():
            with lock.reading():
                if flags[0]:
                    b += 1
                n += 1
        counts.append(n)
        bad.append(b)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    writes = 0
    while writes < 100:
        with lock.writing():
            flags[0] = 1
            time.sleep(0.0002)
            flags[0] = 0
        writes += 1
        time.sleep(0.0005)
    stop.set()
    flags[1] = 1
    for t in threads:
        t.join()
    for p in procs:
        out, _ = p.communicate(timeout=30)
        n, b = map(int, out.split())
        counts.append(n)
        bad.append(b)
    assert bad == [0, 0, 0, 0]
    assert all(n > 0 for n in counts), counts
    st = lock.stats()
    assert st["active"] == 0 and not st["writer"]
    assert st["reclaimed"] == 0
    # the threads gave their slots back when they ended, the processes when they exited
    assert st["slots_in_use"] == 0
    assert lock.reclaim_dead() == 0
    flags.close()
    os.close(fd)


def test_reader_killed_inside_its_read_section():
    lock = SharedLock()
    p = _spawn(STUCK, lock.fileno())
    assert lock.stats()["active"] == 1
    done = threading.Event()

    def write():
        with lock.writing():
            done.set()

    t = threading.Thread(target=write)
    t.start()
    # the writer waits on the live reader ...
    while lock.stats()["writer_waits"] < 2:
        time.sleep(0.005)
    assert not done.is_set() and lock.stats()["active"] == 1
    # ... and not on a dead one
    p.send_signal(signal.SIGKILL)
    p.wait()
    t.join(timeout=2)
    assert done.is_set()
    assert lock.stats()["reclaimed"] == 1
    assert lock.stats()["slots_in_use"] == 0
    with lock.reading():
        assert lock.stats()["active"] == 1
    with lock.writing():
        pass
    p.stdin.close()
    p.stdout.close()


def test_pid_reuse_defence():
    lock = SharedLock()
    me = os.getpid()
    real = proc_stamp(me)
    assert real > 0
    alive = lock._acquire_for_test(me, real)
    reused = lock._acquire_for_test(me, real + 1)  # our pid, another process's start
    gone = lock._acquire_for_test(2**30, 1)  # beyond pid_max: no such process
    for s in (alive, reused, gone):
        assert lock._read_try_for_test(s) == _shlock.OK
    assert lock._write_begin_for_test() == _shlock.OK
    assert lock._write_pending_for_test() == 1  # only the live reader is waited for
    assert lock.stats()["reclaimed"] == 2
    assert lock._slot_for_test(reused) == (0, 0, 0)
    assert lock._slot_for_test(gone) == (0, 0, 0)
    assert lock._slot_for_test(alive) == (me, real, 1)
    assert lock._read_exit_for_test(alive) == _shlock.OK
    assert lock._write_pending_for_test() == 0
    assert lock._write_exit_for_test() == _shlock.OK
    # an idle slot of a dead owner is reclaimed by reclaim_dead, a live one is not
    assert lock._acquire_for_test(2**30, 1) >= 0
    assert lock.reclaim_dead() == 1
    assert lock.stats()["slots_in_use"] == 1


def test_writer_waits_for_readers_inside_and_new_readers_wait_for_it():
    lock = SharedLock()
    order: list[str] = []
    inside = threading.Event()
    leave = threading.Event()
    release_writer = threading.Event()

    def first_reader():
        with lock.reading():
            inside.set()
            leave.wait()
            order.append("R1 out")

    def writer():
        with lock.writing():
            order.append("W")
            release_writer.wait()

    def second_reader():
        with lock.reading():
            order.append("R2")

    r1 = threading.Thread(target=first_reader)
    r1.start()
    inside.wait()
    w = threading.Thread(target=writer)
    w.start()
    while not lock.stats()["writer"]:
        time.sleep(0.001)
    r2 = threading.Thread(target=second_reader)
    r2.start()
    while lock.stats()["slots_in_use"] < 2:  # R2 took its slot: about to read
        time.sleep(0.001)
    time.sleep(0.05)
    assert order == []  # R2 waits for the waiting writer, the writer for R1
    leave.set()
    while "W" not in order:
        time.sleep(0.001)
    assert order == ["R1 out", "W"]
    release_writer.set()
    r2.join()
    w.join()
    r1.join()
    assert order == ["R1 out", "W", "R2"]


def test_second_concurrent_writer_is_refused():
    lock = SharedLock()
    other = SharedLock.attach(lock.fileno())
    lock.write_enter()
    with pytest.raises(SharedLockError):
        other.write_enter()
    assert other._write_begin_for_test() == _shlock.EBUSY
    lock.write_exit()
    with pytest.raises(SharedLockError):
        lock.write_exit()
    with other.writing():
        assert lock.stats()["writer"]


def test_usage_errors():
    lock = SharedLock()
    with pytest.raises(SharedLockError):
        lock.read_exit()
    lock.read_enter()
    with pytest.raises(SharedLockError):
        lock.read_enter()  # sections do not nest
    lock.read_exit()
    fd = os.memfd_create("empty")
    os.ftruncate(fd, 1 << 16)
    with pytest.raises(SharedLockError):
        SharedLock.attach(fd)  # no lock in it
    os.close(fd)


def test_slots_run_out_and_come_back():
    lock = SharedLock()
    taken = [
        lock._acquire_for_test(os.getpid(), proc_stamp(os.getpid())) for _ in range(_shlock.SLOTS)
    ]
    assert sorted(taken) == list(range(_shlock.SLOTS))
    with pytest.raises(SharedLockError):
        lock.read_enter()
    assert lock._release_for_test(taken[0]) == _shlock.OK
    with lock.reading():
        pass


def test_thread_ended_inside_its_read_section_does_not_block_the_writer():
    lock = SharedLock()
    t = threading.Thread(target=lock.read_enter)  # ends without read_exit
    t.start()
    t.join()
    # its locals (and slot) are gone with it: the section was left, the slot given back
    assert lock.stats()["active"] == 0 and lock.stats()["slots_in_use"] == 0
    with lock.writing():
        assert lock.stats()["writer"]
