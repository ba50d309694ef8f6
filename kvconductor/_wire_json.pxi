# Included by _wire.pyx: the JSON scanner of the query parser and the JSON request parser.
#
# The scanners (json_*, _json_*) run without the GIL, never allocate and return a
# WIRE_* code (kvconductor/_readers.pxd); on error c.p points at the offending byte.
# They rely on a NUL byte at c.end[0] (every ``bytes`` object has one): they read at
# most that sentinel past the end and never step over it.


cdef extern from "kvconductor/c/wire_json.h":
    int _ctz64 "kvw_ctz64"(unsigned long long x) noexcept nogil   # x != 0


cdef inline bint _is_digit(uint8_t ch) noexcept nogil:
    return <unsigned int>(ch - 48) <= 9


cdef inline bint _is_hex(uint8_t ch) noexcept nogil:
    return _is_digit(ch) or <unsigned int>((ch | 0x20) - 97) <= 5


cdef inline int _hex_val(uint8_t ch) noexcept nogil:
    if ch <= 57:
        return ch - 48
    return (ch | 0x20) - 87


cdef inline uint32_t _hex4(const uint8_t* p) noexcept nogil:
    return ((<uint32_t>_hex_val(p[0]) << 12) | (<uint32_t>_hex_val(p[1]) << 8)
            | (<uint32_t>_hex_val(p[2]) << 4) | <uint32_t>_hex_val(p[3]))


cdef inline const uint8_t* _ws(const uint8_t* p) noexcept nogil:
    while p[0] == 32 or p[0] == 10 or p[0] == 13 or p[0] == 9:
        p += 1
    return p


cdef inline int _bad(const wcur* c, const uint8_t* p) noexcept nogil:
    """WIRE_EOF at the end of the input, else WIRE_SYNTAX."""
    return WIRE_EOF if p >= c.end else WIRE_SYNTAX


cdef int _json_string(wcur* c, const uint8_t** s, size_t* n, bint* esc) noexcept nogil:
    """String at c.p (its opening quote): content extent, escapes validated; c.p past it."""
    cdef const uint8_t* p = c.p + 1
    cdef const uint8_t* start = p
    cdef uint8_t ch
    cdef int k
    cdef uint32_t cp
    cdef bint e = False
    while True:
        ch = p[0]
        if ch == 34:            # '"'
            break
        if ch == 92:            # '\\'
            e = True
            ch = p[1]
            if (ch == 34 or ch == 92 or ch == 47 or ch == 98 or ch == 102 or ch == 110
                    or ch == 114 or ch == 116):
                p += 2
            elif ch == 117:     # 'u' + 4 hex digits (stops at the first non-hex: the NUL)
                for k in range(2, 6):
                    if not _is_hex(p[k]):
                        c.p = p + k
                        return _bad(c, p + k)
                cp = _hex4(p + 2)
                if 0xD800 <= cp <= 0xDBFF:
                    # a high surrogate must be followed by an escaped low one
                    if p[6] != 92 or p[7] != 117:
                        c.p = p
                        return _bad(c, p + 6)
                    for k in range(8, 12):
                        if not _is_hex(p[k]):
                            c.p = p + k
                            return _bad(c, p + k)
                    cp = _hex4(p + 8)
                    if not 0xDC00 <= cp <= 0xDFFF:
                        c.p = p
                        return WIRE_SYNTAX
                    p += 12
                elif 0xDC00 <= cp <= 0xDFFF:
                    c.p = p
                    return WIRE_SYNTAX
                else:
                    p += 6
            else:
                c.p = p
                return _bad(c, p + 1)
        elif ch < 32:
            c.p = p
            return _bad(c, p)
        else:
            p += 1
    s[0] = start
    n[0] = <size_t>(p - start)
    esc[0] = e
    c.p = p + 1
    return WIRE_OK


cdef inline uint8_t* _put_utf8(uint8_t* o, uint32_t cp) noexcept nogil:
    if cp < 0x80:
        o[0] = <uint8_t>cp
        return o + 1
    if cp < 0x800:
        o[0] = <uint8_t>(0xC0 | (cp >> 6))
        o[1] = <uint8_t>(0x80 | (cp & 0x3F))
        return o + 2
    if cp < 0x10000:
        o[0] = <uint8_t>(0xE0 | (cp >> 12))
        o[1] = <uint8_t>(0x80 | ((cp >> 6) & 0x3F))
        o[2] = <uint8_t>(0x80 | (cp & 0x3F))
        return o + 3
    o[0] = <uint8_t>(0xF0 | (cp >> 18))
    o[1] = <uint8_t>(0x80 | ((cp >> 12) & 0x3F))
    o[2] = <uint8_t>(0x80 | ((cp >> 6) & 0x3F))
    o[3] = <uint8_t>(0x80 | (cp & 0x3F))
    return o + 4


cdef Py_ssize_t _json_unescape(const uint8_t* s, size_t n, uint8_t* out) noexcept nogil:
    """Decode the escapes of s[:n] (validated by _json_string) into out (>= n bytes).

    Returns the output length, or -1 - offset on a lone surrogate (defensive)."""
    cdef size_t i = 0
    cdef uint8_t* o = out
    cdef uint8_t ch
    cdef uint32_t cp, lo
    while i < n:
        ch = s[i]
        if ch != 92:
            o[0] = ch
            o += 1
            i += 1
            continue
        ch = s[i + 1]
        if ch == 117:
            cp = _hex4(s + i + 2)
            if 0xD800 <= cp <= 0xDBFF:
                if i + 12 <= n and s[i + 6] == 92 and s[i + 7] == 117:
                    lo = _hex4(s + i + 8)
                    if 0xDC00 <= lo <= 0xDFFF:
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
                        o = _put_utf8(o, cp)
                        i += 12
                        continue
                return -1 - <Py_ssize_t>i
            if 0xDC00 <= cp <= 0xDFFF:
                return -1 - <Py_ssize_t>i
            o = _put_utf8(o, cp)
            i += 6
            continue
        if ch == 98:
            o[0] = 8
        elif ch == 102:
            o[0] = 12
        elif ch == 110:
            o[0] = 10
        elif ch == 114:
            o[0] = 13
        elif ch == 116:
            o[0] = 9
        else:                   # '"', '\\', '/'
            o[0] = ch
        o += 1
        i += 2
    return <Py_ssize_t>(o - out)


cdef int _json_skip_number(wcur* c) noexcept nogil:
    cdef const uint8_t* p = c.p
    if p[0] == 45:
        p += 1
    if p[0] == 48:
        p += 1
    elif _is_digit(p[0]):
        while _is_digit(p[0]):
            p += 1
    else:
        c.p = p
        return _bad(c, p)
    if p[0] == 46:
        p += 1
        if not _is_digit(p[0]):
            c.p = p
            return _bad(c, p)
        while _is_digit(p[0]):
            p += 1
    if (p[0] | 0x20) == 101:
        p += 1
        if p[0] == 43 or p[0] == 45:
            p += 1
        if not _is_digit(p[0]):
            c.p = p
            return _bad(c, p)
        while _is_digit(p[0]):
            p += 1
    c.p = p
    return WIRE_OK


cdef inline bint _lit(const uint8_t* p, char a, char b, char d, char e) noexcept nogil:
    return p[0] == a and p[1] == b and p[2] == d and p[3] == e


cdef int _json_scalar(wcur* c) noexcept nogil:
    """Skip a string, number or literal at c.p."""
    cdef const uint8_t* s = NULL
    cdef size_t n = 0
    cdef bint esc
    cdef const uint8_t* p = c.p
    cdef uint8_t ch = p[0]
    if ch == 34:
        return _json_string(c, &s, &n, &esc)
    if ch == 45 or _is_digit(ch):
        return _json_skip_number(c)
    if _lit(p, b't', b'r', b'u', b'e') or _lit(p, b'n', b'u', b'l', b'l'):
        c.p = p + 4
        return WIRE_OK
    if _lit(p, b'f', b'a', b'l', b's') and p[4] == b'e':
        c.p = p + 5
        return WIRE_OK
    return _bad(c, p)


cdef inline int _json_key(wcur* c) noexcept nogil:
    """Skip `"key" :` at c.p (whitespace before allowed); c.p lands after the colon."""
    cdef const uint8_t* s = NULL
    cdef size_t n = 0
    cdef bint esc
    cdef int rc
    c.p = _ws(c.p)
    if c.p[0] != 34:
        return _bad(c, c.p)
    rc = _json_string(c, &s, &n, &esc)
    if rc:
        return rc
    c.p = _ws(c.p)
    if c.p[0] != 58:
        return _bad(c, c.p)
    c.p += 1
    return WIRE_OK


cdef int json_skip_value(wcur* c) noexcept nogil:
    cdef uint8_t stack[WIRE_JSON_MAX_DEPTH]
    cdef int depth = 0
    cdef int rc
    cdef uint8_t ch, top
    cdef bint opened
    while True:
        # -- one value at c.p
        c.p = _ws(c.p)
        ch = c.p[0]
        opened = False
        if ch == 123 or ch == 91:           # '{' '['
            c.p = _ws(c.p + 1)
            if c.p[0] == ch + 2:            # '}' / ']' (empty container)
                c.p += 1
            else:
                if depth >= WIRE_JSON_MAX_DEPTH:
                    return WIRE_DEPTH
                stack[depth] = ch
                depth += 1
                opened = True
                if ch == 123:
                    rc = _json_key(c)
                    if rc:
                        return rc
        else:
            rc = _json_scalar(c)
            if rc:
                return rc
        if opened:
            continue
        # -- after a value: separators and closing brackets
        while True:
            if depth == 0:
                return WIRE_OK
            c.p = _ws(c.p)
            ch = c.p[0]
            top = stack[depth - 1]
            if ch == 44:                    # ','
                c.p += 1
                if top == 123:
                    rc = _json_key(c)
                    if rc:
                        return rc
                break
            if ch == top + 2:
                c.p += 1
                depth -= 1
            else:
                return _bad(c, c.p)


cdef inline int _json_not_int(const wcur* c, const uint8_t* p) noexcept nogil:
    """Classify a non-number where an integer was expected."""
    cdef uint8_t ch = p[0]
    if p >= c.end:
        return WIRE_EOF
    if ch == 34 or ch == 91 or ch == 123 or ch == 116 or ch == 102 or ch == 110:
        return WIRE_TYPE
    return WIRE_SYNTAX


cdef inline int _json_int(const wcur* c, const uint8_t** pp, uint64_t* mag,
                          bint* neg) noexcept nogil:
    """Integer at *pp: magnitude (must fit u64) and sign; *pp moves past it.

    Floats (fraction or exponent) give WIRE_TYPE, leading zeros WIRE_SYNTAX."""
    cdef const uint8_t* p = pp[0]
    cdef uint64_t v
    cdef unsigned int d
    cdef int k
    cdef bint ng = p[0] == 45
    if ng:
        p += 1
    d = <unsigned int>(p[0] - 48)
    if d > 9:
        pp[0] = p
        return _bad(c, p) if ng else _json_not_int(c, p)
    v = d
    p += 1
    if d == 0:
        if _is_digit(p[0]):
            pp[0] = p
            return WIRE_SYNTAX
    else:
        k = 1
        while k < 19:
            d = <unsigned int>(p[0] - 48)
            if d > 9:
                break
            v = v * 10 + d
            p += 1
            k += 1
        if k == 19:
            d = <unsigned int>(p[0] - 48)
            if d <= 9:
                if v > 1844674407370955161ULL or (v == 1844674407370955161ULL and d > 5):
                    pp[0] = p
                    return WIRE_RANGE
                v = v * 10 + d
                p += 1
                if _is_digit(p[0]):
                    pp[0] = p
                    return WIRE_RANGE
    if p[0] == 46 or (p[0] | 0x20) == 101:
        pp[0] = p
        return WIRE_TYPE
    pp[0] = p
    mag[0] = v
    neg[0] = ng
    return WIRE_OK


cdef size_t json_count_upper(const uint8_t* p, const uint8_t* end) noexcept nogil:
    cdef const uint8_t* q = <const uint8_t*>memchr(p, 93, <size_t>(end - p))
    cdef size_t i, m, n = 1
    if q == NULL:
        q = end
    m = <size_t>(q - p)
    for i in range(m):
        n += p[i] == 44
    return n


cdef inline int _json_after_elem(const wcur* c, const uint8_t** pp) noexcept nogil:
    """After an element: 0 = another follows (*pp at it), 1 = array closed, else -code."""
    cdef const uint8_t* p = pp[0]
    if p[0] == 44:
        pp[0] = _ws(p + 1)
        return 0
    if p[0] == 93:
        pp[0] = p + 1
        return 1
    p = _ws(p)
    if p[0] == 44:
        pp[0] = _ws(p + 1)
        return 0
    if p[0] == 93:
        pp[0] = p + 1
        return 1
    pp[0] = p
    return -_bad(c, p)


cdef inline uint64_t _le64(const uint8_t* p) noexcept nogil:
    return ((<uint64_t>p[0]) | (<uint64_t>p[1] << 8) | (<uint64_t>p[2] << 16)
            | (<uint64_t>p[3] << 24) | (<uint64_t>p[4] << 32) | (<uint64_t>p[5] << 40)
            | (<uint64_t>p[6] << 48) | (<uint64_t>p[7] << 56))


cdef int json_u32_array(wcur* c, uint32_t* out, size_t cap, size_t* count) noexcept nogil:
    cdef const uint8_t* p = _ws(c.p)
    cdef const uint8_t* q
    cdef const uint8_t* end = c.end
    cdef size_t n = 0
    cdef uint64_t v = 0, x, t, nd
    cdef unsigned int k
    cdef bint neg = False
    cdef int rc
    if p[0] == 93:
        c.p = p + 1
        count[0] = 0
        return WIRE_OK
    while True:
        if n >= cap:
            rc = WIRE_CAPACITY
            break
        # SWAR fast path: an integer of 1..7 digits read as one 8-byte word (the digit
        # count varies per token, so a per-digit loop mispredicts its exit branch).
        neg = p[0] == 45
        q = p + neg
        if end - q >= 8:
            x = _le64(q)
            t = x ^ 0x3030303030303030ULL             # digit bytes -> 0..9
            nd = (t & 0xF0F0F0F0F0F0F0F0ULL) | (
                ((t & 0x0F0F0F0F0F0F0F0FULL) + 0x0606060606060606ULL) & 0x1010101010101010ULL)
            if nd:
                k = <unsigned int>_ctz64(nd) >> 3       # number of leading digits
                q += k
                if (k != 0 and (k == 1 or (x & 0xFF) != 0x30)
                        and q[0] != 46 and (q[0] | 0x20) != 101):
                    t <<= 64 - 8 * k
                    t = ((t & 0x0F0F0F0F0F0F0F0FULL) * 2561) >> 8
                    t = ((t & 0x00FF00FF00FF00FFULL) * 6553601) >> 16
                    v = ((t & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32
                    out[n] = <uint32_t>(0 - v) if neg else <uint32_t>v
                    n += 1
                    p = q
                    rc = _json_after_elem(c, &p)
                    if rc == 0:
                        continue
                    if rc == 1:
                        rc = WIRE_OK
                    else:
                        rc = -rc
                    break
        # general path: any length, range checks, precise errors
        rc = _json_int(c, &p, &v, &neg)
        if rc:
            break
        if neg:
            if v > _I64_MAX + 1:
                rc = WIRE_RANGE
                break
            v = 0 - v
        elif v > _I64_MAX:
            rc = WIRE_RANGE
            break
        out[n] = <uint32_t>v
        n += 1
        rc = _json_after_elem(c, &p)
        if rc == 0:
            continue
        if rc == 1:
            rc = WIRE_OK
        else:
            rc = -rc
        break
    c.p = p
    count[0] = n
    return rc


cdef int json_u64_array(wcur* c, uint64_t* out, size_t cap, size_t* count) noexcept nogil:
    cdef const uint8_t* p = _ws(c.p)
    cdef size_t n = 0
    cdef uint64_t v = 0
    cdef bint neg = False
    cdef int rc
    if p[0] == 93:
        c.p = p + 1
        count[0] = 0
        return WIRE_OK
    while True:
        rc = _json_int(c, &p, &v, &neg)
        if rc:
            break
        if neg and v != 0:
            rc = WIRE_RANGE
            break
        if n >= cap:
            rc = WIRE_CAPACITY
            break
        out[n] = v
        n += 1
        rc = _json_after_elem(c, &p)
        if rc == 0:
            continue
        if rc == 1:
            rc = WIRE_OK
        else:
            rc = -rc
        break
    c.p = p
    count[0] = n
    return rc


# =========================================================================================
# JSON request parsing (with the GIL; the big scans release it)
# =========================================================================================

cdef str _json_str_value(wcur* c, int fid):
    """The JSON string at c.p (a '"') as str; c.p moves past it."""
    cdef const uint8_t* s = NULL
    cdef size_t n = 0
    cdef bint esc
    cdef uint8_t* tmp
    cdef Py_ssize_t m
    _check(_json_string(c, &s, &n, &esc), c, True, FIELD_UNKNOWN, -1)
    if not esc:
        return _decode_utf8(s, n, fid)
    tmp = <uint8_t*>malloc(n + 1)
    if tmp == NULL:
        raise MemoryError()
    try:
        m = _json_unescape(s, n, tmp)
        if m < 0:
            raise WireError(f"invalid JSON at byte {(s - c.base) + (-1 - m)} (lone surrogate)")
        return _decode_utf8(tmp, <size_t>m, fid)
    finally:
        free(tmp)


cdef int _json_key_id(wcur* c, const uint8_t* s, size_t n, bint esc) except -1:
    cdef uint8_t tmp[160]
    cdef Py_ssize_t m
    if not esc:
        return _field_id(s, n)
    if n > sizeof(tmp):
        return FIELD_UNKNOWN
    m = _json_unescape(s, n, tmp)
    if m < 0:
        raise WireError(f"invalid JSON at byte {(s - c.base) + (-1 - m)} (lone surrogate)")
    return _field_id(tmp, <size_t>m)


cdef int _json_skip(wcur* c) noexcept:
    cdef int rc
    if _left(c) > _NOGIL_BYTES:
        with nogil:
            rc = json_skip_value(c)
    else:
        rc = json_skip_value(c)
    return rc


cdef object _json_type_error(wcur* c, int fid, str expected):
    """A well-formed value of the wrong type -> type error; malformed -> syntax error."""
    _check(_json_skip(c), c, True, FIELD_UNKNOWN, -1)
    raise WireError(f"invalid type for `{_field_name(fid)}`: expected {expected}")


cdef array.array _json_values(wcur* c, bint u64, int fid):
    """The integer array at c.p (a '[')."""
    cdef size_t cap, n = 0
    cdef int rc
    cdef array.array arr
    cdef bint big
    c.p += 1
    cap = json_count_upper(c.p, c.end)
    arr = _new_array(u64, cap)
    big = _left(c) > _NOGIL_BYTES
    if u64:
        if big:
            with nogil:
                rc = json_u64_array(c, <uint64_t*>arr.data.as_ulonglongs, cap, &n)
        else:
            rc = json_u64_array(c, <uint64_t*>arr.data.as_ulonglongs, cap, &n)
    else:
        if big:
            with nogil:
                rc = json_u32_array(c, arr.data.as_uints, cap, &n)
        else:
            rc = json_u32_array(c, arr.data.as_uints, cap, &n)
    _check(rc, c, True, fid, <Py_ssize_t>n)
    if n != cap:
        array.resize(arr, <Py_ssize_t>n)
    return arr


cdef list _json_str_array(wcur* c, int fid):
    """The JSON array of strings at c.p (a '[')."""
    cdef list out = []
    c.p = _ws(c.p + 1)
    if c.p[0] == 93:
        c.p += 1
        return out
    while True:
        if c.p[0] != 34:
            _json_type_error(c, fid, "an array of strings or null")
        out.append(_json_str_value(c, fid))
        c.p = _ws(c.p)
        if c.p[0] == 44:
            c.p = _ws(c.p + 1)
            continue
        if c.p[0] == 93:
            c.p += 1
            return out
        _check(_bad(c, c.p), c, True, FIELD_UNKNOWN, -1)


cdef tuple _parse_json(const uint8_t* buf, size_t size, bint by_hash, bint ext):
    cdef wcur c
    cdef const uint8_t* s = NULL
    cdef size_t n = 0
    cdef bint esc = False, neg = False, have_bs = False
    cdef uint64_t v = 0
    cdef int fid, rc
    cdef int vfid = FIELD_BLOCK_HASHES if by_hash else FIELD_TOKEN_IDS
    cdef const uint8_t* p
    model = None
    tenant = None
    lora = None
    block_size = 0
    values = None
    top_k = None
    instances = None
    cdef bint fresh = False, xs = False, xm = False
    c.base = buf
    c.end = buf + size
    c.p = _ws(buf)
    if c.p[0] != 123:
        if c.p >= c.end:
            raise WireError("empty body")
        _check(_json_skip(&c), &c, True, FIELD_UNKNOWN, -1)
        raise WireError("expected a JSON object")
    c.p = _ws(c.p + 1)
    if c.p[0] == 125:
        c.p += 1
    else:
        while True:
            if c.p[0] != 34:
                _check(_bad(&c, c.p), &c, True, FIELD_UNKNOWN, -1)
            _check(_json_string(&c, &s, &n, &esc), &c, True, FIELD_UNKNOWN, -1)
            fid = _json_key_id(&c, s, n, esc)
            c.p = _ws(c.p)
            if c.p[0] != 58:
                _check(_bad(&c, c.p), &c, True, FIELD_UNKNOWN, -1)
            c.p = _ws(c.p + 1)
            if fid == FIELD_MODEL:
                if c.p[0] != 34:
                    _json_type_error(&c, fid, "a string")
                model = _json_str_value(&c, fid)
            elif fid == FIELD_TENANT or fid == FIELD_LORA:
                if c.p[0] == 34:
                    text = _json_str_value(&c, fid)
                elif _lit(c.p, b'n', b'u', b'l', b'l'):
                    c.p += 4
                    text = None
                else:
                    _json_type_error(&c, fid, "a string or null")
                if fid == FIELD_TENANT:
                    tenant = text
                else:
                    lora = text
            elif fid == FIELD_BLOCK_SIZE:
                p = c.p
                rc = _json_int(&c, &p, &v, &neg)
                if rc == WIRE_TYPE:
                    _json_type_error(&c, fid, "an integer")
                c.p = p
                _check(rc, &c, True, fid, -1)
                block_size = _block_size(v, neg and v != 0)
                have_bs = True
            elif fid == vfid:
                if c.p[0] != 91:
                    _json_type_error(&c, fid, "an array of integers")
                values = _json_values(&c, by_hash, fid)
            elif fid == FIELD_TOP_K and ext:
                if _lit(c.p, b'n', b'u', b'l', b'l'):
                    c.p += 4
                    top_k = None
                else:
                    p = c.p
                    rc = _json_int(&c, &p, &v, &neg)
                    if rc == WIRE_TYPE:
                        _json_type_error(&c, fid, "an integer or null")
                    c.p = p
                    _check(rc, &c, True, fid, -1)
                    top_k = _top_k(v, neg and v != 0)
            elif fid == FIELD_INSTANCES and ext:
                if _lit(c.p, b'n', b'u', b'l', b'l'):
                    c.p += 4
                    instances = None
                elif c.p[0] == 91:
                    instances = _json_str_array(&c, fid)
                else:
                    _json_type_error(&c, fid, "an array of strings or null")
            elif fid == FIELD_FRESHNESS and ext:
                if _lit(c.p, b't', b'r', b'u', b'e'):
                    c.p += 4
                    fresh = True
                elif _lit(c.p, b'n', b'u', b'l', b'l'):
                    c.p += 4
                    fresh = False
                elif _lit(c.p, b'f', b'a', b'l', b's') and c.p[4] == b'e':
                    c.p += 5
                    fresh = False
                else:
                    _json_type_error(&c, fid, "a boolean or null")
            elif (fid == FIELD_CACHE_SALT or fid == FIELD_MM_INPUTS) and ext:
                if fid == FIELD_CACHE_SALT:
                    xs = not _lit(c.p, b'n', b'u', b'l', b'l')
                else:
                    xm = not _lit(c.p, b'n', b'u', b'l', b'l')
                _check(_json_skip(&c), &c, True, FIELD_UNKNOWN, -1)
            else:
                _check(_json_skip(&c), &c, True, FIELD_UNKNOWN, -1)
            c.p = _ws(c.p)
            if c.p[0] == 44:
                c.p = _ws(c.p + 1)
                continue
            if c.p[0] == 125:
                c.p += 1
                break
            _check(_bad(&c, c.p), &c, True, FIELD_UNKNOWN, -1)
    c.p = _ws(c.p)
    if c.p < c.end:
        raise WireError("trailing data")
    return _finish(model, block_size, have_bs, tenant, values, by_hash, lora, ext, top_k,
                   instances, fresh, xs or xm)
