# Included by _index.pyx: the two-phase offload/pool state: records, waiters,
# offload, pool_store, evict, sweep.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them.


# -- two-phase records ---------------------------------------------------------------------
cdef uint32_t _new_rec(CoreIndex self, uint64_t local, bint hp, uint64_t parent,
                       double t) noexcept nogil:
    cdef uint32_t r = pool_take(&self.st.rec_pool, <void**>&self.st.recs, sizeof(TPRec))
    if r == HM_NIL:
        return HM_NIL
    self.st.recs[r].local = local
    self.st.recs[r].parent = parent if hp else 0
    self.st.recs[r].has_parent = 1 if hp else 0
    self.st.recs[r].t = t
    return r

cdef void _free_rec(CoreIndex self, uint32_t r) noexcept nogil:
    if r != HM_NIL:
        pool_give(&self.st.rec_pool, self.st.recs, r, sizeof(TPRec))

cdef int _put_rec(CoreIndex self, U64Map* m, uint64_t h, uint64_t local, bint hp, uint64_t parent,
                  double t) noexcept nogil:
    """``m[h] = (local, parent, t)``, reusing an existing record."""
    cdef uint32_t r = u64m_get(m, h)
    if r == HM_NIL:
        r = _new_rec(self, local, hp, parent, t)
        if r == HM_NIL:
            return -1
        if u64m_put(m, h, r) < 0:
            _free_rec(self, r)
            return -1
        return 0
    self.st.recs[r].local = local
    self.st.recs[r].parent = parent if hp else 0
    self.st.recs[r].has_parent = 1 if hp else 0
    self.st.recs[r].t = t
    return 0

cdef uint32_t _new_wait(CoreIndex self, uint32_t worker, double t) noexcept nogil:
    cdef uint32_t i = pool_take(&self.st.wait_pool, <void**>&self.st.waits, sizeof(TPWait))
    if i == HM_NIL:
        return HM_NIL
    self.st.waits[i].worker = worker
    self.st.waits[i].t = t
    self.st.waits[i].next = HM_NIL
    return i

cdef void _free_wait(CoreIndex self, uint32_t i) noexcept nogil:
    pool_give(&self.st.wait_pool, self.st.waits, i, sizeof(TPWait))
    self.st.npending -= 1

cdef long _apply(CoreIndex self, uint32_t worker, bint hp, uint64_t parent, uint64_t h,
                 uint64_t local) noexcept nogil:
    """Store one confirmed block for ``worker``; 1 if stored, 0 if refused, -1 OOM."""
    cdef long rc = _store_c(self, worker, self.st.wtier[worker], hp, parent, &h, &local, 1)
    if rc == T_ERR_OOM:
        return -1
    return 1 if rc == 1 else 0

cdef long _apply_rec(CoreIndex self, uint32_t worker, uint64_t h, uint32_t r) noexcept nogil:
    return _apply(self, worker, self.st.recs[r].has_parent == 1, self.st.recs[r].parent, h,
                  self.st.recs[r].local)

cdef long _drop_waits(CoreIndex self, uint32_t worker, double now, double ttl) noexcept nogil:
    """Remove waiters of ``worker`` (ttl < 0) or waiters older than ``ttl`` (any
    worker, ``worker`` ignored). Returns the number removed; -1 on OOM."""
    cdef U64Map* m = &self.st.pending_m
    cdef size_t i, nempty = 0, k
    cdef uint32_t head, cur, prev, nxt
    cdef long removed = 0
    cdef uint64_t* empty = NULL
    cdef bint drop
    if m.keys == NULL or self.st.npending == 0:
        return 0
    empty = <uint64_t*>malloc((m.size + 1) * sizeof(uint64_t))
    if empty == NULL:
        return -1
    for i in range(m.mask + 1):
        head = m.vals[i]
        if head == HM_NIL:
            continue
        prev = HM_NIL
        cur = head
        while cur != HM_NIL:
            nxt = self.st.waits[cur].next
            if ttl < 0:
                drop = self.st.waits[cur].worker == worker
            else:
                drop = now - self.st.waits[cur].t >= ttl
            if drop:
                if prev == HM_NIL:
                    head = nxt
                else:
                    self.st.waits[prev].next = nxt
                _free_wait(self, cur)
                removed += 1
            else:
                prev = cur
            cur = nxt
        m.vals[i] = head if head != HM_NIL else m.vals[i]
        if head == HM_NIL:
            empty[nempty] = m.keys[i]
            nempty += 1
    for k in range(nempty):
        u64m_pop(m, empty[k])
    free(empty)
    return removed

# -- two-phase operations ------------------------------------------------------------------
cdef object _offload(CoreIndex self, engine_hashes, local_hashes, parent, double now):
    cdef const uint64_t[::1] sv = as_u64(engine_hashes)
    cdef const uint64_t[::1] lv = as_u64(local_hashes)
    cdef size_t n = min(sv.shape[0], lv.shape[0])
    cdef bint hp0 = parent is not None
    cdef uint64_t p0 = parent if hp0 else 0
    cdef long rc = 0
    self._writable()
    if n == 0:
        return 0
    with nogil:
        _wlock(self)
        rc = _offload_c(self, &sv[0], &lv[0], n, hp0, p0, now)
        _wunlock(self)
    if rc < 0:
        raise MemoryError()
    return rc

cdef long _offload_c(CoreIndex self, const uint64_t* ehashes, const uint64_t* locals, size_t n,
                     bint hp0, uint64_t p0, double now) noexcept nogil:
    cdef size_t i, nw, a, b
    cdef uint64_t h, t, p
    cdef bint hp
    cdef uint32_t head, cur, tmp
    cdef long applied = 0, rc
    cdef uint32_t ws[64]
    for i in range(n):
        h = ehashes[i]
        t = locals[i]
        hp = hp0 if i == 0 else True
        p = p0 if i == 0 else ehashes[i - 1]
        head = u64m_pop(&self.st.pending_m, h)
        if head != HM_NIL:
            if _put_rec(self, &self.st.content_m, h, t, hp, p, now) < 0:
                return -1
            _free_rec(self, u64m_pop(&self.st.offload_m, h))
            # Apply to the waiters in batches of up to 64, each in increasing worker id
            # (the chain is newest first, so batches are not globally sorted as the
            # twin's sorted(waiters) is). The order cannot change a result: every
            # waiter stores the same (parent, block) on its own worker.
            while head != HM_NIL:
                nw = 0
                cur = head
                while cur != HM_NIL and nw < 64:
                    ws[nw] = self.st.waits[cur].worker
                    nw += 1
                    tmp = self.st.waits[cur].next
                    _free_wait(self, cur)
                    cur = tmp
                head = cur
                for a in range(1, nw):
                    b = a
                    while b > 0 and ws[b - 1] > ws[b]:
                        ws[b - 1], ws[b] = ws[b], ws[b - 1]
                        b -= 1
                for a in range(nw):
                    rc = _apply(self, ws[a], hp, p, h, t)
                    if rc < 0:
                        return -1
                    applied += rc
        else:
            _free_rec(self, u64m_pop(&self.st.content_m, h))
            if _put_rec(self, &self.st.offload_m, h, t, hp, p, now) < 0:
                return -1
    return applied

cdef object _pool_store(CoreIndex self, uint32_t worker, engine_hashes, double now):
    self._writable()
    self._tier(worker)
    cdef const uint64_t[::1] sv = as_u64(engine_hashes)
    cdef size_t n = sv.shape[0]
    cdef long applied = 0, queued = 0
    cdef int rc = 0
    if n == 0:
        return (0, 0)
    with nogil:
        _wlock(self)
        rc = _pool_store_c(self, worker, &sv[0], n, now, &applied, &queued)
        _wunlock(self)
    if rc < 0:
        raise MemoryError()
    return (applied, queued)

cdef int _pool_store_c(CoreIndex self, uint32_t worker, const uint64_t* hs, size_t n, double now,
                       long* applied, long* queued) noexcept nogil:
    cdef size_t i
    cdef uint64_t h, p = 0, local = 0
    cdef uint32_t r, head, cur
    cdef bint hp = False
    cdef long rc
    for i in range(n):
        h = hs[i]
        r = u64m_pop(&self.st.offload_m, h)
        if r != HM_NIL:
            self.st.recs[r].t = now
            _free_rec(self, u64m_pop(&self.st.content_m, h))
            if u64m_put(&self.st.content_m, h, r) < 0:
                _free_rec(self, r)
                return -1
        else:
            r = u64m_get(&self.st.content_m, h)
            if r == HM_NIL:
                if (lower_lookup(&self.st.tiers[0], h, &hp, &p, &local)
                        or lower_lookup(&self.st.tiers[1], h, &hp, &p, &local)):
                    if _put_rec(self, &self.st.content_m, h, local, hp, p, now) < 0:
                        return -1
                    r = u64m_get(&self.st.content_m, h)
        if r != HM_NIL:
            rc = _apply_rec(self, worker, h, r)
            if rc < 0:
                return -1
            applied[0] += rc
            continue
        head = u64m_get(&self.st.pending_m, h)
        cur = head
        while cur != HM_NIL and self.st.waits[cur].worker != worker:
            cur = self.st.waits[cur].next
        if cur != HM_NIL:
            continue            # duplicate delivery: first insert time kept
        cur = _new_wait(self, worker, now)
        if cur == HM_NIL:
            return -1
        self.st.waits[cur].next = head
        if u64m_put(&self.st.pending_m, h, cur) < 0:
            pool_give(&self.st.wait_pool, self.st.waits, cur, sizeof(TPWait))
            return -1
        self.st.npending += 1
        queued[0] += 1
    return 0

cdef object _evict(CoreIndex self, uint32_t worker, engine_hashes):
    self._writable()
    self._tier(worker)
    cdef const uint64_t[::1] sv = as_u64(engine_hashes)
    cdef size_t n = sv.shape[0]
    cdef long rc = 0
    if n == 0:
        return 0
    with nogil:
        _wlock(self)
        rc = _evict_w(self, worker, &sv[0], n)
        _wunlock(self)
    return rc

cdef long _evict_w(CoreIndex self, uint32_t worker, const uint64_t* hs, size_t n) noexcept nogil:
    cdef int tier = self.st.wtier[worker]
    if tier == 0:
        return tree_remove(&self.st.tree, worker, hs, n)
    return _evict_c(self, worker, tier, hs, n)

cdef long _evict_c(CoreIndex self, uint32_t worker, int tier, const uint64_t* hs,
                   size_t n) noexcept nogil:
    cdef size_t i
    cdef uint64_t h
    cdef uint32_t r, head, cur, prev
    cdef long removed = 0
    cdef bint waited
    for i in range(n):
        h = hs[i]
        r = u64m_pop(&self.st.offload_m, h)
        if r != HM_NIL:
            _free_rec(self, r)
            _free_rec(self, u64m_pop(&self.st.content_m, h))
            continue
        head = u64m_get(&self.st.pending_m, h)
        prev = HM_NIL
        cur = head
        while cur != HM_NIL and self.st.waits[cur].worker != worker:
            prev = cur
            cur = self.st.waits[cur].next
        waited = cur != HM_NIL
        if waited:
            if prev == HM_NIL:
                head = self.st.waits[cur].next
                if head == HM_NIL:
                    u64m_pop(&self.st.pending_m, h)
                else:
                    u64m_put(&self.st.pending_m, h, head)
            else:
                self.st.waits[prev].next = self.st.waits[cur].next
            _free_wait(self, cur)
            if u64m_get(&self.st.content_m, h) == HM_NIL:
                continue
        removed += _remove_c(self, worker, tier, &h, 1)
    return removed

cdef object _sweep(CoreIndex self, double now, double pending_ttl, double content_ttl,
                   double offload_ttl):
    cdef long a, b, c
    self._writable()
    with nogil:
        _wlock(self)
        a = _expire(self, &self.st.offload_m, now, offload_ttl)
        b = _expire(self, &self.st.content_m, now, content_ttl)
        c = _drop_waits(self, 0, now, pending_ttl if pending_ttl >= 0 else 0.0)
        _wunlock(self)
    if a < 0 or b < 0 or c < 0:
        raise MemoryError()
    # NOTE: the HBM tree prunes empty nodes eagerly; its sweep is always 0.
    return a + b + c

cdef long _expire(CoreIndex self, U64Map* m, double now, double ttl) noexcept nogil:
    cdef size_t i, k, nold = 0
    cdef uint64_t* old
    cdef uint32_t r
    if m.keys == NULL or m.size == 0:
        return 0
    old = <uint64_t*>malloc(m.size * sizeof(uint64_t))
    if old == NULL:
        return -1
    for i in range(m.mask + 1):
        r = m.vals[i]
        if r != HM_NIL and now - self.st.recs[r].t >= ttl:
            old[nold] = m.keys[i]
            nold += 1
    for k in range(nold):
        _free_rec(self, u64m_pop(m, old[k]))
    free(old)
    return <long>nold
