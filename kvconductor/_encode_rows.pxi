# Included by _encode.pyx: answers straight from the core's arrays -- GroupNames (each
# (instance, DP) group's names pre-encoded once), the exact sizes and raw writers, the
# freshness members, and encode_rows, which sizes the answer of a MatchRows and then
# writes it without realloc and without the GIL.
# The module keeps the growing-buffer writers these share with encode_result and
# encode_error, and encode_answer, which picks one of the two.


cdef extern from "kvconductor/c/encode.h":
    unsigned kvc_log2_u64(unsigned long long x) noexcept nogil


#: The template of ``GroupNames.instances_rank``'s array.
cdef array.array _RANK_TMPL = _array.array("I")


cdef class GroupNames:
    """The names of an index's (instance, DP) groups, pre-encoded once when a group is
    named, so an answer copies bytes per row instead of encoding strings.

    ``add(instance_id, dp_rank)`` names the next group id (writer thread; the GIL orders it
    with readers); ``keys[g]`` is ``(instance_id, dp_rank)`` and ``dp_keys[g]``
    ``str(dp_rank)``, made once: ``MatchRows.scores``/``tuples``/``hits``/``v3`` put
    these very objects in every answer naming the group. :func:`encode_rows` reads
    entries without the GIL: they never move (fixed chunks, never reallocated)."""

    def __cinit__(self):
        cdef int c
        for c in range(GN_NCHUNKS):
            self.chunks[c] = NULL
        self.count = 0
        self.ninst = 0
        self.nbytes_ = 0
        self.keys = []
        self.dp_keys = []
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
        cdef str ds = str(_index(dp_rank))
        dk = ds.encode()
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
        self.dp_keys.append(ds)
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

    def instances_rank(self, instance_ids):
        """One u32 per group id (an ``array('I')``): 1 + the position of its instance's
        first mention in ``instance_ids``, 0 for the groups of instances not named (unknown
        names are ignored), the ``ranks`` argument of ``MatchRows.select``: the order of
        ``instances`` is the preference among rows tied at the ``top_k`` cut."""
        cdef array.array want = array.clone(_RANK_TMPL, <Py_ssize_t>self.ninst, True)
        cdef array.array out = array.clone(_RANK_TMPL, <Py_ssize_t>self.count, True)
        cdef uint32_t* w = want.data.as_uints
        cdef uint32_t* o = out.data.as_uints
        cdef size_t g
        cdef uint32_t pos = 0
        cdef bint any_ = False
        for name in instance_ids:
            pos += 1
            i = self._inst.get(name)
            if i is not None and w[<size_t>i] == 0:
                w[<size_t>i] = pos
                any_ = True
        if any_:
            for g in range(self.count):
                o[g] = w[self.entry(g).inst]
        return out


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
            o = _p_mpu(o, f.age_ms)
        if f.has_since:
            o = _p_raw(o, b"\xafdegraded_for_ms", 16)
            o = _p_mpu(o, f.since_ms)
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
        matched[i] = <uint32_t>kvc_sat_u32_mul(tot, bs)
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


cdef enum:
    # Answers of up to this many rows are planned and written with the GIL held.
    ENCODE_GIL_ROWS = 2048


cdef size_t _plan_all(const uint32_t* rv, size_t n, gname_t** ents, uint64_t bs, size_t tlen,
                      bint msgpack, uint32_t* matched, size_t* nxt, rinst_t* iv,
                      uint32_t* slots, size_t smask, size_t* ni, const fresh_t* fr,
                      size_t taillen, GroupNames names) noexcept nogil:
    """``encode_rows``' first pass: the slots cleared, each row's name entry, the plan."""
    cdef size_t i
    memset(slots, 0xFF, smask * sizeof(uint32_t))
    for i in range(n):
        ents[i] = names.entry(rv[4 * i])
    return _plan_rows(rv, n, ents, bs, tlen, msgpack, matched, nxt, iv, slots, smask - 1, ni,
                      fr, taillen)


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
        # PERF: a short answer is encoded with the GIL held (a release hands it to a
        # busy ingest thread and waits for it back: see _recv.pyx)
        if n > ENCODE_GIL_ROWS:
            with nogil:
                size = _plan_all(rv, n, ents, bs, tlen, msgpack, matched, nxt, iv, slots,
                                 smask, &ni, fr, taillen, names)
        else:
            size = _plan_all(rv, n, ents, bs, tlen, msgpack, matched, nxt, iv, slots,
                             smask, &ni, fr, taillen, names)
        out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
        o = PyBytes_AS_STRING(out)
        if n > ENCODE_GIL_ROWS:
            with nogil:
                end = _write_rows(o, rv, ents, t.data, tlen, msgpack, matched, nxt, iv, ni,
                                  fr, tail, taillen)
        else:
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
