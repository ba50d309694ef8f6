# Included by _tree.pyx: the match -- the walk of a query's hashes down the tree with
# the candidate workers as a bitmap or a list, its pause and resume (tree_match_start /
# tree_match_resume) and tree_match in one go.
# The functions take the Tree first (Cython allows no include inside a class body).


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
    ``out_ehash[w]`` = w's engine hash there (when ``out_ehash`` is not NULL); when
    ``out_worker`` is not NULL each is also appended as (w, ``depth``) at ``nout``;
    ``sig`` (when not NULL) adds their
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
                    if out_ehash != NULL:
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
                if out_ehash != NULL:
                    out_ehash[w] = ehs[rank + popc64(word & (((<uint64_t>1) << b) - 1))]
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
            if out_ehash != NULL:
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
        if out_ehash != NULL:
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
    if out_ehash != NULL:
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
