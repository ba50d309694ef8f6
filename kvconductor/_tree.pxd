# cython: language_level=3
"""HBM radix tree: C structs and the nogil kernels shared with ``_index``."""
from libc.stdint cimport uint32_t, uint64_t

from kvconductor._cursor cimport HCursor
from kvconductor._maps cimport FpMap, hm_mix
from kvconductor._pool cimport Pool

cdef inline uint64_t member_sig(uint32_t worker) noexcept nogil:
    return hm_mix(<uint64_t>worker + 1)

cdef enum:
    T_ROOT = 0                  # index of the root node
    # TNode.y of a node with two or more members: this bit set, the rest indexes Tree.wide
    # (a wide node: members as a bitmap); clear, the head of its member list in Tree.mem
    T_WIDE = 0x80000000
    T_ERR_OOM = -1              # out of memory
    T_ERR_PARENT = -2           # ParentBlockNotFound
    T_ERR_SEQUENCE = -3         # InvalidBlockSequence

cdef struct TNode:
    # nmembers == 1: the sole member's worker (its engine hash is ``x``); >= 2: head of
    # the member list in Tree.mem, or T_WIDE | its TWide in Tree.wide; a free node: the
    # free-list link (Pool convention)
    uint32_t y
    uint32_t parent             # parent node index (HM_NIL for the root and free nodes)
    uint64_t local              # LocalBlockHash of the block (edge key under the parent)
    # nmembers == 1: the sole member's engine hash; >= 2: the set fingerprint, the sum of
    # member_sig(worker) over the members (tree_sig gives it for any node)
    uint64_t x
    uint32_t nmembers           # number of members (workers holding the block)
    uint32_t nchildren          # number of child edges; HM_NIL marks a free node

cdef struct TMember:
    # a member of a node with two or more (a sole member lives in the node itself)
    uint32_t next               # next member of the same node, or next free record
    uint32_t worker             # worker id
    uint64_t ehash              # the member worker's engine hash for this block

cdef struct TWide:
    # the members of a wide node (held by many workers): a bitmap over worker ids and the
    # members' engine hashes in worker-id order (member of rank r: ``bits[nwords + r]``)
    uint32_t node               # the node it describes; a free record: the free-list link
    uint32_t nwords             # bitmap words: it covers worker ids < 64 * nwords
    uint32_t cap                # engine-hash capacity (>= the node's nmembers)
    uint32_t spare
    uint64_t* bits              # one block: nwords bitmap words, then cap engine hashes

cdef struct Tree:
    TNode* nodes                # node array, node 0 = root
    Pool node_pool              # capacity, high-water mark and free list of ``nodes``
    size_t live_nodes           # nodes in use, root excluded
    TMember* mem                # member records of the nodes with two or more members
    Pool mem_pool               # capacity, high-water mark and free list of ``mem``
    size_t nrecords             # member records in use
    size_t npairs               # live (worker, block) pairs
    TWide* wide                 # the wide nodes' member bitmaps
    Pool wide_pool              # capacity, high-water mark and free list of ``wide``
    size_t nwide                # wide nodes
    size_t wide_bytes           # bytes of the live TWide.bits blocks
    size_t nwidened             # lifetime count: list nodes turned wide (tests, layout)
    size_t nnarrowed            # lifetime count: wide nodes turned back (list or inline)
    # (parent node, local) -> child: an FpMap of node indices, verified against the node
    FpMap edges
    # per worker: engine hash -> node, an FpMap of node indices verified against the
    # worker's member on the node
    FpMap* rev
    size_t nrev                 # length of rev (capacity: at least max worker id + 1 seen)
    uint32_t wend               # one past the highest worker id that ever held a block
    size_t nfreed               # nodes freed so far (a paused match checks its path then)


cdef inline uint64_t tree_sig(const TNode* n) noexcept nogil:
    """The node's member-set fingerprint (0 for no members)."""
    if n.nmembers >= 2:
        return n.x
    return member_sig(n.y) if n.nmembers == 1 else 0


cdef int tree_init(Tree* t) noexcept nogil
cdef void tree_free(Tree* t) noexcept nogil
cdef size_t tree_nbytes(const Tree* t) noexcept nogil
cdef long tree_store(Tree* t, uint32_t worker, bint has_parent, uint64_t parent,
                     const uint64_t* ehashes, const uint64_t* locals, size_t n) noexcept nogil
cdef long tree_remove(Tree* t, uint32_t worker, const uint64_t* ehashes, size_t n) noexcept nogil
cdef long tree_clear(Tree* t, uint32_t worker) noexcept nogil
# Checker: 0 when every invariant holds; -1 with ``msg`` (of ``cap`` bytes) saying which
# failed; -2 out of memory. Walks every structure: O(size of the tree).
cdef int tree_check(const Tree* t, char* msg, size_t cap) noexcept nogil
# The return code of tree_store as a value, or the matching exception.
cdef long check_rc(long rc) except -1
# The result of a *_check function as an exception (AssertionError(msg), MemoryError).
cdef int check_raise(int rc, const char* msg) except -1
cdef size_t tree_worker_blocks(const Tree* t, uint32_t worker) noexcept nogil
# Bytes the structures touch: the used part of the node and member arrays, every slot of
# the tables (what resident memory grows by; tree_nbytes counts allocated capacity).
cdef size_t tree_used_bytes(const Tree* t) noexcept nogil
# Layout figures into out[0:TL_N] (layout_dict names them).
cdef enum:
    TL_N = 13
cdef void tree_layout(const Tree* t, size_t* out) noexcept nogil
cdef dict layout_dict(const size_t* out)
# The child of ``parent`` under ``local``, or HM_NIL.
cdef uint32_t tree_child(const Tree* t, uint32_t parent, uint64_t local) noexcept nogil
# Explain (CoreIndex.trace): the query's path from the root, ``path[k]`` the node after k
# blocks (``path[0]`` T_ROOT) as far as the tree has the query's blocks, its length
# returned (``path`` holds ``hc.n + 1`` entries); whether a node has members; whether
# ``worker`` holds any block of LocalBlockHash ``local`` (its reverse map scanned:
# O(blocks of the worker), diagnostics only).
cdef size_t tree_path(const Tree* t, HCursor* hc, uint32_t* path) noexcept nogil
cdef bint tree_held(const Tree* t, uint32_t node) noexcept nogil
cdef bint tree_holds_local(const Tree* t, uint32_t worker, uint64_t local) noexcept nogil
# The node holding ``worker``'s block ``ehash``, or HM_NIL.
cdef uint32_t tree_rev_get(const Tree* t, uint32_t worker, uint64_t ehash) noexcept nogil
# ``worker``'s engine hash on ``node`` into ``out``: 1, or 0 when not a member.
cdef bint tree_member_ehash(const Tree* t, uint32_t node, uint32_t worker,
                            uint64_t* out) noexcept nogil
# Match: fills out_worker[k]/out_depth[k] for result k and out_ehash[w] (indexed by
# worker id) -- all of capacity t.nrev; ``out_ehash`` may be NULL (no breakpoints wanted:
# the walk skips the engine hashes); ``scratch`` holds tree_match_scratch(t.nrev)
# bytes, 8-byte aligned. Returns the number of results.
cdef size_t tree_match(const Tree* t, HCursor* hc, uint32_t* out_worker, uint32_t* out_depth,
                       uint64_t* out_ehash, uint64_t* scratch) noexcept nogil

# The same walk in steps (a worker's query, CoreIndex._run_query): tree_match_start walks
# up to block ``limit`` and returns 1 (paused: the walk's state in ``m``) when the query is
# longer, 0 when done (``m.cnt`` results); tree_match_resume goes on to a further limit.
# Between the two the caller may leave its read section: tree_match_valid (inside the next
# one) says whether the paused walk may go on in the tree as it is then, else the caller
# starts again (docs/design.md, "Long queries and the writer").
cdef enum:
    TM_DONE = 0
    TM_WORDS = 1                # the walk on bitmap words (many candidates)
    TM_LIST = 2                 # the walk on the list of candidates

cdef struct TreeMatch:
    uint32_t node               # the node reached ...
    uint32_t step               # ... after this many blocks (its depth)
    size_t alive                # candidates left on it (the bitmap A; K is zero) ...
    uint64_t asig               # ... and their fingerprint
    uint64_t* A
    uint64_t* K
    size_t NW                   # words of the bitmaps
    size_t base                 # results emitted so far
    size_t cnt                  # results in all (the candidates of the first node)
    int phase                   # TM_*
    uint32_t wend               # the tree's wend when the walk started
    size_t nfreed               # the tree's nfreed when the walk paused

cdef int tree_match_start(const Tree* t, HCursor* hc, uint32_t* out_worker,
                          uint32_t* out_depth, uint64_t* out_ehash, uint64_t* scratch,
                          TreeMatch* m, size_t limit) noexcept nogil
cdef int tree_match_resume(const Tree* t, HCursor* hc, uint32_t* out_worker,
                           uint32_t* out_depth, uint64_t* out_ehash, TreeMatch* m,
                           size_t limit) noexcept nogil
cdef bint tree_match_valid(const Tree* t, HCursor* hc, const TreeMatch* m) noexcept nogil


cdef inline size_t tree_match_scratch(size_t nrev) noexcept nogil:
    """Bytes of tree_match's scratch for ``nrev`` workers: two bitmaps over them."""
    return 16 * ((nrev + 63) // 64)


# Dump and restore (CoreIndex.export_hbm / restore_hbm): the node table (parent row,
# local) in parent-before-child order and the member table (node row, worker, engine hash).
cdef int tree_export(const Tree* t, uint32_t* pos, uint32_t* stack, uint32_t* oparent,
                     uint64_t* olocal, uint32_t* mnode, uint32_t* mworker,
                     uint64_t* mehash) noexcept nogil
cdef long tree_restore(Tree* t, const uint32_t* parents, const uint64_t* locals, size_t nn,
                       const uint32_t* mnode, const uint32_t* mworker, const uint64_t* mehash,
                       size_t nm, uint32_t* rows) noexcept nogil
