# Included by _tree.pyx: a node's members -- a sole member inline in the node, two or
# more in pooled member records or, on a wide node, a bitmap over worker ids -- and the
# pruning of nodes nobody holds.
# Like every kernel of the tree these take the Tree first, are noexcept nogil and report
# errors by return code; the module keeps the allocation, edges, reverse maps, mutations
# and the Python class, which call them.


# -- members: a sole member inline in the node, two or more in member records or, on a wide
# node, as a bitmap over worker ids with their engine hashes in worker order ------------------
cdef inline bint _is_wide(const TNode* n) noexcept nogil:
    return n.nmembers >= 2 and (n.y & T_WIDE) != 0


cdef inline TWide* _wide_of(const Tree* t, const TNode* n) noexcept nogil:
    return &t.wide[n.y & ~(<uint32_t>T_WIDE)]


cdef inline bint _wide_has(const TWide* wd, uint32_t worker) noexcept nogil:
    return (worker >> 6) < wd.nwords and _bit(wd.bits, worker)


cdef inline bint _member_ehash(const Tree* t, uint32_t node, uint32_t worker,
                               uint64_t* out) noexcept nogil:
    cdef const TNode* n = &t.nodes[node]
    cdef const TWide* wd
    cdef uint32_t m
    if n.nmembers == 1:
        if n.y == worker:
            out[0] = n.x
            return True
        return False
    if n.nmembers == 0:
        return False
    if n.y & T_WIDE:
        wd = _wide_of(t, n)
        if not _wide_has(wd, worker):
            return False
        out[0] = wd.bits[wd.nwords + _rank(wd.bits, worker)]
        return True
    m = n.y
    while m != HM_NIL:
        if t.mem[m].worker == worker:
            out[0] = t.mem[m].ehash
            return True
        m = t.mem[m].next
    return False


cdef bint tree_member_ehash(const Tree* t, uint32_t node, uint32_t worker,
                            uint64_t* out) noexcept nogil:
    return _member_ehash(t, node, worker, out)


cdef void _set_member_ehash(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    cdef TWide* wd
    cdef uint32_t m
    if t.nodes[node].nmembers == 1:
        t.nodes[node].x = ehash
        return
    if t.nodes[node].y & T_WIDE:
        wd = _wide_of(t, &t.nodes[node])
        if _wide_has(wd, worker):
            wd.bits[wd.nwords + _rank(wd.bits, worker)] = ehash
        return
    m = t.nodes[node].y
    while m != HM_NIL:
        if t.mem[m].worker == worker:
            t.mem[m].ehash = ehash
            return
        m = t.mem[m].next


cdef inline uint32_t _take_record(Tree* t) noexcept nogil:
    cdef uint32_t r = pool_take(&t.mem_pool, <void**>&t.mem, sizeof(TMember))
    if r != HM_NIL and r >= <uint32_t>T_WIDE:
        # a record index must leave TNode.y's wide bit clear (2**31 records: 32 GB)
        pool_give(&t.mem_pool, t.mem, r, sizeof(TMember))
        return HM_NIL
    return r


cdef inline uint32_t _wide_cap(uint32_t nm) noexcept nogil:
    """Engine-hash capacity for ``nm`` members: 1/8 and 4 spare."""
    return nm + nm // 8 + 4


cdef void _wide_release(Tree* t, uint32_t wi) noexcept nogil:
    cdef TWide* wd = &t.wide[wi]
    mem_free(wd.bits)
    t.wide_bytes -= (<size_t>wd.nwords + wd.cap) * sizeof(uint64_t)
    wd.bits = NULL
    wd.nwords = 0
    wd.cap = 0
    pool_give(&t.wide_pool, t.wide, wi, sizeof(TWide))
    t.nwide -= 1


cdef int _promote(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    """Turn list node ``node`` wide with ``worker`` (not a member) joining under ``ehash``;
    -1 (unchanged) when out of memory."""
    cdef TNode* n = &t.nodes[node]
    cdef uint32_t nm = n.nmembers, m, w, maxw = worker, wi, nw, cap, i, r, nxt
    cdef uint64_t* bits
    cdef uint64_t* ehs
    cdef uint32_t* before
    m = n.y
    while m != HM_NIL:
        if t.mem[m].worker > maxw:
            maxw = t.mem[m].worker
        m = t.mem[m].next
    nw = (maxw >> 6) + 1
    cap = _wide_cap(nm + 1)
    bits = <uint64_t*>mem_alloc((<size_t>nw + cap) * sizeof(uint64_t))
    if bits == NULL:
        return -1
    before = <uint32_t*>malloc(nw * sizeof(uint32_t))      # scratch: set bits before word i
    if before == NULL:
        mem_free(bits)
        return -1
    wi = pool_take(&t.wide_pool, <void**>&t.wide, sizeof(TWide))
    if wi == HM_NIL or wi >= <uint32_t>T_WIDE:
        if wi != HM_NIL:
            pool_give(&t.wide_pool, t.wide, wi, sizeof(TWide))
        free(before)
        mem_free(bits)
        return -1
    memset(bits, 0, nw * sizeof(uint64_t))
    _bit_set(bits, worker)
    m = n.y
    while m != HM_NIL:
        _bit_set(bits, t.mem[m].worker)
        m = t.mem[m].next
    r = 0
    for i in range(nw):
        before[i] = r
        r += popc64(bits[i])
    ehs = bits + nw
    w = worker
    ehs[before[w >> 6] + popc64(bits[w >> 6] & (((<uint64_t>1) << (w & 63)) - 1))] = ehash
    m = n.y
    while m != HM_NIL:
        w = t.mem[m].worker
        ehs[before[w >> 6] + popc64(bits[w >> 6] & (((<uint64_t>1) << (w & 63)) - 1))] = (
            t.mem[m].ehash)
        nxt = t.mem[m].next
        pool_give(&t.mem_pool, t.mem, m, sizeof(TMember))
        m = nxt
    free(before)
    t.nrecords -= nm
    t.wide[wi].node = node
    t.wide[wi].nwords = nw
    t.wide[wi].cap = cap
    t.wide[wi].spare = 0
    t.wide[wi].bits = bits
    t.nwide += 1
    t.nwidened += 1
    t.wide_bytes += (<size_t>nw + cap) * sizeof(uint64_t)
    n.y = <uint32_t>T_WIDE | wi
    n.x += member_sig(worker)
    n.nmembers = nm + 1
    t.npairs += 1
    return 0


cdef int _demote(Tree* t, uint32_t node) noexcept nogil:
    """Turn wide node ``node`` back into a member list (in worker order); -1 (unchanged)
    when out of memory."""
    cdef TNode* n = &t.nodes[node]
    cdef uint32_t nm = n.nmembers, r, head = HM_NIL, wi = n.y & ~(<uint32_t>T_WIDE)
    cdef TWide* wd
    cdef size_t i, rank = 0
    cdef uint64_t x
    for _ in range(nm):
        r = _take_record(t)
        if r == HM_NIL:
            while head != HM_NIL:
                r = t.mem[head].next
                pool_give(&t.mem_pool, t.mem, head, sizeof(TMember))
                head = r
            return -1
        t.mem[r].next = head
        head = r
    wd = &t.wide[wi]
    r = head
    for i in range(wd.nwords):
        x = wd.bits[i]
        while x:
            t.mem[r].worker = <uint32_t>(i * 64 + ctz64(x))
            t.mem[r].ehash = wd.bits[wd.nwords + rank]
            rank += 1
            r = t.mem[r].next
            x &= x - 1
    t.nrecords += nm
    _wide_release(t, wi)
    t.nnarrowed += 1
    n.y = head
    return 0


cdef int _list_add(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    """``worker`` joins list node ``node`` (two or more members) at the head; -1 on OOM."""
    cdef uint32_t a = _take_record(t)
    cdef TNode* n
    if a == HM_NIL:
        return -1
    n = &t.nodes[node]
    t.mem[a].worker = worker
    t.mem[a].ehash = ehash
    t.mem[a].next = n.y
    n.y = a
    n.x += member_sig(worker)
    n.nmembers += 1
    t.nrecords += 1
    t.npairs += 1
    return 0


cdef int _wide_add(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    """``worker`` joins wide node ``node``; -1 on OOM (unchanged)."""
    cdef TNode* n = &t.nodes[node]
    cdef TWide* wd = _wide_of(t, n)
    cdef uint32_t nm = n.nmembers, nw = wd.nwords, cap = wd.cap, need, ncap, r
    cdef uint64_t* p
    cdef uint64_t* ehs
    need = nw if (worker >> 6) < nw else (worker >> 6) + 1
    if need > nw and nm + 1 < need + WIDE_PAD // 2 and _demote(t, node) == 0:
        # a bitmap that wide would cost more than the member records
        return _list_add(t, node, worker, ehash)
    ncap = cap if nm + 1 <= cap else _wide_cap(nm + 1)
    if need != nw or ncap != cap:
        p = <uint64_t*>mem_realloc(wd.bits, (<size_t>need + ncap) * sizeof(uint64_t))
        if p == NULL:
            return -1
        if need != nw:
            memmove(p + need, p + nw, nm * sizeof(uint64_t))     # the engine hashes move up
            memset(p + nw, 0, (need - nw) * sizeof(uint64_t))
        t.wide_bytes += (<size_t>need + ncap - nw - cap) * sizeof(uint64_t)
        wd.bits = p
        wd.nwords = need
        wd.cap = ncap
    ehs = wd.bits + wd.nwords
    r = _rank(wd.bits, worker)
    memmove(ehs + r + 1, ehs + r, (nm - r) * sizeof(uint64_t))
    ehs[r] = ehash
    _bit_set(wd.bits, worker)
    n.x += member_sig(worker)
    n.nmembers = nm + 1
    t.npairs += 1
    return 0


cdef bint _wide_remove(Tree* t, uint32_t node, uint32_t worker) noexcept nogil:
    cdef TNode* n = &t.nodes[node]
    cdef uint32_t wi = n.y & ~(<uint32_t>T_WIDE)
    cdef TWide* wd = &t.wide[wi]
    cdef uint32_t nm = n.nmembers, r, ncap
    cdef size_t i
    cdef uint64_t* ehs
    cdef uint64_t* p
    if not _wide_has(wd, worker):
        return False
    ehs = wd.bits + wd.nwords
    r = _rank(wd.bits, worker)
    memmove(ehs + r, ehs + r + 1, (nm - 1 - r) * sizeof(uint64_t))
    _bit_clear(wd.bits, worker)
    nm -= 1
    n.nmembers = nm
    n.x -= member_sig(worker)
    t.npairs -= 1
    if nm == 1:
        # the survivor moves inline
        for i in range(wd.nwords):
            if wd.bits[i]:
                n.y = <uint32_t>(i * 64 + ctz64(wd.bits[i]))
                break
        n.x = ehs[0]
        _wide_release(t, wi)
        t.nnarrowed += 1
    elif nm < wd.nwords + WIDE_PAD // 2:
        _demote(t, node)            # out of memory: it stays wide, still sound
    elif wd.cap > nm + nm // 4 + 8:
        ncap = _wide_cap(nm)
        p = <uint64_t*>mem_realloc(wd.bits, (<size_t>wd.nwords + ncap) * sizeof(uint64_t))
        if p != NULL:
            t.wide_bytes -= (<size_t>wd.cap - ncap) * sizeof(uint64_t)
            wd.bits = p
            wd.cap = ncap
    return True


cdef int _link_member(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    """Make ``worker`` (not a member yet) hold ``node`` under ``ehash``; -1 on OOM
    (unchanged). In a member list the newest member comes first; a list that reaches
    2 * (bitmap words over every worker id) + WIDE_PAD members turns wide."""
    cdef uint32_t nm = t.nodes[node].nmembers, a, b
    cdef TNode* n
    if worker >= t.wend:
        t.wend = worker + 1
    if nm == 0:
        n = &t.nodes[node]
        n.y = worker
        n.x = ehash
        n.nmembers = 1
        t.npairs += 1
        return 0
    if nm == 1:
        # the inline member moves to a record; the list is (new, old)
        a = _take_record(t)
        if a == HM_NIL:
            return -1
        b = _take_record(t)
        if b == HM_NIL:
            pool_give(&t.mem_pool, t.mem, a, sizeof(TMember))
            return -1
        n = &t.nodes[node]
        t.mem[a].worker = n.y
        t.mem[a].ehash = n.x
        t.mem[a].next = HM_NIL
        t.mem[b].worker = worker
        t.mem[b].ehash = ehash
        t.mem[b].next = a
        n.x = member_sig(n.y) + member_sig(worker)
        n.y = b
        n.nmembers = 2
        t.nrecords += 2
        t.npairs += 1
        return 0
    if t.nodes[node].y & T_WIDE:
        return _wide_add(t, node, worker, ehash)
    if (nm + 1 >= 2 * ((<size_t>t.wend + 63) >> 6) + WIDE_PAD
            and _promote(t, node, worker, ehash) == 0):
        return 0
    return _list_add(t, node, worker, ehash)


cdef bint _unlink_member(Tree* t, uint32_t node, uint32_t worker) noexcept nogil:
    cdef TNode* n = &t.nodes[node]
    cdef uint32_t nm = n.nmembers, m, prev = HM_NIL, r
    if nm == 0:
        return False
    if nm == 1:
        if n.y != worker:
            return False
        n.y = HM_NIL
        n.x = 0
        n.nmembers = 0
        t.npairs -= 1
        return True
    if n.y & T_WIDE:
        return _wide_remove(t, node, worker)
    m = n.y
    while m != HM_NIL:
        if t.mem[m].worker == worker:
            if prev == HM_NIL:
                n.y = t.mem[m].next
            else:
                t.mem[prev].next = t.mem[m].next
            pool_give(&t.mem_pool, t.mem, m, sizeof(TMember))
            t.nrecords -= 1
            n.nmembers = nm - 1
            t.npairs -= 1
            if nm == 2:
                # one member left: it moves inline
                r = n.y
                n.y = t.mem[r].worker
                n.x = t.mem[r].ehash
                pool_give(&t.mem_pool, t.mem, r, sizeof(TMember))
                t.nrecords -= 1
            else:
                n.x -= member_sig(worker)
            return True
        prev = m
        m = t.mem[m].next
    return False


cdef void _prune(Tree* t, uint32_t n) noexcept nogil:
    """Delete ``n`` and its ancestors while they hold nothing and lead nowhere."""
    cdef uint32_t p
    while n != T_ROOT and t.nodes[n].nmembers == 0 and t.nodes[n].nchildren == 0:
        p = t.nodes[n].parent
        _drop_edge(t, n)
        t.nodes[p].nchildren -= 1
        _free_node(t, n)
        n = p
