# Included by _tree.pyx: dump and restore -- the tree exported as flat arrays
# (nodes in parent-before-child order, members as rows) and rebuilt from them.
# The functions take the Tree first (Cython allows no include inside a class body).


# -- dump and restore ------------------------------------------------------------------------
cdef long _export_members(const Tree* t, uint32_t n, uint32_t row, uint32_t* mnode,
                          uint32_t* mworker, uint64_t* mehash, size_t nmem) noexcept nogil:
    """Append node ``n``'s members as rows ``row`` from ``nmem`` on; the new count, or -1
    past ``t.npairs``."""
    cdef const TNode* nd = &t.nodes[n]
    cdef const TWide* wd
    cdef size_t i, rank = 0
    cdef uint32_t m
    cdef uint64_t x
    if nmem + nd.nmembers > t.npairs:
        return -1
    if nd.nmembers == 1:
        mnode[nmem] = row
        mworker[nmem] = nd.y
        mehash[nmem] = nd.x
        return <long>nmem + 1
    if nd.nmembers == 0:
        return <long>nmem
    if nd.y & T_WIDE:
        wd = _wide_of(t, nd)
        for i in range(wd.nwords):
            x = wd.bits[i]
            while x:
                if rank >= nd.nmembers:
                    return -1
                mnode[nmem] = row
                mworker[nmem] = <uint32_t>(i * 64 + ctz64(x))
                mehash[nmem] = wd.bits[wd.nwords + rank]
                nmem += 1
                rank += 1
                x &= x - 1
        return <long>nmem if rank == nd.nmembers else -1
    m = nd.y
    while m != HM_NIL:
        if nmem >= t.npairs:
            return -1
        mnode[nmem] = row
        mworker[nmem] = t.mem[m].worker
        mehash[nmem] = t.mem[m].ehash
        nmem += 1
        m = t.mem[m].next
    return <long>nmem


cdef int tree_export(const Tree* t, uint32_t* pos, uint32_t* stack, uint32_t* oparent,
                     uint64_t* olocal, uint32_t* mnode, uint32_t* mworker,
                     uint64_t* mehash) noexcept nogil:
    """Fill the node table (``t.live_nodes`` rows: parent row or HM_NIL for the root,
    local) with every parent before its children, and the member table (``t.npairs``
    rows: node row, worker, engine hash; each node's members in list order, a wide
    node's in worker order). ``pos``
    and ``stack`` are scratch of ``t.node_pool.used`` entries. 0, or -1 when the
    counters disagree with the structure."""
    cdef size_t i, nrow = 0, nmem = 0, top
    cdef uint32_t n
    cdef long k
    for i in range(t.node_pool.used):
        pos[i] = HM_NIL
    for i in range(1, t.node_pool.used):
        if t.nodes[i].nchildren == HM_NIL or pos[i] != HM_NIL:
            continue            # free, or emitted as an ancestor of an earlier node
        top = 0
        n = <uint32_t>i
        while n != T_ROOT and pos[n] == HM_NIL:
            stack[top] = n
            top += 1
            n = t.nodes[n].parent
        while top > 0:
            top -= 1
            n = stack[top]
            if nrow >= t.live_nodes:
                return -1
            oparent[nrow] = HM_NIL if t.nodes[n].parent == T_ROOT else pos[t.nodes[n].parent]
            olocal[nrow] = t.nodes[n].local
            pos[n] = <uint32_t>nrow
            k = _export_members(t, n, <uint32_t>nrow, mnode, mworker, mehash, nmem)
            if k < 0:
                return -1
            nmem = <size_t>k
            nrow += 1
    return 0 if nrow == t.live_nodes and nmem == t.npairs else -1


cdef long tree_restore(Tree* t, const uint32_t* parents, const uint64_t* locals, size_t nn,
                       const uint32_t* mnode, const uint32_t* mworker, const uint64_t* mehash,
                       size_t nm, uint32_t* rows) noexcept nogil:
    """Rebuild a :func:`tree_export` table: create the ``nn`` nodes (an existing node on
    the same path is reused), then add the ``nm`` members, last row first (so each
    node's member list comes out in the exported order). ``rows`` is scratch of ``nn``
    entries. Returns ``nm``, T_ERR_SEQUENCE for a malformed table (a parent row not
    before its child, a node row out of range, a worker already holding the engine
    hash or the node), T_ERR_OOM. On error the tree may keep memberless nodes: discard it."""
    cdef size_t i, k
    cdef uint32_t p, node, w
    cdef uint64_t e
    for i in range(nn):
        if parents[i] == HM_NIL:
            p = T_ROOT
        elif parents[i] < i:
            p = rows[parents[i]]
        else:
            return T_ERR_SEQUENCE
        node = _child(t, p, locals[i])
        if node == HM_NIL:
            node = _new_child(t, p, locals[i])
            if node == HM_NIL:
                return T_ERR_OOM
        rows[i] = node
    for k in range(nm):
        i = nm - 1 - k
        if mnode[i] >= nn or mworker[i] == HM_NIL:
            return T_ERR_SEQUENCE
        node = rows[mnode[i]]
        w = mworker[i]
        if revs_ensure(&t.rev, &t.nrev, w) < 0:
            return T_ERR_OOM
        if tree_rev_get(t, w, mehash[i]) != HM_NIL or _member_ehash(t, node, w, &e):
            return T_ERR_SEQUENCE
        if fpm_reserve_one(&t.rev[w]) < 0 or _link_member(t, node, w, mehash[i]) < 0:
            return T_ERR_OOM
        fpm_insert(&t.rev[w], _rev_fp(mehash[i]), node)
    return <long>nm
