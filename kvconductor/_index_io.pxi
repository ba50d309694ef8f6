# Included by _index.pyx: dump and restore (kvconductor.state.dump): the tree, the tiers
# and the two-phase state as arrays.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them.


# -- dump and restore (kvconductor.state.dump) ---------------------------------------------
cdef object _export_hbm(CoreIndex self):
    cdef int slot_, stale_ = 0
    cdef uint32_t* pos = NULL
    cdef uint32_t* stack = NULL
    cdef size_t nn, nm, used
    cdef int rc = 0
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
    if stale_:
        self._stale(stale_)
    try:
        nn = self.st.tree.live_nodes
        nm = self.st.tree.npairs
        used = self.st.tree.node_pool.used
        parents = _array.array("I", bytes(4 * nn))
        locs = _array.array("Q", bytes(8 * nn))
        mnode = _array.array("I", bytes(4 * nm))
        mworker = _array.array("I", bytes(4 * nm))
        mehash = _array.array("Q", bytes(8 * nm))
        pos = <uint32_t*>malloc(used * sizeof(uint32_t) + 1)
        stack = <uint32_t*>malloc(used * sizeof(uint32_t) + 1)
        if pos == NULL or stack == NULL:
            raise MemoryError()
        with nogil:
            rc = tree_export(
                &self.st.tree, pos, stack,
                <uint32_t*>(<array.array>parents).data.as_uints,
                <uint64_t*>(<array.array>locs).data.as_ulonglongs,
                <uint32_t*>(<array.array>mnode).data.as_uints,
                <uint32_t*>(<array.array>mworker).data.as_uints,
                <uint64_t*>(<array.array>mehash).data.as_ulonglongs)
    finally:
        _runlock(self, slot_)
        free(pos)
        free(stack)
    if rc < 0:
        raise AssertionError("HBM tree: node or member count disagrees with the tree")
    return parents, locs, mnode, mworker, mehash

cdef object _restore_hbm(CoreIndex self, parents, local_hashes, node, worker, ehash):
    cdef const uint32_t[::1] pv = _u32(parents)
    cdef const uint64_t[::1] lv = as_u64(local_hashes)
    cdef const uint32_t[::1] nv = _u32(node)
    cdef const uint32_t[::1] wv = _u32(worker)
    cdef const uint64_t[::1] ev = as_u64(ehash)
    cdef size_t nn = pv.shape[0], nm = nv.shape[0], i
    cdef uint32_t* rows
    cdef long rc
    self._writable()
    if <size_t>lv.shape[0] != nn or <size_t>wv.shape[0] != nm or <size_t>ev.shape[0] != nm:
        raise ValueError("HBM table: column lengths differ")
    for i in range(nm):
        if (wv[i] >= self.st.nworkers or self.st.wgroup[wv[i]] == HM_NIL
                or self.st.wtier[wv[i]] != 0):
            raise ValueError(f"HBM table: worker {wv[i]} is unknown or not an HBM worker")
    if nn == 0 and nm == 0:
        return 0
    rows = <uint32_t*>malloc(nn * sizeof(uint32_t) + 1)
    if rows == NULL:
        raise MemoryError()
    with nogil:
        _wlock(self)
        rc = tree_restore(&self.st.tree, &pv[0] if nn else NULL, &lv[0] if nn else NULL, nn,
                          &nv[0] if nm else NULL, &wv[0] if nm else NULL,
                          &ev[0] if nm else NULL, nm, rows)
        _wunlock(self)
    free(rows)
    if rc == T_ERR_OOM:
        raise MemoryError()
    if rc < 0:
        raise ValueError("HBM table: a parent row follows its child, a row is out of "
                         "range or a worker holds a block twice")
    return rc

cdef object _export_tier(CoreIndex self, int tier):
    cdef int slot_, stale_ = 0
    cdef Lower* L
    cdef size_t n, k = 0, i
    cdef uint32_t e, o, w
    cdef int bad = 0
    cdef uint32_t* ow
    cdef uint64_t* oe
    cdef uint64_t* ol
    cdef uint64_t* op
    cdef uint8_t* oh
    if tier != 1 and tier != 2:
        raise ValueError(f"tier must be 1 or 2, not {tier}")
    L = &self.st.tiers[tier - 1]
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
    if stale_:
        self._stale(stale_)
    try:
        n = L.total
        workers = _array.array("I", bytes(4 * n))
        ehashes = _array.array("Q", bytes(8 * n))
        locs = _array.array("Q", bytes(8 * n))
        parents = _array.array("Q", bytes(8 * n))
        hps = _array.array("B", bytes(n))
        ow = <uint32_t*>(<array.array>workers).data.as_uints
        oe = <uint64_t*>(<array.array>ehashes).data.as_ulonglongs
        ol = <uint64_t*>(<array.array>locs).data.as_ulonglongs
        op = <uint64_t*>(<array.array>parents).data.as_ulonglongs
        oh = <uint8_t*>(<array.array>hps).data.as_uchars
        with nogil:
            # pass 0: root edges along each local's chain (oldest first); pass 1: the rest
            for i in range(L.roots.mask + 1 if L.roots.keys != NULL else 0):
                e = L.roots.vals[i]
                while e != HM_NIL and bad == 0:
                    w = lower_owner_first(L, e, &o)
                    while w != HM_NIL:
                        if k >= n:
                            bad = 1
                            break
                        ow[k] = w
                        oe[k] = L.edges[e].child
                        ol[k] = L.edges[e].local
                        op[k] = 0
                        oh[k] = 0
                        k += 1
                        w = lower_owner_next(L, &o)
                    e = L.edges[e].next_root
            for i in range(L.edge_pool.used):
                if L.edges[i].has_parent != 1 or bad:
                    continue
                w = lower_owner_first(L, <uint32_t>i, &o)
                while w != HM_NIL:
                    if k >= n:
                        bad = 1
                        break
                    ow[k] = w
                    oe[k] = L.edges[i].child
                    ol[k] = L.edges[i].local
                    op[k] = L.edges[i].parent
                    oh[k] = 1
                    k += 1
                    w = lower_owner_next(L, &o)
    finally:
        _runlock(self, slot_)
    if bad or k != n:
        raise AssertionError("lower tier: block count disagrees with the edges")
    return workers, ehashes, locs, parents, hps

cdef object _restore_tier(CoreIndex self, int tier, worker, ehash, local_hashes, parent,
                          has_parent):
    cdef const uint32_t[::1] wv = _u32(worker)
    cdef const uint64_t[::1] ev = as_u64(ehash)
    cdef const uint64_t[::1] lv = as_u64(local_hashes)
    cdef const uint64_t[::1] pv = as_u64(parent)
    cdef const uint8_t[::1] hv = _u8(has_parent)
    cdef size_t n = wv.shape[0], i
    cdef long rc = 1
    cdef Lower* L
    self._writable()
    if tier != 1 and tier != 2:
        raise ValueError(f"tier must be 1 or 2, not {tier}")
    if (<size_t>ev.shape[0] != n or <size_t>lv.shape[0] != n or <size_t>pv.shape[0] != n
            or <size_t>hv.shape[0] != n):
        raise ValueError("tier table: column lengths differ")
    for i in range(n):
        if (wv[i] >= self.st.nworkers or self.st.wgroup[wv[i]] == HM_NIL
                or self.st.wtier[wv[i]] != tier):
            raise ValueError(f"tier table: worker {wv[i]} is unknown or not of tier {tier}")
    L = &self.st.tiers[tier - 1]
    i = 0
    with nogil:
        _wlock(self)
        while i < n:
            rc = lower_store(L, wv[i], hv[i] != 0, pv[i], &ev[i], &lv[i], 1)
            if rc != 1:
                break
            i += 1
        _wunlock(self)
    if rc < 0:
        raise MemoryError()
    if i < n:
        raise ValueError(f"tier table: row {i} (block {ev[i]} of worker {wv[i]}) refused")
    return n

cdef object _export_twophase(CoreIndex self):
    cdef int slot_, stale_ = 0
    cdef size_t i
    cdef int k
    cdef uint32_t r, c
    cdef U64Map* m
    records = []
    waits = []
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
    if stale_:
        self._stale(stale_)
    try:
        for k in range(2):
            m = &self.st.offload_m if k == 0 else &self.st.content_m
            for i in range(m.mask + 1 if m.keys != NULL else 0):
                r = m.vals[i]
                if r == HM_NIL:
                    continue
                records.append((k, m.keys[i], self.st.recs[r].local,
                                self.st.recs[r].parent if self.st.recs[r].has_parent else None,
                                self.st.recs[r].t))
        m = &self.st.pending_m
        for i in range(m.mask + 1 if m.keys != NULL else 0):
            c = m.vals[i]
            while c != HM_NIL:
                waits.append((m.keys[i], self.st.waits[c].worker, self.st.waits[c].t))
                c = self.st.waits[c].next
    finally:
        _runlock(self, slot_)
    return records, waits

cdef object _restore_twophase(CoreIndex self, records, waits):
    cdef int kind
    cdef uint64_t h, local, parent
    cdef uint32_t worker, cur, head
    cdef bint hp
    cdef double t
    self._writable()
    recs = [(int(k), int(h_), int(l_), p_, float(t_)) for k, h_, l_, p_, t_ in records]
    ws = [(int(h_), int(w_), float(t_)) for h_, w_, t_ in waits]
    for rec in recs:
        if rec[0] != 0 and rec[0] != 1:
            raise ValueError(f"two-phase record of kind {rec[0]}")
    for wait in ws:
        worker = wait[1]
        if worker >= self.st.nworkers or self.st.wgroup[worker] == HM_NIL:
            raise ValueError(f"pending wait of unknown worker {worker}")
    with nogil:
        _wlock(self)
    try:
        for kind, h, local, p_, t in recs:
            hp = p_ is not None
            parent = p_ if hp else 0
            if (u64m_get(&self.st.offload_m, h) != HM_NIL
                    or u64m_get(&self.st.content_m, h) != HM_NIL):
                raise ValueError(f"two-phase record for hash {h} given twice")
            if _put_rec(self, &self.st.offload_m if kind == 0 else &self.st.content_m, h, local,
                        hp, parent, t) < 0:
                raise MemoryError()
        # each hash's waiters come newest first: push them oldest first
        for h, worker, t in reversed(ws):
            head = u64m_get(&self.st.pending_m, h)
            cur = head
            while cur != HM_NIL and self.st.waits[cur].worker != worker:
                cur = self.st.waits[cur].next
            if cur != HM_NIL:
                raise ValueError(f"worker {worker} waits twice for hash {h}")
            cur = _new_wait(self, worker, t)
            if cur == HM_NIL:
                raise MemoryError()
            self.st.waits[cur].next = head
            if u64m_put(&self.st.pending_m, h, cur) < 0:
                pool_give(&self.st.wait_pool, self.st.waits, cur, sizeof(TPWait))
                raise MemoryError()
            self.st.npending += 1
    finally:
        _wunlock(self)


cdef const uint32_t[::1] _u32(values):
    """A u32 view of an ``array('I')`` (or any ints)."""
    if isinstance(values, _array.array) and values.typecode == "I":
        return values
    return _array.array("I", values)


cdef const uint8_t[::1] _u8(values):
    """A u8 view of an ``array('B')``, bytes (or any ints)."""
    if isinstance(values, _array.array) and values.typecode == "B":
        return values
    return _array.array("B", values)
