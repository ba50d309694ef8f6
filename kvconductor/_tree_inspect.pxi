# Included by _tree.pyx: introspection and the checker -- where the bytes go
# (tree_layout, layout_dict) and the walk of the C structures that names the first
# broken invariant (tree_check).
# The functions take the Tree first (Cython allows no include inside a class body).


# -- layout ---------------------------------------------------------------------------------------
cdef void tree_layout(const Tree* t, size_t* out) noexcept nogil:
    cdef size_t w, rslots = 0
    for w in range(t.nrev):
        rslots += t.rev[w].cap
    out[0] = t.node_pool.used
    out[1] = t.mem_pool.used
    out[2] = t.nrecords
    out[3] = t.edges.cap
    out[4] = rslots
    out[5] = t.nrev
    out[6] = tree_used_bytes(t)
    out[7] = tree_nbytes(t)
    out[8] = t.nwide
    out[9] = t.wide_pool.used
    out[10] = t.wide_bytes
    out[11] = t.nwidened
    out[12] = t.nnarrowed


cdef dict layout_dict(const size_t* out):
    """``node_bytes``/``member_bytes`` (struct sizes), ``nodes``/``records`` (high-water
    marks of the two arrays), ``records_live`` (member records in use: members of nodes
    two or more workers hold as a list), ``edge_slots``/``rev_slots`` (table
    capacities), ``rev_maps`` (reverse-map headers), ``wide_bytes`` (a wide node's
    record, the struct size), ``wide_nodes`` (wide nodes: members as a bitmap),
    ``wide_records`` (high-water mark of their records), ``wide_block_bytes`` (their
    bitmaps and engine hashes), ``widened``/``narrowed`` (how many times, since the
    tree was made, a member list turned wide / a wide node turned back), ``used_bytes``
    (what the structures touch: the arrays to their high-water marks, every table slot,
    the wide blocks) and ``nbytes`` (allocated)."""
    return {"node_bytes": sizeof(TNode), "member_bytes": sizeof(TMember),
            "wide_bytes": sizeof(TWide), "nodes": out[0], "records": out[1],
            "records_live": out[2], "edge_slots": out[3], "rev_slots": out[4],
            "rev_maps": out[5], "wide_nodes": out[8], "wide_records": out[9],
            "wide_block_bytes": out[10], "widened": out[11], "narrowed": out[12],
            "used_bytes": out[6], "nbytes": out[7]}


# -- invariants ------------------------------------------------------------------------------------
ctypedef unsigned long long ull


cdef int _check_wide(const Tree* t, size_t i, char* msg, size_t cap,
                     uint8_t* wfree) noexcept nogil:
    """Wide node ``i``: its record is live and its own, the bitmap covers known worker
    ids and is exactly the member set (count, fingerprint, and each (worker, engine
    hash) found by that worker's reverse map at ``i``)."""
    cdef uint32_t wi = t.nodes[i].y & ~(<uint32_t>T_WIDE), nm = t.nodes[i].nmembers
    cdef const TWide* wd
    cdef size_t j, rank = 0, w
    cdef uint64_t x, sig = 0, e
    if wi >= t.wide_pool.used or wfree[wi] != 0:
        snprintf(msg, cap, "node %llu points at wide record %llu that is free, out of range "
                 "or another node's", <ull>i, <ull>wi)
        return -1
    wfree[wi] = 2                   # visited
    wd = &t.wide[wi]
    if (wd.node != i or wd.bits == NULL or wd.cap < nm or wd.nwords == 0
            or <size_t>(wd.nwords - 1) * 64 >= t.wend or t.wend > t.nrev):
        snprintf(msg, cap, "wide record %llu of node %llu: node %llu, %llu words, capacity "
                 "%llu for %llu members and worker ids < %llu", <ull>wi, <ull>i,
                 <ull>wd.node, <ull>wd.nwords, <ull>wd.cap, <ull>nm, <ull>t.wend)
        return -1
    for j in range(wd.nwords):
        x = wd.bits[j]
        while x:
            w = j * 64 + ctz64(x)
            x &= x - 1
            if rank >= nm:
                snprintf(msg, cap, "node %llu: its bitmap has more than nmembers %llu bits",
                         <ull>i, <ull>nm)
                return -1
            e = wd.bits[wd.nwords + rank]
            rank += 1
            sig += member_sig(<uint32_t>w)
            if w >= t.wend or tree_rev_get(t, <uint32_t>w, e) != i:
                snprintf(msg, cap, "wide member (worker %llu, ehash %llu) of node %llu is not "
                         "in the worker's reverse map", <ull>w, <ull>e, <ull>i)
                return -1
    if rank != nm or sig != t.nodes[i].x:
        snprintf(msg, cap, "node %llu: nmembers %llu / sig disagree with its bitmap of %llu "
                 "bits", <ull>i, <ull>nm, <ull>rank)
        return -1
    return 0


cdef int _tree_check(const Tree* t, char* msg, size_t cap, uint8_t* nfree, uint8_t* mfree,
                     uint8_t* wfree, uint32_t* kids) noexcept nogil:
    """tree_check with scratch: free marks of nodes, members and wide records, child
    counts."""
    cdef size_t i, live = 0, npairs = 0, nrec = 0, nrevs = 0, w, nwide = 0, wbytes = 0
    cdef uint32_t p, m, k, nm
    cdef uint64_t sig
    cdef long nf, mf, wf
    wf = pool_mark_free(&t.wide_pool, t.wide, sizeof(TWide), wfree)
    if wf < 0:
        snprintf(msg, cap, "wide record free list broken (out of range, cyclic or used > cap)")
        return -1
    nf = pool_mark_free(&t.node_pool, t.nodes, sizeof(TNode), nfree)
    if nf < 0:
        snprintf(msg, cap, "node free list broken (out of range, cyclic or used > cap)")
        return -1
    mf = pool_mark_free(&t.mem_pool, t.mem, sizeof(TMember), mfree)
    if mf < 0:
        snprintf(msg, cap, "member free list broken (out of range, cyclic or used > cap)")
        return -1
    if t.node_pool.used == 0 or nfree[T_ROOT] or t.nodes[T_ROOT].parent != HM_NIL:
        snprintf(msg, cap, "root node missing, free or with a parent")
        return -1
    if t.nodes[T_ROOT].y != HM_NIL or t.nodes[T_ROOT].nmembers != 0:
        snprintf(msg, cap, "root node has members")
        return -1
    if fpm_check(&t.edges) < 0:
        snprintf(msg, cap, "edge map corrupt (size, load or probe chains)")
        return -1
    memset(kids, 0, t.node_pool.used * sizeof(uint32_t))
    for i in range(t.node_pool.used):
        if nfree[i]:
            if t.nodes[i].nchildren != HM_NIL:
                snprintf(msg, cap, "node %llu on the free list is not marked free", <ull>i)
                return -1
            continue
        if t.nodes[i].nchildren == HM_NIL:
            snprintf(msg, cap, "node %llu marked free is not on the free list", <ull>i)
            return -1
        # members: a sole one inline; two or more as distinct live records whose count
        # and fingerprint the node carries; each found by its worker's reverse map
        nm = t.nodes[i].nmembers
        if nm == 1:
            w = t.nodes[i].y
            if w >= t.wend or tree_rev_get(t, <uint32_t>w, t.nodes[i].x) != i:
                snprintf(msg, cap, "sole member (worker %llu, ehash %llu) of node %llu is "
                         "not in the worker's reverse map", <ull>w, <ull>t.nodes[i].x, <ull>i)
                return -1
        elif nm >= 2 and (t.nodes[i].y & T_WIDE):
            if _check_wide(t, i, msg, cap, wfree) < 0:
                return -1
            nwide += 1
            wbytes += (<size_t>t.wide[t.nodes[i].y & ~(<uint32_t>T_WIDE)].nwords
                       + t.wide[t.nodes[i].y & ~(<uint32_t>T_WIDE)].cap) * sizeof(uint64_t)
        elif nm >= 2:
            sig = 0
            k = 0
            m = t.nodes[i].y
            while m != HM_NIL:
                if m >= t.mem_pool.used or mfree[m] != 0:
                    snprintf(msg, cap, "node %llu lists member record %llu that is free, "
                             "out of range or on another list", <ull>i, <ull>m)
                    return -1
                mfree[m] = 2                # visited
                w = t.mem[m].worker
                sig += member_sig(t.mem[m].worker)
                if w >= t.wend or tree_rev_get(t, <uint32_t>w, t.mem[m].ehash) != i:
                    snprintf(msg, cap, "member (worker %llu, ehash %llu) of node %llu is not "
                             "in the worker's reverse map", <ull>w, <ull>t.mem[m].ehash, <ull>i)
                    return -1
                k += 1
                m = t.mem[m].next
            if k != nm or sig != t.nodes[i].x:
                snprintf(msg, cap, "node %llu: nmembers %llu / sig disagree with its %llu "
                         "member records", <ull>i, <ull>nm, <ull>k)
                return -1
            nrec += k
        elif t.nodes[i].y != HM_NIL:
            snprintf(msg, cap, "node %llu without members points at %llu", <ull>i,
                     <ull>t.nodes[i].y)
            return -1
        npairs += nm
        if i == T_ROOT:
            continue
        live += 1
        p = t.nodes[i].parent
        if p >= t.node_pool.used or nfree[p]:
            snprintf(msg, cap, "node %llu has a free or out-of-range parent %llu",
                     <ull>i, <ull>p)
            return -1
        if _child(t, p, t.nodes[i].local) != i:
            snprintf(msg, cap, "node %llu is not the child of edge (parent %llu, its local)",
                     <ull>i, <ull>p)
            return -1
        kids[p] += 1
        if nm == 0 and t.nodes[i].nchildren == 0:
            snprintf(msg, cap, "empty node %llu survived (no members, no children)", <ull>i)
            return -1
    for i in range(t.node_pool.used):
        if not nfree[i] and kids[i] != t.nodes[i].nchildren:
            snprintf(msg, cap, "node %llu: nchildren %llu, recount %llu", <ull>i,
                     <ull>t.nodes[i].nchildren, <ull>kids[i])
            return -1
    for i in range(t.mem_pool.used):
        if mfree[i] == 0:
            snprintf(msg, cap, "member record %llu is neither free nor on a node", <ull>i)
            return -1
    for i in range(t.wide_pool.used):
        if wfree[i] == 0:
            snprintf(msg, cap, "wide record %llu is neither free nor on a node", <ull>i)
            return -1
    if nwide != t.nwide or nwide + <size_t>wf != t.wide_pool.used or wbytes != t.wide_bytes:
        snprintf(msg, cap, "nwide %llu, recount %llu, free %llu, high-water %llu; wide bytes "
                 "%llu, recount %llu", <ull>t.nwide, <ull>nwide, <ull>wf,
                 <ull>t.wide_pool.used, <ull>t.wide_bytes, <ull>wbytes)
        return -1
    if live != t.live_nodes or live + 1 + <size_t>nf != t.node_pool.used:
        snprintf(msg, cap, "live_nodes %llu, recount %llu, free %llu, high-water %llu",
                 <ull>t.live_nodes, <ull>live, <ull>nf, <ull>t.node_pool.used)
        return -1
    if npairs != t.npairs:
        snprintf(msg, cap, "npairs %llu, recount %llu", <ull>t.npairs, <ull>npairs)
        return -1
    if nrec != t.nrecords or nrec + <size_t>mf != t.mem_pool.used:
        snprintf(msg, cap, "nrecords %llu, recount %llu, free records %llu, high-water %llu",
                 <ull>t.nrecords, <ull>nrec, <ull>mf, <ull>t.mem_pool.used)
        return -1
    # every live non-root node has its edge (checked above); no other edge exists
    if t.edges.size != live:
        snprintf(msg, cap, "edge map holds %llu edges for %llu nodes",
                 <ull>t.edges.size, <ull>live)
        return -1
    # reverse maps: sound, and exactly the members (each member found above; sizes agree)
    for w in range(t.nrev):
        if fpm_check(&t.rev[w]) < 0:
            snprintf(msg, cap, "reverse map of worker %llu corrupt", <ull>w)
            return -1
        nrevs += t.rev[w].size
    if nrevs != npairs:
        snprintf(msg, cap, "reverse maps hold %llu entries for %llu members",
                 <ull>nrevs, <ull>npairs)
        return -1
    return 0


cdef int tree_check(const Tree* t, char* msg, size_t cap) noexcept nogil:
    cdef uint8_t* nfree = <uint8_t*>malloc(t.node_pool.used + 1)
    cdef uint8_t* mfree = <uint8_t*>malloc(t.mem_pool.used + 1)
    cdef uint8_t* wfree = <uint8_t*>malloc(t.wide_pool.used + 1)
    cdef uint32_t* kids = <uint32_t*>malloc((t.node_pool.used + 1) * sizeof(uint32_t))
    cdef int rc = -2
    if nfree != NULL and mfree != NULL and wfree != NULL and kids != NULL:
        rc = _tree_check(t, msg, cap, nfree, mfree, wfree, kids)
    free(nfree)
    free(mfree)
    free(wfree)
    free(kids)
    return rc
