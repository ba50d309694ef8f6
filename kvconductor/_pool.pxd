# cython: language_level=3
"""Growable C arrays and index pools with a free list, usable without the GIL.

Items are addressed by ``uint32_t`` index; ``HM_NIL`` means "no item" (the
hash maps of ``_maps`` use it for empty slots too). Every function is
``noexcept nogil`` and reports out-of-memory by its return value, leaving the
array unchanged.
"""
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memset

from kvconductor._alloc cimport alloc_arena_writing, alloc_free, alloc_malloc, alloc_realloc

# -- counted allocation ------------------------------------------------------------------
# Every structure array (pool arrays, map slots, per-worker tables, query breakpoints) is
# allocated and freed through these, which keep a count of live blocks; each compiled
# module that cimports this file gets its own counter (``static``, kvconductor/c/pool.h),
# read by its ``_live_allocations()`` so tests can check that what they created and
# released was freed. One relaxed atomic add per block allocation or free: allocations
# are per growth step, never per item. Per-call scratch buffers stay on plain
# malloc/free.
#
# The allocator itself is ONE module, ``_alloc`` (kvconductor/c/alloc.h): in shared mode
# (``--workers N``) one ``_alloc.install_arena`` routes the writer thread's structure
# memory of every module into the shared arena (docs/design.md "Several worker
# processes").
cdef extern from "kvconductor/c/pool.h":
    void _count "kvc_count_blocks"(long d) noexcept nogil
    long live_allocations "kvc_live_allocations"() noexcept nogil


cdef inline void* mem_alloc(size_t n) noexcept nogil:
    cdef void* p = alloc_malloc(n)
    if p != NULL:
        _count(1)
    return p


cdef inline void* mem_realloc(void* ptr, size_t n) noexcept nogil:
    cdef void* p = alloc_realloc(ptr, n)
    if p != NULL and ptr == NULL:
        _count(1)
    return p


cdef inline void mem_free(void* p) noexcept nogil:
    if p == NULL:
        return
    _count(-1)
    alloc_free(p)


cdef enum:
    HM_NIL = 0xFFFFFFFF           # no item / no index; also the empty slot of the maps
    GROW_SLOW_BYTES = 8 << 20     # grow_array: arrays this big grow by 1.25x, not 1.5x


# -- growable arrays ------------------------------------------------------------------
cdef inline void* grow_array(void* ptr, size_t* cap, size_t need, size_t item) noexcept nogil:
    """Return ``ptr`` grown (doubling) to hold ``need`` items; NULL on overflow/OOM
    (then ``ptr`` is still valid and unchanged)."""
    cdef size_t ncap = cap[0] if cap[0] else 16
    # In the shared arena (the writer thread of --workers N) a big array doubles: the
    # arena grows a run in place only when the run above it is free or it is the top, so
    # the big arrays that grow side by side (nodes, members, tables) often move, and a
    # move copies; doubling copies a quarter of the bytes 1.25x steps copy. The slack
    # costs address space only: a run's pages are not touched (committed) until used.
    cdef bint slow = not alloc_arena_writing()
    while ncap < need:
        if ncap > (<size_t>-1) // 2 // item:
            return NULL
        # 1.5x, and 1.25x past GROW_SLOW_BYTES: a big array (the tree's nodes) keeps at
        # most a quarter of slack. glibc grows such a mapping in place (mremap).
        if ncap * item < GROW_SLOW_BYTES:
            ncap += ncap // 2
        elif slow:
            ncap += ncap // 4
        else:
            ncap += ncap
    if ncap == cap[0]:
        return ptr
    cdef void* p = mem_realloc(ptr, ncap * item)
    if p == NULL:
        return NULL
    cap[0] = ncap
    return p


# -- pooled arrays with a free list -----------------------------------------------------
# Convention: the FIRST field of every pooled struct is a uint32 that links free items.
cdef struct Pool:
    size_t cap                   # allocated items
    uint32_t used                # high-water mark of item indices
    uint32_t free                # head of the free list (HM_NIL: empty)


cdef inline void pool_init(Pool* p) noexcept nogil:
    p.cap = 0
    p.used = 0
    p.free = HM_NIL


cdef inline uint32_t pool_take(Pool* p, void** data, size_t item) noexcept nogil:
    """Index of a free item of ``data[0]`` (items of ``item`` bytes): a freed one, else
    the next past the high-water mark, growing the array. HM_NIL on overflow or
    out of memory (``data[0]`` is then unchanged)."""
    cdef uint32_t i
    cdef void* q
    if p.free != HM_NIL:
        i = p.free
        p.free = (<uint32_t*>(<char*>data[0] + <size_t>i * item))[0]
        return i
    if p.used >= <uint32_t>(HM_NIL - 1):
        return HM_NIL
    if p.used >= p.cap:
        q = grow_array(data[0], &p.cap, <size_t>p.used + 1, item)
        if q == NULL:
            return HM_NIL
        data[0] = q
    i = p.used
    p.used += 1
    return i


cdef inline void pool_give(Pool* p, void* data, uint32_t i, size_t item) noexcept nogil:
    """Put item ``i`` on the free list (overwrites its first uint32 field)."""
    (<uint32_t*>(<char*>data + <size_t>i * item))[0] = p.free
    p.free = i


cdef inline long pool_mark_free(const Pool* p, const void* data, size_t item,
                                uint8_t* marks) noexcept nogil:
    """Checker: ``marks[i] = 1`` for each item ``i`` on the free list, 0 for the others
    (``marks`` holds ``p.used`` entries). Returns how many are free, or -1 when the
    list leaves ``[0, used)``, visits an item twice or ``used`` exceeds ``cap``."""
    cdef uint32_t i = p.free
    cdef long n = 0
    if p.used > p.cap:
        return -1
    if p.used:
        memset(marks, 0, p.used)
    while i != HM_NIL:
        if i >= p.used or marks[i]:
            return -1
        marks[i] = 1
        n += 1
        i = (<const uint32_t*>(<const char*>data + <size_t>i * item))[0]
    return n
