# cython: language_level=3
"""Shared-memory arena for the multi-process index (issue 14): the allocator.

A ``memfd`` reserved (``MAP_SHARED | MAP_NORESERVE``, nothing committed) at one fixed
address with ``MAP_FIXED_NOREPLACE``; another process maps the same fd at the same
address with :meth:`Arena.attach`, so absolute pointers into the arena are valid in
every process. The file grows with ``ftruncate`` and never shrinks.

Layout (offsets from the base):

* ``0``: :c:type:`ArenaHeader` (magic, version, layout hash, sizes, allocator state);
* ``4096``: a 64 KiB opaque area kept for the reader table and the directory;
* ``128 KiB``: page-aligned runs up to ``top``. Every run starts with a 16-byte
  :c:type:`BlockHdr`. A free run also keeps its size in its last 8 bytes (footer) and
  its list links after its header; the run above it carries ``ARENA_PREV_FREE``.

Allocation: ``n + 16`` bytes up to 16 KiB take a power-of-two size class (64 B .. 16 KiB)
from a LIFO free list per class, refilled by carving a chunk (a run of 32 blocks of the
class, at least 64 KiB, plus one header page; never returned) lowest block first.
Larger requests take a run of ``round_up(n + 16, 4096)`` bytes: the best fit (smallest,
then lowest offset) of the free runs, split at the front, else fresh space at ``top``.
A freed run merges with its free neighbours; one that reaches ``top`` lowers ``top``
instead of being listed. ``realloc`` of a run to a larger run grows it where it lies
when the run just above it is free and large enough (the rest of it stays free) or it
ends at ``top`` (the way glibc grows a large block with ``mremap``, no copy); else it
moves the block. A freed run of 64 KiB or more is punched out of the file
(``fallocate(PUNCH_HOLE)``; its first and last page stay, they hold its header and
footer), so the pages of the arrays an index outgrew are not counted against every
process that maps the arena. The pure-Python model in
``kvconductor/_py/arena.py`` gives the same offsets for the same calls.
"""
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from kvconductor._shlock cimport SHL_OK, SharedLock, shl_read_enter, shl_read_exit

import os

cdef extern from "kvconductor/c/arena.h":
    int kvc_arena_memfd() noexcept nogil
    int kvc_arena_punch(int fd, uint64_t off, uint64_t length) noexcept nogil
    int kvc_arena_grow(int fd, uint64_t size) noexcept nogil
    void* kvc_arena_map(uintptr_t addr, uint64_t length, int fd) noexcept nogil
    int kvc_arena_unmap(void* p, uint64_t length) noexcept nogil
    long kvc_arena_file_size(int fd) noexcept nogil
    int kvc_errno() noexcept nogil
    void* KVC_MAP_FAILED
    int c_close "close"(int fd) noexcept nogil

VERSION = 1
DEFAULT_ADDRESS = 0x3F0000000000
DEFAULT_RESERVE = 64 << 30
#: Offset and size of the area the allocator never hands out: the directory lives there.
OPAQUE_OFFSET = ARENA_OPAQUE_OFF
OPAQUE_SIZE = ARENA_OPAQUE_SIZE

cdef uint64_t MAGIC = 0x414E455241564B43
cdef uint32_t BLOCK_MAGIC = 0xB10CB10C
cdef uint32_t C_VERSION = 1


cdef inline uint32_t arena_layout() noexcept nogil:
    return <uint32_t>((sizeof(ArenaHeader) << 16) | (sizeof(BlockHdr) << 8)
                      | ARENA_NCLASSES)


cdef inline ArenaHeader* H(arena_t* a) noexcept nogil:
    return <ArenaHeader*>a.base


cdef inline BlockHdr* B(arena_t* a, uint64_t off) noexcept nogil:
    return <BlockHdr*>(a.base + off)


cdef inline uint64_t* W(arena_t* a, uint64_t off) noexcept nogil:
    # 64-bit word at ``off``
    return <uint64_t*>(a.base + off)


cdef inline uint64_t round_up(uint64_t n, uint64_t m) noexcept nogil:
    return (n + m - 1) // m * m


cdef inline uint64_t chunk_bytes(int k) noexcept nogil:
    """Bytes of a chunk of class ``k`` (its header page not included): 32 blocks, at
    least 64 KiB. Carving touches every block of a chunk (its free-list link), so a
    class used a little costs a little."""
    cdef uint64_t n = (<uint64_t>ARENA_MIN_CLASS << k) * 32
    return n if n > (64 << 10) else (64 << 10)


cdef inline int class_of(uint64_t need) noexcept nogil:
    """Size class of a block of ``need`` bytes (header included); -1: a run."""
    cdef int k = 0
    cdef uint64_t s = ARENA_MIN_CLASS
    if need > ARENA_MAX_CLASS:
        return -1
    while s < need:
        s <<= 1
        k += 1
    return k


# -- free-run list (doubly linked: next at +16, prev at +24; footer at end - 8) --------
cdef inline void run_list_push(arena_t* a, uint64_t off, uint64_t size) noexcept nogil:
    cdef ArenaHeader* h = H(a)
    cdef BlockHdr* b = B(a, off)
    b.size = size
    b.magic = BLOCK_MAGIC
    b.flags = ARENA_KIND_RUN_FREE          # its lower neighbour is never free (merged)
    W(a, off + 16)[0] = h.free_runs
    W(a, off + 24)[0] = 0
    if h.free_runs:
        W(a, h.free_runs + 24)[0] = off
    h.free_runs = off
    W(a, off + size - 8)[0] = size
    h.n_free_runs += 1
    h.free_run_bytes += size
    if off + size < h.top:
        B(a, off + size).flags |= ARENA_PREV_FREE


cdef inline void run_list_remove(arena_t* a, uint64_t off) noexcept nogil:
    cdef ArenaHeader* h = H(a)
    cdef uint64_t nxt = W(a, off + 16)[0]
    cdef uint64_t prv = W(a, off + 24)[0]
    if prv:
        W(a, prv + 16)[0] = nxt
    else:
        h.free_runs = nxt
    if nxt:
        W(a, nxt + 24)[0] = prv
    h.n_free_runs -= 1
    h.free_run_bytes -= B(a, off).size


cdef uint64_t run_take(arena_t* a, uint64_t size, uint32_t kind) noexcept nogil:
    """Offset of a run of ``size`` bytes (page multiple) marked ``kind``; 0 when the
    reservation is exhausted or the file cannot grow."""
    cdef ArenaHeader* h = H(a)
    cdef uint64_t r = h.free_runs
    cdef uint64_t best = 0
    cdef uint64_t bsize = 0
    cdef uint64_t rs, newc
    cdef uint64_t guard = h.n_free_runs
    while r and guard:
        rs = B(a, r).size
        if rs >= size and (best == 0 or rs < bsize or (rs == bsize and r < best)):
            best = r
            bsize = rs
        r = W(a, r + 16)[0]
        guard -= 1
    if best:
        run_list_remove(a, best)
        if bsize - size >= ARENA_PAGE:
            run_list_push(a, best + size, bsize - size)
        else:
            size = bsize
            if best + size < h.top:
                B(a, best + size).flags &= ~(<uint32_t>ARENA_PREV_FREE)
    else:
        if size > h.reserve or h.top > h.reserve - size:
            return 0
        best = h.top
        if best + size > h.committed:
            newc = round_up(best + size, ARENA_CHUNK)
            if newc > h.reserve:
                newc = h.reserve
            if kvc_arena_grow(a.fd, newc) != 0:
                return 0
            h.committed = newc
        h.top = best + size
    B(a, best).size = size
    B(a, best).magic = BLOCK_MAGIC
    B(a, best).flags = kind
    return best


cdef void run_give(arena_t* a, uint64_t off) noexcept nogil:
    """Free the run at ``off``: merge with free neighbours, lower ``top`` or list it,
    punch it out of the file when it is 64 KiB or more."""
    cdef ArenaHeader* h = H(a)
    cdef uint64_t size = B(a, off).size
    cdef uint64_t psize, nxt
    if B(a, off).flags & ARENA_PREV_FREE:
        psize = W(a, off - 8)[0]
        off -= psize
        run_list_remove(a, off)
        size += psize
    nxt = off + size
    if nxt < h.top and (B(a, nxt).flags & 0xFF) == ARENA_KIND_RUN_FREE:
        size += B(a, nxt).size
        run_list_remove(a, nxt)
    if off + size == h.top:
        h.top = off
        if size >= ARENA_PUNCH_MIN and kvc_arena_punch(a.fd, off, size) == 0:
            h.punched += 1
        return
    run_list_push(a, off, size)
    if size >= ARENA_PUNCH_MIN and kvc_arena_punch(a.fd, off + ARENA_PAGE,
                                                   size - 2 * ARENA_PAGE) == 0:
        h.punched += 1


cdef int run_grow(arena_t* a, uint64_t off, uint64_t want) noexcept nogil:
    """Grow the live run at ``off`` to ``want`` bytes (page multiple, more than its
    size) where it lies, as glibc's ``mremap`` grows a mapping: into the free run just
    above it (the rest of that run stays free) or, at ``top``, into fresh space. 0, or
    -1 (nothing changed) when neither has room."""
    cdef ArenaHeader* h = H(a)
    cdef uint64_t old = B(a, off).size
    cdef uint64_t nxt = off + old
    cdef uint64_t total, newc
    if nxt == h.top:
        if want > h.reserve or off > h.reserve - want:
            return -1
        if off + want > h.committed:
            newc = round_up(off + want, ARENA_CHUNK)
            if newc > h.reserve:
                newc = h.reserve
            if kvc_arena_grow(a.fd, newc) != 0:
                return -1
            h.committed = newc
        h.top = off + want
        total = want
    elif (B(a, nxt).flags & 0xFF) == ARENA_KIND_RUN_FREE and old + B(a, nxt).size >= want:
        total = old + B(a, nxt).size
        run_list_remove(a, nxt)
        if total - want >= ARENA_PAGE:
            run_list_push(a, off + want, total - want)
            total = want
        elif off + total < h.top:
            B(a, off + total).flags &= ~(<uint32_t>ARENA_PREV_FREE)
    else:
        return -1
    B(a, off).size = total
    h.bytes_in_use += total - old
    return 0


cdef int chunk_carve(arena_t* a, int k) noexcept nogil:
    """Refill class ``k``'s free list from a new chunk; -1 when out of space."""
    cdef ArenaHeader* h = H(a)
    cdef uint64_t cs = (<uint64_t>ARENA_MIN_CLASS) << k
    cdef uint64_t c = run_take(a, chunk_bytes(k) + ARENA_PAGE, ARENA_KIND_CHUNK)
    cdef uint64_t i, blk
    cdef uint64_t cnt = chunk_bytes(k) // cs
    if c == 0:
        return -1
    B(a, c).flags = ARENA_KIND_CHUNK | (<uint32_t>k << 8)
    W(a, c + 16)[0] = h.chunks
    h.chunks = c
    h.n_chunks += 1
    i = cnt
    while i:
        i -= 1
        blk = c + ARENA_PAGE + i * cs
        B(a, blk).size = cs
        B(a, blk).magic = BLOCK_MAGIC
        B(a, blk).flags = ARENA_KIND_SMALL_FREE | (<uint32_t>k << 8)
        W(a, blk + 16)[0] = h.free_class[k]
        h.free_class[k] = blk
    return 0


cdef void* arena_malloc(arena_t* a, size_t n) noexcept nogil:
    cdef ArenaHeader* h = H(a)
    cdef uint64_t off, size
    cdef int k
    if not a.writer or n > h.reserve:
        return NULL
    k = class_of(<uint64_t>n + ARENA_BLOCK_HDR)
    if k >= 0:
        if h.free_class[k] == 0 and chunk_carve(a, k) != 0:
            return NULL
        off = h.free_class[k]
        h.free_class[k] = W(a, off + 16)[0]
        B(a, off).flags = ARENA_KIND_SMALL | (<uint32_t>k << 8)
        size = B(a, off).size
    else:
        size = round_up(<uint64_t>n + ARENA_BLOCK_HDR, ARENA_PAGE)
        off = run_take(a, size, ARENA_KIND_RUN)
        if off == 0:
            return NULL
        size = B(a, off).size
    h.live_blocks += 1
    h.bytes_in_use += size
    return a.base + off + ARENA_BLOCK_HDR


cdef inline uint64_t block_of(arena_t* a, void* p) noexcept nogil:
    """Offset of the block header of ``p``; 0 when ``p`` is no live block."""
    cdef uintptr_t q = <uintptr_t>p
    cdef uintptr_t base = <uintptr_t>a.base
    cdef uint64_t off
    cdef uint32_t kind
    if q < base + ARENA_DATA_OFF + ARENA_BLOCK_HDR or q >= base + H(a).top:
        return 0
    off = q - base - ARENA_BLOCK_HDR
    if off % 16 or B(a, off).magic != BLOCK_MAGIC:
        return 0
    kind = B(a, off).flags & 0xFF
    if kind != ARENA_KIND_SMALL and kind != ARENA_KIND_RUN:
        return 0
    return off


cdef int arena_free(arena_t* a, void* p) noexcept nogil:
    """Free ``p`` (NULL: nothing). 0, or -1 when ``p`` is no live block (ignored)."""
    cdef ArenaHeader* h = H(a)
    cdef uint64_t off
    cdef int k
    if p == NULL:
        return 0
    if not a.writer:
        return -1
    off = block_of(a, p)
    if off == 0:
        return -1
    h.live_blocks -= 1
    h.bytes_in_use -= B(a, off).size
    if (B(a, off).flags & 0xFF) == ARENA_KIND_SMALL:
        k = (B(a, off).flags >> 8) & 0xFF
        B(a, off).flags = ARENA_KIND_SMALL_FREE | (<uint32_t>k << 8)
        W(a, off + 16)[0] = h.free_class[k]
        h.free_class[k] = off
    else:
        run_give(a, off)
    return 0


cdef void* arena_realloc(arena_t* a, void* p, size_t n) noexcept nogil:
    """``realloc``: the same pointer when ``n`` keeps the size class (or run size) or
    a run can grow where it lies (``run_grow``), else a new block with the old
    contents; NULL (``p`` untouched) on failure."""
    cdef uint64_t off, old, want
    cdef int k
    cdef void* q
    if p == NULL:
        return arena_malloc(a, n)
    if not a.writer:
        return NULL
    off = block_of(a, p)
    if off == 0 or n > H(a).reserve:
        return NULL
    old = B(a, off).size
    k = class_of(<uint64_t>n + ARENA_BLOCK_HDR)
    if k >= 0:
        want = (<uint64_t>ARENA_MIN_CLASS) << k
    else:
        want = round_up(<uint64_t>n + ARENA_BLOCK_HDR, ARENA_PAGE)
    if want == old and ((k >= 0) == ((B(a, off).flags & 0xFF) == ARENA_KIND_SMALL)):
        return p
    if (k < 0 and want > old and (B(a, off).flags & 0xFF) == ARENA_KIND_RUN
            and run_grow(a, off, want) == 0):
        return p
    q = arena_malloc(a, n)
    if q == NULL:
        return NULL
    memcpy(q, p, min(<uint64_t>n, old - ARENA_BLOCK_HDR))
    arena_free(a, p)
    return q


# -- Python class ------------------------------------------------------------------------
cdef class Arena:
    """A shared-memory arena at a fixed address (see the module docstring).

    ``Arena(reserve=..., address=...)`` creates one (a new memfd) and may allocate;
    ``Arena.attach(fd, address, reserve)`` maps an existing one in another process at
    the same address, read-mostly: it may read and write memory but never allocates.

    Threading rule: ONE writer (the owner process, one thread at a time, under the
    index's write lock) calls ``malloc``/``realloc``/``free``; the allocator has no
    lock and no atomics. Other processes only read arena memory (and only what the
    writer published). Addresses are plain ints (0: allocation failed).
    """

    def __cinit__(self):
        self.a.base = NULL
        self.a.fd = -1
        self.a.writer = 0
        self.owns_fd = False
        self.mapped = False

    def __init__(self, reserve: int = DEFAULT_RESERVE, address: int = DEFAULT_ADDRESS):
        cdef int fd
        cdef ArenaHeader* h
        _check_geometry(reserve, address)
        fd = kvc_arena_memfd()
        if fd < 0:
            raise OSError(kvc_errno(), "memfd_create failed")
        self.a.fd = fd
        self.owns_fd = True
        if kvc_arena_grow(fd, ARENA_DATA_OFF) != 0:
            raise OSError(kvc_errno(), "ftruncate of the arena's memfd failed")
        self._map(address, reserve)
        h = H(&self.a)
        h.magic = MAGIC
        h.version = C_VERSION
        h.layout = arena_layout()
        h.reserve = reserve
        h.committed = ARENA_DATA_OFF
        h.top = ARENA_DATA_OFF
        self.a.writer = 1

    cdef _map(self, uint64_t address, uint64_t reserve):
        cdef void* p = kvc_arena_map(<uintptr_t>address, reserve, self.a.fd)
        cdef int err
        if p == KVC_MAP_FAILED:
            err = kvc_errno()
            raise OSError(err, f"cannot map the arena at {address:#x} ({reserve} bytes): "
                          f"{os.strerror(err)}; the range is taken in this process")
        if <uintptr_t>p != <uintptr_t>address:
            # kernels before 4.17 ignore MAP_FIXED_NOREPLACE and map elsewhere
            kvc_arena_unmap(p, reserve)
            raise OSError(17, f"cannot map the arena at {address:#x}: the range is taken "
                          f"in this process")
        self.a.base = <char*>p
        self.a.reserve = reserve
        self.mapped = True

    @staticmethod
    def attach(fd: int, address: int = DEFAULT_ADDRESS, reserve: int = DEFAULT_RESERVE):
        """Map the arena of ``fd`` (created by another process) at ``address``.

        OSError when the range is taken or the header is not this build's arena; the
        fd stays the caller's (``close()`` unmaps only)."""
        cdef Arena self = Arena.__new__(Arena)
        cdef ArenaHeader* h
        cdef long size
        _check_geometry(reserve, address)
        size = kvc_arena_file_size(fd)
        if size < 0:
            raise OSError(kvc_errno(), f"fd {fd}: fstat failed")
        if size < ARENA_DATA_OFF:
            raise OSError(22, f"fd {fd} is no arena: {size} bytes, smaller than its header")
        self.a.fd = fd
        self._map(address, reserve)
        h = H(&self.a)
        problem = None
        if h.magic != MAGIC:
            problem = f"bad magic {h.magic:#x} (expected {MAGIC:#x})"
        elif h.version != C_VERSION:
            problem = f"layout version {h.version}, this build reads {C_VERSION}"
        elif h.layout != arena_layout():
            problem = f"struct layout {h.layout:#x}, this build has {arena_layout():#x}"
        elif h.reserve != reserve:
            problem = f"reserve {h.reserve} bytes, attach asked for {reserve}"
        if problem is not None:
            self.close()
            raise OSError(22, f"fd {fd} at {address:#x} is no compatible arena: {problem}")
        return self

    def __dealloc__(self):
        if self.mapped:
            kvc_arena_unmap(self.a.base, self.a.reserve)
        if self.owns_fd and self.a.fd >= 0:
            c_close(self.a.fd)

    def close(self) -> None:
        """Unmap the arena (and close its memfd when this object created it)."""
        if self.mapped:
            kvc_arena_unmap(self.a.base, self.a.reserve)
            self.mapped = False
        if self.owns_fd and self.a.fd >= 0:
            c_close(self.a.fd)
        self.a.fd = -1
        self.a.writer = 0

    cdef _live(self):
        if not self.mapped:
            raise ValueError("arena is closed")

    cdef _writer(self):
        self._live()
        if not self.a.writer:
            raise RuntimeError("an attached arena never allocates (one writer: the owner)")

    @property
    def address(self) -> int:
        return <uintptr_t>self.a.base

    def fileno(self) -> int:
        return self.a.fd

    def malloc(self, n: int) -> int:
        self._writer()
        if n < 0:
            raise ValueError("negative size")
        return <uintptr_t>arena_malloc(&self.a, n)

    def realloc(self, addr: int, n: int) -> int:
        self._writer()
        if n < 0:
            raise ValueError("negative size")
        if addr and block_of(&self.a, <void*><uintptr_t>addr) == 0:
            raise ValueError(f"{addr:#x} is no live block of this arena")
        return <uintptr_t>arena_realloc(&self.a, <void*><uintptr_t>addr, n)

    def free(self, addr: int) -> None:
        self._writer()
        if arena_free(&self.a, <void*><uintptr_t>addr) != 0:
            raise ValueError(f"{addr:#x} is no live block of this arena")

    cdef char* _span(self, uint64_t addr, uint64_t n) except NULL:
        cdef uint64_t base = <uintptr_t>self.a.base
        self._live()
        if addr < base or n > H(&self.a).committed or addr - base > H(&self.a).committed - n:
            raise ValueError(f"[{addr:#x}, +{n}) is outside the arena's committed bytes")
        return <char*><uintptr_t>addr

    def write(self, addr: int, data: bytes) -> None:
        """Copy ``data`` to ``addr`` (bounds: the committed file); the shared directory
        is written this way."""
        cdef const unsigned char[:] view = data
        cdef char* dst = self._span(addr, len(data))
        if len(data):
            memcpy(dst, &view[0], len(data))

    def read(self, addr: int, n: int) -> bytes:
        """``n`` bytes at ``addr`` (bounds: the committed file)."""
        cdef char* src = self._span(addr, n)
        return src[:n]

    def read_record(self, SharedLock lock, uint64_t addr):
        """Copy a record inside ONE read section of ``lock``, without the GIL: the four
        u64 words at ``addr`` (``a, b, data address, data length``) and the data they
        point to (bounds: the committed file); ``((a, b, data address, length),
        data)``. A worker's directory is read this way, so a thread never waits for
        the GIL inside a read section, where the writer would wait for it."""
        cdef uint64_t w[4]
        cdef uint64_t base = <uintptr_t>self.a.base
        cdef uint64_t committed
        cdef char* buf = NULL
        cdef int slot, rc, bad = 0
        self._span(addr, sizeof(w))
        slot = lock._slot()
        with nogil:
            rc = shl_read_enter(lock.lock, slot)
            if rc == SHL_OK:
                memcpy(w, <void*><uintptr_t>addr, sizeof(w))
                committed = H(&self.a).committed
                if w[3] != 0:
                    if w[2] < base or w[3] > committed or w[2] - base > committed - w[3]:
                        bad = 1
                    else:
                        buf = <char*>malloc(w[3])
                        if buf == NULL:
                            bad = 2
                        else:
                            memcpy(buf, <void*><uintptr_t>w[2], w[3])
                shl_read_exit(lock.lock, slot)
        if rc != SHL_OK:
            raise RuntimeError("read_record inside a read section of this thread")
        if bad == 1:
            raise ValueError(f"[{w[2]:#x}, +{w[3]}) is outside the arena's committed bytes")
        if bad == 2:
            raise MemoryError()
        try:
            data = buf[:w[3]] if w[3] != 0 else b""
        finally:
            free(buf)
        return (w[0], w[1], w[2], w[3]), data

    def stats(self) -> dict:
        self._live()
        cdef ArenaHeader* h = H(&self.a)
        return {
            "reserve": h.reserve,
            "committed": h.committed,
            "top": h.top,
            "live_blocks": h.live_blocks,
            "bytes_in_use": h.bytes_in_use,
            "chunks": h.n_chunks,
            "free_runs": h.n_free_runs,
            "free_run_bytes": h.free_run_bytes,
            "punched": h.punched,
        }

    def check_invariants(self) -> None:
        """Walk runs, chunks and free lists; AssertionError naming the first problem."""
        self._live()
        _check(&self.a)

    def _corrupt_for_test(self, kind: str) -> None:
        """Break one invariant (test hook). ``kind``: ``"block_magic"`` (the header of
        the first run), ``"live_count"`` (the live-block counter), ``"free_list"``
        (a class free list pointing into the opaque area)."""
        self._writer()
        cdef ArenaHeader* h = H(&self.a)
        if kind == "block_magic":
            if h.top == ARENA_DATA_OFF:
                raise ValueError("nothing allocated yet")
            B(&self.a, ARENA_DATA_OFF).magic ^= 1
        elif kind == "live_count":
            h.live_blocks += 1
        elif kind == "free_list":
            h.free_class[0] = ARENA_OPAQUE_OFF
        else:
            raise ValueError(f"unknown corruption {kind!r}")


def _check_geometry(reserve, address):
    if address <= 0 or address % ARENA_PAGE:
        raise ValueError(f"address {address:#x} is not a page-aligned address")
    if reserve < 2 * ARENA_CHUNK or reserve % ARENA_CHUNK:
        raise ValueError(f"reserve {reserve} is not a multiple of 2 MiB of at least 4 MiB")


cdef _check(arena_t* a):
    cdef ArenaHeader* h = H(a)
    cdef uint64_t off, size, cs, blk, prv, c
    cdef uint32_t kind, flags
    cdef int k
    cdef bint prev_free = False
    cdef uint64_t live = 0, used = 0, nfree_runs = 0, free_bytes = 0, nchunks = 0
    cdef uint64_t free_small[15]
    cdef uint64_t listed
    cdef long fsize
    for k in range(ARENA_NCLASSES):
        free_small[k] = 0
    if h.magic != MAGIC or h.version != C_VERSION or h.layout != arena_layout():
        raise AssertionError("arena header: bad magic, version or layout")
    if not (ARENA_DATA_OFF <= h.top <= h.committed <= h.reserve):
        raise AssertionError(f"arena header: top {h.top}, committed {h.committed}, "
                             f"reserve {h.reserve} out of order")
    fsize = kvc_arena_file_size(a.fd)
    if fsize != <long>h.committed:
        raise AssertionError(f"file size {fsize} != committed {h.committed}")
    off = ARENA_DATA_OFF
    while off < h.top:
        if B(a, off).magic != BLOCK_MAGIC:
            raise AssertionError(f"run at offset {off:#x}: bad block magic")
        size = B(a, off).size
        flags = B(a, off).flags
        kind = flags & 0xFF
        if size == 0 or size % ARENA_PAGE or size > h.top - off:
            raise AssertionError(f"run at offset {off:#x}: bad size {size}")
        if bool(flags & ARENA_PREV_FREE) != prev_free:
            raise AssertionError(f"run at offset {off:#x}: PREV_FREE flag is wrong")
        if kind == ARENA_KIND_RUN_FREE:
            if prev_free:
                raise AssertionError(f"free run at offset {off:#x} not merged with the "
                                     f"free run below")
            if W(a, off + size - 8)[0] != size:
                raise AssertionError(f"free run at offset {off:#x}: footer != size")
            nfree_runs += 1
            free_bytes += size
            prev_free = True
        elif kind == ARENA_KIND_RUN:
            live += 1
            used += size
            prev_free = False
        elif kind == ARENA_KIND_CHUNK:
            k = (flags >> 8) & 0xFF
            if k >= ARENA_NCLASSES or size != chunk_bytes(k) + ARENA_PAGE:
                raise AssertionError(f"chunk at offset {off:#x}: bad class or size")
            nchunks += 1
            cs = (<uint64_t>ARENA_MIN_CLASS) << k
            blk = off + ARENA_PAGE
            while blk < off + size:
                if B(a, blk).magic != BLOCK_MAGIC or B(a, blk).size != cs:
                    raise AssertionError(f"block at offset {blk:#x}: bad magic or size")
                flags = B(a, blk).flags
                if (flags >> 8) & 0xFF != <uint32_t>k:
                    raise AssertionError(f"block at offset {blk:#x}: class != its chunk's")
                if flags & 0xFF == ARENA_KIND_SMALL:
                    live += 1
                    used += cs
                elif flags & 0xFF == ARENA_KIND_SMALL_FREE:
                    free_small[k] += 1
                else:
                    raise AssertionError(f"block at offset {blk:#x}: bad kind")
                blk += cs
            prev_free = False
        else:
            raise AssertionError(f"run at offset {off:#x}: bad kind {kind}")
        off += size
    if off != h.top:
        raise AssertionError(f"runs end at {off:#x}, top is {h.top:#x}")
    if prev_free:
        raise AssertionError("a free run ends at top (should have lowered top)")
    if live != h.live_blocks:
        raise AssertionError(f"live_blocks {h.live_blocks} != {live} blocks in use")
    if used != h.bytes_in_use:
        raise AssertionError(f"bytes_in_use {h.bytes_in_use} != {used}")
    if nchunks != h.n_chunks:
        raise AssertionError(f"n_chunks {h.n_chunks} != {nchunks} chunks")
    if nfree_runs != h.n_free_runs or free_bytes != h.free_run_bytes:
        raise AssertionError("free-run counters disagree with the runs")
    # the free-run list: exactly the free runs, links consistent
    listed = 0
    prv = 0
    off = h.free_runs
    while off:
        if listed >= nfree_runs:
            raise AssertionError("free-run list longer than the free runs (cycle?)")
        if off < ARENA_DATA_OFF or off >= h.top or off % ARENA_PAGE \
                or (B(a, off).flags & 0xFF) != ARENA_KIND_RUN_FREE:
            raise AssertionError(f"free-run list: offset {off:#x} is no free run")
        if W(a, off + 24)[0] != prv:
            raise AssertionError(f"free-run list: back link of {off:#x} is wrong")
        listed += 1
        prv = off
        off = W(a, off + 16)[0]
    if listed != nfree_runs:
        raise AssertionError(f"free-run list holds {listed} of {nfree_runs} free runs")
    # chunk list
    listed = 0
    c = h.chunks
    while c:
        if listed >= nchunks or c < ARENA_DATA_OFF or c >= h.top \
                or (B(a, c).flags & 0xFF) != ARENA_KIND_CHUNK:
            raise AssertionError(f"chunk list: offset {c:#x} is no chunk (or a cycle)")
        listed += 1
        c = W(a, c + 16)[0]
    if listed != nchunks:
        raise AssertionError(f"chunk list holds {listed} of {nchunks} chunks")
    # class free lists
    for k in range(ARENA_NCLASSES):
        listed = 0
        blk = h.free_class[k]
        while blk:
            if listed >= free_small[k] or blk < ARENA_DATA_OFF or blk >= h.top \
                    or blk % 16 or B(a, blk).magic != BLOCK_MAGIC \
                    or B(a, blk).flags != (ARENA_KIND_SMALL_FREE | (<uint32_t>k << 8)):
                raise AssertionError(f"class {k} free list: offset {blk:#x} is no free "
                                     f"block of the class (or a cycle)")
            listed += 1
            blk = W(a, blk + 16)[0]
        if listed != free_small[k]:
            raise AssertionError(f"class {k} free list holds {listed} of {free_small[k]} "
                                 f"free blocks")
