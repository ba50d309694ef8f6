# Included by _index.pyx: shared mode (--workers N): the arena install, attached
# handles, nested write sections.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them.


# Writer thread only: nesting depth of the shared lock's write section, so a batch of
# writes (SharedIndexes.writing(): a drain of ZeroMQ messages, a directory publish) holds
# it once instead of once per write.
cdef int _wdepth = 0
# Shared mode (``install_shared``): the SharedLock every writer of a new CoreIndex also
# takes, so readers in other processes never see a half-made change.
cdef object _shared_lock = None

cdef enum:
    WRITER_WAIT_MS = 10         # the writer's futex wait before it checks for dead readers

cdef void _xwrite_enter(ShLock* xl) noexcept nogil:
    """Enter the shared write section, or nest in the one this thread holds."""
    global _wdepth
    if _wdepth == 0:
        while shl_write_enter(xl, WRITER_WAIT_MS) == SHL_EBUSY:
            usleep(1000)
    _wdepth += 1


cdef void _xwrite_exit(ShLock* xl) noexcept nogil:
    global _wdepth
    _wdepth -= 1
    if _wdepth == 0:
        shl_write_exit(xl)


# -- shared mode (--workers N) -----------------------------------------------------------
def install_shared(Arena arena, SharedLock lock):
    """Shared mode for this process, called ON THE WRITER THREAD (the owner's ingest
    thread): structure memory that thread allocates comes from ``arena`` (in every
    compiled module: one install in ``_alloc``), and every CoreIndex created afterwards also
    takes ``lock``'s write side when it writes. ``install_shared(None, None)`` ends it
    (tests; indexes created meanwhile stay shared)."""
    global _shared_lock
    _alloc.install_arena(arena)
    _shared_lock = lock if arena is not None else None


def attach_core(uintptr_t address, SharedLock lock, uintptr_t gen_address, uint64_t gen_seen):
    """A read-only handle (a worker's) on the CoreIndex state at ``address`` of the
    arena mapped in this process. Every read enters ``lock``'s read section and first
    checks that the word at ``gen_address`` still equals ``gen_seen`` (else
    :class:`StaleIndexError`: the caller reloads the directory). Never frees anything."""
    cdef CoreIndex c = CoreIndex.__new__(CoreIndex, _ATTACH)
    cdef CoreState* st = <CoreState*>address
    if address == 0 or gen_address == 0 or lock is None:
        raise ValueError("attach_core needs a state address, a generation and a lock")
    c.attached = True
    c.st = st
    c.xlock = lock
    _lock_attached(&c.lk, lock.lock, <const uint64_t*>gen_address, gen_seen)
    return c


def shared_write_enter():
    """Enter the shared lock's write section on the writer thread (nests: the writes
    inside take it no more). Readers in other processes wait until the matching
    :func:`shared_write_exit`; keep sections short."""
    cdef ShLock* xl
    if _shared_lock is None or not alloc_arena_writing():
        raise RuntimeError("shared_write_enter: shared mode, writer thread only")
    xl = (<SharedLock>_shared_lock).lock
    with nogil:
        _xwrite_enter(xl)


def shared_write_exit():
    """Leave what :func:`shared_write_enter` entered."""
    if _shared_lock is None or _wdepth <= 0:
        raise RuntimeError("shared_write_exit outside a shared write section")
    _xwrite_exit((<SharedLock>_shared_lock).lock)


def _arena_leaks():
    """Arena blocks freed off the writer thread (left in place; every module, ``_alloc``)."""
    return alloc_arena_leaked()


def _query_counters():
    """This process's attached-handle queries: ``(yields, restarts)``, read sections left
    for a waiting writer between two steps of the HBM walk, and walks started again
    because the tree changed under their path (docs/design.md, "Long queries and the
    writer")."""
    return (kvc_query_count(0), kvc_query_count(1))
