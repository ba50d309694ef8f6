# cython: language_level=3
"""The one structure allocator of the compiled core (``kvconductor/c/alloc.h``).

Every module allocates structure memory through these (by ``_pool.pxd``'s
``mem_alloc``/``mem_realloc``/``mem_free``, which also count the module's own blocks).
The shared arena of ``--workers N`` is installed here, once for every module
(:func:`install_arena`, called by ``_index.install_shared``).
"""
cdef void* alloc_malloc(size_t n) noexcept nogil
cdef void* alloc_realloc(void* ptr, size_t n) noexcept nogil
cdef void alloc_free(void* p) noexcept nogil
# True on the writer thread while an arena is installed (its allocations go there).
cdef bint alloc_arena_writing() noexcept nogil
cdef bint alloc_in_arena(const void* p) noexcept nogil
# Arena blocks freed off the writer thread (left in place, counted).
cdef long alloc_arena_leaked() noexcept nogil
