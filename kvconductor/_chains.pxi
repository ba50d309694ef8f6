# The Python face of one chain structure, shared by the test-only wrappers ``RadixTree``
# (``_tree.pyx``) and ``LowerTier`` (``_lower.pyx``): the structure ``t``, its C rwlock
# and the methods that differ only by the kernel they call. Each module includes this file
# after ``ctypedef <its structure> Table`` and gives its kernels in ``_KERNELS`` (a
# ``ChainKernels``), so it compiles its own copy of ``_Chains`` over its own structure:
# the object layout is the one each wrapper had (no vtable), and the walks, defined in the
# subclasses, are untouched. The index calls the kernels directly, not through this.

ctypedef struct ChainKernels:
    int (*init)(Table* t) noexcept nogil
    void (*free)(Table* t) noexcept nogil
    long (*store)(Table* t, uint32_t worker, bint has_parent, uint64_t parent,
                  const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil
    long (*remove)(Table* t, uint32_t worker, const uint64_t* ehashes, size_t n) noexcept nogil
    long (*clear)(Table* t, uint32_t worker) noexcept nogil
    # the first two figures ``sizes`` returns, into out[0:2]
    void (*counts)(const Table* t, size_t* out) noexcept nogil
    size_t (*nbytes)(const Table* t) noexcept nogil
    int (*check)(const Table* t, char* msg, size_t cap) noexcept nogil


cdef class _Chains:
    """What ``RadixTree`` and ``LowerTier`` share.

    **Threading: one writer thread calls store/remove/clear; any number of threads may
    call the reads concurrently. Each method holds a C reader/writer lock (writers
    exclusive) and runs without the GIL.**
    """

    cdef Table t
    cdef pthread_rwlock_t lock
    cdef bint lock_ok

    def __cinit__(self):
        # on a raise, __dealloc__ frees what init made (the kernels' free is idempotent)
        self.lock_ok = False
        if _KERNELS.init(&self.t) < 0:
            raise MemoryError()
        if rwlock_init(&self.lock) != 0:
            raise MemoryError("cannot initialise rwlock")
        self.lock_ok = True

    def __dealloc__(self):
        _KERNELS.free(&self.t)
        if self.lock_ok:
            pthread_rwlock_destroy(&self.lock)
            self.lock_ok = False

    def store(self, uint32_t worker, parent, engine_hashes, local_hashes):
        """Store a chain for ``worker`` under ``parent`` (None = root); returns blocks stored."""
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = min(sv.shape[0], lv.shape[0])
        cdef bint has_parent = parent is not None
        cdef uint64_t p = parent if has_parent else 0
        cdef long rc
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = _KERNELS.store(&self.t, worker, has_parent, p, &sv[0], &lv[0], n)
            pthread_rwlock_unlock(&self.lock)
        return check_rc(rc)

    def remove(self, uint32_t worker, engine_hashes):
        """Drop ``worker``'s blocks by engine hash; returns how many it held."""
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long rc
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = _KERNELS.remove(&self.t, worker, &sv[0], n)
            pthread_rwlock_unlock(&self.lock)
        return rc

    def clear(self, uint32_t worker):
        """Drop every block of ``worker``; returns the count."""
        cdef long rc
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = _KERNELS.clear(&self.t, worker)
            pthread_rwlock_unlock(&self.lock)
        return rc

    # Introspection reads the C arrays (``rev`` is realloc-ed when a worker appears), so
    # it takes the read lock like the walks do: one snapshot of every size.
    def sizes(self, uint32_t worker=0):
        """The structure's two counts, its bytes and ``worker_blocks(worker)``, read under one
        lock."""
        cdef size_t out[4]
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            _KERNELS.counts(&self.t, out)
            out[2] = _KERNELS.nbytes(&self.t)
            out[3] = revs_count(self.t.rev, self.t.nrev, worker)   # worker_blocks
            pthread_rwlock_unlock(&self.lock)
        return out[0], out[1], out[2], out[3]

    def worker_blocks(self, uint32_t worker):
        """Number of blocks ``worker`` holds."""
        return self.sizes(worker)[3]

    def check_invariants(self):
        """Walk the C structures under the read lock; ``AssertionError`` naming the first
        broken invariant (the twin's ``_check_invariants`` and the C bookkeeping)."""
        cdef char msg[256]
        cdef int rc
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            rc = _KERNELS.check(&self.t, msg, sizeof(msg))
            pthread_rwlock_unlock(&self.lock)
        check_raise(rc, msg)

    @property
    def nbytes(self):
        """Bytes allocated by the structure's C arrays."""
        return self.sizes()[2]
