# cython: language_level=3
"""The index core of one (model, tenant): HBM tree, CPU/Disk tiers, two-phase state."""
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from kvconductor._cursor cimport HCursor
from kvconductor._maps cimport U64Map
from kvconductor._pool cimport Pool
from kvconductor._rwlock cimport pthread_rwlock_t
from kvconductor._lower cimport Lower
from kvconductor._tree cimport Tree
from kvconductor._shlock cimport ShLock

cdef struct TPRec:
    uint32_t next_free          # free-list link (Pool convention: first field)
    uint32_t has_parent         # 0: root block, 1: parent set
    uint64_t local              # LocalBlockHash of the offloaded block
    uint64_t parent             # parent engine hash (when has_parent)
    double t                    # insert time (caller's clock, seconds)

cdef struct TPWait:
    uint32_t next               # next waiter on the same hash, or next free record
    uint32_t worker             # waiting pool worker
    double t                    # first insert time of this waiter

cdef struct BP:
    uint32_t group              # (instance, dp) group id
    uint32_t end                # absolute end position (blocks)
    uint64_t last               # engine hash of the last block covered


cdef enum:
    OP_STORE = 0                # store a chain (``_store_c``)
    OP_EVICT = 1                # removal with the two-phase rule (``evict``)
    OP_CLEAR = 2                # clear every worker of the ``clear`` list (``clear``)

cdef struct BatchOp:
    const uint64_t* ehashes        # engine hashes (STORE, EVICT)
    const uint64_t* locals      # LocalBlockHashes (STORE)
    size_t n                    # number of hashes
    uint64_t parent             # parent engine hash (STORE, when has_parent)
    uint32_t worker             # target worker id (STORE, EVICT); validated by the caller
    uint8_t kind                # OP_*
    uint8_t has_parent
    long rc                     # out: like the Python method's result; T_ERR_* (< 0) for STORE


cdef struct Scratch:
    size_t W                    # worker-indexed capacity
    size_t G                    # the groups of ``ends`` (npu, cpu, disk: G each)
    bint owned                  # hw, hd, hs, stamp, ends, tl malloc'd for this call
    bint lower                  # a lower tier's walk wrote cpu/disk ends
    bint dense                  # many results: ``tl`` not kept, ``nt`` only counted
    uint32_t* hw                # tree results: worker
    uint32_t* hd                # tree results: depth
    uint64_t* hs                # tree: ehash by worker
    uint32_t* stamp             # tree scratch
    uint32_t* tl                # the groups whose ends are not 0, first touch order
    size_t nt                   # ... how many (tl: G + 1 entries)
    uint64_t* tb                # a bitmap of G bits, all 0 at rest (thread scratch)
    uint32_t* idx               # walk scratch (HM_NIL filled)
    uint32_t* cand              # walk candidates
    size_t* oend                # walk results: end
    uint64_t* olast             # walk results: last
    BP* bps                     # breakpoints
    size_t nbp
    size_t bpcap
    uint32_t* ends              # 3 * G: npu, cpu, disk ends per group


# Stop codes of ``CoreIndex.trace`` (their names: ``kvconductor.schema.STOP_REASONS``). When
# several walks of a worker stop at the same block, the smaller code is reported.
cdef enum:
    STOP_END_OF_PROMPT = 0      # every block of the query matched
    STOP_PARENT_MISMATCH = 1    # the worker holds the next block's content elsewhere
    STOP_NOT_HELD = 2           # the tier holds the next block, this worker does not
    STOP_NO_FIRST_BLOCK = 3     # no worker of the tier holds the first block as a root
    STOP_TIER_EXHAUSTED = 4     # no worker of the tier holds the next block after this prefix
    STOP_MUTED = 5              # the worker is muted (set_muted): no hits, no breakpoints


# The state of one index, in one C struct: on the heap in a single process, in the shared
# arena with ``--workers N`` (workers read it through attached handles, see CoreIndex).
cdef struct CoreState:
    uint64_t magic              # CORE_MAGIC while alive; 0 once closed
    Tree tree                   # HBM tier
    Lower tiers[2]              # [0] CPU, [1] Disk
    uint32_t* wgroup            # worker id -> group id
    uint8_t* wtier              # worker id -> 0 HBM / 1 CPU / 2 Disk
    uint8_t* wmute              # worker id -> 1: muted, no hits in queries (set_muted)
    size_t wcap                 # allocated entries of wgroup/wtier/wmute
    size_t nworkers             # max worker id + 1
    size_t ngroups              # max group id + 1
    U64Map offload_m            # engine hash -> TPRec (unconfirmed engine offloads)
    U64Map content_m            # engine hash -> TPRec (confirmed content, kept for promotion)
    # engine hash -> head TPWait (pool confirmations waiting), chained newest first, one
    # waiter per worker
    U64Map pending_m
    TPRec* recs                 # records of offload/content entries
    Pool rec_pool               # capacity, high-water mark and free list of ``recs``
    TPWait* waits               # pending-pool waiters
    Pool wait_pool              # capacity, high-water mark and free list of ``waits``
    size_t npending             # live waiters


cdef enum:
    CORE_STALE = -7             # attached handle: the directory changed, reload it
    CORE_CLOSED = -8            # the state was freed (close), or the shared lock failed


# The answer of one query: ``n`` rows of (group, npu, cpu, disk) exclusive block counts,
# by increasing group, in one malloc'd buffer (``4 * n`` u32) owned by the object. No
# Python object per row: the encoder (``_encode.encode_rows``) renders it directly.
cdef class MatchRows:
    cdef uint32_t* data
    cdef size_t n
    #: rows tied at the cut depth of ``select(top_k=...)`` that it left out
    cdef readonly size_t omitted


cdef MatchRows rows_wrap(uint32_t* data, size_t n)


# The lock of one CoreIndex and its kind, chosen once at construction (``__cinit__``,
# ``attach_core``) as the four section functions, so no section branches on the kind:
# local (this process's threads: the rwlock), shared (the owner's state in the arena:
# writers also take the cross-process lock's write side) or attached (a worker's
# read-only handle: the cross-process lock's read side and the directory generation).
cdef struct CoreLock:
    pthread_rwlock_t rw         # this process's threads (local and shared kinds)
    ShLock* xl                  # the cross-process lock (shared and attached kinds)
    const uint64_t* gen         # attached: the directory generation word in the arena
    uint64_t gen_seen           # attached: the generation this handle was built from
    # 0 inside the read section; CORE_STALE (attached: the directory changed) or
    # CORE_CLOSED (the state is gone, or the shared lock failed): not inside then
    int (*rlock)(CoreLock* lk, CoreState** st, int slot) noexcept nogil
    void (*runlock)(CoreLock* lk, int slot) noexcept nogil
    void (*wlock)(CoreLock* lk) noexcept nogil
    void (*wunlock)(CoreLock* lk) noexcept nogil


cdef class CoreIndex:
    cdef CoreState* st          # NULL once closed
    cdef CoreLock lk            # the lock and its kind
    cdef bint lock_ok
    cdef bint attached          # a worker's read-only handle on another process's state
    cdef bint shared            # owner's state in the arena: writers also take ``lk.xl``
    cdef object xlock           # its SharedLock (keeps the mapping alive)

    cdef int _writable(self) except -1
    cdef int _slot(self) except -2
    cdef int _reader(self) except -2
    cdef int _stale(self, int code) except -1
    cdef int _tier(self, uint32_t worker) except -1
    # Apply ``ops`` in order under ONE write lock (the caller validated every worker id
    # with ``_tier`` and holds no lock); OP_CLEAR clears each of ``clear[0:nclear]``.
    cdef void _apply_ops(self, BatchOp* ops, size_t n, const uint32_t* clear,
                         size_t nclear) noexcept nogil
    # The same if the write lock is free this instant, else nothing and False (never
    # waits: callable with the GIL held; the shared kind always answers False).
    cdef bint _try_apply_ops(self, BatchOp* ops, size_t n, const uint32_t* clear,
                             size_t nclear) noexcept nogil
