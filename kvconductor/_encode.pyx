# cython: language_level=3
"""Response encoding of ``/query`` and ``/query_by_hash`` (docs/api.md, "Response").

``encode_result`` / ``encode_error`` write the V3 response body
(``QueryResult.to_dict``) as compact JSON or MessagePack, byte-identical to
``msgspec.json.encode`` / ``msgspec.msgpack.encode`` of that dict, into a growing
C buffer (:c:type:`wbuf`, ``_encode.pxd``). Shares nothing with the parsers.

``kvconductor.wire.py_encode_result`` / ``py_encode_error`` are the pure-Python
(msgspec) oracles; both must agree exactly (tests/test_wire.py).
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from kvconductor._index cimport MatchRows

from operator import index as _index


cdef extern from "Python.h":
    # Exceptions are checked by hand (saturation instead of OverflowError).
    unsigned long long PyLong_AsUnsignedLongLong(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow)
    bint PyLong_CheckExact(object o)


cdef uint64_t _U32_MAX = 0xFFFFFFFF
cdef uint32_t _SLOT_NIL = 0xFFFFFFFF


cdef int _wb_reserve(wbuf* b, size_t extra) except -1:
    cdef size_t cap
    cdef char* d
    if b.len + extra <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 256
    while cap < b.len + extra:
        cap *= 2
    d = <char*>realloc(b.data, cap)
    if d == NULL:
        raise MemoryError()
    b.data = d
    b.cap = cap
    return 0


cdef inline int _wb_raw(wbuf* b, const char* s, size_t n) except -1:
    _wb_reserve(b, n)
    memcpy(b.data + b.len, s, n)
    b.len += n
    return 0


cdef inline int _wb_byte(wbuf* b, char ch) except -1:
    _wb_reserve(b, 1)
    b.data[b.len] = ch
    b.len += 1
    return 0


cdef int _wb_dec(wbuf* b, uint64_t v) except -1:
    cdef char tmp[24]
    cdef int i = 24
    while True:
        i -= 1
        tmp[i] = <char>(48 + v % 10)
        v //= 10
        if v == 0:
            break
    return _wb_raw(b, tmp + i, 24 - i)


cdef const char* _HEX = b"0123456789abcdef"


cdef int _wb_json_bytes(wbuf* b, const uint8_t* u, size_t n) except -1:
    """A JSON string of UTF-8 bytes, escaped like msgspec."""
    cdef size_t i
    cdef uint8_t ch
    cdef char* o
    _wb_reserve(b, 6 * n + 2)
    o = b.data + b.len
    o[0] = b'"'
    o += 1
    for i in range(n):
        ch = u[i]
        if ch == 34 or ch == 92:
            o[0] = b'\\'
            o[1] = <char>ch
            o += 2
        elif ch >= 32:
            o[0] = <char>ch
            o += 1
        elif ch == 10:
            o[0] = b'\\'
            o[1] = b'n'
            o += 2
        elif ch == 9:
            o[0] = b'\\'
            o[1] = b't'
            o += 2
        elif ch == 13:
            o[0] = b'\\'
            o[1] = b'r'
            o += 2
        elif ch == 8:
            o[0] = b'\\'
            o[1] = b'b'
            o += 2
        elif ch == 12:
            o[0] = b'\\'
            o[1] = b'f'
            o += 2
        else:
            o[0] = b'\\'
            o[1] = b'u'
            o[2] = b'0'
            o[3] = b'0'
            o[4] = _HEX[ch >> 4]
            o[5] = _HEX[ch & 15]
            o += 6
    o[0] = b'"'
    o += 1
    b.len = <size_t>(o - b.data)
    return 0


cdef int _wb_mp_str_bytes(wbuf* b, const char* u, size_t n) except -1:
    _wb_reserve(b, n + 5)
    cdef char* o = b.data + b.len
    if n < 32:
        o[0] = <char>(0xa0 | n)
        o += 1
    elif n < 256:
        o[0] = <char>0xd9
        o[1] = <char>n
        o += 2
    elif n < 65536:
        o[0] = <char>0xda
        o[1] = <char>(n >> 8)
        o[2] = <char>n
        o += 3
    else:
        o[0] = <char>0xdb
        o[1] = <char>(n >> 24)
        o[2] = <char>(n >> 16)
        o[3] = <char>(n >> 8)
        o[4] = <char>n
        o += 5
    memcpy(o, u, n)
    b.len = <size_t>(o - b.data) + n
    return 0


cdef int _wb_str(wbuf* b, str s, bint mp) except -1:
    cdef Py_ssize_t n
    cdef const char* u = PyUnicode_AsUTF8AndSize(s, &n)
    if mp:
        return _wb_mp_str_bytes(b, u, <size_t>n)
    return _wb_json_bytes(b, <const uint8_t*>u, <size_t>n)


cdef int _wb_mp_uint(wbuf* b, uint64_t v) except -1:
    _wb_reserve(b, 9)
    cdef char* o = b.data + b.len
    cdef int k
    if v < 128:
        o[0] = <char>v
        b.len += 1
    elif v < 256:
        o[0] = <char>0xcc
        o[1] = <char>v
        b.len += 2
    elif v < 65536:
        o[0] = <char>0xcd
        o[1] = <char>(v >> 8)
        o[2] = <char>v
        b.len += 3
    elif v <= 0xFFFFFFFF:
        o[0] = <char>0xce
        o[1] = <char>(v >> 24)
        o[2] = <char>(v >> 16)
        o[3] = <char>(v >> 8)
        o[4] = <char>v
        b.len += 5
    else:
        o[0] = <char>0xcf
        for k in range(8):
            o[1 + k] = <char>(v >> (56 - 8 * k))
        b.len += 9
    return 0


cdef int _wb_mp_map(wbuf* b, size_t n) except -1:
    _wb_reserve(b, 5)
    cdef char* o = b.data + b.len
    if n < 16:
        o[0] = <char>(0x80 | n)
        b.len += 1
    elif n < 65536:
        o[0] = <char>0xde
        o[1] = <char>(n >> 8)
        o[2] = <char>n
        b.len += 3
    else:
        o[0] = <char>0xdf
        o[1] = <char>(n >> 24)
        o[2] = <char>(n >> 16)
        o[3] = <char>(n >> 8)
        o[4] = <char>n
        b.len += 5
    return 0


cdef int _wb_key(wbuf* b, const char* k, size_t n, bint mp) except -1:
    """A literal ASCII key (no escaping needed) followed by ':' in JSON."""
    if mp:
        return _wb_mp_str_bytes(b, k, n)
    _wb_reserve(b, n + 3)
    b.data[b.len] = b'"'
    memcpy(b.data + b.len + 1, k, n)
    b.data[b.len + 1 + n] = b'"'
    b.data[b.len + 2 + n] = b':'
    b.len += n + 3
    return 0


cdef inline int _wb_uint(wbuf* b, uint64_t v, bint mp) except -1:
    if mp:
        return _wb_mp_uint(b, v)
    return _wb_dec(b, v)


cdef uint64_t _count(object x) except? 0xFFFFFFFFFFFFFFFF:
    """A non-negative int as u64, saturating at 2^64-1."""
    cdef unsigned long long v
    if not PyLong_CheckExact(x):
        x = _index(x)
    v = PyLong_AsUnsignedLongLong(x)
    if v == <unsigned long long>-1 and PyErr_Occurred() != NULL:
        PyErr_Clear()
        if x < 0:
            raise ValueError(f"negative count {x!r} in query result")
        return 0xFFFFFFFFFFFFFFFF
    return v


cdef inline uint64_t _sat_add(uint64_t a, uint64_t b) noexcept nogil:
    cdef uint64_t s = a + b
    return s if s >= a else 0xFFFFFFFFFFFFFFFF


cdef inline uint64_t _sat_u32_mul(uint64_t a, uint64_t b) noexcept nogil:
    """min(a * b, 2^32-1)."""
    if a == 0 or b == 0:
        return 0
    if a > _U32_MAX or b > _U32_MAX:
        return _U32_MAX
    a = a * b
    return a if a < _U32_MAX else _U32_MAX


ctypedef struct hit_t:
    Py_ssize_t next         # next hit of the same instance, -1 at the end
    int64_t dp              # dp_rank (when dp_text is unused)
    bint dp_text            # dp key comes from str(dp_rank) (not a plain int64)
    bint dead               # replaced by a later hit with the same (instance, dp key)
    uint32_t matched, npu, cpu, disk


ctypedef struct inst_t:
    Py_ssize_t first, last
    Py_ssize_t ndp
    uint32_t longest


cdef int _wb_dp_key(wbuf* b, const hit_t* h, Py_ssize_t i, dict dp_texts, bint mp) except -1:
    cdef char tmp[24]
    cdef int k = 24
    cdef uint64_t v = 0
    cdef bint neg = False
    if h.dp_text:
        return _wb_str(b, dp_texts[i], mp)
    neg = h.dp < 0
    v = <uint64_t>0 - <uint64_t>h.dp if neg else <uint64_t>h.dp
    while True:
        k -= 1
        tmp[k] = <char>(48 + v % 10)
        v //= 10
        if v == 0:
            break
    if neg:
        k -= 1
        tmp[k] = b'-'
    if mp:
        return _wb_mp_str_bytes(b, tmp + k, 24 - k)
    _wb_reserve(b, 24 - k + 2)
    b.data[b.len] = b'"'
    memcpy(b.data + b.len + 1, tmp + k, 24 - k)
    b.data[b.len + 1 + 24 - k] = b'"'
    b.len += 24 - k + 2
    return 0


cdef object _dp_key(hit_t* h, object dp_rank):
    """Fill h.dp / h.dp_text for ``str(dp_rank)``; return the dedup key (int or str)."""
    cdef int ovf = 0
    cdef long long v
    if PyLong_CheckExact(dp_rank):
        v = PyLong_AsLongLongAndOverflow(dp_rank, &ovf)
        if ovf == 0:
            h.dp = v
            h.dp_text = False
            return dp_rank
    text = str(dp_rank)
    if not PyLong_CheckExact(dp_rank):
        # an int-like object whose str() is the canonical decimal is the same key
        try:
            x = int(text)
        except ValueError:
            x = None
        if x is not None and str(x) == text:
            return _dp_key(h, x)
    h.dp = 0
    h.dp_text = True
    return text


cdef int _write_result(wbuf* b, list hits, str tenant, uint64_t bs, bint mp) except -1:
    cdef Py_ssize_t nh = len(hits), i, j, ni = 0, g
    cdef hit_t* hv = NULL
    cdef inst_t* iv = NULL
    cdef hit_t* h
    cdef inst_t* ins
    cdef uint64_t npu, cpu, disk
    cdef dict inst_ids = {}
    cdef dict dp_seen = {}
    cdef dict dp_texts = {}
    cdef list names = []
    cdef bint first
    try:
        hv = <hit_t*>malloc(sizeof(hit_t) * (nh if nh else 1))
        iv = <inst_t*>malloc(sizeof(inst_t) * (nh if nh else 1))
        if hv == NULL or iv == NULL:
            raise MemoryError()
        for i in range(nh):
            inst_id, dp_rank, n_, c_, d_ = hits[i]
            if not isinstance(inst_id, str):
                raise TypeError(f"instance_id must be a str, not {type(inst_id).__name__}")
            h = &hv[i]
            npu = _count(n_)
            cpu = _count(c_)
            disk = _count(d_)
            h.npu = <uint32_t>(npu if npu < _U32_MAX else _U32_MAX)
            h.cpu = <uint32_t>(cpu if cpu < _U32_MAX else _U32_MAX)
            h.disk = <uint32_t>(disk if disk < _U32_MAX else _U32_MAX)
            h.matched = <uint32_t>_sat_u32_mul(_sat_add(_sat_add(npu, cpu), disk), bs)
            h.next = -1
            h.dead = False
            h.dp_text = False
            dkey = _dp_key(h, dp_rank)
            if h.dp_text:
                dp_texts[i] = dkey
            gobj = inst_ids.get(inst_id)
            if gobj is None:
                g = ni
                ni += 1
                inst_ids[inst_id] = g
                names.append(inst_id)
                ins = &iv[g]
                ins.first = i
                ins.last = i
                ins.ndp = 1
                ins.longest = h.matched
                dp_seen[(g, dkey)] = i
                continue
            g = gobj
            ins = &iv[g]
            if h.matched > ins.longest:
                ins.longest = h.matched
            key = (g, dkey)
            j = dp_seen.get(key, -1)
            if j >= 0:
                # same DP key again: the value replaces the earlier one in place
                hv[j].matched = h.matched
                hv[j].npu = h.npu
                hv[j].cpu = h.cpu
                hv[j].disk = h.disk
                h.dead = True
                continue
            dp_seen[key] = i
            hv[ins.last].next = i
            ins.last = i
            ins.ndp += 1
        # -- write {tenant: {instance: {"longest_matched": n, "DP": {dp: {...}}}}}
        if mp:
            _wb_mp_map(b, 1)
            _wb_str(b, tenant, True)
            _wb_mp_map(b, <size_t>ni)
        else:
            _wb_byte(b, b'{')
            _wb_str(b, tenant, False)
            _wb_raw(b, b":{", 2)
        for g in range(ni):
            ins = &iv[g]
            if not mp and g:
                _wb_byte(b, b',')
            _wb_str(b, names[g], mp)
            if mp:
                _wb_mp_map(b, 2)
            else:
                _wb_raw(b, b":{", 2)
            _wb_key(b, b"longest_matched", 15, mp)
            _wb_uint(b, ins.longest, mp)
            if mp:
                _wb_key(b, b"DP", 2, True)
                _wb_mp_map(b, <size_t>ins.ndp)
            else:
                _wb_raw(b, b",\"DP\":{", 7)
            i = ins.first
            first = True
            while i >= 0:
                h = &hv[i]
                if not first and not mp:
                    _wb_byte(b, b',')
                first = False
                _wb_dp_key(b, h, i, dp_texts, mp)
                if mp:
                    _wb_mp_map(b, 4)
                    _wb_key(b, b"matched_tokens", 14, True)
                    _wb_mp_uint(b, h.matched)
                    _wb_key(b, b"npu_blocks", 10, True)
                    _wb_mp_uint(b, h.npu)
                    _wb_key(b, b"cpu_blocks", 10, True)
                    _wb_mp_uint(b, h.cpu)
                    _wb_key(b, b"disk_blocks", 11, True)
                    _wb_mp_uint(b, h.disk)
                else:
                    _wb_raw(b, b":{\"matched_tokens\":", 19)
                    _wb_dec(b, h.matched)
                    _wb_raw(b, b",\"npu_blocks\":", 14)
                    _wb_dec(b, h.npu)
                    _wb_raw(b, b",\"cpu_blocks\":", 14)
                    _wb_dec(b, h.cpu)
                    _wb_raw(b, b",\"disk_blocks\":", 15)
                    _wb_dec(b, h.disk)
                    _wb_byte(b, b'}')
                i = h.next
            if not mp:
                _wb_raw(b, b"}}", 2)
        if not mp:
            _wb_raw(b, b"}}", 2)
    finally:
        free(hv)
        free(iv)
    return 0


def encode_result(hits, str tenant not None, block_size, bint msgpack):
    """``QueryResult(hits).to_dict(tenant, block_size)`` as JSON or MessagePack bytes.

    ``hits``: sequence of ``(instance_id, dp_rank, npu_blocks, cpu_blocks,
    disk_blocks)`` tuples (``DpHit`` works). Instances appear in first-seen
    order with their DPs in hit order; counts saturate at 2^32-1.
    """
    cdef wbuf b
    cdef uint64_t bs = _count(block_size)
    if not isinstance(hits, list):
        hits = list(hits)
    b.data = NULL
    b.len = 0
    b.cap = 0
    try:
        _wb_reserve(&b, 64 + 160 * <size_t>len(hits))
        _write_result(&b, hits, tenant, bs, msgpack)
        return PyBytes_FromStringAndSize(b.data, <Py_ssize_t>b.len)
    finally:
        free(b.data)


def encode_error(str message not None, bint msgpack):
    """``{"error": message}`` as JSON or MessagePack bytes."""
    cdef wbuf b
    b.data = NULL
    b.len = 0
    b.cap = 0
    try:
        if msgpack:
            _wb_mp_map(&b, 1)
            _wb_key(&b, b"error", 5, True)
            _wb_str(&b, message, True)
        else:
            _wb_raw(&b, b"{\"error\":", 9)
            _wb_str(&b, message, False)
            _wb_byte(&b, b'}')
        return PyBytes_FromStringAndSize(b.data, <Py_ssize_t>b.len)
    finally:
        free(b.data)


# =========================================================================================
# Answers straight from the core's arrays: GroupNames + encode_rows
# =========================================================================================

cdef extern from "kvconductor/c/encode.h":
    unsigned kvc_log2_u64(unsigned long long x) noexcept nogil


cdef class GroupNames:
    """The names of an index's (instance, DP) groups, pre-encoded once when a group is
    named, so an answer copies bytes per row instead of encoding strings.

    ``add(instance_id, dp_rank)`` names the next group id (writer thread; the GIL orders it
    with readers); ``keys[g]`` is ``(instance_id, dp_rank)``. :func:`encode_rows` reads
    entries without the GIL: they never move (fixed chunks, never reallocated)."""

    def __cinit__(self):
        cdef int c
        for c in range(GN_NCHUNKS):
            self.chunks[c] = NULL
        self.count = 0
        self.ninst = 0
        self.nbytes_ = 0
        self.keys = []
        self._inst = {}

    def __dealloc__(self):
        cdef int c
        cdef size_t i, size
        for c in range(GN_NCHUNKS):
            if self.chunks[c] != NULL:
                size = (<size_t>GN_CHUNK0) << c
                for i in range(size):
                    free(self.chunks[c][i].data)
                free(self.chunks[c])
                self.chunks[c] = NULL

    cdef gname_t* entry(self, size_t g) noexcept nogil:
        cdef size_t x = (g // GN_CHUNK0) + 1
        cdef unsigned c = kvc_log2_u64(x)
        return &self.chunks[c][g - GN_CHUNK0 * (((<size_t>1) << c) - 1)]

    def __len__(self):
        return self.count

    def nbytes(self):
        """Bytes of the C table (chunks and encoded names)."""
        return self.nbytes_

    def add(self, str instance_id not None, dp_rank):
        """Name the next group ``(instance_id, dp_rank)``; returns its id."""
        cdef size_t g = self.count
        cdef size_t x = (g // GN_CHUNK0) + 1
        cdef unsigned c = kvc_log2_u64(x)
        cdef size_t size = (<size_t>GN_CHUNK0) << c
        cdef gname_t* e
        cdef wbuf b
        cdef size_t ji, mi, jd
        cdef bytes dk
        dk = str(_index(dp_rank)).encode()
        if c >= GN_NCHUNKS:
            raise OverflowError("too many groups")
        if self.chunks[c] == NULL:
            self.chunks[c] = <gname_t*>calloc(size, sizeof(gname_t))
            if self.chunks[c] == NULL:
                raise MemoryError()
            self.nbytes_ += size * sizeof(gname_t)
        b.data = NULL
        b.len = 0
        b.cap = 0
        try:
            _wb_str(&b, instance_id, False)
            ji = b.len
            _wb_str(&b, instance_id, True)
            mi = b.len - ji
            _wb_json_bytes(&b, <const uint8_t*><const char*>dk, <size_t>len(dk))
            jd = b.len - ji - mi
            _wb_mp_str_bytes(&b, <const char*>dk, <size_t>len(dk))
        except BaseException:
            free(b.data)
            raise
        inst = self._inst.get(instance_id)
        if inst is None:
            inst = self._inst[instance_id] = self.ninst
            self.ninst += 1
        e = self.entry(g)
        e.data = b.data
        e.inst = <uint32_t>inst
        e.ji = <uint32_t>ji
        e.mi = <uint32_t>mi
        e.jd = <uint32_t>jd
        e.md = <uint32_t>(b.len - ji - mi - jd)
        self.nbytes_ += b.cap
        self.keys.append((instance_id, dp_rank))
        self.count = g + 1          # published last: readers check groups against it
        return g

    def instances_mask(self, instance_ids):
        """One byte per group id: 1 for the groups of the named instances (unknown names
        are ignored), the ``groups`` argument of ``MatchRows.select``."""
        cdef bytearray want = bytearray(self.ninst)
        cdef bytearray out = bytearray(self.count)
        cdef unsigned char* w = want
        cdef unsigned char* o = out
        cdef size_t g
        cdef bint any_ = False
        for name in instance_ids:
            i = self._inst.get(name)
            if i is not None:
                w[<size_t>i] = 1
                any_ = True
        if any_:
            for g in range(self.count):
                o[g] = w[self.entry(g).inst]
        return bytes(out)


# -- exact sizes and raw writers (the answer is sized first, then written without realloc) ---
cdef inline size_t _dec_len(uint64_t v) noexcept nogil:
    cdef size_t n = 1
    while v >= 10:
        v //= 10
        n += 1
    return n


cdef inline size_t _mpu_len(uint64_t v) noexcept nogil:
    if v < 128:
        return 1
    if v < 256:
        return 2
    if v < 65536:
        return 3
    if v <= _U32_MAX:
        return 5
    return 9


cdef inline size_t _mpmap_len(size_t n) noexcept nogil:
    return 1 if n < 16 else (3 if n < 65536 else 5)


cdef inline char* _p_raw(char* o, const char* s, size_t n) noexcept nogil:
    memcpy(o, s, n)
    return o + n


cdef inline char* _p_dec(char* o, uint64_t v) noexcept nogil:
    cdef size_t n = _dec_len(v), i = n
    while True:
        i -= 1
        o[i] = <char>(48 + v % 10)
        v //= 10
        if i == 0:
            break
    return o + n


cdef inline char* _p_mpu(char* o, uint64_t v) noexcept nogil:
    if v < 128:
        o[0] = <char>v
        return o + 1
    if v < 256:
        o[0] = <char>0xcc
        o[1] = <char>v
        return o + 2
    if v < 65536:
        o[0] = <char>0xcd
        o[1] = <char>(v >> 8)
        o[2] = <char>v
        return o + 3
    o[0] = <char>0xce           # counts here are u32
    o[1] = <char>(v >> 24)
    o[2] = <char>(v >> 16)
    o[3] = <char>(v >> 8)
    o[4] = <char>v
    return o + 5


cdef inline char* _p_mpmap(char* o, size_t n) noexcept nogil:
    if n < 16:
        o[0] = <char>(0x80 | n)
        return o + 1
    if n < 65536:
        o[0] = <char>0xde
        o[1] = <char>(n >> 8)
        o[2] = <char>n
        return o + 3
    o[0] = <char>0xdf
    o[1] = <char>(n >> 24)
    o[2] = <char>(n >> 16)
    o[3] = <char>(n >> 8)
    o[4] = <char>n
    return o + 5


cdef inline char* _p_mpu64(char* o, uint64_t v) noexcept nogil:
    cdef int k
    if v <= _U32_MAX:
        return _p_mpu(o, v)
    o[0] = <char>0xcf
    for k in range(8):
        o[1 + k] = <char>(v >> (56 - 8 * k))
    return o + 9


# -- freshness (docs/api.md, "freshness"): per answered (instance, DP), written in its DP map
#: The state names, by code (``fresh_t.code``); the worst of a DP's sources is the last.
FRESH_STATES = ("live", "remote", "connecting", "replaying", "degraded", "muted", "no_source")
cdef enum:
    FS_N = 7
cdef tuple _FS_BYTES = tuple(
    (("\"%s\"" % n).encode(), bytes([0xa0 | len(n)]) + n.encode()) for n in FRESH_STATES)
cdef const char* _fs_json[FS_N]
cdef size_t _fs_json_len[FS_N]
cdef const char* _fs_mp[FS_N]
cdef size_t _fs_mp_len[FS_N]
for _k in range(FS_N):
    _fs_json[_k] = PyBytes_AS_STRING(_FS_BYTES[_k][0])
    _fs_json_len[_k] = len(_FS_BYTES[_k][0])
    _fs_mp[_k] = PyBytes_AS_STRING(_FS_BYTES[_k][1])
    _fs_mp_len[_k] = len(_FS_BYTES[_k][1])


cdef inline size_t _fresh_len(const fresh_t* f, bint mp) noexcept nogil:
    """Bytes of a DP's ``"freshness"`` member (its key included; JSON: its comma)."""
    cdef size_t n
    if mp:
        n = 10 + 1 + 6 + _fs_mp_len[f.code]
        if f.has_age:
            n += 18 + _mpu_len(f.age_ms)
        if f.has_since:
            n += 16 + _mpu_len(f.since_ms)
    else:
        n = 13 + 9 + _fs_json_len[f.code] + 1
        if f.has_age:
            n += 21 + _dec_len(f.age_ms)
        if f.has_since:
            n += 19 + _dec_len(f.since_ms)
    return n


cdef inline char* _p_fresh(char* o, const fresh_t* f, bint mp) noexcept nogil:
    if mp:
        o = _p_raw(o, b"\xa9freshness", 10)
        o[0] = <char>(0x81 + f.has_age + f.has_since)
        o = _p_raw(o + 1, b"\xa5state", 6)
        o = _p_raw(o, _fs_mp[f.code], _fs_mp_len[f.code])
        if f.has_age:
            o = _p_raw(o, b"\xb1last_event_age_ms", 18)
            o = _p_mpu64(o, f.age_ms)
        if f.has_since:
            o = _p_raw(o, b"\xafdegraded_for_ms", 16)
            o = _p_mpu64(o, f.since_ms)
        return o
    o = _p_raw(o, b",\"freshness\":", 13)
    o = _p_raw(o, b"{\"state\":", 9)
    o = _p_raw(o, _fs_json[f.code], _fs_json_len[f.code])
    if f.has_age:
        o = _p_raw(o, b",\"last_event_age_ms\":", 21)
        o = _p_dec(o, f.age_ms)
    if f.has_since:
        o = _p_raw(o, b",\"degraded_for_ms\":", 19)
        o = _p_dec(o, f.since_ms)
    o[0] = b'}'
    return o + 1


ctypedef struct rinst_t:
    size_t first, last, ndp
    uint32_t key                # instance ordinal
    uint32_t longest


cdef size_t _plan_rows(const uint32_t* rows, size_t n, gname_t** ents, uint64_t bs,
                       size_t tlen, bint mp, uint32_t* matched, size_t* nxt, rinst_t* iv,
                       uint32_t* slots, size_t smask, size_t* ninst, const fresh_t* fr,
                       size_t taillen) noexcept nogil:
    """Group the rows by instance (first-seen order; ``nxt`` links the DPs of one instance
    in row order), compute matched tokens and each instance's longest; return the exact
    size of the answer. ``fr``: the rows' freshness (NULL: none) and ``taillen`` the bytes
    of the answer's own ``"freshness"`` value."""
    cdef size_t i, j, ni = 0, size
    cdef uint32_t key, sl
    cdef uint64_t tot
    cdef gname_t* e
    cdef rinst_t* ins
    for i in range(n):
        tot = <uint64_t>rows[4 * i + 1] + rows[4 * i + 2] + rows[4 * i + 3]
        matched[i] = <uint32_t>_sat_u32_mul(tot, bs)
        nxt[i] = <size_t>-1
        key = ents[i].inst
        j = (<size_t>key * <size_t>0x9E3779B1) & smask
        while True:
            sl = slots[j]
            if sl == _SLOT_NIL or iv[sl].key == key:
                break
            j = (j + 1) & smask
        if sl == _SLOT_NIL:
            sl = <uint32_t>ni
            slots[j] = sl
            ni += 1
            ins = &iv[sl]
            ins.key = key
            ins.first = i
            ins.last = i
            ins.ndp = 1
            ins.longest = matched[i]
        else:
            ins = &iv[sl]
            nxt[ins.last] = i
            ins.last = i
            ins.ndp += 1
            if matched[i] > ins.longest:
                ins.longest = matched[i]
    ninst[0] = ni
    if mp:
        size = 1 + tlen + _mpmap_len(ni)
    else:
        size = 1 + tlen + 2 + 2 + (ni - 1 if ni else 0)
    for j in range(ni):
        ins = &iv[j]
        e = ents[ins.first]
        if mp:
            size += e.mi + 1 + 16 + _mpu_len(ins.longest) + 3 + _mpmap_len(ins.ndp)
        else:
            size += e.ji + 2 + 18 + _dec_len(ins.longest) + 7 + 2 + (ins.ndp - 1)
    for i in range(n):
        e = ents[i]
        if mp:
            size += (e.md + 1 + 15 + _mpu_len(matched[i]) + 11 + _mpu_len(rows[4 * i + 1])
                     + 11 + _mpu_len(rows[4 * i + 2]) + 12 + _mpu_len(rows[4 * i + 3]))
        else:
            size += (e.jd + 19 + _dec_len(matched[i]) + 14 + _dec_len(rows[4 * i + 1])
                     + 14 + _dec_len(rows[4 * i + 2]) + 15 + _dec_len(rows[4 * i + 3]) + 1)
        if fr != NULL:
            size += _fresh_len(&fr[i], mp)
    if fr != NULL:
        size += (10 if mp else 13) + taillen
    return size


cdef char* _write_rows(char* o, const uint32_t* rows, gname_t** ents, const char* tenant,
                       size_t tlen, bint mp, const uint32_t* matched, const size_t* nxt,
                       const rinst_t* iv, size_t ni, const fresh_t* fr, const char* tail,
                       size_t taillen) noexcept nogil:
    cdef size_t i, j
    cdef gname_t* e
    cdef const rinst_t* ins
    if mp:
        o = _p_mpmap(o, 1 if fr == NULL else 2)
        o = _p_raw(o, tenant, tlen)
        o = _p_mpmap(o, ni)
    else:
        o[0] = b'{'
        o = _p_raw(o + 1, tenant, tlen)
        o = _p_raw(o, b":{", 2)
    for j in range(ni):
        ins = &iv[j]
        e = ents[ins.first]
        if mp:
            o = _p_raw(o, e.data + e.ji, e.mi)
            o[0] = <char>0x82
            o = _p_raw(o + 1, b"\xaflongest_matched", 16)
            o = _p_mpu(o, ins.longest)
            o = _p_raw(o, b"\xa2DP", 3)
            o = _p_mpmap(o, ins.ndp)
        else:
            if j:
                o[0] = b','
                o += 1
            o = _p_raw(o, e.data, e.ji)
            o = _p_raw(o, b":{\"longest_matched\":", 20)
            o = _p_dec(o, ins.longest)
            o = _p_raw(o, b",\"DP\":{", 7)
        i = ins.first
        while i != <size_t>-1:
            e = ents[i]
            if mp:
                o = _p_raw(o, e.data + e.ji + e.mi + e.jd, e.md)
                o[0] = <char>(0x84 if fr == NULL else 0x85)
                o = _p_raw(o + 1, b"\xaematched_tokens", 15)
                o = _p_mpu(o, matched[i])
                o = _p_raw(o, b"\xaanpu_blocks", 11)
                o = _p_mpu(o, rows[4 * i + 1])
                o = _p_raw(o, b"\xaacpu_blocks", 11)
                o = _p_mpu(o, rows[4 * i + 2])
                o = _p_raw(o, b"\xabdisk_blocks", 12)
                o = _p_mpu(o, rows[4 * i + 3])
                if fr != NULL:
                    o = _p_fresh(o, &fr[i], True)
            else:
                if i != ins.first:
                    o[0] = b','
                    o += 1
                o = _p_raw(o, e.data + e.ji + e.mi, e.jd)
                o = _p_raw(o, b":{\"matched_tokens\":", 19)
                o = _p_dec(o, matched[i])
                o = _p_raw(o, b",\"npu_blocks\":", 14)
                o = _p_dec(o, rows[4 * i + 1])
                o = _p_raw(o, b",\"cpu_blocks\":", 14)
                o = _p_dec(o, rows[4 * i + 2])
                o = _p_raw(o, b",\"disk_blocks\":", 15)
                o = _p_dec(o, rows[4 * i + 3])
                if fr != NULL:
                    o = _p_fresh(o, &fr[i], False)
                o[0] = b'}'
                o += 1
            i = nxt[i]
        if not mp:
            o = _p_raw(o, b"}}", 2)
    if mp:
        if fr != NULL:
            o = _p_raw(o, b"\xa9freshness", 10)
            o = _p_raw(o, tail, taillen)
        return o
    o[0] = b'}'
    o += 1
    if fr != NULL:
        o = _p_raw(o, b",\"freshness\":", 13)
        o = _p_raw(o, tail, taillen)
    o[0] = b'}'
    return o + 1


cdef int _fill_fresh(fresh_t* fr, const uint32_t* rv, size_t n, list groups, double now) except -1:
    """Each row's freshness from its group's entry in ``groups`` (docs in
    ``kvconductor.ingest.freshness``): ``None`` (no source), or ``(code, stats, since)``:
    the state code, the ``SourceStats`` of the group's sources (the newest
    ``last_event`` of them is its last event) and the wall time its stream was degraded
    at (or None)."""
    cdef size_t i, g, ng = <size_t>len(groups)
    cdef double last, t, age
    cdef tuple entry
    cdef object since
    for i in range(n):
        g = rv[4 * i]
        fr[i].has_age = 0
        fr[i].has_since = 0
        fr[i].age_ms = 0
        fr[i].since_ms = 0
        if g >= ng or groups[g] is None:
            fr[i].code = FS_N - 1
            continue
        entry = <tuple>groups[g]
        fr[i].code = <uint32_t>entry[0]
        last = -1.0
        for st in <tuple>entry[1]:
            t = st.last_event
            if t > last:
                last = t
        if last >= 0.0:
            age = now - last
            fr[i].has_age = 1
            fr[i].age_ms = <uint64_t>(age * 1000.0 + 0.5) if age > 0.0 else 0
        since = entry[2]
        if since is not None:
            age = now - <double>since
            fr[i].has_since = 1
            fr[i].since_ms = <uint64_t>(age * 1000.0 + 0.5) if age > 0.0 else 0
    return 0


def encode_rows(MatchRows rows not None, GroupNames names not None, str tenant not None,
                block_size, bint msgpack, fresh=None):
    """The V3 answer of ``rows`` (``kvconductor._index.MatchRows``) named by ``names``:
    the bytes of ``encode_result`` of the same rows as DpHit tuples, written from the
    arrays and the pre-encoded names (sized exactly, then written without the GIL).
    ``IndexError`` when a row's group is not named (a stale name table).

    ``fresh``: ``(groups, now, tail)`` adds the freshness (docs/api.md, "freshness"):
    each row's ``"freshness"`` member from ``groups`` (by group id, see
    :func:`_fill_fresh`) at wall time ``now``, and the answer's own ``"freshness"``
    member with the encoded value ``tail`` (in the answer's encoding)."""
    cdef size_t n = rows.n, i, size = 0, ni = 0, smask = 1, tlen
    cdef uint64_t bs = _count(block_size)
    cdef const uint32_t* rv = rows.data
    cdef gname_t** ents = NULL
    cdef uint32_t* matched = NULL
    cdef size_t* nxt = NULL
    cdef rinst_t* iv = NULL
    cdef uint32_t* slots = NULL
    cdef fresh_t* fr = NULL
    cdef const char* tail = NULL
    cdef size_t taillen = 0
    cdef wbuf t
    cdef char* o
    cdef char* end
    cdef bytes out
    cdef bytes tailb
    if n and <size_t>rv[4 * (n - 1)] >= names.count:
        raise IndexError(f"group {rv[4 * (n - 1)]} has no name ({names.count} named)")
    t.data = NULL
    t.len = 0
    t.cap = 0
    while smask < 2 * n:
        smask <<= 1
    try:
        _wb_str(&t, tenant, msgpack)
        tlen = t.len
        ents = <gname_t**>malloc(n * sizeof(gname_t*) + 1)
        matched = <uint32_t*>malloc(n * sizeof(uint32_t) + 1)
        nxt = <size_t*>malloc(n * sizeof(size_t) + 1)
        iv = <rinst_t*>malloc(n * sizeof(rinst_t) + 1)
        slots = <uint32_t*>malloc(smask * sizeof(uint32_t))
        if ents == NULL or matched == NULL or nxt == NULL or iv == NULL or slots == NULL:
            raise MemoryError()
        if fresh is not None:
            groups, now, tailb = fresh
            fr = <fresh_t*>malloc(n * sizeof(fresh_t) + 1)
            if fr == NULL:
                raise MemoryError()
            _fill_fresh(fr, rv, n, groups, now)
            tail = PyBytes_AS_STRING(tailb)
            taillen = <size_t>len(tailb)
        with nogil:
            memset(slots, 0xFF, smask * sizeof(uint32_t))
            for i in range(n):
                ents[i] = names.entry(rv[4 * i])
            size = _plan_rows(rv, n, ents, bs, tlen, msgpack, matched, nxt, iv, slots,
                              smask - 1, &ni, fr, taillen)
        out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
        o = PyBytes_AS_STRING(out)
        with nogil:
            end = _write_rows(o, rv, ents, t.data, tlen, msgpack, matched, nxt, iv, ni, fr,
                              tail, taillen)
        if <size_t>(end - o) != size:
            raise SystemError(f"encode_rows wrote {end - o} bytes of {size}")
        return out
    finally:
        free(t.data)
        free(ents)
        free(matched)
        free(nxt)
        free(iv)
        free(slots)
        free(fr)


def encode_answer(result, str tenant not None, block_size, bint msgpack, fresh=None):
    """The compiled encoder of ``kvconductor.wire.encode_result``: a
    ``kvconductor.index.QueryResult`` backed by ``MatchRows`` and ``GroupNames`` is
    rendered by :func:`encode_rows`; any other result through its ``hits`` (a plain
    sequence of hit tuples as is) by :func:`encode_result`. Same bytes either way.
    ``fresh`` (see :func:`encode_rows`) only for the former (``TypeError`` otherwise)."""
    rows = getattr(result, "rows", None)
    if type(rows) is MatchRows:
        names = getattr(result, "names", None)
        if type(names) is GroupNames:
            return encode_rows(<MatchRows>rows, <GroupNames>names, tenant, block_size, msgpack,
                               fresh)
    if fresh is not None:
        raise TypeError("freshness needs an answer of MatchRows named by GroupNames")
    hits = getattr(result, "hits", result)
    return encode_result(hits, tenant, block_size, msgpack)
