# cython: language_level=3
"""Response encoding of ``/query`` and ``/query_by_hash`` (docs/api.md, "Response").

``encode_result`` / ``encode_error`` write the V3 response body
(``QueryResult.to_dict``) as compact JSON or MessagePack, byte-identical to
``msgspec.json.encode`` / ``msgspec.msgpack.encode`` of that dict, into a growing
C buffer (:c:type:`wbuf`, ``_encode.pxd``). Shares nothing with the parsers.

``kvconductor.wire.py_encode_result`` / ``py_encode_error`` are the pure-Python
(msgspec) oracles; both must agree exactly (tests/test_wire.py).

The answer straight from the core's arrays (``GroupNames``, ``encode_rows``) is its own
job, in ``_encode_rows.pxi``, included where it stood (one extension, as ``_index.pyx``
includes its ``_index_*.pxi``); ``encode_answer`` picks one path or the other.
"""
from cpython cimport array
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset

from kvconductor._index cimport MatchRows

import array as _array
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


# -- msgpack headers and ints, written at o (room checked by the caller); each returns the
# byte after. Every width goes through _p_tag_be.
cdef inline char* _p_tag_be(char* o, uint8_t tag, uint64_t v, size_t w) noexcept nogil:
    """``tag``, then ``v`` as ``w`` big-endian bytes (1, 2, 4 or 8)."""
    cdef size_t k
    o[0] = <char>tag
    for k in range(w):
        o[1 + k] = <char>(v >> (8 * (w - 1 - k)))
    return o + 1 + w


cdef inline char* _p_mphead(char* o, uint64_t v, uint8_t fix, uint64_t nfix, uint8_t tag,
                            size_t w) noexcept nogil:
    """``v`` in the shortest form of its msgpack family: ``fix | v`` below ``nfix``, else
    ``tag`` and ``v`` in ``w`` bytes, or the next tag and twice the bytes, as far as ``v``
    needs (every family's tags follow each other: the caller keeps ``v`` in its range)."""
    if v < nfix:
        o[0] = <char>(fix | v)
        return o + 1
    while w < 8 and (v >> (8 * w)) != 0:
        w *= 2
        tag += 1
    return _p_tag_be(o, tag, v, w)


cdef inline char* _p_mpstr(char* o, size_t n) noexcept nogil:
    """The header of a str of ``n`` bytes: fixstr, str8/16/32 (at most 5 bytes)."""
    return _p_mphead(o, n, 0xa0, 32, 0xd9, 1)


cdef inline char* _p_mpu(char* o, uint64_t v) noexcept nogil:
    """An unsigned int: positive fixint, uint8/16/32/64 (at most 9 bytes)."""
    return _p_mphead(o, v, 0, 128, 0xcc, 1)


cdef inline char* _p_mpmap(char* o, size_t n) noexcept nogil:
    """The header of a map of ``n`` pairs: fixmap, map16/32 (at most 5 bytes)."""
    return _p_mphead(o, n, 0x80, 16, 0xde, 2)


cdef int _wb_mp_str_bytes(wbuf* b, const char* u, size_t n) except -1:
    _wb_reserve(b, n + 5)
    cdef char* o = _p_mpstr(b.data + b.len, n)
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
    b.len = <size_t>(_p_mpu(b.data + b.len, v) - b.data)
    return 0


cdef int _wb_mp_map(wbuf* b, size_t n) except -1:
    _wb_reserve(b, 5)
    b.len = <size_t>(_p_mpmap(b.data + b.len, n) - b.data)
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


cdef extern from "kvconductor/c/encode.h":
    # min(a * b, 2^32-1): a row's matched tokens
    uint64_t kvc_sat_u32_mul(uint64_t a, uint64_t b) noexcept nogil


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
            h.matched = <uint32_t>kvc_sat_u32_mul(_sat_add(_sat_add(npu, cpu), disk), bs)
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

include "_encode_rows.pxi"


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
