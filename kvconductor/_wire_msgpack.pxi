# Included by _wire.pyx: the MessagePack scanner of the query parser and the msgpack
# request parser. The small readers (mp_int, mp_str, mp_bin, mp_container, mp_skip,
# mp_u32_array) are the cdef inline ones of kvconductor/_readers.pxd.


cdef inline uint32_t _le32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[3] << 24) | (<uint32_t>p[2] << 16) | (<uint32_t>p[1] << 8) | <uint32_t>p[0]


cdef int mp_u64_array(wcur* c, uint64_t* out, size_t n, size_t* count) noexcept nogil:
    cdef size_t i = 0
    cdef uint64_t v = 0
    cdef bint neg = False
    cdef int rc = WIRE_OK
    cdef const uint8_t* p
    while i < n:
        p = c.p
        rc = mp_int(c, &v, &neg)
        if rc:
            break
        if neg:
            c.p = p
            rc = WIRE_RANGE
            break
        out[i] = v
        i += 1
    count[0] = i
    return rc


# =========================================================================================
# MessagePack request parsing (with the GIL; the big scans release it)
# =========================================================================================

cdef str _mp_str_value(wcur* c, int fid, bint nullable):
    """str (or nil when nullable -> None) at c.p."""
    cdef const uint8_t* s = NULL
    cdef size_t n = 0
    cdef int rc
    if nullable and _left(c) and c.p[0] == 0xc0:
        c.p += 1
        return None
    rc = mp_str(c, &s, &n)
    if rc == WIRE_TYPE:
        raise WireError(f"invalid type for `{_field_name(fid)}`: expected "
                        + ("a string or nil" if nullable else "a string"))
    _check(rc, c, False, fid, -1)
    return _decode_utf8(s, n, fid)


cdef object _mp_block_size(wcur* c):
    cdef uint64_t v = 0
    cdef bint neg = False
    _check(mp_int(c, &v, &neg), c, False, FIELD_BLOCK_SIZE, -1)
    return _block_size(v, neg)


cdef array.array _mp_values(wcur* c, bint u64, int fid):
    cdef size_t n = 0, cnt = 0
    cdef const uint8_t* s = NULL
    cdef int rc
    cdef array.array arr
    cdef uint32_t* o
    cdef size_t i
    rc = mp_container(c, 0x90, 0xdc, &n)
    if rc == WIRE_OK:
        if n > _left(c):            # every element needs at least one byte
            c.p = c.end
            _check(WIRE_EOF, c, False, fid, -1)
        arr = _new_array(u64, n)
        if u64:
            if n > _NOGIL_BYTES // 4:
                with nogil:
                    rc = mp_u64_array(c, <uint64_t*>arr.data.as_ulonglongs, n, &cnt)
            else:
                rc = mp_u64_array(c, <uint64_t*>arr.data.as_ulonglongs, n, &cnt)
        else:
            if n > _NOGIL_BYTES // 4:
                with nogil:
                    rc = mp_u32_array(c, arr.data.as_uints, n, &cnt)
            else:
                rc = mp_u32_array(c, arr.data.as_uints, n, &cnt)
        _check(rc, c, False, fid, <Py_ssize_t>cnt)
        return arr
    if rc == WIRE_TYPE and not u64:
        rc = mp_bin(c, &s, &n)
        if rc == WIRE_OK:
            # packed tokens: little-endian u32
            if n % 4:
                raise WireError(f"packed `{_field_name(fid)}` length is not a multiple of 4")
            n //= 4
            arr = _new_array(False, n)
            o = arr.data.as_uints
            if _LITTLE:
                if n:
                    if n > _NOGIL_BYTES // 4:
                        with nogil:
                            memcpy(o, s, n * 4)
                    else:
                        memcpy(o, s, n * 4)
            else:
                for i in range(n):
                    o[i] = _le32(s + 4 * i)
            return arr
    if rc == WIRE_TYPE:
        if u64:
            raise WireError(f"invalid type for `{_field_name(fid)}`: expected an array of integers")
        raise WireError(
            f"invalid type for `{_field_name(fid)}`: expected an array of integers or bin")
    _check(rc, c, False, fid, -1)


cdef object _mp_top_k(wcur* c):
    """``top_k``: an int in [1, 2**32) or nil (None)."""
    cdef uint64_t v = 0
    cdef bint neg = False
    cdef int rc
    if _left(c) and c.p[0] == 0xc0:
        c.p += 1
        return None
    rc = mp_int(c, &v, &neg)
    if rc == WIRE_TYPE:
        raise WireError("invalid type for `top_k`: expected an integer or nil")
    _check(rc, c, False, FIELD_TOP_K, -1)
    return _top_k(v, neg)


cdef list _mp_instances(wcur* c):
    """``instances``: an array of str, or nil (None)."""
    cdef size_t n = 0, i
    cdef int rc
    cdef list out = []
    if _left(c) and c.p[0] == 0xc0:
        c.p += 1
        return None
    rc = mp_container(c, 0x90, 0xdc, &n)
    if rc == WIRE_TYPE:
        raise WireError("invalid type for `instances`: expected an array of strings or nil")
    _check(rc, c, False, FIELD_INSTANCES, -1)
    if n > _left(c):
        c.p = c.end
        _check(WIRE_EOF, c, False, FIELD_INSTANCES, -1)
    for i in range(n):
        if _left(c) and not (0xa0 <= c.p[0] <= 0xbf or 0xd9 <= c.p[0] <= 0xdb):
            raise WireError("invalid type for `instances`: expected an array of strings or nil")
        out.append(_mp_str_value(c, FIELD_INSTANCES, False))
    return out


cdef bint _mp_freshness(wcur* c) except -1:
    """``freshness``: a bool, or nil (False)."""
    cdef uint8_t b
    if not _left(c):
        _check(WIRE_EOF, c, False, FIELD_FRESHNESS, -1)
    b = c.p[0]
    if b == 0xc3 or b == 0xc2 or b == 0xc0:
        c.p += 1
        return b == 0xc3
    raise WireError("invalid type for `freshness`: expected a boolean or nil")


cdef int _mp_skip_checked(wcur* c) except -1:
    cdef int rc
    if _left(c) > _NOGIL_BYTES:
        with nogil:
            rc = mp_skip(c, 0, True)
    else:
        rc = mp_skip(c, 0, True)
    return _check(rc, c, False, FIELD_UNKNOWN, -1)


cdef tuple _parse_msgpack(const uint8_t* buf, size_t size, bint by_hash, bint ext):
    cdef wcur c
    cdef const uint8_t* s = NULL
    cdef size_t n = 0, i, klen = 0
    cdef int fid, rc
    cdef int vfid = FIELD_BLOCK_HASHES if by_hash else FIELD_TOKEN_IDS
    cdef bint have_bs = False
    model = None
    tenant = None
    lora = None
    block_size = 0
    values = None
    top_k = None
    instances = None
    cdef bint fresh = False, xs = False, xm = False
    c.base = buf
    c.p = buf
    c.end = buf + size
    if size == 0:
        raise WireError("empty body")
    rc = mp_container(&c, 0x80, 0xde, &n)
    if rc == WIRE_OK:
        if n > _left(&c):
            c.p = c.end
            _check(WIRE_EOF, &c, False, FIELD_UNKNOWN, -1)
        for i in range(n):
            rc = mp_str(&c, &s, &klen)
            if rc == WIRE_TYPE:
                raise WireError("map keys must be strings")
            _check(rc, &c, False, FIELD_UNKNOWN, -1)
            fid = _field_id(s, klen)
            if fid == FIELD_MODEL:
                model = _mp_str_value(&c, fid, False)
            elif fid == FIELD_TENANT:
                tenant = _mp_str_value(&c, fid, True)
            elif fid == FIELD_LORA:
                lora = _mp_str_value(&c, fid, True)
            elif fid == FIELD_BLOCK_SIZE:
                block_size = _mp_block_size(&c)
                have_bs = True
            elif fid == vfid:
                values = _mp_values(&c, by_hash, fid)
            elif fid == FIELD_TOP_K and ext:
                top_k = _mp_top_k(&c)
            elif fid == FIELD_INSTANCES and ext:
                instances = _mp_instances(&c)
            elif fid == FIELD_FRESHNESS and ext:
                fresh = _mp_freshness(&c)
            elif fid == FIELD_CACHE_SALT and ext:
                xs = c.p < c.end and c.p[0] != 0xc0
                _mp_skip_checked(&c)
            elif fid == FIELD_MM_INPUTS and ext:
                xm = c.p < c.end and c.p[0] != 0xc0
                _mp_skip_checked(&c)
            else:
                _mp_skip_checked(&c)
    elif rc == WIRE_TYPE:
        rc = mp_container(&c, 0x90, 0xdc, &n)
        if rc == WIRE_TYPE:
            raise WireError("expected a map or an array")
        _check(rc, &c, False, FIELD_UNKNOWN, -1)
        if n > _left(&c):
            c.p = c.end
            _check(WIRE_EOF, &c, False, FIELD_UNKNOWN, -1)
        # positional form [model, block_size, values, tenant_id, lora_name, top_k, instances,
        # freshness, cache_salt, mm_inputs, <ignored>...] (the last five only with ``ext``;
        # skipped without)
        if n < 1:
            raise WireError("missing field `model`")
        model = _mp_str_value(&c, FIELD_MODEL, False)
        if n < 2:
            raise WireError("missing field `block_size`")
        block_size = _mp_block_size(&c)
        have_bs = True
        if n < 3:
            raise WireError(f"missing field `{_field_name(vfid)}`")
        values = _mp_values(&c, by_hash, vfid)
        if n >= 4:
            tenant = _mp_str_value(&c, FIELD_TENANT, True)
        if n >= 5:
            lora = _mp_str_value(&c, FIELD_LORA, True)
        i = 5
        if ext and n >= 6:
            top_k = _mp_top_k(&c)
            i = 6
            if n >= 7:
                instances = _mp_instances(&c)
                i = 7
                if n >= 8:
                    fresh = _mp_freshness(&c)
                    i = 8
                    if n >= 9:
                        xs = c.p < c.end and c.p[0] != 0xc0
                        _mp_skip_checked(&c)
                        i = 9
                    if n >= 10:
                        xm = c.p < c.end and c.p[0] != 0xc0
                        _mp_skip_checked(&c)
                        i = 10
        while i < n:
            _mp_skip_checked(&c)
            i += 1
    else:
        _check(rc, &c, False, FIELD_UNKNOWN, -1)
    if c.p != c.end:
        raise WireError("trailing data")
    return _finish(model, block_size, have_bs, tenant, values, by_hash, lora, ext, top_k,
                   instances, fresh, xs or xm)
