# cython: language_level=3
"""The query input of the index kernels: LocalBlockHashes given, or hashed from
tokens lazily (in growing chunks) as a walk reaches them."""
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from kvconductor._hash cimport hash_token_blocks


cdef struct HCursor:
    const uint64_t* hashes       # precomputed LocalBlockHashes, or NULL to hash lazily
    uint64_t* buf                # lazily filled hashes (n entries) when hashes == NULL
    const uint32_t* tokens       # u32 tokens when hashing lazily
    size_t ntok                  # number of tokens
    size_t bs                    # block size (tokens per block)
    size_t n                     # number of blocks (hashes)
    size_t done                  # blocks hashed so far into buf
    uint64_t seed                # XXH3 seed (1337 or LoRA-salted)


cdef inline void hc_init_hashes(HCursor* c, const uint64_t* hashes, size_t n) noexcept nogil:
    c.hashes = hashes
    c.buf = NULL
    c.tokens = NULL
    c.ntok = 0
    c.bs = 1
    c.n = n
    c.done = n
    c.seed = 0


cdef inline int hc_init_tokens(HCursor* c, const uint32_t* tokens, size_t ntok, size_t bs,
                               uint64_t seed) noexcept nogil:
    """Set up lazy hashing of ``tokens``; -1 on OOM. Free with ``hc_free``."""
    c.hashes = NULL
    c.tokens = tokens
    c.ntok = ntok
    c.bs = bs
    c.seed = seed
    c.done = 0
    c.n = 0 if bs == 0 else (ntok + bs - 1) // bs
    c.buf = NULL
    if c.n:
        c.buf = <uint64_t*>malloc(c.n * sizeof(uint64_t))
        if c.buf == NULL:
            return -1
    return 0


cdef inline void hc_free(HCursor* c) noexcept nogil:
    free(c.buf)
    c.buf = NULL


cdef inline uint64_t hc_get(HCursor* c, size_t i) noexcept nogil:
    """LocalBlockHash ``i`` (< c.n); hashes lazily in growing chunks."""
    cdef size_t end, t0, t1
    if c.hashes != NULL:
        return c.hashes[i]
    if i >= c.done:
        # PERF: hash ahead in doubling chunks, so a short match hashes little and a
        # long one amortises the call overhead.
        end = c.done * 2
        if end < 16:
            end = 16
        if end < i + 1:
            end = i + 1
        if end > c.n:
            end = c.n
        t0 = c.done * c.bs
        t1 = end * c.bs
        if t1 > c.ntok:
            t1 = c.ntok
        hash_token_blocks(c.tokens + t0, t1 - t0, c.bs, c.seed, c.buf + c.done)
        c.done = end
    return c.buf[i]
