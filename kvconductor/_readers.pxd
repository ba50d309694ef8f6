# cython: language_level=3
"""Low-level MessagePack readers shared by the compiled parsers (``_wire``, ``_ingest``).

Everything here is ``cdef inline`` (the lookup tables are ``static`` C arrays), so
every module that cimports it compiles its own copy: no cross-module call on the
hot path, and no module has to be imported first.

Every reader works on a :c:type:`wcur` over a byte range, runs without the GIL,
never allocates (but :func:`mp_u32_array`, see there) and returns one of the
``WIRE_*`` codes. Each one takes the value at ``c.p`` and, on ``WIRE_OK``, moves
``c.p`` past it; on ``WIRE_EOF`` (truncated input) or ``WIRE_TYPE`` (a value of another
type; :func:`mp_int`: ``WIRE_BAD_BYTE`` for 0xc1) it leaves ``c.p`` unchanged unless
said otherwise. MessagePack readers check lengths and need no sentinel (the JSON
scanners of ``_wire`` do).
"""
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

cdef enum:
    WIRE_OK = 0
    WIRE_EOF = 1          # input ends inside a value (JSON) / truncated msgpack
    WIRE_SYNTAX = 2       # malformed JSON at c.p
    WIRE_TYPE = 3         # a well-formed value of another type than the one expected
    WIRE_RANGE = 4        # integer outside the allowed range
    WIRE_DEPTH = 5        # nesting deeper than allowed (JSON: WIRE_JSON_MAX_DEPTH)
    WIRE_BAD_BYTE = 6     # msgpack byte 0xc1 (never used)
    WIRE_CAPACITY = 7     # more elements than the output holds (malformed input only)
    WIRE_EXT = 8          # a msgpack ext value where none is allowed (mp_skip)
    WIRE_JSON_MAX_DEPTH = 1000
    MP_SKIP_MAX_DEPTH = 32  # largest max_depth mp_skip accepts

ctypedef struct wcur:
    const uint8_t* base   # start of the body (for byte offsets)
    const uint8_t* p      # current position
    const uint8_t* end    # one past the last byte


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


# Bytes s[:n] equal to the literal lit[:m].
cdef inline bint _eq(const uint8_t* s, size_t n, const char* lit, size_t m) noexcept nogil:
    return n == m and memcmp(s, lit, m) == 0


# The big-endian unsigned int of w = 1, 2, 4 or 8 bytes at p: every msgpack width (the
# length of a str, bin or ext, the count of an array or map, an int) is read here.
cdef inline uint64_t _be(const uint8_t* p, size_t w) noexcept nogil:
    if w == 1:
        return p[0]
    if w == 2:
        return _be16(p)
    if w == 4:
        return _be32(p)
    return _be64(p)


# The width of the length (or count) that follows tag b, for b in first..first+2 (8, 16 and
# 32 bits: 1, 2, 4 bytes), else 0.
cdef inline size_t _mp_width(uint8_t b, uint8_t first) noexcept nogil:
    if first <= b <= first + 2:
        return <size_t>1 << (b - first)
    return 0


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
        return WIRE_BAD_BYTE if b == 0xc1 else WIRE_TYPE
    bits[0] = <uint64_t>s
    neg[0] = s < 0
    return WIRE_OK


# str (str8 = 0xd9 and fixstr 0xa0..0xbf) or bin (bin8 = 0xc4, no fix form): *s, *n = its
# bytes (a str's UTF-8, not validated).
cdef inline int _mp_bytes(wcur* c, uint8_t tag8, bint fix, const uint8_t** s,
                          size_t* n) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef size_t left = _left(c)
    cdef size_t w, hdr, ln
    cdef uint8_t b
    if left == 0:
        return WIRE_EOF
    b = p[0]
    w = _mp_width(b, tag8)
    if fix and 0xa0 <= b <= 0xbf:
        hdr = 1
        ln = b & 0x1f
    elif w:
        hdr = 1 + w
        if left < hdr:
            return WIRE_EOF
        ln = _be(p + 1, w)
    else:
        return WIRE_TYPE
    if ln > left - hdr:
        return WIRE_EOF
    s[0] = p + hdr
    n[0] = ln
    c.p = p + hdr + ln
    return WIRE_OK


cdef inline int mp_str(wcur* c, const uint8_t** s, size_t* n) noexcept nogil:
    return _mp_bytes(c, 0xd9, True, s, n)


cdef inline int mp_bin(wcur* c, const uint8_t** s, size_t* n) noexcept nogil:
    return _mp_bytes(c, 0xc4, False, s, n)


# Array (fix=0x90, m16=0xdc) or map (fix=0x80, m16=0xde) header: *n = elements (map:
# pairs). The count is not checked against the bytes left.
cdef inline int mp_container(wcur* c, uint8_t fix, uint8_t m16, size_t* n) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef size_t left = _left(c)
    cdef size_t w
    cdef uint8_t b
    if left == 0:
        return WIRE_EOF
    b = p[0]
    if (b & 0xf0) == fix:
        n[0] = b & 0x0f
        c.p = p + 1
        return WIRE_OK
    if b != m16 and b != m16 + 1:
        return WIRE_TYPE
    w = 2 if b == m16 else 4
    if left <= w:
        return WIRE_EOF
    n[0] = _be(p + 1, w)
    c.p = p + 1 + w
    return WIRE_OK


# Skip one complete msgpack value of any type, nested ones included, without
# recursion. max_depth > 0 (at most MP_SKIP_MAX_DEPTH): a container nested max_depth
# levels deep (the value itself is level 0) gives WIRE_DEPTH; ext_ok false: an ext
# value gives WIRE_EXT. Byte 0xc1 gives WIRE_BAD_BYTE. On WIRE_EOF c.p is c.end, on
# the other errors the offending byte.
cdef inline int mp_skip(wcur* c, int max_depth, bint ext_ok) noexcept nogil:
    cdef uint64_t todo = 1          # values still to skip (containers add their children)
    cdef uint64_t marks[MP_SKIP_MAX_DEPTH]  # todo when each open container is done
    cdef uint64_t kids
    cdef int depth = 0
    cdef const uint8_t* p = c.p
    cdef const uint8_t* end = c.end
    cdef uint8_t b
    cdef size_t hdr, ln, left, w
    cdef bint box
    while todo:
        if max_depth:
            while depth and todo == marks[depth - 1]:
                depth -= 1
        todo -= 1
        left = <size_t>(end - p)
        if todo >= left:            # every pending value needs at least one byte
            c.p = end
            return WIRE_EOF
        b = p[0]
        if b <= 0x7f or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3:
            p += 1
            continue
        if b == 0xc1:
            c.p = p
            return WIRE_BAD_BYTE
        # the width of the length (count) after the tag, 0 for none: bin and str 8/16/32,
        # ext 8/16/32 (the length, then a type byte), array and map 16/32
        w = _mp_width(b, 0xc4) | _mp_width(b, 0xd9) | _mp_width(b, 0xc7)
        if b == 0xdc or b == 0xde:
            w = 2
        elif b == 0xdd or b == 0xdf:
            w = 4
        hdr = 1 + w
        ln = 0
        kids = 0
        box = (0x80 <= b <= 0x9f) or b >= 0xdc     # array or map (fix, 16, 32)
        if 0xa0 <= b <= 0xbf:
            ln = b & 0x1f
        elif 0xca <= b <= 0xd3:             # float, int
            hdr = mp_num_size(b)
        elif (0xc7 <= b <= 0xc9) or (0xd4 <= b <= 0xd8):
            if not ext_ok:
                c.p = p
                return WIRE_EXT
            if w:                           # ext 8/16/32: a type byte after the length
                hdr += 1
            else:                           # fixext 1/2/4/8/16: type byte + data
                hdr = 2 + (<size_t>1 << (b - 0xd4))
        elif box:
            if max_depth:
                if depth >= max_depth:
                    c.p = p
                    return WIRE_DEPTH
                marks[depth] = todo
                depth += 1
            if b <= 0x8f:                   # fixmap: pairs
                kids = 2 * <uint64_t>(b & 0x0f)
            elif b <= 0x9f:                 # fixarray
                kids = b & 0x0f
        if w:
            if left <= w:
                c.p = end
                return WIRE_EOF
            if not box:
                ln = _be(p + 1, w)
            elif b >= 0xde:                 # map16 / map32: pairs
                kids = 2 * _be(p + 1, w)
            else:
                kids = _be(p + 1, w)
        if box:
            if kids > left - hdr:           # every element needs at least one byte
                c.p = end
                return WIRE_EOF
            todo += kids
        if hdr > left or ln > left - hdr:
            c.p = end
            return WIRE_EOF
        p += hdr + ln
    c.p = p
    return WIRE_OK


# Branch-free decoding of the ints that fit 32 bits (fixints, uint8/16/32, int8/16/32):
# value = be32(p + OFF[tag]) >> SH[tag], arithmetic shift when SGN[tag]; LEN[tag] = 0 for
# every other tag (64-bit ints, errors). Random token ids mix uint16 and uint32
# encodings, so a branch per tag would mispredict about half the time.
cdef extern from "kvconductor/c/readers.h":
    const uint8_t _MP_LEN "kvr_mp_len"[256]
    const uint8_t _MP_OFF "kvr_mp_off"[256]
    const uint8_t _MP_SH "kvr_mp_sh"[256]
    const uint32_t _MP_SGN "kvr_mp_sgn"[256]


# Arrays of at least this many ints are decoded by two chains (mp_u32_array).
cdef enum:
    MP_SPLIT_MIN = 256
    MP_SPLIT_PROBE = 32   # elements decoded before B's start is chosen


cdef inline uint32_t _mp_fast(const uint8_t* p, uint8_t b) noexcept nogil:
    # the int of tag b (_MP_LEN[b] != 0) at p; 9 readable bytes at p
    cdef uint32_t w = _be32(p + _MP_OFF[b])
    cdef uint8_t sh = _MP_SH[b]
    cdef uint32_t m = _MP_SGN[b]
    return (<uint32_t>(<int32_t>w >> sh) & m) | ((w >> sh) & ~m)


# Parse n msgpack ints at c.p into out, truncated to their low 32 bits; ints of 2**63
# or more give WIRE_RANGE (as i64 would not hold them). *count = elements stored (on
# error: index of the offending element). From MP_SPLIT_MIN elements on, it allocates
# scratch (freed before it returns; without memory it decodes in one chain).
cdef inline int mp_u32_array(wcur* c, uint32_t* out, size_t n, size_t* count) noexcept nogil:
    if n >= MP_SPLIT_MIN:
        return _mp_u32_split(c, out, n, count)
    return _mp_u32_from(c, c.p, out, 0, n, count)


# mp_u32_array from element i at p (the elements before are in out already).
cdef inline int _mp_u32_from(wcur* c, const uint8_t* p, uint32_t* out, size_t i, size_t n,
                             size_t* count) noexcept nogil:
    cdef const uint8_t* end = c.end
    cdef uint8_t b, ln
    cdef uint64_t v = 0
    cdef bint neg = False
    cdef int rc = WIRE_OK
    while i < n:
        if end - p >= 9:
            # fast path: every encoding fits, no bounds checks
            b = p[0]
            ln = _MP_LEN[b]
            if ln:
                out[i] = _mp_fast(p, b)
                p += ln
            elif b == 0xcf:
                v = _be64(p + 1)
                if v > <uint64_t>0x7FFFFFFFFFFFFFFF:
                    rc = WIRE_RANGE
                    break
                out[i] = <uint32_t>v
                p += 9
            elif b == 0xd3:
                out[i] = <uint32_t>_be64(p + 1)
                p += 9
            else:
                rc = WIRE_BAD_BYTE if b == 0xc1 else WIRE_TYPE
                break
        else:
            c.p = p
            rc = mp_int(c, &v, &neg)
            if rc:
                break
            if not neg and v > <uint64_t>0x7FFFFFFFFFFFFFFF:
                rc = WIRE_RANGE
                break
            p = c.p
            out[i] = <uint32_t>v
        i += 1
    c.p = p
    count[0] = i
    return rc


# PERF: each element's position depends on the tag before it (a load and a table lookup,
# ~10 cycles), so one chain is latency-bound. Two chains run in turns: A from the start
# (the truth), B from where the middle element would be at the bytes per element of A's
# first MP_SPLIT_PROBE (a guess: it may start inside an element or past the array). B
# stores its values and lengths in scratch, always one contiguous decoding: a tag B cannot
# decode makes it start again at the next byte, dropping what it recorded (nothing of it
# is used yet). Once A reaches B's range, B's recorded starts are walked to A's position:
# if A stands on one, B's elements from there are exactly A's next ones (decoding is
# deterministic from a true start) and are copied; if not, A goes on alone. Either way
# A's general loop decodes whatever B did not give, so errors, 64-bit ints and truncation
# are found and counted as in one chain. About 30 % less time per token on an idle core
# (tests/test_wire.py checks it against one chain on arbitrary bytes).
cdef inline int _mp_u32_split(wcur* c, uint32_t* out, size_t n, size_t* count) noexcept nogil:
    cdef const uint8_t* pa = c.p
    cdef const uint8_t* pb
    cdef const uint8_t* first
    cdef const uint8_t* lim
    cdef size_t half = n // 2
    cdef size_t cap = n - half
    cdef size_t ia = 0, kb = 0, kj = 0, have, k, guess
    cdef uint8_t a, b, la, lb
    cdef bint bgo
    cdef uint32_t* vb
    cdef uint8_t* lens
    if c.end - pa < 32:
        return _mp_u32_from(c, pa, out, 0, n, count)
    vb = <uint32_t*>malloc(cap * (sizeof(uint32_t) + 1))
    if vb == NULL:
        return _mp_u32_from(c, pa, out, 0, n, count)
    lens = <uint8_t*>(vb + cap)
    lim = c.end - 9                    # a fast step at p needs p <= lim
    # B's start: A's first MP_SPLIT_PROBE elements give the bytes per element
    while ia < MP_SPLIT_PROBE and pa <= lim:
        a = pa[0]
        la = _MP_LEN[a]
        if la == 0:
            break
        out[ia] = _mp_fast(pa, a)
        pa += la
        ia += 1
    pb = lim + 1                       # no B
    if ia == MP_SPLIT_PROBE:
        guess = <size_t>(pa - c.p) * half // ia
        if guess < <size_t>(c.end - c.p):
            pb = c.p + guess
    while pb <= lim and _MP_LEN[pb[0]] == 0:
        pb += 1                        # B starts at a fast tag (nothing recorded before)
    first = pb
    bgo = pb <= lim
    # A and B in turns, until A reaches B's start or the middle index
    while ia < half and pa < first and pa <= lim:
        a = pa[0]
        la = _MP_LEN[a]
        if la == 0:
            break
        out[ia] = _mp_fast(pa, a)
        pa += la
        ia += 1
        if bgo:
            b = pb[0]
            lb = _MP_LEN[b]
            if lb == 0:
                # not on the array's path yet (or a tag B leaves to A): B starts again at
                # the next byte, dropping what it recorded (none of it is used yet)
                pb += 1
                first = pb
                kb = 0
                bgo = pb <= lim
            else:
                vb[kb] = _mp_fast(pb, b)
                lens[kb] = lb
                pb += lb
                kb += 1
                bgo = kb < cap and pb <= lim
    # A alone, looking for B's path: `first` walks B's starts (kj: B's element there)
    while ia < n and kj < kb:
        if pa >= first:
            while kj < kb and first < pa:
                first += lens[kj]
                kj += 1
            if kj == kb:
                break                  # A passed every start B recorded: no join
            if first == pa:            # joined: B's elements kj.. are A's ia..
                have = kb - kj
                if have > n - ia:
                    have = n - ia
                memcpy(out + ia, vb + kj, have * sizeof(uint32_t))
                for k in range(kj, kj + have):
                    pa += lens[k]
                ia += have
                break
        if pa > lim:
            break
        a = pa[0]
        la = _MP_LEN[a]
        if la == 0:
            break
        out[ia] = _mp_fast(pa, a)
        pa += la
        ia += 1
    free(vb)
    return _mp_u32_from(c, pa, out, ia, n, count)
