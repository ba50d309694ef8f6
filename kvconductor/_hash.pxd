# cython: language_level=3
"""C-level block hashing shared by the index and the wire parsers."""
from libc.stdint cimport uint32_t, uint64_t

ctypedef uint64_t (*xxh3_seeded_fn)(const void* data, size_t length, uint64_t seed) noexcept nogil

cdef enum:
    KVC_SEED = 1337       # same constant as NVIDIA Dynamo kv-router and the reference

# Seeds of the extra-key items (docs/api.md, "Block hashing"): "m", "s", "e".
cdef enum:
    XK_MM = 0x6D
    XK_SALT = 0x73
    XK_EMBEDS = 0x65

# Hash ``n_tokens`` u32 tokens in blocks of ``block_size`` into ``out`` (capacity
# >= ceil(n/bs)); trailing partial block included. Returns the number of hashes.
cdef size_t hash_token_blocks(const uint32_t* tokens, size_t n_tokens, size_t block_size,
                              uint64_t seed, uint64_t* out) noexcept nogil

# XXH3-64 of one byte range (the real xxHash function from the xxhash package).
cdef uint64_t xxh3(const void* data, size_t length, uint64_t seed) noexcept nogil

# Extra keys: XXH3-64 of the two u64 ``a``, ``b`` (16 little-endian bytes) with ``seed``.
cdef uint64_t pair_hash(uint64_t a, uint64_t b, uint64_t seed) noexcept nogil
# One extra-key item's hash (``tag`` XK_*; ``offset`` for XK_MM, as u64).
cdef uint64_t extra_item(int tag, const void* data, size_t n, uint64_t offset) noexcept nogil
# A block's digest after one more item (never 0: 0 means "no extra keys").
cdef uint64_t extra_fold(uint64_t digest, uint64_t item) noexcept nogil
# ``local[i]`` mixed with ``digests[i]`` where that is not 0.
cdef void mix_extra_locals(uint64_t* local, const uint64_t* digests, size_t n,
                           uint64_t seed) noexcept nogil
# ``values``' u64 items in ``v`` (the caller releases it: PyBuffer_Release): a C-contiguous
# u64 buffer (``array('Q')``, a u64 memoryview) without a copy, else what ``as_u64`` makes
# of it (ints in [0, 2**64), else OverflowError). No Cython memoryview made.
cdef int u64_view(Py_buffer* v, object values) except -1
