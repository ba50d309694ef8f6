# cython: language_level=3
"""CoreIndex: the whole index of one (model, tenant) in C.

Holds the HBM tree, the CPU and Disk tiers and the two-phase offload/pool
state, and answers tiered queries (hashing, HBM match and both lower-tier walks)
in one ``nogil`` pass under a read lock. Semantics: ``docs/design.md``.
"""
from cpython cimport array
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from kvconductor._cursor cimport HCursor, hc_free, hc_get, hc_init_hashes, hc_init_tokens
from kvconductor._maps cimport (
    U64Map, em_get, u64m_check, u64m_free, u64m_get, u64m_init, u64m_nbytes, u64m_pop,
    u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, grow_array, live_allocations, mem_free, pool_give, pool_init, pool_mark_free,
    pool_take,
)
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_unlock, pthread_rwlock_wrlock,
    rwlock_init,
)
from kvconductor._hash cimport hash_token_blocks
from kvconductor._lower cimport (
    Lower, lower_check, lower_clear, lower_find, lower_free, lower_init, lower_lookup,
    lower_nbytes, lower_owns, lower_remove, lower_root_of, lower_store, lower_walk_multi,
    lower_worker_blocks,
)
from kvconductor._tree cimport (
    T_ERR_OOM, T_ROOT, check_raise, check_rc, tree_check, tree_clear, tree_free, tree_init,
    tree_match, tree_nbytes, tree_remove, tree_store, tree_worker_blocks,
)
from kvconductor._tree cimport tree_export, tree_restore

import array as _array

from kvconductor._hash import as_u64, to_u32_tokens

ctypedef unsigned long long ull


cdef inline size_t _max(size_t a, size_t b) noexcept nogil:
    return a if a > b else b


# -- query scratch -------------------------------------------------------------------------
cdef int _scratch_init(Scratch* s, size_t W, size_t G) noexcept nogil:
    cdef size_t k
    s.W = W
    s.hw = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.hd = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.hs = <uint64_t*>malloc(W * sizeof(uint64_t) + 1)
    s.stamp = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.idx = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.cand = <uint32_t*>malloc(W * sizeof(uint32_t) + 1)
    s.oend = <size_t*>malloc(W * sizeof(size_t) + 1)
    s.olast = <uint64_t*>malloc(W * sizeof(uint64_t) + 1)
    s.ends = <uint32_t*>malloc(3 * G * sizeof(uint32_t) + 1)
    s.bps = NULL
    s.nbp = 0
    s.bpcap = 0
    if (s.hw == NULL or s.hd == NULL or s.hs == NULL or s.stamp == NULL or s.idx == NULL
            or s.cand == NULL or s.oend == NULL or s.olast == NULL or s.ends == NULL):
        return -1
    for k in range(W):
        s.idx[k] = HM_NIL
    memset(s.ends, 0, 3 * G * sizeof(uint32_t))
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


cdef int _bp_add(Scratch* s, uint32_t group, size_t end, uint64_t last) noexcept nogil:
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


cdef class CoreIndex:
    """Index core of one (model, tenant); worker and group ids are small ints.

    **Threading: exactly one writer thread calls set_worker/store/store_tokens/
    remove/clear/offload/pool_store/evict/sweep; any number of threads may call
    match/match_tokens/stats/worker_blocks concurrently. Every method holds one C
    reader/writer lock for its whole duration (writers exclusive, writer
    preferred) and runs its C part without the GIL.**
    """

    def __cinit__(self):
        cdef int k
        self.lock_ok = False
        self.wgroup = NULL
        self.wtier = NULL
        self.wmute = NULL
        self.wcap = 0
        self.nworkers = 0
        self.ngroups = 0
        self.recs = NULL
        pool_init(&self.rec_pool)
        self.waits = NULL
        pool_init(&self.wait_pool)
        self.npending = 0
        u64m_init(&self.offload_m)
        u64m_init(&self.content_m)
        u64m_init(&self.pending_m)
        for k in range(2):
            lower_init(&self.tiers[k])
        if tree_init(&self.tree) < 0:
            tree_free(&self.tree)
            raise MemoryError()
        if rwlock_init(&self.lock) != 0:
            raise MemoryError("cannot initialise rwlock")
        self.lock_ok = True

    def __dealloc__(self):
        cdef int k
        tree_free(&self.tree)
        for k in range(2):
            lower_free(&self.tiers[k])
        u64m_free(&self.offload_m)
        u64m_free(&self.content_m)
        u64m_free(&self.pending_m)
        mem_free(self.recs)
        mem_free(self.waits)
        mem_free(self.wgroup)
        mem_free(self.wtier)
        mem_free(self.wmute)
        self.recs = NULL
        self.waits = NULL
        self.wgroup = NULL
        self.wtier = NULL
        self.wmute = NULL
        if self.lock_ok:
            pthread_rwlock_destroy(&self.lock)
            self.lock_ok = False

    # -- workers ----------------------------------------------------------------------------
    def set_worker(self, uint32_t worker, uint32_t group, int tier):
        """Declare ``worker``'s (instance, DP) group and tier (0 HBM, 1 CPU, 2 Disk)."""
        cdef size_t cap, k
        cdef void* p
        cdef void* q
        cdef void* r
        if tier < 0 or tier > 2:
            raise ValueError(f"tier must be 0, 1 or 2, not {tier}")
        if worker == HM_NIL or group == HM_NIL:
            raise ValueError("worker and group ids must be < 2**32 - 1")
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            if worker >= self.wcap:
                cap = self.wcap
                p = grow_array(self.wgroup, &cap, <size_t>worker + 1, sizeof(uint32_t))
                if p != NULL:
                    self.wgroup = <uint32_t*>p
                    cap = self.wcap
                    q = grow_array(self.wtier, &cap, <size_t>worker + 1, sizeof(uint8_t))
                    if q != NULL:
                        self.wtier = <uint8_t*>q
                        cap = self.wcap
                        r = grow_array(self.wmute, &cap, <size_t>worker + 1, sizeof(uint8_t))
                        if r != NULL:
                            self.wmute = <uint8_t*>r
                            for k in range(self.wcap, cap):
                                self.wgroup[k] = HM_NIL
                                self.wtier[k] = 0
                                self.wmute[k] = 0
                            self.wcap = cap
            if worker < self.wcap:
                self.wgroup[worker] = group
                self.wtier[worker] = <uint8_t>tier
                if worker + 1 > self.nworkers:
                    self.nworkers = worker + 1
                if group + 1 > self.ngroups:
                    self.ngroups = group + 1
            pthread_rwlock_unlock(&self.lock)
        if worker >= self.wcap:
            raise MemoryError()

    def set_muted(self, uint32_t worker, bint muted):
        """Mute (or unmute) ``worker``: a muted worker keeps its blocks and takes every
        update as usual, but contributes no hits (and no breakpoint for a lower tier to
        continue from) to :meth:`match`/:meth:`match_tokens`. A source down too long
        (``docs/operations.md``, "Dead engines") mutes its HBM workers."""
        self._tier(worker)
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            self.wmute[worker] = 1 if muted else 0
            pthread_rwlock_unlock(&self.lock)

    def is_muted(self, uint32_t worker):
        """Whether ``worker`` is muted (:meth:`set_muted`)."""
        cdef bint m
        self._tier(worker)
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            m = self.wmute[worker] != 0
            pthread_rwlock_unlock(&self.lock)
        return m

    cdef int _tier(self, uint32_t worker) except -1:
        if worker >= self.nworkers or self.wgroup[worker] == HM_NIL:
            raise KeyError(f"unknown worker id {worker}: call set_worker first")
        return self.wtier[worker]

    # -- direct mutations ---------------------------------------------------------------------
    cdef long _store_c(self, uint32_t worker, int tier, bint hp, uint64_t p,
                       const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil:
        if tier == 0:
            return tree_store(&self.tree, worker, hp, p, ehashes, locals, n)
        return lower_store(&self.tiers[tier - 1], worker, hp, p, ehashes, locals, n)

    def store(self, uint32_t worker, parent, engine_hashes, local_hashes):
        """Store a chain on ``worker``'s tier; returns blocks stored."""
        cdef int tier = self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = min(sv.shape[0], lv.shape[0])
        cdef bint hp = parent is not None
        cdef uint64_t p = parent if hp else 0
        cdef long rc
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = self._store_c(worker, tier, hp, p, &sv[0], &lv[0], n)
            pthread_rwlock_unlock(&self.lock)
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
        if n == 0:
            return 0
        loc = <uint64_t*>malloc(n * sizeof(uint64_t))
        if loc == NULL:
            raise MemoryError()
        with nogil:
            hash_token_blocks(&tv[0], min(ntok, n * block_size), block_size, seed, loc)
            pthread_rwlock_wrlock(&self.lock)
            rc = self._store_c(worker, tier, hp, p, &sv[0], loc, n)
            pthread_rwlock_unlock(&self.lock)
        free(loc)
        return check_rc(rc)

    cdef long _remove_c(self, uint32_t worker, int tier, const uint64_t* ehashes,
                        size_t n) noexcept nogil:
        if tier == 0:
            return tree_remove(&self.tree, worker, ehashes, n)
        return lower_remove(&self.tiers[tier - 1], worker, ehashes, n)

    def remove(self, uint32_t worker, engine_hashes):
        """Remove blocks of ``worker`` directly; returns how many it held."""
        cdef int tier = self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long rc
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = self._remove_c(worker, tier, &sv[0], n)
            pthread_rwlock_unlock(&self.lock)
        return rc

    cdef long _clear_c(self, uint32_t worker) noexcept nogil:
        cdef int tier = self.wtier[worker]
        cdef long rc
        if tier == 0:
            rc = tree_clear(&self.tree, worker)
        else:
            rc = lower_clear(&self.tiers[tier - 1], worker)
        self._drop_waits(worker, 0.0, -1.0)
        return rc

    def clear(self, uint32_t worker):
        """Drop every block of ``worker`` and its pending waits; returns blocks removed."""
        self._tier(worker)
        cdef long rc
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = self._clear_c(worker)
            pthread_rwlock_unlock(&self.lock)
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
        pthread_rwlock_wrlock(&self.lock)
        for i in range(n):
            op = &ops[i]
            if op.kind == OP_STORE:
                op.rc = self._store_c(op.worker, self.wtier[op.worker], op.has_parent != 0,
                                      op.parent, op.ehashes, op.locals, op.n)
            elif op.kind == OP_EVICT:
                op.rc = self._evict_w(op.worker, op.ehashes, op.n)
            else:
                rc = 0
                for k in range(nclear):
                    rc += self._clear_c(clear[k])
                op.rc = rc
        pthread_rwlock_unlock(&self.lock)

    # -- two-phase records ---------------------------------------------------------------------
    cdef uint32_t _new_rec(self, uint64_t local, bint hp, uint64_t parent, double t) noexcept nogil:
        cdef uint32_t r = pool_take(&self.rec_pool, <void**>&self.recs, sizeof(TPRec))
        if r == HM_NIL:
            return HM_NIL
        self.recs[r].local = local
        self.recs[r].parent = parent if hp else 0
        self.recs[r].has_parent = 1 if hp else 0
        self.recs[r].t = t
        return r

    cdef void _free_rec(self, uint32_t r) noexcept nogil:
        if r != HM_NIL:
            pool_give(&self.rec_pool, self.recs, r, sizeof(TPRec))

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
        self.recs[r].local = local
        self.recs[r].parent = parent if hp else 0
        self.recs[r].has_parent = 1 if hp else 0
        self.recs[r].t = t
        return 0

    cdef uint32_t _new_wait(self, uint32_t worker, double t) noexcept nogil:
        cdef uint32_t i = pool_take(&self.wait_pool, <void**>&self.waits, sizeof(TPWait))
        if i == HM_NIL:
            return HM_NIL
        self.waits[i].worker = worker
        self.waits[i].t = t
        self.waits[i].next = HM_NIL
        return i

    cdef void _free_wait(self, uint32_t i) noexcept nogil:
        pool_give(&self.wait_pool, self.waits, i, sizeof(TPWait))
        self.npending -= 1

    cdef long _apply(self, uint32_t worker, bint hp, uint64_t parent, uint64_t h,
                     uint64_t local) noexcept nogil:
        """Store one confirmed block for ``worker``; 1 if stored, 0 if refused, -1 OOM."""
        cdef long rc = self._store_c(worker, self.wtier[worker], hp, parent, &h, &local, 1)
        if rc == T_ERR_OOM:
            return -1
        return 1 if rc == 1 else 0

    cdef long _apply_rec(self, uint32_t worker, uint64_t h, uint32_t r) noexcept nogil:
        return self._apply(worker, self.recs[r].has_parent == 1, self.recs[r].parent, h,
                           self.recs[r].local)

    cdef long _drop_waits(self, uint32_t worker, double now, double ttl) noexcept nogil:
        """Remove waiters of ``worker`` (ttl < 0) or waiters older than ``ttl`` (any
        worker, ``worker`` ignored). Returns the number removed; -1 on OOM."""
        cdef U64Map* m = &self.pending_m
        cdef size_t i, nempty = 0, k
        cdef uint32_t head, cur, prev, nxt
        cdef long removed = 0
        cdef uint64_t* empty = NULL
        cdef bint drop
        if m.keys == NULL or self.npending == 0:
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
                nxt = self.waits[cur].next
                if ttl < 0:
                    drop = self.waits[cur].worker == worker
                else:
                    drop = now - self.waits[cur].t >= ttl
                if drop:
                    if prev == HM_NIL:
                        head = nxt
                    else:
                        self.waits[prev].next = nxt
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
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = self._offload_c(&sv[0], &lv[0], n, hp0, p0, now)
            pthread_rwlock_unlock(&self.lock)
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
            head = u64m_pop(&self.pending_m, h)
            if head != HM_NIL:
                if self._put_rec(&self.content_m, h, t, hp, p, now) < 0:
                    return -1
                self._free_rec(u64m_pop(&self.offload_m, h))
                # Apply to the waiters in batches of up to 64, each in increasing worker id
                # (the chain is newest first, so batches are not globally sorted as the
                # twin's sorted(waiters) is). The order cannot change a result: every
                # waiter stores the same (parent, block) on its own worker.
                while head != HM_NIL:
                    nw = 0
                    cur = head
                    while cur != HM_NIL and nw < 64:
                        ws[nw] = self.waits[cur].worker
                        nw += 1
                        tmp = self.waits[cur].next
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
                self._free_rec(u64m_pop(&self.content_m, h))
                if self._put_rec(&self.offload_m, h, t, hp, p, now) < 0:
                    return -1
        return applied

    def pool_store(self, uint32_t worker, engine_hashes, double now):
        """Phase 2 (pool confirms blocks for ``worker``); returns (applied, queued)."""
        self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long applied = 0, queued = 0
        cdef int rc = 0
        if n == 0:
            return (0, 0)
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = self._pool_store_c(worker, &sv[0], n, now, &applied, &queued)
            pthread_rwlock_unlock(&self.lock)
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
            r = u64m_pop(&self.offload_m, h)
            if r != HM_NIL:
                self.recs[r].t = now
                self._free_rec(u64m_pop(&self.content_m, h))
                if u64m_put(&self.content_m, h, r) < 0:
                    self._free_rec(r)
                    return -1
            else:
                r = u64m_get(&self.content_m, h)
                if r == HM_NIL:
                    if (lower_lookup(&self.tiers[0], h, &hp, &p, &local)
                            or lower_lookup(&self.tiers[1], h, &hp, &p, &local)):
                        if self._put_rec(&self.content_m, h, local, hp, p, now) < 0:
                            return -1
                        r = u64m_get(&self.content_m, h)
            if r != HM_NIL:
                rc = self._apply_rec(worker, h, r)
                if rc < 0:
                    return -1
                applied[0] += rc
                continue
            head = u64m_get(&self.pending_m, h)
            cur = head
            while cur != HM_NIL and self.waits[cur].worker != worker:
                cur = self.waits[cur].next
            if cur != HM_NIL:
                continue            # duplicate delivery: first insert time kept
            cur = self._new_wait(worker, now)
            if cur == HM_NIL:
                return -1
            self.waits[cur].next = head
            if u64m_put(&self.pending_m, h, cur) < 0:
                pool_give(&self.wait_pool, self.waits, cur, sizeof(TPWait))
                return -1
            self.npending += 1
            queued[0] += 1
        return 0

    def evict(self, uint32_t worker, engine_hashes):
        """Removal with the two-phase rule; returns index removals performed."""
        self._tier(worker)
        cdef const uint64_t[::1] sv = as_u64(engine_hashes)
        cdef size_t n = sv.shape[0]
        cdef long rc = 0
        if n == 0:
            return 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = self._evict_w(worker, &sv[0], n)
            pthread_rwlock_unlock(&self.lock)
        return rc

    cdef long _evict_w(self, uint32_t worker, const uint64_t* hs, size_t n) noexcept nogil:
        cdef int tier = self.wtier[worker]
        if tier == 0:
            return tree_remove(&self.tree, worker, hs, n)
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
            r = u64m_pop(&self.offload_m, h)
            if r != HM_NIL:
                self._free_rec(r)
                self._free_rec(u64m_pop(&self.content_m, h))
                continue
            head = u64m_get(&self.pending_m, h)
            prev = HM_NIL
            cur = head
            while cur != HM_NIL and self.waits[cur].worker != worker:
                prev = cur
                cur = self.waits[cur].next
            waited = cur != HM_NIL
            if waited:
                if prev == HM_NIL:
                    head = self.waits[cur].next
                    if head == HM_NIL:
                        u64m_pop(&self.pending_m, h)
                    else:
                        u64m_put(&self.pending_m, h, head)
                else:
                    self.waits[prev].next = self.waits[cur].next
                self._free_wait(cur)
                if u64m_get(&self.content_m, h) == HM_NIL:
                    continue
            removed += self._remove_c(worker, tier, &h, 1)
        return removed

    def sweep(self, double now, double pending_ttl, double content_ttl, double offload_ttl):
        """Expire two-phase entries by age (>= TTL); returns entries removed."""
        cdef long a, b, c
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            a = self._expire(&self.offload_m, now, offload_ttl)
            b = self._expire(&self.content_m, now, content_ttl)
            c = self._drop_waits(0, now, pending_ttl if pending_ttl >= 0 else 0.0)
            pthread_rwlock_unlock(&self.lock)
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
            if r != HM_NIL and now - self.recs[r].t >= ttl:
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
        cdef Lower* L = &self.tiers[tier]
        cdef size_t n = hc.n, k, b, nc
        cdef uint32_t e, o, w, g, start
        cdef uint64_t last, first
        if n == 0 or L.live_edges == 0:
            return 0
        # (a) the root walks: every owner of a root edge of H[0] walks on from the
        # oldest root edge it owns (one root edge per distinct first engine hash)
        e = lower_find(L, False, 0, hc_get(hc, 0))
        if e != HM_NIL:
            memset(s.stamp, 0xFF, s.W * sizeof(uint32_t))
        while e != HM_NIL:
            nc = 0
            o = L.edges[e].owners
            while o != HM_NIL:
                w = L.own[o].worker
                if w < self.nworkers and nc < s.W and s.stamp[w] == HM_NIL and not self.wmute[w]:
                    s.stamp[w] = 0
                    s.cand[nc] = w
                    nc += 1
                o = L.own[o].next
            first = L.edges[e].child
            lower_walk_multi(L, hc, 1, first, s.cand, nc, s.idx, s.W, s.oend, s.olast)
            for k in range(nc):
                g = self.wgroup[s.cand[k]]
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
            o = L.edges[e].owners
            while o != HM_NIL:
                w = L.own[o].worker
                if (w < self.nworkers and self.wgroup[w] == g and nc < s.W
                        and not self.wmute[w]):
                    s.cand[nc] = w
                    nc += 1
                o = L.own[o].next
            if nc == 0:
                continue
            lower_walk_multi(L, hc, start, last, s.cand, nc, s.idx, s.W, s.oend, s.olast)
            for k in range(nc):
                if s.oend[k] > start:
                    if _bp_add(s, g, s.oend[k], s.olast[k]) < 0:
                        return -1
                    if s.oend[k] > ends[g]:
                        ends[g] = <uint32_t>s.oend[k]
        return 0

    cdef int _query_c(self, HCursor* hc, Scratch* s) noexcept nogil:
        cdef size_t k, nh, ncpu_from
        cdef uint32_t w, g
        cdef size_t G = self.ngroups
        cdef uint32_t* npu = s.ends
        cdef uint32_t* cpu = s.ends + G
        cdef uint32_t* dsk = s.ends + 2 * G
        nh = tree_match(&self.tree, hc, s.hw, s.hd, s.hs, s.stamp)
        for k in range(nh):
            w = s.hw[k]
            if w >= self.nworkers or self.wmute[w]:
                continue
            g = self.wgroup[w]
            if _bp_add(s, g, s.hd[k], s.hs[w]) < 0:
                return -1
            if s.hd[k] > npu[g]:
                npu[g] = s.hd[k]
        ncpu_from = s.nbp
        if self._tier_walk(0, hc, s, ncpu_from, cpu) < 0:
            return -1
        # Disk continues from every HBM and CPU breakpoint of the same group.
        if self._tier_walk(1, hc, s, s.nbp, dsk) < 0:
            return -1
        return 0

    cdef list _run_query(self, HCursor* hc):
        cdef Scratch s
        cdef int rc = 0
        cdef size_t W, G, g
        cdef uint32_t n_, c_, d_, top
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            W = _max(_max(self.nworkers, self.tree.nrev),
                     _max(self.tiers[0].nrev, self.tiers[1].nrev))
            G = self.ngroups
            rc = _scratch_init(&s, W, G)
            if rc == 0:
                rc = self._query_c(hc, &s)
            pthread_rwlock_unlock(&self.lock)
        try:
            if rc < 0:
                raise MemoryError()
            out = []
            for g in range(G):
                n_ = s.ends[g]
                c_ = s.ends[G + g]
                d_ = s.ends[2 * G + g]
                if n_ or c_ or d_:
                    top = n_ if n_ > c_ else c_
                    out.append((g, n_, c_ - n_ if c_ > n_ else 0, d_ - top if d_ > top else 0))
            return out
        finally:
            _scratch_free(&s)

    def match(self, local_hashes):
        """``[(group, npu, cpu, disk)]`` exclusive block counts for LocalBlockHashes."""
        cdef const uint64_t[::1] lv = as_u64(local_hashes)
        cdef size_t n = lv.shape[0]
        cdef HCursor hc
        if n == 0:
            return []
        hc_init_hashes(&hc, &lv[0], n)
        return self._run_query(&hc)

    def match_tokens(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`match`, hashing ``tokens`` lazily in C during the walk."""
        cdef const uint32_t[::1] tv = to_u32_tokens(tokens)
        cdef size_t ntok = tv.shape[0]
        cdef HCursor hc
        if ntok == 0 or block_size == 0:
            return []
        if hc_init_tokens(&hc, &tv[0], ntok, block_size, seed) < 0:
            raise MemoryError()
        try:
            return self._run_query(&hc)
        finally:
            hc_free(&hc)

    # -- invariants -----------------------------------------------------------------------
    cdef int _check_c(self, char* msg, size_t cap, uint8_t* rfree, uint8_t* wfree) noexcept nogil:
        """The two-phase state and the worker table (the tiers are checked by the caller)."""
        cdef long nr, nw
        cdef size_t i, k, waits = 0
        cdef uint32_t r, c, d
        cdef U64Map* m
        nr = pool_mark_free(&self.rec_pool, self.recs, sizeof(TPRec), rfree)
        nw = pool_mark_free(&self.wait_pool, self.waits, sizeof(TPWait), wfree)
        if nr < 0 or nw < 0:
            snprintf(msg, cap, "record or waiter free list broken")
            return -1
        if (u64m_check(&self.offload_m) < 0 or u64m_check(&self.content_m) < 0
                or u64m_check(&self.pending_m) < 0):
            snprintf(msg, cap, "offload, content or pending map corrupt")
            return -1
        # offload and content: disjoint keys, each value its own live record
        for k in range(2):
            m = &self.offload_m if k == 0 else &self.content_m
            for i in range(m.mask + 1 if m.keys != NULL else 0):
                r = m.vals[i]
                if r == HM_NIL:
                    continue
                if r >= self.rec_pool.used or rfree[r] != 0:
                    snprintf(msg, cap, "%s entry %llu has record %llu that is free, out of "
                             "range or shared", "offload" if k == 0 else "content",
                             <ull>m.keys[i], <ull>r)
                    return -1
                rfree[r] = 2
                if r != HM_NIL and k == 0 and u64m_get(&self.content_m, m.keys[i]) != HM_NIL:
                    snprintf(msg, cap, "hash %llu in offload and content", <ull>m.keys[i])
                    return -1
        if self.offload_m.size + self.content_m.size + <size_t>nr != self.rec_pool.used:
            snprintf(msg, cap, "records: %llu offload + %llu content + %llu free != %llu",
                     <ull>self.offload_m.size, <ull>self.content_m.size, <ull>nr,
                     <ull>self.rec_pool.used)
            return -1
        # pending: non-empty chains of live waiters, one per worker and hash
        m = &self.pending_m
        for i in range(m.mask + 1 if m.keys != NULL else 0):
            c = m.vals[i]
            if c == HM_NIL:
                continue
            while c != HM_NIL:
                if c >= self.wait_pool.used or wfree[c] != 0:
                    snprintf(msg, cap, "pending hash %llu lists waiter %llu that is free, out "
                             "of range or on another list", <ull>m.keys[i], <ull>c)
                    return -1
                wfree[c] = 2
                waits += 1
                d = self.waits[c].next
                while d != HM_NIL and d < self.wait_pool.used and wfree[d] == 0:
                    if self.waits[d].worker == self.waits[c].worker:
                        snprintf(msg, cap, "worker %llu waits twice for hash %llu",
                                 <ull>self.waits[c].worker, <ull>m.keys[i])
                        return -1
                    d = self.waits[d].next
                c = self.waits[c].next
        if waits != self.npending or waits + <size_t>nw != self.wait_pool.used:
            snprintf(msg, cap, "npending %llu, recount %llu, free %llu, high-water %llu",
                     <ull>self.npending, <ull>waits, <ull>nw, <ull>self.wait_pool.used)
            return -1
        if self.nworkers > self.wcap:
            snprintf(msg, cap, "nworkers %llu > allocated %llu", <ull>self.nworkers,
                     <ull>self.wcap)
            return -1
        for i in range(self.nworkers):
            if self.wgroup[i] != HM_NIL and (self.wgroup[i] >= self.ngroups or self.wtier[i] > 2):
                snprintf(msg, cap, "worker %llu: group %llu of %llu or tier %llu out of range",
                         <ull>i, <ull>self.wgroup[i], <ull>self.ngroups, <ull>self.wtier[i])
                return -1
        return 0

    def check_invariants(self):
        """Walk the C structures under the read lock (HBM tree, both tiers, two-phase
        state); ``AssertionError`` naming the first broken invariant."""
        cdef char msg[256]
        cdef char sub[200]
        cdef int rc
        cdef uint8_t* rfree = NULL
        cdef uint8_t* wfree = NULL
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            rc = tree_check(&self.tree, sub, sizeof(sub))
            if rc == -1:
                snprintf(msg, sizeof(msg), "HBM tree: %s", sub)
            if rc == 0:
                rc = lower_check(&self.tiers[0], sub, sizeof(sub))
                if rc == -1:
                    snprintf(msg, sizeof(msg), "CPU tier: %s", sub)
            if rc == 0:
                rc = lower_check(&self.tiers[1], sub, sizeof(sub))
                if rc == -1:
                    snprintf(msg, sizeof(msg), "Disk tier: %s", sub)
            if rc == 0:
                rfree = <uint8_t*>malloc(self.rec_pool.used + 1)
                wfree = <uint8_t*>malloc(self.wait_pool.used + 1)
                rc = -2 if rfree == NULL or wfree == NULL else self._check_c(
                    msg, sizeof(msg), rfree, wfree)
                free(rfree)
                free(wfree)
            pthread_rwlock_unlock(&self.lock)
        check_raise(rc, msg)

    def _corrupt_for_test(self, str kind):
        """TEST ONLY: break one invariant on purpose so a test can see ``check_invariants``
        fail (the object stays safe to free, not to use). Kinds: ``npending``,
        ``record_freed`` (needs an offload entry), ``hbm_pairs``, ``cpu_total``."""
        cdef size_t i
        if kind == "npending":
            self.npending += 1
        elif kind == "record_freed":
            for i in range(self.offload_m.mask + 1 if self.offload_m.keys != NULL else 0):
                if self.offload_m.vals[i] != HM_NIL:
                    pool_give(&self.rec_pool, self.recs, self.offload_m.vals[i], sizeof(TPRec))
                    return
            raise ValueError("needs an offload entry")
        elif kind == "hbm_pairs":
            self.tree.npairs += 1
        elif kind == "cpu_total":
            self.tiers[0].total += 1
        else:
            raise ValueError(kind)

    # -- introspection -----------------------------------------------------------------------------
    def worker_blocks(self, uint32_t worker):
        """Blocks ``worker`` holds on its tier."""
        cdef size_t n = 0
        cdef int tier
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            if worker < self.nworkers:
                tier = self.wtier[worker]
                if tier == 0:
                    n = tree_worker_blocks(&self.tree, worker)
                else:
                    n = lower_worker_blocks(&self.tiers[tier - 1], worker)
            pthread_rwlock_unlock(&self.lock)
        return n

    def worker_hashes(self, uint32_t worker):
        """The engine hashes ``worker`` holds on its tier, as ``array('Q')`` (any order)."""
        cdef const U64Map* rev = NULL
        cdef size_t i, k = 0, n = 0
        cdef uint64_t* o
        cdef int tier
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
        try:
            if worker < self.nworkers:
                tier = self.wtier[worker]
                if tier == 0:
                    if worker < self.tree.nrev:
                        rev = &self.tree.rev[worker]
                elif worker < self.tiers[tier - 1].nrev:
                    rev = &self.tiers[tier - 1].rev[worker]
            if rev != NULL:
                n = rev.size
            out = _array.array("Q", bytes(8 * n))
            if n:
                o = <uint64_t*>(<array.array>out).data.as_ulonglongs
                for i in range(rev.mask + 1):
                    if rev.vals[i] != HM_NIL:
                        o[k] = rev.keys[i]
                        k += 1
            return out
        finally:
            pthread_rwlock_unlock(&self.lock)

    def parent_of(self, uint32_t worker, uint64_t h):
        """The engine hash of the parent of ``worker``'s block ``h`` on its tier.

        ``None`` for a root block, or (HBM) when the worker no longer holds the
        parent block. Raises ``KeyError`` when ``worker`` does not hold ``h``.
        """
        cdef uint32_t node = HM_NIL, p, m
        cdef bint found = False, has_parent = False
        cdef uint64_t parent = 0
        cdef int tier = -1
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            if worker < self.nworkers:
                tier = self.wtier[worker]
            if tier == 0 and worker < self.tree.nrev:
                node = u64m_get(&self.tree.rev[worker], h)
                if node != HM_NIL:
                    found = True
                    p = self.tree.nodes[node].parent
                    if p != 0 and p != HM_NIL:
                        m = self.tree.nodes[p].members
                        while m != HM_NIL:
                            if self.tree.mem[m].worker == worker:
                                has_parent = True
                                parent = self.tree.mem[m].ehash
                                break
                            m = self.tree.mem[m].next
            elif tier > 0 and worker < self.tiers[tier - 1].nrev:
                node = u64m_get(&self.tiers[tier - 1].rev[worker], h)
                if node != HM_NIL:
                    found = True
                    has_parent = self.tiers[tier - 1].edges[node].has_parent == 1
                    parent = self.tiers[tier - 1].edges[node].parent
            pthread_rwlock_unlock(&self.lock)
        if not found:
            raise KeyError(h)
        return parent if has_parent else None

    def stats(self):
        """Sizes: nodes, hbm_pairs, cpu_blocks, disk_blocks, offload, content, pending, nbytes."""
        cdef size_t nodes, pairs, cpu, disk, off, con, pen, nb
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            nodes = self.tree.live_nodes
            pairs = self.tree.npairs
            cpu = self.tiers[0].total
            disk = self.tiers[1].total
            off = self.offload_m.size
            con = self.content_m.size
            pen = self.npending
            nb = (tree_nbytes(&self.tree) + lower_nbytes(&self.tiers[0])
                  + lower_nbytes(&self.tiers[1]) + u64m_nbytes(&self.offload_m)
                  + u64m_nbytes(&self.content_m) + u64m_nbytes(&self.pending_m)
                  + self.rec_pool.cap * sizeof(TPRec) + self.wait_pool.cap * sizeof(TPWait)
                  + self.wcap * (sizeof(uint32_t) + 2 * sizeof(uint8_t)))
            pthread_rwlock_unlock(&self.lock)
        return {"nodes": nodes, "hbm_pairs": pairs, "cpu_blocks": cpu, "disk_blocks": disk,
                "offload": off, "content": con, "pending": pen, "nbytes": nb}

    # -- explain (appended) ---------------------------------------------------------------
    cdef bint _holds_local(self, int tier, uint32_t w, uint64_t local) noexcept nogil:
        """Does ``w`` hold, on its tier, any block whose LocalBlockHash is ``local``?
        O(blocks of ``w``): diagnostics only."""
        cdef const U64Map* rev
        cdef size_t i
        cdef const Lower* L
        if tier == 0:
            if w >= self.tree.nrev:
                return False
            rev = &self.tree.rev[w]
            if rev.size == 0:
                return False
            for i in range(rev.mask + 1):
                if rev.vals[i] != HM_NIL and self.tree.nodes[rev.vals[i]].local == local:
                    return True
            return False
        L = &self.tiers[tier - 1]
        if w >= L.nrev:
            return False
        rev = &L.rev[w]
        if rev.size == 0:
            return False
        for i in range(rev.mask + 1):
            if rev.vals[i] != HM_NIL and L.edges[rev.vals[i]].local == local:
                return True
        return False

    cdef size_t _walk1(self, int tier, uint32_t w, HCursor* hc, size_t pos, bint* hp,
                       uint64_t* p) noexcept nogil:
        """One worker's lower-tier walk from (pos, parent ``p`` when ``hp``, else the
        root); returns where it stops, with ``hp``/``p`` the last block walked."""
        cdef const Lower* L = &self.tiers[tier - 1]
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
        cdef const Lower* L = &self.tiers[tier - 1]
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
        nh = tree_match(&self.tree, hc, s.hw, s.hd, s.hs, s.stamp)
        for k in range(self.nworkers):
            reach[k] = 0
        for k in range(nh):
            w = s.hw[k]
            if w >= self.nworkers or self.wmute[w]:
                continue
            if _bp_add(s, self.wgroup[w], s.hd[k], s.hs[w]) < 0:
                return -1
            reach[w] = s.hd[k]
        nb0 = s.nbp
        if self._tier_walk(0, hc, s, nb0, s.ends + self.ngroups) < 0:
            return -1
        nb1 = s.nbp
        # the tree path of the query: path[k] is the node after k blocks
        path[0] = T_ROOT
        plen = 1
        while plen <= n:
            c = em_get(&self.tree.edges, path[plen - 1], hc_get(hc, plen - 1))
            if c == HM_NIL:
                break
            path[plen] = c
            plen += 1
        for k in range(self.nworkers):
            w = <uint32_t>k
            g = self.wgroup[w]
            if g == HM_NIL:
                continue
            t = self.wtier[w]
            if self.wmute[w]:
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
                elif d + 1 < plen and self.tree.nodes[path[d + 1]].nmembers > 0:
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
        cdef Scratch s
        cdef int rc = 0
        cdef size_t W, G, k, nw = 0
        cdef size_t* reach = NULL
        cdef uint8_t* code = NULL
        cdef uint32_t* path = NULL
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
            W = _max(_max(self.nworkers, self.tree.nrev),
                     _max(self.tiers[0].nrev, self.tiers[1].nrev))
            G = self.ngroups
            nw = self.nworkers
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
                    if self.wgroup[k] == HM_NIL:
                        code[k] = 0xFF
            pthread_rwlock_unlock(&self.lock)
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
        cdef uint32_t* pos = NULL
        cdef uint32_t* stack = NULL
        cdef size_t nn, nm, used
        cdef int rc = 0
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
        try:
            nn = self.tree.live_nodes
            nm = self.tree.npairs
            used = self.tree.node_pool.used
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
                    &self.tree, pos, stack,
                    <uint32_t*>(<array.array>parents).data.as_uints,
                    <uint64_t*>(<array.array>locs).data.as_ulonglongs,
                    <uint32_t*>(<array.array>mnode).data.as_uints,
                    <uint32_t*>(<array.array>mworker).data.as_uints,
                    <uint64_t*>(<array.array>mehash).data.as_ulonglongs)
        finally:
            pthread_rwlock_unlock(&self.lock)
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
        if <size_t>lv.shape[0] != nn or <size_t>wv.shape[0] != nm or <size_t>ev.shape[0] != nm:
            raise ValueError("HBM table: column lengths differ")
        for i in range(nm):
            if wv[i] >= self.nworkers or self.wgroup[wv[i]] == HM_NIL or self.wtier[wv[i]] != 0:
                raise ValueError(f"HBM table: worker {wv[i]} is unknown or not an HBM worker")
        if nn == 0 and nm == 0:
            return 0
        rows = <uint32_t*>malloc(nn * sizeof(uint32_t) + 1)
        if rows == NULL:
            raise MemoryError()
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            rc = tree_restore(&self.tree, &pv[0] if nn else NULL, &lv[0] if nn else NULL, nn,
                              &nv[0] if nm else NULL, &wv[0] if nm else NULL,
                              &ev[0] if nm else NULL, nm, rows)
            pthread_rwlock_unlock(&self.lock)
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
        cdef Lower* L
        cdef size_t n, k = 0, i
        cdef uint32_t e, o
        cdef int bad = 0
        cdef uint32_t* ow
        cdef uint64_t* oe
        cdef uint64_t* ol
        cdef uint64_t* op
        cdef uint8_t* oh
        if tier != 1 and tier != 2:
            raise ValueError(f"tier must be 1 or 2, not {tier}")
        L = &self.tiers[tier - 1]
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
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
                        o = L.edges[e].owners
                        while o != HM_NIL:
                            if k >= n:
                                bad = 1
                                break
                            ow[k] = L.own[o].worker
                            oe[k] = L.edges[e].child
                            ol[k] = L.edges[e].local
                            op[k] = 0
                            oh[k] = 0
                            k += 1
                            o = L.own[o].next
                        e = L.edges[e].next_root
                for i in range(L.edge_pool.used):
                    if L.edges[i].has_parent != 1 or bad:
                        continue
                    o = L.edges[i].owners
                    while o != HM_NIL:
                        if k >= n:
                            bad = 1
                            break
                        ow[k] = L.own[o].worker
                        oe[k] = L.edges[i].child
                        ol[k] = L.edges[i].local
                        op[k] = L.edges[i].parent
                        oh[k] = 1
                        k += 1
                        o = L.own[o].next
        finally:
            pthread_rwlock_unlock(&self.lock)
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
        if tier != 1 and tier != 2:
            raise ValueError(f"tier must be 1 or 2, not {tier}")
        if (<size_t>ev.shape[0] != n or <size_t>lv.shape[0] != n or <size_t>pv.shape[0] != n
                or <size_t>hv.shape[0] != n):
            raise ValueError("tier table: column lengths differ")
        for i in range(n):
            if wv[i] >= self.nworkers or self.wgroup[wv[i]] == HM_NIL or self.wtier[wv[i]] != tier:
                raise ValueError(f"tier table: worker {wv[i]} is unknown or not of tier {tier}")
        L = &self.tiers[tier - 1]
        i = 0
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
            while i < n:
                rc = lower_store(L, wv[i], hv[i] != 0, pv[i], &ev[i], &lv[i], 1)
                if rc != 1:
                    break
                i += 1
            pthread_rwlock_unlock(&self.lock)
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
        cdef size_t i
        cdef int k
        cdef uint32_t r, c
        cdef U64Map* m
        records = []
        waits = []
        with nogil:
            pthread_rwlock_rdlock(&self.lock)
        try:
            for k in range(2):
                m = &self.offload_m if k == 0 else &self.content_m
                for i in range(m.mask + 1 if m.keys != NULL else 0):
                    r = m.vals[i]
                    if r == HM_NIL:
                        continue
                    records.append((k, m.keys[i], self.recs[r].local,
                                    self.recs[r].parent if self.recs[r].has_parent else None,
                                    self.recs[r].t))
            m = &self.pending_m
            for i in range(m.mask + 1 if m.keys != NULL else 0):
                c = m.vals[i]
                while c != HM_NIL:
                    waits.append((m.keys[i], self.waits[c].worker, self.waits[c].t))
                    c = self.waits[c].next
        finally:
            pthread_rwlock_unlock(&self.lock)
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
        recs = [(int(k), int(h_), int(l_), p_, float(t_)) for k, h_, l_, p_, t_ in records]
        ws = [(int(h_), int(w_), float(t_)) for h_, w_, t_ in waits]
        for rec in recs:
            if rec[0] != 0 and rec[0] != 1:
                raise ValueError(f"two-phase record of kind {rec[0]}")
        for wait in ws:
            worker = wait[1]
            if worker >= self.nworkers or self.wgroup[worker] == HM_NIL:
                raise ValueError(f"pending wait of unknown worker {worker}")
        with nogil:
            pthread_rwlock_wrlock(&self.lock)
        try:
            for kind, h, local, p_, t in recs:
                hp = p_ is not None
                parent = p_ if hp else 0
                if (u64m_get(&self.offload_m, h) != HM_NIL
                        or u64m_get(&self.content_m, h) != HM_NIL):
                    raise ValueError(f"two-phase record for hash {h} given twice")
                if self._put_rec(&self.offload_m if kind == 0 else &self.content_m, h, local,
                                 hp, parent, t) < 0:
                    raise MemoryError()
            # each hash's waiters come newest first: push them oldest first
            for h, worker, t in reversed(ws):
                head = u64m_get(&self.pending_m, h)
                cur = head
                while cur != HM_NIL and self.waits[cur].worker != worker:
                    cur = self.waits[cur].next
                if cur != HM_NIL:
                    raise ValueError(f"worker {worker} waits twice for hash {h}")
                cur = self._new_wait(worker, t)
                if cur == HM_NIL:
                    raise MemoryError()
                self.waits[cur].next = head
                if u64m_put(&self.pending_m, h, cur) < 0:
                    pool_give(&self.wait_pool, self.waits, cur, sizeof(TPWait))
                    raise MemoryError()
                self.npending += 1
        finally:
            pthread_rwlock_unlock(&self.lock)


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
