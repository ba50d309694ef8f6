# The extra keys of a vLLM ``BlockStored`` (docs/api.md, "Block hashing"; docs/events.md):
# ``extra_keys`` read from its msgpack bytes into one digest per block (0: none), as
# ``kvconductor._py.hash.event_extra_digests`` (the twin) reads them. Included by
# ``_ingest.pyx``: the fast path and the Python decoder (``extra_key_digests``) both call
# ``_extra_digests``.

cdef inline bint _utf8_ok(const uint8_t* s, size_t n) noexcept nogil:
    """Strict UTF-8 (what msgspec and Python accept: no overlongs, no surrogates)."""
    cdef size_t i = 0, k, need
    cdef uint32_t cp
    cdef uint8_t b
    while i < n:
        b = s[i]
        if b < 0x80:
            i += 1
            continue
        if 0xc2 <= b <= 0xdf:
            need = 1
            cp = b & 0x1f
        elif 0xe0 <= b <= 0xef:
            need = 2
            cp = b & 0x0f
        elif 0xf0 <= b <= 0xf4:
            need = 3
            cp = b & 0x07
        else:
            return False
        if n - i <= need:
            return False
        for k in range(1, need + 1):
            if (s[i + k] & 0xc0) != 0x80:
                return False
            cp = (cp << 6) | (s[i + k] & 0x3f)
        if ((need == 2 and (cp < 0x800 or 0xd800 <= cp <= 0xdfff))
                or (need == 3 and (cp < 0x10000 or cp > 0x10ffff))):
            return False
        i += need + 1
    return True


cdef int _extra_item(wcur* c, uint64_t* item) noexcept nogil:
    """One item of a block's entry: a str (cache_salt), a bin (prompt-embeds digest) or an
    ``[identifier, offset]`` pair; -1 for any other shape."""
    cdef const uint8_t* s
    cdef size_t n, m
    cdef uint64_t off
    cdef bint neg
    if mp_str(c, &s, &n) == WIRE_OK:
        if not _utf8_ok(s, n):
            return -1
        item[0] = extra_item(XK_SALT, s, n, 0)
        return 0
    if mp_bin(c, &s, &n) == WIRE_OK:
        item[0] = extra_item(XK_EMBEDS, s, n, 0)
        return 0
    if _container(c, False, &m) != WIRE_OK or m != 2:
        return -1
    if mp_str(c, &s, &n) != WIRE_OK or not _utf8_ok(s, n):
        return -1
    if mp_int(c, &off, &neg) != WIRE_OK:
        return -1
    item[0] = extra_item(XK_MM, s, n, off)
    return 0


cdef int _extra_digests(const uint8_t* p, size_t size, const uint8_t* lora, size_t lora_n,
                        size_t nblocks, uint64_t* out, bint* some) noexcept nogil:
    """``extra_keys`` (the msgpack value at ``p``, ``size`` bytes) into ``out[0:nblocks]``;
    ``some``: a digest is not 0. 0, or -1 for a shape that is not vLLM's (nothing of
    ``out`` to be used). The LoRA name, the first item of each entry when the event names
    one, is its seed already: skipped."""
    cdef wcur c
    cdef size_t n, m, i, k, sn
    cdef const uint8_t* s
    cdef const uint8_t* save
    cdef uint64_t d, item
    c.base = p
    c.p = p
    c.end = p + size
    some[0] = False
    if _nil(&c):
        return 0 if c.p == c.end else -1
    if _container(&c, False, &n) != WIRE_OK or n != nblocks:
        return -1
    for i in range(n):
        out[i] = 0
        if _nil(&c):
            continue
        if _container(&c, False, &m) != WIRE_OK:
            return -1
        d = 0
        for k in range(m):
            if k == 0 and lora_n:
                save = c.p
                if mp_str(&c, &s, &sn) == WIRE_OK and _eq(s, sn, <const char*>lora, lora_n):
                    continue
                c.p = save
            if _extra_item(&c, &item) < 0:
                return -1
            d = extra_fold(d, item)
        out[i] = d
        if d:
            some[0] = True
    return 0 if c.p == c.end else -1


def extra_key_digests(raw, lora_name, size_t nblocks):
    """The Python decoder's ``extra_keys`` (msgpack bytes of the value) of a BlockStored
    of ``nblocks`` block hashes and LoRA ``lora_name``: ``array('Q')`` of one digest per
    block, None when it carries none; ``ValueError`` for a shape that is not vLLM's
    (the twin: ``kvconductor._py.hash.event_extra_digests``)."""
    cdef const uint8_t[::1] view = raw
    cdef size_t size = view.shape[0]
    cdef bytes name = (lora_name or "").encode("utf-8")
    cdef const uint8_t* lp = <const uint8_t*>PyBytes_AS_STRING(name)
    cdef size_t ln = <size_t>PyBytes_GET_SIZE(name)
    cdef bint some = False
    cdef int rc
    if size == 0:
        return None
    out = _array.array("Q", bytes(8 * nblocks))
    cdef uint64_t[::1] ov = out
    cdef uint64_t dummy = 0
    with nogil:
        rc = _extra_digests(&view[0], size, lp, ln, nblocks, &ov[0] if nblocks else &dummy,
                            &some)
    if rc < 0:
        raise ValueError("extra_keys of a shape that is not vLLM's (docs/events.md)")
    return out if some else None
