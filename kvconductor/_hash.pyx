# cython: language_level=3
"""LocalBlockHash: XXH3-64 (seed 1337) over little-endian u32 token blocks.

The xxHash implementation is the one compiled into the ``xxhash`` package's own
extension module: we ``dlopen`` that shared object (already loaded by
``import xxhash``) and take ``XXH3_64bits_withSeed`` from it, so nothing of
xxHash is vendored or rewritten here.

Hashing runs without the GIL over a C buffer of u32 tokens.
"""
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from posix.dlfcn cimport RTLD_NOW, dlerror, dlopen, dlsym

import array as _array
import sys as _sys

import xxhash._xxhash as _xx

DEFAULT_SEED = KVC_SEED

cdef xxh3_seeded_fn _XXH3 = NULL
cdef bint _LITTLE = _sys.byteorder == "little"


cdef void _load() except *:
    global _XXH3
    path = _xx.__file__.encode()
    cdef void* handle = dlopen(path, RTLD_NOW)
    if handle == NULL:
        raise ImportError(f"cannot dlopen xxhash extension: {dlerror()!r}")
    # PERF: the runtime-dispatched variant picks AVX2/SSE2 at first call.
    cdef void* fn = dlsym(handle, b"XXH3_64bits_withSeed_dispatch")
    if fn == NULL:
        fn = dlsym(handle, b"XXH3_64bits_withSeed")
    if fn == NULL:
        raise ImportError("xxhash extension does not export XXH3_64bits_withSeed")
    _XXH3 = <xxh3_seeded_fn>fn


_load()


cdef uint64_t xxh3(const void* data, size_t length, uint64_t seed) noexcept nogil:
    return _XXH3(data, length, seed)


cdef inline uint32_t _bswap32(uint32_t x) noexcept nogil:
    return ((x & 0xFF) << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | (x >> 24)


cdef size_t hash_token_blocks(const uint32_t* tokens, size_t n_tokens, size_t block_size,
                              uint64_t seed, uint64_t* out) noexcept nogil:
    cdef size_t i = 0, k = 0, take
    if block_size == 0 or n_tokens == 0:
        return 0
    while i < n_tokens:
        take = block_size if n_tokens - i >= block_size else n_tokens - i
        if _LITTLE:
            out[k] = _XXH3(<const void*>(tokens + i), take * 4, seed)
        else:
            # NOTE: big-endian hosts byte-swap in bounded chunks; correctness only.
            out[k] = _hash_swapped(tokens + i, take, seed)
        k += 1
        i += take
    return k


cdef uint64_t _hash_swapped(const uint32_t* tokens, size_t n, uint64_t seed) noexcept nogil:
    cdef uint32_t* buf = <uint32_t*>malloc(n * 4 + 4)
    cdef size_t j
    cdef uint64_t h
    for j in range(n):
        buf[j] = _bswap32(tokens[j])
    h = _XXH3(<const void*>buf, n * 4, seed)
    free(buf)
    return h


def xxh3_64(data, unsigned long long seed=0):
    """XXH3-64 of ``data`` (bytes-like) with ``seed``, via the shared C function."""
    cdef const uint8_t[::1] view = data
    cdef size_t n = view.shape[0]
    cdef const void* ptr = NULL
    if n:
        ptr = &view[0]
    with nogil:
        h = _XXH3(ptr if n else <const void*>b"", n, seed)
    return h


def lora_seed(lora_name):
    """Seed for blocks of a LoRA adapter: 1337 + XXH3-64(name, seed 0) mod 2^64.

    ``None`` or ``""`` give the base seed 1337.
    """
    if not lora_name:
        return KVC_SEED
    if isinstance(lora_name, str):
        lora_name = lora_name.encode("utf-8")
    return (KVC_SEED + xxh3_64(lora_name, 0)) & 0xFFFFFFFFFFFFFFFF


def to_u32_tokens(tokens):
    """Return a contiguous u32 buffer of ``tokens``.

    Buffers with format ``I``/``L`` of item size 4 pass through; any other
    iterable of ints is truncated to the low 32 bits (``-1`` -> ``0xFFFFFFFF``).
    """
    if isinstance(tokens, (bytes, bytearray)):
        raise TypeError("token buffers must be typed u32 arrays, not raw bytes")
    try:
        mv = memoryview(tokens)
    except TypeError:
        mv = None
    if mv is not None and mv.itemsize == 4 and mv.format in ("I", "L", "=I", "<I") and mv.ndim == 1:
        if mv.c_contiguous:
            return mv
        return memoryview(_array.array("I", mv.tobytes()))
    if not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)       # an iterator must survive the fallback below
    try:
        # PERF: array's own C loop (~7 ms per 1M ints); the masking fallback is ~5x slower
        # and only runs for ids outside [0, 2**32) or non-int items.
        return _array.array("I", tokens)
    except (OverflowError, TypeError):
        return _array.array("I", [int(t) & 0xFFFFFFFF for t in tokens])


def hash_blocks(tokens, size_t block_size, unsigned long long seed=KVC_SEED):
    """LocalBlockHashes of ``tokens`` (u32 buffer or ints) as an ``array('Q')``."""
    buf = to_u32_tokens(tokens)
    cdef const uint32_t[::1] view = buf
    cdef size_t n = view.shape[0]
    cdef size_t nblocks = 0 if block_size == 0 else (n + block_size - 1) // block_size
    out = _array.array("Q", bytes(8 * nblocks))
    cdef uint64_t[::1] ov = out
    if nblocks:
        with nogil:
            hash_token_blocks(&view[0], n, block_size, seed, &ov[0])
    return out


def as_u64(values):
    """Return ``values`` as a contiguous u64 buffer (``array('Q')`` or memoryview).

    u64 buffers pass through without a copy; other iterables are converted and
    must hold ints in ``[0, 2**64)`` (else ``OverflowError``).
    """
    if isinstance(values, _array.array) and values.typecode == "Q":
        return values
    if not isinstance(values, (list, tuple, range)):
        try:
            mv = memoryview(values)
        except TypeError:
            mv = None
        if (mv is not None and mv.ndim == 1 and mv.itemsize == 8
                and mv.format.lstrip("<=@") in ("Q", "L") and mv.c_contiguous):
            return mv
    return _array.array("Q", values)


cdef int u64_view(Py_buffer* v, object values) except -1:
    # PERF: a typed memoryview of the argument (a Cython memoryview object made, its
    # format string parsed) cost ~0.2 us of a 1.2 us CoreIndex.store
    cdef const char* f
    if PyObject_CheckBuffer(values):
        try:
            PyObject_GetBuffer(values, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        except BufferError:
            pass        # not C-contiguous: converted below
        else:
            f = v.format
            if f != NULL and v.itemsize == 8 and v.ndim == 1:
                if f[0] == b"<" or f[0] == b"=" or f[0] == b"@":
                    f += 1
                if (f[0] == b"Q" or f[0] == b"L") and f[1] == 0:
                    return 0
            PyBuffer_Release(v)
    PyObject_GetBuffer(as_u64(values), v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    return 0


cdef inline uint64_t _sub_block_hash(uint64_t h, uint64_t j) noexcept nogil:
    # splitmix64 of h + (j + 1) * golden (kvconductor._py.hash.sub_block_hash is the oracle)
    cdef uint64_t x = h + (j + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return x ^ (x >> 31)


def split_chunk_hashes(hashes, size_t k):
    """The engine hashes of the ``k`` registered blocks each chunk hash of ``hashes``
    stands for (a store-only source's chunk, docs/api.md "Store-only sources"), as one
    ``array('Q')`` of ``len(hashes) * k``: per chunk ``h``, blocks ``0 .. k-2`` get
    ``sub_block_hash(h, j)`` and the last keeps ``h`` (the next chunk names it as parent).
    ``k`` 0 gives an empty array."""
    src = as_u64(hashes)
    cdef const uint64_t[::1] sv = src
    cdef size_t n = sv.shape[0]
    cdef size_t total
    if k and n > (<size_t>-1) // 8 // k:
        raise OverflowError("chunk split too large")
    total = n * k
    out = _array.array("Q", bytes(8 * total))
    cdef uint64_t[::1] ov = out
    cdef size_t i, j, o = 0
    cdef uint64_t h
    if total:
        with nogil:
            for i in range(n):
                h = sv[i]
                for j in range(k - 1):
                    ov[o] = _sub_block_hash(h, j)
                    o += 1
                ov[o] = h
                o += 1
    return out


cdef inline uint64_t _le64(uint64_t x) noexcept nogil:
    """``x`` as the u64 whose bytes in memory are ``x`` little-endian."""
    if _LITTLE:
        return x
    x = ((x & 0x00000000FFFFFFFFULL) << 32) | (x >> 32)
    x = ((x & 0x0000FFFF0000FFFFULL) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFULL)
    return ((x & 0x00FF00FF00FF00FFULL) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFULL)


# -- extra keys (docs/api.md, "Block hashing": "Extra keys") ---------------------------------
# A block's extra keys (vLLM's per-block multimodal hashes with their offsets, cache_salt,
# prompt-embeds digests; the LoRA name is the seed already) fold into one digest, which
# mixes into the block's LocalBlockHash. No extra keys: no digest (0), the hash unchanged.

cdef uint64_t pair_hash(uint64_t a, uint64_t b, uint64_t seed) noexcept nogil:
    cdef uint64_t buf[2]
    buf[0] = _le64(a)
    buf[1] = _le64(b)
    return _XXH3(<const void*>buf, 16, seed)


cdef uint64_t extra_item(int tag, const void* data, size_t n, uint64_t offset) noexcept nogil:
    if tag == XK_MM:
        return pair_hash(_XXH3(data, n, XK_MM), offset, XK_MM)
    return _XXH3(data, n, <uint64_t>tag)


cdef uint64_t extra_fold(uint64_t digest, uint64_t item) noexcept nogil:
    cdef uint64_t d = pair_hash(digest, item, 0)
    return d if d else 1


cdef void mix_extra_locals(uint64_t* local, const uint64_t* digests, size_t n,
                           uint64_t seed) noexcept nogil:
    cdef size_t i
    for i in range(n):
        if digests[i]:
            local[i] = pair_hash(local[i], digests[i], seed)


def extra_digest(items):
    """The digest of one block's extra keys: ``items`` in vLLM's order, each
    ``("mm", identifier, offset)``, ``("salt", cache_salt)`` or ``("embeds", digest
    bytes)``; 0 for no items."""
    cdef uint64_t d = 0
    cdef const uint8_t[::1] view
    for item in items:
        kind = item[0]
        data = item[1].encode("utf-8") if isinstance(item[1], str) else bytes(item[1])
        view = data
        tag = XK_MM if kind == "mm" else (XK_SALT if kind == "salt" else XK_EMBEDS)
        if kind not in ("mm", "salt", "embeds"):
            raise ValueError(f"unknown extra key kind {kind!r}")
        off = (item[2] & 0xFFFFFFFFFFFFFFFF) if kind == "mm" else 0
        d = extra_fold(d, extra_item(tag, &view[0] if view.shape[0] else <const uint8_t*>b"",
                                     view.shape[0], off))
    return d


def mix_extra(local_hashes, digests, unsigned long long seed=KVC_SEED):
    """``local_hashes`` with each block's extra-key digest mixed in (a digest of 0 leaves
    its block's hash as it is), as a new ``array('Q')``; ``digests`` may be shorter."""
    out = _array.array("Q", as_u64(local_hashes))
    dig = as_u64(digests)
    cdef uint64_t[::1] ov = out
    cdef const uint64_t[::1] dv = dig
    cdef size_t n = min(ov.shape[0], dv.shape[0])
    if n:
        with nogil:
            mix_extra_locals(&ov[0], &dv[0], n, seed)
    return out


def query_extra_digests(size_t n_tokens, size_t block_size, cache_salt=None, mm_inputs=()):
    """The extra-key digests of a query's blocks (``ceil(n_tokens / block_size)``, as
    ``array('Q')``), placed as vLLM's ``generate_block_hash_extra_keys`` places them:
    ``cache_salt`` on the first block; each ``(identifier, offset, length)`` of
    ``mm_inputs`` (sorted by offset) on every block it overlaps, with its offset relative
    to the block's start."""
    cdef size_t nb = 0 if block_size == 0 else (n_tokens + block_size - 1) // block_size
    out = _array.array("Q", bytes(8 * nb))
    if nb == 0:
        return out
    cdef uint64_t[::1] ov = out
    feats = sorted(mm_inputs, key=lambda f: f[1])
    cdef size_t nf = len(feats), f, cur = 0, b
    cdef long long start, end, off, length
    ids = _array.array("Q", [_mm_id(x[0]) for x in feats])
    offs = _array.array("q", [x[1] for x in feats])
    lens = _array.array("q", [x[2] for x in feats])
    cdef const uint64_t[::1] idv = ids if nf else _array.array("Q", [0])
    cdef const long long[::1] offv = offs if nf else _array.array("q", [0])
    cdef const long long[::1] lenv = lens if nf else _array.array("q", [0])
    cdef uint64_t d
    for b in range(nb):
        start = <long long>(b * block_size)
        end = start + <long long>block_size
        d = 0
        # vLLM's _gen_mm_extra_hash_keys: the inputs overlapping [start, end), in order
        f = cur
        while f < nf:
            off = offv[f]
            length = lenv[f]
            if end <= off:
                break
            if start >= off + length:
                f += 1
                cur = f
                continue
            d = extra_fold(d, pair_hash(idv[f], <uint64_t>(off - start), XK_MM))
            if end >= off + length:
                f += 1
                cur = f
            else:
                break
        if b == 0 and cache_salt:
            salt = cache_salt.encode("utf-8")
            d = extra_fold(d, _XXH3(<const char*>salt, len(salt), XK_SALT))
        ov[b] = d
    return out


def _mm_id(identifier):
    data = identifier.encode("utf-8")
    return _XXH3(<const char*>data, len(data), XK_MM)


def chain_hashes(local_hashes, unsigned long long seed):
    """A chain's hashes, each naming its whole prefix: ``c[i] = XXH3-64(c[i-1] ||
    local[i], seed)`` over the two u64 little-endian (16 bytes), ``c[-1] = 0``, as one
    ``array('Q')`` (hashed without the GIL; its oracle: ``_py/hash.py``)."""
    src = as_u64(local_hashes)
    cdef const uint64_t[::1] sv = src
    cdef size_t n = sv.shape[0], i
    out = _array.array("Q", bytes(8 * n))
    cdef uint64_t[::1] ov = out
    cdef uint64_t pair[2]
    cdef uint64_t prev = 0
    if n:
        with nogil:
            for i in range(n):
                pair[0] = _le64(prev)
                pair[1] = _le64(sv[i])
                prev = _XXH3(<const void*>pair, 16, seed)
                ov[i] = prev
    return out
