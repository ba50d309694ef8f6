# cython: language_level=3
"""HBM radix tree: flat arrays of C structs linked by integer index.

Nodes live in one growable ``TNode`` array (node 0 is the root). A node one worker
holds -- most nodes -- keeps that member (worker, engine hash) inline; a node two or
more workers hold lists them in a pooled ``TMember`` array. The edge table
``(parent node, LocalBlockHash) -> child`` and each worker's reverse map
``engine hash -> node`` are ``FpMap`` tables of 8-byte slots (a node index and a 32-bit
fingerprint of the key) whose keys are read back from the node, so no key is stored
twice. Semantics: ``docs/design.md`` ("RadixTree"); the bytes: ``docs/performance.md``.

Every kernel here is ``noexcept nogil`` and reports errors by return code
(``T_ERR_*``); the Python-facing methods map them to exceptions.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from kvconductor._cursor cimport HCursor, hc_get, hc_init_hashes
from kvconductor._maps cimport (
    FpMap, U64Map, em_hash, fpm_check, fpm_delete_at, fpm_first, fpm_free, fpm_home, fpm_init,
    fpm_insert, fpm_nbytes, fpm_next, fpm_reserve_one, hm_mix, prefetch, revs_count, revs_ensure,
    revs_free, revs_nbytes, u64m_free, u64m_init, u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, live_allocations, mem_free, pool_give, pool_init, pool_mark_free, pool_take,
    pool_use_arena,
)
from kvconductor._arena cimport Arena
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_unlock, pthread_rwlock_wrlock,
    rwlock_init,
)

from kvconductor._hash import as_u64
from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound

cdef enum:
    NO_SLOT = 0xFFFFFFFFFFFFFFFF     # "no slot" for the FpMap slot finders


# -- allocation ---------------------------------------------------------------------------
cdef int tree_init(Tree* t) noexcept nogil:
    t.nodes = NULL
    pool_init(&t.node_pool)
    t.live_nodes = 0
    t.mem = NULL
    pool_init(&t.mem_pool)
    t.nrecords = 0
    t.npairs = 0
    fpm_init(&t.edges)
    t.rev = NULL
    t.nrev = 0
    if pool_take(&t.node_pool, <void**>&t.nodes, sizeof(TNode)) != T_ROOT:
        return -1
    t.nodes[0].local = 0
    t.nodes[0].parent = HM_NIL
    t.nodes[0].y = HM_NIL
    t.nodes[0].x = 0
    t.nodes[0].nmembers = 0
    t.nodes[0].nchildren = 0
    return 0


cdef void tree_free(Tree* t) noexcept nogil:
    revs_free(&t.rev, &t.nrev)
    mem_free(t.nodes)
    t.nodes = NULL
    pool_init(&t.node_pool)
    mem_free(t.mem)
    t.mem = NULL
    pool_init(&t.mem_pool)
    fpm_free(&t.edges)


cdef size_t _tables_nbytes(const Tree* t) noexcept nogil:
    return fpm_nbytes(&t.edges) + revs_nbytes(t.rev, t.nrev)


cdef size_t tree_nbytes(const Tree* t) noexcept nogil:
    return (t.node_pool.cap * sizeof(TNode) + t.mem_pool.cap * sizeof(TMember)
            + _tables_nbytes(t))


cdef size_t tree_used_bytes(const Tree* t) noexcept nogil:
    return (<size_t>t.node_pool.used * sizeof(TNode)
            + <size_t>t.mem_pool.used * sizeof(TMember) + _tables_nbytes(t))


cdef uint32_t _alloc_node(Tree* t, uint64_t local, uint32_t parent) noexcept nogil:
    cdef uint32_t i = pool_take(&t.node_pool, <void**>&t.nodes, sizeof(TNode))
    if i == HM_NIL:
        return HM_NIL
    t.nodes[i].local = local
    t.nodes[i].parent = parent
    t.nodes[i].y = HM_NIL
    t.nodes[i].x = 0
    t.nodes[i].nmembers = 0
    t.nodes[i].nchildren = 0
    t.live_nodes += 1
    return i


cdef inline void _free_node(Tree* t, uint32_t i) noexcept nogil:
    t.nodes[i].nchildren = HM_NIL
    t.nodes[i].parent = HM_NIL
    pool_give(&t.node_pool, t.nodes, i, sizeof(TNode))
    t.live_nodes -= 1


# -- edges: (parent, local) -> child, keys read back from the child ---------------------------
cdef inline uint32_t _child(const Tree* t, uint32_t parent, uint64_t local) noexcept nogil:
    cdef uint32_t fp, c
    cdef size_t i
    if t.edges.slots == NULL:
        return HM_NIL
    fp = <uint32_t>em_hash(parent, local)
    i = fpm_first(&t.edges, fp)
    while True:
        c = t.edges.slots[i].idx
        if c == HM_NIL or (t.nodes[c].local == local and t.nodes[c].parent == parent):
            return c
        i = fpm_next(&t.edges, fp, i)


cdef uint32_t tree_child(const Tree* t, uint32_t parent, uint64_t local) noexcept nogil:
    return _child(t, parent, local)


cdef uint32_t _new_child(Tree* t, uint32_t parent, uint64_t local) noexcept nogil:
    """A new node under ``parent`` for ``local`` (not there yet); HM_NIL on OOM."""
    cdef uint32_t child
    if fpm_reserve_one(&t.edges) < 0:
        return HM_NIL
    child = _alloc_node(t, local, parent)
    if child == HM_NIL:
        return HM_NIL
    fpm_insert(&t.edges, <uint32_t>em_hash(parent, local), child)
    t.nodes[parent].nchildren += 1
    return child


cdef void _drop_edge(Tree* t, uint32_t n) noexcept nogil:
    """Delete the edge slot of node ``n`` (from its parent)."""
    cdef uint32_t fp = <uint32_t>em_hash(t.nodes[n].parent, t.nodes[n].local)
    cdef size_t i = fpm_first(&t.edges, fp)
    while t.edges.slots[i].idx != n:
        if t.edges.slots[i].idx == HM_NIL:
            return
        i = fpm_next(&t.edges, fp, i)
    fpm_delete_at(&t.edges, i)


# -- members: a sole member inline in the node, two or more in member records ------------------
cdef inline bint _member_ehash(const Tree* t, uint32_t node, uint32_t worker,
                               uint64_t* out) noexcept nogil:
    cdef const TNode* n = &t.nodes[node]
    cdef uint32_t m
    if n.nmembers == 1:
        if n.y == worker:
            out[0] = n.x
            return True
        return False
    if n.nmembers == 0:
        return False
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


cdef inline uint32_t _member_first(const Tree* t, uint32_t node, uint32_t* cur,
                                   uint64_t* ehash) noexcept nogil:
    """Members of ``node`` in list order: ``w = _member_first(t, node, &cur, &e)``, then
    while ``w != HM_NIL``, ``w = _member_next(t, &cur, &e)`` (``e``: w's engine hash)."""
    cdef uint32_t nm = t.nodes[node].nmembers
    cur[0] = HM_NIL
    if nm == 1:
        ehash[0] = t.nodes[node].x
        return t.nodes[node].y
    if nm == 0:
        return HM_NIL
    cur[0] = t.nodes[node].y
    return _member_next(t, cur, ehash)


cdef inline uint32_t _member_next(const Tree* t, uint32_t* cur, uint64_t* ehash) noexcept nogil:
    cdef uint32_t m = cur[0]
    if m == HM_NIL:
        return HM_NIL
    cur[0] = t.mem[m].next
    ehash[0] = t.mem[m].ehash
    return t.mem[m].worker


cdef void _set_member_ehash(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    cdef uint32_t m
    if t.nodes[node].nmembers == 1:
        t.nodes[node].x = ehash
        return
    m = t.nodes[node].y
    while m != HM_NIL:
        if t.mem[m].worker == worker:
            t.mem[m].ehash = ehash
            return
        m = t.mem[m].next


cdef inline uint32_t _take_record(Tree* t) noexcept nogil:
    return pool_take(&t.mem_pool, <void**>&t.mem, sizeof(TMember))


cdef int _link_member(Tree* t, uint32_t node, uint32_t worker, uint64_t ehash) noexcept nogil:
    """Make ``worker`` (not a member yet) hold ``node`` under ``ehash``; -1 on OOM
    (unchanged). The newest member comes first in the list."""
    cdef uint32_t nm = t.nodes[node].nmembers, a, b
    cdef TNode* n
    if nm == 0:
        n = &t.nodes[node]
        n.y = worker
        n.x = ehash
    elif nm == 1:
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
        t.nrecords += 2
    else:
        a = _take_record(t)
        if a == HM_NIL:
            return -1
        n = &t.nodes[node]
        t.mem[a].worker = worker
        t.mem[a].ehash = ehash
        t.mem[a].next = n.y
        n.y = a
        n.x += member_sig(worker)
        t.nrecords += 1
    n.nmembers = nm + 1
    t.npairs += 1
    return 0


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


# -- reverse maps: per worker, engine hash -> node, keys read back from the member -------------
cdef inline uint32_t _rev_fp(uint64_t ehash) noexcept nogil:
    return <uint32_t>hm_mix(ehash)


cdef inline size_t _rev_slot(const Tree* t, const FpMap* r, uint32_t worker,
                             uint64_t ehash) noexcept nogil:
    """The slot of ``r`` (``worker``'s map) holding ``ehash``, or NO_SLOT."""
    cdef uint32_t fp
    cdef size_t i
    cdef uint64_t e
    if r.slots == NULL:
        return NO_SLOT
    fp = _rev_fp(ehash)
    i = fpm_first(r, fp)
    while r.slots[i].idx != HM_NIL:
        if _member_ehash(t, r.slots[i].idx, worker, &e) and e == ehash:
            return i
        i = fpm_next(r, fp, i)
    return NO_SLOT


cdef uint32_t tree_rev_get(const Tree* t, uint32_t worker, uint64_t ehash) noexcept nogil:
    cdef size_t i
    if worker >= t.nrev:
        return HM_NIL
    i = _rev_slot(t, &t.rev[worker], worker, ehash)
    return HM_NIL if i == NO_SLOT else t.rev[worker].slots[i].idx


cdef inline uint32_t _rev_pop(Tree* t, FpMap* r, uint32_t worker, uint64_t ehash) noexcept nogil:
    """Delete ``worker``'s entry for ``ehash`` (before its member is unlinked: the
    lookup reads the member); its node, or HM_NIL when absent."""
    cdef size_t i = _rev_slot(t, r, worker, ehash)
    cdef uint32_t node
    if i == NO_SLOT:
        return HM_NIL
    node = r.slots[i].idx
    fpm_delete_at(r, i)
    return node


# -- mutations ----------------------------------------------------------------------------
cdef int _has_repeat(bint has_parent, uint64_t parent, const uint64_t* ehashes,
                     size_t n) noexcept nogil:
    """1 if ``[parent] + ehashes`` repeats a value, 0 if not, -1 out of memory."""
    cdef size_t i, j
    cdef U64Map seen
    cdef int rc
    if n <= 32:
        for i in range(n):
            if has_parent and ehashes[i] == parent:
                return 1
            for j in range(i):
                if ehashes[j] == ehashes[i]:
                    return 1
        return 0
    u64m_init(&seen)
    if has_parent and u64m_put(&seen, parent, 0) < 0:
        u64m_free(&seen)
        return -1
    for i in range(n):
        rc = u64m_put(&seen, ehashes[i], 0)
        if rc != 1:
            u64m_free(&seen)
            return -1 if rc < 0 else 1
    u64m_free(&seen)
    return 0


cdef long tree_store(Tree* t, uint32_t worker, bint has_parent, uint64_t parent,
                     const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil:
    cdef uint32_t node = T_ROOT, child, old
    cdef size_t i
    cdef int rc
    cdef uint64_t e, cur
    cdef size_t s
    cdef FpMap* rev
    if n == 0:
        return 0
    if has_parent:
        node = tree_rev_get(t, worker, parent)
        if node == HM_NIL:
            return T_ERR_PARENT
    rc = _has_repeat(has_parent, parent, ehashes, n)
    if rc != 0:
        return T_ERR_OOM if rc < 0 else T_ERR_SEQUENCE
    if revs_ensure(&t.rev, &t.nrev, worker) < 0:
        return T_ERR_OOM
    rev = &t.rev[worker]        # t.rev is reallocated by revs_ensure only
    for i in range(n):
        e = ehashes[i]
        child = _child(t, node, locals[i])
        old = HM_NIL
        if rev.size:
            s = _rev_slot(t, rev, worker, e)
            if s != NO_SLOT:
                old = rev.slots[s].idx
                if old != child:
                    # The worker announced this engine hash elsewhere before: it moved.
                    fpm_delete_at(rev, s)
                    _unlink_member(t, old, worker)
                    _prune(t, old)
                    # NOTE: pruning may have freed ``child`` (an emptied ancestor of ``old``).
                    child = _child(t, node, locals[i])
        if child == HM_NIL:
            child = _new_child(t, node, locals[i])
            if child == HM_NIL:
                return T_ERR_OOM
        if _member_ehash(t, child, worker, &cur):
            if cur != e:
                # The worker holds this block under another engine hash: re-key it (the
                # pop leaves room for the insert).
                _rev_pop(t, rev, worker, cur)
                _set_member_ehash(t, child, worker, e)
                fpm_insert(rev, _rev_fp(e), child)
        else:
            if fpm_reserve_one(rev) < 0 or _link_member(t, child, worker, e) < 0:
                _prune(t, child)
                return T_ERR_OOM
            fpm_insert(rev, _rev_fp(e), child)
        node = child
    return <long>n


cdef long tree_remove(Tree* t, uint32_t worker, const uint64_t* ehashes, size_t n) noexcept nogil:
    cdef size_t i
    cdef long count = 0
    cdef uint32_t node
    if worker >= t.nrev:
        return 0
    for i in range(n):
        node = _rev_pop(t, &t.rev[worker], worker, ehashes[i])
        if node == HM_NIL:
            continue
        _unlink_member(t, node, worker)
        _prune(t, node)
        count += 1
    return count


cdef long tree_clear(Tree* t, uint32_t worker) noexcept nogil:
    cdef size_t i
    cdef long count = 0
    cdef FpMap* rev
    cdef uint32_t node
    if worker >= t.nrev:
        return 0
    rev = &t.rev[worker]
    if rev.slots != NULL:
        for i in range(rev.cap):
            node = rev.slots[i].idx
            if node != HM_NIL:
                _unlink_member(t, node, worker)
                _prune(t, node)
                count += 1
    fpm_free(rev)
    return count


cdef size_t tree_worker_blocks(const Tree* t, uint32_t worker) noexcept nogil:
    return revs_count(t.rev, t.nrev, worker)


# -- match -----------------------------------------------------------------------------------------
cdef enum:
    PREFETCH_AHEAD = 32          # blocks ahead for the speculative edge-slot prefetch
    ST_ALIVE = 0xFFFFFFFE       # candidate still on the path
    ST_KEEP = 0xFFFFFFFD        # candidate seen on the node of a slow step


cdef inline void _settle(const Tree* t, uint32_t node, uint32_t step, uint32_t* stamp,
                         uint32_t mark, uint32_t* out_depth, uint64_t* out_ehash) noexcept nogil:
    """Every still-alive candidate on ``node`` ends there: depth ``step``, its ehash on
    ``node``; its stamp becomes ``mark``."""
    cdef uint32_t m, w
    if t.nodes[node].nmembers == 1:
        w = t.nodes[node].y
        if stamp[w] == ST_ALIVE:
            out_ehash[w] = t.nodes[node].x
            out_depth[w] = step
            stamp[w] = mark
        return
    m = t.nodes[node].y if t.nodes[node].nmembers else HM_NIL
    while m != HM_NIL:
        w = t.mem[m].worker
        if stamp[w] == ST_ALIVE:
            out_ehash[w] = t.mem[m].ehash
            out_depth[w] = step
            stamp[w] = mark
        m = t.mem[m].next


cdef size_t tree_match(const Tree* t, HCursor* hc, uint32_t* out_worker, uint32_t* out_depth,
                       uint64_t* out_ehash, uint32_t* stamp) noexcept nogil:
    """Consecutive depth from the root of every worker on the first node.

    ``out_worker[0:alive]`` holds the candidates still on the path, the ones
    that left follow. A step whose node has exactly the alive set (same size,
    same ``tree_sig`` fingerprint) costs O(1); otherwise the node's members are
    scanned and the workers that left get depth ``step`` and their breakpoint
    ehash from the previous node.
    NOTE: the fingerprint is a 64-bit sum of mixed worker ids: the same order of
    collision risk as the 64-bit block hashes the whole index is keyed by.
    """
    cdef size_t n = hc.n, cnt = 0, alive, k, j
    cdef uint32_t node, child, m, w, step, tmp
    cdef uint64_t asig = 0
    if n == 0 or t.nrev == 0:
        return 0
    child = _child(t, T_ROOT, hc_get(hc, 0))
    if child == HM_NIL:
        return 0
    memset(stamp, 0xFF, t.nrev * sizeof(uint32_t))
    if t.nodes[child].nmembers == 1:
        w = t.nodes[child].y
        stamp[w] = ST_ALIVE
        out_worker[0] = w
        cnt = 1
    else:
        m = t.nodes[child].y if t.nodes[child].nmembers else HM_NIL
        while m != HM_NIL:
            w = t.mem[m].worker
            stamp[w] = ST_ALIVE
            out_worker[cnt] = w
            cnt += 1
            m = t.mem[m].next
    alive = cnt
    asig = tree_sig(&t.nodes[child])
    node = child
    step = 1
    while step < n:
        child = _child(t, node, hc_get(hc, step))
        if child == HM_NIL:
            break
        if step + PREFETCH_AHEAD < n and t.edges.slots != NULL:
            # PERF: a chain stored in one go has consecutive node indices, so the
            # edge slot PREFETCH_AHEAD steps on is probably at (child + k, H[step + k]).
            prefetch(&t.edges.slots[fpm_home(&t.edges, <uint32_t>em_hash(
                child + PREFETCH_AHEAD - 1, hc_get(hc, step + PREFETCH_AHEAD)))])
            prefetch(&t.nodes[child + PREFETCH_AHEAD] if child + PREFETCH_AHEAD < t.node_pool.used
                     else &t.nodes[child])
        if t.nodes[child].nmembers == alive and tree_sig(&t.nodes[child]) == asig:
            node = child
            step += 1
            continue
        # Slow step: mark the alive workers that are on ``child`` ...
        if t.nodes[child].nmembers == 1:
            w = t.nodes[child].y
            if stamp[w] == ST_ALIVE:
                stamp[w] = ST_KEEP
        else:
            m = t.nodes[child].y if t.nodes[child].nmembers else HM_NIL
            while m != HM_NIL:
                w = t.mem[m].worker
                if stamp[w] == ST_ALIVE:
                    stamp[w] = ST_KEEP
                m = t.mem[m].next
        # ... the others stop at depth ``step`` with their ehash on ``node``.
        _settle(t, node, step, stamp, HM_NIL, out_depth, out_ehash)
        j = 0
        asig = 0
        for k in range(alive):
            w = out_worker[k]
            if stamp[w] == ST_KEEP:
                stamp[w] = ST_ALIVE
                asig += member_sig(w)
                tmp = out_worker[j]
                out_worker[j] = w
                out_worker[k] = tmp
                j += 1
        alive = j
        if alive == 0:
            break
        node = child
        step += 1
    # The survivors end on ``node`` at depth ``step``.
    if alive:
        _settle(t, node, step, stamp, ST_ALIVE, out_depth, out_ehash)
    # out_depth was filled by worker id; convert it to result order.
    for k in range(cnt):
        stamp[k] = out_depth[out_worker[k]]
    for k in range(cnt):
        out_depth[k] = stamp[k]
    return cnt


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


cdef dict layout_dict(const size_t* out):
    """``node_bytes``/``member_bytes`` (struct sizes), ``nodes``/``records`` (high-water
    marks of the two arrays), ``records_live`` (member records in use: members of nodes
    two or more workers hold), ``edge_slots``/``rev_slots`` (table capacities),
    ``rev_maps`` (reverse-map headers), ``used_bytes`` (what the structures touch: the
    arrays to their high-water marks, every table slot) and ``nbytes`` (allocated)."""
    return {"node_bytes": sizeof(TNode), "member_bytes": sizeof(TMember), "nodes": out[0],
            "records": out[1], "records_live": out[2], "edge_slots": out[3],
            "rev_slots": out[4], "rev_maps": out[5], "used_bytes": out[6], "nbytes": out[7]}


# -- invariants ------------------------------------------------------------------------------------
ctypedef unsigned long long ull


cdef int _tree_check(const Tree* t, char* msg, size_t cap, uint8_t* nfree, uint8_t* mfree,
                     uint32_t* kids) noexcept nogil:
    """tree_check with scratch: free marks of nodes and members, child counts."""
    cdef size_t i, live = 0, npairs = 0, nrec = 0, nrevs = 0, w
    cdef uint32_t p, m, k, nm
    cdef uint64_t sig
    cdef long nf, mf
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
            if w >= t.nrev or tree_rev_get(t, <uint32_t>w, t.nodes[i].x) != i:
                snprintf(msg, cap, "sole member (worker %llu, ehash %llu) of node %llu is "
                         "not in the worker's reverse map", <ull>w, <ull>t.nodes[i].x, <ull>i)
                return -1
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
                if w >= t.nrev or tree_rev_get(t, <uint32_t>w, t.mem[m].ehash) != i:
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
    cdef uint32_t* kids = <uint32_t*>malloc((t.node_pool.used + 1) * sizeof(uint32_t))
    cdef int rc = -2
    if nfree != NULL and mfree != NULL and kids != NULL:
        rc = _tree_check(t, msg, cap, nfree, mfree, kids)
    free(nfree)
    free(mfree)
    free(kids)
    return rc


# -- Python API ---------------------------------------------------------------------------
cdef class RadixTree:
    """HBM radix tree over LocalBlockHashes, shared by every HBM worker of an index.

    **Threading: one writer thread calls store/remove/clear; any number of
    threads may call match/stats concurrently. Each method holds a C
    reader/writer lock (writers exclusive) and runs without the GIL.**
    """

    def __cinit__(self):
        self.lock_ok = False
        if tree_init(&self.t) < 0:
            tree_free(&self.t)
            raise MemoryError()
        if rwlock_init(&self.lock) != 0:
            tree_free(&self.t)
            raise MemoryError("cannot initialise rwlock")
        self.lock_ok = True

    def __dealloc__(self):
        tree_free(&self.t)
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
            rc = tree_store(&self.t, worker, has_parent, p, &sv[0], &lv[0], n)
            pthread_rwlock_unlock(&self.lock)
        return check_rc(rc)

    def remove(self, uint32_t worker, engine_hashes):
        """Remove blocks of ``worker`` by engine hash; returns how many it held."""
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long rc
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = tree_remove(&self.t, worker, &sv[0], n)
            pthread_rwlock_unlock(&self.lock)
        return rc

    def clear(self, uint32_t worker):
        """Remove every block of ``worker``; returns the count."""
        cdef long rc
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = tree_clear(&self.t, worker)
            pthread_rwlock_unlock(&self.lock)
        return rc

    def match(self, local_hashes):
        """``[(worker, depth, last_engine_hash)]`` sorted by worker."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = lv.shape[0], cnt = 0, k, nw
        cdef HCursor hc
        cdef uint32_t* ow = NULL
        cdef uint32_t* od = NULL
        cdef uint32_t* st = NULL
        cdef uint64_t* os = NULL
        if n == 0:
            return []
        hc_init_hashes(&hc, &lv[0], n)
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            nw = self.t.nrev
            if nw:
                ow = <uint32_t*>malloc(nw * sizeof(uint32_t))
                od = <uint32_t*>malloc(nw * sizeof(uint32_t))
                st = <uint32_t*>malloc(nw * sizeof(uint32_t))
                os = <uint64_t*>malloc(nw * sizeof(uint64_t))
                if ow != NULL and od != NULL and st != NULL and os != NULL:
                    cnt = tree_match(&self.t, &hc, ow, od, os, st)
            pthread_rwlock_unlock(&self.lock)
        try:
            if nw and (ow == NULL or od == NULL or st == NULL or os == NULL):
                raise MemoryError()
            return sorted([(ow[k], od[k], os[ow[k]]) for k in range(cnt)])
        finally:
            free(ow)
            free(od)
            free(st)
            free(os)

    # Introspection reads the C arrays (``rev`` is realloc-ed when a worker appears), so
    # it takes the read lock like match does: one snapshot of every size.
    def sizes(self, uint32_t worker=0):
        """``(num_nodes, num_pairs, nbytes, worker_blocks(worker))`` read under one lock."""
        cdef size_t nodes, pairs, nb, wb
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            nodes = self.t.live_nodes
            pairs = self.t.npairs
            nb = tree_nbytes(&self.t)
            wb = tree_worker_blocks(&self.t, worker)
            pthread_rwlock_unlock(&self.lock)
        return nodes, pairs, nb, wb

    def layout(self):
        """Where the bytes go, read under the read lock (see :func:`layout_dict`)."""
        cdef size_t out[TL_N]
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            tree_layout(&self.t, out)
            pthread_rwlock_unlock(&self.lock)
        return layout_dict(out)

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
            rc = tree_check(&self.t, msg, sizeof(msg))
            pthread_rwlock_unlock(&self.lock)
        check_raise(rc, msg)

    def _corrupt_for_test(self, str kind):
        """TEST ONLY: break one invariant on purpose so a test can see ``check_invariants``
        fail (the object stays safe to free, not to use). Kinds: ``live_nodes``,
        ``nchildren``, ``sig``, ``member_freed``, ``rev_entry``; the last three need a
        node two workers hold."""
        cdef uint32_t n = self.t.node_pool.used - 1
        cdef uint32_t m
        if kind == "live_nodes":
            self.t.live_nodes += 1
            return
        if kind == "nchildren":
            self.t.nodes[T_ROOT].nchildren += 1
            return
        while n > T_ROOT and (self.t.nodes[n].nchildren == HM_NIL
                              or self.t.nodes[n].nmembers < 2):
            n -= 1
        if n == T_ROOT:
            raise ValueError("needs a node with two members")
        m = self.t.nodes[n].y
        if kind == "sig":
            self.t.nodes[n].x ^= 1
        elif kind == "member_freed":
            pool_give(&self.t.mem_pool, self.t.mem, m, sizeof(TMember))
        elif kind == "rev_entry":
            _rev_pop(&self.t, &self.t.rev[self.t.mem[m].worker], self.t.mem[m].worker,
                     self.t.mem[m].ehash)
        else:
            raise ValueError(kind)

    @property
    def num_nodes(self):
        """Nodes in the tree, root excluded."""
        return self.sizes()[0]

    @property
    def num_pairs(self):
        """(worker, block) pairs held."""
        return self.sizes()[1]

    @property
    def nbytes(self):
        """Bytes allocated by the tree's C structures."""
        return self.sizes()[2]


cdef int check_raise(int rc, const char* msg) except -1:
    """The result of a ``*_check`` as an exception (AssertionError with its message)."""
    if rc == -2:
        raise MemoryError()
    if rc < 0:
        raise AssertionError(msg.decode("utf-8", "replace"))
    return 0


cdef long check_rc(long rc) except -1:
    """Map a tree_store/_remove code to its exception (the one place that does)."""
    if rc >= 0:
        return rc
    if rc == T_ERR_PARENT:
        raise ParentBlockNotFound()
    if rc == T_ERR_SEQUENCE:
        raise InvalidBlockSequence()
    raise MemoryError()


def _install_arena(Arena arena):
    """Shared mode: structure memory this module allocates on the calling thread (the
    writer) comes from ``arena``; None ends it (see ``_index.install_shared``)."""
    pool_use_arena(arena)


def _live_allocations():
    """Structure blocks this module allocated and has not freed (tests: leak check)."""
    return live_allocations()


# -- dump and restore ------------------------------------------------------------------------
cdef int tree_export(const Tree* t, uint32_t* pos, uint32_t* stack, uint32_t* oparent,
                     uint64_t* olocal, uint32_t* mnode, uint32_t* mworker,
                     uint64_t* mehash) noexcept nogil:
    """Fill the node table (``t.live_nodes`` rows: parent row or HM_NIL for the root,
    local) with every parent before its children, and the member table (``t.npairs``
    rows: node row, worker, engine hash; each node's members in list order). ``pos``
    and ``stack`` are scratch of ``t.node_pool.used`` entries. 0, or -1 when the
    counters disagree with the structure."""
    cdef size_t i, nrow = 0, nmem = 0, top
    cdef uint32_t n, m, w
    cdef uint64_t e
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
            w = _member_first(t, n, &m, &e)
            while w != HM_NIL:
                if nmem >= t.npairs:
                    return -1
                mnode[nmem] = <uint32_t>nrow
                mworker[nmem] = w
                mehash[nmem] = e
                nmem += 1
                w = _member_next(t, &m, &e)
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
