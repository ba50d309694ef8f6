# cython: language_level=3
"""The cross-process reader/writer lock (``_shlock.pxd``) over a shared mapping.

:class:`SharedLock` maps a memfd (a new one, or one passed from another process) and
runs the lock's C functions on it without the GIL. It is for the tests and for the
future owner/worker processes of ``kv-conductor --workers N``; nothing in the service
uses it yet.
"""
cimport cython
from libc.stdint cimport int32_t, uint64_t
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

    def reclaim_dead(self):
        """Clear every slot whose owner process is dead; how many were."""
        with nogil:
            n = shl_reclaim_dead(self.lock)
        return n

    def stats(self):
        """``slots_in_use``, ``active`` readers, ``reclaimed`` slots of dead readers,
        ``writer_waits`` (futex waits of writers), ``writer`` (flag set)."""
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
            "writer": bool(self.lock.writer),
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
