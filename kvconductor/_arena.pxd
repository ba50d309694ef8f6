# cython: language_level=3
"""Shared-memory arena: one memfd mapped at one fixed address in every process.

C declarations for modules that will allocate structure memory from the arena
(``_pool.pxd`` in shared mode, issue 14). ``arena_malloc``/``arena_realloc``/
``arena_free`` follow ``malloc``/``realloc``/``free``: NULL on failure (the old
block of a failed ``arena_realloc`` is untouched). Only ONE writer (process and
thread) may call them; the allocator takes no lock and uses no atomics.
"""
from libc.stdint cimport uint32_t, uint64_t

cdef enum:
    ARENA_PAGE = 4096
    ARENA_NCLASSES = 9               # 64 B << 0 .. 64 B << 8 = 16 KiB
    ARENA_MIN_CLASS = 64
    ARENA_MAX_CLASS = 16 << 10
    ARENA_CHUNK = 2 << 20            # small blocks are carved from 2 MiB chunks
    ARENA_PUNCH_MIN = 64 << 10       # a free run this big gives its inner pages back
    ARENA_OPAQUE_OFF = 4096          # the opaque area (reader table, directory) ...
    ARENA_OPAQUE_SIZE = 64 << 10     # ... of 64 KiB follows the header page
    ARENA_DATA_OFF = 128 << 10       # first run (page-aligned runs start here)
    ARENA_BLOCK_HDR = 16


cdef struct ArenaHeader:
    # At offset 0 of the arena; offsets below are relative to the arena's base.
    uint64_t magic
    uint32_t version
    uint32_t layout                  # hash of the struct layouts (arena_layout())
    uint64_t reserve                 # bytes of address space reserved
    uint64_t committed               # file size (ftruncate), never shrinks
    uint64_t top                     # end of the last run; space above is unused
    uint64_t live_blocks             # blocks handed out and not freed
    uint64_t bytes_in_use            # their sizes (size class or run size, header included)
    uint64_t chunks                  # head of the chunk list (0: none)
    uint64_t n_chunks
    uint64_t free_runs               # head of the free-run list (0: none)
    uint64_t n_free_runs
    uint64_t free_run_bytes
    uint64_t punched                 # successful hole punches (not part of the model)
    uint64_t free_class[9]           # head of each size class's free list (0: none)


cdef struct BlockHdr:
    # 16 bytes before every block handed out, and at the start of every run/chunk.
    uint64_t size                    # block size (class size, or run size in bytes)
    uint32_t magic
    uint32_t flags                   # kind | class << 8 | ARENA_PREV_FREE


cdef enum:
    ARENA_KIND_SMALL = 1             # small block in use
    ARENA_KIND_SMALL_FREE = 2        # small block on its class's free list
    ARENA_KIND_RUN = 3               # run in use
    ARENA_KIND_RUN_FREE = 4          # run on the free-run list (footer: its size)
    ARENA_KIND_CHUNK = 5             # run holding small blocks of one class
    ARENA_PREV_FREE = 0x10000        # the run just below this one is free


cdef struct arena_t:
    char* base                       # the fixed address; ArenaHeader at base
    uint64_t reserve                 # length of the mapping
    int fd                           # the memfd
    int writer                       # 1 in the owner (may allocate), 0 when attached


cdef void* arena_malloc(arena_t* a, size_t n) noexcept nogil
cdef void* arena_realloc(arena_t* a, void* p, size_t n) noexcept nogil
cdef int arena_free(arena_t* a, void* p) noexcept nogil


cdef class Arena:
    cdef arena_t a
    cdef bint owns_fd
    cdef bint mapped

    cdef _map(self, uint64_t address, uint64_t reserve)
    cdef _live(self)
    cdef _writer(self)
    cdef char* _span(self, uint64_t addr, uint64_t n) except NULL
