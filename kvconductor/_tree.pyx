# cython: language_level=3
"""HBM radix tree: flat arrays of C structs linked by integer index.

Nodes live in one growable ``TNode`` array (node 0 is the root); the edge table
``(parent node, LocalBlockHash) -> child`` is one open-addressing ``EdgeMap``;
each node's members ``(worker, engine hash)`` are a singly linked list in a
pooled ``TMember`` array; each worker has a reverse map ``engine hash -> node``.
Semantics: ``docs/design.md`` ("RadixTree").

Every kernel here is ``noexcept nogil`` and reports errors by return code
(``T_ERR_*``); the Python-facing methods map them to exceptions.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from kvconductor._cursor cimport HCursor, hc_get, hc_init_hashes
from kvconductor._maps cimport (
    em_get, em_hash, em_pop, em_put, prefetch, revs_count, revs_ensure, revs_free, revs_nbytes,
    sm_check, sm_free, sm_init, sm_nbytes, u64m_check, u64m_free, u64m_get, u64m_init, u64m_pop,
    u64m_put,
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


# -- allocation ---------------------------------------------------------------------------
cdef int tree_init(Tree* t) noexcept nogil:
    t.nodes = NULL
    pool_init(&t.node_pool)
    t.live_nodes = 0
    t.mem = NULL
    pool_init(&t.mem_pool)
    t.npairs = 0
    sm_init(&t.edges)
    t.rev = NULL
    t.nrev = 0
    if pool_take(&t.node_pool, <void**>&t.nodes, sizeof(TNode)) != T_ROOT:
        return -1
    t.nodes[0].local = 0
    t.nodes[0].parent = HM_NIL
    t.nodes[0].members = HM_NIL
    t.nodes[0].nmembers = 0
    t.nodes[0].nchildren = 0
    t.nodes[0].sig = 0
    return 0


cdef void tree_free(Tree* t) noexcept nogil:
    revs_free(&t.rev, &t.nrev)
    mem_free(t.nodes)
    t.nodes = NULL
    pool_init(&t.node_pool)
    mem_free(t.mem)
    t.mem = NULL
    pool_init(&t.mem_pool)
    sm_free(&t.edges)


cdef size_t tree_nbytes(const Tree* t) noexcept nogil:
    cdef size_t n = t.node_pool.cap * sizeof(TNode) + t.mem_pool.cap * sizeof(TMember)
    return n + sm_nbytes(&t.edges) + revs_nbytes(t.rev, t.nrev)


cdef uint32_t _alloc_node(Tree* t, uint64_t local, uint32_t parent) noexcept nogil:
    cdef uint32_t i = pool_take(&t.node_pool, <void**>&t.nodes, sizeof(TNode))
    if i == HM_NIL:
        return HM_NIL
    t.nodes[i].local = local
    t.nodes[i].parent = parent
    t.nodes[i].members = HM_NIL
    t.nodes[i].nmembers = 0
    t.nodes[i].sig = 0
    t.nodes[i].nchildren = 0
    t.live_nodes += 1
    return i


cdef inline void _free_node(Tree* t, uint32_t i) noexcept nogil:
    t.nodes[i].nchildren = HM_NIL
    t.nodes[i].parent = HM_NIL
    pool_give(&t.node_pool, t.nodes, i, sizeof(TNode))
    t.live_nodes -= 1


cdef uint32_t _new_child(Tree* t, uint32_t parent, uint64_t local) noexcept nogil:
    """A new node under ``parent`` for ``local`` (not there yet); HM_NIL on OOM."""
    cdef uint32_t child = _alloc_node(t, local, parent)
    if child == HM_NIL:
        return HM_NIL
    if em_put(&t.edges, parent, local, child) < 0:
        _free_node(t, child)
        return HM_NIL
    t.nodes[parent].nchildren += 1
    return child


cdef inline uint32_t _alloc_member(Tree* t) noexcept nogil:
    return pool_take(&t.mem_pool, <void**>&t.mem, sizeof(TMember))


cdef inline void _link_member(Tree* t, uint32_t node, uint32_t m, uint32_t worker,
                              uint64_t ehash) noexcept nogil:
    """Make member record ``m`` ``worker``'s hold of ``node`` under engine hash ``ehash``."""
    t.mem[m].ehash = ehash
    t.mem[m].worker = worker
    t.mem[m].next = t.nodes[node].members
    t.nodes[node].members = m
    t.nodes[node].nmembers += 1
    t.nodes[node].sig += member_sig(worker)
    t.npairs += 1


# -- members ----------------------------------------------------------------------------------
cdef inline uint32_t _find_member(const Tree* t, uint32_t node, uint32_t worker) noexcept nogil:
    cdef uint32_t m = t.nodes[node].members
    while m != HM_NIL:
        if t.mem[m].worker == worker:
            return m
        m = t.mem[m].next
    return HM_NIL


cdef bint _unlink_member(Tree* t, uint32_t node, uint32_t worker) noexcept nogil:
    cdef uint32_t m = t.nodes[node].members, prev = HM_NIL
    while m != HM_NIL:
        if t.mem[m].worker == worker:
            if prev == HM_NIL:
                t.nodes[node].members = t.mem[m].next
            else:
                t.mem[prev].next = t.mem[m].next
            pool_give(&t.mem_pool, t.mem, m, sizeof(TMember))
            t.nodes[node].nmembers -= 1
            t.nodes[node].sig -= member_sig(worker)
            t.npairs -= 1
            return True
        prev = m
        m = t.mem[m].next
    return False


cdef void _prune(Tree* t, uint32_t n) noexcept nogil:
    """Delete ``n`` and its ancestors while they hold nothing and lead nowhere."""
    cdef uint32_t p
    while n != T_ROOT and t.nodes[n].nmembers == 0 and t.nodes[n].nchildren == 0:
        p = t.nodes[n].parent
        em_pop(&t.edges, p, t.nodes[n].local)
        t.nodes[p].nchildren -= 1
        _free_node(t, n)
        n = p


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
    cdef uint32_t node = T_ROOT, child, old, m
    cdef size_t i
    cdef int rc
    if n == 0:
        return 0
    if has_parent:
        node = u64m_get(&t.rev[worker], parent) if worker < t.nrev else HM_NIL
        if node == HM_NIL:
            return T_ERR_PARENT
    rc = _has_repeat(has_parent, parent, ehashes, n)
    if rc != 0:
        return T_ERR_OOM if rc < 0 else T_ERR_SEQUENCE
    if revs_ensure(&t.rev, &t.nrev, worker) < 0:
        return T_ERR_OOM
    cdef U64Map* rev = &t.rev[worker]
    for i in range(n):
        child = em_get(&t.edges, node, locals[i])
        old = u64m_get(rev, ehashes[i])
        if old != HM_NIL and old != child:
            # The worker announced this engine hash elsewhere before: it moved.
            _unlink_member(t, old, worker)
            u64m_pop(rev, ehashes[i])
            _prune(t, old)
            # NOTE: pruning may have freed ``child`` (an emptied ancestor of ``old``).
            child = em_get(&t.edges, node, locals[i])
        if child == HM_NIL:
            child = _new_child(t, node, locals[i])
            if child == HM_NIL:
                return T_ERR_OOM
        m = _find_member(t, child, worker)
        if m != HM_NIL:
            if t.mem[m].ehash != ehashes[i]:
                u64m_pop(rev, t.mem[m].ehash)
                t.mem[m].ehash = ehashes[i]
        if u64m_put(rev, ehashes[i], child) < 0:
            return T_ERR_OOM
        if m == HM_NIL:
            m = _alloc_member(t)
            if m == HM_NIL:
                u64m_pop(rev, ehashes[i])
                _prune(t, child)
                return T_ERR_OOM
            _link_member(t, child, m, worker, ehashes[i])
        node = child
    return <long>n


cdef long tree_remove(Tree* t, uint32_t worker, const uint64_t* ehashes, size_t n) noexcept nogil:
    cdef size_t i
    cdef long count = 0
    cdef uint32_t node
    if worker >= t.nrev:
        return 0
    for i in range(n):
        node = u64m_pop(&t.rev[worker], ehashes[i])
        if node == HM_NIL:
            continue
        _unlink_member(t, node, worker)
        _prune(t, node)
        count += 1
    return count


cdef long tree_clear(Tree* t, uint32_t worker) noexcept nogil:
    cdef size_t i
    cdef long count = 0
    cdef U64Map* rev
    cdef uint32_t node
    if worker >= t.nrev:
        return 0
    rev = &t.rev[worker]
    if rev.keys != NULL:
        for i in range(rev.mask + 1):
            node = rev.vals[i]
            if node != HM_NIL:
                _unlink_member(t, node, worker)
                _prune(t, node)
                count += 1
    u64m_free(rev)
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
    cdef uint32_t m = t.nodes[node].members, w
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
    same ``sig`` fingerprint) costs O(1); otherwise the node's member list is
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
    child = em_get(&t.edges, T_ROOT, hc_get(hc, 0))
    if child == HM_NIL:
        return 0
    memset(stamp, 0xFF, t.nrev * sizeof(uint32_t))
    m = t.nodes[child].members
    while m != HM_NIL:
        w = t.mem[m].worker
        stamp[w] = ST_ALIVE
        out_worker[cnt] = w
        cnt += 1
        m = t.mem[m].next
    alive = cnt
    asig = t.nodes[child].sig
    node = child
    step = 1
    while step < n:
        child = em_get(&t.edges, node, hc_get(hc, step))
        if child == HM_NIL:
            break
        if step + PREFETCH_AHEAD < n and t.edges.slots != NULL:
            # PERF: a chain stored in one go has consecutive node indices, so the
            # edge slot PREFETCH_AHEAD steps on is probably at (child + k, H[step + k]).
            prefetch(&t.edges.slots[em_hash(child + PREFETCH_AHEAD - 1,
                                            hc_get(hc, step + PREFETCH_AHEAD)) & t.edges.mask])
            prefetch(&t.nodes[child + PREFETCH_AHEAD] if child + PREFETCH_AHEAD < t.node_pool.used
                     else &t.nodes[child])
        if t.nodes[child].nmembers == alive and t.nodes[child].sig == asig:
            node = child
            step += 1
            continue
        # Slow step: mark the alive workers that are on ``child`` ...
        m = t.nodes[child].members
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


# -- invariants ------------------------------------------------------------------------------------
ctypedef unsigned long long ull


cdef int _tree_check(const Tree* t, char* msg, size_t cap, uint8_t* nfree, uint8_t* mfree,
                     uint32_t* kids) noexcept nogil:
    """tree_check with scratch: free marks of nodes and members, child counts."""
    cdef size_t i, live = 0, npairs = 0, nrevs = 0, w
    cdef uint32_t p, m, k
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
    if t.nodes[T_ROOT].members != HM_NIL or t.nodes[T_ROOT].nmembers != 0:
        snprintf(msg, cap, "root node has members")
        return -1
    if sm_check(&t.edges) < 0:
        snprintf(msg, cap, "edge map corrupt (size or probe chains)")
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
        # members: distinct live records, count, fingerprint, reverse map entries
        sig = 0
        k = 0
        m = t.nodes[i].members
        while m != HM_NIL:
            if m >= t.mem_pool.used or mfree[m] != 0:
                snprintf(msg, cap, "node %llu lists member record %llu that is free, "
                         "out of range or on another list", <ull>i, <ull>m)
                return -1
            mfree[m] = 2                # visited
            w = t.mem[m].worker
            sig += member_sig(t.mem[m].worker)
            if w >= t.nrev or u64m_get(&t.rev[w], t.mem[m].ehash) != i:
                snprintf(msg, cap, "member (worker %llu, ehash %llu) of node %llu is not in "
                         "the worker's reverse map", <ull>w, <ull>t.mem[m].ehash, <ull>i)
                return -1
            k += 1
            m = t.mem[m].next
        if k != t.nodes[i].nmembers or sig != t.nodes[i].sig:
            snprintf(msg, cap, "node %llu: nmembers %llu / sig disagree with its %llu members",
                     <ull>i, <ull>t.nodes[i].nmembers, <ull>k)
            return -1
        npairs += k
        if i == T_ROOT:
            continue
        live += 1
        p = t.nodes[i].parent
        if p >= t.node_pool.used or nfree[p]:
            snprintf(msg, cap, "node %llu has a free or out-of-range parent %llu",
                     <ull>i, <ull>p)
            return -1
        if em_get(&t.edges, p, t.nodes[i].local) != i:
            snprintf(msg, cap, "node %llu is not the child of edge (parent %llu, its local)",
                     <ull>i, <ull>p)
            return -1
        kids[p] += 1
        if t.nodes[i].nmembers == 0 and t.nodes[i].nchildren == 0:
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
    if npairs != t.npairs or npairs + <size_t>mf != t.mem_pool.used:
        snprintf(msg, cap, "npairs %llu, recount %llu, free records %llu, high-water %llu",
                 <ull>t.npairs, <ull>npairs, <ull>mf, <ull>t.mem_pool.used)
        return -1
    # every live non-root node has its edge (checked above); no other edge exists
    if t.edges.size != live:
        snprintf(msg, cap, "edge map holds %llu edges for %llu nodes",
                 <ull>t.edges.size, <ull>live)
        return -1
    # reverse maps: sound, and exactly the members (each member found above; sizes agree)
    for w in range(t.nrev):
        if u64m_check(&t.rev[w]) < 0:
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
        node under the root."""
        cdef uint32_t n = self.t.node_pool.used - 1
        cdef uint32_t m
        if kind == "live_nodes":
            self.t.live_nodes += 1
            return
        if kind == "nchildren":
            self.t.nodes[T_ROOT].nchildren += 1
            return
        while n > T_ROOT and (self.t.nodes[n].nchildren == HM_NIL
                              or self.t.nodes[n].members == HM_NIL):
            n -= 1
        if n == T_ROOT:
            raise ValueError("needs a node with members")
        m = self.t.nodes[n].members
        if kind == "sig":
            self.t.nodes[n].sig ^= 1
        elif kind == "member_freed":
            pool_give(&self.t.mem_pool, self.t.mem, m, sizeof(TMember))
        elif kind == "rev_entry":
            u64m_pop(&self.t.rev[self.t.mem[m].worker], self.t.mem[m].ehash)
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
    cdef uint32_t n, m
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
            m = t.nodes[n].members
            while m != HM_NIL:
                if nmem >= t.npairs:
                    return -1
                mnode[nmem] = <uint32_t>nrow
                mworker[nmem] = t.mem[m].worker
                mehash[nmem] = t.mem[m].ehash
                nmem += 1
                m = t.mem[m].next
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
    cdef uint32_t p, node, m, w
    for i in range(nn):
        if parents[i] == HM_NIL:
            p = T_ROOT
        elif parents[i] < i:
            p = rows[parents[i]]
        else:
            return T_ERR_SEQUENCE
        node = em_get(&t.edges, p, locals[i])
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
        if u64m_get(&t.rev[w], mehash[i]) != HM_NIL or _find_member(t, node, w) != HM_NIL:
            return T_ERR_SEQUENCE
        m = _alloc_member(t)
        if m == HM_NIL:
            return T_ERR_OOM
        if u64m_put(&t.rev[w], mehash[i], node) < 0:
            pool_give(&t.mem_pool, t.mem, m, sizeof(TMember))
            return T_ERR_OOM
        _link_member(t, node, m, w, mehash[i])
    return <long>nm
