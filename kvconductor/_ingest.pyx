# cython: language_level=3
"""Compiled fast path of vLLM / SGLang ``KVEventBatch`` ingest (HBM subscriptions).

:class:`FastBatch` parses one whole batch payload without the GIL and, when
every event is one the fast path handles, applies it to a
:class:`~kvconductor._index.CoreIndex` under one write lock. Anything else
(another medium, a bad hash, a pool-looking map, an odd envelope, ...) makes
:meth:`FastBatch.parse` return -1 *before anything is mutated*; the caller then
uses the general Python path (``kvconductor.ingest.apply``), which stays the
reference for the semantics. Exactly what is accepted is documented in
``docs/events.md`` ("Compiled fast path") and fuzzed against the Python path in
``tests/test_ingest.py``.

Two calls per batch, so the Python side decides *between* them which index and
which worker ids to use (``get_or_create_index`` is only called for batches with
events, the HBM worker is only created when an event needs it, as the Python
path does)::

    n = fb.parse(payload, registered_block_size)      # -1: use the Python path
    blocks, parent_not_found, invalid_sequence, oom = fb.apply(core, hbm_worker, clear_ids)
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, strlen

from kvconductor._hash cimport (KVC_SEED, XK_EMBEDS, XK_MM, XK_SALT, extra_fold, extra_item,
                                hash_token_blocks, mix_extra_locals, xxh3)
from kvconductor._pool cimport HM_NIL, grow_array, live_allocations, mem_free
from kvconductor._index cimport OP_CLEAR, OP_EVICT, OP_STORE, BatchOp, CoreIndex
from kvconductor._tree cimport T_ERR_PARENT, T_ERR_SEQUENCE
from kvconductor._readers cimport (WIRE_EOF, WIRE_OK, _eq, _left, mp_bin, mp_container, mp_int,
                                   mp_skip, mp_str, mp_u32_array, wcur)

import array as _array

# -- result flags of a parsed batch ------------------------------------------------------
cdef enum:
    BATCH_NEEDS_WORKER = 1          # a store or removal targets the HBM worker (create it)
    BATCH_TOUCHES = 2               # a store targets the HBM worker (Applier.touched)
    BATCH_HAS_CLEAR = 4             # an AllBlocksCleared (pass the default media's worker ids)

# -- why parse() declined (reason codes) ----------------------------------------------------
cdef enum:
    R_OK = 0
    R_ENVELOPE = 1
    R_TRUNCATED = 2
    R_EVENT = 3
    R_MEDIUM = 4
    R_HASH = 5
    R_FIELD = 6
    R_POOL_KEY = 7
    R_DUPLICATE = 8
    R_TOKENS = 9
    R_BLOCK_SIZE = 10
    R_SKIPPED_VALUE = 11
    R_OOM = 12
    R_LORAS = 13            # more distinct LoRA names than LORA_MAX in one batch
    R_EXTRA = 14            # extra_keys of a shape that is not vLLM's (the Python path drops)

_REASONS = ("", "envelope", "truncated", "event", "medium", "hash", "field", "pool_key",
            "duplicate_key", "tokens", "block_size", "skipped_value", "out_of_memory",
            "too_many_loras", "extra_keys")

# -- event kinds and field ids -------------------------------------------------------------
cdef enum:
    K_STORED = 0
    K_REMOVED = 1
    K_CLEARED = 2

cdef enum:
    FID_TYPE = 0
    FID_HASHES = 1
    FID_PARENT = 2
    FID_TOKENS = 3
    FID_BLOCK_SIZE = 4
    FID_LORA_ID = 5
    FID_MEDIUM = 6
    FID_LORA_NAME = 7
    FID_GROUP = 8
    FID_KIND = 9
    FID_WINDOW = 10
    FID_LOCALITY = 11
    FID_OWNERSHIP = 12
    FID_SESSION = 13
    FID_EXTRA = 14              # extra_keys: mixed into the blocks' local hashes
    FID_SALT = 15               # SGLang's cache_salt: mixed into a chain's first block
    FID_POOL = 16               # event_type / seq_hashes / backend_id / event_id
    FID_SKIP = 17               # ignored by the decoders (skipped as raw msgpack)
    FID_DECLINE = 18            # tokens_hashes: the general path applies such an event

# Map keys each event struct of kvconductor.ingest.vllm declares (others are skipped).
cdef uint32_t _KNOWN_STORED = (1 << 16) - 1
cdef uint32_t _KNOWN_REMOVED = ((1 << FID_TYPE) | (1 << FID_HASHES) | (1 << FID_MEDIUM)
                                | (1 << FID_GROUP))
cdef uint32_t _KNOWN_CLEARED = 1 << FID_TYPE

# Array (positional) events: field id of position 1, 2, ... (beyond the table: skipped).
cdef int _POS_STORED[11]
_POS_STORED[:] = [FID_HASHES, FID_PARENT, FID_TOKENS, FID_BLOCK_SIZE, FID_LORA_ID, FID_MEDIUM,
                  FID_LORA_NAME, FID_EXTRA, FID_GROUP, FID_KIND, FID_WINDOW]
cdef int _POS_REMOVED[3]
_POS_REMOVED[:] = [FID_HASHES, FID_MEDIUM, FID_GROUP]

# String tables. Their Python twins (kvconductor.keys, kvconductor.ingest.apply and
# the structs of kvconductor.ingest.vllm) are tied to them by tests/test_shapes.py
# through the module-level tuples below.
cdef extern from "kvconductor/c/ingest.h":
    ctypedef struct lit_t "kvi_lit":
        const char* s
        size_t n
    const lit_t _HBM_MEDIA "kvi_hbm_media"[10]
    const lit_t _REJECTED_KINDS "kvi_rejected_kinds"[6]

# Map key of each field id FID_TYPE .. FID_SALT (what _fid recognises), and the
# pool-event keys that make it FID_POOL.
cdef const char* _FID_NAMES[16]
_FID_NAMES[:] = [b"type", b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size",
                 b"lora_id", b"medium", b"lora_name", b"group_idx", b"kv_cache_spec_kind",
                 b"kv_cache_spec_sliding_window", b"locality", b"ownership", b"session_id",
                 b"extra_keys", b"cache_salt"]
cdef const char* _POOL_NAMES[4]
_POOL_NAMES[:] = [b"event_type", b"seq_hashes", b"backend_id", b"event_id"]


cdef tuple _names(const int* fids, int n):
    return tuple([None if fids[i] == FID_SKIP else _FID_NAMES[fids[i]].decode()
                  for i in range(n)])


cdef tuple _known(uint32_t mask):
    return tuple([_FID_NAMES[i].decode() for i in range(16) if mask & (1u << i)])


#: Medium strings the fast path takes as HBM ("" too); keys.parse_medium's NPU aliases.
HBM_MEDIA = tuple([_HBM_MEDIA[i].s[:_HBM_MEDIA[i].n].decode() for i in range(10)])
#: apply.REJECTED_KINDS, from the C table the fast path uses.
REJECTED_KINDS = tuple([_REJECTED_KINDS[i].s[:_REJECTED_KINDS[i].n].decode() for i in range(6)])
#: Fields of positions 1, 2, ... of an array-form BlockStored / BlockRemoved (None: skipped).
STORED_POSITIONS = _names(_POS_STORED, 11)
REMOVED_POSITIONS = _names(_POS_REMOVED, 3)
#: Map keys a map-form BlockStored / BlockRemoved / AllBlocksCleared reads ("type" included).
STORED_KEYS = _known(_KNOWN_STORED)
REMOVED_KEYS = _known(_KNOWN_REMOVED)
CLEARED_KEYS = _known(_KNOWN_CLEARED)
#: Keys that make a map a pool event (apply._POOL_KEYS).
POOL_KEYS = tuple([_POOL_NAMES[i].decode() for i in range(4)])
#: Map keys the decoders read that make the fast path decline an event.
DECLINED_KEYS = ("tokens_hashes",)


cdef enum:
    # deeper skipped values: the Python path (msgspec has a limit); at most
    # _readers.MP_SKIP_MAX_DEPTH
    MAX_DEPTH = 32
    TRIM_ITEMS = 1 << 20        # scratch above this many items is freed after a batch
    # Up to these sizes a batch is parsed, and applied (when the write lock is free), with
    # the GIL held: tens of microseconds at most, less than a GIL handoff costs a busy
    # server. Larger ones release it.
    PARSE_GIL_BYTES = 32 * 1024
    APPLY_GIL_BLOCKS = 256


cdef inline int _r(int rc, int other) noexcept nogil:
    """The R_* code of a msgpack reader's WIRE_* result (the one place they are mapped):
    R_OK, R_TRUNCATED, or ``other`` for a value of another type (cursor unchanged)."""
    if rc == WIRE_OK:
        return R_OK
    return R_TRUNCATED if rc == WIRE_EOF else other


cdef inline int _container(wcur* c, bint is_map, size_t* n) noexcept nogil:
    """Array or map header (WIRE_* code); every element (map: key and value) needs >= 1
    more byte, else WIRE_EOF."""
    cdef int rc = mp_container(c, 0x80 if is_map else 0x90, 0xde if is_map else 0xdc, n)
    if rc == WIRE_OK and (2 * n[0] if is_map else n[0]) > _left(c):
        return WIRE_EOF
    return rc


cdef inline bint _one_byte(uint8_t b) noexcept nogil:
    """nil, bool or fixint: a whole value in its first byte."""
    return b <= 0x7f or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3


cdef inline bint _ascii(const uint8_t* s, size_t n) noexcept nogil:
    cdef size_t i
    for i in range(n):
        if s[i] >= 0x80:
            return False
    return True


cdef inline int _skip(wcur* c) noexcept nogil:
    """Skip one value the decoders ignore (raw msgpack). Ext values, byte 0xc1 and
    nesting deeper than MAX_DEPTH are left to the Python path."""
    return _r(mp_skip(c, MAX_DEPTH, False), R_SKIPPED_VALUE)


cdef int _any(wcur* c) noexcept nogil:
    """A field the decoders type as ``Any`` (decoded to a Python object, then unused):
    nil, bool, int, float, bin or ASCII str; anything else -> Python path."""
    cdef size_t left = _left(c), n
    cdef const uint8_t* s
    cdef uint8_t b
    cdef int rc
    if left == 0:
        return R_TRUNCATED
    b = c.p[0]
    if _one_byte(b):
        c.p += 1
        return R_OK
    if 0xca <= b <= 0xd3 or 0xc4 <= b <= 0xc6:
        return _skip(c)
    rc = _r(mp_str(c, &s, &n), R_FIELD)
    if rc == R_OK and not _ascii(s, n):
        rc = R_FIELD
    return rc


cdef inline int _nil(wcur* c) noexcept nogil:
    if c.p < c.end and c.p[0] == 0xc0:
        c.p += 1
        return 1
    return 0


cdef inline int _hash(wcur* c, uint64_t* h) noexcept nogil:
    """engine_hash: int (negative: two's complement) or non-empty bin (last 8 bytes BE)."""
    cdef uint64_t v = 0
    cdef bint neg
    cdef const uint8_t* s
    cdef size_t n, i
    cdef int rc = _r(mp_int(c, h, &neg), R_HASH)
    if rc != R_HASH:
        return rc               # an int, or truncated
    rc = _r(mp_bin(c, &s, &n), R_HASH)
    if rc == R_OK and n == 0:
        rc = R_HASH
    if rc:
        return rc               # str (parse_hash_str), bool, float, nil, empty bin, ...
    i = n - 8 if n > 8 else 0
    while i < n:
        v = (v << 8) | s[i]
        i += 1
    h[0] = v
    return R_OK


cdef inline int _tag(wcur* c, int* kind) noexcept nogil:
    cdef const uint8_t* s
    cdef size_t n
    cdef int rc = _r(mp_str(c, &s, &n), R_EVENT)
    if rc:
        return rc
    if n == 11 and memcmp(s, b"BlockStored", 11) == 0:
        kind[0] = K_STORED
    elif n == 12 and memcmp(s, b"BlockRemoved", 12) == 0:
        kind[0] = K_REMOVED
    elif n == 16 and memcmp(s, b"AllBlocksCleared", 16) == 0:
        kind[0] = K_CLEARED
    else:
        return R_EVENT
    return R_OK


# Every map key _fid names, grouped by length: the fields, the pool keys, the declined key.
cdef enum:
    NKEYS = 21
    KEY_MAXLEN = 28
cdef const char* _KEYS[NKEYS]
cdef int _KEY_FID[NKEYS]
cdef int _KEY_FROM[KEY_MAXLEN + 2]   # the keys of length n: _KEY_FROM[n] <= k < _KEY_FROM[n + 1]


cdef int _index_keys() noexcept:
    cdef const char* names[NKEYS]
    cdef int fids[NKEYS]
    cdef int i, n, k = 0
    for i in range(16):
        names[i] = _FID_NAMES[i]
        fids[i] = i
    for i in range(4):
        names[16 + i] = _POOL_NAMES[i]
        fids[16 + i] = FID_POOL
    names[20] = b"tokens_hashes"
    fids[20] = FID_DECLINE
    for n in range(KEY_MAXLEN + 1):
        _KEY_FROM[n] = k
        for i in range(NKEYS):
            if strlen(names[i]) == <size_t>n:
                _KEYS[k] = names[i]
                _KEY_FID[k] = fids[i]
                k += 1
    _KEY_FROM[KEY_MAXLEN + 1] = k
    return k


if _index_keys() != NKEYS:
    raise ImportError("_ingest: a map key longer than KEY_MAXLEN")


cdef int _fid(const uint8_t* s, size_t n) noexcept nogil:
    """Field id of a map key (FID_SKIP for keys no decoder declares)."""
    cdef int k
    if n > KEY_MAXLEN:
        return FID_SKIP
    for k in range(_KEY_FROM[n], _KEY_FROM[n + 1]):
        if memcmp(s, _KEYS[k], n) == 0:
            return _KEY_FID[k]
    return FID_SKIP


cdef bint _hbm_medium(const uint8_t* s, size_t n) noexcept nogil:
    """Strings kvconductor.keys.parse_medium maps to NPU ("" counts as absent)."""
    cdef int i
    if n == 0:
        return True
    for i in range(10):
        if _eq(s, n, _HBM_MEDIA[i].s, _HBM_MEDIA[i].n):
            return True
    return False


cdef bint _kind_rejected(const uint8_t* s, size_t n) noexcept nogil:
    """apply.kind_rejected for an ASCII kind: lower-case, '_' removed, in REJECTED_KINDS."""
    cdef char k[32]
    cdef size_t i, m = 0
    cdef uint8_t ch
    cdef int j
    for i in range(n):
        ch = s[i]
        if ch == 0x5f:
            continue
        if m >= 32:
            return False
        if 0x41 <= ch <= 0x5a:
            ch += 32
        k[m] = <char>ch
        m += 1
    for j in range(6):
        if _eq(<const uint8_t*>k, m, _REJECTED_KINDS[j].s, _REJECTED_KINDS[j].n):
            return True
    return False


def _fid_of(str name):
    """_fid of a map key (tests tie it to the names table)."""
    cdef bytes b = name.encode()
    return _fid(<const uint8_t*>PyBytes_AS_STRING(b), <size_t>PyBytes_GET_SIZE(b))


include "_ingest_kind.pxi"


cdef class FastBatch:
    """Parse buffer and applier of the vLLM/SGLang HBM fast path (one per subscription;
    not thread-safe: the ingest thread only)."""

    def __cinit__(self, uint64_t seed=KVC_SEED):
        # (Cython zero-fills the C fields: no scratch, capacities and counts 0, why R_OK)
        self.seed = seed
        self.nevents = -1

    def __dealloc__(self):
        mem_free(self.hs)
        mem_free(self.loc)
        mem_free(self.xd)
        mem_free(self.tok)
        mem_free(self.recs)
        mem_free(self.ops)
        mem_free(self.clear)

    cdef int _reserve_hashes(self, size_t need) noexcept nogil:
        cdef size_t cap
        cdef void* p
        if need <= self.hs_cap:
            return 0
        cap = self.hs_cap
        p = grow_array(self.hs, &cap, need, sizeof(uint64_t))
        if p == NULL:
            return -1
        self.hs = <uint64_t*>p
        cap = self.hs_cap
        p = grow_array(self.loc, &cap, need, sizeof(uint64_t))
        if p == NULL:
            return -1
        self.loc = <uint64_t*>p
        cap = self.hs_cap
        p = grow_array(self.xd, &cap, need, sizeof(uint64_t))
        if p == NULL:
            return -1
        self.xd = <uint64_t*>p
        self.hs_cap = cap
        return 0

    cdef int _field(self, wcur* c, int fid, Ev* ev) noexcept nogil:
        """Read one declared field of the current event into ``ev``."""
        cdef size_t n, i, cnt
        cdef const uint8_t* s
        cdef uint64_t v
        cdef bint neg
        cdef int rc
        cdef void* p
        if fid == FID_SKIP:
            return _skip(c)
        if fid == FID_POOL:
            return R_POOL_KEY
        if _nil(c):
            return R_OK         # nil: the field's default, which _event set (each field once)
        if fid == FID_HASHES:
            rc = _r(_container(c, False, &n), R_HASH)
            if rc or n == 0:
                return rc
            if self._reserve_hashes(self.hs_used + n) < 0:
                return R_OOM
            for i in range(n):
                rc = _hash(c, &self.hs[self.hs_used + i])
                if rc:
                    return rc
            ev.nh = n
            return R_OK
        if fid == FID_PARENT:
            rc = _hash(c, &ev.parent)
            if rc == R_OK:
                ev.has_parent = 1
            return rc
        if fid == FID_TOKENS:
            rc = _r(_container(c, False, &n), R_TOKENS)
            if rc or n == 0:
                return rc
            if n > self.tok_cap:
                p = grow_array(self.tok, &self.tok_cap, n, sizeof(uint32_t))
                if p == NULL:
                    return R_OOM
                self.tok = <uint32_t*>p
            if mp_u32_array(c, self.tok, n, &cnt) != WIRE_OK:
                return R_TOKENS     # not an int, truncated, or >= 2**63 (the Python path decides)
            ev.ntok = n
            return R_OK
        if fid == FID_SALT:
            if mp_str(c, &s, &n) != WIRE_OK:
                return _any(c)      # not a string: no salt (as the Python decoder)
            if not _utf8_ok(s, n):
                return R_FIELD
            ev.salt = s
            ev.salt_n = n
            return R_OK
        if fid == FID_EXTRA:
            ev.xk = c.p             # read once the event's LoRA name and blocks are known
            rc = _skip(c)
            ev.xkn = c.p - ev.xk
            return rc
        if fid == FID_BLOCK_SIZE:
            rc = _r(mp_int(c, &v, &neg), R_FIELD)
            if rc:
                return rc
            if neg or v > <uint64_t>0xFFFFFFFF:
                return R_BLOCK_SIZE
            ev.bs = v
            return R_OK
        if fid == FID_MEDIUM or fid == FID_LORA_NAME or fid == FID_KIND:
            rc = _r(mp_str(c, &s, &n), R_FIELD)
            if rc:
                return rc
            if fid == FID_MEDIUM:
                return R_OK if _hbm_medium(s, n) else R_MEDIUM
            if not _ascii(s, n):
                return R_FIELD
            if fid == FID_LORA_NAME:
                ev.seed = <uint64_t>KVC_SEED + xxh3(s, n, 0) if n else self.seed
                ev.lora = s
                ev.lora_n = n
            else:
                ev.kind_rejected = _kind_rejected(s, n)
            return R_OK
        return _any(c)          # lora_id, group_idx, sliding window, locality, ownership, session

    cdef int _event(self, wcur* c, long long reg) noexcept nogil:
        cdef Ev ev
        cdef size_t n, i, _k, pairs_done = 0, nb, nstore
        cdef const uint8_t* s
        cdef const uint8_t* save
        cdef int kind = -1, rc, fid, k2
        cdef uint32_t known, bit
        cdef bint xk
        cdef uint64_t salt
        cdef EvRec* r
        ev.nh = 0
        ev.ntok = 0
        ev.parent = 0
        ev.bs = 0
        ev.seed = self.seed
        ev.seen = 0
        ev.has_parent = 0
        ev.kind_rejected = 0
        ev.xkn = ev.lora_n = ev.salt_n = 0
        rc = _r(_container(c, False, &n), R_EVENT)     # R_EVENT: not an array, a map?
        if rc == R_TRUNCATED:
            return rc
        if rc == R_OK:
            # -- array form: tag, then fields by position -----------------------------------
            if n == 0:
                return R_EVENT
            rc = _tag(c, &kind)
            if rc:
                return rc
            for i in range(1, n):
                if kind == K_STORED and i <= 11:
                    fid = _POS_STORED[i - 1]
                elif kind == K_REMOVED and i <= 3:
                    fid = _POS_REMOVED[i - 1]
                else:
                    fid = FID_SKIP
                rc = self._field(c, fid, &ev)
                if rc:
                    return rc
        else:
            # -- map form: by name; "type" first in practice, anywhere per msgspec --------
            rc = _r(_container(c, True, &n), R_EVENT)
            if rc:
                return rc
            save = c.p
            if n:
                if mp_str(c, &s, &i) == WIRE_OK and _eq(s, i, b"type", 4):
                    rc = _tag(c, &kind)
                    if rc:
                        return rc
                    pairs_done = 1
                    ev.seen = 1 << FID_TYPE
                else:
                    c.p = save
            if kind < 0:
                for _k in range(n):
                    rc = _r(mp_str(c, &s, &nb), R_EVENT)
                    if rc:
                        return rc
                    if _eq(s, nb, b"type", 4):
                        if kind >= 0:
                            return R_DUPLICATE
                        rc = _tag(c, &kind)
                    else:
                        rc = _skip(c)
                    if rc:
                        return rc
                if kind < 0:
                    return R_EVENT      # no "type": msgspec cannot pick the struct
                c.p = save
            known = _KNOWN_STORED if kind == K_STORED else (
                _KNOWN_REMOVED if kind == K_REMOVED else _KNOWN_CLEARED)
            for _k in range(pairs_done, n):
                rc = _r(mp_str(c, &s, &nb), R_EVENT)
                if rc:
                    return rc
                fid = _fid(s, nb)
                if fid == FID_POOL:
                    return R_POOL_KEY   # a pool map (see apply._looks_like_pool)
                if fid == FID_DECLINE:
                    return R_FIELD      # precomputed local hashes: the general path
                if fid != FID_SKIP:
                    bit = 1u << fid
                    if ev.seen & bit:
                        return R_DUPLICATE
                    ev.seen |= bit
                    if not (known & bit):
                        fid = FID_SKIP
                if fid == FID_TYPE:
                    rc = _tag(c, &k2)
                    if rc == R_OK and k2 != kind:
                        rc = R_EVENT
                else:
                    rc = self._field(c, fid, &ev)
                if rc:
                    return rc
        # -- what the Python path does with the decoded event (Applier._stored/_removed) ---
        if kind == K_CLEARED:
            self.flags |= BATCH_HAS_CLEAR
            r = &self.recs[self.nrec]
            r.kind = OP_CLEAR
            r.off = 0
            r.n = 0
            r.parent = 0
            r.has_parent = 0
            r.ehash_locals = 1
            self.nrec += 1
            return R_OK
        if kind == K_REMOVED:
            if ev.nh == 0:
                return R_OK
            self.flags |= BATCH_NEEDS_WORKER
            r = &self.recs[self.nrec]
            r.kind = OP_EVICT
            r.off = self.hs_used
            r.n = ev.nh
            r.parent = 0
            r.has_parent = 0
            r.ehash_locals = 1
            self.hs_used += ev.nh
            self.nrec += 1
            return R_OK
        xk = False
        if ev.xkn and _extra_digests(ev.xk, ev.xkn, ev.lora, ev.lora_n, ev.nh,
                                     self.xd + self.hs_used, &xk) < 0:
            return R_EXTRA      # the Python path drops the event (counted, warned)
        salt = 0
        if not ev.xkn and ev.salt_n and not ev.has_parent:
            # SGLang's salt namespaces the request's whole chain: salting the chain's first
            # block does that in the prefix tree (and is what a salted query hashes)
            salt = extra_fold(0, extra_item(XK_SALT, ev.salt, ev.salt_n, 0))
        if ev.bs and reg > 0 and ev.bs != <uint64_t>reg:
            self.n_size_mismatch += 1
            self.bad_bs = ev.bs
            return R_OK
        if ev.kind_rejected:
            self.n_kind += 1
            return R_OK
        if ev.nh == 0:
            return R_OK
        if ev.seed != self.seed and ev.ntok and ev.bs:
            # a LoRA adapter's blocks: remember its seed (queries naming an adapter that no
            # event carried are warned about)
            for i in range(self.nlora):
                if self.lora[i] == ev.seed:
                    break
            else:
                if self.nlora == LORA_MAX:
                    return R_LORAS
                self.lora[self.nlora] = ev.seed
                self.nlora += 1
        self.flags |= BATCH_NEEDS_WORKER | BATCH_TOUCHES
        r = &self.recs[self.nrec]
        r.kind = OP_STORE
        r.off = self.hs_used
        r.has_parent = ev.has_parent
        r.parent = ev.parent
        if ev.ntok and ev.bs:
            # CoreIndex.store_tokens: min(hashes, ceil(ntok / bs)) blocks, tail block included
            nb = (ev.ntok + ev.bs - 1) // ev.bs
            nstore = ev.nh if ev.nh < nb else nb
            hash_token_blocks(self.tok, ev.ntok if ev.ntok < nstore * ev.bs else nstore * ev.bs,
                              ev.bs, ev.seed, self.loc + self.hs_used)
            if xk:
                mix_extra_locals(self.loc + self.hs_used, self.xd + self.hs_used, nstore,
                                 ev.seed)
            elif salt:
                mix_extra_locals(self.loc + self.hs_used, &salt, 1, ev.seed)
            r.n = nstore
            r.ehash_locals = 0
        else:
            r.n = ev.nh         # CoreIndex.store(engine hashes as local hashes)
            r.ehash_locals = 1
        self.hs_used += ev.nh
        self.nrec += 1
        return R_OK

    cdef int _parse(self, const uint8_t* buf, size_t size, long long reg) noexcept nogil:
        cdef wcur c
        cdef size_t nev, i, _k
        cdef void* p
        cdef int rc
        cdef uint64_t v
        cdef bint neg
        self.nrec = self.done = 0
        self.hs_used = 0
        self.flags = 0
        self.n_size_mismatch = 0
        self.n_kind = 0
        self.nlora = 0
        if size < 11 or (buf[0] != 0x92 and buf[0] != 0x93) or buf[1] != 0xcb:
            return -R_ENVELOPE  # [float64 ts, events] / [float64 ts, events, dp]
        c.base = buf
        c.p = buf + 10
        c.end = buf + size
        rc = _r(_container(&c, False, &nev), R_ENVELOPE)
        if rc:
            return -rc
        if nev > self.rec_cap:
            i = self.rec_cap
            p = grow_array(self.recs, &i, nev, sizeof(EvRec))
            if p == NULL:
                return -R_OOM
            self.recs = <EvRec*>p
            i = self.rec_cap
            p = grow_array(self.ops, &i, nev, sizeof(BatchOp))
            if p == NULL:
                return -R_OOM
            self.ops = <BatchOp*>p
            self.rec_cap = i
        for _k in range(nev):
            rc = self._event(&c, reg)
            if rc:
                return -rc
        if buf[0] == 0x93 and not _nil(&c):
            rc = _r(mp_int(&c, &v, &neg), R_ENVELOPE)
            if rc:
                return -rc
        if c.p != c.end:
            return -R_ENVELOPE   # trailing bytes: msgspec rejects the payload
        return <int>(nev if nev < 0x7FFFFFFF else 0x7FFFFFFF)

    def parse(self, payload, long long registered_block_size):
        """Parse one batch payload; its event count, or -1 when any part of it needs the
        Python path (then :attr:`reason` says why and nothing may be applied)."""
        cdef const uint8_t* buf
        cdef size_t size
        cdef const uint8_t[::1] view
        cdef int rc
        if PyBytes_Check(payload):
            buf = <const uint8_t*>PyBytes_AS_STRING(payload)
            size = <size_t>PyBytes_GET_SIZE(payload)
        else:
            view = payload
            size = view.shape[0]
            buf = &view[0] if size else NULL
        self.nevents = -1
        self._trim()
        if size < 11:
            rc = -R_ENVELOPE
        elif size <= PARSE_GIL_BYTES:
            rc = self._parse(buf, size, registered_block_size)  # PERF: see apply()
        else:
            with nogil:
                rc = self._parse(buf, size, registered_block_size)
        if rc < 0:
            self.why = -rc
            self.rejected += 1
            self.nrec = 0
            return -1
        self.why = R_OK
        self.parsed += 1
        self.nevents = rc
        return rc

    cdef void _trim(self) noexcept nogil:
        """Free scratch that one huge batch grew (the next batch starts small)."""
        if self.hs_cap > TRIM_ITEMS:
            mem_free(self.hs)
            mem_free(self.loc)
            mem_free(self.xd)
            self.hs = self.loc = self.xd = NULL
            self.hs_cap = 0
        if self.tok_cap > TRIM_ITEMS:
            mem_free(self.tok)
            self.tok = NULL
            self.tok_cap = 0
        if self.rec_cap > TRIM_ITEMS:
            mem_free(self.recs)
            mem_free(self.ops)
            self.recs = NULL
            self.ops = NULL
            self.rec_cap = 0

    @property
    def nhashes(self):
        """Engine hashes (stored and removed blocks) of the parsed batch."""
        return self.hs_used if self.nevents >= 0 else 0

    @property
    def reason(self):
        """Why the last :meth:`parse` returned -1 ("" after an accepted batch)."""
        return _REASONS[self.why]

    @property
    def mismatched_block_size(self):
        """The block_size of the last BlockStored counted in :attr:`size_mismatch`."""
        return self.bad_bs

    @property
    def lora_seeds(self):
        """Hash seeds of the LoRA adapters whose blocks the parsed batch stores (distinct)."""
        return tuple(self.lora[i] for i in range(self.nlora))

    @property
    def needs_worker(self):
        """A store or removal of the parsed batch targets the HBM worker."""
        return (self.flags & BATCH_NEEDS_WORKER) != 0

    @property
    def touches(self):
        """A store of the parsed batch targets the HBM worker."""
        return (self.flags & BATCH_TOUCHES) != 0

    @property
    def has_clear(self):
        """The parsed batch has an AllBlocksCleared."""
        return (self.flags & BATCH_HAS_CLEAR) != 0

    @property
    def size_mismatch(self):
        """BlockStored events of the parsed batch dropped for their block_size."""
        return self.n_size_mismatch

    @property
    def kind_rejected(self):
        """BlockStored events of the parsed batch dropped for their attention kind."""
        return self.n_kind

    @property
    def nrecords(self):
        """The parsed batch's events that mutate the index (stores, removals, clears)
        not applied yet."""
        return self.nrec - self.done if self.nevents >= 0 else 0

    @property
    def leading_stores(self):
        """Of :attr:`nrecords`, the stores before the first removal or clear."""
        cdef size_t i = self.done
        if self.nevents < 0:
            return 0
        while i < self.nrec and self.recs[i].kind == OP_STORE:
            i += 1
        return i - self.done

    def apply(self, CoreIndex core not None, long long hbm_worker=-1, clear_workers=(),
              long long upto=-1):
        """Apply the parsed batch to ``core`` under one write lock.

        ``hbm_worker``: the HBM worker id (required when :attr:`needs_worker`);
        ``clear_workers``: ids cleared by each AllBlocksCleared. Returns
        ``(blocks, parent_not_found, invalid_sequence, out_of_memory)``: blocks
        stored and the stores that failed (counted and skipped, like the Python
        path). Consumes the parse; raises before mutating anything on bad ids.
        ``upto`` (0 <= upto < :attr:`nrecords`): apply only that many of the records
        left and keep the parse for the next call (the rest)."""
        cdef size_t i, nclear = 0, nops = 0, end = self.nrec
        cdef void* p
        cdef EvRec* r
        cdef BatchOp* op
        cdef long blocks = 0, pnf = 0, bad = 0, oom = 0
        cdef size_t nblocks = 0
        cdef long long x
        cdef uint32_t w = 0
        cdef long keep = -1
        if self.nevents < 0:
            raise RuntimeError("apply() needs a successful parse()")
        if 0 <= upto < <long long>(self.nrec - self.done):
            end = self.done + <size_t>upto
            keep = self.nevents
        self.nevents = -1
        if self.flags & BATCH_NEEDS_WORKER:
            if (hbm_worker < 0 or hbm_worker >= <long long>HM_NIL
                    or core._tier(<uint32_t>hbm_worker) != 0):
                raise ValueError(f"hbm_worker {hbm_worker} is not an HBM worker of this index")
            w = <uint32_t>hbm_worker
        if self.flags & BATCH_HAS_CLEAR:
            ids = [int(v) for v in clear_workers]
            nclear = len(ids)
            if nclear > self.clear_cap:
                i = self.clear_cap
                p = grow_array(self.clear, &i, nclear, sizeof(uint32_t))
                if p == NULL:
                    raise MemoryError()
                self.clear = <uint32_t*>p
                self.clear_cap = i
            for i in range(nclear):
                x = ids[i]
                if x < 0 or x >= <long long>HM_NIL:
                    raise ValueError(f"bad worker id {x}")
                core._tier(<uint32_t>x)
                self.clear[i] = <uint32_t>x
        for i in range(self.done, end):
            r = &self.recs[i]
            op = &self.ops[nops]
            op.kind = r.kind
            op.worker = w
            op.n = r.n
            op.ehashes = self.hs + r.off
            op.locals = op.ehashes if r.ehash_locals else self.loc + r.off
            op.has_parent = r.has_parent
            op.parent = r.parent
            op.rc = 0
            nops += 1
            nblocks += r.n
        # PERF: a small batch is applied with the GIL held when the write lock is free
        # (``_try_apply_ops`` never waits): releasing the GIL for a few microseconds of
        # work hands it to the waiting event loop and waits for it back, which on a
        # busy server cost more than the work (see _recv.pyx).
        if nops and (nblocks + nclear > APPLY_GIL_BLOCKS
                     or not core._try_apply_ops(self.ops, nops, self.clear, nclear)):
            with nogil:
                core._apply_ops(self.ops, nops, self.clear, nclear)
        with nogil:
            for i in range(nops):
                op = &self.ops[i]
                if op.kind != OP_STORE:
                    continue
                if op.rc >= 0:
                    blocks += op.rc
                elif op.rc == T_ERR_PARENT:
                    pnf += 1
                elif op.rc == T_ERR_SEQUENCE:
                    bad += 1
                else:
                    oom += 1
        if keep >= 0:
            self.nevents = keep
            self.done = end
        else:
            self.nrec = self.done = 0
        return (blocks, pnf, bad, oom)


include "_ingest_extra.pxi"


def _live_allocations():
    """Scratch blocks of FastBatch objects allocated and not freed (tests: leak check)."""
    return live_allocations()
