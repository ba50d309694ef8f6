"""Pure-Python twin of the cross-process lock's state machine (``kvconductor/_shlock.pxd``).

A deterministic model, no threads and no waiting: the reader slots {pid, stamp, active},
the writer mutex and preference flag and the ``reclaimed`` counter, changed by the
non-blocking steps the blocking calls are made of (``read_try`` is one attempt of
``read_enter``; ``write_begin`` then ``write_pending`` until 0 is ``write_enter``;
``write_yield`` and ``write_prefer`` are what a writer does around a reader stalled past
the bound). The differential tests drive it and the compiled lock through the same
sequences and compare the state after every step. Time (the stall bound), signals and
the stall counters of the blocking ``write_enter`` are not modelled.

A slot owner is dead when ``kill(pid, 0)`` says there is no such process, when the
start time the slot recorded (``/proc/<pid>/stat`` field 22, + 1) is not the process's
under that pid now (the pid was reused), or when it is a zombie (state ``Z``) whose
threads have all exited (field 20, ``num_threads``, is 1): it runs no code any more.
"""

from __future__ import annotations

import os
from collections.abc import Callable

OK = 0
EBUSY = 1
EINVAL = 2
EAGAIN = 3
SLOTS = 256


def _stat(pid: int) -> list[bytes] | None:
    """Fields 3, 4, ... of ``/proc/<pid>/stat``; None when it cannot be read."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()
    return fields if len(fields) > 22 - 3 else None


def proc_stamp(pid: int) -> int:
    """Start time of ``pid`` in clock ticks + 1; 0 when it cannot be read."""
    fields = _stat(pid)
    return int(fields[22 - 3]) + 1 if fields else 0


def owner_alive(pid: int, stamp: int) -> bool:
    """False when the owner (pid, stamp) of a slot is dead."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    if fields is None:
        return stamp == 0
    if stamp != 0 and int(fields[22 - 3]) + 1 != stamp:
        return False
    return not (fields[0] in (b"Z", b"X") and int(fields[20 - 3]) <= 1)


class SharedLockModel:
    """The slot table and writer flag of one lock; methods return the C codes.

    **Threading: one thread** (a model, not a lock).
    """

    def __init__(self, alive: Callable[[int, int], bool] = owner_alive) -> None:
        self.pids = [0] * SLOTS
        self.stamps = [0] * SLOTS
        self.active = [False] * SLOTS
        self.wlock = False  # a writer between write_begin and write_exit
        self.writer = False  # its preference: new readers wait
        self.reclaimed = 0
        self._alive = alive

    def _valid(self, slot: int) -> bool:
        return 0 <= slot < SLOTS and self.pids[slot] > 0

    def acquire(self, pid: int, stamp: int) -> int:
        """The first free slot, now owned by (pid, stamp); -1 when none is free."""
        if pid <= 0:
            return -1
        for i in range(SLOTS):
            if self.pids[i] == 0:
                self.pids[i] = pid
                self.stamps[i] = stamp
                return i
        return -1

    def release(self, slot: int) -> int:
        if not self._valid(slot) or self.active[slot]:
            return EINVAL
        self.pids[slot] = 0
        self.stamps[slot] = 0
        return OK

    def _clear(self, slot: int) -> None:
        self.pids[slot] = 0
        self.stamps[slot] = 0
        self.active[slot] = False
        self.reclaimed += 1

    def _reclaim_if_dead(self, slot: int) -> bool:
        pid = self.pids[slot]
        if pid <= 0 or self._alive(pid, self.stamps[slot]):
            return False
        self._clear(slot)
        return True

    def reclaim_dead(self) -> int:
        return sum(self._reclaim_if_dead(i) for i in range(SLOTS))

    def read_try(self, slot: int) -> int:
        """One attempt to enter: ``EAGAIN`` while the writer flag is set."""
        if not self._valid(slot) or self.active[slot]:
            return EINVAL
        if self.writer:
            return EAGAIN
        self.active[slot] = True
        return OK

    def read_exit(self, slot: int) -> int:
        if not self._valid(slot) or not self.active[slot]:
            return EINVAL
        self.active[slot] = False
        return OK

    def write_begin(self) -> int:
        if self.wlock:
            return EBUSY
        self.wlock = self.writer = True
        return OK

    def write_yield(self) -> int:
        """The writer stops preferring itself (a reader stalled): readers enter again."""
        if not self.wlock:
            return EINVAL
        self.writer = False
        return OK

    def write_prefer(self) -> int:
        if not self.wlock:
            return EINVAL
        self.writer = True
        return OK

    def write_pending(self) -> int:
        """Reclaim the active slots of dead owners; the active slots left."""
        n = 0
        for i in range(SLOTS):
            if self.active[i] and not self._reclaim_if_dead(i):
                n += 1
        return n

    def write_exit(self) -> int:
        if not self.wlock:
            return EINVAL
        self.wlock = self.writer = False
        return OK

    def slot(self, slot: int) -> tuple[int, int, int]:
        """(pid, stamp, active) of a slot."""
        return (self.pids[slot], self.stamps[slot], int(self.active[slot]))

    def stats(self) -> dict[str, object]:
        return {
            "slots_in_use": sum(p != 0 for p in self.pids),
            "active": sum(self.active),
            "reclaimed": self.reclaimed,
            "writer_waits": 0,
            "writer": self.wlock,
            "preferred": self.writer,
            "stalls": 0,
            "kills": 0,
        }
