# Included by _index.pyx: explain: how far each worker's walk reaches and why it
# stops.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them. The walks
# and scans are the structures' own (tree_path, tree_held, tree_holds_local in _tree;
# lower_walk_one, lower_holds_local in _lower); the breakpoints are the query's own
# (tree_match, _tier_walk).


# -- explain -------------------------------------------------------------------------------
cdef int _lower_stop(CoreIndex self, int tier, uint32_t w, HCursor* hc, size_t pos, bint hp,
                     uint64_t p) noexcept nogil:
    cdef const Lower* L = &self.st.tiers[tier - 1]
    cdef uint64_t h
    if pos >= hc.n:
        return STOP_END_OF_PROMPT
    h = hc_get(hc, pos)
    if lower_holds_local(L, w, h):
        return STOP_PARENT_MISMATCH
    if not hp:
        return STOP_NOT_HELD if lower_find(L, False, 0, h) != HM_NIL else STOP_NO_FIRST_BLOCK
    return STOP_NOT_HELD if lower_find(L, True, p, h) != HM_NIL else STOP_TIER_EXHAUSTED

cdef int _trace_c(CoreIndex self, HCursor* hc, Scratch* s, size_t* reach, uint8_t* code,
                  uint32_t* path) noexcept nogil:
    """Per worker: the position its tier's walk reaches and why it stops there
    (docs/design.md, "CoreIndex: explain"). The breakpoints are those of
    ``_query_rest``; a lower-tier worker walks from the root and from every breakpoint
    of its group upstream of its tier (a walk of 0 blocks reaches its start)."""
    cdef size_t k, nh, nb0, nb1, nin, plen, d, pos, best
    cdef uint32_t w, g
    cdef int t, rc, bc
    cdef size_t n = hc.n
    cdef bint hp
    cdef uint64_t p, h
    nh = tree_match(&self.st.tree, hc, s.hw, s.hd, s.hs, <uint64_t*>s.stamp)
    for k in range(self.st.nworkers):
        reach[k] = 0
    for k in range(nh):
        w = s.hw[k]
        if w >= self.st.nworkers or self.st.wmute[w]:
            continue
        if _bp_add(s, self.st.wgroup[w], s.hd[k], s.hs[w]) < 0:
            return -1
        reach[w] = s.hd[k]
    nb0 = s.nbp
    if _tier_walk(self, 0, hc, s, nb0, s.ends + self.st.ngroups) < 0:
        return -1
    nb1 = s.nbp
    # the tree path of the query: path[k] is the node after k blocks
    plen = tree_path(&self.st.tree, hc, path)
    for k in range(self.st.nworkers):
        w = <uint32_t>k
        g = self.st.wgroup[w]
        if g == HM_NIL:
            continue
        t = self.st.wtier[w]
        if self.st.wmute[w]:
            # no hits and no breakpoints (set_muted): it reaches nothing
            reach[w] = 0
            code[w] = STOP_MUTED
            continue
        if t == 0:
            d = reach[w]
            if d >= n:
                code[w] = STOP_END_OF_PROMPT
                continue
            h = hc_get(hc, d)
            if tree_holds_local(&self.st.tree, w, h):
                code[w] = STOP_PARENT_MISMATCH
            elif d + 1 < plen and tree_held(&self.st.tree, path[d + 1]):
                code[w] = STOP_NOT_HELD
            elif d == 0:
                code[w] = STOP_NO_FIRST_BLOCK
            else:
                code[w] = STOP_TIER_EXHAUSTED
            continue
        hp = False
        p = 0
        best = lower_walk_one(&self.st.tiers[t - 1], w, hc, 0, &hp, &p)
        bc = _lower_stop(self, t, w, hc, best, hp, p)
        nin = nb0 if t == 1 else nb1
        for d in range(nin):
            if s.bps[d].group != g or s.bps[d].end == HM_NIL:
                continue
            hp = True
            p = s.bps[d].last
            pos = lower_walk_one(&self.st.tiers[t - 1], w, hc, s.bps[d].end, &hp, &p)
            rc = _lower_stop(self, t, w, hc, pos, hp, p)
            if pos > best or (pos == best and rc < bc):
                best = pos
                bc = rc
        reach[w] = best
        code[w] = <uint8_t>bc
    return 0


cdef list _run_trace(CoreIndex self, HCursor* hc):
    cdef int slot_, stale_ = 0
    cdef Scratch s
    cdef int rc = 0
    cdef size_t W, G, k, nw = 0
    cdef size_t* reach = NULL
    cdef uint8_t* code = NULL
    cdef uint32_t* path = NULL
    slot_ = self._reader()
    with nogil:
        stale_ = _rlock(self, slot_)
        if stale_ == 0:
            W = _max(_max(self.st.nworkers, self.st.tree.nrev),
                     _max(self.st.tiers[0].nrev, self.st.tiers[1].nrev))
            G = self.st.ngroups
            nw = self.st.nworkers
            rc = _scratch_init(&s, W, G)
            reach = <size_t*>malloc(nw * sizeof(size_t) + 1)
            code = <uint8_t*>malloc(nw + 1)
            path = <uint32_t*>malloc((hc.n + 1) * sizeof(uint32_t))
            if reach == NULL or code == NULL or path == NULL:
                rc = -1
            if rc == 0:
                rc = _trace_c(self, hc, &s, reach, code, path)
            if rc == 0:
                for k in range(nw):
                    if self.st.wgroup[k] == HM_NIL:
                        code[k] = 0xFF
            _runlock(self, slot_)
    if stale_ == CORE_CLOSED and not self.attached:
        nodes = pairs = cpu = disk = off = con = pen = nb = 0     # closed: empty
    elif stale_:
        self._stale(stale_)
    try:
        if rc < 0:
            raise MemoryError()
        return [(k, reach[k], code[k]) for k in range(nw) if code[k] != 0xFF]
    finally:
        _scratch_free(&s)
        free(reach)
        free(code)
        free(path)

cdef object _trace(CoreIndex self, local_hashes):
    cdef const uint64_t[::1] lv = as_u64(local_hashes)
    cdef size_t n = lv.shape[0]
    cdef HCursor hc
    cdef uint64_t dummy = 0
    hc_init_hashes(&hc, &lv[0] if n else &dummy, n)
    return _run_trace(self, &hc)

cdef object _trace_tokens(CoreIndex self, tokens, size_t block_size, uint64_t seed):
    cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
    cdef size_t ntok = tv.shape[0]
    cdef HCursor hc
    cdef uint32_t dummy = 0
    if hc_init_tokens(&hc, &tv[0] if ntok else &dummy, ntok, block_size, seed) < 0:
        raise MemoryError()
    try:
        return _run_trace(self, &hc)
    finally:
        hc_free(&hc)
