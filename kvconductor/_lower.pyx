# cython: language_level=3
"""CPU and Disk tiers: edge tables keyed by (parent engine hash | root, LocalBlockHash).

Edges live in one growable ``LEdge`` array. ``(parent, local) -> edge`` is an ``FpMap``
of 8-byte slots (edge index and 32 bits of the key's hash) whose keys are read back from
the edge, and root edges ``local -> edge`` a ``U64Map``. An edge one worker owns -- most
edges -- keeps that owner inline; two or more owners are a pooled linked list. Each
worker has a reverse map ``engine hash -> edge``, an ``FpMap`` checked against the
edge's child. Semantics: ``docs/design.md`` ("LowerTier"). The two-phase offload/pool
state that feeds these tiers lives in ``_index.CoreIndex``.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc

from kvconductor._cursor cimport HCursor, hc_get, hc_init_hashes
from kvconductor._maps cimport (
    FpMap, fpm_check, fpm_delete_at, fpm_first, fpm_free, fpm_home, fpm_init, fpm_insert,
    fpm_nbytes, fpm_next, fpm_reserve_one, hm_mix, pm_hash, prefetch, revs_count, revs_ensure,
    revs_free, revs_nbytes, u64m_check, u64m_free, u64m_get, u64m_init, u64m_nbytes, u64m_pop,
    u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, live_allocations, mem_free, pool_give, pool_init, pool_mark_free, pool_take,
)
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_t, pthread_rwlock_unlock,
    pthread_rwlock_wrlock, rwlock_init,
)

from kvconductor._tree cimport check_raise, check_rc

from kvconductor._hash import as_u64


cdef enum:
    PREFETCH_AHEAD = 32          # edges ahead for the speculative table-slot prefetch
    NO_SLOT = 0xFFFFFFFFFFFFFFFF     # "no slot" for the FpMap slot finders


cdef int lower_init(Lower* L) noexcept nogil:
    L.edges = NULL
    pool_init(&L.edge_pool)
    L.live_edges = 0
    L.own = NULL
    pool_init(&L.own_pool)
    L.nrecords = 0
    fpm_init(&L.pairs)
    u64m_init(&L.roots)
    L.rev = NULL
    L.nrev = 0
    L.total = 0
    return 0


cdef void lower_free(Lower* L) noexcept nogil:
    revs_free(&L.rev, &L.nrev)
    mem_free(L.edges)
    mem_free(L.own)
    fpm_free(&L.pairs)
    u64m_free(&L.roots)
    lower_init(L)


cdef size_t lower_nbytes(const Lower* L) noexcept nogil:
    cdef size_t n = L.edge_pool.cap * sizeof(LEdge) + L.own_pool.cap * sizeof(LOwner)
    return n + fpm_nbytes(&L.pairs) + u64m_nbytes(&L.roots) + revs_nbytes(L.rev, L.nrev)


cdef void lower_counts(const Lower* L, size_t* out) noexcept nogil:
    """``LowerTier.sizes``' first two: (worker, block) pairs and edges."""
    out[0] = L.total
    out[1] = L.live_edges


# -- non-root edges: (parent, local) -> edge, the key read back from the edge -----------------
cdef inline uint32_t _pair_fp(uint64_t parent, uint64_t local) noexcept nogil:
    return <uint32_t>pm_hash(parent, local)


cdef inline uint32_t _pair_get(const Lower* L, uint64_t parent, uint64_t local) noexcept nogil:
    cdef uint32_t fp, e
    cdef size_t i
    if L.pairs.slots == NULL:
        return HM_NIL
    fp = _pair_fp(parent, local)
    i = fpm_first(&L.pairs, fp)
    while True:
        e = L.pairs.slots[i].idx
        if e == HM_NIL or (L.edges[e].local == local and L.edges[e].parent == parent):
            return e
        i = fpm_next(&L.pairs, fp, i)


cdef void _pair_drop(Lower* L, uint32_t e) noexcept nogil:
    """Delete the table slot of non-root edge ``e``."""
    cdef uint32_t fp = _pair_fp(L.edges[e].parent, L.edges[e].local)
    cdef size_t i = fpm_first(&L.pairs, fp)
    while L.pairs.slots[i].idx != e:
        if L.pairs.slots[i].idx == HM_NIL:
            return
        i = fpm_next(&L.pairs, fp, i)
    fpm_delete_at(&L.pairs, i)


# -- reverse maps: per worker, engine hash -> edge, checked against the edge's child ---------
cdef inline uint32_t _rev_fp(uint64_t h) noexcept nogil:
    return <uint32_t>hm_mix(h)


cdef inline size_t _rev_slot(const Lower* L, const FpMap* r, uint64_t h) noexcept nogil:
    cdef uint32_t fp
    cdef size_t i
    if r.slots == NULL:
        return NO_SLOT
    fp = _rev_fp(h)
    i = fpm_first(r, fp)
    while r.slots[i].idx != HM_NIL:
        if L.edges[r.slots[i].idx].child == h:
            return i
        i = fpm_next(r, fp, i)
    return NO_SLOT


cdef uint32_t lower_rev_get(const Lower* L, uint32_t worker, uint64_t h) noexcept nogil:
    cdef size_t i
    if worker >= L.nrev:
        return HM_NIL
    i = _rev_slot(L, &L.rev[worker], h)
    return HM_NIL if i == NO_SLOT else L.rev[worker].slots[i].idx


cdef uint32_t lower_find(const Lower* L, bint has_parent, uint64_t parent,
                         uint64_t local) noexcept nogil:
    if has_parent:
        return _pair_get(L, parent, local)
    return u64m_get(&L.roots, local)


cdef uint32_t lower_root_of(const Lower* L, uint64_t local, uint32_t worker) noexcept nogil:
    cdef uint32_t e = u64m_get(&L.roots, local)
    while e != HM_NIL and not lower_owns(L, e, worker):
        e = L.edges[e].next_root
    return e


cdef size_t lower_walk_one(const Lower* L, uint32_t worker, HCursor* hc, size_t pos,
                           bint* has_parent, uint64_t* parent) noexcept nogil:
    cdef uint32_t e
    if pos >= hc.n:
        return pos
    if not has_parent[0]:
        e = lower_root_of(L, hc_get(hc, pos), worker)
        if e == HM_NIL:
            return pos
        parent[0] = L.edges[e].child
        has_parent[0] = True
        pos += 1
    while pos < hc.n:
        e = _pair_get(L, parent[0], hc_get(hc, pos))
        # owned: the worker's reverse map sends the edge's engine hash to it (O(1), as
        # lower_walk_multi asks on an edge of many owners)
        if e == HM_NIL or lower_rev_get(L, worker, L.edges[e].child) != e:
            break
        parent[0] = L.edges[e].child
        pos += 1
    return pos


cdef bint lower_holds_local(const Lower* L, uint32_t worker, uint64_t local) noexcept nogil:
    cdef const FpMap* rev
    cdef size_t i
    if worker >= L.nrev:
        return False
    rev = &L.rev[worker]
    if rev.size == 0:
        return False
    for i in range(rev.cap):
        if rev.slots[i].idx != HM_NIL and L.edges[rev.slots[i].idx].local == local:
            return True
    return False


cdef uint32_t _root_edge(const Lower* L, uint64_t local, uint64_t child) noexcept nogil:
    """The root edge (local, child), or HM_NIL."""
    cdef uint32_t e = u64m_get(&L.roots, local)
    while e != HM_NIL and L.edges[e].child != child:
        e = L.edges[e].next_root
    return e


cdef bint lower_owns(const Lower* L, uint32_t e, uint32_t worker) noexcept nogil:
    cdef uint32_t cur
    cdef uint32_t w = lower_owner_first(L, e, &cur)
    while w != HM_NIL:
        if w == worker:
            return True
        w = lower_owner_next(L, &cur)
    return False


cdef uint32_t _new_edge(Lower* L, bint has_parent, uint64_t parent, uint64_t local,
                        uint64_t child) noexcept nogil:
    cdef int rc = 0
    cdef uint32_t t
    cdef uint32_t e
    if has_parent and fpm_reserve_one(&L.pairs) < 0:
        return HM_NIL
    e = pool_take(&L.edge_pool, <void**>&L.edges, sizeof(LEdge))
    if e == HM_NIL:
        return HM_NIL
    L.edges[e].parent = parent if has_parent else 0
    L.edges[e].local = local
    L.edges[e].child = child
    L.edges[e].owners = HM_NIL
    L.edges[e].nowners = 0
    L.edges[e].has_parent = 1 if has_parent else 0
    L.edges[e].next_root = HM_NIL
    if has_parent:
        fpm_insert(&L.pairs, _pair_fp(parent, local), e)
    else:
        # NOTE: engines with different hash seeds give the same first block different
        # engine hashes; each gets its own root edge, appended so the oldest stays first.
        t = u64m_get(&L.roots, local)
        if t == HM_NIL:
            rc = u64m_put(&L.roots, local, e)
        else:
            while L.edges[t].next_root != HM_NIL:
                t = L.edges[t].next_root
            L.edges[t].next_root = e
    if rc < 0:
        _release_edge(L, e)
        return HM_NIL
    L.live_edges += 1
    return e


cdef inline void _release_edge(Lower* L, uint32_t e) noexcept nogil:
    L.edges[e].has_parent = HM_NIL
    pool_give(&L.edge_pool, L.edges, e, sizeof(LEdge))


cdef void _drop_edge(Lower* L, uint32_t e) noexcept nogil:
    cdef uint32_t t
    if L.edges[e].has_parent:
        _pair_drop(L, e)
    else:
        t = u64m_get(&L.roots, L.edges[e].local)
        if t == e:
            if L.edges[e].next_root == HM_NIL:
                u64m_pop(&L.roots, L.edges[e].local)
            else:
                u64m_put(&L.roots, L.edges[e].local, L.edges[e].next_root)
        else:
            while t != HM_NIL and L.edges[t].next_root != e:
                t = L.edges[t].next_root
            if t != HM_NIL:
                L.edges[t].next_root = L.edges[e].next_root
    _release_edge(L, e)
    L.live_edges -= 1


cdef inline uint32_t _take_record(Lower* L) noexcept nogil:
    return pool_take(&L.own_pool, <void**>&L.own, sizeof(LOwner))


cdef int _add_owner(Lower* L, uint32_t e, uint32_t worker) noexcept nogil:
    """Make ``worker`` (not an owner yet) own ``e``; -1 on OOM (unchanged). The newest
    owner comes first."""
    cdef uint32_t n = L.edges[e].nowners, a, b
    if n == 0:
        L.edges[e].owners = worker
    elif n == 1:
        # the inline owner moves to a record; the list is (new, old)
        a = _take_record(L)
        if a == HM_NIL:
            return -1
        b = _take_record(L)
        if b == HM_NIL:
            pool_give(&L.own_pool, L.own, a, sizeof(LOwner))
            return -1
        L.own[a].worker = L.edges[e].owners
        L.own[a].next = HM_NIL
        L.own[b].worker = worker
        L.own[b].next = a
        L.edges[e].owners = b
        L.nrecords += 2
    else:
        a = _take_record(L)
        if a == HM_NIL:
            return -1
        L.own[a].worker = worker
        L.own[a].next = L.edges[e].owners
        L.edges[e].owners = a
        L.nrecords += 1
    L.edges[e].nowners = n + 1
    return 0


cdef void _unown(Lower* L, uint32_t e, uint32_t worker) noexcept nogil:
    """Drop ``worker`` from edge ``e``; delete the edge when nobody owns it."""
    cdef uint32_t n = L.edges[e].nowners, o, prev = HM_NIL, r
    if n == 1:
        if L.edges[e].owners == worker:
            L.edges[e].owners = HM_NIL
            L.edges[e].nowners = 0
    elif n >= 2:
        o = L.edges[e].owners
        while o != HM_NIL:
            if L.own[o].worker == worker:
                if prev == HM_NIL:
                    L.edges[e].owners = L.own[o].next
                else:
                    L.own[prev].next = L.own[o].next
                pool_give(&L.own_pool, L.own, o, sizeof(LOwner))
                L.nrecords -= 1
                L.edges[e].nowners = n - 1
                if n == 2:
                    # one owner left: it moves inline
                    r = L.edges[e].owners
                    L.edges[e].owners = L.own[r].worker
                    pool_give(&L.own_pool, L.own, r, sizeof(LOwner))
                    L.nrecords -= 1
                break
            prev = o
            o = L.own[o].next
    if L.edges[e].nowners == 0:
        _drop_edge(L, e)


cdef long lower_store(Lower* L, uint32_t worker, bint has_parent, uint64_t parent,
                      const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil:
    cdef size_t i
    cdef long count = 0
    cdef uint32_t e, old
    cdef bint hp = has_parent
    cdef uint64_t p = parent
    cdef size_t s
    if n == 0:
        return 0
    if revs_ensure(&L.rev, &L.nrev, worker) < 0:
        return -1
    cdef FpMap* rev = &L.rev[worker]    # L.rev is reallocated by revs_ensure only
    for i in range(n):
        e = _pair_get(L, p, locals[i]) if hp else _root_edge(L, locals[i], ehashes[i])
        s = _rev_slot(L, rev, ehashes[i])
        old = HM_NIL if s == NO_SLOT else rev.slots[s].idx
        if old != HM_NIL and old != e:
            break               # the worker maps this block to another key
        if e != HM_NIL and L.edges[e].child != ehashes[i]:
            break               # the edge belongs to a different block (first writer wins)
        if old == HM_NIL and fpm_reserve_one(rev) < 0:
            return -1
        if e == HM_NIL:
            e = _new_edge(L, hp, p, locals[i], ehashes[i])
            if e == HM_NIL:
                return -1
        if old == HM_NIL:
            if not lower_owns(L, e, worker):
                if _add_owner(L, e, worker) < 0:
                    if L.edges[e].nowners == 0:
                        _drop_edge(L, e)
                    return -1
            fpm_insert(rev, _rev_fp(ehashes[i]), e)
            L.total += 1
        p = ehashes[i]
        hp = True
        count += 1
    return count


cdef long lower_remove(Lower* L, uint32_t worker, const uint64_t* ehashes, size_t n) noexcept nogil:
    cdef size_t i, s
    cdef long count = 0
    cdef uint32_t e
    cdef FpMap* rev
    if worker >= L.nrev:
        return 0
    rev = &L.rev[worker]
    for i in range(n):
        s = _rev_slot(L, rev, ehashes[i])
        if s == NO_SLOT:
            continue
        e = rev.slots[s].idx
        fpm_delete_at(rev, s)
        _unown(L, e, worker)
        L.total -= 1
        count += 1
    return count


cdef long lower_clear(Lower* L, uint32_t worker) noexcept nogil:
    cdef size_t i
    cdef long count = 0
    cdef FpMap* rev
    if worker >= L.nrev:
        return 0
    rev = &L.rev[worker]
    if rev.slots != NULL:
        for i in range(rev.cap):
            if rev.slots[i].idx != HM_NIL:
                _unown(L, rev.slots[i].idx, worker)
                count += 1
    L.total -= rev.size
    fpm_free(rev)
    return count


cdef bint lower_lookup(const Lower* L, uint64_t h, bint* has_parent, uint64_t* parent,
                       uint64_t* local) noexcept nogil:
    cdef size_t w
    cdef uint32_t e
    for w in range(L.nrev):
        e = lower_rev_get(L, <uint32_t>w, h)
        if e != HM_NIL:
            has_parent[0] = L.edges[e].has_parent == 1
            parent[0] = L.edges[e].parent
            local[0] = L.edges[e].local
            return True
    return False


cdef size_t lower_worker_blocks(const Lower* L, uint32_t worker) noexcept nogil:
    return revs_count(L.rev, L.nrev, worker)


cdef void lower_walk_multi(const Lower* L, HCursor* hc, size_t start,
                           uint64_t parent, const uint32_t* cand, size_t ncand,
                           uint32_t* idx, size_t nidx, size_t* out_end,
                           uint64_t* out_last) noexcept nogil:
    cdef size_t k, pos = start, alive = ncand
    cdef uint32_t w, j, e, cur
    cdef uint64_t p = parent
    for k in range(ncand):
        idx[cand[k]] = <uint32_t>k
        out_end[k] = start
        out_last[k] = 0
    cdef uint64_t child
    cdef uint32_t g
    while alive and pos < hc.n:
        e = _pair_get(L, p, hc_get(hc, pos))
        if e == HM_NIL:
            break
        child = L.edges[e].child
        g = e + PREFETCH_AHEAD
        if g < L.edge_pool.used and L.edges[g].has_parent == 1:
            # PERF: a chain stored in one go occupies consecutive edge slots, so
            # edge e + k is probably the one k steps on: prefetch its table slot (reading
            # that edge now also brings it into the cache for when the walk gets there).
            prefetch(&L.pairs.slots[fpm_home(
                &L.pairs, _pair_fp(L.edges[g].parent, L.edges[g].local))])
        alive = 0
        if L.edges[e].nowners > 8 * ncand:
            # few candidates on an edge many workers own: each candidate's reverse map
            # says whether it owns the edge (O(candidates), not O(owners))
            for k in range(ncand):
                if out_end[k] == pos and lower_rev_get(L, cand[k], child) == e:
                    out_end[k] = pos + 1
                    out_last[k] = child
                    alive += 1
        else:
            w = lower_owner_first(L, e, &cur)
            while w != HM_NIL:
                if w < nidx:
                    j = idx[w]
                    if j != HM_NIL and out_end[j] == pos:
                        out_end[j] = pos + 1
                        out_last[j] = child
                        alive += 1
                w = lower_owner_next(L, &cur)
        p = child
        pos += 1
    for k in range(ncand):
        idx[cand[k]] = HM_NIL


# -- invariants ------------------------------------------------------------------------------------
ctypedef unsigned long long ull


cdef int _lower_check(const Lower* L, char* msg, size_t cap, uint8_t* efree,
                      uint8_t* ofree) noexcept nogil:
    """lower_check with scratch: free marks of edges and owner records."""
    cdef size_t i, live = 0, nonroot = 0, roots = 0, chained = 0, owners = 0, nrevs = 0, w, j
    cdef size_t nrec = 0
    cdef uint32_t e, o, k, cur, ow
    cdef long nf, of
    nf = pool_mark_free(&L.edge_pool, L.edges, sizeof(LEdge), efree)
    if nf < 0:
        snprintf(msg, cap, "edge free list broken (out of range, cyclic or used > cap)")
        return -1
    of = pool_mark_free(&L.own_pool, L.own, sizeof(LOwner), ofree)
    if of < 0:
        snprintf(msg, cap, "owner free list broken (out of range, cyclic or used > cap)")
        return -1
    if fpm_check(&L.pairs) < 0 or u64m_check(&L.roots) < 0:
        snprintf(msg, cap, "edge table or root map corrupt (size, load or probe chains)")
        return -1
    for i in range(L.edge_pool.used):
        if efree[i]:
            if L.edges[i].has_parent != HM_NIL:
                snprintf(msg, cap, "edge %llu on the free list is not marked free", <ull>i)
                return -1
            continue
        if L.edges[i].has_parent > 1:
            snprintf(msg, cap, "edge %llu marked free is not on the free list", <ull>i)
            return -1
        live += 1
        k = 0
        if L.edges[i].nowners >= 2:
            o = L.edges[i].owners
            while o != HM_NIL:
                if o >= L.own_pool.used or ofree[o] != 0:
                    snprintf(msg, cap, "edge %llu lists owner record %llu that is free, "
                             "out of range or on another list", <ull>i, <ull>o)
                    return -1
                ofree[o] = 2                # visited
                k += 1
                o = L.own[o].next
            nrec += k
        elif L.edges[i].nowners == 1:
            k = 1
        if k != L.edges[i].nowners or k == 0:
            snprintf(msg, cap, "edge %llu: nowners %llu, recount %llu (ownerless edges must go)",
                     <ull>i, <ull>L.edges[i].nowners, <ull>k)
            return -1
        ow = lower_owner_first(L, <uint32_t>i, &cur)
        while ow != HM_NIL:
            if lower_rev_get(L, ow, L.edges[i].child) != i:
                snprintf(msg, cap, "owner %llu of edge %llu does not map its child %llu to it",
                         <ull>ow, <ull>i, <ull>L.edges[i].child)
                return -1
            ow = lower_owner_next(L, &cur)
        owners += k
        if L.edges[i].has_parent:
            nonroot += 1
            if _pair_get(L, L.edges[i].parent, L.edges[i].local) != i:
                snprintf(msg, cap, "edge %llu is not in the edge table", <ull>i)
                return -1
        else:
            roots += 1
    for i in range(L.own_pool.used):
        if ofree[i] == 0:
            snprintf(msg, cap, "owner record %llu is neither free nor on an edge", <ull>i)
            return -1
    # root chains: every root edge exactly once, under its own LocalBlockHash
    for j in range(L.roots.mask + 1 if L.roots.keys != NULL else 0):
        e = L.roots.vals[j]
        while e != HM_NIL:
            if (e >= L.edge_pool.used or efree[e] or L.edges[e].has_parent != 0
                    or L.edges[e].local != L.roots.keys[j] or chained >= roots):
                snprintf(msg, cap, "root chain of local %llu reaches edge %llu that is free, "
                         "not a root edge of it, or seen twice", <ull>L.roots.keys[j], <ull>e)
                return -1
            chained += 1
            e = L.edges[e].next_root
    if chained != roots or L.pairs.size != nonroot:
        snprintf(msg, cap, "root chains hold %llu of %llu root edges; table %llu of %llu",
                 <ull>chained, <ull>roots, <ull>L.pairs.size, <ull>nonroot)
        return -1
    if live != L.live_edges or live + <size_t>nf != L.edge_pool.used:
        snprintf(msg, cap, "live_edges %llu, recount %llu, free %llu, high-water %llu",
                 <ull>L.live_edges, <ull>live, <ull>nf, <ull>L.edge_pool.used)
        return -1
    if nrec != L.nrecords or nrec + <size_t>of != L.own_pool.used:
        snprintf(msg, cap, "owner records: %llu live (counted %llu), %llu free, high-water %llu",
                 <ull>nrec, <ull>L.nrecords, <ull>of, <ull>L.own_pool.used)
        return -1
    # reverse maps: sound, each entry an owned edge with that child, as many as owners
    for w in range(L.nrev):
        if fpm_check(&L.rev[w]) < 0:
            snprintf(msg, cap, "reverse map of worker %llu corrupt", <ull>w)
            return -1
        nrevs += L.rev[w].size
        for j in range(L.rev[w].cap):
            e = L.rev[w].slots[j].idx
            if e == HM_NIL:
                continue
            if (e >= L.edge_pool.used or efree[e]
                    or L.rev[w].slots[j].fp != _rev_fp(L.edges[e].child)
                    or not lower_owns(L, e, <uint32_t>w)):
                snprintf(msg, cap, "worker %llu maps edge %llu it does not own (or under "
                         "another child)", <ull>w, <ull>e)
                return -1
    if nrevs != owners or nrevs != L.total:
        snprintf(msg, cap, "total %llu, reverse maps %llu, owners %llu",
                 <ull>L.total, <ull>nrevs, <ull>owners)
        return -1
    return 0


cdef int lower_check(const Lower* L, char* msg, size_t cap) noexcept nogil:
    cdef uint8_t* efree = <uint8_t*>malloc(L.edge_pool.used + 1)
    cdef uint8_t* ofree = <uint8_t*>malloc(L.own_pool.used + 1)
    cdef int rc = -2
    if efree != NULL and ofree != NULL:
        rc = _lower_check(L, msg, cap, efree, ofree)
    free(efree)
    free(ofree)
    return rc


ctypedef Lower Table
include "_chains.pxi"
cdef ChainKernels _KERNELS = ChainKernels(
    lower_init, lower_free, lower_store, lower_remove, lower_clear, lower_counts, lower_nbytes,
    lower_check)


cdef class LowerTier(_Chains):
    """One lower tier (CPU or Disk) of an index.

    **Threading: one writer thread calls store/remove/clear; any number of
    threads may call walk/lookup_block/stats concurrently. Each method holds a C
    reader/writer lock (writers exclusive) and runs without the GIL.**
    ``sizes()`` is ``(total_blocks, num_edges, nbytes, worker_blocks(worker))``.
    """

    def lookup_block(self, uint64_t h):
        """``(parent | None, local)`` of block ``h`` (lowest worker id), or None."""
        cdef bint hp = False, found
        cdef uint64_t p = 0, local = 0
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            found = lower_lookup(&self.t, h, &hp, &p, &local)
            pthread_rwlock_unlock(&self.lock)
        if not found:
            return None
        return (p if hp else None, local)

    def walk(self, uint32_t worker, local_hashes, size_t start, parent):
        """``(count, last_engine_hash | None)`` of ``worker``'s owned run from ``start``.

        With ``parent`` None the run starts on the oldest root edge of
        ``H[start]`` that ``worker`` owns.
        """
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = lv.shape[0], end = start
        cdef bint hp = parent is not None
        cdef uint64_t p = parent if hp else 0
        cdef HCursor hc
        if start >= n:
            return (0, None)
        hc_init_hashes(&hc, &lv[0], n)
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            end = lower_walk_one(&self.t, worker, &hc, start, &hp, &p)
            pthread_rwlock_unlock(&self.lock)
        if end == start:
            return (0, None)
        return (end - start, p)

    def _corrupt_for_test(self, str kind):
        """TEST ONLY: break one invariant on purpose so a test can see ``check_invariants``
        fail (the object stays safe to free, not to use). Kinds: ``total``, ``owners``,
        ``owner_freed``, ``rev_entry``; all but ``total`` need a non-root edge two
        workers own."""
        cdef uint32_t e = self.t.edge_pool.used - 1
        cdef uint32_t o, w
        cdef size_t s
        if kind == "total":
            self.t.total += 1
            return
        while e != HM_NIL and (self.t.edges[e].has_parent != 1 or self.t.edges[e].nowners < 2):
            e -= 1
        if e == HM_NIL:
            raise ValueError("needs a non-root edge two workers own")
        o = self.t.edges[e].owners
        if kind == "owners":
            self.t.edges[e].nowners += 1
        elif kind == "owner_freed":
            pool_give(&self.t.own_pool, self.t.own, o, sizeof(LOwner))
        elif kind == "rev_entry":
            w = self.t.own[o].worker
            s = _rev_slot(&self.t, &self.t.rev[w], self.t.edges[e].child)
            fpm_delete_at(&self.t.rev[w], s)
        else:
            raise ValueError(kind)

    @property
    def total_blocks(self):
        """(worker, block) pairs held in this tier."""
        return self.sizes()[0]

    @property
    def num_edges(self):
        """Edges in the table."""
        return self.sizes()[1]


def _live_allocations():
    """Structure blocks this module allocated and has not freed (tests: leak check)."""
    return live_allocations()
