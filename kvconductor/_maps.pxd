# cython: language_level=3
"""Open-addressing hash maps to u32 values, usable without the GIL.

``U64Map`` (u64 keys) stores its keys: linear probing, power-of-two capacity, load
factor <= 3/4, backward-shift deletion (no tombstones). ``FpMap`` stores only a 32-bit
fingerprint and lets its owner read the key back from the item (the HBM tree's and the
CPU/Disk tiers' edges and reverse maps; see its section). A
value of ``HM_NIL`` (the "no item" index of ``_pool``) marks an empty slot, so it can
never be stored. Keys are mixed with the splitmix64 finalizer because engine hashes
may be small integers.

Every function is ``noexcept nogil``; the ones that allocate return -1 on
out-of-memory and leave the map unchanged. The owner of a map (a ``cdef class``
of ``_tree``/``_lower``/``_index``) frees it with ``*_free``.
"""
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from kvconductor._pool cimport HM_NIL, grow_array, mem_alloc, mem_free


# Read prefetch of a slot a walk will probably probe soon (a no-op on other compilers).
cdef extern from "kvconductor/c/maps.h":
    void prefetch "kvc_prefetch"(const void* p) noexcept nogil


cdef inline uint64_t hm_mix(uint64_t x) noexcept nogil:
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


# -- U64Map: u64 -> u32 ---------------------------------------------------------------
cdef struct U64Map:
    uint64_t* keys               # slot keys (valid where vals[i] != HM_NIL)
    uint32_t* vals               # slot values, HM_NIL = empty
    size_t mask                  # capacity - 1 (capacity a power of two; 0 when unallocated)
    size_t size                  # live entries


cdef inline void u64m_init(U64Map* m) noexcept nogil:
    m.keys = NULL
    m.vals = NULL
    m.mask = 0
    m.size = 0


cdef inline void u64m_free(U64Map* m) noexcept nogil:
    mem_free(m.keys)
    mem_free(m.vals)
    u64m_init(m)


cdef inline size_t u64m_nbytes(const U64Map* m) noexcept nogil:
    return 0 if m.keys == NULL else (m.mask + 1) * 12


cdef inline uint32_t u64m_get(const U64Map* m, uint64_t key) noexcept nogil:
    if m.keys == NULL:
        return HM_NIL
    cdef size_t i = hm_mix(key) & m.mask
    cdef uint32_t v
    while True:
        v = m.vals[i]
        if v == HM_NIL:
            return HM_NIL
        if m.keys[i] == key:
            return v
        i = (i + 1) & m.mask


cdef inline int u64m_rehash(U64Map* m, size_t cap) noexcept nogil:
    cdef uint64_t* nk = <uint64_t*>mem_alloc(cap * sizeof(uint64_t))
    cdef uint32_t* nv = <uint32_t*>mem_alloc(cap * sizeof(uint32_t))
    cdef size_t i, j, nmask = cap - 1
    if nk == NULL or nv == NULL:
        mem_free(nk)
        mem_free(nv)
        return -1
    memset(nv, 0xFF, cap * sizeof(uint32_t))
    if m.keys != NULL:
        for i in range(m.mask + 1):
            if m.vals[i] != HM_NIL:
                j = hm_mix(m.keys[i]) & nmask
                while nv[j] != HM_NIL:
                    j = (j + 1) & nmask
                nk[j] = m.keys[i]
                nv[j] = m.vals[i]
        mem_free(m.keys)
        mem_free(m.vals)
    m.keys = nk
    m.vals = nv
    m.mask = nmask
    return 0


cdef inline int u64m_put(U64Map* m, uint64_t key, uint32_t val) noexcept nogil:
    """Insert or overwrite. Returns 1 if inserted, 0 if overwritten, -1 on OOM."""
    if m.keys == NULL:
        if u64m_rehash(m, 8) < 0:
            return -1
    elif (m.size + 1) * 4 > (m.mask + 1) * 3:
        if u64m_rehash(m, (m.mask + 1) * 2) < 0:
            return -1
    cdef size_t i = hm_mix(key) & m.mask
    while m.vals[i] != HM_NIL:
        if m.keys[i] == key:
            m.vals[i] = val
            return 0
        i = (i + 1) & m.mask
    m.keys[i] = key
    m.vals[i] = val
    m.size += 1
    return 1


cdef inline uint32_t u64m_pop(U64Map* m, uint64_t key) noexcept nogil:
    """Delete ``key``; return its value or HM_NIL when absent."""
    if m.keys == NULL:
        return HM_NIL
    cdef size_t mask = m.mask
    cdef size_t i = hm_mix(key) & mask, j, k
    cdef uint32_t out
    while True:
        if m.vals[i] == HM_NIL:
            return HM_NIL
        if m.keys[i] == key:
            break
        i = (i + 1) & mask
    out = m.vals[i]
    m.vals[i] = HM_NIL
    j = i
    while True:
        j = (j + 1) & mask
        if m.vals[j] == HM_NIL:
            break
        k = hm_mix(m.keys[j]) & mask
        # the entry at j may stay iff its home k lies cyclically in (i, j]
        if (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j)):
            continue
        m.keys[i] = m.keys[j]
        m.vals[i] = m.vals[j]
        m.vals[j] = HM_NIL
        i = j
    m.size -= 1
    return out


cdef inline int u64m_check(const U64Map* m) noexcept nogil:
    """Checker: 0 when ``size`` counts the used slots, the load factor holds and every
    key is found from its home slot (with its own value); -1 otherwise."""
    cdef size_t i, n = 0
    if m.keys == NULL or m.vals == NULL:
        return 0 if m.size == 0 and m.keys == NULL and m.vals == NULL else -1
    for i in range(m.mask + 1):
        if m.vals[i] != HM_NIL:
            n += 1
            if u64m_get(m, m.keys[i]) != m.vals[i]:
                return -1
    return 0 if n == m.size and n * 4 <= (m.mask + 1) * 3 else -1


# -- key hashes of the FpMap owners ------------------------------------------------------
# pm_hash: a lower tier's (parent engine hash, local) edge key; em_hash: the tree's
# (parent node, local) edge key.
cdef inline uint64_t pm_hash(uint64_t a, uint64_t b) noexcept nogil:
    return hm_mix(a * <uint64_t>0x9e3779b97f4a7c15 ^ b)


cdef inline uint64_t em_hash(uint32_t parent, uint64_t local) noexcept nogil:
    return hm_mix((<uint64_t>parent) * <uint64_t>0x9e3779b97f4a7c15 ^ local)


# -- FpMap: u32 items found through a 32-bit fingerprint of their key -----------------------
# The key lives in the item itself (a tree node, a member record), so a slot is 8 bytes:
# the item's index and a 32-bit fingerprint of the key's hash. The owner walks the probe
# run from the fingerprint's home (``fpm_first`` / ``fpm_next``) and checks each
# fingerprint hit against the item; rehashing and deleting need only the fingerprint,
# never the item. The home is ``fp * cap >> 32`` (any capacity, not just powers of two),
# so the table grows by 1.5x at a load of 13/16 and stays between 54 % and 81 % full.
# PERF: at 7/8 the same tables were ~15 % slower to fill (longer probe runs) for ~7 %
# fewer bytes; 13/16 stores faster than the 3/4 maps with keys it replaced.
cdef struct FSlot:
    uint32_t idx                 # item index, HM_NIL = empty slot
    uint32_t fp                  # the key's fingerprint (low 32 bits of its hash)

cdef struct FpMap:
    FSlot* slots
    size_t cap                   # slots (at most 2**32; 0 when unallocated)
    size_t size


cdef inline size_t fpm_home(const FpMap* m, uint32_t fp) noexcept nogil:
    return <size_t>((<uint64_t>fp * m.cap) >> 32)


cdef inline void fpm_init(FpMap* m) noexcept nogil:
    m.slots = NULL
    m.cap = 0
    m.size = 0


cdef inline void fpm_free(FpMap* m) noexcept nogil:
    mem_free(m.slots)
    fpm_init(m)


cdef inline size_t fpm_nbytes(const FpMap* m) noexcept nogil:
    return m.cap * sizeof(FSlot)


cdef inline int _fpm_rehash(FpMap* m, size_t cap) noexcept nogil:
    cdef FpMap nm
    cdef size_t i, j
    if cap > (<size_t>1 << 32):
        return -1
    nm.slots = <FSlot*>mem_alloc(cap * sizeof(FSlot))
    if nm.slots == NULL:
        return -1
    nm.cap = cap
    nm.size = m.size
    memset(nm.slots, 0xFF, cap * sizeof(FSlot))
    if m.slots != NULL:
        for i in range(m.cap):
            if m.slots[i].idx != HM_NIL:
                j = fpm_home(&nm, m.slots[i].fp)
                while nm.slots[j].idx != HM_NIL:
                    j = 0 if j + 1 == cap else j + 1
                nm.slots[j] = m.slots[i]
        mem_free(m.slots)
    m[0] = nm
    return 0


cdef inline int fpm_reserve_one(FpMap* m) noexcept nogil:
    """Room for one more entry (load factor <= 13/16); -1 on OOM, map unchanged."""
    if m.slots == NULL:
        return _fpm_rehash(m, 8)
    if (m.size + 1) * 16 > m.cap * 13:
        return _fpm_rehash(m, m.cap + m.cap // 2)
    return 0


cdef inline int fpm_reserve(FpMap* m, size_t k) noexcept nogil:
    """Room for ``k`` more entries in one rehash, at the capacity ``k`` calls of
    ``fpm_reserve_one`` would reach (the same steps: 8, then 1.5x); -1 on OOM, map
    unchanged. PERF: a store of n blocks into a small map rehashed it up to n / 3 times."""
    cdef size_t cap = m.cap
    if cap == 0:
        cap = 8
    while (m.size + k) * 16 > cap * 13:
        cap += cap // 2
    if cap == m.cap:
        return 0
    return _fpm_rehash(m, cap)


cdef inline void fpm_insert(FpMap* m, uint32_t fp, uint32_t idx) noexcept nogil:
    """Add an entry whose key is not in the map, after ``fpm_reserve_one`` succeeded."""
    cdef size_t i = fpm_home(m, fp)
    while m.slots[i].idx != HM_NIL:
        i = 0 if i + 1 == m.cap else i + 1
    m.slots[i].idx = idx
    m.slots[i].fp = fp
    m.size += 1


cdef inline size_t fpm_next(const FpMap* m, uint32_t fp, size_t i) noexcept nogil:
    """The next slot after used slot ``i`` holding ``fp`` or empty."""
    while True:
        i = 0 if i + 1 == m.cap else i + 1
        if m.slots[i].idx == HM_NIL or m.slots[i].fp == fp:
            return i


cdef inline size_t fpm_first(const FpMap* m, uint32_t fp) noexcept nogil:
    """The first slot from ``fp``'s home on holding ``fp`` or empty (map allocated)."""
    cdef size_t i = fpm_home(m, fp)
    if m.slots[i].idx == HM_NIL or m.slots[i].fp == fp:
        return i
    return fpm_next(m, fp, i)


cdef inline void fpm_delete_at(FpMap* m, size_t i) noexcept nogil:
    """Empty used slot ``i``; backward-shift the cluster after it (no tombstones)."""
    cdef size_t j = i, k
    m.slots[i].idx = HM_NIL
    while True:
        j = 0 if j + 1 == m.cap else j + 1
        if m.slots[j].idx == HM_NIL:
            break
        k = fpm_home(m, m.slots[j].fp)
        # the entry at j may stay iff its home k lies cyclically in (i, j]
        if (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j)):
            continue
        m.slots[i] = m.slots[j]
        m.slots[j].idx = HM_NIL
        i = j
    m.size -= 1


cdef inline int fpm_check(const FpMap* m) noexcept nogil:
    """Checker: 0 when ``size`` counts the used slots, the load factor holds and every
    entry is reachable from its home slot (no empty slot in between); -1 otherwise."""
    cdef size_t i, j, n = 0
    if m.slots == NULL:
        return 0 if m.size == 0 and m.cap == 0 else -1
    for i in range(m.cap):
        if m.slots[i].idx != HM_NIL:
            n += 1
            j = fpm_home(m, m.slots[i].fp)
            while j != i:
                if m.slots[j].idx == HM_NIL:
                    return -1
                j = 0 if j + 1 == m.cap else j + 1
    return 0 if n == m.size and n * 16 <= m.cap * 13 else -1


# -- per-worker reverse maps: one FpMap (engine hash -> item) per worker id ----------------
# The tree and both lower tiers keep ``FpMap* rev`` of ``nrev`` entries; these are the one
# copy of how that array grows, is freed, measured and counted.
cdef inline int revs_ensure(FpMap** rev, size_t* nrev, uint32_t worker) noexcept nogil:
    """Grow ``rev[0]`` to hold ``worker`` (new maps empty); -1 on OOM (unchanged)."""
    cdef size_t old = nrev[0], cap = nrev[0], w
    cdef void* p
    if worker < old:
        return 0
    p = grow_array(rev[0], &cap, <size_t>worker + 1, sizeof(FpMap))
    if p == NULL:
        return -1
    rev[0] = <FpMap*>p
    for w in range(old, cap):
        fpm_init(&rev[0][w])
    nrev[0] = cap
    return 0


cdef inline void revs_free(FpMap** rev, size_t* nrev) noexcept nogil:
    cdef size_t w
    if rev[0] != NULL:
        for w in range(nrev[0]):
            fpm_free(&rev[0][w])
    mem_free(rev[0])
    rev[0] = NULL
    nrev[0] = 0


cdef inline size_t revs_nbytes(const FpMap* rev, size_t nrev) noexcept nogil:
    cdef size_t w, n = nrev * sizeof(FpMap)
    for w in range(nrev):
        n += fpm_nbytes(&rev[w])
    return n


cdef inline size_t revs_count(const FpMap* rev, size_t nrev, uint32_t worker) noexcept nogil:
    """Entries of ``worker``'s map (0 past the end)."""
    return rev[worker].size if worker < nrev else 0
