# cython: language_level=3
"""CPU/Disk edge tables: C structs and the nogil kernels shared with ``_index``."""
from libc.stdint cimport uint32_t, uint64_t

from kvconductor._cursor cimport HCursor
from kvconductor._maps cimport FpMap, U64Map
from kvconductor._pool cimport HM_NIL, Pool

cdef struct LEdge:
    # nowners == 1: the sole owner's worker id; >= 2: head of the owner list in Lower.own;
    # a free edge: the next free edge (Pool convention)
    uint32_t owners
    uint32_t nowners            # number of owner workers
    uint64_t parent             # parent engine hash (meaningful when has_parent == 1)
    uint64_t local              # LocalBlockHash of the block
    uint64_t child              # engine hash of the block, fixed by the edge's creator
    uint32_t has_parent         # 1: parent set, 0: root edge, HM_NIL: free slot
    uint32_t next_root          # next root edge with the same LocalBlockHash (HM_NIL: last)

cdef struct LOwner:
    # an owner of an edge two or more workers own (a sole owner lives in the edge)
    uint32_t next               # next owner of the same edge, or next free record
    uint32_t worker             # owner worker id

cdef struct Lower:
    LEdge* edges                # edge array
    Pool edge_pool              # capacity, high-water mark and free list of ``edges``
    size_t live_edges           # edges in use
    LOwner* own                 # owner records
    Pool own_pool               # capacity, high-water mark and free list of ``own``
    size_t nrecords             # owner records in use
    # (parent engine hash, local) -> edge, for non-root edges: an FpMap of edge indices,
    # verified against the edge's parent and local
    FpMap pairs
    U64Map roots                # local -> first root edge; more via LEdge.next_root, oldest first
    # per worker: engine hash -> edge, an FpMap verified against the edge's child (the
    # engine hash a worker maps to an edge is always that edge's child)
    FpMap* rev
    size_t nrev                 # length of rev
    size_t total                # sum of the reverse maps' sizes: (worker, block) pairs

# Owners of edge ``e``: ``w = lower_owner_first(L, e, &cur)`` then, while ``w != HM_NIL``,
# ``w = lower_owner_next(L, &cur)`` (newest first).
cdef inline uint32_t lower_owner_first(const Lower* L, uint32_t e, uint32_t* cur) noexcept nogil:
    cdef uint32_t o
    if L.edges[e].nowners == 1:
        cur[0] = HM_NIL
        return L.edges[e].owners
    o = L.edges[e].owners if L.edges[e].nowners else HM_NIL
    if o == HM_NIL:
        cur[0] = HM_NIL
        return HM_NIL
    cur[0] = L.own[o].next
    return L.own[o].worker


cdef inline uint32_t lower_owner_next(const Lower* L, uint32_t* cur) noexcept nogil:
    cdef uint32_t o = cur[0]
    if o == HM_NIL:
        return HM_NIL
    cur[0] = L.own[o].next
    return L.own[o].worker


cdef int lower_init(Lower* L) noexcept nogil
cdef void lower_free(Lower* L) noexcept nogil
cdef size_t lower_nbytes(const Lower* L) noexcept nogil
# Non-root edge (parent, local), or the FIRST root edge of ``local`` (has_parent false;
# further root edges of the same content follow through LEdge.next_root).
cdef uint32_t lower_find(const Lower* L, bint has_parent, uint64_t parent,
                         uint64_t local) noexcept nogil
# The root edge of ``local`` owned by ``worker`` that was created first, or HM_NIL.
cdef uint32_t lower_root_of(const Lower* L, uint64_t local, uint32_t worker) noexcept nogil
cdef bint lower_owns(const Lower* L, uint32_t e, uint32_t worker) noexcept nogil
# One worker's walk from ``pos`` (after parent ``parent[0]`` when ``has_parent[0]``, else
# entering by its oldest root edge of ``H[pos]``): returns where it stops, with
# ``has_parent``/``parent`` the last block walked (explain, LowerTier.walk).
cdef size_t lower_walk_one(const Lower* L, uint32_t worker, HCursor* hc, size_t pos,
                           bint* has_parent, uint64_t* parent) noexcept nogil
# Explain: whether ``worker`` holds any block of LocalBlockHash ``local`` (its reverse map
# scanned: O(blocks of the worker), diagnostics only).
cdef bint lower_holds_local(const Lower* L, uint32_t worker, uint64_t local) noexcept nogil
# The edge ``worker`` maps engine hash ``h`` to, or HM_NIL.
cdef uint32_t lower_rev_get(const Lower* L, uint32_t worker, uint64_t h) noexcept nogil
cdef long lower_store(Lower* L, uint32_t worker, bint has_parent, uint64_t parent,
                      const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil
cdef long lower_remove(Lower* L, uint32_t worker, const uint64_t* ehashes, size_t n) noexcept nogil
cdef long lower_clear(Lower* L, uint32_t worker) noexcept nogil
cdef bint lower_lookup(const Lower* L, uint64_t h, bint* has_parent, uint64_t* parent,
                       uint64_t* local) noexcept nogil
cdef size_t lower_worker_blocks(const Lower* L, uint32_t worker) noexcept nogil
# Checker: 0 when every invariant holds; -1 with ``msg`` (of ``cap`` bytes) saying which
# failed; -2 out of memory. Walks every structure: O(size of the tier).
cdef int lower_check(const Lower* L, char* msg, size_t cap) noexcept nogil
# Walk the chain from (start, parent) -- parent is an engine hash, root edges are
# entered by the caller -- once for several candidate workers: for
# candidate k, out_end[k] = start + consecutive owned edges, out_last[k] = the
# last child walked (valid when out_end[k] > start). ``idx`` is scratch indexed
# by worker id, of ``nidx`` entries, all HM_NIL on entry and on return.
cdef void lower_walk_multi(const Lower* L, HCursor* hc, size_t start,
                           uint64_t parent, const uint32_t* cand, size_t ncand,
                           uint32_t* idx, size_t nidx, size_t* out_end,
                           uint64_t* out_last) noexcept nogil
