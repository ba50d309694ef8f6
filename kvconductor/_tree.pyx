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

One extension, one file per job (as ``_index.pyx`` includes its ``_index_*.pxi``): this
file keeps the allocation, the edges, the reverse maps, the mutations and the Python
class; ``_tree_members.pxi`` (a node's members: inline, list, wide), ``_tree_match.pxi``
(the walk), ``_tree_inspect.pxi`` (layout and the invariant checker) and ``_tree_io.pxi``
(dump and restore) hold the kernels they call, included where they stood so the
generated C is the same. Each kernel takes the ``Tree`` first.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset

from kvconductor._cursor cimport HCursor, hc_get, hc_init_hashes
from kvconductor._maps cimport (
    FpMap, U64Map, em_hash, fpm_check, fpm_delete_at, fpm_first, fpm_free, fpm_home, fpm_init,
    fpm_insert, fpm_nbytes, fpm_next, fpm_reserve, fpm_reserve_one, hm_mix, prefetch, revs_count,
    revs_ensure, revs_free, revs_nbytes, u64m_free, u64m_init, u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, live_allocations, mem_alloc, mem_free, mem_realloc, pool_give, pool_init,
    pool_mark_free, pool_take,
)
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_t, pthread_rwlock_unlock,
    pthread_rwlock_wrlock, rwlock_init,
)

from kvconductor._hash import as_u64
from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound

cdef enum:
    NO_SLOT = 0xFFFFFFFFFFFFFFFF     # "no slot" for the FpMap slot finders
    # Wide nodes (members as a bitmap over worker ids, docs/design.md "Wide nodes"): a
    # node whose bitmap would cover ``nw`` 64-bit words becomes wide when a member joins
    # and it has at least 2 * nw + WIDE_PAD members (nw counted over every worker id the
    # tree has seen), and turns back into a member list below nw + WIDE_PAD / 2 (nw of
    # its own bitmap). A member record costs 16 B, a wide member 8 B and the bitmap
    # 8 * nw B plus a 24 B TWide: from nw + 3 members on a wide node is the smaller.
    WIDE_PAD = 8


# -- bit helpers ---------------------------------------------------------------------------------
cdef extern from "kvconductor/c/bits.h":
    unsigned popc64 "kvc_popc64"(uint64_t x) noexcept nogil
    unsigned ctz64 "kvc_ctz64"(uint64_t x) noexcept nogil


cdef inline bint _bit(const uint64_t* b, uint32_t w) noexcept nogil:
    return (b[w >> 6] >> (w & 63)) & 1


cdef inline void _bit_set(uint64_t* b, uint32_t w) noexcept nogil:
    b[w >> 6] |= (<uint64_t>1) << (w & 63)


cdef inline void _bit_clear(uint64_t* b, uint32_t w) noexcept nogil:
    b[w >> 6] &= ~((<uint64_t>1) << (w & 63))


cdef inline uint32_t _rank(const uint64_t* b, uint32_t w) noexcept nogil:
    """Set bits of ``b`` below bit ``w``."""
    cdef uint32_t i, r = 0, top = w >> 6
    for i in range(top):
        r += popc64(b[i])
    return r + popc64(b[top] & (((<uint64_t>1) << (w & 63)) - 1))


# -- allocation ---------------------------------------------------------------------------
cdef int tree_init(Tree* t) noexcept nogil:
    t.nodes = NULL
    pool_init(&t.node_pool)
    t.live_nodes = 0
    t.mem = NULL
    pool_init(&t.mem_pool)
    t.nrecords = 0
    t.npairs = 0
    t.wide = NULL
    pool_init(&t.wide_pool)
    t.nwide = 0
    t.wide_bytes = 0
    t.nwidened = 0
    t.nnarrowed = 0
    fpm_init(&t.edges)
    t.rev = NULL
    t.nrev = 0
    t.wend = 0
    t.nfreed = 0
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
    cdef size_t i
    for i in range(t.wide_pool.used):
        # live ones: their node is live and points back (a free record's bits are NULL)
        mem_free(t.wide[i].bits)
    mem_free(t.wide)
    t.wide = NULL
    pool_init(&t.wide_pool)
    t.nwide = 0
    t.wide_bytes = 0
    revs_free(&t.rev, &t.nrev)
    t.wend = 0
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
            + t.wide_pool.cap * sizeof(TWide) + t.wide_bytes + _tables_nbytes(t))


cdef void tree_counts(const Tree* t, size_t* out) noexcept nogil:
    """``RadixTree.sizes``' first two: nodes and (worker, block) pairs."""
    out[0] = t.live_nodes
    out[1] = t.npairs


cdef size_t tree_used_bytes(const Tree* t) noexcept nogil:
    return (<size_t>t.node_pool.used * sizeof(TNode)
            + <size_t>t.mem_pool.used * sizeof(TMember)
            + <size_t>t.wide_pool.used * sizeof(TWide) + t.wide_bytes + _tables_nbytes(t))


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
    t.nfreed += 1
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


# -- explain (CoreIndex.trace): what the index asks of the tree ---------------------------
cdef size_t tree_path(const Tree* t, HCursor* hc, uint32_t* path) noexcept nogil:
    cdef size_t plen = 1
    cdef uint32_t c
    path[0] = T_ROOT
    while plen <= hc.n:
        c = _child(t, path[plen - 1], hc_get(hc, plen - 1))
        if c == HM_NIL:
            break
        path[plen] = c
        plen += 1
    return plen


cdef bint tree_held(const Tree* t, uint32_t node) noexcept nogil:
    return t.nodes[node].nmembers > 0


cdef bint tree_holds_local(const Tree* t, uint32_t worker, uint64_t local) noexcept nogil:
    cdef const FpMap* rev
    cdef size_t i
    if worker >= t.nrev:
        return False
    rev = &t.rev[worker]
    if rev.size == 0:
        return False
    for i in range(rev.cap):
        if rev.slots[i].idx != HM_NIL and t.nodes[rev.slots[i].idx].local == local:
            return True
    return False


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


include "_tree_members.pxi"


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
    if fpm_reserve(rev, n) < 0:
        return T_ERR_OOM
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


include "_tree_match.pxi"


include "_tree_inspect.pxi"


# -- Python API ---------------------------------------------------------------------------
ctypedef Tree Table
include "_chains.pxi"
cdef ChainKernels _KERNELS = ChainKernels(
    tree_init, tree_free, tree_store, tree_remove, tree_clear, tree_counts, tree_nbytes,
    tree_check)


# tree_match's outputs (worker, depth, each worker's last engine hash) and scratch, for
# ``nw`` workers.
cdef struct MatchBufs:
    uint32_t* worker
    uint32_t* depth
    uint64_t* ehash
    uint64_t* scratch


cdef int match_bufs_alloc(MatchBufs* b, size_t nw) noexcept nogil:
    """``b`` for ``nw`` workers: 1 ready, 0 no worker (nothing to match), -1 out of
    memory; free it in every case."""
    if nw == 0:
        return 0
    b.worker = <uint32_t*>malloc(nw * sizeof(uint32_t))
    b.depth = <uint32_t*>malloc(nw * sizeof(uint32_t))
    b.scratch = <uint64_t*>malloc(tree_match_scratch(nw))
    b.ehash = <uint64_t*>malloc(nw * sizeof(uint64_t))
    if b.worker == NULL or b.depth == NULL or b.scratch == NULL or b.ehash == NULL:
        return -1
    return 1


cdef void match_bufs_free(MatchBufs* b) noexcept nogil:
    free(b.worker)
    free(b.depth)
    free(b.scratch)
    free(b.ehash)


cdef class RadixTree(_Chains):
    """HBM radix tree over LocalBlockHashes, shared by every HBM worker of an index.

    **Threading: one writer thread calls store/remove/clear; any number of
    threads may call match/stats concurrently. Each method holds a C
    reader/writer lock (writers exclusive) and runs without the GIL.**
    ``sizes()`` is ``(num_nodes, num_pairs, nbytes, worker_blocks(worker))``.
    """

    def match(self, local_hashes):
        """``[(worker, depth, last_engine_hash)]`` sorted by worker."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = lv.shape[0], cnt = 0, k
        cdef HCursor hc
        cdef MatchBufs b = MatchBufs(NULL, NULL, NULL, NULL)
        cdef int ready
        if n == 0:
            return []
        hc_init_hashes(&hc, &lv[0], n)
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            ready = match_bufs_alloc(&b, self.t.nrev)
            if ready > 0:
                cnt = tree_match(&self.t, &hc, b.worker, b.depth, b.ehash, b.scratch)
            pthread_rwlock_unlock(&self.lock)
        try:
            if ready < 0:
                raise MemoryError()
            return sorted([(b.worker[k], b.depth[k], b.ehash[b.worker[k]]) for k in range(cnt)])
        finally:
            match_bufs_free(&b)

    def _match_count(self, local_hashes, ends):
        """BENCHMARK AID: run the match of each query ``local_hashes[ends[i-1]:ends[i]]``
        (``ends`` ascending) in C, one read section, and return the total number of
        results; no Python object per result, so a benchmark times the walk alone."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef const uint64_t[::1] ev = as_u64(ends)
        cdef size_t nq = ev.shape[0], q, start = 0, total = 0
        cdef HCursor hc
        cdef MatchBufs b = MatchBufs(NULL, NULL, NULL, NULL)
        cdef int ready
        if nq and ev[nq - 1] > <uint64_t>lv.shape[0]:
            raise ValueError("ends past the hashes")
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            ready = match_bufs_alloc(&b, self.t.nrev)
            if ready > 0:
                for q in range(nq):
                    if ev[q] > start:
                        hc_init_hashes(&hc, &lv[start], ev[q] - start)
                        total += tree_match(&self.t, &hc, b.worker, b.depth, b.ehash, b.scratch)
                        start = ev[q]
            pthread_rwlock_unlock(&self.lock)
        match_bufs_free(&b)
        if ready < 0:
            raise MemoryError()
        return total

    def layout(self):
        """Where the bytes go, read under the read lock (see :func:`layout_dict`)."""
        cdef size_t out[TL_N]
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            tree_layout(&self.t, out)
            pthread_rwlock_unlock(&self.lock)
        return layout_dict(out)

    def _corrupt_for_test(self, str kind):
        """TEST ONLY: break one invariant on purpose so a test can see ``check_invariants``
        fail (the object stays safe to free, not to use). Kinds: ``live_nodes``,
        ``nchildren``, ``sig``, ``member_freed``, ``rev_entry`` (the last three need a
        node two or more workers hold as a member list), ``wide_bit``, ``wide_ehash``,
        ``wide_freed``, ``wide_bytes`` (these need a wide node)."""
        cdef uint32_t n = self.t.node_pool.used - 1
        cdef uint32_t m
        cdef bint wide = kind.startswith("wide_")
        cdef TWide* wd = NULL
        cdef int b
        if kind == "live_nodes":
            self.t.live_nodes += 1
            return
        if kind == "nchildren":
            self.t.nodes[T_ROOT].nchildren += 1
            return
        while n > T_ROOT and (self.t.nodes[n].nchildren == HM_NIL
                              or self.t.nodes[n].nmembers < 2
                              or ((self.t.nodes[n].y & T_WIDE) != 0) != wide):
            n -= 1
        if n == T_ROOT:
            raise ValueError("needs a wide node" if wide else "needs a node with a member list")
        m = self.t.nodes[n].y
        if wide:
            wd = _wide_of(&self.t, &self.t.nodes[n])
        if kind == "sig":
            self.t.nodes[n].x ^= 1
        elif kind == "member_freed":
            pool_give(&self.t.mem_pool, self.t.mem, m, sizeof(TMember))
        elif kind == "rev_entry":
            _rev_pop(&self.t, &self.t.rev[self.t.mem[m].worker], self.t.mem[m].worker,
                     self.t.mem[m].ehash)
        elif kind == "wide_bit":
            m = wd.nwords
            while m > 0 and wd.bits[m - 1] == 0:
                m -= 1
            b = 63
            while m > 0 and not (wd.bits[m - 1] >> b) & 1:
                b -= 1
            if m > 0:
                # the last member's bit cleared (the others keep their ranks)
                wd.bits[m - 1] &= ~((<uint64_t>1) << b)
        elif kind == "wide_ehash":
            wd.bits[wd.nwords] ^= 1
        elif kind == "wide_freed":
            pool_give(&self.t.wide_pool, self.t.wide, m & ~(<uint32_t>T_WIDE), sizeof(TWide))
        elif kind == "wide_bytes":
            self.t.wide_bytes += 8
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


def _live_allocations():
    """Structure blocks this module allocated and has not freed (tests: leak check)."""
    return live_allocations()


include "_tree_io.pxi"
