# cython: language_level=3
"""The robust cross-process reader/writer lock (``docs/design.md``, "The cross-process
lock"): a :c:type:`ShLock` that lives in shared memory (any ``MAP_SHARED`` mapping) and
survives a reader killed, or stopped, inside its read section.

* A writer mutex word (``wlock``), a writer *preference* flag (``writer``, the futex
  readers wait on) and a fixed table of ``SHL_SLOTS`` reader slots, one cache line
  each: {owner pid, owner start stamp, ``active`` (the futex the writer waits on),
  ``enters`` (read sections entered)}.
* A reading thread takes one slot (:func:`shl_slot_acquire`) and keeps it; it gives it
  back with :func:`shl_slot_release`, or the writer reclaims it once its owner is dead.
  The lock counts the slots ever taken (``used``: one more than the highest index,
  raised before the slot's first read section, never lowered), and a writer scans
  those, not all ``SHL_SLOTS`` cache lines, for readers inside.
* Reader: waits while the preference flag is set, sets ``active``, checks the flag
  again (sequentially consistent, Dekker-style); if the writer came in meanwhile it
  clears ``active``, wakes the writer and waits again.
* Writer (one at a time: a second concurrent writer gets ``SHL_EBUSY``): takes
  ``wlock``, sets the flag, then waits on every active slot's futex ``timeout_ms`` at a
  time; after each timeout it checks the slot owner: gone (``kill(pid, 0)`` gives
  ``ESRCH``), another process under the same pid (its start time, ``/proc/<pid>/stat``
  field 22, differs), or a zombie whose threads have all exited (state ``Z`` with one
  thread left) means dead, and the slot is cleared (counted in ``reclaimed``). The
  writer never waits on a dead reader. (A writer that dies inside leaves the flag set
  and the readers waiting: the owner is the only writer, and its death takes the
  workers down.)
* **Stalled readers** (policy in the lock, :func:`shl_set_stall_policy`): a reader
  still inside ``stall_ms`` after the writer started waiting for it is *stalled* (a
  stopped, frozen or swapping process). The writer then clears its preference flag,
  so every other reader goes on, and, with ``kill_stalled``, sends SIGKILL to the
  reader's process if it is a child of the writer's process (through a pidfd, so a
  recycled pid is never signalled); it waits, without preference, until that reader
  left its section or is dead (the slot reclaimed), records the stall (counters and
  a small log the owner's supervisor reads), sets its flag again and waits for the
  readers inside as usual. **It never writes while a live reader may still be inside
  a read section**: a reader that cannot be killed (not a child, or ``kill_stalled``
  off, or a process that does not die, e.g. frozen by a cgroup-v1 freezer or in
  uninterruptible sleep) is waited for without bound, but without holding up the
  other readers. ``stall_ms`` 0: no bound (readers wait behind the writer as long as
  it waits).

Everything is ``noexcept nogil`` with ``SHL_*`` return codes; raw ``futex(2)``
``FUTEX_WAIT``/``FUTEX_WAKE`` (not the ``_PRIVATE`` ones: the waiters are in other
processes). Linux only. Pids are those of the caller's pid namespace.
"""
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from "kvconductor/c/shlock.h":
    enum:
        SHL_SLOTS
        SHL_HIST
        SHL_LOG
        SHL_OK
        SHL_EBUSY
        SHL_EINVAL
        SHL_EAGAIN
        SHL_EMAGIC

    const uint64_t shl_hist_bounds[]

    ctypedef struct shl_slot:
        int32_t pid
        uint32_t active
        uint64_t stamp
        uint32_t enters

    ctypedef struct shl_stall:
        uint64_t seq
        int32_t pid
        int32_t slot
        uint64_t waited_ns
        uint32_t killed
        char state

    ctypedef struct ShLock:
        uint32_t magic
        uint64_t reclaimed
        uint64_t writer_waits
        uint64_t stalls
        uint64_t kills
        uint32_t stall_ms
        uint32_t kill_stalled
        uint32_t wlock
        int32_t stalling_pid
        uint64_t stalling_since_ns
        uint64_t wait_count
        uint64_t wait_sum_ns
        uint64_t wait_hist[SHL_HIST]
        uint64_t stall_seq
        shl_stall stall_log[SHL_LOG]
        uint32_t writer
        shl_slot slots[SHL_SLOTS]

    uint64_t shl_now_ns() noexcept nogil
    uint64_t shl_proc_stamp(int32_t pid) noexcept nogil
    int shl_owner_alive(int32_t pid, uint64_t stamp) noexcept nogil
    void shl_init(ShLock* l) noexcept nogil
    int shl_check(const ShLock* l) noexcept nogil
    void shl_set_stall_policy(ShLock* l, uint32_t stall_ms, int kill) noexcept nogil
    int shl_slot_acquire(ShLock* l, int32_t pid, uint64_t stamp) noexcept nogil
    int shl_slot_release(ShLock* l, int slot) noexcept nogil
    int shl_reclaim_dead(ShLock* l) noexcept nogil
    int shl_read_try(ShLock* l, int slot) noexcept nogil
    int shl_read_enter(ShLock* l, int slot) noexcept nogil
    int shl_read_exit(ShLock* l, int slot) noexcept nogil
    int shl_write_begin(ShLock* l) noexcept nogil
    int shl_write_yield(ShLock* l) noexcept nogil
    int shl_write_prefer(ShLock* l) noexcept nogil
    int shl_write_pending(ShLock* l) noexcept nogil
    int shl_write_enter(ShLock* l, int timeout_ms) noexcept nogil
    int shl_write_exit(ShLock* l) noexcept nogil


cdef class _Mapping:
    cdef ShLock* lock
    cdef size_t size


cdef class SharedLock:
    cdef _Mapping _map
    cdef ShLock* lock
    cdef int fd
    cdef object _local

    cdef int _slot(self) except -1
