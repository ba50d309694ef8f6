# cython: language_level=3
"""Open-addressing hash maps of u64 keys to u32 values, usable without the GIL.

Linear probing, power-of-two capacity, load factor <= 3/4, backward-shift
deletion (no tombstones). A value of ``HM_NIL`` marks an empty slot, so it can
never be stored. Keys are mixed with the splitmix64 finalizer because engine
hashes may be small integers.

Every function is ``noexcept nogil``; the ones that allocate return -1 on
out-of-memory and leave the map unchanged. The owner of a map (a ``cdef class``
of ``_tree``/``_lower``/``_index``) frees it with ``*_free``.
"""
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

cdef enum:
    HM_NIL = 0xFFFFFFFF           # "no value" / empty slot / no index


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
    free(m.keys)
    free(m.vals)
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
    cdef uint64_t* nk = <uint64_t*>malloc(cap * sizeof(uint64_t))
    cdef uint32_t* nv = <uint32_t*>malloc(cap * sizeof(uint32_t))
    cdef size_t i, j, nmask = cap - 1
    if nk == NULL or nv == NULL:
        free(nk)
        free(nv)
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
        free(m.keys)
        free(m.vals)
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


# -- PairMap: (u64, u64) -> u32, slots as one struct array -------------------------------
cdef struct PSlot:
    uint64_t a                   # first key half (parent engine hash)
    uint64_t b                   # second key half (LocalBlockHash)
    uint64_t c                   # payload carried in the slot (lower tier: the child hash)
    uint32_t v                   # value, HM_NIL = empty slot
    uint32_t hint                # payload (lower tier: the sole owner, or HM_NIL)

cdef struct PairMap:
    PSlot* slots                 # PERF: one cache line holds key and value of a slot
    size_t mask
    size_t size


cdef inline uint64_t pm_hash(uint64_t a, uint64_t b) noexcept nogil:
    return hm_mix(a * <uint64_t>0x9e3779b97f4a7c15 ^ b)


cdef inline void pm_init(PairMap* m) noexcept nogil:
    m.slots = NULL
    m.mask = 0
    m.size = 0


cdef inline void pm_free(PairMap* m) noexcept nogil:
    free(m.slots)
    pm_init(m)


cdef inline size_t pm_nbytes(const PairMap* m) noexcept nogil:
    return 0 if m.slots == NULL else (m.mask + 1) * sizeof(PSlot)


cdef inline uint32_t pm_get(const PairMap* m, uint64_t a, uint64_t b) noexcept nogil:
    if m.slots == NULL:
        return HM_NIL
    cdef size_t i = pm_hash(a, b) & m.mask
    cdef const PSlot* s
    while True:
        s = &m.slots[i]
        if s.v == HM_NIL:
            return HM_NIL
        if s.b == b and s.a == a:
            return s.v
        i = (i + 1) & m.mask


cdef inline PSlot* pm_find(const PairMap* m, uint64_t a, uint64_t b) noexcept nogil:
    """The slot of key (a, b), or NULL. PERF: walks read the payload from it."""
    if m.slots == NULL:
        return NULL
    cdef size_t i = pm_hash(a, b) & m.mask
    cdef PSlot* s
    while True:
        s = &m.slots[i]
        if s.v == HM_NIL:
            return NULL
        if s.b == b and s.a == a:
            return s
        i = (i + 1) & m.mask


cdef inline int pm_rehash(PairMap* m, size_t cap) noexcept nogil:
    cdef PSlot* ns = <PSlot*>malloc(cap * sizeof(PSlot))
    cdef size_t i, j, nmask = cap - 1
    if ns == NULL:
        return -1
    for i in range(cap):
        ns[i].v = HM_NIL
    if m.slots != NULL:
        for i in range(m.mask + 1):
            if m.slots[i].v != HM_NIL:
                j = pm_hash(m.slots[i].a, m.slots[i].b) & nmask
                while ns[j].v != HM_NIL:
                    j = (j + 1) & nmask
                ns[j] = m.slots[i]
        free(m.slots)
    m.slots = ns
    m.mask = nmask
    return 0


cdef inline int pm_put(PairMap* m, uint64_t a, uint64_t b, uint32_t val) noexcept nogil:
    """Insert or overwrite. Returns 1 if inserted, 0 if overwritten, -1 on OOM."""
    if m.slots == NULL:
        if pm_rehash(m, 8) < 0:
            return -1
    elif (m.size + 1) * 4 > (m.mask + 1) * 3:
        if pm_rehash(m, (m.mask + 1) * 2) < 0:
            return -1
    cdef size_t i = pm_hash(a, b) & m.mask
    while m.slots[i].v != HM_NIL:
        if m.slots[i].b == b and m.slots[i].a == a:
            m.slots[i].v = val
            return 0
        i = (i + 1) & m.mask
    m.slots[i].a = a
    m.slots[i].b = b
    m.slots[i].c = 0
    m.slots[i].v = val
    m.slots[i].hint = HM_NIL
    m.size += 1
    return 1


cdef inline uint32_t pm_pop(PairMap* m, uint64_t a, uint64_t b) noexcept nogil:
    if m.slots == NULL:
        return HM_NIL
    cdef size_t mask = m.mask
    cdef size_t i = pm_hash(a, b) & mask, j, k
    cdef uint32_t out
    while True:
        if m.slots[i].v == HM_NIL:
            return HM_NIL
        if m.slots[i].b == b and m.slots[i].a == a:
            break
        i = (i + 1) & mask
    out = m.slots[i].v
    m.slots[i].v = HM_NIL
    j = i
    while True:
        j = (j + 1) & mask
        if m.slots[j].v == HM_NIL:
            break
        k = pm_hash(m.slots[j].a, m.slots[j].b) & mask
        if (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j)):
            continue
        m.slots[i] = m.slots[j]
        m.slots[j].v = HM_NIL
        i = j
    m.size -= 1
    return out


# -- EdgeMap: (u32 node, u64 local) -> u32 node, 16-byte slots (the HBM tree's edges) ----------
cdef struct ESlot:
    uint64_t local               # LocalBlockHash
    uint32_t parent              # parent node index
    uint32_t child               # child node index, HM_NIL = empty slot

cdef struct EdgeMap:
    ESlot* slots
    size_t mask
    size_t size


cdef inline uint64_t em_hash(uint32_t parent, uint64_t local) noexcept nogil:
    return hm_mix((<uint64_t>parent) * <uint64_t>0x9e3779b97f4a7c15 ^ local)


cdef inline void em_init(EdgeMap* m) noexcept nogil:
    m.slots = NULL
    m.mask = 0
    m.size = 0


cdef inline void em_free(EdgeMap* m) noexcept nogil:
    free(m.slots)
    em_init(m)


cdef inline size_t em_nbytes(const EdgeMap* m) noexcept nogil:
    return 0 if m.slots == NULL else (m.mask + 1) * sizeof(ESlot)


cdef inline uint32_t em_get(const EdgeMap* m, uint32_t parent, uint64_t local) noexcept nogil:
    if m.slots == NULL:
        return HM_NIL
    cdef size_t i = em_hash(parent, local) & m.mask
    cdef const ESlot* s
    while True:
        s = &m.slots[i]
        if s.child == HM_NIL:
            return HM_NIL
        if s.local == local and s.parent == parent:
            return s.child
        i = (i + 1) & m.mask


cdef inline int em_rehash(EdgeMap* m, size_t cap) noexcept nogil:
    cdef ESlot* ns = <ESlot*>malloc(cap * sizeof(ESlot))
    cdef size_t i, j, nmask = cap - 1
    if ns == NULL:
        return -1
    for i in range(cap):
        ns[i].child = HM_NIL
    if m.slots != NULL:
        for i in range(m.mask + 1):
            if m.slots[i].child != HM_NIL:
                j = em_hash(m.slots[i].parent, m.slots[i].local) & nmask
                while ns[j].child != HM_NIL:
                    j = (j + 1) & nmask
                ns[j] = m.slots[i]
        free(m.slots)
    m.slots = ns
    m.mask = nmask
    return 0


cdef inline int em_put(EdgeMap* m, uint32_t parent, uint64_t local, uint32_t child) noexcept nogil:
    """Insert or overwrite. Returns 1 if inserted, 0 if overwritten, -1 on OOM."""
    if m.slots == NULL:
        if em_rehash(m, 8) < 0:
            return -1
    elif (m.size + 1) * 4 > (m.mask + 1) * 3:
        if em_rehash(m, (m.mask + 1) * 2) < 0:
            return -1
    cdef size_t i = em_hash(parent, local) & m.mask
    while m.slots[i].child != HM_NIL:
        if m.slots[i].local == local and m.slots[i].parent == parent:
            m.slots[i].child = child
            return 0
        i = (i + 1) & m.mask
    m.slots[i].parent = parent
    m.slots[i].local = local
    m.slots[i].child = child
    m.size += 1
    return 1


cdef inline uint32_t em_pop(EdgeMap* m, uint32_t parent, uint64_t local) noexcept nogil:
    if m.slots == NULL:
        return HM_NIL
    cdef size_t mask = m.mask
    cdef size_t i = em_hash(parent, local) & mask, j, k
    cdef uint32_t out
    while True:
        if m.slots[i].child == HM_NIL:
            return HM_NIL
        if m.slots[i].local == local and m.slots[i].parent == parent:
            break
        i = (i + 1) & mask
    out = m.slots[i].child
    m.slots[i].child = HM_NIL
    j = i
    while True:
        j = (j + 1) & mask
        if m.slots[j].child == HM_NIL:
            break
        k = em_hash(m.slots[j].parent, m.slots[j].local) & mask
        if (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j)):
            continue
        m.slots[i] = m.slots[j]
        m.slots[j].child = HM_NIL
        i = j
    m.size -= 1
    return out
