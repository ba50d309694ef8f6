# Included by _index.pyx: workers, muting, the direct mutations (store, remove,
# clear) and the ingest fast path's batch.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them.


# -- workers -------------------------------------------------------------------------------
cdef object _set_worker(CoreIndex self, uint32_t worker, uint32_t group, int tier):
    cdef size_t cap, k
    cdef void* p
    cdef void* q
    cdef void* r
    self._writable()
    if tier < 0 or tier > 2:
        raise ValueError(f"tier must be 0, 1 or 2, not {tier}")
    if worker == HM_NIL or group == HM_NIL:
        raise ValueError("worker and group ids must be < 2**32 - 1")
    with nogil:
        _wlock(self)
        if worker >= self.st.wcap:
            cap = self.st.wcap
            p = grow_array(self.st.wgroup, &cap, <size_t>worker + 1, sizeof(uint32_t))
            if p != NULL:
                self.st.wgroup = <uint32_t*>p
                cap = self.st.wcap
                q = grow_array(self.st.wtier, &cap, <size_t>worker + 1, sizeof(uint8_t))
                if q != NULL:
                    self.st.wtier = <uint8_t*>q
                    cap = self.st.wcap
                    r = grow_array(self.st.wmute, &cap, <size_t>worker + 1, sizeof(uint8_t))
                    if r != NULL:
                        self.st.wmute = <uint8_t*>r
                        for k in range(self.st.wcap, cap):
                            self.st.wgroup[k] = HM_NIL
                            self.st.wtier[k] = 0
                            self.st.wmute[k] = 0
                        self.st.wcap = cap
        if worker < self.st.wcap:
            self.st.wgroup[worker] = group
            self.st.wtier[worker] = <uint8_t>tier
            if worker + 1 > self.st.nworkers:
                self.st.nworkers = worker + 1
            if group + 1 > self.st.ngroups:
                self.st.ngroups = group + 1
        _wunlock(self)
    if worker >= self.st.wcap:
        raise MemoryError()

cdef object _set_muted(CoreIndex self, uint32_t worker, bint muted):
    self._writable()
    self._tier(worker)
    with nogil:
        _wlock(self)
        self.st.wmute[worker] = 1 if muted else 0
        _wunlock(self)

cdef object _is_muted(CoreIndex self, uint32_t worker):
    cdef int slot_, stale_ = 0
    cdef bint m = False
    self._tier(worker)
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            m = self.st.wmute[worker] != 0
            _runlock(self, slot_)
    if stale_:
        self._stale(stale_)
    return m

# -- direct mutations ----------------------------------------------------------------------
cdef long _store_c(CoreIndex self, uint32_t worker, int tier, bint hp, uint64_t p,
                   const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil:
    if tier == 0:
        return tree_store(&self.st.tree, worker, hp, p, ehashes, locals, n)
    return lower_store(&self.st.tiers[tier - 1], worker, hp, p, ehashes, locals, n)

cdef object _store(CoreIndex self, uint32_t worker, parent, engine_hashes, local_hashes):
    cdef int tier = self._tier(worker)
    cdef Py_buffer sv, lv
    cdef size_t n
    cdef bint hp = parent is not None
    cdef uint64_t p = parent if hp else 0
    cdef long rc
    u64_view(&sv, engine_hashes)
    try:
        u64_view(&lv, local_hashes)
    except BaseException:
        PyBuffer_Release(&sv)
        raise
    try:
        n = <size_t>min(sv.len, lv.len) // sizeof(uint64_t)
        self._writable()
        if n == 0:
            return 0
        with nogil:
            _wlock(self)
            rc = _store_c(self, worker, tier, hp, p, <const uint64_t*>sv.buf,
                          <const uint64_t*>lv.buf, n)
            _wunlock(self)
        return check_rc(rc)
    finally:
        PyBuffer_Release(&lv)
        PyBuffer_Release(&sv)

cdef object _store_tokens(CoreIndex self, uint32_t worker, parent, engine_hashes, tokens,
                          size_t block_size, uint64_t seed):
    cdef int tier = self._tier(worker)
    cdef const uint64_t[::1] sv = as_u64(engine_hashes)
    cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
    cdef size_t ntok = tv.shape[0]
    cdef size_t nb = 0 if block_size == 0 else (ntok + block_size - 1) // block_size
    cdef size_t n = min(<size_t>sv.shape[0], nb)
    cdef bint hp = parent is not None
    cdef uint64_t p = parent if hp else 0
    cdef long rc = 0
    cdef uint64_t* loc
    self._writable()
    if n == 0:
        return 0
    loc = <uint64_t*>malloc(n * sizeof(uint64_t))
    if loc == NULL:
        raise MemoryError()
    with nogil:
        hash_token_blocks(&tv[0], min(ntok, n * block_size), block_size, seed, loc)
        _wlock(self)
        rc = _store_c(self, worker, tier, hp, p, &sv[0], loc, n)
        _wunlock(self)
    free(loc)
    return check_rc(rc)

cdef long _remove_c(CoreIndex self, uint32_t worker, int tier, const uint64_t* ehashes,
                    size_t n) noexcept nogil:
    if tier == 0:
        return tree_remove(&self.st.tree, worker, ehashes, n)
    return lower_remove(&self.st.tiers[tier - 1], worker, ehashes, n)

cdef object _remove(CoreIndex self, uint32_t worker, engine_hashes):
    cdef int tier = self._tier(worker)
    cdef const uint64_t[::1] sv = as_u64(engine_hashes)
    cdef size_t n = sv.shape[0]
    cdef long rc
    self._writable()
    if n == 0:
        return 0
    with nogil:
        _wlock(self)
        rc = _remove_c(self, worker, tier, &sv[0], n)
        _wunlock(self)
    return rc

cdef long _clear_c(CoreIndex self, uint32_t worker) noexcept nogil:
    cdef int tier = self.st.wtier[worker]
    cdef long rc
    if tier == 0:
        rc = tree_clear(&self.st.tree, worker)
    else:
        rc = lower_clear(&self.st.tiers[tier - 1], worker)
    _drop_waits(self, worker, 0.0, -1.0)
    return rc

cdef object _clear(CoreIndex self, uint32_t worker):
    self._writable()
    self._tier(worker)
    cdef long rc
    with nogil:
        _wlock(self)
        rc = _clear_c(self, worker)
        _wunlock(self)
    return rc

cdef void _batch_locked(CoreIndex self, BatchOp* ops, size_t n, const uint32_t* clear,
                        size_t nclear) noexcept nogil:
    """The ops of ``_apply_batch``, its write lock held."""
    cdef size_t i, k
    cdef BatchOp* op
    cdef long rc
    for i in range(n):
        op = &ops[i]
        if op.kind == OP_STORE:
            op.rc = _store_c(self, op.worker, self.st.wtier[op.worker], op.has_parent != 0,
                             op.parent, op.ehashes, op.locals, op.n)
        elif op.kind == OP_EVICT:
            op.rc = _evict_w(self, op.worker, op.ehashes, op.n)
        else:
            rc = 0
            for k in range(nclear):
                rc += _clear_c(self, clear[k])
            op.rc = rc


cdef void _apply_batch(CoreIndex self, BatchOp* ops, size_t n, const uint32_t* clear,
                       size_t nclear) noexcept nogil:
    """A batch of stores/evictions/clears under one write lock (the ingest fast path).

    Each op does exactly what the matching Python method does inside its lock
    (``store``/``store_tokens``, ``evict``, ``clear`` per worker), so a batch
    equals that sequence of calls; ``ops[i].rc`` gets the method's result."""
    cdef size_t i
    if self.st == NULL or (self.shared and not alloc_arena_writing()):
        for i in range(n):      # the caller checked with _tier: never reached
            ops[i].rc = T_ERR_OOM
        return
    _wlock(self)
    _batch_locked(self, ops, n, clear, nclear)
    _wunlock(self)


cdef bint _try_apply_batch(CoreIndex self, BatchOp* ops, size_t n, const uint32_t* clear,
                           size_t nclear) noexcept nogil:
    """``_apply_batch`` if this process's write lock is free this instant; False (nothing
    done) when it is taken, the state is shared (its writer also waits for the workers'
    readers) or closed."""
    if (self.st == NULL or self.shared or self.attached
            or pthread_rwlock_trywrlock(&self.lk.rw) != 0):
        return False
    _batch_locked(self, ops, n, clear, nclear)
    pthread_rwlock_unlock(&self.lk.rw)
    return True
