# cython: language_level=3
"""The one structure allocator of the compiled core, and its shared-arena hook.

Its state (the installed arena, the writer thread, the count of arena blocks freed off
that thread) exists once per process, here: the other compiled modules call the
functions this module exports (``_alloc.pxd``, imported at their load), so one
:func:`install_arena` routes the structure memory of ``_tree``, ``_lower`` and
``_index`` alike (uvloop's one ``uv_replace_allocator``). The C is
``kvconductor/c/alloc.h``; the per-module block counts stay in ``_pool.pxd``.
"""
from kvconductor._arena cimport Arena, arena_free, arena_malloc, arena_realloc

cdef extern from "kvconductor/c/alloc.h":
    void* _c_alloc "kvc_alloc"(size_t n) noexcept nogil
    void* _c_realloc "kvc_realloc"(void* ptr, size_t n) noexcept nogil
    void _c_free "kvc_free"(void* p) noexcept nogil
    void _c_set_arena "kvc_set_arena"(void* arena, void* m, void* r, void* f, const char* lo,
                                      const char* hi) noexcept nogil
    void _c_unset_arena "kvc_unset_arena"() noexcept nogil
    bint _c_arena_writing "kvc_arena_writing"() noexcept nogil
    bint _c_in_arena "kvc_in_arena"(const void* p) noexcept nogil
    long _c_arena_leaked "kvc_arena_leaked"() noexcept nogil


cdef void* alloc_malloc(size_t n) noexcept nogil:
    return _c_alloc(n)


cdef void* alloc_realloc(void* ptr, size_t n) noexcept nogil:
    return _c_realloc(ptr, n)


cdef void alloc_free(void* p) noexcept nogil:
    _c_free(p)


cdef bint alloc_arena_writing() noexcept nogil:
    return _c_arena_writing()


cdef bint alloc_in_arena(const void* p) noexcept nogil:
    return _c_in_arena(p)


cdef long alloc_arena_leaked() noexcept nogil:
    return _c_arena_leaked()


def install_arena(Arena arena):
    """Shared mode for this process, called ON THE WRITER THREAD: the structure memory
    that thread allocates, in every compiled module, comes from ``arena`` from now on;
    None ends it. The caller keeps ``arena`` open while it is installed."""
    if arena is None:
        _c_unset_arena()
    else:
        _c_set_arena(&arena.a, <void*>arena_malloc, <void*>arena_realloc,
                     <void*>arena_free, arena.a.base, arena.a.base + arena.a.reserve)


def arena_writing():
    """True on the thread that installed an arena, while it is installed."""
    return _c_arena_writing()


def _arena_leaks():
    """Arena blocks freed off the writer thread (left in place, counted)."""
    return _c_arena_leaked()
