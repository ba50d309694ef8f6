# cython: language_level=3
"""The query parser (docs/api.md, POST /query and POST /query_by_hash).

``parse_query`` turns a ``/query`` or ``/query_by_hash`` body (JSON or
MessagePack) into ``(model, block_size, tenant_id, values, lora_name)``; token ids and
hashes never become Python ints: they are scanned without the GIL straight into
the C buffer of the output ``array('I')`` / ``array('Q')``, pre-sized from the
msgpack array header or from a count of the commas of the JSON array.
``read_u32_array`` reads one msgpack int array the same way (vLLM ``token_ids``).

Layout: the request field table, error messages and entry points are here; the
JSON scanner and request parser are in ``_wire_json.pxi``, the MessagePack ones in
``_wire_msgpack.pxi`` (both included below); the low-level msgpack readers shared
with ``_ingest`` are the ``cdef inline`` functions of ``_readers.pxd``. Response
encoding is the separate module ``kvconductor._encode``.

``kvconductor.wire.py_parse_query`` is the pure-Python (msgspec) oracle of
``parse_query``; both must agree exactly (tests/test_wire.py).
"""
from cpython cimport array
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memchr, memcpy, strlen

from kvconductor._readers cimport (WIRE_BAD_BYTE, WIRE_CAPACITY, WIRE_DEPTH, WIRE_EOF,
                                   WIRE_JSON_MAX_DEPTH, WIRE_OK, WIRE_RANGE, WIRE_SYNTAX,
                                   WIRE_TYPE, _eq, _left, mp_bin, mp_container, mp_int, mp_skip,
                                   mp_str, mp_u32_array, wcur)

import array as _array
import sys as _sys


class WireError(ValueError):
    """A malformed /query or /query_by_hash body; ``str(err)`` is a short detail."""


cdef bint _LITTLE = _sys.byteorder == "little"
cdef array.array _TMPL_U32 = _array.array("I")
cdef array.array _TMPL_U64 = _array.array("Q")
if _TMPL_U32.itemsize != 4 or _TMPL_U64.itemsize != 8:
    raise ImportError("array('I') must have 4-byte items and array('Q') 8-byte items")

cdef uint64_t _U32_MAX = 0xFFFFFFFF
cdef uint64_t _I64_MAX = 0x7FFFFFFFFFFFFFFF
# Inputs longer than this are scanned with the GIL released.
cdef size_t _NOGIL_BYTES = 1 << 15

# Field ids of the request: FIELD_* in _wire.pxd.


# =========================================================================================
# Request parsing (with the GIL; the big scans release it)
# =========================================================================================

# The request's field names by field id (FIELD_* in _wire.pxd), and their lengths.
cdef const char* _FIELD_NAMES[FIELD_MM_INPUTS + 1]
_FIELD_NAMES[:] = [b"", b"model", b"block_size", b"token_ids", b"block_hashes", b"tenant_id",
                   b"lora_name", b"top_k", b"instances", b"freshness", b"cache_salt",
                   b"mm_inputs"]
cdef size_t _FIELD_LENS[FIELD_MM_INPUTS + 1]
for _fid in range(FIELD_MM_INPUTS + 1):
    _FIELD_LENS[_fid] = strlen(_FIELD_NAMES[_fid])
del _fid


cdef int _field_id(const uint8_t* s, size_t n) noexcept nogil:
    cdef int fid
    for fid in range(FIELD_MODEL, FIELD_MM_INPUTS + 1):
        if _eq(s, n, _FIELD_NAMES[fid], _FIELD_LENS[fid]):
            return fid
    return FIELD_UNKNOWN


cdef str _field_name(int fid):
    if FIELD_MODEL <= fid <= FIELD_MM_INPUTS:
        return _FIELD_NAMES[fid].decode("ascii")
    return ""


def _field_table():
    """``(id, name, id of name)`` for every request field id: ``_field_name`` and
    ``_field_id`` of the C table, tied to ``kvconductor.schema`` by the tests."""
    cdef int fid
    cdef bytes key
    out = []
    for fid in range(FIELD_MODEL, FIELD_MM_INPUTS + 1):
        name = _field_name(fid)
        key = name.encode()
        out.append((fid, name, _field_id(<const uint8_t*>PyBytes_AS_STRING(key),
                                         <size_t>PyBytes_GET_SIZE(key))))
    return tuple(out)


cdef object _fail(int rc, const wcur* c, bint is_json, int fid, Py_ssize_t index):
    """Raise the WireError of scanner code ``rc`` (field ``fid``, element ``index`` or -1)."""
    cdef Py_ssize_t pos = c.p - c.base
    cdef str name = _field_name(fid) if fid != FIELD_UNKNOWN else ""
    if rc == WIRE_EOF:
        msg = "unexpected end of JSON input" if is_json else "truncated msgpack"
    elif rc == WIRE_SYNTAX:
        msg = f"invalid JSON at byte {pos}"
    elif rc == WIRE_DEPTH:
        msg = "nesting too deep"
    elif rc == WIRE_BAD_BYTE:
        msg = f"invalid msgpack byte 0xc1 at offset {pos}"
    elif fid == FIELD_BLOCK_SIZE:
        if rc == WIRE_RANGE:
            msg = "block_size out of range"
        else:
            msg = "expected an integer for `block_size`"
    elif fid == FIELD_TOP_K:
        msg = TOP_K_RANGE if rc == WIRE_RANGE else "expected an integer for `top_k`"
    elif rc == WIRE_RANGE:
        msg = f"integer out of range in `{name}` at index {index}"
    elif rc == WIRE_TYPE:
        msg = f"expected an integer in `{name}` at index {index}"
    else:
        msg = f"invalid `{name}` array"
    raise WireError(msg)


cdef inline int _check(int rc, const wcur* c, bint is_json, int fid, Py_ssize_t index) except -1:
    if rc:
        _fail(rc, c, is_json, fid, index)
    return 0


cdef str _decode_utf8(const uint8_t* s, size_t n, int fid):
    try:
        return PyUnicode_DecodeUTF8(<const char*>s, <Py_ssize_t>n, NULL)
    except UnicodeDecodeError:
        raise WireError(f"invalid UTF-8 in `{_field_name(fid)}`") from None


cdef object _block_size(uint64_t v, bint neg):
    if neg or v > _U32_MAX:
        raise WireError("block_size out of range")
    return <unsigned long>v


#: The one message of a ``top_k`` that is not in [1, 2**32) (also the oracle's).
TOP_K_RANGE = "top_k must be between 1 and 4294967295"


cdef object _top_k(uint64_t v, bint neg):
    if neg or v == 0 or v > _U32_MAX:
        raise WireError(TOP_K_RANGE)
    return <unsigned long>v


cdef inline array.array _new_array(bint u64, size_t n):
    return array.clone(_TMPL_U64 if u64 else _TMPL_U32, <Py_ssize_t>n, False)


cdef tuple _finish(model, block_size, bint have_bs, tenant, values, bint by_hash, lora, bint ext,
                   top_k, instances, bint fresh, bint extra):
    if model is None:
        raise WireError("missing field `model`")
    if not have_bs and not by_hash:
        raise WireError("missing field `block_size`")
    if values is None:
        raise WireError("missing field `block_hashes`" if by_hash else "missing field `token_ids`")
    if ext:
        return (model, block_size, "default" if tenant is None else tenant, values, lora or None,
                top_k, instances, fresh, extra)
    return (model, block_size, "default" if tenant is None else tenant, values, lora or None)


include "_wire_json.pxi"
include "_wire_msgpack.pxi"


def parse_query(body, bint msgpack, bint by_hash, bint ext=False):
    """Parse a /query (``by_hash=False``) or /query_by_hash body.

    Returns ``(model, block_size, tenant_id, values, lora_name)``: ``values``
    is an ``array('I')`` of token ids truncated to 32 bits, or an
    ``array('Q')`` of block hashes; ``lora_name`` is ``None`` when absent,
    null or empty. ``block_size`` defaults to 0 for /query_by_hash. Raises
    :class:`WireError` on any malformed body.

    With ``ext`` the extension fields are read too and four more items follow:
    ``top_k`` (int in [1, 2**32) or ``None``), ``instances`` (list of str or
    ``None``), ``freshness`` (bool; null and absent are False) and whether
    ``cache_salt`` or ``mm_inputs`` is there and not null (their values are skipped
    here: ``kvconductor.extrakeys`` reads them, only then); without it they are
    skipped like any unknown field.
    """
    cdef const uint8_t[::1] view
    if msgpack and not PyBytes_Check(body):
        # PERF: msgpack scanners need no sentinel: read a bytearray/memoryview in place.
        view = body
        if view.shape[0] == 0:
            return _parse_msgpack(<const uint8_t*>b"", 0, by_hash, ext)
        return _parse_msgpack(&view[0], <size_t>view.shape[0], by_hash, ext)
    if not PyBytes_Check(body):
        body = bytes(body)          # JSON scanners need the NUL sentinel of bytes
    cdef const uint8_t* buf = <const uint8_t*>PyBytes_AS_STRING(body)
    cdef size_t size = <size_t>PyBytes_GET_SIZE(body)
    if msgpack:
        return _parse_msgpack(buf, size, by_hash, ext)
    return _parse_json(buf, size, by_hash, ext)


def read_u32_array(buf):
    """One msgpack array of ints (a vLLM ``token_ids`` value) as ``array('I')``.

    Same rules as the ``token_ids`` array of :func:`parse_query`: i64 values keep
    their low 32 bits, ints of 2**63 or more are rejected. Raises
    :class:`WireError` for anything else: not an array (a bin included), an
    element that is not an int, truncated input or bytes after the array.
    """
    cdef const uint8_t[::1] view = buf
    cdef size_t size = <size_t>view.shape[0]
    cdef wcur c
    cdef uint8_t b
    if size == 0:
        raise WireError("truncated msgpack")
    b = view[0]
    if not (0x90 <= b <= 0x9f or b == 0xdc or b == 0xdd):
        raise WireError("expected a msgpack array of integers")
    c.base = &view[0]
    c.p = c.base
    c.end = c.base + size
    values = _mp_values(&c, False, FIELD_TOKEN_IDS)
    if c.p != c.end:
        raise WireError("trailing data")
    return values
