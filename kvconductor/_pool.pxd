# cython: language_level=3
"""Growable C arrays and index pools with a free list, usable without the GIL.

Items are addressed by ``uint32_t`` index; ``HM_NIL`` means "no item" (the
hash maps of ``_maps`` use it for empty slots too). Every function is
``noexcept nogil`` and reports out-of-memory by its return value, leaving the
array unchanged.
"""
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memset

from kvconductor._arena cimport Arena, arena_free, arena_malloc, arena_realloc

# -- counted allocation ------------------------------------------------------------------
# Every structure array (pool arrays, map slots, per-worker tables, query breakpoints) is
# allocated and freed through these, which keep a count of live blocks; each compiled
# module that cimports this file gets its own counter (``static``), read by its
# ``_live_allocations()`` so tests can check that what they created and released was
# freed. One relaxed atomic add per block allocation or free: allocations are per
# growth step, never per item. Per-call scratch buffers stay on plain malloc/free.
#
# Shared mode (``--workers N``, docs/design.md "Several worker processes"): once
# ``kvc_set_arena`` installed the arena, allocations made ON THE WRITER THREAD (the
# thread that installed it: the owner's ingest thread) come from the shared arena, so
# worker processes see them at the same address. Other threads keep plain malloc (query
# scratch, explain walks): the arena allocator has no lock. Frees and reallocs go by
# address: arena blocks back to the arena (writer thread only; an arena block freed
# elsewhere is leaked and counted, never handed to the allocator concurrently), others
# to free/realloc.
cdef extern from "kvconductor/c/pool.h":
    void* mem_alloc "kvc_mem_alloc"(size_t n) noexcept nogil
    void* mem_realloc "kvc_mem_realloc"(void* ptr, size_t n) noexcept nogil
    void mem_free "kvc_mem_free"(void* p) noexcept nogil
    long live_allocations "kvc_live_allocations"() noexcept nogil
    void pool_set_arena "kvc_set_arena"(void* arena, void* m, void* r, void* f, const char* lo,
                                        const char* hi) noexcept nogil
    void pool_unset_arena "kvc_unset_arena"() noexcept nogil
    bint pool_arena_writing "kvc_arena_writing"() noexcept nogil
    bint pool_in_arena "kvc_in_arena"(const void* p) noexcept nogil
    long pool_arena_leaked "kvc_arena_leaked"() noexcept nogil

cdef inline void pool_use_arena(Arena arena) noexcept:
    """Shared mode for this module (called on the writer thread): its structure memory
    comes from ``arena`` from now on; None ends it."""
    if arena is None:
        pool_unset_arena()
    else:
        pool_set_arena(&arena.a, <void*>arena_malloc, <void*>arena_realloc,
                       <void*>arena_free, arena.a.base, arena.a.base + arena.a.reserve)


cdef enum:
    HM_NIL = 0xFFFFFFFF           # no item / no index; also the empty slot of the maps
    GROW_SLOW_BYTES = 8 << 20     # grow_array: arrays this big grow by 1.25x, not 1.5x


# -- growable arrays ------------------------------------------------------------------
cdef inline void* grow_array(void* ptr, size_t* cap, size_t need, size_t item) noexcept nogil:
    """Return ``ptr`` grown (doubling) to hold ``need`` items; NULL on overflow/OOM
    (then ``ptr`` is still valid and unchanged)."""
    cdef size_t ncap = cap[0] if cap[0] else 16
    while ncap < need:
        if ncap > (<size_t>-1) // 2 // item:
            return NULL
        # 1.5x, and 1.25x past GROW_SLOW_BYTES: a big array (the tree's nodes) keeps at
        # most a quarter of slack. glibc grows such a mapping in place (mremap); an arena
        # copies it, but a copy of tens of MB costs milliseconds.
        ncap += ncap // 4 if ncap * item >= GROW_SLOW_BYTES else ncap // 2
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
