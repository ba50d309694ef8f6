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
from libc.string cimport memcpy, memmove, memset

from kvconductor._cursor cimport HCursor, hc_get, hc_init_hashes
from kvconductor._maps cimport (
    FpMap, U64Map, em_hash, fpm_check, fpm_delete_at, fpm_first, fpm_free, fpm_home, fpm_init,
    fpm_insert, fpm_nbytes, fpm_next, fpm_reserve_one, hm_mix, prefetch, revs_count, revs_ensure,
    revs_free, revs_nbytes, u64m_free, u64m_init, u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, live_allocations, mem_alloc, mem_free, mem_realloc, pool_give, pool_init,
    pool_mark_free, pool_take,
)
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_unlock, pthread_rwlock_wrlock,
    rwlock_init,
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
    # The walk keeps the candidates still on the path as a bitmap over worker ids; when
    # the first node is wide and has more than LIST_MAX members, steps work on whole
    # 64-bit words, else (and once at most LIST_MAX are left) on a list of the candidates.
    LIST_MAX = 32


cdef inline void _prefetch_ahead(const Tree* t, HCursor* hc, uint32_t child,
                                 size_t step) noexcept nogil:
    # PERF: a chain stored in one go has consecutive node indices, so the edge slot
    # PREFETCH_AHEAD steps on is probably at (child + k, H[step + k]). The caller checks
    # step + PREFETCH_AHEAD < n (the edge table has slots: ``child`` was found in it).
    prefetch(&t.edges.slots[fpm_home(&t.edges, <uint32_t>em_hash(
        child + PREFETCH_AHEAD - 1, hc_get(hc, step + PREFETCH_AHEAD)))])
    prefetch(&t.nodes[child + PREFETCH_AHEAD] if child + PREFETCH_AHEAD < t.node_pool.used
             else &t.nodes[child])


cdef inline uint32_t _keep_bits(const Tree* t, uint32_t child, const uint64_t* A, uint64_t* K,
                                size_t NW) noexcept nogil:
    """``K`` (all zero on entry) = the candidates of ``A`` that hold ``child``; how many."""
    cdef const TNode* c = &t.nodes[child]
    cdef const TWide* wd
    cdef size_t i
    cdef uint32_t m, w, k = 0
    cdef uint64_t x
    if c.nmembers == 1:
        w = c.y
        if _bit(A, w):
            _bit_set(K, w)
            return 1
        return 0
    if c.nmembers == 0:
        return 0
    if c.y & T_WIDE:
        wd = _wide_of(t, c)
        for i in range(wd.nwords if wd.nwords < NW else NW):
            x = A[i] & wd.bits[i]
            K[i] = x
            k += popc64(x)
        return k
    m = c.y
    while m != HM_NIL:
        w = t.mem[m].worker
        if _bit(A, w):
            _bit_set(K, w)
            k += 1
        m = t.mem[m].next
    return k


cdef size_t _settle(const Tree* t, uint32_t node, const uint64_t* A, const uint64_t* K,
                    size_t NW, uint32_t depth, uint32_t* out_worker, uint32_t* out_depth,
                    uint64_t* out_ehash, size_t nout, uint64_t* sig) noexcept nogil:
    """The candidates of ``A`` not in ``K`` (all members of ``node``) end on ``node``:
    ``out_ehash[w]`` = w's engine hash there; when ``out_worker`` is not NULL each is also
    appended as (w, ``depth``) at ``nout``; ``sig`` (when not NULL) adds their
    fingerprints. Returns the new ``nout``. O(members) for a member list, O(NW + leavers)
    for a wide node."""
    cdef const TNode* n = &t.nodes[node]
    cdef const TWide* wd
    cdef const uint64_t* ehs
    cdef size_t i, nw
    cdef uint32_t m, w, b, rank = 0
    cdef uint64_t x, word, e
    if n.nmembers >= 2 and (n.y & T_WIDE):
        wd = _wide_of(t, n)
        ehs = wd.bits + wd.nwords
        nw = wd.nwords if wd.nwords < NW else NW
        for i in range(nw):
            word = wd.bits[i]
            x = A[i] & ~K[i]
            if x == word:
                # every member of the word ends here (the common case): ranks in a row
                while x:
                    w = <uint32_t>(i * 64 + ctz64(x))
                    out_ehash[w] = ehs[rank]
                    rank += 1
                    if out_worker != NULL:
                        out_worker[nout] = w
                        out_depth[nout] = depth
                        nout += 1
                    if sig != NULL:
                        sig[0] += member_sig(w)
                    x &= x - 1
                continue
            while x:
                b = ctz64(x)
                w = <uint32_t>(i * 64 + b)
                e = ehs[rank + popc64(word & (((<uint64_t>1) << b) - 1))]
                out_ehash[w] = e
                if out_worker != NULL:
                    out_worker[nout] = w
                    out_depth[nout] = depth
                    nout += 1
                if sig != NULL:
                    sig[0] += member_sig(w)
                x &= x - 1
            rank += popc64(word)
        return nout
    if n.nmembers == 1:
        w = n.y
        m = HM_NIL
        e = n.x
    elif n.nmembers:
        m = n.y
        w = t.mem[m].worker
        e = t.mem[m].ehash
    else:
        return nout
    while True:
        if _bit(A, w) and not _bit(K, w):
            out_ehash[w] = e
            if out_worker != NULL:
                out_worker[nout] = w
                out_depth[nout] = depth
                nout += 1
            if sig != NULL:
                sig[0] += member_sig(w)
        if m == HM_NIL:
            break
        m = t.mem[m].next
        if m == HM_NIL:
            break
        w = t.mem[m].worker
        e = t.mem[m].ehash
    return nout


cdef inline uint64_t _bits_sig(const uint64_t* b, size_t NW) noexcept nogil:
    cdef size_t i
    cdef uint64_t x, s = 0
    for i in range(NW):
        x = b[i]
        while x:
            s += member_sig(<uint32_t>(i * 64 + ctz64(x)))
            x &= x - 1
    return s


cdef int _match_words(const Tree* t, HCursor* hc, TreeMatch* ms, uint32_t* out_worker,
                      uint32_t* out_depth, uint64_t* out_ehash, size_t limit) noexcept nogil:
    """The walk on whole bitmap words while more than LIST_MAX candidates are left; the
    ones that end are appended to the results. Returns 0 with ``ms.alive`` 0 (all ended)
    or at most LIST_MAX; 1 (paused, nothing settled) when it reached block ``limit``
    (< the query's blocks) with more left."""
    cdef bint paused = False
    cdef size_t n = hc.n, NW = ms.NW, alive = ms.alive, base = ms.base
    cdef size_t pf_end = n - PREFETCH_AHEAD if n > PREFETCH_AHEAD else 0
    cdef uint32_t node = ms.node, step = ms.step, child, kc
    cdef uint64_t asig = ms.asig, lsig
    cdef uint64_t* A = ms.A
    cdef uint64_t* K = ms.K
    cdef uint64_t* T
    cdef const TNode* c
    while step < n:
        if step >= limit:
            paused = True
            break
        child = _child(t, node, hc_get(hc, step))
        if child == HM_NIL:
            break
        if step < pf_end:
            _prefetch_ahead(t, hc, child, step)
        c = &t.nodes[child]
        if c.nmembers == alive and tree_sig(c) == asig:
            node = child
            step += 1
            continue
        kc = _keep_bits(t, child, A, K, NW)
        # the new fingerprint: from the stayers or the leavers, whichever are fewer
        if kc * 2 <= alive:
            base = _settle(t, node, A, K, NW, step, out_worker, out_depth, out_ehash, base,
                           NULL)
            asig = _bits_sig(K, NW)
        else:
            lsig = 0
            base = _settle(t, node, A, K, NW, step, out_worker, out_depth, out_ehash, base,
                           &lsig)
            asig -= lsig
        T = A
        A = K
        K = T
        memset(K, 0, NW * sizeof(uint64_t))
        alive = kc
        if alive == 0:
            break
        node = child
        step += 1
        if alive <= LIST_MAX:
            break
    if alive > LIST_MAX and not paused:
        # the survivors end on ``node`` at depth ``step``
        base = _settle(t, node, A, K, NW, step, out_worker, out_depth, out_ehash, base, NULL)
        alive = 0
    ms.node = node
    ms.step = step
    ms.alive = alive
    ms.asig = asig
    ms.A = A
    ms.K = K
    ms.base = base
    return 1 if paused else 0


cdef int _match_list(const Tree* t, HCursor* hc, TreeMatch* ms, uint32_t* L, uint32_t* D,
                     uint64_t* out_ehash, size_t limit) noexcept nogil:
    """The walk on the list of candidates ``L[0:alive]`` (also set in ``A``): one that
    ends is swapped behind them and gets its depth in ``D`` (its ehash by settling the
    node it ends on). Returns 0 when every candidate ended; 1 (paused: the walk's state
    in ``ms``, nothing settled) when it reached block ``limit`` (< the query's blocks)
    with candidates left."""
    cdef size_t n = hc.n, NW = ms.NW, alive = ms.alive, k, j
    cdef size_t pf_end = n - PREFETCH_AHEAD if n > PREFETCH_AHEAD else 0
    cdef uint32_t node = ms.node, step = ms.step, child, w, tmp, kc
    cdef uint64_t asig = ms.asig
    cdef uint64_t* A = ms.A
    cdef uint64_t* K = ms.K
    cdef const TNode* c
    cdef const TWide* wd
    while step < n:
        if step >= limit:
            ms.node = node
            ms.step = step
            ms.alive = alive
            ms.asig = asig
            return 1
        child = _child(t, node, hc_get(hc, step))
        if child == HM_NIL:
            break
        if step < pf_end:
            _prefetch_ahead(t, hc, child, step)
        c = &t.nodes[child]
        if c.nmembers == alive and tree_sig(c) == asig:
            node = child
            step += 1
            continue
        # Slow step: mark the candidates that are on ``child`` ...
        if c.nmembers >= 2 and (c.y & T_WIDE):
            wd = _wide_of(t, c)
            kc = 0
            for k in range(alive):
                w = L[k]
                if _wide_has(wd, w):
                    _bit_set(K, w)
                    kc += 1
        else:
            kc = _keep_bits(t, child, A, K, NW)
        if kc == alive:
            # all of them are (with other members)
            for k in range(alive):
                _bit_clear(K, L[k])
            node = child
            step += 1
            continue
        # ... the others stop at depth ``step`` with their ehash on ``node``.
        _settle(t, node, A, K, NW, step, NULL, NULL, out_ehash, 0, NULL)
        j = 0
        asig = 0
        for k in range(alive):
            w = L[k]
            if _bit(K, w):
                _bit_clear(K, w)
                asig += member_sig(w)
                tmp = L[j]
                L[j] = w
                L[k] = tmp
                j += 1
            else:
                _bit_clear(A, w)
        for k in range(j, alive):
            D[k] = step
        alive = j
        if alive == 0:
            ms.alive = 0
            return 0
        node = child
        step += 1
    # The survivors end on ``node`` at depth ``step``.
    _settle(t, node, A, K, NW, step, NULL, NULL, out_ehash, 0, NULL)
    for k in range(alive):
        D[k] = step
    ms.alive = 0
    return 0


cdef int _match_to_list(const Tree* t, HCursor* hc, TreeMatch* ms, uint32_t* out_worker,
                        uint32_t* out_depth, uint64_t* out_ehash, size_t limit) noexcept nogil:
    """A wide first node: the words phase while more than LIST_MAX candidates are left,
    then the list of those left."""
    cdef size_t i, j
    cdef uint64_t x
    if ms.alive > LIST_MAX and _match_words(t, hc, ms, out_worker, out_depth, out_ehash,
                                            limit):
        return 1
    if ms.alive == 0:
        ms.phase = TM_DONE
        return 0
    # list the candidates left (in worker order) behind the results
    j = ms.base
    for i in range(ms.NW):
        x = ms.A[i]
        while x:
            out_worker[j] = <uint32_t>(i * 64 + ctz64(x))
            j += 1
            x &= x - 1
    ms.phase = TM_LIST
    return _match_list(t, hc, ms, out_worker + ms.base, out_depth + ms.base, out_ehash, limit)


cdef int _match_paused(const Tree* t, TreeMatch* ms, int rc) noexcept nogil:
    if rc:
        ms.nfreed = t.nfreed
    else:
        ms.phase = TM_DONE
    return rc


cdef int tree_match_start(const Tree* t, HCursor* hc, uint32_t* out_worker,
                          uint32_t* out_depth, uint64_t* out_ehash, uint64_t* scratch,
                          TreeMatch* ms, size_t limit) noexcept nogil:
    """Consecutive depth from the root of every worker on the first node.

    The candidates still on the path are a bitmap ``A`` over worker ids. A step whose
    node has exactly the candidate set (same size, same ``tree_sig`` fingerprint) costs
    O(1). Otherwise ``K`` = the candidates on the new node, and the others end: depth
    ``step``, their breakpoint ehash from the previous node. While a wide first node
    leaves many candidates that is done on whole words (O(words + leavers) a step);
    with few, on a list of them (O(candidates + the nodes' members)). Every candidate
    ends once, as result ``k``: ``out_worker[k]``, ``out_depth[k]``; ``ms.cnt``
    results.

    The walk stops at block ``limit`` when it is shorter than the query: 1 is returned
    (paused, the walk's state in ``ms``) and :func:`tree_match_resume` goes on, after
    :func:`tree_match_valid` if the tree may have changed meanwhile. 0: done.
    NOTE: the fingerprint is a 64-bit sum of mixed worker ids: the same order of
    collision risk as the 64-bit block hashes the whole index is keyed by.
    """
    cdef size_t cnt, j
    cdef uint32_t child, m, w
    cdef const TNode* c
    cdef const TWide* wd
    ms.cnt = 0
    ms.phase = TM_DONE
    ms.alive = 0
    if hc.n == 0 or t.wend == 0:
        return 0
    child = _child(t, T_ROOT, hc_get(hc, 0))
    if child == HM_NIL or t.nodes[child].nmembers == 0:
        return 0
    ms.wend = t.wend
    ms.NW = (<size_t>t.wend + 63) >> 6
    ms.A = scratch
    ms.K = scratch + ms.NW
    memset(scratch, 0, 2 * ms.NW * sizeof(uint64_t))
    c = &t.nodes[child]
    cnt = c.nmembers
    ms.cnt = cnt
    ms.alive = cnt
    ms.asig = tree_sig(c)
    ms.node = child
    ms.step = 1
    ms.base = 0
    if c.nmembers == 1:
        _bit_set(ms.A, c.y)
        out_worker[0] = c.y
    elif c.y & T_WIDE:
        wd = _wide_of(t, c)
        memcpy(ms.A, wd.bits, (wd.nwords if wd.nwords < ms.NW else ms.NW) * sizeof(uint64_t))
        ms.phase = TM_WORDS
        return _match_paused(t, ms, _match_to_list(t, hc, ms, out_worker, out_depth,
                                                   out_ehash, limit))
    else:
        m = c.y
        j = 0
        while m != HM_NIL:
            w = t.mem[m].worker
            _bit_set(ms.A, w)
            out_worker[j] = w
            j += 1
            m = t.mem[m].next
    ms.phase = TM_LIST
    return _match_paused(t, ms, _match_list(t, hc, ms, out_worker, out_depth, out_ehash,
                                            limit))


cdef int tree_match_resume(const Tree* t, HCursor* hc, uint32_t* out_worker,
                           uint32_t* out_depth, uint64_t* out_ehash, TreeMatch* ms,
                           size_t limit) noexcept nogil:
    """Go on with a paused :func:`tree_match_start` up to block ``limit``: 1 paused
    again, 0 done (``ms.cnt`` results)."""
    if ms.phase == TM_WORDS:
        return _match_paused(t, ms, _match_to_list(t, hc, ms, out_worker, out_depth,
                                                   out_ehash, limit))
    if ms.phase == TM_LIST:
        return _match_paused(t, ms, _match_list(t, hc, ms, out_worker + ms.base,
                                                out_depth + ms.base, out_ehash, limit))
    return 0


cdef bint tree_match_valid(const Tree* t, HCursor* hc, const TreeMatch* ms) noexcept nogil:
    """Whether a paused match may go on in ``t`` as it is now (after writes): the same
    worker-id range (the walk's bitmaps and result arrays are sized by it) and the node
    it stands on still the node of the query's first ``ms.step`` blocks. No node freed
    since the pause: a node's parent and block never change while it lives. Else the
    path is checked from that node up to the root (a freed node, or one reused for
    another block, fails; one reused for the same block under the same path is that
    prefix's node: (parent, block) keys one node)."""
    cdef uint32_t x = ms.node
    cdef size_t k = ms.step
    if ms.phase == TM_DONE:
        return True
    if t.wend != ms.wend:
        return False
    if t.nfreed == ms.nfreed:
        return True
    while k > 0:
        if (x >= t.node_pool.used or t.nodes[x].nchildren == HM_NIL
                or t.nodes[x].local != hc_get(hc, k - 1)):
            return False
        x = t.nodes[x].parent
        k -= 1
    return x == T_ROOT


cdef size_t tree_match(const Tree* t, HCursor* hc, uint32_t* out_worker, uint32_t* out_depth,
                       uint64_t* out_ehash, uint64_t* scratch) noexcept nogil:
    """:func:`tree_match_start` in one go; the number of results."""
    cdef TreeMatch ms
    tree_match_start(t, hc, out_worker, out_depth, out_ehash, scratch, &ms, hc.n)
    return ms.cnt


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
        cdef uint64_t* st = NULL
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
                st = <uint64_t*>malloc(tree_match_scratch(nw))
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

    def _match_count(self, local_hashes, ends):
        """BENCHMARK AID: run the match of each query ``local_hashes[ends[i-1]:ends[i]]``
        (``ends`` ascending) in C, one read section, and return the total number of
        results; no Python object per result, so a benchmark times the walk alone."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef const uint64_t[::1] ev = as_u64(ends)
        cdef size_t nq = ev.shape[0], q, start = 0, total = 0, nw
        cdef HCursor hc
        cdef uint32_t* ow = NULL
        cdef uint32_t* od = NULL
        cdef uint64_t* st = NULL
        cdef uint64_t* os = NULL
        if nq and ev[nq - 1] > <uint64_t>lv.shape[0]:
            raise ValueError("ends past the hashes")
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            nw = self.t.nrev
            if nw:
                ow = <uint32_t*>malloc(nw * sizeof(uint32_t))
                od = <uint32_t*>malloc(nw * sizeof(uint32_t))
                st = <uint64_t*>malloc(tree_match_scratch(nw))
                os = <uint64_t*>malloc(nw * sizeof(uint64_t))
                if ow != NULL and od != NULL and st != NULL and os != NULL:
                    for q in range(nq):
                        if ev[q] > start:
                            hc_init_hashes(&hc, &lv[start], ev[q] - start)
                            total += tree_match(&self.t, &hc, ow, od, os, st)
                            start = ev[q]
            pthread_rwlock_unlock(&self.lock)
        free(ow)
        free(od)
        free(st)
        free(os)
        if nw and (ow == NULL or od == NULL or st == NULL or os == NULL):
            raise MemoryError()
        return total

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


def _live_allocations():
    """Structure blocks this module allocated and has not freed (tests: leak check)."""
    return live_allocations()


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
