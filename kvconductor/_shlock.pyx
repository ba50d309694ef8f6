# cython: language_level=3
"""The cross-process reader/writer lock (``_shlock.pxd``) over a shared mapping.

:class:`SharedLock` maps a memfd (a new one, or one passed from another process) and
runs the lock's C functions on it without the GIL: the owner and the worker processes
of ``kv-conductor --workers N`` share one (``kvconductor/state/shared.py``).
"""
cimport cython
from libc.stdint cimport int32_t, uint32_t, uint64_t
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap

import os
import threading

# The return codes of the C functions, for tests.
OK = SHL_OK
EBUSY = SHL_EBUSY
EINVAL = SHL_EINVAL
EAGAIN = SHL_EAGAIN
#: Reader slots in the table: reading threads of all processes together.
SLOTS = SHL_SLOTS
#: Upper bounds (seconds) of the buckets of :meth:`SharedLock.wait_histogram` (a last
#: bucket, +Inf, follows).
WAIT_BOUNDS = tuple(shl_hist_bounds[i] / 1e9 for i in range(SHL_HIST - 1))
#: Stall log entries the lock keeps (:meth:`SharedLock.stall_log`): older ones are
#: overwritten.
STALL_LOG = SHL_LOG


class SharedLockError(RuntimeError):
    """A usage error of the lock (second writer, exit without enter, no free slot)."""


cdef class _Mapping:
    """The mapping of one lock; unmapped when the last user (lock or slot) is gone."""

    def __dealloc__(self):
        if self.lock != NULL:
            munmap(self.lock, self.size)
            self.lock = NULL


@cython.no_gc_clear
cdef class _Slot:
    """One thread's reader slot, given back when the thread's locals go (thread end)
    or the lock is dropped. A thread that ended inside its read section leaves it
    then, so it cannot hold the writer off for ever."""
    cdef _Mapping map
    cdef int index

    def __dealloc__(self):
        if self.map is not None and self.index >= 0:
            if self.map.lock.slots[self.index].active:
                shl_read_exit(self.map.lock, self.index)
            shl_slot_release(self.map.lock, self.index)


cdef uint64_t _own_stamp = 0
cdef int32_t _own_pid = 0


cdef uint64_t _stamp(int32_t pid) noexcept:
    """This process's start stamp (read once per pid)."""
    global _own_stamp, _own_pid
    if _own_pid != pid:
        _own_stamp = shl_proc_stamp(pid)
        _own_pid = pid
    return _own_stamp


def proc_stamp(int pid):
    """The start stamp the lock records for ``pid`` (start time + 1; 0: unreadable)."""
    return shl_proc_stamp(pid)


def owner_alive(int pid, uint64_t stamp):
    """The lock's judgement of a slot owner (pid, stamp): False once it is dead (gone,
    pid recycled, or a zombie whose threads have all exited)."""
    return bool(shl_owner_alive(pid, stamp))


cdef class SharedLock:
    """A robust reader/writer lock shared by processes, in a memfd mapping.

    ``SharedLock()`` creates a new lock in a new memfd; ``SharedLock.attach(fd)`` maps
    the lock of another process (the fd passed with ``pass_fds``), checking its magic
    and layout version. :meth:`fileno` is the fd to pass on.

    **Threading rule:** any number of threads of any number of processes may read;
    a thread calls :meth:`read_exit` after its own :meth:`read_enter` (sections do not
    nest). Each reading thread takes one of the ``SLOTS`` reader slots on its first
    read and keeps it until it ends (a dead process's slots are reclaimed by the
    writer). **One writer at a time** (the owner's ingest thread): a second concurrent
    :meth:`write_enter` raises :class:`SharedLockError`. A writer preempts new readers
    and waits for the readers already inside, ``timeout_ms`` per futex wait, checking
    after each timeout whether the reader's process is still alive. The waits release
    the GIL.

    **Stalled readers** (:meth:`set_stall_policy`, kept in the shared lock itself): a
    reader still inside ``stall_ms`` after the writer started waiting for it no longer
    holds the other readers back (the writer clears its preference); with ``kill``,
    the writer SIGKILLs it if it is a child process of the writer's. The writer enters
    only once that reader left its section or is dead. :meth:`stall_log`,
    :meth:`stalling` and :meth:`wait_histogram` tell what happened.
    """

    def __cinit__(self):
        self.fd = -1
        self.lock = NULL

    def __init__(self, fd=None):
        cdef size_t size = sizeof(ShLock)
        cdef void* p
        if self.lock != NULL:
            raise SharedLockError("SharedLock is initialised once")
        self._local = threading.local()
        if fd is None:
            self.fd = os.memfd_create("kvconductor-shlock", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
        else:
            self.fd = os.dup(fd)
            if os.fstat(self.fd).st_size < <Py_ssize_t>size:
                raise SharedLockError("the fd is too small to hold a shared lock")
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, self.fd, 0)
        if p == MAP_FAILED:
            raise OSError("cannot map the shared lock")
        self._map = _Mapping.__new__(_Mapping)
        self._map.lock = <ShLock*>p
        self._map.size = size
        self.lock = <ShLock*>p
        if fd is None:
            shl_init(self.lock)
        elif shl_check(self.lock) != SHL_OK:
            raise SharedLockError("the fd holds no shared lock of this version")

    def __dealloc__(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @classmethod
    def attach(cls, int fd):
        """The lock in ``fd`` (created by another :class:`SharedLock`)."""
        return cls(fd)

    def fileno(self):
        """The memfd holding the lock (pass it to other processes)."""
        return self.fd

    cdef int _slot(self) except -1:
        cdef _Slot s = getattr(self._local, "slot", None)
        cdef int i
        cdef int32_t pid
        if s is None:
            pid = <int32_t>os.getpid()
            i = shl_slot_acquire(self.lock, pid, _stamp(pid))
            if i < 0:
                raise SharedLockError(f"all {SHL_SLOTS} reader slots are taken")
            s = _Slot.__new__(_Slot)
            s.map = self._map
            s.index = i
            self._local.slot = s
        return s.index

    def read_enter(self):
        """Enter a read section (waits while a writer is waiting or inside)."""
        cdef int slot = self._slot()
        cdef int rc
        with nogil:
            rc = shl_read_enter(self.lock, slot)
        if rc != SHL_OK:
            raise SharedLockError("read_enter inside a read section of this thread")

    def read_exit(self):
        """Leave this thread's read section."""
        cdef _Slot s = getattr(self._local, "slot", None)
        if s is None or shl_read_exit(self.lock, s.index) != SHL_OK:
            raise SharedLockError("read_exit outside a read section of this thread")

    def write_enter(self, int timeout_ms=10):
        """Enter the write section: new readers wait; waits for the readers inside,
        ``timeout_ms`` per wait, reclaiming the slots of dead ones."""
        cdef int rc
        with nogil:
            rc = shl_write_enter(self.lock, timeout_ms)
        if rc == SHL_EBUSY:
            raise SharedLockError("another writer holds the shared lock")

    def write_exit(self):
        """Leave the write section and wake the waiting readers."""
        if shl_write_exit(self.lock) != SHL_OK:
            raise SharedLockError("write_exit outside a write section")

    def reading(self):
        """Context manager: a read section."""
        return _Section(self, False)

    def writing(self, int timeout_ms=10):
        """Context manager: the write section."""
        return _Section(self, True, timeout_ms)

    def set_stall_policy(self, int stall_ms, bint kill=True):
        """Readers inside ``stall_ms`` after the writer started waiting for them are
        stalled (0: never); ``kill``: SIGKILL a stalled reader that is a child process
        of the writer's. Stored in the shared lock (every attached handle sees it)."""
        if stall_ms < 0:
            raise ValueError("stall_ms must be >= 0")
        shl_set_stall_policy(self.lock, <uint32_t>stall_ms, kill)

    def stall_policy(self):
        """``(stall_ms, kill)`` (:meth:`set_stall_policy`)."""
        return (int(self.lock.stall_ms), bool(self.lock.kill_stalled))

    def stall_log(self, uint64_t after=0):
        """The stalls recorded after sequence number ``after``, oldest first (at most
        ``STALL_LOG``): dicts of ``seq``, ``pid``, ``slot``, ``waited_s`` (how long the
        writer had waited for the reader then), ``killed`` and ``state`` (its process
        state letter then, ``T`` stopped, ``D`` uninterruptible, ...; ``?``)."""
        cdef uint64_t last = self.lock.stall_seq
        cdef uint64_t seq, first
        cdef shl_stall* e
        out = []
        first = max(after + 1, last - SHL_LOG + 1 if last > SHL_LOG else 1)
        for seq in range(first, last + 1):
            e = &self.lock.stall_log[(seq - 1) % SHL_LOG]
            row = {
                "seq": seq,
                "pid": e.pid,
                "slot": e.slot,
                "waited_s": e.waited_ns / 1e9,
                "killed": bool(e.killed),
                "state": chr(<unsigned char>e.state) if e.state else "?",
            }
            if e.seq == seq:   # not overwritten meanwhile
                out.append(row)
        return out

    def stalling(self):
        """The reader the writer is waiting for past the bound right now (without
        preferring itself): ``{"pid", "seconds"}``, or None."""
        cdef int32_t pid = self.lock.stalling_pid
        cdef uint64_t since = self.lock.stalling_since_ns
        cdef uint64_t now = shl_now_ns()
        if pid <= 0:
            return None
        return {"pid": pid, "seconds": (now - since) / 1e9 if now > since else 0.0}

    def wait_histogram(self):
        """How long write sections waited for the readers inside: ``bounds`` (bucket
        upper bounds in seconds, :data:`WAIT_BOUNDS`), ``counts`` (per bucket, not
        cumulative; the last is past every bound), ``count`` and ``sum`` (seconds)."""
        return {
            "bounds": list(WAIT_BOUNDS),
            "counts": [int(self.lock.wait_hist[i]) for i in range(SHL_HIST)],
            "count": int(self.lock.wait_count),
            "sum": self.lock.wait_sum_ns / 1e9,
        }

    def reclaim_dead(self):
        """Clear every slot whose owner process is dead; how many were."""
        with nogil:
            n = shl_reclaim_dead(self.lock)
        return n

    def stats(self):
        """``slots_in_use``, ``active`` readers, ``reclaimed`` slots of dead readers,
        ``writer_waits`` (futex waits of writers), ``writer`` (a writer is waiting or
        inside), ``preferred`` (new readers wait for it), ``stalls`` (readers found
        inside past the stall bound), ``kills`` (of them, SIGKILLed)."""
        cdef int i, used = 0, active = 0
        for i in range(SHL_SLOTS):
            if self.lock.slots[i].pid != 0:
                used += 1
            if self.lock.slots[i].active:
                active += 1
        return {
            "slots_in_use": used,
            "active": active,
            "reclaimed": self.lock.reclaimed,
            "writer_waits": self.lock.writer_waits,
            "writer": bool(self.lock.wlock),
            "preferred": bool(self.lock.writer),
            "stalls": self.lock.stalls,
            "kills": self.lock.kills,
        }

    # Test hooks: the C steps one at a time, for the differential machine and the
    # pid-reuse test (a slot for a made-up owner).

    def _acquire_for_test(self, int pid, uint64_t stamp):
        return shl_slot_acquire(self.lock, pid, stamp)

    def _release_for_test(self, int slot):
        return shl_slot_release(self.lock, slot)

    def _read_try_for_test(self, int slot):
        return shl_read_try(self.lock, slot)

    def _read_exit_for_test(self, int slot):
        return shl_read_exit(self.lock, slot)

    def _write_begin_for_test(self):
        return shl_write_begin(self.lock)

    def _write_yield_for_test(self):
        return shl_write_yield(self.lock)

    def _write_prefer_for_test(self):
        return shl_write_prefer(self.lock)

    def _write_pending_for_test(self):
        return shl_write_pending(self.lock)

    def _write_exit_for_test(self):
        return shl_write_exit(self.lock)

    def _slot_for_test(self, int slot):
        """(pid, stamp, active) of a slot."""
        if not 0 <= slot < SHL_SLOTS:
            raise IndexError(slot)
        s = &self.lock.slots[slot]
        return (s.pid, s.stamp, s.active)


cdef class _Section:
    cdef SharedLock lock
    cdef bint write
    cdef int timeout_ms

    def __cinit__(self, SharedLock lock, bint write, int timeout_ms=10):
        self.lock = lock
        self.write = write
        self.timeout_ms = timeout_ms

    def __enter__(self):
        if self.write:
            self.lock.write_enter(self.timeout_ms)
        else:
            self.lock.read_enter()
        return self.lock

    def __exit__(self, *exc):
        if self.write:
            self.lock.write_exit()
        else:
            self.lock.read_exit()
        return False
