"""The pure-Python twin of ``kvconductor._arena``'s allocator: a model on offsets only.

It holds no memory: it keeps the allocator's state (class free lists, chunks, runs,
free runs, ``top``, the committed file size) and returns the offset from the arena's
base that :class:`kvconductor._arena.Arena` returns for the same sequence of calls.
The algorithm is described in ``kvconductor/_arena.pyx``'s module docstring.

**Threading:** one caller at a time (like the C allocator: one writer).
"""

from __future__ import annotations

PAGE = 4096
NCLASSES = 9
MIN_CLASS = 64
MAX_CLASS = 16 << 10
CHUNK = 2 << 20
DATA_OFF = 128 << 10
BLOCK_HDR = 16


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def chunk_bytes(k: int) -> int:
    """Bytes of a chunk of class ``k`` (header page excluded): 32 blocks, >= 64 KiB."""
    return max(64 << 10, (MIN_CLASS << k) * 32)


def class_of(need: int) -> int:
    """Size class of a block of ``need`` bytes (header included); -1: a run."""
    if need > MAX_CLASS:
        return -1
    k, s = 0, MIN_CLASS
    while s < need:
        s <<= 1
        k += 1
    return k


class ArenaModel:
    """Offsets (of the user pointer, i.e. block header + 16) for malloc/realloc/free."""

    def __init__(self, reserve: int) -> None:
        self.reserve = reserve
        self.committed = DATA_OFF
        self.top = DATA_OFF
        #: class -> stack of free block offsets (head is the last item)
        self.free_class: list[list[int]] = [[] for _ in range(NCLASSES)]
        self.chunks = 0
        #: free run offset -> size; and end offset -> start, for merging
        self.free_runs: dict[int, int] = {}
        self._free_ends: dict[int, int] = {}
        #: live block offset (header) -> (size, is_small)
        self.live: dict[int, tuple[int, bool]] = {}

    # -- runs -----------------------------------------------------------------------
    def _push_run(self, off: int, size: int) -> None:
        self.free_runs[off] = size
        self._free_ends[off + size] = off

    def _remove_run(self, off: int) -> int:
        size = self.free_runs.pop(off)
        del self._free_ends[off + size]
        return size

    def _run_take(self, size: int) -> tuple[int, int]:
        """(offset, size) of a run of at least ``size`` bytes; (0, 0) when out of space."""
        best = None
        for off, rs in self.free_runs.items():
            if rs >= size and (best is None or (rs, off) < (best[1], best[0])):
                best = (off, rs)
        if best is not None:
            off, bsize = best
            self._remove_run(off)
            if bsize - size >= PAGE:
                self._push_run(off + size, bsize - size)
                return off, size
            return off, bsize
        if size > self.reserve or self.top > self.reserve - size:
            return 0, 0
        off = self.top
        if off + size > self.committed:
            self.committed = min(_round_up(off + size, CHUNK), self.reserve)
        self.top = off + size
        return off, size

    def _run_give(self, off: int, size: int) -> None:
        prev = self._free_ends.get(off)
        if prev is not None:
            size += self._remove_run(prev)
            off = prev
        if off + size in self.free_runs:
            size += self._remove_run(off + size)
        if off + size == self.top:
            self.top = off
            return
        self._push_run(off, size)

    def _run_grow(self, off: int, size: int, want: int) -> bool:
        """Grow the live run at ``off`` in place: into the free run above it, or at top."""
        nxt = off + size
        if nxt == self.top:
            if want > self.reserve or off > self.reserve - want:
                return False
            if off + want > self.committed:
                self.committed = min(_round_up(off + want, CHUNK), self.reserve)
            self.top = off + want
            self.live[off] = (want, False)
            return True
        above = self.free_runs.get(nxt)
        if above is None or size + above < want:
            return False
        self._remove_run(nxt)
        total = size + above
        if total - want >= PAGE:
            self._push_run(off + want, total - want)
            total = want
        self.live[off] = (total, False)
        return True

    # -- the API ----------------------------------------------------------------------
    def malloc(self, n: int) -> int:
        """Offset of a new block of ``n`` bytes; 0 when out of space."""
        if n > self.reserve:
            return 0
        k = class_of(n + BLOCK_HDR)
        if k >= 0:
            stack = self.free_class[k]
            if not stack:
                c, _ = self._run_take(chunk_bytes(k) + PAGE)
                if c == 0:
                    return 0
                self.chunks += 1
                cs = MIN_CLASS << k
                stack.extend(c + PAGE + i * cs for i in reversed(range(chunk_bytes(k) // cs)))
            off = stack.pop()
            self.live[off] = (MIN_CLASS << k, True)
        else:
            off, size = self._run_take(_round_up(n + BLOCK_HDR, PAGE))
            if off == 0:
                return 0
            self.live[off] = (size, False)
        return off + BLOCK_HDR

    def free(self, ptr: int) -> None:
        off = ptr - BLOCK_HDR
        size, small = self.live.pop(off)
        if small:
            self.free_class[class_of(size)].append(off)
        else:
            self._run_give(off, size)

    def realloc(self, ptr: int, n: int) -> int:
        """Same offset when ``n`` keeps the size class (or run size) or a run grows in
        place; 0 on failure."""
        if ptr == 0:
            return self.malloc(n)
        if n > self.reserve:
            return 0
        size, small = self.live[ptr - BLOCK_HDR]
        k = class_of(n + BLOCK_HDR)
        want = MIN_CLASS << k if k >= 0 else _round_up(n + BLOCK_HDR, PAGE)
        if want == size and (k >= 0) == small:
            return ptr
        if k < 0 and not small and want > size and self._run_grow(ptr - BLOCK_HDR, size, want):
            return ptr
        new = self.malloc(n)
        if new == 0:
            return 0
        self.free(ptr)
        return new

    def usable(self, ptr: int) -> int:
        """Bytes the caller may use at ``ptr``."""
        return self.live[ptr - BLOCK_HDR][0] - BLOCK_HDR

    def stats(self) -> dict[str, int]:
        return {
            "reserve": self.reserve,
            "committed": self.committed,
            "top": self.top,
            "live_blocks": len(self.live),
            "bytes_in_use": sum(size for size, _ in self.live.values()),
            "chunks": self.chunks,
            "free_runs": len(self.free_runs),
            "free_run_bytes": sum(self.free_runs.values()),
        }
