# cython: language_level=3
"""CoreIndex: the whole index of one (model, tenant) in C.

Holds the HBM tree, the CPU and Disk tiers and the two-phase offload/pool
state, and answers tiered queries (hashing, HBM match and both lower-tier walks)
in one ``nogil`` pass under a read lock. Semantics: ``docs/design.md``.

One extension, one file per job (as uvloop's ``loop.pyx`` includes its handles):
this file holds the state's lifecycle, the locks and the class's Python methods, which
call the functions of the included files (Cython allows no ``include`` inside a class
body, so those take the ``CoreIndex`` as their first argument): ``_index_write.pxi``
(workers, direct mutations, the ingest batch), ``_index_twophase.pxi`` (offload, pool
confirmations, eviction, sweep), ``_index_query.pxi`` (scratch, answers, the tiered
query), ``_index_answers.pxi`` (an answer as Python objects, built in C),
``_index_inspect.pxi`` (checker, introspection, stats), ``_index_trace.pxi``
(explain), ``_index_io.pxi`` (dump and restore), ``_index_shared.pxi`` (``--workers N``).
"""
from cpython cimport array
from cpython.buffer cimport PyBuffer_Release
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdio cimport snprintf
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from kvconductor._cursor cimport HCursor, hc_free, hc_get, hc_init_hashes, hc_init_tokens
from kvconductor._maps cimport (
    FpMap, U64Map, u64m_check, u64m_free, u64m_get, u64m_init, u64m_nbytes, u64m_pop,
    u64m_put,
)
from kvconductor._pool cimport (
    HM_NIL, grow_array, live_allocations, mem_alloc, mem_free, pool_give, pool_init,
    pool_mark_free, pool_take,
)
from kvconductor._alloc cimport alloc_arena_leaked, alloc_arena_writing
from kvconductor._rwlock cimport (
    pthread_rwlock_destroy, pthread_rwlock_rdlock, pthread_rwlock_tryrdlock,
    pthread_rwlock_trywrlock, pthread_rwlock_unlock, pthread_rwlock_wrlock,
    rwlock_init,
)
from kvconductor._hash cimport hash_token_blocks, u64_view
from kvconductor._arena cimport Arena
from kvconductor._shlock cimport (
    SHL_EBUSY, SHL_OK, SharedLock, shl_read_enter, shl_read_exit, shl_write_enter,
    shl_write_exit,
)
from posix.unistd cimport usleep
from kvconductor._lower cimport (
    Lower, lower_check, lower_clear, lower_find, lower_free, lower_holds_local, lower_init,
    lower_lookup, lower_nbytes, lower_owner_first, lower_owner_next, lower_remove,
    lower_rev_get, lower_store, lower_walk_multi, lower_walk_one, lower_worker_blocks,
)
from kvconductor._tree cimport (
    T_ERR_OOM, check_raise, check_rc, tree_check, tree_clear, tree_free, tree_held,
    tree_holds_local, tree_init, tree_match, tree_match_scratch, tree_member_ehash, tree_nbytes,
    tree_path, tree_remove, tree_rev_get, tree_store, tree_worker_blocks, TL_N, layout_dict,
    tree_layout,
)
from kvconductor._tree cimport T_ROOT, tree_child, tree_export, tree_restore
from kvconductor._tree cimport TreeMatch, tree_match_resume, tree_match_start, tree_match_valid

import array as _array
from operator import index as _index_int

from kvconductor import _alloc

from kvconductor._hash import as_u64, to_u32_tokens

ctypedef unsigned long long ull


class IndexClosedError(ValueError):
    """The index was closed (:meth:`CoreIndex.close`)."""


class StaleIndexError(RuntimeError):
    """An attached handle's directory generation is no longer the arena's: the owner
    published a new directory (an index was created or dropped, a group added), so the
    caller reloads it and asks again."""


cdef object _ATTACH = object()

cdef uint64_t CORE_MAGIC = 0x6b76636f72653031ULL     # "kvcore01"

cdef extern from "kvconductor/c/index.h":
    uint64_t kvc_load_u64(const uint64_t* p) noexcept nogil
    uint32_t kvc_load_u32(const uint32_t* p) noexcept nogil
    void kvc_count_yield(int restart) noexcept nogil
    uint64_t kvc_query_count(int restart) noexcept nogil
    void* kvc_scratch_get() noexcept nogil
    int kvc_scratch_set(void* p) noexcept nogil

cdef extern from "kvconductor/c/bits.h":
    unsigned ctz64 "kvc_ctz64"(uint64_t x) noexcept nogil


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


# -- the lock kinds (CoreLock: chosen once, at construction) ---------------------------------
cdef int _local_rlock(CoreLock* lk, CoreState** st, int slot) noexcept nogil:
    pthread_rwlock_rdlock(&lk.rw)
    if st[0] == NULL:
        pthread_rwlock_unlock(&lk.rw)
        return CORE_CLOSED
    return 0


cdef void _local_runlock(CoreLock* lk, int slot) noexcept nogil:
    pthread_rwlock_unlock(&lk.rw)


cdef void _local_wlock(CoreLock* lk) noexcept nogil:
    pthread_rwlock_wrlock(&lk.rw)


cdef void _local_wunlock(CoreLock* lk) noexcept nogil:
    pthread_rwlock_unlock(&lk.rw)


cdef void _shared_wlock(CoreLock* lk) noexcept nogil:
    pthread_rwlock_wrlock(&lk.rw)
    _xwrite_enter(lk.xl)


cdef void _shared_wunlock(CoreLock* lk) noexcept nogil:
    _xwrite_exit(lk.xl)
    pthread_rwlock_unlock(&lk.rw)


cdef int _attached_rlock(CoreLock* lk, CoreState** st, int slot) noexcept nogil:
    if shl_read_enter(lk.xl, slot) != SHL_OK:
        return CORE_CLOSED
    if kvc_load_u64(lk.gen) != lk.gen_seen or st[0].magic != CORE_MAGIC:
        shl_read_exit(lk.xl, slot)
        return CORE_STALE
    return 0


cdef void _attached_runlock(CoreLock* lk, int slot) noexcept nogil:
    shl_read_exit(lk.xl, slot)


cdef void _lock_local(CoreLock* lk) noexcept nogil:
    """This process's threads only: the rwlock."""
    lk.rlock = _local_rlock
    lk.runlock = _local_runlock
    lk.wlock = _local_wlock
    lk.wunlock = _local_wunlock


cdef void _lock_shared(CoreLock* lk, ShLock* xl) noexcept nogil:
    """The owner's state in the arena: its readers take the rwlock, its writer (the
    writer thread) also the cross-process write side, so workers never see a write half
    done."""
    _lock_local(lk)
    lk.xl = xl
    lk.wlock = _shared_wlock
    lk.wunlock = _shared_wunlock


cdef void _lock_attached(CoreLock* lk, ShLock* xl, const uint64_t* gen,
                         uint64_t gen_seen) noexcept nogil:
    """A worker's read-only handle: the cross-process read side, and the directory
    generation checked in every read section (writes are refused before any lock)."""
    lk.xl = xl
    lk.gen = gen
    lk.gen_seen = gen_seen
    lk.rlock = _attached_rlock
    lk.runlock = _attached_runlock


# The section helpers every method uses: one indirect call, no branch on the kind.
cdef inline int _rlock(CoreIndex c, int slot) noexcept nogil:
    return c.lk.rlock(&c.lk, &c.st, slot)


cdef inline void _runlock(CoreIndex c, int slot) noexcept nogil:
    c.lk.runlock(&c.lk, slot)


cdef inline void _wlock(CoreIndex c) noexcept nogil:
    c.lk.wlock(&c.lk)


cdef inline void _wunlock(CoreIndex c) noexcept nogil:
    c.lk.wunlock(&c.lk)


cdef class CoreIndex:
    """Index core of one (model, tenant); worker and group ids are small ints.

    **Threading: exactly one writer thread calls set_worker/store/store_tokens/
    remove/clear/offload/pool_store/evict/sweep; any number of threads may call
    match/match_tokens/stats/worker_blocks concurrently. Every method holds one C
    reader/writer lock for its whole duration (writers exclusive, writer
    preferred) and runs its C part without the GIL. Exception: a short query or
    ingest batch keeps the GIL, and then only try-locks (never waits for the lock with
    the GIL held: it releases the GIL and waits like the others when the lock is
    taken).** A query's scratch is its
    thread's own (one block per reader thread, shared by every index it queries,
    freed when the thread exits): readers share nothing but the index.

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
        self.xlock = None
        self.lk.xl = NULL
        self.lk.gen = NULL
        self.lk.gen_seen = 0
        _lock_local(&self.lk)
        if rwlock_init(&self.lk.rw) != 0:
            raise MemoryError("cannot initialise rwlock")
        self.lock_ok = True
        if _attach is _ATTACH:
            return              # attach_core fills in the rest
        if _shared_lock is not None:
            if not alloc_arena_writing():
                raise RuntimeError(
                    "shared mode: a CoreIndex is created on the writer thread only")
            self.shared = True
            self.xlock = _shared_lock
            _lock_shared(&self.lk, (<SharedLock>_shared_lock).lock)
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
            pthread_rwlock_destroy(&self.lk.rw)
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
            _wlock(self)
            st = self.st
            st.magic = 0
            self.st = NULL
            _state_free(st)
            mem_free(st)
            _wunlock(self)

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
        if self.shared and not alloc_arena_writing():
            raise RuntimeError("shared mode: only the writer thread mutates the index")
        return 0

    cdef int _slot(self) except -2:
        return (<SharedLock>self.xlock)._slot()

    cdef int _reader(self) except -2:
        """This thread's reader slot of the shared lock (attached handles), else -1."""
        if self.attached:
            return self._slot()
        return -1

    cdef int _stale(self, int code) except -1:
        if code == CORE_STALE:
            raise StaleIndexError("the shared directory changed: reload it")
        raise IndexClosedError("index closed")

    # -- workers ----------------------------------------------------------------------------
    def set_worker(self, uint32_t worker, uint32_t group, int tier):
        """Declare ``worker``'s (instance, DP) group and tier (0 HBM, 1 CPU, 2 Disk)."""
        return _set_worker(self, worker, group, tier)

    def set_muted(self, uint32_t worker, bint muted):
        """Mute (or unmute) ``worker``: a muted worker keeps its blocks and takes every
        update as usual, but contributes no hits (and no breakpoint for a lower tier to
        continue from) to :meth:`match`/:meth:`match_tokens`. A source down too long
        (``docs/operations.md``, "Dead engines") mutes its HBM workers."""
        return _set_muted(self, worker, muted)

    def is_muted(self, uint32_t worker):
        """Whether ``worker`` is muted (:meth:`set_muted`)."""
        return _is_muted(self, worker)

    cdef int _tier(self, uint32_t worker) except -1:
        if self.st == NULL or self.attached:
            self._writable()
        if worker >= self.st.nworkers or self.st.wgroup[worker] == HM_NIL:
            raise KeyError(f"unknown worker id {worker}: call set_worker first")
        return self.st.wtier[worker]

    # -- direct mutations ---------------------------------------------------------------------
    def store(self, uint32_t worker, parent, engine_hashes, local_hashes):
        """Store a chain on ``worker``'s tier; returns blocks stored."""
        return _store(self, worker, parent, engine_hashes, local_hashes)

    def store_tokens(self, uint32_t worker, parent, engine_hashes, tokens, size_t block_size,
                     uint64_t seed=1337):
        """Hash ``tokens`` in C (``block_size`` per block) and store like :meth:`store`."""
        return _store_tokens(self, worker, parent, engine_hashes, tokens, block_size, seed)

    def remove(self, uint32_t worker, engine_hashes):
        """Remove blocks of ``worker`` directly; returns how many it held."""
        return _remove(self, worker, engine_hashes)

    def clear(self, uint32_t worker):
        """Drop every block of ``worker`` and its pending waits; returns blocks removed."""
        return _clear(self, worker)

    cdef void _apply_ops(self, BatchOp* ops, size_t n, const uint32_t* clear,
                         size_t nclear) noexcept nogil:
        """The ingest fast path's batch under one write lock (``_apply_batch``)."""
        _apply_batch(self, ops, n, clear, nclear)

    cdef bint _try_apply_ops(self, BatchOp* ops, size_t n, const uint32_t* clear,
                             size_t nclear) noexcept nogil:
        """``_apply_ops`` if the write lock is free this instant (this process's lock
        only, not the shared kind), else nothing and False: never waits, so a caller
        holding the GIL cannot deadlock with a reader that needs the GIL inside its read
        section."""
        return _try_apply_batch(self, ops, n, clear, nclear)

    # -- two-phase records ---------------------------------------------------------------------
    # -- two-phase operations ------------------------------------------------------------------
    def offload(self, engine_hashes, local_hashes, parent, double now):
        """Phase 1 (engine offload to CPU/Disk); returns (worker, block) stores applied."""
        return _offload(self, engine_hashes, local_hashes, parent, now)

    def pool_store(self, uint32_t worker, engine_hashes, double now):
        """Phase 2 (pool confirms blocks for ``worker``); returns (applied, queued)."""
        return _pool_store(self, worker, engine_hashes, now)

    def evict(self, uint32_t worker, engine_hashes):
        """Removal with the two-phase rule; returns index removals performed."""
        return _evict(self, worker, engine_hashes)

    def sweep(self, double now, double pending_ttl, double content_ttl, double offload_ttl):
        """Expire two-phase entries by age (>= TTL); returns entries removed."""
        return _sweep(self, now, pending_ttl, content_ttl, offload_ttl)

    # -- query ----------------------------------------------------------------------------
    def match_rows(self, local_hashes):
        """The answer for LocalBlockHashes as :class:`MatchRows` (``match`` as a list)."""
        return _match_rows(self, local_hashes)

    def match_tokens_rows(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`match_rows`, hashing ``tokens`` lazily in C during the walk."""
        return _match_tokens_rows(self, tokens, block_size, seed)

    def match(self, local_hashes):
        """``[(group, npu, cpu, disk)]`` exclusive block counts for LocalBlockHashes."""
        return _match(self, local_hashes)

    def match_tokens(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`match`, hashing ``tokens`` lazily in C during the walk."""
        return _match_tokens(self, tokens, block_size, seed)

    # -- invariants -----------------------------------------------------------------------
    def check_invariants(self):
        """Walk the C structures under the read lock (HBM tree, both tiers, two-phase
        state); ``AssertionError`` naming the first broken invariant."""
        return _check_invariants(self)

    def _corrupt_for_test(self, str kind):
        """TEST ONLY: break one invariant on purpose so a test can see ``check_invariants``
        fail (the object stays safe to free, not to use). Kinds: ``npending``,
        ``record_freed`` (needs an offload entry), ``hbm_pairs``, ``cpu_total``."""
        return _corrupt_impl(self, kind)

    # -- introspection -----------------------------------------------------------------------------
    def worker_blocks(self, uint32_t worker):
        """Blocks ``worker`` holds on its tier."""
        return _worker_blocks(self, worker)

    def worker_hashes(self, uint32_t worker):
        """The engine hashes ``worker`` holds on its tier, as ``array('Q')`` (any order)."""
        return _worker_hashes(self, worker)

    def parent_of(self, uint32_t worker, uint64_t h):
        """The engine hash of the parent of ``worker``'s block ``h`` on its tier.

        ``None`` for a root block, or (HBM) when the worker no longer holds the
        parent block. Raises ``KeyError`` when ``worker`` does not hold ``h``.
        """
        return _parent_of(self, worker, h)

    def hbm_reach(self, uint32_t worker, local_hashes):
        """How many leading blocks of ``local_hashes`` the HBM ``worker`` holds on the tree's
        path (its ``match`` depth, muting aside; 0 for a worker of another tier)."""
        return _hbm_reach(self, worker, local_hashes)

    def block_of(self, uint32_t worker, uint64_t h):
        """``(parent, local)`` of ``worker``'s block ``h`` on its tier: :meth:`parent_of`'s
        parent and the block's local hash (what a tier needs to hold the same block).
        Raises ``KeyError`` when ``worker`` does not hold ``h``."""
        return _block_of(self, worker, h)

    def hbm_layout(self):
        """Where the HBM tree's bytes go (``RadixTree.layout``): struct sizes, array
        high-water marks, table slots, bytes touched and allocated."""
        return _hbm_layout(self)

    def stats(self):
        """Sizes: nodes, hbm_pairs, cpu_blocks, disk_blocks, offload, content, pending, nbytes."""
        return _stats(self)

    # -- explain (appended) ---------------------------------------------------------------
    def trace(self, local_hashes):
        """``[(worker, reach, stop)]`` for every declared worker, by worker id: how far
        the query's walk on the worker's tier reaches (absolute blocks) and the stop code
        (``STOP_*``; docs/design.md, "CoreIndex: explain")."""
        return _trace(self, local_hashes)

    def trace_tokens(self, tokens, size_t block_size, uint64_t seed=1337):
        """Like :meth:`trace`, hashing ``tokens`` in C (block_size 0: no blocks)."""
        return _trace_tokens(self, tokens, block_size, seed)

    # -- dump and restore (kvconductor.state.dump) ------------------------------------------
    def export_hbm(self):
        """The HBM tree under one read lock, as five arrays.

        ``(parents, locals, node, worker, ehash)``: the node table -- ``parents``
        (``array('I')``, the row of the parent node, ``0xFFFFFFFF`` under the root) and
        ``locals`` (``array('Q')``) -- with every parent before its children, and the
        member table -- ``node`` (``array('I')``, a node row), ``worker``
        (``array('I')``), ``ehash`` (``array('Q')``). :meth:`restore_hbm` rebuilds it.
        """
        return _export_hbm(self)

    def restore_hbm(self, parents, local_hashes, node, worker, ehash):
        """Add an :meth:`export_hbm` table to the tree (worker ids as in this core, each
        declared HBM by :meth:`set_worker`); returns the (worker, block) pairs added.

        ``ValueError`` for a malformed table (lengths differ, a parent row not before its
        child, a row out of range, a worker unknown, not HBM, or already holding the
        block); the core must then be discarded (it may keep memberless nodes)."""
        return _restore_hbm(self, parents, local_hashes, node, worker, ehash)

    def export_tier(self, int tier):
        """CPU (``tier`` 1) or Disk (2) blocks under one read lock: one row per (edge,
        owner) as ``(worker, ehash, local, parent, has_parent)`` arrays (``'I'``, ``'Q'``,
        ``'Q'``, ``'Q'``, ``'B'``), root edges first in their creation order per local
        hash. :meth:`restore_tier` replays them."""
        return _export_tier(self, tier)

    def restore_tier(self, int tier, worker, ehash, local_hashes, parent, has_parent):
        """Replay :meth:`export_tier` rows in order, each as ``store(worker, parent or
        None, [ehash], [local])`` under one write lock; returns the rows stored.
        ``ValueError`` when the columns differ in length, a worker is unknown or not of
        ``tier``, or a row is refused (the tier then holds the rows before it)."""
        return _restore_tier(self, tier, worker, ehash, local_hashes, parent, has_parent)

    def export_twophase(self):
        """The two-phase state under one read lock: ``(records, waits)`` with records
        ``(kind, ehash, local, parent or None, t)`` (kind 0 offload, 1 content) and waits
        ``(ehash, worker, t)``, each hash's waiters newest first; ``t`` on the caller's
        clock (the ``now`` given to offload/pool_store)."""
        return _export_twophase(self)

    def restore_twophase(self, records, waits):
        """Add :meth:`export_twophase` entries (times already on this core's clock).
        ``ValueError`` for a bad kind, a hash already in the offload or content map, an
        unknown waiter or a worker waiting twice for a hash (entries before it stay)."""
        return _restore_twophase(self, records, waits)


def _live_allocations():
    """Structure blocks this module allocated and has not freed (tests: leak check)."""
    return live_allocations()


# -- the jobs, one included file each --------------------------------------------------
include "_index_write.pxi"
include "_index_twophase.pxi"
include "_index_answers.pxi"
include "_index_query.pxi"
include "_index_inspect.pxi"
include "_index_trace.pxi"
include "_index_io.pxi"
include "_index_shared.pxi"
