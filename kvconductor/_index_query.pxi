# Included by _index.pyx: the query: scratch, answers (MatchRows), the lower-tier
# walks and the tiered query.
# Functions of a CoreIndex take it as their first argument (Cython allows no include
# inside a class body); the class keeps the Python methods, which call them.


cdef inline size_t _max(size_t a, size_t b) noexcept nogil:
    return a if a > b else b


cdef inline size_t _min(size_t a, size_t b) noexcept nogil:
    return a if a < b else b


# -- query scratch -------------------------------------------------------------------------
cdef void _scratch_zero(Scratch* s) noexcept nogil:
    """Nothing allocated (``_scratch_free`` frees nothing)."""
    memset(s, 0, sizeof(Scratch))


cdef int _scratch_init(Scratch* s, size_t W, size_t G) noexcept nogil:
    """A scratch of this call's own (``explain``): ``ends`` zeroed; ``_scratch_free``
    frees it."""
    s.W = W
    s.G = G
    s.owned = True
    s.lower = False
    s.dense = False
    s.nt = 0
    s.tb = NULL
    s.hw = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.hd = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.hs = <uint64_t*>malloc(W * sizeof(uint64_t) + 1)
    # worker marks of the tier walks, and tree_match's scratch (malloc: 8-byte aligned)
    s.stamp = <uint32_t*>malloc(_max(W * sizeof(uint32_t), tree_match_scratch(W)) + 1)
    s.tl = <uint32_t*>malloc((G + 1) * sizeof(uint32_t))
    _scratch_no_tiers(s)
    s.ends = <uint32_t*>malloc(3 * G * sizeof(uint32_t) + 1)
    if (s.hw == NULL or s.hd == NULL or s.hs == NULL or s.stamp == NULL or s.ends == NULL
            or s.tl == NULL):
        return -1
    memset(s.ends, 0, 3 * G * sizeof(uint32_t))
    return 0


cdef inline void _scratch_no_tiers(Scratch* s) noexcept nogil:
    # the lower tiers' arrays: on their first use (_scratch_tiers), as most queries of
    # a fleet without CPU/Disk offload never walk a lower tier (PERF: four W-sized
    # mallocs and an O(W) fill less per query, 7,000 engines: ~20 % of the query)
    s.idx = NULL
    s.cand = NULL
    s.oend = NULL
    s.olast = NULL
    s.bps = NULL
    s.nbp = 0
    s.bpcap = 0


cdef struct ThreadScratch:
    # the head of a reader thread's scratch block (kvc_scratch_get); the arrays follow
    # (``_scratch_carve``): hs (W u64), stamp, tb (G bits), hw, hd (W u32), tl (G + 1
    # u32), ends (3 G u32); tb and ends are all 0 between two queries
    size_t W
    size_t G


cdef size_t _scratch_carve(Scratch* s, char* p, size_t W, size_t G) noexcept nogil:
    """Set ``s``'s arrays in the block at ``p`` for a capacity of W workers and G groups
    (``p`` NULL: only the size). Each array starts on its own page at its own offset,
    640 B further each: arrays a loop walks in step (``hw``, ``hd``, ``tl``, ``ends``)
    never sit at the same offset mod 4 KiB, where a load can wait behind an unrelated
    store (4K aliasing). Returns the block's bytes."""
    cdef size_t off = 0, k
    cdef size_t sizes[7]
    cdef void* a[7]
    sizes[0] = W * sizeof(uint64_t)
    sizes[1] = _max(W * sizeof(uint32_t), tree_match_scratch(W))
    sizes[2] = (G + 63) // 64 * sizeof(uint64_t)
    sizes[3] = W * sizeof(uint32_t)
    sizes[4] = W * sizeof(uint32_t)
    sizes[5] = (G + 1) * sizeof(uint32_t)
    sizes[6] = 3 * G * sizeof(uint32_t)
    for k in range(7):
        off = ((off + 4095) & ~(<size_t>4095)) + 640 * k
        a[k] = p + off if p != NULL else NULL
        off += sizes[k]
    if p != NULL:
        s.hs = <uint64_t*>a[0]
        s.stamp = <uint32_t*>a[1]
        s.tb = <uint64_t*>a[2]
        s.hw = <uint32_t*>a[3]
        s.hd = <uint32_t*>a[4]
        s.tl = <uint32_t*>a[5]
        s.ends = <uint32_t*>a[6]
    return off


cdef int _scratch_thread(Scratch* s, size_t W, size_t G) noexcept nogil:
    """The query's scratch from this thread's block, grown (to at least W workers and G
    groups) when the fleet outgrew it: no allocation and no O(G) clearing per query
    (PERF: 5 mallocs and 3 x G zeroed per query before). The caller leaves ``tb`` and
    ``ends`` all 0 again (``_rows_take`` or ``_scratch_untouch``). -1: out of memory."""
    cdef ThreadScratch* b = <ThreadScratch*>kvc_scratch_get()
    cdef size_t wc, gc
    cdef char* p
    if b == NULL or b.W < W or b.G < G:
        wc = _max(W, 64 if b == NULL else b.W)
        gc = _max(G, 64 if b == NULL else b.G)
        p = <char*>calloc(1, 4096 + _scratch_carve(s, NULL, wc, gc))
        if p == NULL:
            return -1
        if kvc_scratch_set(p) < 0:
            free(p)
            return -1
        b = <ThreadScratch*>p
        b.W = wc
        b.G = gc
    _scratch_carve(s, <char*>b + 4096, b.W, b.G)
    s.W = W
    s.G = G
    s.owned = False
    s.lower = False
    s.dense = False
    s.nt = 0
    _scratch_no_tiers(s)
    return 0


cdef inline void _touch(Scratch* s, uint32_t g) noexcept nogil:
    """Before group ``g``'s cpu or disk end is raised: listed in ``tl`` if it was 0."""
    cdef size_t G = s.G
    if s.dense:
        s.nt += 1
    else:
        s.tl[s.nt] = g
        s.nt += (s.ends[g] | s.ends[G + g] | s.ends[2 * G + g]) == 0
    s.lower = True


cdef void _scratch_untouch(Scratch* s) noexcept nogil:
    """The ends of the touched groups back to 0 (a query that builds no rows)."""
    cdef size_t i, G = s.G
    cdef uint32_t g
    if s.dense:
        memset(s.ends, 0, 3 * G * sizeof(uint32_t))
        s.nt = 0
        return
    for i in range(s.nt):
        g = s.tl[i]
        s.ends[g] = 0
        s.ends[G + g] = 0
        s.ends[2 * G + g] = 0
    s.nt = 0


cdef int _scratch_tiers(Scratch* s) noexcept nogil:
    """The tier walks' scratch (``idx`` all HM_NIL, ``cand``, ``oend``, ``olast``), once
    per query; -1 when out of memory (``_scratch_free`` frees what was allocated)."""
    cdef size_t k, W = s.W
    if s.idx != NULL:
        return 0
    s.idx = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.cand = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.oend = <size_t*>malloc(W * sizeof(size_t) + 1)
    s.olast = <uint64_t*>malloc(W * sizeof(uint64_t) + 1)
    if s.idx == NULL or s.cand == NULL or s.oend == NULL or s.olast == NULL:
        return -1
    for k in range(W):
        s.idx[k] = HM_NIL
    return 0


cdef void _scratch_free(Scratch* s) noexcept nogil:
    """Frees what this call allocated (a thread's scratch stays its thread's)."""
    if s.owned:
        free(s.hw)
        free(s.hd)
        free(s.hs)
        free(s.stamp)
        free(s.tl)
        free(s.ends)
    free(s.idx)
    free(s.cand)
    free(s.oend)
    free(s.olast)
    mem_free(s.bps)           # grown by grow_array (counted)
    _scratch_zero(s)


cdef int _bp_reserve(Scratch* s, size_t more) noexcept nogil:
    """Room for ``more`` further breakpoints (one growth instead of many); -1 on OOM."""
    cdef void* p
    if s.nbp + more > s.bpcap:
        p = grow_array(s.bps, &s.bpcap, s.nbp + more, sizeof(BP))
        if p == NULL:
            return -1
        s.bps = <BP*>p
    return 0


cdef inline int _bp_add(Scratch* s, uint32_t group, size_t end, uint64_t last) noexcept nogil:
    cdef void* p
    if s.nbp >= s.bpcap:
        p = grow_array(s.bps, &s.bpcap, s.nbp + 1, sizeof(BP))
        if p == NULL:
            return -1
        s.bps = <BP*>p
    s.bps[s.nbp].group = group
    s.bps[s.nbp].end = <uint32_t>end if end < HM_NIL else HM_NIL
    s.bps[s.nbp].last = last
    s.nbp += 1
    return 0


cdef enum:
    # _tier_walk: a breakpoint whose next edge has more owners than this finds its
    # group's candidates among the group's workers, not among the edge's owners
    GROUP_SCAN_OWNERS = 16


cdef uint32_t* _group_workers(const CoreState* st) noexcept nogil:
    """Per group its unmuted workers, as one array: ``a[g]:a[g + 1]`` indexes them in
    ``a[ngroups + 1:]`` (per-call scratch, ``free`` it); NULL when out of memory."""
    cdef size_t G = st.ngroups, w, g
    cdef uint32_t* a = <uint32_t*>malloc((G + 1 + st.nworkers) * sizeof(uint32_t) + 1)
    cdef uint32_t* pos
    if a == NULL:
        return NULL
    memset(a, 0, (G + 1) * sizeof(uint32_t))
    for w in range(st.nworkers):
        g = st.wgroup[w]
        if g < G and not st.wmute[w]:
            a[g + 1] += 1
    for g in range(G):
        a[g + 1] += a[g]
    pos = <uint32_t*>malloc(G * sizeof(uint32_t) + 1)
    if pos == NULL:
        free(a)
        return NULL
    memcpy(pos, a, G * sizeof(uint32_t))
    for w in range(st.nworkers):
        g = st.wgroup[w]
        if g < G and not st.wmute[w]:
            a[G + 1 + pos[g]] = <uint32_t>w
            pos[g] += 1
    free(pos)
    return a


# -- answers -------------------------------------------------------------------------------
cdef inline uint64_t _row_total(const uint32_t* rows, size_t i) noexcept nogil:
    """Row ``i``'s depth: its npu + cpu + disk blocks (the counts are exclusive)."""
    return <uint64_t>rows[4 * i + 1] + rows[4 * i + 2] + rows[4 * i + 3]


cdef uint64_t _kth_largest(const uint64_t* t, const uint32_t* rows, size_t n, size_t k,
                           uint64_t* heap) noexcept nogil:
    """The k-th largest of ``t[0:n]`` (or, ``t`` NULL, of the totals of ``rows[0:n]``)
    (1 <= k <= n), counting equal values: a min-heap of the k largest seen so far
    (``heap``: k entries), O(n log k), no sort of the rest."""
    cdef size_t i, j, c, p, m = 0
    cdef uint64_t v
    for i in range(n):
        v = t[i] if t != NULL else _row_total(rows, i)
        if m < k:
            j = m
            m += 1
            while j > 0:
                p = (j - 1) >> 1
                if heap[p] <= v:
                    break
                heap[j] = heap[p]
                j = p
            heap[j] = v
        elif v > heap[0]:
            j = 0
            while True:
                c = 2 * j + 1
                if c >= k:
                    break
                if c + 1 < k and heap[c + 1] < heap[c]:
                    c += 1
                if heap[c] >= v:
                    break
                heap[j] = heap[c]
                j = c
            heap[j] = v
    return heap[0]


cdef inline uint64_t _mix64(uint64_t x) noexcept nogil:
    """SplitMix64's finaliser: the start of the rotation of ties from a request's seed."""
    x = (x ^ (x >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef size_t _select_rows(const uint32_t* rows, size_t n, const uint8_t* mask, size_t mlen,
                         bint use_mask, const uint32_t* rank, size_t rlen, bint use_rank,
                         size_t k, uint64_t seed, uint32_t* out, uint64_t* keys,
                         uint64_t* heap, size_t* omitted) noexcept nogil:
    """Write to ``out`` the rows whose group the mask keeps (and, with ``rank``, whose rank
    is not 0; all without either), then (k > 0) only the k deepest: every row deeper than
    the k-th largest total (npu + cpu + disk), and of the ``t`` rows tied at that depth
    the ``need`` first by (rank, order) with ``rank``, else ``need`` consecutive ones of
    them (in order, wrapping) from ``_mix64(seed) % t``. ``omitted``: the tied rows left
    out. Order is kept. Without a mask or ranks the rows are read in place (k < n; ``out``:
    k rows), else filtered into ``out`` first (n rows). ``keys``: n entries with ``rank``;
    ``heap``: k. Returns the rows written."""
    cdef size_t i, m = n, j = 0, t = 0, above = 0, need, start
    cdef uint32_t g
    cdef uint64_t thr, d, kthr = 0
    cdef const uint32_t* src = rows
    omitted[0] = 0
    if use_mask or use_rank:
        m = 0
        for i in range(n):
            g = rows[4 * i]
            if use_mask and (g >= mlen or mask[g] == 0):
                continue
            if use_rank and (g >= rlen or rank[g] == 0):
                continue
            memcpy(out + 4 * m, rows + 4 * i, 4 * sizeof(uint32_t))
            m += 1
        src = out
        if k == 0 or k >= m:
            return m
    thr = _kth_largest(NULL, src, m, k, heap)
    for i in range(m):
        d = _row_total(src, i)
        if d > thr:
            above += 1
        elif d == thr:
            if use_rank:     # smaller (rank, tie index) first: the largest complement
                keys[t] = ~((<uint64_t>rank[src[4 * i]] << 32) | t)
            t += 1
    need = k - above
    omitted[0] = t - need
    if use_rank:
        kthr = _kth_largest(keys, NULL, t, need, heap)
    start = <size_t>(_mix64(seed) % t)
    t = 0
    for i in range(m):
        d = _row_total(src, i)
        if d < thr:
            continue
        if d == thr:
            t += 1
            if use_rank:
                if keys[t - 1] < kthr:
                    continue
            elif (t - 1 + omitted[0] + need - start) % (omitted[0] + need) >= need:
                continue
        if src + 4 * i != out + 4 * j:
            memcpy(out + 4 * j, src + 4 * i, 4 * sizeof(uint32_t))
        j += 1
    return j


cdef MatchRows rows_wrap(uint32_t* data, size_t n):
    """A MatchRows owning ``data`` (malloc'd, ``4 * n`` u32; NULL when n == 0)."""
    cdef MatchRows r = MatchRows.__new__(MatchRows)
    r.data = data
    r.n = n
    return r


cdef class MatchRows:
    """The answer of one query: rows ``(group, npu_blocks, cpu_blocks, disk_blocks)`` by
    increasing group id, hits only, in one C buffer (no Python object per row).

    ``MatchRows(rows)`` builds one from ``(group, npu, cpu, disk)`` tuples (tests, the
    twin's equivalence): group ids strictly increase, every value is a u32. Immutable;
    any thread."""

    def __cinit__(self, *args, **kwargs):
        self.data = NULL
        self.n = 0
        self.omitted = 0

    def __init__(self, rows=()):
        cdef list rs = list(rows)
        cdef size_t n = len(rs), i
        cdef uint32_t* d = NULL
        cdef uint32_t g, a, b, c
        cdef long long prev = -1
        if n:
            d = <uint32_t*>malloc(4 * n * sizeof(uint32_t))
            if d == NULL:
                raise MemoryError()
        try:
            for i in range(n):
                g, a, b, c = rs[i]
                if <long long>g <= prev:
                    raise ValueError("MatchRows: group ids must strictly increase")
                prev = g
                d[4 * i] = g
                d[4 * i + 1] = a
                d[4 * i + 2] = b
                d[4 * i + 3] = c
        except BaseException:
            free(d)
            raise
        free(self.data)
        self.data = d
        self.n = n

    def __dealloc__(self):
        free(self.data)
        self.data = NULL

    def __len__(self):
        return self.n

    def __repr__(self):
        return f"MatchRows({self.tolist()!r})"

    def tolist(self):
        """``[(group, npu, cpu, disk)]``: what ``CoreIndex.match`` returns."""
        cdef size_t i
        cdef uint32_t* d = self.data
        return [(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]) for i in range(self.n)]

    def sums(self):
        """``(npu, cpu, disk)`` block sums over the rows (one C loop)."""
        cdef uint64_t a = 0, b = 0, c = 0
        cdef size_t i
        for i in range(self.n):
            a += self.data[4 * i + 1]
            b += self.data[4 * i + 2]
            c += self.data[4 * i + 3]
        return (a, b, c)

    def last_group(self):
        """The largest group id of the rows (the last one), -1 when empty."""
        return <long long>self.data[4 * (self.n - 1)] if self.n else -1

    # -- the answer as Python objects (_index_answers.pxi; docs/api.md, "Reading an
    # answer in Python"). ``names``: the index's group names (``GroupNames`` or its twin):
    # ``keys`` (group id -> (instance_id, dp_rank)), ``dp_keys`` (group id -> str(dp_rank)).
    def scores(self, names):
        """``{(instance_id, dp_rank): depth}``, depth the row's npu + cpu + disk blocks
        (what Dynamo's ``find_matches(...).scores`` gives a router); keys are the name
        table's own tuples."""
        return _answer_scores(self, _names_keys(self, names, False))

    def tuples(self, names):
        """``[(instance_id, dp_rank, npu, cpu, disk)]`` in row (group) order."""
        return _answer_rows(self, _names_keys(self, names, False), NULL)

    def hits(self, names, cls):
        """:meth:`tuples` as instances of ``cls``, a tuple subclass adding no field (the
        ``DpHit`` NamedTuple), made as ``tuple.__new__(cls, row)`` makes them."""
        return _answer_rows(self, _names_keys(self, names, False), _row_type(cls))

    def v3(self, names, str tenant not None, block_size):
        """The V3 body ``{tenant: {instance_id: {"longest_matched", "DP": {str(dp_rank):
        {"matched_tokens", "npu_blocks", "cpu_blocks", "disk_blocks"}}}}}``, matched tokens
        ``min(blocks * block_size, 2^32 - 1)``; ``block_size`` < 0 is a ValueError."""
        bs = _index_int(block_size)
        if bs < 0:
            raise ValueError(f"block_size must be at least 0, not {bs}")
        cdef list keys = _names_keys(self, names, True)
        return _answer_v3(self, keys, names.dp_keys, tenant,
                          <uint64_t>bs if bs <= 0xFFFFFFFF else <uint64_t>0x100000000)

    def select(self, top_k=None, groups=None, seed=0, ranks=None):
        """The rows an extended query answers (docs/api.md, "top_k and instances"):
        with ``groups`` (bytes-like, one byte per group id, non-zero = kept; ids past its
        end are left out) and ``ranks`` (a u32 buffer, one per group id: 0 = left out,
        else its preference, smaller first) only those groups, then with ``top_k`` at
        most ``top_k`` rows: every row deeper than the ``top_k``-th largest total blocks
        (npu + cpu + disk), and of the rows tied at that depth the first ones by
        (rank, order) with ``ranks``, else a rotation of them seeded by ``seed`` (a u64;
        the same seed, the same rows). The answer's ``omitted``: the tied rows left out.
        Order is kept. ``top_k`` < 1 is a ValueError; more than the rows keeps them all."""
        cdef size_t k = 0, mlen = 0, rlen = 0, m = 0, n = self.n, om = 0
        cdef const uint8_t[::1] mv
        cdef const uint32_t[::1] rv
        cdef const uint8_t* mp = NULL
        cdef const uint32_t* rp = NULL
        cdef bint use_mask = groups is not None
        cdef bint use_rank = ranks is not None
        cdef uint64_t sd = <uint64_t>(seed & 0xFFFFFFFFFFFFFFFF)
        cdef uint32_t* out = NULL
        cdef uint64_t* keys = NULL
        cdef uint64_t* heap = NULL
        cdef MatchRows r
        if top_k is not None:
            top_k = _index_int(top_k)
            if top_k < 1:
                raise ValueError(f"top_k must be at least 1, not {top_k}")
            if top_k < n:
                k = <size_t>top_k
        if use_mask:
            mv = groups
            mlen = <size_t>mv.shape[0]
            if mlen:
                mp = &mv[0]
        if use_rank:
            rv = ranks
            rlen = <size_t>rv.shape[0]
            if rlen:
                rp = &rv[0]
        if not use_mask and not use_rank and k == 0:
            return self
        if n == 0:
            return rows_wrap(NULL, 0)
        out = <uint32_t*>malloc(4 * (n if use_mask or use_rank else k) * sizeof(uint32_t))
        if use_rank:
            keys = <uint64_t*>malloc(n * sizeof(uint64_t))
        heap = <uint64_t*>malloc((k + 1) * sizeof(uint64_t))
        if out == NULL or heap == NULL or (use_rank and keys == NULL):
            free(out)
            free(keys)
            free(heap)
            raise MemoryError()
        if n > SELECT_GIL_ROWS:
            with nogil:
                m = _select_rows(self.data, n, mp, mlen, use_mask, rp, rlen, use_rank, k, sd,
                                 out, keys, heap, &om)
        else:   # PERF: with the GIL held (a release costs more: see _recv.pyx)
            m = _select_rows(self.data, n, mp, mlen, use_mask, rp, rlen, use_rank, k, sd,
                             out, keys, heap, &om)
        free(keys)
        free(heap)
        if m == 0:
            free(out)
            out = NULL
        r = rows_wrap(out, m)
        r.omitted = om
        return r


# -- query ---------------------------------------------------------------------------------
cdef int _tier_walk(CoreIndex self, int tier, HCursor* hc, Scratch* s, size_t nin,
                    uint32_t* ends) noexcept nogil:
    """Walk one lower tier from the root and from breakpoints ``s.bps[0:nin]``
    of the same group; append its own breakpoints; max ends per group."""
    cdef Lower* L = &self.st.tiers[tier]
    cdef size_t n = hc.n, k, b, nc
    cdef uint32_t e, o, w, g, start
    cdef uint64_t last, first
    cdef uint32_t* gws = NULL
    if n == 0 or L.live_edges == 0:
        return 0
    if _scratch_tiers(s) < 0:
        return -1
    # (a) the root walks: every owner of a root edge of H[0] walks on from the
    # oldest root edge it owns (one root edge per distinct first engine hash)
    e = lower_find(L, False, 0, hc_get(hc, 0))
    if e != HM_NIL:
        memset(s.stamp, 0xFF, s.W * sizeof(uint32_t))
    while e != HM_NIL:
        nc = 0
        w = lower_owner_first(L, e, &o)
        while w != HM_NIL:
            if (w < self.st.nworkers and nc < s.W and s.stamp[w] == HM_NIL
                    and not self.st.wmute[w]):
                s.stamp[w] = 0
                s.cand[nc] = w
                nc += 1
            w = lower_owner_next(L, &o)
        first = L.edges[e].child
        lower_walk_multi(L, hc, 1, first, s.cand, nc, s.idx, s.W, s.oend, s.olast)
        for k in range(nc):
            g = self.st.wgroup[s.cand[k]]
            last = s.olast[k] if s.oend[k] > 1 else first
            if _bp_add(s, g, s.oend[k], last) < 0:
                return -1
            if s.oend[k] > ends[g]:
                _touch(s, g)
                ends[g] = <uint32_t>s.oend[k]
        e = L.edges[e].next_root
    # (b) continuation from the same group's breakpoints only: no cross-DP borrowing
    # (docs/design.md, "CoreIndex: query")
    for b in range(nin):
        start = s.bps[b].end
        if start >= n:
            continue
        g = s.bps[b].group
        last = s.bps[b].last
        e = lower_find(L, True, last, hc_get(hc, start))
        if e == HM_NIL:
            continue
        nc = 0
        if L.edges[e].nowners > GROUP_SCAN_OWNERS and gws == NULL:
            gws = _group_workers(self.st)
            if gws == NULL:
                return -1
        if (L.edges[e].nowners <= GROUP_SCAN_OWNERS or g >= self.st.ngroups
                or gws[g + 1] - gws[g] >= L.edges[e].nowners):
            w = lower_owner_first(L, e, &o)
            while w != HM_NIL:
                if (w < self.st.nworkers and self.st.wgroup[w] == g and nc < s.W
                        and not self.st.wmute[w]):
                    s.cand[nc] = w
                    nc += 1
                w = lower_owner_next(L, &o)
        else:
            # An edge many workers own (a prefix every engine offloaded, under the
            # same engine hashes) after the breakpoints of as many groups: ask the
            # group's own (fewer) workers, by their reverse maps, instead of walking
            # every owner for every breakpoint, which is O(breakpoints x owners).
            for k in range(gws[g], gws[g + 1]):
                w = gws[self.st.ngroups + 1 + k]
                if nc < s.W and lower_rev_get(L, w, L.edges[e].child) == e:
                    s.cand[nc] = w
                    nc += 1
        if nc == 0:
            continue
        lower_walk_multi(L, hc, start, last, s.cand, nc, s.idx, s.W, s.oend, s.olast)
        for k in range(nc):
            if s.oend[k] > start:
                if _bp_add(s, g, s.oend[k], s.olast[k]) < 0:
                    free(gws)
                    return -1
                if s.oend[k] > ends[g]:
                    _touch(s, g)
                    ends[g] = <uint32_t>s.oend[k]
    free(gws)
    return 0

cdef void _hbm_ends(const CoreState* st, Scratch* s, size_t nh) noexcept nogil:
    """The HBM depths per group of the walk's ``nh`` results (muted workers have none),
    each group listed in ``s.tl`` on its first depth and counted in ``s.nt``; with
    ``s.dense`` not listed, and ``s.nt`` only a bound: ``nh`` (PERF: a round-robin fleet's
    wide answer: every engine is a result; branch-free, the fewest instructions)."""
    cdef size_t k, nt = s.nt, nw = st.nworkers
    cdef const uint32_t* hw = s.hw
    cdef const uint32_t* hd = s.hd
    cdef const uint32_t* wgroup = st.wgroup
    cdef const uint8_t* wmute = st.wmute
    cdef uint32_t* npu = s.ends
    cdef uint32_t* tl = s.tl
    cdef uint32_t w, g, d, old
    if s.dense:
        for k in range(nh):
            w = hw[k]
            if w >= nw:
                continue
            d = hd[k] & ((wmute[w] != 0) - <uint32_t>1)
            g = wgroup[w]
            old = npu[g]
            npu[g] = d if d > old else old
        nt += nh
    else:
        for k in range(nh):
            w = hw[k]
            if w >= nw:
                continue
            d = hd[k] & ((wmute[w] != 0) - <uint32_t>1)
            g = wgroup[w]
            old = npu[g]
            tl[nt] = g
            nt += (old == 0) & (d != 0)
            npu[g] = d if d > old else old
    s.nt = nt


cdef void _hbm_breakpoints(const CoreState* st, Scratch* s, size_t nh) noexcept nogil:
    """Every unmuted result of the walk a breakpoint (room reserved), for the lower
    tiers' walks."""
    cdef size_t k
    cdef uint32_t w
    for k in range(nh):
        w = s.hw[k]
        if w < st.nworkers and not st.wmute[w]:
            _bp_add(s, st.wgroup[w], s.hd[k], s.hs[w])     # room reserved: cannot fail


cdef inline bint _lower_live(const CoreState* st) noexcept nogil:
    """Whether a lower tier has edges (else a query walks the HBM tree alone)."""
    return st.tiers[0].live_edges != 0 or st.tiers[1].live_edges != 0


cdef int _query_rest(CoreIndex self, HCursor* hc, Scratch* s, size_t nh,
                     bint lower) noexcept nogil:
    """The query after the HBM walk (``nh`` results in ``s``): HBM depths per group,
    then (``lower``: the walk kept the breakpoints' engine hashes) the lower tiers from
    the breakpoints."""
    cdef size_t ncpu_from
    cdef size_t G = self.st.ngroups
    # many results: the rows are taken by one pass over the groups, which clears them
    s.dense = nh * 8 >= G
    _hbm_ends(self.st, s, nh)
    if not lower:
        # no lower tier to continue in: the HBM depths alone, no breakpoints (PERF:
        # a round-robin fleet's answer lists every engine; 16 B per holder less)
        return 0
    if _bp_reserve(s, nh) < 0:
        return -1
    _hbm_breakpoints(self.st, s, nh)
    ncpu_from = s.nbp
    if _tier_walk(self, 0, hc, s, ncpu_from, s.ends + G) < 0:
        return -1
    # Disk continues from every HBM and CPU breakpoint of the same group.
    if _tier_walk(self, 1, hc, s, s.nbp, s.ends + 2 * G) < 0:
        return -1
    return 0

cdef enum:
    # An attached handle's query (a worker's) walks the HBM tree this many blocks per
    # step; between steps it lets a waiting writer in (docs/design.md, "Long queries and
    # the writer"). About 100 us of walking.
    QUERY_CHUNK = 2048
    # Queries of up to this many blocks run with the GIL held when the read lock is free;
    # answers of up to this many rows are selected (top_k, instances) with it held.
    QUERY_GIL_BLOCKS = 512
    SELECT_GIL_ROWS = 4096
    # Starts again at most this many times (the tree changed under its path), then walks
    # the rest in one read section.
    QUERY_RESTARTS = 4


cdef inline size_t _query_w(const CoreState* st) noexcept nogil:
    return _max(_max(st.nworkers, st.tree.nrev), _max(st.tiers[0].nrev, st.tiers[1].nrev))


cdef int _query_sections(CoreIndex self, HCursor* hc, Scratch* s, int slot, size_t chunk,
                         size_t* G, int* stale) noexcept nogil:
    """The query inside the read section the caller entered; ``G``: the groups of the
    answer in ``s.ends``. ``chunk`` 0: in that one section. Else the HBM walk goes
    ``chunk`` blocks at a time, and between two, when the writer is waiting, the section
    is left and entered again: the walk goes on if the sizes it was set up for are
    unchanged and ``tree_match_valid`` holds, else it starts again (at most
    QUERY_RESTARTS times, then in one section). ``stale[0]`` not 0: the handle went
    stale meanwhile (not inside a section then). Returns 0, or -1 out of memory; the
    caller frees ``s`` either way (this thread's scratch, set here) and leaves its ends
    0 again (``_rows_take``, ``_scratch_untouch``)."""
    cdef CoreState* st = self.st
    cdef TreeMatch tm
    cdef size_t W, limit, restarts = 0, nrev0, nw0
    cdef int paused
    cdef bint lower
    while True:
        W = _query_w(st)
        G[0] = st.ngroups
        nw0 = st.nworkers
        nrev0 = st.tree.nrev
        lower = _lower_live(st)
        if _scratch_thread(s, W, G[0]) < 0:
            return -1
        limit = chunk if chunk else hc.n
        # the breakpoints' engine hashes only when a lower tier may continue from them
        # (PERF: W x 8 B written and the wide nodes' hashes read less)
        paused = tree_match_start(&st.tree, hc, s.hw, s.hd, s.hs if lower else NULL,
                                  <uint64_t*>s.stamp, &tm, limit)
        while paused:
            if kvc_load_u32(&self.lk.xl.writer):
                kvc_count_yield(0)
                _runlock(self, slot)
                stale[0] = _rlock(self, slot)
                if stale[0] != 0:
                    return 0
                st = self.st
                if (_query_w(st) != W or st.ngroups != G[0] or st.nworkers != nw0
                        or st.tree.nrev != nrev0 or _lower_live(st) != lower
                        or not tree_match_valid(&st.tree, hc, &tm)):
                    break
            limit += chunk
            paused = tree_match_resume(&st.tree, hc, s.hw, s.hd, s.hs if lower else NULL,
                                       &tm, limit)
        if not paused:
            return _query_rest(self, hc, s, tm.cnt, lower)
        _scratch_free(s)
        kvc_count_yield(1)
        restarts += 1
        if restarts >= QUERY_RESTARTS:
            chunk = 0


cdef size_t _rows_take(Scratch* s, uint32_t* rows) noexcept nogil:
    """The answer's rows (group, npu, cpu, disk) by increasing group, from the ends of
    the touched groups, which go back to 0 (``rows``: room for ``min(s.nt, s.G) + 1``
    rows). ``s.dense`` (many results): one pass over the groups, a row written for every
    group and kept for those with an end (no branch per group: a round-robin fleet's
    answer has most of them); else the ``s.nt`` touched groups' bits in ``tb`` and the
    rows in bit order. Returns the rows written."""
    cdef size_t G = s.G, nt = s.nt, m = 0, i, g, nwords
    cdef uint32_t* npu = s.ends
    cdef uint32_t* cpu = s.ends + G
    cdef uint32_t* dsk = s.ends + 2 * G
    cdef uint64_t* tb = s.tb
    cdef uint32_t n_, c_, d_, top
    cdef uint64_t x
    s.nt = 0
    if nt == 0:
        return 0
    if s.dense:
        if not s.lower:
            for g in range(G):
                n_ = npu[g]
                npu[g] = 0
                rows[4 * m] = <uint32_t>g
                rows[4 * m + 1] = n_
                rows[4 * m + 2] = 0
                rows[4 * m + 3] = 0
                m += n_ != 0
            return m
        for g in range(G):
            n_ = npu[g]
            c_ = cpu[g]
            d_ = dsk[g]
            npu[g] = 0
            cpu[g] = 0
            dsk[g] = 0
            top = n_ if n_ > c_ else c_
            rows[4 * m] = <uint32_t>g
            rows[4 * m + 1] = n_
            rows[4 * m + 2] = c_ - n_ if c_ > n_ else 0
            rows[4 * m + 3] = d_ - top if d_ > top else 0
            m += (n_ | c_ | d_) != 0
        return m
    for i in range(nt):
        g = s.tl[i]
        tb[g >> 6] |= (<uint64_t>1) << (g & 63)
    nwords = (G + 63) >> 6
    for i in range(nwords):
        x = tb[i]
        if x == 0:
            continue
        tb[i] = 0
        while x:
            g = i * 64 + ctz64(x)
            x &= x - 1
            n_ = npu[g]
            c_ = cpu[g]
            d_ = dsk[g]
            npu[g] = 0
            cpu[g] = 0
            dsk[g] = 0
            top = n_ if n_ > c_ else c_
            rows[4 * m] = <uint32_t>g
            rows[4 * m + 1] = n_
            rows[4 * m + 2] = c_ - n_ if c_ > n_ else 0
            rows[4 * m + 3] = d_ - top if d_ > top else 0
            m += 1
    return m


cdef inline bint _try_rlock(CoreIndex self) noexcept nogil:
    """This process's read lock if it is free this instant (never waits; never for an
    attached handle, whose read side is the cross-process lock)."""
    if self.attached or pthread_rwlock_tryrdlock(&self.lk.rw) != 0:
        return False
    if self.st == NULL:
        pthread_rwlock_unlock(&self.lk.rw)
        return False
    return True


cdef int _query_rows(Scratch* s, int rc, int stale, uint32_t** rows, size_t* m) noexcept nogil:
    """After the read section: the answer, one u32 row per group with a hit, in C (no
    Python per row), from the groups the query touched (this thread's scratch left all
    0 again). Returns ``rc``, or -1 out of memory."""
    if stale == 0 and rc == 0 and s.nt:
        rows[0] = <uint32_t*>malloc(4 * (_min(s.nt, s.G) + 1) * sizeof(uint32_t))
        if rows[0] == NULL:
            rc = -1
        else:
            m[0] = _rows_take(s, rows[0])
    if s.nt:
        _scratch_untouch(s)
    return rc


cdef MatchRows _run_query(CoreIndex self, HCursor* hc):
    cdef int slot_, stale_ = 0
    cdef Scratch s
    cdef int rc = 0
    cdef size_t G = 0, m = 0
    cdef size_t chunk = QUERY_CHUNK if self.attached else 0
    cdef uint32_t* rows = NULL
    _scratch_zero(&s)
    slot_ = self._reader()
    if hc.n <= QUERY_GIL_BLOCKS and _try_rlock(self):
        # PERF: a short query runs with the GIL held when the read lock is free: a GIL
        # release for a few microseconds hands the GIL to a busy ingest thread and waits
        # up to the switch interval for it back (see _recv.pyx).
        rc = _query_sections(self, hc, &s, slot_, 0, &G, &stale_)
        pthread_rwlock_unlock(&self.lk.rw)
        rc = _query_rows(&s, rc, stale_, &rows, &m)
    else:
        with nogil:
            stale_ = _rlock(self, slot_)
            if stale_ == 0:
                rc = _query_sections(self, hc, &s, slot_, chunk, &G, &stale_)
                if stale_ == 0:
                    _runlock(self, slot_)
            rc = _query_rows(&s, rc, stale_, &rows, &m)
    _scratch_free(&s)
    if stale_ == CORE_CLOSED and not self.attached:
        free(rows)
        return rows_wrap(NULL, 0)   # closed meanwhile (reclaimed): an empty index
    if stale_:
        free(rows)
        self._stale(stale_)
    if rc < 0:
        free(rows)
        raise MemoryError()
    if m == 0:
        free(rows)
        rows = NULL
    return rows_wrap(rows, m)

cdef object _match_rows(CoreIndex self, local_hashes):
    cdef Py_buffer lv
    cdef size_t n
    cdef HCursor hc
    u64_view(&lv, local_hashes)
    try:
        n = <size_t>lv.len // sizeof(uint64_t)
        if n == 0:
            return rows_wrap(NULL, 0)
        hc_init_hashes(&hc, <const uint64_t*>lv.buf, n)
        return _run_query(self, &hc)
    finally:
        PyBuffer_Release(&lv)

cdef object _match_tokens_rows(CoreIndex self, tokens, size_t block_size, uint64_t seed):
    cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
    cdef size_t ntok = tv.shape[0]
    cdef HCursor hc
    if ntok == 0 or block_size == 0:
        return rows_wrap(NULL, 0)
    if hc_init_tokens(&hc, &tv[0], ntok, block_size, seed) < 0:
        raise MemoryError()
    try:
        return _run_query(self, &hc)
    finally:
        hc_free(&hc)

cdef object _match(CoreIndex self, local_hashes):
    return self.match_rows(local_hashes).tolist()

cdef object _match_tokens(CoreIndex self, tokens, size_t block_size, uint64_t seed):
    return self.match_tokens_rows(tokens, block_size, seed).tolist()
