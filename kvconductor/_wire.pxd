# cython: language_level=3
"""C-level scanners of the /query wire formats (JSON and MessagePack).

Every scanner works on a :c:type:`wcur` over a byte range, runs without the
GIL, never allocates and returns one of the ``WIRE_*`` codes. On error
``c.p`` points at the offending byte (for messages with a byte offset).

JSON scanners rely on a NUL byte at ``c.end[0]`` (every ``bytes`` object has
one): they read at most that sentinel past the end and never step over it.
MessagePack scanners check lengths and need no sentinel.

The small msgpack readers at the end are ``cdef inline`` and defined here, so every
module that cimports them (``_ingest``) compiles its own copy: no cross-module call
on the hot path.
"""
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp

cdef enum:
    WIRE_OK = 0
    WIRE_EOF = 1          # input ends inside a value (JSON) / truncated msgpack
    WIRE_SYNTAX = 2       # malformed JSON at c.p
    WIRE_NOT_INT = 3      # a well-formed value that is not an integer
    WIRE_RANGE = 4        # integer outside the allowed range
    WIRE_DEPTH = 5        # JSON nesting deeper than WIRE_JSON_MAX_DEPTH
    WIRE_BAD_BYTE = 6     # msgpack byte 0xc1 (never used)
    WIRE_CAPACITY = 7     # more elements than the output holds (malformed input only)
    WIRE_JSON_MAX_DEPTH = 1000

ctypedef struct wcur:
    const uint8_t* base   # start of the body (for byte offsets)
    const uint8_t* p      # current position
    const uint8_t* end    # one past the last byte

# JSON (NUL sentinel at end[0] required) ---------------------------------------------
# Validate and skip one JSON value at c.p (leading whitespace allowed).
cdef int json_skip_value(wcur* c) noexcept nogil
# Upper bound of the number of elements of the integer array whose '[' precedes p:
# 1 + the commas before the first ']' (exact for a well-formed integer array).
cdef size_t json_count_upper(const uint8_t* p, const uint8_t* end) noexcept nogil
# Parse the integer array whose '[' is just before c.p into out (capacity cap).
# u32: i64 values truncated to their low 32 bits; u64: values in [0, 2^64).
# *count = elements stored (on error: index of the offending element).
cdef int json_u32_array(wcur* c, uint32_t* out, size_t cap, size_t* count) noexcept nogil
cdef int json_u64_array(wcur* c, uint64_t* out, size_t cap, size_t* count) noexcept nogil

# MessagePack ---------------------------------------------------------------------------
# Skip one complete msgpack value (any type, nested included; no recursion).
cdef int mp_skip(wcur* c) noexcept nogil
# Parse n integer elements (any msgpack int encoding) at c.p into out.
cdef int mp_u32_array(wcur* c, uint32_t* out, size_t n, size_t* count) noexcept nogil
cdef int mp_u64_array(wcur* c, uint64_t* out, size_t n, size_t* count) noexcept nogil


# Inline helpers and msgpack readers (compiled into every module that cimports them) ----
# Each reader takes the value at c.p and, on WIRE_OK, moves c.p past it; on WIRE_EOF
# (truncated input) or WIRE_NOT_INT ("another type"; mp_int: WIRE_BAD_BYTE for 0xc1)
# it leaves c.p unchanged.

# Big-endian loads.
cdef inline uint16_t _be16(const uint8_t* p) noexcept nogil:
    return <uint16_t>((<uint16_t>p[0] << 8) | p[1])


cdef inline uint32_t _be32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3]


cdef inline uint64_t _be64(const uint8_t* p) noexcept nogil:
    return (<uint64_t>_be32(p) << 32) | <uint64_t>_be32(p + 4)


# Size of the float or int value with tag b, 0xca <= b <= 0xd3 (float32/64, uint8..64,
# int8..64): the tag and 4, 8, 1, 2, 4, 8, 1, 2, 4, 8 bytes.
cdef inline size_t mp_num_size(uint8_t b) noexcept nogil:
    return 1 + (<size_t>1 << (b & 3))


# Bytes left after c.p.
cdef inline size_t _left(const wcur* c) noexcept nogil:
    return <size_t>(c.end - c.p)


# Any msgpack int: its 64 bits (two's complement when *neg) and sign.
cdef inline int mp_int(wcur* c, uint64_t* bits, bint* neg) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef size_t left = _left(c)
    cdef uint8_t b
    cdef int64_t s
    if left == 0:
        return WIRE_EOF
    b = p[0]
    if b <= 0x7f:
        bits[0] = b
        neg[0] = False
        c.p = p + 1
        return WIRE_OK
    if b >= 0xe0:
        bits[0] = <uint64_t><int64_t><int8_t>b
        neg[0] = True
        c.p = p + 1
        return WIRE_OK
    if b == 0xcc:
        if left < 2:
            return WIRE_EOF
        bits[0] = p[1]
        neg[0] = False
        c.p = p + 2
        return WIRE_OK
    if b == 0xcd:
        if left < 3:
            return WIRE_EOF
        bits[0] = _be16(p + 1)
        neg[0] = False
        c.p = p + 3
        return WIRE_OK
    if b == 0xce:
        if left < 5:
            return WIRE_EOF
        bits[0] = _be32(p + 1)
        neg[0] = False
        c.p = p + 5
        return WIRE_OK
    if b == 0xcf:
        if left < 9:
            return WIRE_EOF
        bits[0] = _be64(p + 1)
        neg[0] = False
        c.p = p + 9
        return WIRE_OK
    if b == 0xd0:
        if left < 2:
            return WIRE_EOF
        s = <int8_t>p[1]
        c.p = p + 2
    elif b == 0xd1:
        if left < 3:
            return WIRE_EOF
        s = <int16_t>_be16(p + 1)
        c.p = p + 3
    elif b == 0xd2:
        if left < 5:
            return WIRE_EOF
        s = <int32_t>_be32(p + 1)
        c.p = p + 5
    elif b == 0xd3:
        if left < 9:
            return WIRE_EOF
        s = <int64_t>_be64(p + 1)
        c.p = p + 9
    else:
        return WIRE_BAD_BYTE if b == 0xc1 else WIRE_NOT_INT
    bits[0] = <uint64_t>s
    neg[0] = s < 0
    return WIRE_OK


# str: *s, *n = its UTF-8 bytes (not validated).
cdef inline int mp_str(wcur* c, const uint8_t** s, size_t* n) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef size_t left = _left(c)
    cdef size_t hdr, ln
    cdef uint8_t b
    if left == 0:
        return WIRE_EOF
    b = p[0]
    if 0xa0 <= b <= 0xbf:
        hdr = 1
        ln = b & 0x1f
    elif b == 0xd9:
        hdr = 2
        if left < 2:
            return WIRE_EOF
        ln = p[1]
    elif b == 0xda:
        hdr = 3
        if left < 3:
            return WIRE_EOF
        ln = _be16(p + 1)
    elif b == 0xdb:
        hdr = 5
        if left < 5:
            return WIRE_EOF
        ln = _be32(p + 1)
    else:
        return WIRE_NOT_INT
    if ln > left - hdr:
        return WIRE_EOF
    s[0] = p + hdr
    n[0] = ln
    c.p = p + hdr + ln
    return WIRE_OK


# Array (fix=0x90, m16=0xdc) or map (fix=0x80, m16=0xde) header: *n = elements (map:
# pairs). The count is not checked against the bytes left.
cdef inline int mp_container(wcur* c, uint8_t fix, uint8_t m16, size_t* n) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef size_t left = _left(c)
    cdef uint8_t b
    if left == 0:
        return WIRE_EOF
    b = p[0]
    if (b & 0xf0) == fix:
        n[0] = b & 0x0f
        c.p = p + 1
    elif b == m16:
        if left < 3:
            return WIRE_EOF
        n[0] = _be16(p + 1)
        c.p = p + 3
    elif b == m16 + 1:
        if left < 5:
            return WIRE_EOF
        n[0] = _be32(p + 1)
        c.p = p + 5
    else:
        return WIRE_NOT_INT
    return WIRE_OK


# bin: *s, *n = its bytes.
cdef inline int mp_bin(wcur* c, const uint8_t** s, size_t* n) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef size_t left = _left(c)
    cdef size_t hdr, ln
    cdef uint8_t b
    if left == 0:
        return WIRE_EOF
    b = p[0]
    if b == 0xc4:
        hdr = 2
        if left < 2:
            return WIRE_EOF
        ln = p[1]
    elif b == 0xc5:
        hdr = 3
        if left < 3:
            return WIRE_EOF
        ln = _be16(p + 1)
    elif b == 0xc6:
        hdr = 5
        if left < 5:
            return WIRE_EOF
        ln = _be32(p + 1)
    else:
        return WIRE_NOT_INT
    if ln > left - hdr:
        return WIRE_EOF
    s[0] = p + hdr
    n[0] = ln
    c.p = p + hdr + ln
    return WIRE_OK


# Bytes s[:n] equal to the literal lit[:m].
cdef inline bint _eq(const uint8_t* s, size_t n, const char* lit, size_t m) noexcept nogil:
    return n == m and memcmp(s, lit, m) == 0
