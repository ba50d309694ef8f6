# cython: language_level=3
"""C-level scanners of the /query wire formats (JSON and MessagePack).

Every scanner works on a :c:type:`wcur` over a byte range, runs without the
GIL, never allocates and returns one of the ``WIRE_*`` codes. On error
``c.p`` points at the offending byte (for messages with a byte offset).

JSON scanners rely on a NUL byte at ``c.end[0]`` (every ``bytes`` object has
one): they read at most that sentinel past the end and never step over it.
MessagePack scanners check lengths and need no sentinel.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t

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
