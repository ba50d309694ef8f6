# Included by _index.pyx: the C checker of the two-phase state, the corruption
# hooks of its tests, introspection and stats.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them.


# -- invariants ----------------------------------------------------------------------------
cdef int _check_c(CoreIndex self, char* msg, size_t cap, uint8_t* rfree,
                  uint8_t* wfree) noexcept nogil:
    """The two-phase state and the worker table (the tiers are checked by the caller)."""
    cdef long nr, nw
    cdef size_t i, k, waits = 0
    cdef uint32_t r, c, d
    cdef U64Map* m
    nr = pool_mark_free(&self.st.rec_pool, self.st.recs, sizeof(TPRec), rfree)
    nw = pool_mark_free(&self.st.wait_pool, self.st.waits, sizeof(TPWait), wfree)
    if nr < 0 or nw < 0:
        snprintf(msg, cap, "record or waiter free list broken")
        return -1
    if (u64m_check(&self.st.offload_m) < 0 or u64m_check(&self.st.content_m) < 0
            or u64m_check(&self.st.pending_m) < 0):
        snprintf(msg, cap, "offload, content or pending map corrupt")
        return -1
    # offload and content: disjoint keys, each value its own live record
    for k in range(2):
        m = &self.st.offload_m if k == 0 else &self.st.content_m
        for i in range(m.mask + 1 if m.keys != NULL else 0):
            r = m.vals[i]
            if r == HM_NIL:
                continue
            if r >= self.st.rec_pool.used or rfree[r] != 0:
                snprintf(msg, cap, "%s entry %llu has record %llu that is free, out of "
                         "range or shared", "offload" if k == 0 else "content",
                         <ull>m.keys[i], <ull>r)
                return -1
            rfree[r] = 2
            if r != HM_NIL and k == 0 and u64m_get(&self.st.content_m, m.keys[i]) != HM_NIL:
                snprintf(msg, cap, "hash %llu in offload and content", <ull>m.keys[i])
                return -1
    if self.st.offload_m.size + self.st.content_m.size + <size_t>nr != self.st.rec_pool.used:
        snprintf(msg, cap, "records: %llu offload + %llu content + %llu free != %llu",
                 <ull>self.st.offload_m.size, <ull>self.st.content_m.size, <ull>nr,
                 <ull>self.st.rec_pool.used)
        return -1
    # pending: non-empty chains of live waiters, one per worker and hash
    m = &self.st.pending_m
    for i in range(m.mask + 1 if m.keys != NULL else 0):
        c = m.vals[i]
        if c == HM_NIL:
            continue
        while c != HM_NIL:
            if c >= self.st.wait_pool.used or wfree[c] != 0:
                snprintf(msg, cap, "pending hash %llu lists waiter %llu that is free, out "
                         "of range or on another list", <ull>m.keys[i], <ull>c)
                return -1
            wfree[c] = 2
            waits += 1
            d = self.st.waits[c].next
            while d != HM_NIL and d < self.st.wait_pool.used and wfree[d] == 0:
                if self.st.waits[d].worker == self.st.waits[c].worker:
                    snprintf(msg, cap, "worker %llu waits twice for hash %llu",
                             <ull>self.st.waits[c].worker, <ull>m.keys[i])
                    return -1
                d = self.st.waits[d].next
            c = self.st.waits[c].next
    if waits != self.st.npending or waits + <size_t>nw != self.st.wait_pool.used:
        snprintf(msg, cap, "npending %llu, recount %llu, free %llu, high-water %llu",
                 <ull>self.st.npending, <ull>waits, <ull>nw, <ull>self.st.wait_pool.used)
        return -1
    if self.st.nworkers > self.st.wcap:
        snprintf(msg, cap, "nworkers %llu > allocated %llu", <ull>self.st.nworkers,
                 <ull>self.st.wcap)
        return -1
    for i in range(self.st.nworkers):
        if self.st.wgroup[i] != HM_NIL and (self.st.wgroup[i] >= self.st.ngroups
                                            or self.st.wtier[i] > 2):
            snprintf(msg, cap, "worker %llu: group %llu of %llu or tier %llu out of range",
                     <ull>i, <ull>self.st.wgroup[i], <ull>self.st.ngroups,
                     <ull>self.st.wtier[i])
            return -1
    return 0

cdef object _check_invariants(CoreIndex self):
    cdef int slot_, stale_ = 0
    cdef char msg[256]
    cdef char sub[200]
    cdef int rc = 0
    cdef uint8_t* rfree = NULL
    cdef uint8_t* wfree = NULL
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            rc = tree_check(&self.st.tree, sub, sizeof(sub))
            if rc == -1:
                snprintf(msg, sizeof(msg), "HBM tree: %s", sub)
            if rc == 0:
                rc = lower_check(&self.st.tiers[0], sub, sizeof(sub))
                if rc == -1:
                    snprintf(msg, sizeof(msg), "CPU tier: %s", sub)
            if rc == 0:
                rc = lower_check(&self.st.tiers[1], sub, sizeof(sub))
                if rc == -1:
                    snprintf(msg, sizeof(msg), "Disk tier: %s", sub)
            if rc == 0:
                rfree = <uint8_t*>malloc(self.st.rec_pool.used + 1)
                wfree = <uint8_t*>malloc(self.st.wait_pool.used + 1)
                rc = -2 if rfree == NULL or wfree == NULL else _check_c(
                    self, msg, sizeof(msg), rfree, wfree)
                free(rfree)
                free(wfree)
            _runlock(self, slot_)
    if stale_:
        self._stale(stale_)
    check_raise(rc, msg)

cdef object _corrupt_impl(CoreIndex self, str kind):
    cdef size_t i
    if kind == "npending":
        self.st.npending += 1
    elif kind == "record_freed":
        for i in range(self.st.offload_m.mask + 1 if self.st.offload_m.keys != NULL else 0):
            if self.st.offload_m.vals[i] != HM_NIL:
                pool_give(&self.st.rec_pool, self.st.recs, self.st.offload_m.vals[i],
                          sizeof(TPRec))
                return
        raise ValueError("needs an offload entry")
    elif kind == "hbm_pairs":
        self.st.tree.npairs += 1
    elif kind == "cpu_total":
        self.st.tiers[0].total += 1
    else:
        raise ValueError(kind)

# -- introspection -------------------------------------------------------------------------
cdef object _worker_blocks(CoreIndex self, uint32_t worker):
    cdef int slot_, stale_ = 0
    cdef size_t n = 0
    cdef int tier
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            if worker < self.st.nworkers:
                tier = self.st.wtier[worker]
                if tier == 0:
                    n = tree_worker_blocks(&self.st.tree, worker)
                else:
                    n = lower_worker_blocks(&self.st.tiers[tier - 1], worker)
            _runlock(self, slot_)
    if stale_:
        self._stale(stale_)
    return n

cdef object _worker_hashes(CoreIndex self, uint32_t worker):
    cdef int slot_, stale_ = 0
    cdef const FpMap* lrev = NULL
    cdef const Lower* L = NULL
    cdef const FpMap* trev = NULL
    cdef size_t i, k = 0, n = 0
    cdef uint64_t* o
    cdef int tier
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
    if stale_:
        self._stale(stale_)
    try:
        if worker < self.st.nworkers:
            tier = self.st.wtier[worker]
            if tier == 0:
                if worker < self.st.tree.nrev:
                    trev = &self.st.tree.rev[worker]
            elif worker < self.st.tiers[tier - 1].nrev:
                L = &self.st.tiers[tier - 1]
                lrev = &L.rev[worker]
        if lrev != NULL:
            n = lrev.size
        elif trev != NULL:
            n = trev.size
        out = _array.array("Q", bytes(8 * n))
        if n:
            o = <uint64_t*>(<array.array>out).data.as_ulonglongs
            if lrev != NULL:
                for i in range(lrev.cap):
                    if lrev.slots[i].idx != HM_NIL:
                        o[k] = L.edges[lrev.slots[i].idx].child
                        k += 1
            else:
                for i in range(trev.cap):
                    if trev.slots[i].idx != HM_NIL and tree_member_ehash(
                            &self.st.tree, trev.slots[i].idx, worker, &o[k]):
                        k += 1
        return out
    finally:
        _runlock(self, slot_)

cdef object _parent_of(CoreIndex self, uint32_t worker, uint64_t h):
    cdef int slot_, stale_ = 0
    cdef uint32_t node = HM_NIL, p
    cdef bint found = False, has_parent = False
    cdef uint64_t parent = 0
    cdef int tier = -1
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            if worker < self.st.nworkers:
                tier = self.st.wtier[worker]
            if tier == 0 and worker < self.st.tree.nrev:
                node = tree_rev_get(&self.st.tree, worker, h)
                if node != HM_NIL:
                    found = True
                    p = self.st.tree.nodes[node].parent
                    if p != 0 and p != HM_NIL:
                        has_parent = tree_member_ehash(&self.st.tree, p, worker, &parent)
            elif tier > 0 and worker < self.st.tiers[tier - 1].nrev:
                node = lower_rev_get(&self.st.tiers[tier - 1], worker, h)
                if node != HM_NIL:
                    found = True
                    has_parent = self.st.tiers[tier - 1].edges[node].has_parent == 1
                    parent = self.st.tiers[tier - 1].edges[node].parent
            _runlock(self, slot_)
    if stale_:
        self._stale(stale_)
    if not found:
        raise KeyError(h)
    return parent if has_parent else None

cdef object _hbm_reach(CoreIndex self, uint32_t worker, local_hashes):
    cdef const uint64_t[::1] lv = as_u64(local_hashes)
    cdef size_t k, n = lv.shape[0], d = 0
    cdef int slot_, stale_ = 0
    cdef uint32_t node = T_ROOT
    cdef uint64_t x
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            if (worker < self.st.nworkers and self.st.wtier[worker] == 0
                    and worker < self.st.tree.nrev):
                for k in range(n):
                    node = tree_child(&self.st.tree, node, lv[k])
                    if node == HM_NIL or not tree_member_ehash(&self.st.tree, node, worker, &x):
                        break
                    d += 1
            _runlock(self, slot_)
    if stale_:
        self._stale(stale_)
    return d

cdef object _block_of(CoreIndex self, uint32_t worker, uint64_t h):
    cdef int slot_, stale_ = 0
    cdef uint32_t node = HM_NIL, p
    cdef bint found = False, has_parent = False
    cdef uint64_t parent = 0, local = 0
    cdef int tier = -1
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            if worker < self.st.nworkers:
                tier = self.st.wtier[worker]
            if tier == 0 and worker < self.st.tree.nrev:
                node = tree_rev_get(&self.st.tree, worker, h)
                if node != HM_NIL:
                    found = True
                    local = self.st.tree.nodes[node].local
                    p = self.st.tree.nodes[node].parent
                    if p != 0 and p != HM_NIL:
                        has_parent = tree_member_ehash(&self.st.tree, p, worker, &parent)
            elif tier > 0 and worker < self.st.tiers[tier - 1].nrev:
                node = lower_rev_get(&self.st.tiers[tier - 1], worker, h)
                if node != HM_NIL:
                    found = True
                    local = self.st.tiers[tier - 1].edges[node].local
                    has_parent = self.st.tiers[tier - 1].edges[node].has_parent == 1
                    parent = self.st.tiers[tier - 1].edges[node].parent
            _runlock(self, slot_)
    if stale_:
        self._stale(stale_)
    if not found:
        raise KeyError(h)
    return (parent if has_parent else None, local)

cdef object _hbm_layout(CoreIndex self):
    cdef int slot_, stale_ = 0
    cdef size_t out[TL_N]
    memset(out, 0, sizeof(out))
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            tree_layout(&self.st.tree, out)
            _runlock(self, slot_)
    if stale_ and not (stale_ == CORE_CLOSED and not self.attached):
        self._stale(stale_)
    return layout_dict(out)

cdef object _stats(CoreIndex self):
    cdef int slot_, stale_ = 0
    cdef size_t nodes = 0, pairs = 0, cpu = 0, disk = 0, off = 0, con = 0, pen = 0, nb = 0
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            nodes = self.st.tree.live_nodes
            pairs = self.st.tree.npairs
            cpu = self.st.tiers[0].total
            disk = self.st.tiers[1].total
            off = self.st.offload_m.size
            con = self.st.content_m.size
            pen = self.st.npending
            nb = (tree_nbytes(&self.st.tree) + lower_nbytes(&self.st.tiers[0])
                  + lower_nbytes(&self.st.tiers[1]) + u64m_nbytes(&self.st.offload_m)
                  + u64m_nbytes(&self.st.content_m) + u64m_nbytes(&self.st.pending_m)
                  + self.st.rec_pool.cap * sizeof(TPRec)
                  + self.st.wait_pool.cap * sizeof(TPWait)
                  + self.st.wcap * (sizeof(uint32_t) + 2 * sizeof(uint8_t)))
            _runlock(self, slot_)
    if stale_ == CORE_CLOSED and not self.attached:
        nodes = pairs = cpu = disk = off = con = pen = nb = 0     # closed: empty
    elif stale_:
        self._stale(stale_)
    return {"nodes": nodes, "hbm_pairs": pairs, "cpu_blocks": cpu, "disk_blocks": disk,
            "offload": off, "content": con, "pending": pen, "nbytes": nb}
