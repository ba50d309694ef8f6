# -- what an array payload carries (ingest/recognize.py's first step): included by _ingest.pyx
#: :func:`array_payload_kind`: the first event names a vLLM/SGLang batch, a pool tuple, or
#: the C reader cannot tell (``recognize.py``'s Python reader decides).
cdef enum:
    P_UNSURE = 0
    P_VLLM = 1
    P_POOL = 2
    P_VLLM_TAG = 3      # (not whole) a vLLM tag read, the rest of the first event not

PAYLOAD_UNSURE, PAYLOAD_VLLM, PAYLOAD_POOL, PAYLOAD_VLLM_TAG = P_UNSURE, P_VLLM, P_POOL, P_VLLM_TAG


cdef inline bint _array_head(uint8_t b) noexcept nogil:
    return 0x90 <= b <= 0x9f or b == 0xdc or b == 0xdd


cdef inline bint _int_or_nil_head(uint8_t b) noexcept nogil:
    return b == 0xc0 or b <= 0x7f or b >= 0xe0 or 0xcc <= b <= 0xd3


cdef int _first_event_kind(const uint8_t* buf, size_t size, bint whole) noexcept nogil:
    """``recognize._looks_like_pool`` over the envelope ``split_batch`` reads, without
    decoding: a first event that is a map with a pool key, without ``type`` or with a
    ``type`` that is no vLLM tag is a pool tuple. A bad envelope is the vLLM decoder's
    to report (P_VLLM); what this reader skips no further (ext values, deep
    nesting, truncation) or a pool verdict that hangs on a non-ASCII key's UTF-8 is
    P_UNSURE. Not ``whole``: P_VLLM_TAG as soon as a vLLM tag is read with no pool key
    before it (the first key of a map event as msgspec and vLLM write it), the rest of
    the event unread (the fast path refuses pool keys and repeated keys)."""
    cdef wcur c
    cdef size_t n, npairs, _i
    cdef const uint8_t* s
    cdef const uint8_t* save
    cdef int fid, rc, kind
    cdef bint pool = False, typed = False, tagged = False, nonascii = False
    c.base = buf
    c.p = buf
    c.end = buf + size
    if mp_container(&c, 0x90, 0xdc, &n) != WIRE_OK or (n != 2 and n != 3):
        return P_VLLM
    if mp_skip(&c, MAX_DEPTH, False) != WIRE_OK or c.p >= c.end:
        return P_UNSURE
    if not _array_head(c.p[0]):  # [ts, dp, events]: dp an int or nil
        if n != 3 or not _int_or_nil_head(c.p[0]):
            return P_VLLM
        if mp_skip(&c, MAX_DEPTH, False) != WIRE_OK or c.p >= c.end:
            return P_UNSURE
        if not _array_head(c.p[0]):
            return P_VLLM
    if mp_container(&c, 0x90, 0xdc, &n) != WIRE_OK:
        return P_UNSURE
    if n == 0:
        return P_VLLM
    rc = mp_container(&c, 0x80, 0xde, &npairs)
    if rc != WIRE_OK:  # an event of another form (array, bin, ...) is vLLM's
        return P_UNSURE if rc == WIRE_EOF else P_VLLM
    for _i in range(npairs):
        rc = mp_str(&c, &s, &n)
        if rc != WIRE_OK:  # a key that is no str: msgspec reads no keys, not a pool
            return P_UNSURE if rc == WIRE_EOF else P_VLLM
        if not _ascii(s, n):
            nonascii = True
            fid = FID_SKIP
        else:
            fid = _fid(s, n)
        if fid == FID_POOL:
            pool = True
        elif fid == FID_TYPE:  # the last "type" counts, as in a decoded dict
            typed = True
            save = c.p
            tagged = _tag(&c, &kind) == R_OK
            if tagged and not pool and not whole:
                return P_VLLM_TAG
            c.p = save
        if mp_skip(&c, MAX_DEPTH, False) != WIRE_OK:
            return P_UNSURE
    if not pool and typed and tagged:
        return P_VLLM
    return P_UNSURE if nonascii else P_POOL


def array_payload_kind(payload, bint whole=True):
    """PAYLOAD_VLLM, PAYLOAD_POOL or PAYLOAD_UNSURE (not ``whole``: or PAYLOAD_VLLM_TAG)
    for a payload whose top value is a msgpack array (``ingest/recognize.py``, the Python
    reader its twin)."""
    cdef const uint8_t[::1] view
    cdef const uint8_t* buf
    cdef size_t size
    if PyBytes_Check(payload):
        return _first_event_kind(<const uint8_t*>PyBytes_AS_STRING(payload),
                                 <size_t>PyBytes_GET_SIZE(payload), whole)
    view = payload
    size = view.shape[0]
    buf = &view[0] if size else NULL
    return _first_event_kind(buf, size, whole)
