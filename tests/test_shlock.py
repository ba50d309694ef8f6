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
from pathlib import Path

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


# -- stalled readers (a process stopped inside its read section) -------------------------

# A reader process that enters a read section, says so, and leaves it when a line comes
# on stdin (then says "out"); a second line ends it.
PARKED = """
import sys
from kvconductor._shlock import SharedLock
lock = SharedLock.attach(int(sys.argv[1]))
lock.read_enter()
print("inside", flush=True)
sys.stdin.readline()
lock.read_exit()
print("out", flush=True)
sys.stdin.readline()
"""


def _stats_until(lock: SharedLock, key: str, value, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = lock.stats()
        if st[key] == value:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.002)


def _reader_gets_in(lock: SharedLock, timeout: float) -> bool:
    """A thread of this process enters and leaves a read section within ``timeout``."""
    done = threading.Event()

    def read():
        with lock.reading():
            done.set()

    threading.Thread(target=read, daemon=True).start()
    return done.wait(timeout)


def test_a_stopped_reader_is_killed_past_the_bound_and_the_others_go_on():
    """A reader process stopped (SIGSTOP) inside its read section: after the stall bound
    the writer stops holding the other readers back, SIGKILLs the stopped child,
    reclaims its slot once it is dead (not reaped yet: a zombie), then gets in."""
    lock = SharedLock()
    lock.set_stall_policy(200, kill=True)
    assert lock.stall_policy() == (200, True)
    p = _spawn(STUCK, lock.fileno())
    p.send_signal(signal.SIGSTOP)
    inside = threading.Event()
    waited = []

    def write():
        t0 = time.monotonic()
        with lock.writing():
            waited.append(time.monotonic() - t0)
            inside.set()

    w = threading.Thread(target=write, daemon=True)
    w.start()
    _stats_until(lock, "writer", True)
    assert inside.wait(20), lock.stats()
    assert waited[0] >= 0.2
    # SIGKILL reaches a stopped process; nobody reaped it: the writer saw the zombie
    deadline = time.monotonic() + 10
    while p.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert p.returncode == -signal.SIGKILL
    st = lock.stats()
    assert (st["stalls"], st["kills"], st["reclaimed"]) == (1, 1, 1), st
    assert st["slots_in_use"] == 0 and st["active"] == 0
    (entry,) = lock.stall_log()
    assert entry["pid"] == p.pid and entry["killed"] and entry["state"] == "T"
    assert 0.2 <= entry["waited_s"] < 10
    assert lock.stall_log(after=entry["seq"]) == []
    assert lock.stalling() is None
    w.join(5)
    hist = lock.wait_histogram()
    assert hist["count"] == 1 and sum(hist["counts"]) == 1 and hist["sum"] >= 0.2
    assert len(hist["counts"]) == len(hist["bounds"]) + 1 == len(_shlock.WAIT_BOUNDS) + 1
    p.stdin.close()
    p.stdout.close()


def test_a_stalled_reader_that_may_not_be_killed_holds_back_the_writer_only():
    """Without the kill policy the writer waits for the stopped reader as long as it
    takes (it never writes under a live reader), but stops preferring itself after the
    bound: other readers keep getting in. The reader, resumed, leaves; the writer enters."""
    lock = SharedLock()
    lock.set_stall_policy(100, kill=False)
    p = _spawn(PARKED, lock.fileno())
    assert p.stdin is not None and p.stdout is not None
    p.send_signal(signal.SIGSTOP)
    inside = threading.Event()

    def write():
        with lock.writing():
            inside.set()

    w = threading.Thread(target=write, daemon=True)
    w.start()
    _stats_until(lock, "stalls", 1)
    assert lock.stalling()["pid"] == p.pid
    for _ in range(5):  # readers come and go while the writer waits
        assert _reader_gets_in(lock, 10)
    assert not inside.is_set()
    st = lock.stats()
    assert st["writer"] and not st["preferred"] and st["kills"] == 0
    assert p.poll() is None
    p.send_signal(signal.SIGCONT)
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "out"
    assert inside.wait(20)
    w.join(5)
    (entry,) = lock.stall_log()
    assert (entry["pid"], entry["killed"], entry["state"]) == (p.pid, False, "T")
    assert lock.stalling() is None and lock.stats()["reclaimed"] == 0
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(10) == 0
    p.stdout.close()


def test_without_a_bound_readers_wait_behind_the_writer():
    """stall_ms 0 (a new lock's policy): the writer keeps its preference while it waits
    for a live reader, so new readers wait too."""
    lock = SharedLock()
    assert lock.stall_policy() == (0, False)
    p = _spawn(PARKED, lock.fileno())
    assert p.stdin is not None and p.stdout is not None
    w = threading.Thread(target=lambda: lock.writing().__enter__(), daemon=True)
    w.start()
    _stats_until(lock, "writer", True)
    assert not _reader_gets_in(lock, 0.4)
    assert lock.stats()["stalls"] == 0
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "out"
    w.join(10)
    assert lock.stats()["writer"]
    lock.write_exit()
    assert _reader_gets_in(lock, 10)  # the reader left over from above got in too
    p.stdin.write("\n")
    p.stdin.close()
    p.wait(10)
    p.stdout.close()


def test_a_zombie_reader_is_dead():
    """A reader process killed inside its section and not reaped yet (a zombie) runs no
    code: its slot is reclaimed without waiting for the parent to reap it."""
    lock = SharedLock()
    p = _spawn(STUCK, lock.fileno())
    os.kill(p.pid, signal.SIGKILL)  # no wait(): stays a zombie
    deadline = time.monotonic() + 10
    while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert lock._write_begin_for_test() == _shlock.OK
    while lock._write_pending_for_test() != 0:  # its other threads may still be exiting
        assert time.monotonic() < deadline, lock.stats()
        time.sleep(0.005)
    assert lock.stats()["reclaimed"] == 1
    assert lock._write_exit_for_test() == _shlock.OK
    assert p.wait(10) == -signal.SIGKILL
    p.stdin.close()
    p.stdout.close()


def test_yield_and_prefer_steps():
    lock = SharedLock()
    me = os.getpid()
    s = lock._acquire_for_test(me, proc_stamp(me))
    assert lock._write_yield_for_test() == _shlock.EINVAL  # no writer
    assert lock._write_prefer_for_test() == _shlock.EINVAL
    assert lock._write_begin_for_test() == _shlock.OK
    assert lock._read_try_for_test(s) == _shlock.EAGAIN
    assert lock._write_yield_for_test() == _shlock.OK
    st = lock.stats()
    assert st["writer"] and not st["preferred"]
    assert lock._write_begin_for_test() == _shlock.EBUSY  # still one writer
    assert lock._read_try_for_test(s) == _shlock.OK
    assert lock._write_prefer_for_test() == _shlock.OK
    assert lock._write_pending_for_test() == 1
    assert lock._read_exit_for_test(s) == _shlock.OK
    assert lock._read_try_for_test(s) == _shlock.EAGAIN
    assert lock._write_exit_for_test() == _shlock.OK
    assert lock.stats()["preferred"] is False
    assert lock._read_try_for_test(s) == _shlock.OK


def test_writer_wait_histogram_counts_every_write_section():
    lock = SharedLock()
    for _ in range(3):
        with lock.writing():
            pass
    hist = lock.wait_histogram()
    assert hist["count"] == 3 and hist["counts"][0] == 3 and hist["sum"] == 0
    assert hist["bounds"] == list(_shlock.WAIT_BOUNDS)
    assert list(_shlock.WAIT_BOUNDS) == sorted(_shlock.WAIT_BOUNDS)
