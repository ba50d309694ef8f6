# cython: language_level=3
"""CoreIndex: the whole index of one (model, tenant) in C.

Holds the HBM tree, the CPU and Disk tiers and the two-phase offload/pool
state, and answers tiered queries (hashing, HBM match and both lower-tier walks)
in one ``nogil`` pass under a read lock. Semantics: ``docs/design.md``.
"""
from cpython cimport array
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from kvconductor._cursor cimport HCursor, hc_free, hc_get, hc_init_hashes, hc_init_tokens
from kvconductor._maps cimport (
    FpMap, U64Map, u64m_check, u64m_free, u64m_get, u64m_init, u64m_nbytes, u64m_pop,
    u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, grow_array, live_allocations, mem_alloc, mem_free, pool_arena_leaked,
    pool_arena_writing, pool_give, pool_init, pool_mark_free, pool_take, pool_use_arena,
)
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_unlock, pthread_rwlock_wrlock,
    rwlock_init,
)
from kvconductor._hash cimport hash_token_blocks
from kvconductor._arena cimport Arena
from kvconductor._shlock cimport (
    SHL_EBUSY, SHL_OK, SharedLock, shl_read_enter, shl_read_exit, shl_write_enter,
    shl_write_exit,
)
from posix.unistd cimport usleep
from kvconductor._lower cimport (
    Lower, lower_check, lower_clear, lower_find, lower_free, lower_init, lower_lookup,
    lower_nbytes, lower_owner_first, lower_owner_next, lower_owns, lower_remove, lower_rev_get,
    lower_root_of, lower_store, lower_walk_multi, lower_worker_blocks,
)
from kvconductor._tree cimport (
    T_ERR_OOM, T_ROOT, check_raise, check_rc, tree_check, tree_clear, tree_free, tree_init,
    tree_child, tree_match, tree_match_scratch, tree_member_ehash, tree_nbytes, tree_remove,
    tree_rev_get, tree_store, tree_worker_blocks, TL_N, layout_dict, tree_layout,
)
from kvconductor._tree cimport tree_export, tree_restore

import array as _array
from operator import index as _index_int

from kvconductor import _lower, _tree

from kvconductor._hash import as_u64, to_u32_tokens

ctypedef unsigned long long ull


cdef inline size_t _max(size_t a, size_t b) noexcept nogil:
    return a if a > b else b


# -- query scratch -------------------------------------------------------------------------
cdef int _scratch_init(Scratch* s, size_t W, size_t G) noexcept nogil:
    s.W = W
    s.hw = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.hd = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.hs = <uint64_t*>malloc(W * sizeof(uint64_t) + 1)
    # worker marks of the tier walks, and tree_match's scratch (malloc: 8-byte aligned)
    s.stamp = <uint32_t*>malloc(_max(W * sizeof(uint32_t), tree_match_scratch(W)) + 1)
    # the lower tiers' arrays: on their first use (_scratch_tiers), as most queries of
    # a fleet without CPU/Disk offload never walk a lower tier (PERF: four W-sized
    # mallocs and an O(W) fill less per query, 7,000 engines: ~20 % of the query)
    s.idx = NULL
    s.cand = NULL
    s.oend = NULL
    s.olast = NULL
    s.ends = <uint32_t*>malloc(3 * G * sizeof(uint32_t) + 1)
    s.bps = NULL
    s.nbp = 0
    s.bpcap = 0
    if s.hw == NULL or s.hd == NULL or s.hs == NULL or s.stamp == NULL or s.ends == NULL:
        return -1
    memset(s.ends, 0, 3 * G * sizeof(uint32_t))
    return 0


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
    free(s.hw)
    free(s.hd)
    free(s.hs)
    free(s.stamp)
    free(s.idx)
    free(s.cand)
    free(s.oend)
    free(s.olast)
    free(s.ends)
    mem_free(s.bps)           # grown by grow_array (counted)


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


# -- answers ---------------------------------------------------------------------------------
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


cdef size_t _select_rows(const uint32_t* rows, size_t n, const uint8_t* mask, size_t mlen,
                         bint use_mask, size_t k, uint32_t* out, uint64_t* tot,
                         uint64_t* heap) noexcept nogil:
    """Copy to ``out`` the rows whose group the mask keeps (all without a mask), then keep
    those whose total (npu + cpu + disk) is at least the k-th largest total (k == 0: no
    cut). Order is kept. Returns the rows written."""
    cdef size_t i, m = 0, j = 0
    cdef uint32_t g
    cdef uint64_t thr
    for i in range(n):
        g = rows[4 * i]
        if use_mask and (g >= mlen or mask[g] == 0):
            continue
        memcpy(out + 4 * m, rows + 4 * i, 4 * sizeof(uint32_t))
        m += 1
    if k == 0 or k >= m:
        return m
    for i in range(m):
        tot[i] = _row_total(out, i)
    thr = _kth_largest(tot, NULL, m, k, heap)
    for i in range(m):
        if tot[i] >= thr:
            if j != i:
                memcpy(out + 4 * j, out + 4 * i, 4 * sizeof(uint32_t))
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

    def select(self, top_k=None, groups=None):
        """The rows an extended query answers (docs/api.md, "top_k and instances"):
        with ``groups`` (bytes-like, one byte per group id, non-zero = kept; ids past its
        end are left out) only those groups, then with ``top_k`` only the rows whose total
        blocks (npu + cpu + disk) is at least the ``top_k``-th largest total, so rows tied
        at that depth are all kept. Order is kept. ``top_k`` < 1 is a ValueError; more
        than the rows keeps them all."""
        cdef size_t k = 0, mlen = 0, m = 0, n = self.n
        cdef const uint8_t[::1] mv
        cdef const uint8_t* mp = NULL
        cdef bint use_mask = groups is not None
        cdef uint32_t* out = NULL
        cdef uint64_t* tot = NULL
        cdef uint64_t* heap = NULL
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
        if not use_mask and k == 0:
            return self
        if n == 0:
            return rows_wrap(NULL, 0)
        if not use_mask:
            return self._top(k)
        out = <uint32_t*>malloc(4 * n * sizeof(uint32_t))
        if k:
            tot = <uint64_t*>malloc(n * sizeof(uint64_t))
            heap = <uint64_t*>malloc(k * sizeof(uint64_t))
        if out == NULL or (k and (tot == NULL or heap == NULL)):
            free(out)
            free(tot)
            free(heap)
            raise MemoryError()
        with nogil:
            m = _select_rows(self.data, n, mp, mlen, use_mask, k, out, tot, heap)
        free(tot)
        free(heap)
        if m == 0:
            free(out)
            out = NULL
        return rows_wrap(out, m)

    cdef MatchRows _top(self, size_t k):
        """``select(top_k=k)`` (1 <= k < n): the k-th largest total read from the rows in
        place; the rows themselves when every row is kept (ties at the k-th depth: a
        round-robin fleet where thousands hold the same prefix), else a copy of the kept
        ones. No buffer of n entries is allocated."""
        cdef size_t n = self.n, i, m = 0
        cdef uint64_t thr
        cdef uint32_t* out
        cdef uint64_t* heap = <uint64_t*>malloc(k * sizeof(uint64_t))
        if heap == NULL:
            raise MemoryError()
        with nogil:
            thr = _kth_largest(NULL, self.data, n, k, heap)
            for i in range(n):
                if _row_total(self.data, i) >= thr:
                    m += 1
        free(heap)
        if m == n:
            return self
        out = <uint32_t*>malloc(4 * m * sizeof(uint32_t))
        if out == NULL:
            raise MemoryError()
        with nogil:
            m = 0
            for i in range(n):
                if _row_total(self.data, i) >= thr:
                    memcpy(out + 4 * m, self.data + 4 * i, 4 * sizeof(uint32_t))
                    m += 1
        return rows_wrap(out, m)


class IndexClosedError(ValueError):
    """The index was closed (:meth:`CoreIndex.close`)."""


class StaleIndexError(RuntimeError):
    """An attached handle's directory generation is no longer the arena's: the owner
    published a new directory (an index was created or dropped, a group added), so the
    caller reloads it and asks again."""


cdef object _ATTACH = object()
# Writer thread only: nesting depth of the shared lock's write section, so a batch of
# writes (SharedIndexes.writing(): a drain of ZeroMQ messages, a directory publish) holds
# it once instead of once per write.
cdef int _wdepth = 0
# Shared mode (``install_shared``): the SharedLock every writer of a new CoreIndex also
# takes, so readers in other processes never see a half-made change.
cdef object _shared_lock = None

cdef enum:
    WRITER_WAIT_MS = 10         # the writer's futex wait before it checks for dead readers

cdef uint64_t CORE_MAGIC = 0x6b76636f72653031ULL     # "kvcore01"

cdef extern from "kvconductor/c/index.h":
    uint64_t kvc_load_u64(const uint64_t* p) noexcept nogil


cdef void _xwrite_enter(ShLock* xl) noexcept nogil:
    """Enter the shared write section, or nest in the one this thread holds."""
    global _wdepth
    if _wdepth == 0:
        while shl_write_enter(xl, WRITER_WAIT_MS) == SHL_EBUSY:
            usleep(1000)
    _wdepth += 1


cdef void _xwrite_exit(ShLock* xl) noexcept nogil:
    global _wdepth
    _wdepth -= 1
    if _wdepth == 0:
        shl_write_exit(xl)


cdef void _state_init(CoreState* st) noexcept nogil:
    cdef int k
    memset(st, 0, sizeof(CoreState))
    pool_init(&st.rec_pool)
    pool_init(&st.wait_pool)
    u64m_init(&st.offload_m)
    u64m_init(&st.content_m)
    u64m_init(&st.pending_m)
    for k in range(2):
        lower_init(&st.tiers[k])


cdef void _state_free(CoreState* st) noexcept nogil:
    cdef int k
    tree_free(&st.tree)
    for k in range(2):
        lower_free(&st.tiers[k])
    u64m_free(&st.offload_m)
    u64m_free(&st.content_m)
    u64m_free(&st.pending_m)
    mem_free(st.recs)
    mem_free(st.waits)
    mem_free(st.wgroup)
    mem_free(st.wtier)
    mem_free(st.wmute)
    st.recs = NULL
    st.waits = NULL
    st.wgroup = NULL
    st.wtier = NULL
    st.wmute = NULL


cdef class CoreIndex:
    """Index core of one (model, tenant); worker and group ids are small ints.

    **Threading: exactly one writer thread calls set_worker/store/store_tokens/
    remove/clear/offload/pool_store/evict/sweep; any number of threads may call
    match/match_tokens/stats/worker_blocks concurrently. Every method holds one C
    reader/writer lock for its whole duration (writers exclusive, writer
    preferred) and runs its C part without the GIL.**

    The state lives in one C struct (``CoreState``). **Shared mode** (``--workers N``,
    :func:`install_shared`): the state and every structure array come from the shared
    arena, and each write also holds the cross-process lock's write side, so worker
    processes reading it through :func:`attach_core` handles never see a write half
    done. The writer thread is then the only thread that may create, change or
    :meth:`close` a shared index (others get ``RuntimeError``); an attached handle is
    read-only, frees nothing, and checks in every read section that the owner's
    directory generation is still the one it was built from (else
    ``StaleIndexError``).
    """

    def __cinit__(self, _attach=None):
        self.lock_ok = False
        self.st = NULL
        self.attached = False
        self.shared = False
        self.xl = NULL
        self.xlock = None
        self.gen = NULL
        self.gen_seen = 0
        if rwlock_init(&self.lock) != 0:
            raise MemoryError("cannot initialise rwlock")
        self.lock_ok = True
        if _attach is _ATTACH:
            return              # attach_core fills in the rest
        if _shared_lock is not None:
            if not pool_arena_writing():
                raise RuntimeError(
                    "shared mode: a CoreIndex is created on the writer thread only")
            self.shared = True
            self.xlock = _shared_lock
            self.xl = (<SharedLock>_shared_lock).lock
        self.st = <CoreState*>mem_alloc(sizeof(CoreState))
        if self.st == NULL:
            raise MemoryError()
        _state_init(self.st)
        if tree_init(&self.st.tree) < 0:
            _state_free(self.st)
            mem_free(self.st)
            self.st = NULL
            raise MemoryError()
        self.st.magic = CORE_MAGIC

    def __dealloc__(self):
        # An attached handle owns nothing. A shared state not closed is left in the arena:
        # workers may still read it, and only the writer thread may free arena blocks.
        if self.st != NULL and not self.attached and not self.shared:
            _state_free(self.st)
            mem_free(self.st)
        self.st = NULL
        if self.lock_ok:
            pthread_rwlock_destroy(&self.lock)
            self.lock_ok = False

    # -- handles, locks and shared mode -------------------------------------------------------
    def close(self):
        """Free the state now (writer thread, under the write lock); the handle answers
        nothing afterwards (``IndexClosedError``; ``match`` and ``stats`` answer empty).
        With ``--workers N`` the owner publishes a directory without this index first,
        so no worker can enter it afterwards."""
        cdef CoreState* st
        if self.st == NULL:
            return
        self._writable()
        with nogil:
            self._wlock()
            st = self.st
            st.magic = 0
            self.st = NULL
            _state_free(st)
            mem_free(st)
            self._wunlock()

    @property
    def closed(self):
        """True once :meth:`close` freed the state."""
        return self.st == NULL

    def address(self):
        """Address of the C state (shared mode: in the arena, where workers attach)."""
        if self.st == NULL:
            raise IndexClosedError("index closed")
        return <uintptr_t>self.st

    @property
    def is_attached(self):
        """True for a worker's read-only handle (:func:`attach_core`)."""
        return self.attached

    cdef int _writable(self) except -1:
        if self.attached:
            raise RuntimeError("an attached CoreIndex is read-only")
        if self.st == NULL:
            raise IndexClosedError("index closed")
        if self.shared and not pool_arena_writing():
            raise RuntimeError("shared mode: only the writer thread mutates the index")
        return 0

    cdef int _wlock(self) noexcept nogil:
        pthread_rwlock_wrlock(&self.lock)
        if self.shared:
            _xwrite_enter(self.xl)
        return 0

    cdef void _wunlock(self) noexcept nogil:
        if self.shared:
            _xwrite_exit(self.xl)
        pthread_rwlock_unlock(&self.lock)

    cdef int _slot(self) except -2:
        return (<SharedLock>self.xlock)._slot()

    cdef int _reader(self) except -2:
        """This thread's reader slot of the shared lock (attached handles), else -1."""
        if self.attached:
            return self._slot()
        return -1

    cdef int _rlock(self, int slot) noexcept nogil:
        """0 inside the read section; CORE_STALE (attached: the directory changed) or
        CORE_CLOSED (not inside then)."""
        if self.attached:
            if shl_read_enter(self.xl, slot) != SHL_OK:
                return CORE_CLOSED
            if kvc_load_u64(self.gen) != self.gen_seen or self.st.magic != CORE_MAGIC:
                shl_read_exit(self.xl, slot)
                return CORE_STALE
            return 0
        pthread_rwlock_rdlock(&self.lock)
        if self.st == NULL:
            pthread_rwlock_unlock(&self.lock)
            return CORE_CLOSED
        return 0

    cdef void _runlock(self, int slot) noexcept nogil:
        if self.attached:
            shl_read_exit(self.xl, slot)
        else:
            pthread_rwlock_unlock(&self.lock)

    cdef int _stale(self, int code) except -1:
        if code == CORE_STALE:
            raise StaleIndexError("the shared directory changed: reload it")
        raise IndexClosedError("index closed")

    # -- workers ----------------------------------------------------------------------------
    def set_worker(self, uint32_t worker, uint32_t group, int tier):
        """Declare ``worker``'s (instance, DP) group and tier (0 HBM, 1 CPU, 2 Disk)."""
        cdef size_t cap, k
        cdef void* p
        cdef void* q
        cdef void* r
        self._writable()
        if tier < 0 or tier > 2:
            raise ValueError(f"tier must be 0, 1 or 2, not {tier}")
        if worker == HM_NIL or group == HM_NIL:
            raise ValueError("worker and group ids must be < 2**32 - 1")
        with nogil:
            self._wlock()
            if worker >= self.st.wcap:
                cap = self.st.wcap
                p = grow_array(self.st.wgroup, &cap, <size_t>worker + 1, sizeof(uint32_t))
                if p != NULL:
                    self.st.wgroup = <uint32_t*>p
                    cap = self.st.wcap
                    q = grow_array(self.st.wtier, &cap, <size_t>worker + 1, sizeof(uint8_t))
                    if q != NULL:
                        self.st.wtier = <uint8_t*>q
                        cap = self.st.wcap
                        r = grow_array(self.st.wmute, &cap, <size_t>worker + 1, sizeof(uint8_t))
                        if r != NULL:
                            self.st.wmute = <uint8_t*>r
                            for k in range(self.st.wcap, cap):
                                self.st.wgroup[k] = HM_NIL
                                self.st.wtier[k] = 0
                                self.st.wmute[k] = 0
                            self.st.wcap = cap
            if worker < self.st.wcap:
                self.st.wgroup[worker] = group
                self.st.wtier[worker] = <uint8_t>tier
                if worker + 1 > self.st.nworkers:
                    self.st.nworkers = worker + 1
                if group + 1 > self.st.ngroups:
                    self.st.ngroups = group + 1
            self._wunlock()
        if worker >= self.st.wcap:
            raise MemoryError()

    def set_muted(self, uint32_t worker, bint muted):
        """Mute (or unmute) ``worker``: a muted worker keeps its blocks and takes every
        update as usual, but contributes no hits (and no breakpoint for a lower tier to
        continue from) to :meth:`match`/:meth:`match_tokens`. A source down too long
        (``docs/operations.md``, "Dead engines") mutes its HBM workers."""
        self._writable()
        self._tier(worker)
        with nogil:
            self._wlock()
            self.st.wmute[worker] = 1 if muted else 0
            self._wunlock()

    def is_muted(self, uint32_t worker):
        """Whether ``worker`` is muted (:meth:`set_muted`)."""
        cdef int slot_, stale_ = 0
        cdef bint m = False
        self._tier(worker)
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                m = self.st.wmute[worker] != 0
                self._runlock(slot_)
        if stale_:
            self._stale(stale_)
        return m

    cdef int _tier(self, uint32_t worker) except -1:
        if self.st == NULL or self.attached:
            self._writable()
        if worker >= self.st.nworkers or self.st.wgroup[worker] == HM_NIL:
            raise KeyError(f"unknown worker id {worker}: call set_worker first")
        return self.st.wtier[worker]

    # -- direct mutations ---------------------------------------------------------------------
    cdef long _store_c(self, uint32_t worker, int tier, bint hp, uint64_t p,
                       const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil:
        if tier == 0:
            return tree_store(&self.st.tree, worker, hp, p, ehashes, locals, n)
        return lower_store(&self.st.tiers[tier - 1], worker, hp, p, ehashes, locals, n)

    def store(self, uint32_t worker, parent, engine_hashes, local_hashes):
        """Store a chain on ``worker``'s tier; returns blocks stored."""
        cdef int tier = self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = min(sv.shape[0], lv.shape[0])
        cdef bint hp = parent is not None
        cdef uint64_t p = parent if hp else 0
        cdef long rc
        self._writable()
        if n == 0:
            return 0
        with nogil:
            self._wlock()
            rc = self._store_c(worker, tier, hp, p, &sv[0], &lv[0], n)
            self._wunlock()
        return check_rc(rc)

    def store_tokens(self, uint32_t worker, parent, engine_hashes, tokens, size_t block_size,
                     uint64_t seed=1337):
        """Hash ``tokens`` in C (``block_size`` per block) and store like :meth:`store`."""
        cdef int tier = self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
        cdef size_t ntok = tv.shape[0]
        cdef size_t nb = 0 if block_size == 0 else (ntok + block_size - 1) // block_size
        cdef size_t n = min(<size_t>sv.shape[0], nb)
        cdef bint hp = parent is not None
        cdef uint64_t p = parent if hp else 0
        cdef long rc = 0
        cdef uint64_t* loc
        self._writable()
        if n == 0:
            return 0
        loc = <uint64_t*>malloc(n * sizeof(uint64_t))
        if loc == NULL:
            raise MemoryError()
        with nogil:
            hash_token_blocks(&tv[0], min(ntok, n * block_size), block_size, seed, loc)
            self._wlock()
            rc = self._store_c(worker, tier, hp, p, &sv[0], loc, n)
            self._wunlock()
        free(loc)
        return check_rc(rc)

    cdef long _remove_c(self, uint32_t worker, int tier, const uint64_t* ehashes,
                        size_t n) noexcept nogil:
        if tier == 0:
            return tree_remove(&self.st.tree, worker, ehashes, n)
        return lower_remove(&self.st.tiers[tier - 1], worker, ehashes, n)

    def remove(self, uint32_t worker, engine_hashes):
        """Remove blocks of ``worker`` directly; returns how many it held."""
        cdef int tier = self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long rc
        self._writable()
        if n == 0:
            return 0
        with nogil:
            self._wlock()
            rc = self._remove_c(worker, tier, &sv[0], n)
            self._wunlock()
        return rc

    cdef long _clear_c(self, uint32_t worker) noexcept nogil:
        cdef int tier = self.st.wtier[worker]
        cdef long rc
        if tier == 0:
            rc = tree_clear(&self.st.tree, worker)
        else:
            rc = lower_clear(&self.st.tiers[tier - 1], worker)
        self._drop_waits(worker, 0.0, -1.0)
        return rc

    def clear(self, uint32_t worker):
        """Drop every block of ``worker`` and its pending waits; returns blocks removed."""
        self._writable()
        self._tier(worker)
        cdef long rc
        with nogil:
            self._wlock()
            rc = self._clear_c(worker)
            self._wunlock()
        return rc

    cdef void _apply_ops(self, BatchOp* ops, size_t n, const uint32_t* clear,
                         size_t nclear) noexcept nogil:
        """A batch of stores/evictions/clears under one write lock (the ingest fast path).

        Each op does exactly what the matching Python method does inside its lock
        (``store``/``store_tokens``, ``evict``, ``clear`` per worker), so a batch
        equals that sequence of calls; ``ops[i].rc`` gets the method's result."""
        cdef size_t i, k
        cdef BatchOp* op
        cdef long rc
        if self.st == NULL or (self.shared and not pool_arena_writing()):
            for i in range(n):      # the caller checked with _tier: never reached
                ops[i].rc = T_ERR_OOM
            return
        self._wlock()
        for i in range(n):
            op = &ops[i]
            if op.kind == OP_STORE:
                op.rc = self._store_c(op.worker, self.st.wtier[op.worker], op.has_parent != 0,
                                      op.parent, op.ehashes, op.locals, op.n)
            elif op.kind == OP_EVICT:
                op.rc = self._evict_w(op.worker, op.ehashes, op.n)
            else:
                rc = 0
                for k in range(nclear):
                    rc += self._clear_c(clear[k])
                op.rc = rc
        self._wunlock()

    # -- two-phase records ---------------------------------------------------------------------
    cdef uint32_t _new_rec(self, uint64_t local, bint hp, uint64_t parent, double t) noexcept nogil:
        cdef uint32_t r = pool_take(&self.st.rec_pool, <void**>&self.st.recs, sizeof(TPRec))
        if r == HM_NIL:
            return HM_NIL
        self.st.recs[r].local = local
        self.st.recs[r].parent = parent if hp else 0
        self.st.recs[r].has_parent = 1 if hp else 0
        self.st.recs[r].t = t
        return r

    cdef void _free_rec(self, uint32_t r) noexcept nogil:
        if r != HM_NIL:
            pool_give(&self.st.rec_pool, self.st.recs, r, sizeof(TPRec))

    cdef int _put_rec(self, U64Map* m, uint64_t h, uint64_t local, bint hp, uint64_t parent,
                      double t) noexcept nogil:
        """``m[h] = (local, parent, t)``, reusing an existing record."""
        cdef uint32_t r = u64m_get(m, h)
        if r == HM_NIL:
            r = self._new_rec(local, hp, parent, t)
            if r == HM_NIL:
                return -1
            if u64m_put(m, h, r) < 0:
                self._free_rec(r)
                return -1
            return 0
        self.st.recs[r].local = local
        self.st.recs[r].parent = parent if hp else 0
        self.st.recs[r].has_parent = 1 if hp else 0
        self.st.recs[r].t = t
        return 0

    cdef uint32_t _new_wait(self, uint32_t worker, double t) noexcept nogil:
        cdef uint32_t i = pool_take(&self.st.wait_pool, <void**>&self.st.waits, sizeof(TPWait))
        if i == HM_NIL:
            return HM_NIL
        self.st.waits[i].worker = worker
        self.st.waits[i].t = t
        self.st.waits[i].next = HM_NIL
        return i

    cdef void _free_wait(self, uint32_t i) noexcept nogil:
        pool_give(&self.st.wait_pool, self.st.waits, i, sizeof(TPWait))
        self.st.npending -= 1

    cdef long _apply(self, uint32_t worker, bint hp, uint64_t parent, uint64_t h,
                     uint64_t local) noexcept nogil:
        """Store one confirmed block for ``worker``; 1 if stored, 0 if refused, -1 OOM."""
        cdef long rc = self._store_c(worker, self.st.wtier[worker], hp, parent, &h, &local, 1)
        if rc == T_ERR_OOM:
            return -1
        return 1 if rc == 1 else 0

    cdef long _apply_rec(self, uint32_t worker, uint64_t h, uint32_t r) noexcept nogil:
        return self._apply(worker, self.st.recs[r].has_parent == 1, self.st.recs[r].parent, h,
                           self.st.recs[r].local)

    cdef long _drop_waits(self, uint32_t worker, double now, double ttl) noexcept nogil:
        """Remove waiters of ``worker`` (ttl < 0) or waiters older than ``ttl`` (any
        worker, ``worker`` ignored). Returns the number removed; -1 on OOM."""
        cdef U64Map* m = &self.st.pending_m
        cdef size_t i, nempty = 0, k
        cdef uint32_t head, cur, prev, nxt
        cdef long removed = 0
        cdef uint64_t* empty = NULL
        cdef bint drop
        if m.keys == NULL or self.st.npending == 0:
            return 0
        empty = <uint64_t*>malloc((m.size + 1) * sizeof(uint64_t))
        if empty == NULL:
            return -1
        for i in range(m.mask + 1):
            head = m.vals[i]
            if head == HM_NIL:
                continue
            prev = HM_NIL
            cur = head
            while cur != HM_NIL:
                nxt = self.st.waits[cur].next
                if ttl < 0:
                    drop = self.st.waits[cur].worker == worker
                else:
                    drop = now - self.st.waits[cur].t >= ttl
                if drop:
                    if prev == HM_NIL:
                        head = nxt
                    else:
                        self.st.waits[prev].next = nxt
                    self._free_wait(cur)
                    removed += 1
                else:
                    prev = cur
                cur = nxt
            m.vals[i] = head if head != HM_NIL else m.vals[i]
            if head == HM_NIL:
                empty[nempty] = m.keys[i]
                nempty += 1
        for k in range(nempty):
            u64m_pop(m, empty[k])
        free(empty)
        return removed

    # -- two-phase operations ------------------------------------------------------------------
    def offload(self, engine_hashes, local_hashes, parent, double now):
        """Phase 1 (engine offload to CPU/Disk); returns (worker, block) stores applied."""
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = min(sv.shape[0], lv.shape[0])
        cdef bint hp0 = parent is not None
        cdef uint64_t p0 = parent if hp0 else 0
        cdef long rc = 0
        self._writable()
        if n == 0:
            return 0
        with nogil:
            self._wlock()
            rc = self._offload_c(&sv[0], &lv[0], n, hp0, p0, now)
            self._wunlock()
        if rc < 0:
            raise MemoryError()
        return rc

    cdef long _offload_c(self, const uint64_t* ehashes, const uint64_t* locals, size_t n,
                         bint hp0, uint64_t p0, double now) noexcept nogil:
        cdef size_t i, nw, a, b
        cdef uint64_t h, t, p
        cdef bint hp
        cdef uint32_t head, cur, tmp
        cdef long applied = 0, rc
        cdef uint32_t ws[64]
        for i in range(n):
            h = ehashes[i]
            t = locals[i]
            hp = hp0 if i == 0 else True
            p = p0 if i == 0 else ehashes[i - 1]
            head = u64m_pop(&self.st.pending_m, h)
            if head != HM_NIL:
                if self._put_rec(&self.st.content_m, h, t, hp, p, now) < 0:
                    return -1
                self._free_rec(u64m_pop(&self.st.offload_m, h))
                # Apply to the waiters in batches of up to 64, each in increasing worker id
                # (the chain is newest first, so batches are not globally sorted as the
                # twin's sorted(waiters) is). The order cannot change a result: every
                # waiter stores the same (parent, block) on its own worker.
                while head != HM_NIL:
                    nw = 0
                    cur = head
                    while cur != HM_NIL and nw < 64:
                        ws[nw] = self.st.waits[cur].worker
                        nw += 1
                        tmp = self.st.waits[cur].next
                        self._free_wait(cur)
                        cur = tmp
                    head = cur
                    for a in range(1, nw):
                        b = a
                        while b > 0 and ws[b - 1] > ws[b]:
                            ws[b - 1], ws[b] = ws[b], ws[b - 1]
                            b -= 1
                    for a in range(nw):
                        rc = self._apply(ws[a], hp, p, h, t)
                        if rc < 0:
                            return -1
                        applied += rc
            else:
                self._free_rec(u64m_pop(&self.st.content_m, h))
                if self._put_rec(&self.st.offload_m, h, t, hp, p, now) < 0:
                    return -1
        return applied

    def pool_store(self, uint32_t worker, engine_hashes, double now):
        """Phase 2 (pool confirms blocks for ``worker``); returns (applied, queued)."""
        self._writable()
        self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long applied = 0, queued = 0
        cdef int rc = 0
        if n == 0:
            return (0, 0)
        with nogil:
            self._wlock()
            rc = self._pool_store_c(worker, &sv[0], n, now, &applied, &queued)
            self._wunlock()
        if rc < 0:
            raise MemoryError()
        return (applied, queued)

    cdef int _pool_store_c(self, uint32_t worker, const uint64_t* hs, size_t n, double now,
                           long* applied, long* queued) noexcept nogil:
        cdef size_t i
        cdef uint64_t h, p = 0, local = 0
        cdef uint32_t r, head, cur
        cdef bint hp = False
        cdef long rc
        for i in range(n):
            h = hs[i]
            r = u64m_pop(&self.st.offload_m, h)
            if r != HM_NIL:
                self.st.recs[r].t = now
                self._free_rec(u64m_pop(&self.st.content_m, h))
                if u64m_put(&self.st.content_m, h, r) < 0:
                    self._free_rec(r)
                    return -1
            else:
                r = u64m_get(&self.st.content_m, h)
                if r == HM_NIL:
                    if (lower_lookup(&self.st.tiers[0], h, &hp, &p, &local)
                            or lower_lookup(&self.st.tiers[1], h, &hp, &p, &local)):
                        if self._put_rec(&self.st.content_m, h, local, hp, p, now) < 0:
                            return -1
                        r = u64m_get(&self.st.content_m, h)
            if r != HM_NIL:
                rc = self._apply_rec(worker, h, r)
                if rc < 0:
                    return -1
                applied[0] += rc
                continue
            head = u64m_get(&self.st.pending_m, h)
            cur = head
            while cur != HM_NIL and self.st.waits[cur].worker != worker:
                cur = self.st.waits[cur].next
            if cur != HM_NIL:
                continue            # duplicate delivery: first insert time kept
            cur = self._new_wait(worker, now)
            if cur == HM_NIL:
                return -1
            self.st.waits[cur].next = head
            if u64m_put(&self.st.pending_m, h, cur) < 0:
                pool_give(&self.st.wait_pool, self.st.waits, cur, sizeof(TPWait))
                return -1
            self.st.npending += 1
            queued[0] += 1
        return 0

    def evict(self, uint32_t worker, engine_hashes):
        """Removal with the two-phase rule; returns index removals performed."""
        self._writable()
        self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long rc = 0
        if n == 0:
            return 0
        with nogil:
            self._wlock()
            rc = self._evict_w(worker, &sv[0], n)
            self._wunlock()
        return rc

    cdef long _evict_w(self, uint32_t worker, const uint64_t* hs, size_t n) noexcept nogil:
        cdef int tier = self.st.wtier[worker]
        if tier == 0:
            return tree_remove(&self.st.tree, worker, hs, n)
        return self._evict_c(worker, tier, hs, n)

    cdef long _evict_c(self, uint32_t worker, int tier, const uint64_t* hs,
                       size_t n) noexcept nogil:
        cdef size_t i
        cdef uint64_t h
        cdef uint32_t r, head, cur, prev
        cdef long removed = 0
        cdef bint waited
        for i in range(n):
            h = hs[i]
            r = u64m_pop(&self.st.offload_m, h)
            if r != HM_NIL:
                self._free_rec(r)
                self._free_rec(u64m_pop(&self.st.content_m, h))
                continue
            head = u64m_get(&self.st.pending_m, h)
            prev = HM_NIL
            cur = head
            while cur != HM_NIL and self.st.waits[cur].worker != worker:
                prev = cur
                cur = self.st.waits[cur].next
            waited = cur != HM_NIL
            if waited:
                if prev == HM_NIL:
                    head = self.st.waits[cur].next
                    if head == HM_NIL:
                        u64m_pop(&self.st.pending_m, h)
                    else:
                        u64m_put(&self.st.pending_m, h, head)
                else:
                    self.st.waits[prev].next = self.st.waits[cur].next
                self._free_wait(cur)
                if u64m_get(&self.st.content_m, h) == HM_NIL:
                    continue
            removed += self._remove_c(worker, tier, &h, 1)
        return removed

    def sweep(self, double now, double pending_ttl, double content_ttl, double offload_ttl):
        """Expire two-phase entries by age (>= TTL); returns entries removed."""
        cdef long a, b, c
        self._writable()
        with nogil:
            self._wlock()
            a = self._expire(&self.st.offload_m, now, offload_ttl)
            b = self._expire(&self.st.content_m, now, content_ttl)
            c = self._drop_waits(0, now, pending_ttl if pending_ttl >= 0 else 0.0)
            self._wunlock()
        if a < 0 or b < 0 or c < 0:
            raise MemoryError()
        # NOTE: the HBM tree prunes empty nodes eagerly; its sweep is always 0.
        return a + b + c

    cdef long _expire(self, U64Map* m, double now, double ttl) noexcept nogil:
        cdef size_t i, k, nold = 0
        cdef uint64_t* old
        cdef uint32_t r
        if m.keys == NULL or m.size == 0:
            return 0
        old = <uint64_t*>malloc(m.size * sizeof(uint64_t))
        if old == NULL:
            return -1
        for i in range(m.mask + 1):
            r = m.vals[i]
            if r != HM_NIL and now - self.st.recs[r].t >= ttl:
                old[nold] = m.keys[i]
                nold += 1
        for k in range(nold):
            self._free_rec(u64m_pop(m, old[k]))
        free(old)
        return <long>nold

    # -- query ----------------------------------------------------------------------------
    cdef int _tier_walk(self, int tier, HCursor* hc, Scratch* s, size_t nin,
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
                        ends[g] = <uint32_t>s.oend[k]
        free(gws)
        return 0

    cdef int _query_c(self, HCursor* hc, Scratch* s) noexcept nogil:
        cdef size_t k, nh, ncpu_from
        cdef uint32_t w, g
        cdef size_t G = self.st.ngroups
        cdef uint32_t* npu = s.ends
        cdef uint32_t* cpu = s.ends + G
        cdef uint32_t* dsk = s.ends + 2 * G
        nh = tree_match(&self.st.tree, hc, s.hw, s.hd, s.hs, <uint64_t*>s.stamp)
        if self.st.tiers[0].live_edges == 0 and self.st.tiers[1].live_edges == 0:
            # no lower tier to continue in: the HBM depths alone, no breakpoints (PERF:
            # a round-robin fleet's answer lists every engine; 16 B per holder less)
            for k in range(nh):
                w = s.hw[k]
                if w < self.st.nworkers and not self.st.wmute[w]:
                    g = self.st.wgroup[w]
                    if s.hd[k] > npu[g]:
                        npu[g] = s.hd[k]
            return 0
        if _bp_reserve(s, nh) < 0:
            return -1
        for k in range(nh):
            w = s.hw[k]
            if w >= self.st.nworkers or self.st.wmute[w]:
                continue
            g = self.st.wgroup[w]
            _bp_add(s, g, s.hd[k], s.hs[w])     # room reserved: cannot fail
            if s.hd[k] > npu[g]:
                npu[g] = s.hd[k]
        ncpu_from = s.nbp
        if self._tier_walk(0, hc, s, ncpu_from, cpu) < 0:
            return -1
        # Disk continues from every HBM and CPU breakpoint of the same group.
        if self._tier_walk(1, hc, s, s.nbp, dsk) < 0:
            return -1
        return 0

    cdef MatchRows _run_query(self, HCursor* hc):
        cdef int slot_, stale_ = 0
        cdef Scratch s
        cdef int rc = 0
        cdef size_t W, G = 0, g, m = 0
        cdef uint32_t n_, c_, d_, top
        cdef uint32_t* rows = NULL
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                W = _max(_max(self.st.nworkers, self.st.tree.nrev),
                         _max(self.st.tiers[0].nrev, self.st.tiers[1].nrev))
                G = self.st.ngroups
                rc = _scratch_init(&s, W, G)
                if rc == 0:
                    rc = self._query_c(hc, &s)
                self._runlock(slot_)
            if stale_ == 0 and rc == 0:
                # the answer: one u32 row per group with a hit, in C (no Python per row)
                for g in range(G):
                    if s.ends[g] or s.ends[G + g] or s.ends[2 * G + g]:
                        m += 1
                if m:
                    rows = <uint32_t*>malloc(4 * m * sizeof(uint32_t))
                    if rows == NULL:
                        rc = -1
                    else:
                        m = 0
                        for g in range(G):
                            n_ = s.ends[g]
                            c_ = s.ends[G + g]
                            d_ = s.ends[2 * G + g]
                            if n_ or c_ or d_:
                                top = n_ if n_ > c_ else c_
                                rows[4 * m] = <uint32_t>g
                                rows[4 * m + 1] = n_
                                rows[4 * m + 2] = c_ - n_ if c_ > n_ else 0
                                rows[4 * m + 3] = d_ - top if d_ > top else 0
                                m += 1
        if stale_ == CORE_CLOSED and not self.attached:
            return rows_wrap(NULL, 0)   # closed meanwhile (reclaimed): an empty index
        if stale_:
            self._stale(stale_)
        _scratch_free(&s)
        if rc < 0:
            free(rows)
            raise MemoryError()
        return rows_wrap(rows, m)

    def match_rows(self, local_hashes):
        """The answer for LocalBlockHashes as :class:`MatchRows` (``match`` as a list)."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = lv.shape[0]
        cdef HCursor hc
        if n == 0:
            return rows_wrap(NULL, 0)
        hc_init_hashes(&hc, &lv[0], n)
        return self._run_query(&hc)

    def match_tokens_rows(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`match_rows`, hashing ``tokens`` lazily in C during the walk."""
        cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
        cdef size_t ntok = tv.shape[0]
        cdef HCursor hc
        if ntok == 0 or block_size == 0:
            return rows_wrap(NULL, 0)
        if hc_init_tokens(&hc, &tv[0], ntok, block_size, seed) < 0:
            raise MemoryError()
        try:
            return self._run_query(&hc)
        finally:
            hc_free(&hc)

    def match(self, local_hashes):
        """``[(group, npu, cpu, disk)]`` exclusive block counts for LocalBlockHashes."""
        return self.match_rows(local_hashes).tolist()

    def match_tokens(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`match`, hashing ``tokens`` lazily in C during the walk."""
        return self.match_tokens_rows(tokens, block_size, seed).tolist()

    # -- invariants -----------------------------------------------------------------------
    cdef int _check_c(self, char* msg, size_t cap, uint8_t* rfree, uint8_t* wfree) noexcept nogil:
        """The two-phase state and the worker table (the tiers are checked by the caller)."""
        cdef long nr, nw
        cdef size_t i, k, waits = 0
        cdef uint32_t r, c, d
        cdef U64Map* m
        nr = pool_mark_free(&self.st.rec_pool, self.st.recs, sizeof(TPRec), rfree)
        nw = pool_mark_free(&self.st.wait_pool, self.st.waits, sizeof(TPWait), wfree)
        if nr < 0 or nw < 0:
            snprintf(msg, cap, "record or waiter free list broken")
            return -1
        if (u64m_check(&self.st.offload_m) < 0 or u64m_check(&self.st.content_m) < 0
                or u64m_check(&self.st.pending_m) < 0):
            snprintf(msg, cap, "offload, content or pending map corrupt")
            return -1
        # offload and content: disjoint keys, each value its own live record
        for k in range(2):
            m = &self.st.offload_m if k == 0 else &self.st.content_m
            for i in range(m.mask + 1 if m.keys != NULL else 0):
                r = m.vals[i]
                if r == HM_NIL:
                    continue
                if r >= self.st.rec_pool.used or rfree[r] != 0:
                    snprintf(msg, cap, "%s entry %llu has record %llu that is free, out of "
                             "range or shared", "offload" if k == 0 else "content",
                             <ull>m.keys[i], <ull>r)
                    return -1
                rfree[r] = 2
                if r != HM_NIL and k == 0 and u64m_get(&self.st.content_m, m.keys[i]) != HM_NIL:
                    snprintf(msg, cap, "hash %llu in offload and content", <ull>m.keys[i])
                    return -1
        if self.st.offload_m.size + self.st.content_m.size + <size_t>nr != self.st.rec_pool.used:
            snprintf(msg, cap, "records: %llu offload + %llu content + %llu free != %llu",
                     <ull>self.st.offload_m.size, <ull>self.st.content_m.size, <ull>nr,
                     <ull>self.st.rec_pool.used)
            return -1
        # pending: non-empty chains of live waiters, one per worker and hash
        m = &self.st.pending_m
        for i in range(m.mask + 1 if m.keys != NULL else 0):
            c = m.vals[i]
            if c == HM_NIL:
                continue
            while c != HM_NIL:
                if c >= self.st.wait_pool.used or wfree[c] != 0:
                    snprintf(msg, cap, "pending hash %llu lists waiter %llu that is free, out "
                             "of range or on another list", <ull>m.keys[i], <ull>c)
                    return -1
                wfree[c] = 2
                waits += 1
                d = self.st.waits[c].next
                while d != HM_NIL and d < self.st.wait_pool.used and wfree[d] == 0:
                    if self.st.waits[d].worker == self.st.waits[c].worker:
                        snprintf(msg, cap, "worker %llu waits twice for hash %llu",
                                 <ull>self.st.waits[c].worker, <ull>m.keys[i])
                        return -1
                    d = self.st.waits[d].next
                c = self.st.waits[c].next
        if waits != self.st.npending or waits + <size_t>nw != self.st.wait_pool.used:
            snprintf(msg, cap, "npending %llu, recount %llu, free %llu, high-water %llu",
                     <ull>self.st.npending, <ull>waits, <ull>nw, <ull>self.st.wait_pool.used)
            return -1
        if self.st.nworkers > self.st.wcap:
            snprintf(msg, cap, "nworkers %llu > allocated %llu", <ull>self.st.nworkers,
                     <ull>self.st.wcap)
            return -1
        for i in range(self.st.nworkers):
            if self.st.wgroup[i] != HM_NIL and (self.st.wgroup[i] >= self.st.ngroups
                                                or self.st.wtier[i] > 2):
                snprintf(msg, cap, "worker %llu: group %llu of %llu or tier %llu out of range",
                         <ull>i, <ull>self.st.wgroup[i], <ull>self.st.ngroups,
                         <ull>self.st.wtier[i])
                return -1
        return 0

    def check_invariants(self):
        """Walk the C structures under the read lock (HBM tree, both tiers, two-phase
        state); ``AssertionError`` naming the first broken invariant."""
        cdef int slot_, stale_ = 0
        cdef char msg[256]
        cdef char sub[200]
        cdef int rc = 0
        cdef uint8_t* rfree = NULL
        cdef uint8_t* wfree = NULL
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                rc = tree_check(&self.st.tree, sub, sizeof(sub))
                if rc == -1:
                    snprintf(msg, sizeof(msg), "HBM tree: %s", sub)
                if rc == 0:
                    rc = lower_check(&self.st.tiers[0], sub, sizeof(sub))
                    if rc == -1:
                        snprintf(msg, sizeof(msg), "CPU tier: %s", sub)
                if rc == 0:
                    rc = lower_check(&self.st.tiers[1], sub, sizeof(sub))
                    if rc == -1:
                        snprintf(msg, sizeof(msg), "Disk tier: %s", sub)
                if rc == 0:
                    rfree = <uint8_t*>malloc(self.st.rec_pool.used + 1)
                    wfree = <uint8_t*>malloc(self.st.wait_pool.used + 1)
                    rc = -2 if rfree == NULL or wfree == NULL else self._check_c(
                        msg, sizeof(msg), rfree, wfree)
                    free(rfree)
                    free(wfree)
                self._runlock(slot_)
        if stale_:
            self._stale(stale_)
        check_raise(rc, msg)

    def _corrupt_for_test(self, str kind):
        """TEST ONLY: break one invariant on purpose so a test can see ``check_invariants``
        fail (the object stays safe to free, not to use). Kinds: ``npending``,
        ``record_freed`` (needs an offload entry), ``hbm_pairs``, ``cpu_total``."""
        cdef size_t i
        if kind == "npending":
            self.st.npending += 1
        elif kind == "record_freed":
            for i in range(self.st.offload_m.mask + 1 if self.st.offload_m.keys != NULL else 0):
                if self.st.offload_m.vals[i] != HM_NIL:
                    pool_give(&self.st.rec_pool, self.st.recs, self.st.offload_m.vals[i],
                              sizeof(TPRec))
                    return
            raise ValueError("needs an offload entry")
        elif kind == "hbm_pairs":
            self.st.tree.npairs += 1
        elif kind == "cpu_total":
            self.st.tiers[0].total += 1
        else:
            raise ValueError(kind)

    # -- introspection -----------------------------------------------------------------------------
    def worker_blocks(self, uint32_t worker):
        """Blocks ``worker`` holds on its tier."""
        cdef int slot_, stale_ = 0
        cdef size_t n = 0
        cdef int tier
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                if worker < self.st.nworkers:
                    tier = self.st.wtier[worker]
                    if tier == 0:
                        n = tree_worker_blocks(&self.st.tree, worker)
                    else:
                        n = lower_worker_blocks(&self.st.tiers[tier - 1], worker)
                self._runlock(slot_)
        if stale_:
            self._stale(stale_)
        return n

    def worker_hashes(self, uint32_t worker):
        """The engine hashes ``worker`` holds on its tier, as ``array('Q')`` (any order)."""
        cdef int slot_, stale_ = 0
        cdef const FpMap* lrev = NULL
        cdef const Lower* L = NULL
        cdef const FpMap* trev = NULL
        cdef size_t i, k = 0, n = 0
        cdef uint64_t* o
        cdef int tier
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
        if stale_:
            self._stale(stale_)
        try:
            if worker < self.st.nworkers:
                tier = self.st.wtier[worker]
                if tier == 0:
                    if worker < self.st.tree.nrev:
                        trev = &self.st.tree.rev[worker]
                elif worker < self.st.tiers[tier - 1].nrev:
                    L = &self.st.tiers[tier - 1]
                    lrev = &L.rev[worker]
            if lrev != NULL:
                n = lrev.size
            elif trev != NULL:
                n = trev.size
            out = _array.array("Q", bytes(8 * n))
            if n:
                o = <uint64_t*>(<array.array>out).data.as_ulonglongs
                if lrev != NULL:
                    for i in range(lrev.cap):
                        if lrev.slots[i].idx != HM_NIL:
                            o[k] = L.edges[lrev.slots[i].idx].child
                            k += 1
                else:
                    for i in range(trev.cap):
                        if trev.slots[i].idx != HM_NIL and tree_member_ehash(
                                &self.st.tree, trev.slots[i].idx, worker, &o[k]):
                            k += 1
            return out
        finally:
            self._runlock(slot_)

    def parent_of(self, uint32_t worker, uint64_t h):
        """The engine hash of the parent of ``worker``'s block ``h`` on its tier.

        ``None`` for a root block, or (HBM) when the worker no longer holds the
        parent block. Raises ``KeyError`` when ``worker`` does not hold ``h``.
        """
        cdef int slot_, stale_ = 0
        cdef uint32_t node = HM_NIL, p
        cdef bint found = False, has_parent = False
        cdef uint64_t parent = 0
        cdef int tier = -1
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                if worker < self.st.nworkers:
                    tier = self.st.wtier[worker]
                if tier == 0 and worker < self.st.tree.nrev:
                    node = tree_rev_get(&self.st.tree, worker, h)
                    if node != HM_NIL:
                        found = True
                        p = self.st.tree.nodes[node].parent
                        if p != 0 and p != HM_NIL:
                            has_parent = tree_member_ehash(&self.st.tree, p, worker, &parent)
                elif tier > 0 and worker < self.st.tiers[tier - 1].nrev:
                    node = lower_rev_get(&self.st.tiers[tier - 1], worker, h)
                    if node != HM_NIL:
                        found = True
                        has_parent = self.st.tiers[tier - 1].edges[node].has_parent == 1
                        parent = self.st.tiers[tier - 1].edges[node].parent
                self._runlock(slot_)
        if stale_:
            self._stale(stale_)
        if not found:
            raise KeyError(h)
        return parent if has_parent else None

    def hbm_layout(self):
        """Where the HBM tree's bytes go (``RadixTree.layout``): struct sizes, array
        high-water marks, table slots, bytes touched and allocated."""
        cdef int slot_, stale_ = 0
        cdef size_t out[TL_N]
        memset(out, 0, sizeof(out))
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                tree_layout(&self.st.tree, out)
                self._runlock(slot_)
        if stale_ and not (stale_ == CORE_CLOSED and not self.attached):
            self._stale(stale_)
        return layout_dict(out)

    def stats(self):
        """Sizes: nodes, hbm_pairs, cpu_blocks, disk_blocks, offload, content, pending, nbytes."""
        cdef int slot_, stale_ = 0
        cdef size_t nodes = 0, pairs = 0, cpu = 0, disk = 0, off = 0, con = 0, pen = 0, nb = 0
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                nodes = self.st.tree.live_nodes
                pairs = self.st.tree.npairs
                cpu = self.st.tiers[0].total
                disk = self.st.tiers[1].total
                off = self.st.offload_m.size
                con = self.st.content_m.size
                pen = self.st.npending
                nb = (tree_nbytes(&self.st.tree) + lower_nbytes(&self.st.tiers[0])
                      + lower_nbytes(&self.st.tiers[1]) + u64m_nbytes(&self.st.offload_m)
                      + u64m_nbytes(&self.st.content_m) + u64m_nbytes(&self.st.pending_m)
                      + self.st.rec_pool.cap * sizeof(TPRec)
                      + self.st.wait_pool.cap * sizeof(TPWait)
                      + self.st.wcap * (sizeof(uint32_t) + 2 * sizeof(uint8_t)))
                self._runlock(slot_)
        if stale_ == CORE_CLOSED and not self.attached:
            nodes = pairs = cpu = disk = off = con = pen = nb = 0     # closed: empty
        elif stale_:
            self._stale(stale_)
        return {"nodes": nodes, "hbm_pairs": pairs, "cpu_blocks": cpu, "disk_blocks": disk,
                "offload": off, "content": con, "pending": pen, "nbytes": nb}

    # -- explain (appended) ---------------------------------------------------------------
    cdef bint _holds_local(self, int tier, uint32_t w, uint64_t local) noexcept nogil:
        """Does ``w`` hold, on its tier, any block whose LocalBlockHash is ``local``?
        O(blocks of ``w``): diagnostics only."""
        cdef const FpMap* trev
        cdef size_t i
        cdef const Lower* L
        if tier == 0:
            if w >= self.st.tree.nrev:
                return False
            trev = &self.st.tree.rev[w]
            if trev.size == 0:
                return False
            for i in range(trev.cap):
                if (trev.slots[i].idx != HM_NIL
                        and self.st.tree.nodes[trev.slots[i].idx].local == local):
                    return True
            return False
        L = &self.st.tiers[tier - 1]
        if w >= L.nrev:
            return False
        trev = &L.rev[w]
        if trev.size == 0:
            return False
        for i in range(trev.cap):
            if trev.slots[i].idx != HM_NIL and L.edges[trev.slots[i].idx].local == local:
                return True
        return False

    cdef size_t _walk1(self, int tier, uint32_t w, HCursor* hc, size_t pos, bint* hp,
                       uint64_t* p) noexcept nogil:
        """One worker's lower-tier walk from (pos, parent ``p`` when ``hp``, else the
        root); returns where it stops, with ``hp``/``p`` the last block walked."""
        cdef const Lower* L = &self.st.tiers[tier - 1]
        cdef size_t n = hc.n
        cdef uint32_t e
        if pos >= n:
            return pos
        if not hp[0]:
            e = lower_root_of(L, hc_get(hc, pos), w)
            if e == HM_NIL:
                return pos
            p[0] = L.edges[e].child
            hp[0] = True
            pos += 1
        while pos < n:
            e = lower_find(L, True, p[0], hc_get(hc, pos))
            if e == HM_NIL or not lower_owns(L, e, w):
                break
            p[0] = L.edges[e].child
            pos += 1
        return pos

    cdef int _lower_stop(self, int tier, uint32_t w, HCursor* hc, size_t pos, bint hp,
                         uint64_t p) noexcept nogil:
        cdef const Lower* L = &self.st.tiers[tier - 1]
        cdef uint64_t h
        if pos >= hc.n:
            return STOP_END_OF_PROMPT
        h = hc_get(hc, pos)
        if self._holds_local(tier, w, h):
            return STOP_PARENT_MISMATCH
        if not hp:
            return STOP_NOT_HELD if lower_find(L, False, 0, h) != HM_NIL else STOP_NO_FIRST_BLOCK
        return STOP_NOT_HELD if lower_find(L, True, p, h) != HM_NIL else STOP_TIER_EXHAUSTED

    cdef int _trace_c(self, HCursor* hc, Scratch* s, size_t* reach, uint8_t* code,
                      uint32_t* path) noexcept nogil:
        """Per worker: the position its tier's walk reaches and why it stops there
        (docs/design.md, "CoreIndex: explain"). The breakpoints are those of
        ``_query_c``; a lower-tier worker walks from the root and from every breakpoint
        of its group upstream of its tier (a walk of 0 blocks reaches its start)."""
        cdef size_t k, nh, nb0, nb1, nin, plen, d, pos, best
        cdef uint32_t w, g, c
        cdef int t, rc, bc
        cdef size_t n = hc.n
        cdef bint hp
        cdef uint64_t p, h
        nh = tree_match(&self.st.tree, hc, s.hw, s.hd, s.hs, <uint64_t*>s.stamp)
        for k in range(self.st.nworkers):
            reach[k] = 0
        for k in range(nh):
            w = s.hw[k]
            if w >= self.st.nworkers or self.st.wmute[w]:
                continue
            if _bp_add(s, self.st.wgroup[w], s.hd[k], s.hs[w]) < 0:
                return -1
            reach[w] = s.hd[k]
        nb0 = s.nbp
        if self._tier_walk(0, hc, s, nb0, s.ends + self.st.ngroups) < 0:
            return -1
        nb1 = s.nbp
        # the tree path of the query: path[k] is the node after k blocks
        path[0] = T_ROOT
        plen = 1
        while plen <= n:
            c = tree_child(&self.st.tree, path[plen - 1], hc_get(hc, plen - 1))
            if c == HM_NIL:
                break
            path[plen] = c
            plen += 1
        for k in range(self.st.nworkers):
            w = <uint32_t>k
            g = self.st.wgroup[w]
            if g == HM_NIL:
                continue
            t = self.st.wtier[w]
            if self.st.wmute[w]:
                # no hits and no breakpoints (set_muted): it reaches nothing
                reach[w] = 0
                code[w] = STOP_MUTED
                continue
            if t == 0:
                d = reach[w]
                if d >= n:
                    code[w] = STOP_END_OF_PROMPT
                    continue
                h = hc_get(hc, d)
                if self._holds_local(0, w, h):
                    code[w] = STOP_PARENT_MISMATCH
                elif d + 1 < plen and self.st.tree.nodes[path[d + 1]].nmembers > 0:
                    code[w] = STOP_NOT_HELD
                elif d == 0:
                    code[w] = STOP_NO_FIRST_BLOCK
                else:
                    code[w] = STOP_TIER_EXHAUSTED
                continue
            hp = False
            p = 0
            best = self._walk1(t, w, hc, 0, &hp, &p)
            bc = self._lower_stop(t, w, hc, best, hp, p)
            nin = nb0 if t == 1 else nb1
            for d in range(nin):
                if s.bps[d].group != g or s.bps[d].end == HM_NIL:
                    continue
                hp = True
                p = s.bps[d].last
                pos = self._walk1(t, w, hc, s.bps[d].end, &hp, &p)
                rc = self._lower_stop(t, w, hc, pos, hp, p)
                if pos > best or (pos == best and rc < bc):
                    best = pos
                    bc = rc
            reach[w] = best
            code[w] = <uint8_t>bc
        return 0

    cdef list _run_trace(self, HCursor* hc):
        cdef int slot_, stale_ = 0
        cdef Scratch s
        cdef int rc = 0
        cdef size_t W, G, k, nw = 0
        cdef size_t* reach = NULL
        cdef uint8_t* code = NULL
        cdef uint32_t* path = NULL
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
            if stale_ == 0:
                W = _max(_max(self.st.nworkers, self.st.tree.nrev),
                         _max(self.st.tiers[0].nrev, self.st.tiers[1].nrev))
                G = self.st.ngroups
                nw = self.st.nworkers
                rc = _scratch_init(&s, W, G)
                reach = <size_t*>malloc(nw * sizeof(size_t) + 1)
                code = <uint8_t*>malloc(nw + 1)
                path = <uint32_t*>malloc((hc.n + 1) * sizeof(uint32_t))
                if reach == NULL or code == NULL or path == NULL:
                    rc = -1
                if rc == 0:
                    rc = self._trace_c(hc, &s, reach, code, path)
                if rc == 0:
                    for k in range(nw):
                        if self.st.wgroup[k] == HM_NIL:
                            code[k] = 0xFF
                self._runlock(slot_)
        if stale_ == CORE_CLOSED and not self.attached:
            nodes = pairs = cpu = disk = off = con = pen = nb = 0     # closed: empty
        elif stale_:
            self._stale(stale_)
        try:
            if rc < 0:
                raise MemoryError()
            return [(k, reach[k], code[k]) for k in range(nw) if code[k] != 0xFF]
        finally:
            _scratch_free(&s)
            free(reach)
            free(code)
            free(path)

    def trace(self, local_hashes):
        """``[(worker, reach, stop)]`` for every declared worker, by worker id: how far
        the query's walk on the worker's tier reaches (absolute blocks) and the stop code
        (``STOP_*``; docs/design.md, "CoreIndex: explain")."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = lv.shape[0]
        cdef HCursor hc
        cdef uint64_t dummy = 0
        hc_init_hashes(&hc, &lv[0] if n else &dummy, n)
        return self._run_trace(&hc)

    def trace_tokens(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`trace`, hashing ``tokens`` in C (block_size 0: no blocks)."""
        cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
        cdef size_t ntok = tv.shape[0]
        cdef HCursor hc
        cdef uint32_t dummy = 0
        if hc_init_tokens(&hc, &tv[0] if ntok else &dummy, ntok, block_size, seed) < 0:
            raise MemoryError()
        try:
            return self._run_trace(&hc)
        finally:
            hc_free(&hc)

    # -- dump and restore (kvconductor.dump) ------------------------------------------------
    def export_hbm(self):
        """The HBM tree under one read lock, as five arrays.

        ``(parents, locals, node, worker, ehash)``: the node table -- ``parents``
        (``array('I')``, the row of the parent node, ``0xFFFFFFFF`` under the root) and
        ``locals`` (``array('Q')``) -- with every parent before its children, and the
        member table -- ``node`` (``array('I')``, a node row), ``worker``
        (``array('I')``), ``ehash`` (``array('Q')``). :meth:`restore_hbm` rebuilds it.
        """
        cdef int slot_, stale_ = 0
        cdef uint32_t* pos = NULL
        cdef uint32_t* stack = NULL
        cdef size_t nn, nm, used
        cdef int rc = 0
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
        if stale_:
            self._stale(stale_)
        try:
            nn = self.st.tree.live_nodes
            nm = self.st.tree.npairs
            used = self.st.tree.node_pool.used
            parents = _array.array("I", bytes(4 * nn))
            locs = _array.array("Q", bytes(8 * nn))
            mnode = _array.array("I", bytes(4 * nm))
            mworker = _array.array("I", bytes(4 * nm))
            mehash = _array.array("Q", bytes(8 * nm))
            pos = <uint32_t*>malloc(used * sizeof(uint32_t) + 1)
            stack = <uint32_t*>malloc(used * sizeof(uint32_t) + 1)
            if pos == NULL or stack == NULL:
                raise MemoryError()
            with nogil:
                rc = tree_export(
                    &self.st.tree, pos, stack,
                    <uint32_t*>(<array.array>parents).data.as_uints,
                    <uint64_t*>(<array.array>locs).data.as_ulonglongs,
                    <uint32_t*>(<array.array>mnode).data.as_uints,
                    <uint32_t*>(<array.array>mworker).data.as_uints,
                    <uint64_t*>(<array.array>mehash).data.as_ulonglongs)
        finally:
            self._runlock(slot_)
            free(pos)
            free(stack)
        if rc < 0:
            raise AssertionError("HBM tree: node or member count disagrees with the tree")
        return parents, locs, mnode, mworker, mehash

    def restore_hbm(self, parents, local_hashes, node, worker, ehash):
        """Add an :meth:`export_hbm` table to the tree (worker ids as in this core, each
        declared HBM by :meth:`set_worker`); returns the (worker, block) pairs added.

        ``ValueError`` for a malformed table (lengths differ, a parent row not before its
        child, a row out of range, a worker unknown, not HBM, or already holding the
        block); the core must then be discarded (it may keep memberless nodes)."""
        cdef const uint32_t[::1] pv = _u32(parents)
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef const uint32_t[::1] nv = _u32(node)
        cdef const uint32_t[::1] wv = _u32(worker)
        cdef const uint64_t[::1] ev = as_u64(ehash)
        cdef size_t nn = pv.shape[0], nm = nv.shape[0], i
        cdef uint32_t* rows
        cdef long rc
        self._writable()
        if <size_t>lv.shape[0] != nn or <size_t>wv.shape[0] != nm or <size_t>ev.shape[0] != nm:
            raise ValueError("HBM table: column lengths differ")
        for i in range(nm):
            if (wv[i] >= self.st.nworkers or self.st.wgroup[wv[i]] == HM_NIL
                    or self.st.wtier[wv[i]] != 0):
                raise ValueError(f"HBM table: worker {wv[i]} is unknown or not an HBM worker")
        if nn == 0 and nm == 0:
            return 0
        rows = <uint32_t*>malloc(nn * sizeof(uint32_t) + 1)
        if rows == NULL:
            raise MemoryError()
        with nogil:
            self._wlock()
            rc = tree_restore(&self.st.tree, &pv[0] if nn else NULL, &lv[0] if nn else NULL, nn,
                              &nv[0] if nm else NULL, &wv[0] if nm else NULL,
                              &ev[0] if nm else NULL, nm, rows)
            self._wunlock()
        free(rows)
        if rc == T_ERR_OOM:
            raise MemoryError()
        if rc < 0:
            raise ValueError("HBM table: a parent row follows its child, a row is out of "
                             "range or a worker holds a block twice")
        return rc

    def export_tier(self, int tier):
        """CPU (``tier`` 1) or Disk (2) blocks under one read lock: one row per (edge,
        owner) as ``(worker, ehash, local, parent, has_parent)`` arrays (``'I'``, ``'Q'``,
        ``'Q'``, ``'Q'``, ``'B'``), root edges first in their creation order per local
        hash. :meth:`restore_tier` replays them."""
        cdef int slot_, stale_ = 0
        cdef Lower* L
        cdef size_t n, k = 0, i
        cdef uint32_t e, o, w
        cdef int bad = 0
        cdef uint32_t* ow
        cdef uint64_t* oe
        cdef uint64_t* ol
        cdef uint64_t* op
        cdef uint8_t* oh
        if tier != 1 and tier != 2:
            raise ValueError(f"tier must be 1 or 2, not {tier}")
        L = &self.st.tiers[tier - 1]
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
        if stale_:
            self._stale(stale_)
        try:
            n = L.total
            workers = _array.array("I", bytes(4 * n))
            ehashes = _array.array("Q", bytes(8 * n))
            locs = _array.array("Q", bytes(8 * n))
            parents = _array.array("Q", bytes(8 * n))
            hps = _array.array("B", bytes(n))
            ow = <uint32_t*>(<array.array>workers).data.as_uints
            oe = <uint64_t*>(<array.array>ehashes).data.as_ulonglongs
            ol = <uint64_t*>(<array.array>locs).data.as_ulonglongs
            op = <uint64_t*>(<array.array>parents).data.as_ulonglongs
            oh = <uint8_t*>(<array.array>hps).data.as_uchars
            with nogil:
                # pass 0: root edges along each local's chain (oldest first); pass 1: the rest
                for i in range(L.roots.mask + 1 if L.roots.keys != NULL else 0):
                    e = L.roots.vals[i]
                    while e != HM_NIL and bad == 0:
                        w = lower_owner_first(L, e, &o)
                        while w != HM_NIL:
                            if k >= n:
                                bad = 1
                                break
                            ow[k] = w
                            oe[k] = L.edges[e].child
                            ol[k] = L.edges[e].local
                            op[k] = 0
                            oh[k] = 0
                            k += 1
                            w = lower_owner_next(L, &o)
                        e = L.edges[e].next_root
                for i in range(L.edge_pool.used):
                    if L.edges[i].has_parent != 1 or bad:
                        continue
                    w = lower_owner_first(L, <uint32_t>i, &o)
                    while w != HM_NIL:
                        if k >= n:
                            bad = 1
                            break
                        ow[k] = w
                        oe[k] = L.edges[i].child
                        ol[k] = L.edges[i].local
                        op[k] = L.edges[i].parent
                        oh[k] = 1
                        k += 1
                        w = lower_owner_next(L, &o)
        finally:
            self._runlock(slot_)
        if bad or k != n:
            raise AssertionError("lower tier: block count disagrees with the edges")
        return workers, ehashes, locs, parents, hps

    def restore_tier(self, int tier, worker, ehash, local_hashes, parent, has_parent):
        """Replay :meth:`export_tier` rows in order, each as ``store(worker, parent or
        None, [ehash], [local])`` under one write lock; returns the rows stored.
        ``ValueError`` when the columns differ in length, a worker is unknown or not of
        ``tier``, or a row is refused (the tier then holds the rows before it)."""
        cdef const uint32_t[::1] wv = _u32(worker)
        cdef const uint64_t[::1] ev = as_u64(ehash)
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef const uint64_t[::1] pv = as_u64(parent)
        cdef const uint8_t[::1] hv = _u8(has_parent)
        cdef size_t n = wv.shape[0], i
        cdef long rc = 1
        cdef Lower* L
        self._writable()
        if tier != 1 and tier != 2:
            raise ValueError(f"tier must be 1 or 2, not {tier}")
        if (<size_t>ev.shape[0] != n or <size_t>lv.shape[0] != n or <size_t>pv.shape[0] != n
                or <size_t>hv.shape[0] != n):
            raise ValueError("tier table: column lengths differ")
        for i in range(n):
            if (wv[i] >= self.st.nworkers or self.st.wgroup[wv[i]] == HM_NIL
                    or self.st.wtier[wv[i]] != tier):
                raise ValueError(f"tier table: worker {wv[i]} is unknown or not of tier {tier}")
        L = &self.st.tiers[tier - 1]
        i = 0
        with nogil:
            self._wlock()
            while i < n:
                rc = lower_store(L, wv[i], hv[i] != 0, pv[i], &ev[i], &lv[i], 1)
                if rc != 1:
                    break
                i += 1
            self._wunlock()
        if rc < 0:
            raise MemoryError()
        if i < n:
            raise ValueError(f"tier table: row {i} (block {ev[i]} of worker {wv[i]}) refused")
        return n

    def export_twophase(self):
        """The two-phase state under one read lock: ``(records, waits)`` with records
        ``(kind, ehash, local, parent or None, t)`` (kind 0 offload, 1 content) and waits
        ``(ehash, worker, t)``, each hash's waiters newest first; ``t`` on the caller's
        clock (the ``now`` given to offload/pool_store)."""
        cdef int slot_, stale_ = 0
        cdef size_t i
        cdef int k
        cdef uint32_t r, c
        cdef U64Map* m
        records = []
        waits = []
        slot_ = self._reader()
        with nogil:
            stale_ = self._rlock(slot_)
        if stale_:
            self._stale(stale_)
        try:
            for k in range(2):
                m = &self.st.offload_m if k == 0 else &self.st.content_m
                for i in range(m.mask + 1 if m.keys != NULL else 0):
                    r = m.vals[i]
                    if r == HM_NIL:
                        continue
                    records.append((k, m.keys[i], self.st.recs[r].local,
                                    self.st.recs[r].parent if self.st.recs[r].has_parent else None,
                                    self.st.recs[r].t))
            m = &self.st.pending_m
            for i in range(m.mask + 1 if m.keys != NULL else 0):
                c = m.vals[i]
                while c != HM_NIL:
                    waits.append((m.keys[i], self.st.waits[c].worker, self.st.waits[c].t))
                    c = self.st.waits[c].next
        finally:
            self._runlock(slot_)
        return records, waits

    def restore_twophase(self, records, waits):
        """Add :meth:`export_twophase` entries (times already on this core's clock).
        ``ValueError`` for a bad kind, a hash already in the offload or content map, an
        unknown waiter or a worker waiting twice for a hash (entries before it stay)."""
        cdef int kind
        cdef uint64_t h, local, parent
        cdef uint32_t worker, cur, head
        cdef bint hp
        cdef double t
        self._writable()
        recs = [(int(k), int(h_), int(l_), p_, float(t_)) for k, h_, l_, p_, t_ in records]
        ws = [(int(h_), int(w_), float(t_)) for h_, w_, t_ in waits]
        for rec in recs:
            if rec[0] != 0 and rec[0] != 1:
                raise ValueError(f"two-phase record of kind {rec[0]}")
        for wait in ws:
            worker = wait[1]
            if worker >= self.st.nworkers or self.st.wgroup[worker] == HM_NIL:
                raise ValueError(f"pending wait of unknown worker {worker}")
        with nogil:
            self._wlock()
        try:
            for kind, h, local, p_, t in recs:
                hp = p_ is not None
                parent = p_ if hp else 0
                if (u64m_get(&self.st.offload_m, h) != HM_NIL
                        or u64m_get(&self.st.content_m, h) != HM_NIL):
                    raise ValueError(f"two-phase record for hash {h} given twice")
                if self._put_rec(&self.st.offload_m if kind == 0 else &self.st.content_m, h, local,
                                 hp, parent, t) < 0:
                    raise MemoryError()
            # each hash's waiters come newest first: push them oldest first
            for h, worker, t in reversed(ws):
                head = u64m_get(&self.st.pending_m, h)
                cur = head
                while cur != HM_NIL and self.st.waits[cur].worker != worker:
                    cur = self.st.waits[cur].next
                if cur != HM_NIL:
                    raise ValueError(f"worker {worker} waits twice for hash {h}")
                cur = self._new_wait(worker, t)
                if cur == HM_NIL:
                    raise MemoryError()
                self.st.waits[cur].next = head
                if u64m_put(&self.st.pending_m, h, cur) < 0:
                    pool_give(&self.st.wait_pool, self.st.waits, cur, sizeof(TPWait))
                    raise MemoryError()
                self.st.npending += 1
        finally:
            self._wunlock()


cdef const uint32_t[::1] _u32(values):
    """A u32 view of an ``array('I')`` (or any ints)."""
    if isinstance(values, _array.array) and values.typecode == "I":
        return values
    return _array.array("I", values)


cdef const uint8_t[::1] _u8(values):
    """A u8 view of an ``array('B')``, bytes (or any ints)."""
    if isinstance(values, _array.array) and values.typecode == "B":
        return values
    return _array.array("B", values)


def _live_allocations():
    """Structure blocks this module allocated and has not freed (tests: leak check)."""
    return live_allocations()


# -- shared mode (--workers N) -----------------------------------------------------------
def install_shared(Arena arena, SharedLock lock):
    """Shared mode for this process, called ON THE WRITER THREAD (the owner's ingest
    thread): structure memory that thread allocates comes from ``arena`` (in this
    module and in ``_tree``/``_lower``), and every CoreIndex created afterwards also
    takes ``lock``'s write side when it writes. ``install_shared(None, None)`` ends it
    (tests; indexes created meanwhile stay shared)."""
    global _shared_lock
    pool_use_arena(arena)
    _tree._install_arena(arena)
    _lower._install_arena(arena)
    _shared_lock = lock if arena is not None else None


def attach_core(uintptr_t address, SharedLock lock, uintptr_t gen_address, uint64_t gen_seen):
    """A read-only handle (a worker's) on the CoreIndex state at ``address`` of the
    arena mapped in this process. Every read enters ``lock``'s read section and first
    checks that the word at ``gen_address`` still equals ``gen_seen`` (else
    :class:`StaleIndexError`: the caller reloads the directory). Never frees anything."""
    cdef CoreIndex c = CoreIndex.__new__(CoreIndex, _ATTACH)
    cdef CoreState* st = <CoreState*>address
    if address == 0 or gen_address == 0 or lock is None:
        raise ValueError("attach_core needs a state address, a generation and a lock")
    c.attached = True
    c.st = st
    c.xlock = lock
    c.xl = lock.lock
    c.gen = <const uint64_t*>gen_address
    c.gen_seen = gen_seen
    return c


def shared_write_enter():
    """Enter the shared lock's write section on the writer thread (nests: the writes
    inside take it no more). Readers in other processes wait until the matching
    :func:`shared_write_exit`; keep sections short."""
    cdef ShLock* xl
    if _shared_lock is None or not pool_arena_writing():
        raise RuntimeError("shared_write_enter: shared mode, writer thread only")
    xl = (<SharedLock>_shared_lock).lock
    with nogil:
        _xwrite_enter(xl)


def shared_write_exit():
    """Leave what :func:`shared_write_enter` entered."""
    if _shared_lock is None or _wdepth <= 0:
        raise RuntimeError("shared_write_exit outside a shared write section")
    _xwrite_exit((<SharedLock>_shared_lock).lock)


def _arena_leaks():
    """Arena blocks this module was asked to free off the writer thread (left in place)."""
    return pool_arena_leaked()
