"""kvconductor._wire (/query parser) and kvconductor._encode (response encoder) vs msgspec.

The reference for ``parse_query`` is the straightforward msgspec decoding of the
body into a Struct (what the pure-Python twin in ``kvconductor.wire`` does),
followed by the range checks and the u32 truncation of token ids. The
reference for ``encode_result`` is ``msgspec.{json,msgpack}.encode`` of
``QueryResult(hits).to_dict(tenant, block_size)``: the bytes must be identical.
"""

from __future__ import annotations

import json
import re
import struct
from array import array

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor import _encode, _wire
from kvconductor.index import DpHit, QueryResult
from tests.helpers.examples import scaled

WireError = _wire.WireError
parse_query = _wire.parse_query
encode_result = _encode.encode_result
encode_error = _encode.encode_error

U32 = 2**32 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U64 = 2**64 - 1
KNOWN = {"model", "block_size", "token_ids", "block_hashes", "tenant_id", "lora_name"}


# ---------------------------------------------------------------------------------------
# the msgspec reference
# ---------------------------------------------------------------------------------------


class _JsonQuery(msgspec.Struct):
    model: str
    block_size: int
    token_ids: list[int]
    tenant_id: str | None = None
    lora_name: str | None = None


class _JsonHashQuery(msgspec.Struct):
    model: str
    block_hashes: list[int]
    block_size: int = 0
    tenant_id: str | None = None
    lora_name: str | None = None


class _MpQuery(msgspec.Struct):
    model: str
    block_size: int
    token_ids: list[int] | bytes
    tenant_id: str | None = None
    lora_name: str | None = None


class _MpQueryArray(msgspec.Struct, array_like=True):
    model: str
    block_size: int
    token_ids: list[int] | bytes
    tenant_id: str | None = None
    lora_name: str | None = None


class _MpHashQuery(msgspec.Struct):
    model: str
    block_hashes: list[int]
    block_size: int = 0
    tenant_id: str | None = None
    lora_name: str | None = None


class _MpHashQueryArray(msgspec.Struct, array_like=True):
    model: str
    block_size: int
    block_hashes: list[int]
    tenant_id: str | None = None
    lora_name: str | None = None


class RefError(Exception):
    pass


def reference(body: bytes, msgpack: bool, by_hash: bool):
    """(model, block_size, tenant, typecode, values, lora_name) or RefError."""
    try:
        if msgpack:
            positional = bool(body) and (0x90 <= body[0] <= 0x9F or body[0] in (0xDC, 0xDD))
            if by_hash:
                cls = _MpHashQueryArray if positional else _MpHashQuery
            else:
                cls = _MpQueryArray if positional else _MpQuery
            q = msgspec.msgpack.decode(body, type=cls)
        else:
            q = msgspec.json.decode(body, type=_JsonHashQuery if by_hash else _JsonQuery)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as ex:
        raise RefError(str(ex)) from None
    if not 0 <= q.block_size <= U32:
        raise RefError("block_size out of range")
    if by_hash:
        if any(not 0 <= h <= U64 for h in q.block_hashes):
            raise RefError("hash out of range")
        values = ("Q", list(q.block_hashes))
    elif isinstance(q.token_ids, bytes):
        if len(q.token_ids) % 4:
            raise RefError("packed length")
        values = ("I", list(struct.unpack(f"<{len(q.token_ids) // 4}I", q.token_ids)))
    else:
        if any(not I64_MIN <= t <= I64_MAX for t in q.token_ids):
            raise RefError("token out of range")
        values = ("I", [t & 0xFFFFFFFF for t in q.token_ids])
    tenant = "default" if q.tenant_id is None else q.tenant_id
    return (q.model, q.block_size, tenant) + values + (q.lora_name or None,)


def ours(body, msgpack, by_hash):
    model, bs, tenant, values, lora = parse_query(body, msgpack, by_hash)
    assert lora is None or (type(lora) is str and lora)
    assert type(model) is str and type(tenant) is str and type(bs) is int
    assert isinstance(values, array)
    return (model, bs, tenant, values.typecode, list(values), lora)


def agree(body, msgpack, by_hash):
    """Both accept with equal results, or both reject (ours with WireError)."""
    try:
        expected = reference(body, msgpack, by_hash)
    except RefError:
        expected = None
    try:
        got = ours(body, msgpack, by_hash)
    except WireError:
        got = None
    assert got == expected, (body[:200], expected and expected[:3], got and got[:3])
    return got


# ---------------------------------------------------------------------------------------
# body writers: JSON with random whitespace, msgpack with random (valid) encodings
# ---------------------------------------------------------------------------------------

_WS = [b"", b"", b" ", b"\n", b"\t", b"\r\n  "]


def jdump(obj, rnd) -> bytes:
    """JSON with random whitespace between tokens and random \\u-escaping of strings."""
    ws = lambda: rnd.choice(_WS)
    if isinstance(obj, dict):
        if not obj:
            return b"{" + ws() + b"}"
        parts = [
            ws() + jdump(k, rnd) + ws() + b":" + ws() + jdump(v, rnd) + ws() for k, v in obj.items()
        ]
        return b"{" + b",".join(parts) + b"}"
    if isinstance(obj, list):
        if not obj:
            return b"[" + ws() + b"]"
        return b"[" + b",".join(ws() + jdump(v, rnd) + ws() for v in obj) + b"]"
    if isinstance(obj, str):
        return json.dumps(obj, ensure_ascii=rnd.random() < 0.5).encode()
    return json.dumps(obj).encode()


def _mp_int(v: int, rnd) -> bytes:
    choices = []
    if 0 <= v <= 127:
        choices.append(bytes([v]))
    if -32 <= v < 0:
        choices.append(struct.pack("b", v))
    for code, fmt, lo, hi in (
        (0xCC, ">B", 0, 2**8 - 1),
        (0xCD, ">H", 0, 2**16 - 1),
        (0xCE, ">I", 0, 2**32 - 1),
        (0xCF, ">Q", 0, 2**64 - 1),
        (0xD0, ">b", -(2**7), 2**7 - 1),
        (0xD1, ">h", -(2**15), 2**15 - 1),
        (0xD2, ">i", -(2**31), 2**31 - 1),
        (0xD3, ">q", -(2**63), 2**63 - 1),
    ):
        if lo <= v <= hi:
            choices.append(bytes([code]) + struct.pack(fmt, v))
    return rnd.choice(choices)


def _mp_len(n: int, fix: int | None, fixmax: int, codes: tuple[int, int, int], rnd) -> bytes:
    choices = []
    if fix is not None and n <= fixmax:
        choices.append(bytes([fix | n]))
    c8, c16, c32 = codes
    if c8 is not None and n < 2**8:
        choices.append(bytes([c8, n]))
    if n < 2**16:
        choices.append(bytes([c16]) + struct.pack(">H", n))
    choices.append(bytes([c32]) + struct.pack(">I", n))
    return rnd.choice(choices)


def mpack(obj, rnd) -> bytes:
    """MessagePack of ``obj`` choosing a random valid encoding for every value."""
    if obj is None:
        return b"\xc0"
    if obj is True:
        return b"\xc3"
    if obj is False:
        return b"\xc2"
    if isinstance(obj, int):
        return _mp_int(obj, rnd)
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        b = obj.encode()
        return _mp_len(len(b), 0xA0, 31, (0xD9, 0xDA, 0xDB), rnd) + b
    if isinstance(obj, bytes):
        return _mp_len(len(obj), None, 0, (0xC4, 0xC5, 0xC6), rnd) + obj
    if isinstance(obj, list):
        return _mp_len(len(obj), 0x90, 15, (None, 0xDC, 0xDD), rnd) + b"".join(
            mpack(v, rnd) for v in obj
        )
    if isinstance(obj, dict):
        return _mp_len(len(obj), 0x80, 15, (None, 0xDE, 0xDF), rnd) + b"".join(
            mpack(k, rnd) + mpack(v, rnd) for k, v in obj.items()
        )
    raise TypeError(type(obj))


# ---------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------

tokens_st = st.lists(
    st.one_of(
        st.integers(I64_MIN, I64_MAX),
        st.integers(-40, 300),
        st.integers(0, 2**17),
        st.integers(-(2**31), 2**32),
        st.sampled_from([I64_MIN, I64_MAX, -1, 0, U32]),
    ),
    max_size=48,
)
hashes_st = st.lists(
    st.one_of(st.integers(0, U64), st.integers(0, 300), st.sampled_from([0, U64, 2**63, 2**32])),
    max_size=48,
)
text_st = st.text(max_size=12)
wide_text_st = st.one_of(text_st, st.text(min_size=30, max_size=300))
scalar_st = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(I64_MIN, U64),
    st.floats(allow_nan=False, allow_infinity=False),
    text_st,
)
json_value_st = st.recursive(
    scalar_st,
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(text_st, ch, max_size=4),
    max_leaves=10,
)
mp_value_st = st.recursive(
    st.one_of(scalar_st, st.binary(max_size=20)),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(text_st, ch, max_size=4),
    max_leaves=10,
)
extra_key_st = text_st.filter(lambda k: k not in KNOWN)


@st.composite
def request_fields(draw, by_hash: bool, value_st):
    """(ordered items of a request dict, model, block_size, values, tenant or None,
    lora_name or None)."""
    model = draw(wide_text_st)
    items = [("model", model)]
    bs = draw(st.one_of(st.integers(0, U32), st.sampled_from([1, 16, 128, U32])))
    if by_hash and draw(st.booleans()):
        bs = None
    else:
        items.append(("block_size", bs))
    values = draw(hashes_st if by_hash else tokens_st)
    items.append(("block_hashes" if by_hash else "token_ids", values))
    tenant_kind = draw(st.sampled_from(["absent", "null", "str"]))
    tenant = None
    if tenant_kind == "null":
        items.append(("tenant_id", None))
    elif tenant_kind == "str":
        tenant = draw(wide_text_st)
        items.append(("tenant_id", tenant))
    lora_kind = draw(st.sampled_from(["absent", "null", "empty", "str"]))
    lora = None
    if lora_kind == "null":
        items.append(("lora_name", None))
    elif lora_kind == "empty":
        items.append(("lora_name", ""))
    elif lora_kind == "str":
        lora = draw(wide_text_st.filter(bool))
        items.append(("lora_name", lora))
    extras = draw(st.dictionaries(extra_key_st, value_st, max_size=3))
    items += list(extras.items())
    items = draw(st.permutations(items))
    return items, model, bs, values, tenant, lora


def expected_of(model, bs, values, tenant, by_hash, lora=None):
    vals = list(values) if by_hash else [t & 0xFFFFFFFF for t in values]
    return (
        model,
        bs or 0,
        "default" if tenant is None else tenant,
        "Q" if by_hash else "I",
        vals,
        lora,
    )


# ---------------------------------------------------------------------------------------
# parse_query: valid bodies
# ---------------------------------------------------------------------------------------


def test_contract_example():
    body = b'{"model":"qwen","block_size":128,"token_ids":[1,2,3,4],"tenant_id":"default"}'
    model, bs, tenant, values, lora = parse_query(body, False, False)
    assert lora is None
    assert (model, bs, tenant) == ("qwen", 128, "default")
    assert values.typecode == "I" and list(values) == [1, 2, 3, 4]


@pytest.mark.parametrize("by_hash", [False, True])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_json_matches_msgspec(by_hash, data):
    items, model, bs, values, tenant, lora = data.draw(request_fields(by_hash, json_value_st))
    d = dict(items)
    style = data.draw(st.sampled_from(["msgspec", "dumps", "ascii", "indent", "ws"]))
    if style == "msgspec":
        body = msgspec.json.encode(d)
    elif style == "dumps":
        body = json.dumps(d, ensure_ascii=False).encode()
    elif style == "ascii":
        body = json.dumps(d).encode()
    elif style == "indent":
        body = json.dumps(d, indent=2).encode() + b"\n"
    else:
        body = jdump(d, data.draw(st.randoms(use_true_random=False)))
    got = agree(body, False, by_hash)
    assert got == expected_of(model, bs, values, tenant, by_hash, lora)


@pytest.mark.parametrize("by_hash", [False, True])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_msgpack_matches_msgspec(by_hash, data):
    items, model, bs, values, tenant, lora = data.draw(request_fields(by_hash, mp_value_st))
    rnd = data.draw(st.randoms(use_true_random=False))
    form = data.draw(st.sampled_from(["map", "msgspec", "array"] + ([] if by_hash else ["packed"])))
    if form == "packed":
        items = [
            (k, struct.pack(f"<{len(v)}I", *[t & 0xFFFFFFFF for t in v]))
            if k == "token_ids"
            else (k, v)
            for k, v in items
        ]
    if form in ("map", "packed"):
        body = mpack(dict(items), rnd)
    elif form == "msgspec":
        body = msgspec.msgpack.encode(dict(items))
    else:
        if bs is None:
            bs = data.draw(st.integers(0, U32))
        arr = [model, bs, values]
        if tenant is not None or lora is not None or data.draw(st.booleans()):
            arr.append(tenant)
            if lora is not None or data.draw(st.booleans()):
                arr.append(lora)  # [model, block_size, values, tenant_id, lora_name, ...]
                arr += data.draw(st.lists(mp_value_st, max_size=2))  # ignored trailing items
        body = mpack(arr, rnd)
    got = agree(body, True, by_hash)
    assert got == expected_of(model, bs, values, tenant, by_hash, lora)


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_every_int_encoding_of_tokens(fmt):
    values = [
        0,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        U32,
        U32 + 1,
        I64_MAX,
        -1,
        -32,
        -33,
        -128,
        -129,
        -32768,
        -32769,
        -(2**31),
        -(2**31) - 1,
        I64_MIN,
    ]
    if fmt == "json":
        bodies = [json.dumps({"model": "m", "block_size": 4, "token_ids": values}).encode()]
    else:
        bodies = []
        for i in range(8):
            import random

            bodies.append(
                mpack({"model": "m", "block_size": 4, "token_ids": values}, random.Random(i))
            )
    for body in bodies:
        model, bs, tenant, got, _ = parse_query(body, fmt == "msgpack", False)
        assert list(got) == [v & 0xFFFFFFFF for v in values]


@pytest.mark.parametrize("sep", [",", ", ", " ,\n\t", "\r\n,"])
def test_json_every_digit_count(sep):
    """1..19-digit ids (the 8-byte fast path and the general path), at every distance
    from the end of the body."""
    vals = [0]
    for d in range(1, 19):
        vals += [10 ** (d - 1), 10**d - 1, -(10 ** (d - 1)), -(10**d - 1), 10 ** (d - 1) + 7]
    vals += [10**18, -(10**18), I64_MAX, I64_MIN, 2**32, 2**32 - 1, -(2**32)]
    want = [v & 0xFFFFFFFF for v in vals]
    for lst in (vals, vals[::-1]):
        body = (
            '{"model":"m","block_size":1,"token_ids":[' + sep.join(map(str, lst)) + "]}"
        ).encode()
        assert list(parse_query(body, False, False)[3]) == [v & 0xFFFFFFFF for v in lst]
    for v, w in zip(vals, want, strict=True):
        for tail in ("]}", " ]}", "]}" + " " * 12, "]" + " " * 12 + "}"):
            body = f'{{"model":"m","block_size":1,"token_ids":[{v}{tail}'.encode()
            assert list(parse_query(body, False, False)[3]) == [w]


@pytest.mark.parametrize(
    "num",
    [
        "00",
        "01",
        "0123456",
        "-00",
        "-012",
        "1.5",
        "1234567.0",
        "12345678.5",
        "1e5",
        "1234567E2",
        "12e",
        "-",
        "--1",
        "1-",
        "0x10",
        "1_000",
        "١",
    ],
)
@pytest.mark.parametrize("pad", ["", ",1,2,3,4,5,6,7,8"])
def test_json_bad_numbers(num, pad):
    body = f'{{"model":"m","block_size":1,"token_ids":[{num}{pad}]}}'.encode()
    with pytest.raises(WireError):
        parse_query(body, False, False)
    agree(body, False, False)


def test_packed_tokens_are_little_endian_u32():
    toks = [0, 1, 0xDEADBEEF, U32, 70000]
    body = msgspec.msgpack.encode(
        {"model": "m", "block_size": 2, "token_ids": struct.pack("<5I", *toks)}
    )
    assert list(parse_query(body, True, False)[3]) == toks
    body = msgspec.msgpack.encode(["m", 2, b"", "t"])
    assert parse_query(body, True, False) == ("m", 2, "t", array("I"), None)


def test_hash_extremes_and_defaults():
    body = b'{"model":"m","block_hashes":[18446744073709551615,0,-0,9223372036854775808]}'
    assert parse_query(body, False, True) == (
        "m",
        0,
        "default",
        array("Q", [U64, 0, 0, 2**63]),
        None,
    )
    body = msgspec.msgpack.encode({"model": "m", "block_hashes": [U64, 5], "block_size": 9})
    assert parse_query(body, True, True) == ("m", 9, "default", array("Q", [U64, 5]), None)


def test_json_string_escapes_and_unicode():
    body = (
        b'{"model":"a\\"b\\\\c\\/d\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\\u0000",'
        b'"tenant_id":"\xc3\xa9\xf0\x9f\x98\x80","block_size":1,"token_ids":[]}'
    )
    model, _, tenant, _, _ = parse_query(body, False, False)
    assert model == 'a"b\\c/d\b\f\n\r\té\U0001f600\x00'
    assert tenant == "é\U0001f600"


def test_escaped_key_names_are_recognised():
    body = b'{"mod\\u0065l":"m","block_s\\u0069ze":3,"token\\u005fids":[7]}'
    assert parse_query(body, False, False) == ("m", 3, "default", array("I", [7]), None)


def test_duplicate_keys_last_wins():
    body = (
        b'{"model":"a","token_ids":[1],"model":"b","block_size":1,"token_ids":[2,3],'
        b'"tenant_id":"x","tenant_id":null}'
    )
    assert parse_query(body, False, False) == ("b", 1, "default", array("I", [2, 3]), None)
    agree(body, False, False)


def test_other_mode_field_is_ignored():
    body = b'{"model":"m","block_size":1,"token_ids":[1],"block_hashes":[1.5,"x"]}'
    assert list(parse_query(body, False, False)[3]) == [1]
    body = b'{"model":"m","block_hashes":[5],"token_ids":{"a":[true]}}'
    assert list(parse_query(body, False, True)[3]) == [5]


def test_skipped_values_of_every_kind():
    extra = (
        b'"a":{"b":[1,-2.5e-3,{"c":null}],"d":[]},"e":"\\u20ac\\ud83d\\ude00",'
        b'"f":123456789012345678901234567890,"g":1E+400,"h":true,"i":false,"j":{},'
        b'"k":"\xff\xfe"'
    )
    body = b"{" + extra + b',"model":"m","block_size":1,"token_ids":[1]}'
    assert parse_query(body, False, False) == ("m", 1, "default", array("I", [1]), None)
    agree(body, False, False)
    extras = {
        "a": {"b": [1, -2.5, {"c": None}], "d": []},
        "e": b"\x00" * 300,
        "f": U64,
        "g": I64_MIN,
        "h": 1.5,
        "i": [[[[]]]],
        "j": "x" * 70000,
    }
    body = msgspec.msgpack.encode({**extras, "model": "m", "block_size": 1, "token_ids": [1]})
    assert parse_query(body, True, False) == ("m", 1, "default", array("I", [1]), None)
    # ext types (fixext 1/2/4/8/16, ext8/16/32) and float32 in unknown fields
    exts = [msgspec.msgpack.Ext(1, b"x" * n) for n in (1, 2, 4, 8, 16, 3, 300, 70000)]
    body = msgspec.msgpack.encode(
        {
            "x": exts,
            "y": [msgspec.msgpack.Ext(2, b"")],
            "model": "m",
            "block_size": 1,
            "token_ids": [2],
        }
    )
    assert list(parse_query(body, True, False)[3]) == [2]
    body = (
        b"\x84\xa1x\xca\x3f\x80\x00\x00"
        + msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [3]})[1:]
    )
    assert list(parse_query(body, True, False)[3]) == [3]


def test_buffer_types_are_accepted():
    body = b'{"model":"m","block_size":1,"token_ids":[1,2]}'
    for b in (bytearray(body), memoryview(body)):
        assert parse_query(b, False, False) == ("m", 1, "default", array("I", [1, 2]), None)


@pytest.mark.parametrize("n", [5000, 200_000])
def test_large_bodies_all_forms(n):
    import random

    rnd = random.Random(n)
    toks = [rnd.randrange(-(2**40), 2**40) for _ in range(n)]
    want = [t & 0xFFFFFFFF for t in toks]
    d = {"model": "m", "block_size": 16, "token_ids": toks}
    assert list(parse_query(msgspec.json.encode(d), False, False)[3]) == want
    assert list(parse_query(json.dumps(d, indent=1).encode(), False, False)[3]) == want
    assert list(parse_query(msgspec.msgpack.encode(d), True, False)[3]) == want
    packed = {**d, "token_ids": struct.pack(f"<{n}I", *want)}
    assert list(parse_query(msgspec.msgpack.encode(packed), True, False)[3]) == want
    hashes = [rnd.randrange(0, 2**64) for _ in range(n)]
    h = {"model": "m", "block_hashes": hashes}
    assert list(parse_query(msgspec.json.encode(h), False, True)[3]) == hashes
    assert list(parse_query(msgspec.msgpack.encode(h), True, True)[3]) == hashes
    # a big unknown field is skipped (without the GIL)
    big = {"junk": [{"k": "v" * 10, "n": [1.5, None]}] * (n // 10), **d}
    assert list(parse_query(msgspec.json.encode(big), False, False)[3]) == want
    assert list(parse_query(msgspec.msgpack.encode(big), True, False)[3]) == want


# ---------------------------------------------------------------------------------------
# parse_query: malformed bodies
# ---------------------------------------------------------------------------------------


def _bodies():
    import random

    rnd = random.Random(7)
    d = {
        "model": "qwen-\u00e9\U0001f600",
        "block_size": 128,
        "token_ids": [1, -1, 300, 70000, I64_MAX, I64_MIN, 0],
        "tenant_id": "t\n",
        "x": {"y": [1.5, None, True, "s\\"], "z": {}},
    }
    h = {"model": "m", "block_hashes": [1, U64, 300], "tenant_id": None, "q": [[]]}
    yield msgspec.json.encode(d), False, False
    yield json.dumps(d, indent=1).encode(), False, False
    yield msgspec.json.encode(h), False, True
    yield mpack(d, rnd), True, False
    yield msgspec.msgpack.encode(d), True, False
    yield msgspec.msgpack.encode(["m", 70000, [1, 2, -5], "t", "lora-a", {"x": [1]}]), True, False
    yield msgspec.msgpack.encode(["m", 1, struct.pack("<3I", 1, 2, 3)]), True, False
    yield msgspec.msgpack.encode({**d, "token_ids": struct.pack("<2I", 1, 2)}), True, False
    yield msgspec.msgpack.encode(h), True, True
    yield mpack(["m", 1, [U64, 0], None], rnd), True, True


@pytest.mark.parametrize("body,mp,by_hash", list(_bodies()))
def test_truncated_at_every_offset(body, mp, by_hash):
    parse_query(body, mp, by_hash)  # the whole body is valid
    if not mp:
        body = body.rstrip()
    for i in range(len(body)):
        with pytest.raises(WireError):
            parse_query(body[:i], mp, by_hash)


BAD = [
    # (body, msgpack, by_hash, message fragment)
    (b"", False, False, "empty body"),
    (b"  ", False, False, "empty body"),
    (b"", True, False, "empty body"),
    (b"[1,2]", False, False, "expected a JSON object"),
    (b'"x"', False, False, "expected a JSON object"),
    (b"{", False, False, "unexpected end of JSON input"),
    (b'{"model":"m","block_size":1,"token_ids":[1]}x', False, False, "trailing data"),
    (b'{"model":"m","block_size":1,"token_ids":[1]}{}', False, False, "trailing data"),
    (b'{"model":"m","block_size":1,"token_ids":[1]}\x00', False, False, "trailing data"),
    (b'{"model":"m","block_size":1}', False, False, "missing field `token_ids`"),
    (b'{"model":"m","token_ids":[]}', False, False, "missing field `block_size`"),
    (b'{"block_size":1,"token_ids":[]}', False, False, "missing field `model`"),
    (b'{"model":"m","block_size":1,"token_ids":[1]}', False, True, "missing field `block_hashes`"),
    (
        b'{"model":"m","block_size":1,"token_ids":[1,2,3,1.5]}',
        False,
        False,
        "expected an integer in `token_ids` at index 3",
    ),
    (b'{"model":"m","block_size":1,"token_ids":[1e3]}', False, False, "expected an integer"),
    (b'{"model":"m","block_size":1,"token_ids":[1E3]}', False, False, "expected an integer"),
    (b'{"model":"m","block_size":1,"token_ids":[true]}', False, False, "expected an integer"),
    (
        b'{"model":"m","block_size":1,"token_ids":[0,null]}',
        False,
        False,
        "expected an integer in `token_ids` at index 1",
    ),
    (b'{"model":"m","block_size":1,"token_ids":["1"]}', False, False, "expected an integer"),
    (b'{"model":"m","block_size":1,"token_ids":[[1]]}', False, False, "expected an integer"),
    (b'{"model":"m","block_size":1,"token_ids":[1,]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[,1]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[1 2]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[01]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[-]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[+1]}', False, False, "invalid JSON"),
    (
        b'{"model":"m","block_size":1,"token_ids":[9223372036854775808]}',
        False,
        False,
        "integer out of range in `token_ids` at index 0",
    ),
    (
        b'{"model":"m","block_size":1,"token_ids":[-9223372036854775809]}',
        False,
        False,
        "integer out of range",
    ),
    (
        b'{"model":"m","block_size":1,"token_ids":[18446744073709551616]}',
        False,
        False,
        "integer out of range",
    ),
    (
        b'{"model":"m","block_size":1,"token_ids":[123456789012345678901234567890]}',
        False,
        False,
        "integer out of range",
    ),
    (b'{"model":"m","block_hashes":[18446744073709551616]}', False, True, "integer out of range"),
    (
        b'{"model":"m","block_hashes":[1,-1]}',
        False,
        True,
        "integer out of range in `block_hashes` at index 1",
    ),
    (b'{"model":"m","block_size":1,"token_ids":{}}', False, False, "invalid type for `token_ids`"),
    (b'{"model":"m","block_size":1,"token_ids":null}', False, False, "invalid type"),
    (b'{"model":1,"block_size":1,"token_ids":[]}', False, False, "invalid type for `model`"),
    (b'{"model":null,"block_size":1,"token_ids":[]}', False, False, "invalid type for `model`"),
    (
        b'{"model":"m","block_size":1,"token_ids":[],"tenant_id":5}',
        False,
        False,
        "invalid type for `tenant_id`",
    ),
    (b'{"model":"m","block_size":-1,"token_ids":[]}', False, False, "block_size out of range"),
    (
        b'{"model":"m","block_size":4294967296,"token_ids":[]}',
        False,
        False,
        "block_size out of range",
    ),
    (b'{"model":"m","block_size":1.0,"token_ids":[]}', False, False, "`block_size`"),
    (b'{"model":"m","block_size":true,"token_ids":[]}', False, False, "`block_size`"),
    (b'{"model":"m","block_size":"1","token_ids":[]}', False, False, "`block_size`"),
    (b'{"model":"m","block_size":null,"token_ids":[]}', False, False, "`block_size`"),
    (b'{"model":"m","block_hashes":[],"block_size":-5}', False, True, "block_size out of range"),
    (b'{"model":"\xff","block_size":1,"token_ids":[]}', False, False, "invalid UTF-8 in `model`"),
    (
        b'{"model":"m","block_size":1,"token_ids":[],"tenant_id":"\xc3"}',
        False,
        False,
        "invalid UTF-8 in `tenant_id`",
    ),
    (b'{"model":"\\ud800","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"\\udc00x","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"\\ud800\\u0041","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"\\x","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"\\u12G4","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"a\tb","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":[1,{]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":{"a" 1}}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":{1:2}}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":tru}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":1.}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":.5}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":1e}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":-01}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":NaN}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":[1]]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],}', False, False, "invalid JSON"),
    (b'{"model":"m" "block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (b'{"model":"m","block_size":1,"token_ids":[],"x":"\\ud800"}', False, False, "invalid JSON"),
    (b"{'model':'m'}", False, False, "invalid JSON"),
    (b'\xef\xbb\xbf{"model":"m","block_size":1,"token_ids":[]}', False, False, "invalid JSON"),
    (
        b'{"model":"m","block_size":1,"token_ids":[],"x":' + b"[" * 1100 + b"]" * 1100 + b"}",
        False,
        False,
        "nesting too deep",
    ),
    (
        b'{"model":"m","block_size":1,"token_ids":[],"x":'
        + b'{"a":' * 1100
        + b"1"
        + b"}" * 1100
        + b"}",
        False,
        False,
        "nesting too deep",
    ),
    # msgpack
    (b"\x01", True, False, "expected a map or an array"),
    (b"\xc0", True, False, "expected a map or an array"),
    (b"\xc1", True, False, "expected a map or an array"),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [1]}) + b"\x00",
        True,
        False,
        "trailing data",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [1]})[:-1],
        True,
        False,
        "truncated msgpack",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1}),
        True,
        False,
        "missing field `token_ids`",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "token_ids": []}),
        True,
        False,
        "missing field `block_size`",
    ),
    (
        msgspec.msgpack.encode({"block_size": 1, "token_ids": []}),
        True,
        False,
        "missing field `model`",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [1, 2.0]}),
        True,
        False,
        "expected an integer in `token_ids` at index 1",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [True]}),
        True,
        False,
        "expected an integer in `token_ids` at index 0",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [None]}),
        True,
        False,
        "expected an integer",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [1, 2**63]}),
        True,
        False,
        "integer out of range in `token_ids` at index 1",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_hashes": [1, -1]}),
        True,
        True,
        "integer out of range in `block_hashes` at index 1",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_hashes": b"\x00" * 8}),
        True,
        True,
        "invalid type for `block_hashes`",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": b"\x00" * 5}),
        True,
        False,
        "not a multiple of 4",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": "abc"}),
        True,
        False,
        "invalid type for `token_ids`",
    ),
    (
        msgspec.msgpack.encode({"model": b"m", "block_size": 1, "token_ids": []}),
        True,
        False,
        "invalid type for `model`",
    ),
    (
        msgspec.msgpack.encode({"model": None, "block_size": 1, "token_ids": []}),
        True,
        False,
        "invalid type for `model`",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [], "tenant_id": 3}),
        True,
        False,
        "invalid type for `tenant_id`",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": -1, "token_ids": []}),
        True,
        False,
        "block_size out of range",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 2**32, "token_ids": []}),
        True,
        False,
        "block_size out of range",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": 1.0, "token_ids": []}),
        True,
        False,
        "expected an integer for `block_size`",
    ),
    (
        msgspec.msgpack.encode({"model": "m", "block_size": None, "token_ids": []}),
        True,
        False,
        "expected an integer for `block_size`",
    ),
    (
        msgspec.msgpack.encode({1: "m", "model": "m", "block_size": 1, "token_ids": []}),
        True,
        False,
        "map keys must be strings",
    ),
    (
        b"\x83\xa5model\xa1\xff\xaablock_size\x01\xa9token_ids\x90",
        True,
        False,
        "invalid UTF-8 in `model`",
    ),
    (msgspec.msgpack.encode([]), True, False, "missing field `model`"),
    (msgspec.msgpack.encode(["m"]), True, False, "missing field `block_size`"),
    (msgspec.msgpack.encode(["m", 1]), True, False, "missing field `token_ids`"),
    (msgspec.msgpack.encode(["m", 1]), True, True, "missing field `block_hashes`"),
    (msgspec.msgpack.encode([1, 1, []]), True, False, "invalid type for `model`"),
    (b"\xdd\xff\xff\xff\xff\xa1m", True, False, "truncated msgpack"),
    (b"\x93\xa1m\x01\xdd\xff\xff\xff\xff\x01", True, False, "truncated msgpack"),
    (b"\x93\xa1m\x01\xc6\xff\xff\xff\xff\x01", True, False, "truncated msgpack"),
    (
        b"\x84\xa1x\xdf\xff\xff\xff\xff"
        + msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": []})[1:],
        True,
        False,
        "truncated msgpack",
    ),
    (
        b"\x84\xa1x\xc1"
        + msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": []})[1:],
        True,
        False,
        "invalid msgpack byte",
    ),
]


@pytest.mark.parametrize("body,mp,by_hash,fragment", BAD)
def test_malformed_bodies(body, mp, by_hash, fragment):
    with pytest.raises(WireError) as ei:
        parse_query(body, mp, by_hash)
    assert fragment in str(ei.value)
    assert isinstance(ei.value, ValueError)
    if b"[" * 1100 not in body and b'{"a":' * 1100 not in body:
        agree(body, mp, by_hash)


def test_deep_msgpack_nesting_in_unknown_field_is_skipped():
    deep = b"\x91" * 100_000 + b"\x90"
    body = (
        b"\x84\xa1x"
        + deep
        + msgspec.msgpack.encode({"model": "m", "block_size": 1, "token_ids": [4]})[1:]
    )
    assert list(parse_query(body, True, False)[3]) == [4]


INSERTABLE = b'{}[],:"\\0123456789-.eEtfn \x00\xc0\xc1\xd9\xdc\xdd\xde\xdf\xcf\xd3\x91\x81'


@pytest.mark.parametrize("by_hash", [False, True])
@pytest.mark.parametrize("mp", [False, True])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_mutated_bodies_agree_or_fail_cleanly(mp, by_hash, data):
    """Random byte edits of valid bodies: both decoders accept with equal results, or both
    reject (ours always with WireError, never a crash)."""
    items, *_ = data.draw(request_fields(by_hash, mp_value_st if mp else json_value_st))
    enc = msgspec.msgpack.encode if mp else msgspec.json.encode
    body = bytearray(enc(dict(items)))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        i = data.draw(st.integers(0, max(len(body) - 1, 0)))
        if op == "insert":
            body[i:i] = bytes([data.draw(st.sampled_from(INSERTABLE))])
        elif body and op == "delete":
            del body[i]
        elif body and op == "flip":
            body[i] ^= 1 << data.draw(st.integers(0, 7))
        elif body:
            body[i] = data.draw(st.integers(0, 255))
    agree(bytes(body), mp, by_hash)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=64), mp=st.booleans(), by_hash=st.booleans())
def test_random_bytes_never_crash(body, mp, by_hash):
    try:
        parse_query(body, mp, by_hash)
    except WireError:
        pass


# ---------------------------------------------------------------------------------------
# encode_result / encode_error
# ---------------------------------------------------------------------------------------


def _check_encoding(hits, tenant, block_size):
    ref = QueryResult([DpHit(*h) for h in hits]).to_dict(tenant, block_size)
    js = encode_result(hits, tenant, block_size, False)
    mp = encode_result(hits, tenant, block_size, True)
    assert msgspec.json.decode(js) == ref
    assert msgspec.msgpack.decode(mp) == ref
    assert js == msgspec.json.encode(ref)
    assert mp == msgspec.msgpack.encode(ref)
    assert json.loads(js) == ref


def test_encode_contract_example():
    hits = [DpHit("vllm-prefill-1", 0, 3, 2, 0)]
    assert encode_result(hits, "default", 128, False) == (
        b'{"default":{"vllm-prefill-1":{"longest_matched":640,"DP":{"0":{"matched_tokens":640,'
        b'"npu_blocks":3,"cpu_blocks":2,"disk_blocks":0}}}}}'
    )
    _check_encoding(hits, "default", 128)


def test_encode_empty_result():
    assert encode_result([], "t", 4, False) == b'{"t":{}}'
    assert encode_result([], "t", 4, True) == b"\x81\xa1t\x80"


def test_encode_groups_non_adjacent_dps_in_first_seen_order():
    hits = [("b", 1, 1, 0, 0), ("a", 0, 2, 0, 0), ("b", 0, 4, 1, 0), ("a", 3, 0, 0, 1)]
    out = json.loads(encode_result(hits, "t", 2, False))
    assert list(out["t"]) == ["b", "a"]
    assert list(out["t"]["b"]["DP"]) == ["1", "0"]
    assert out["t"]["b"]["longest_matched"] == 10
    _check_encoding(hits, "t", 2)


def test_encode_duplicate_dp_replaces_in_place():
    hits = [("a", 0, 5, 0, 0), ("a", 1, 1, 0, 0), ("a", 0, 2, 0, 0), ("b", 0, 1, 0, 0)]
    _check_encoding(hits, "t", 3)
    out = json.loads(encode_result(hits, "t", 3, False))
    assert out["t"]["a"]["longest_matched"] == 15  # the replaced DP still counted
    assert out["t"]["a"]["DP"]["0"]["npu_blocks"] == 2


def test_encode_saturation():
    hits = [
        ("a", 0, 2**40, 0, 0),
        ("a", 1, 2**31, 2**31, 2**31),
        ("b", 0, 2**80, 1, 1),
        ("c", 0, 1, 0, 0),
        ("d", 0, U32, 0, 0),
        ("d", 1, 0, 0, 0),
    ]
    for bs in (0, 1, 2, 2**31, 2**32, 2**70):
        _check_encoding(hits, "t", bs)


@pytest.mark.parametrize(
    "value,encoded",
    [
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\xcc\x80"),
        (255, b"\xcc\xff"),
        (256, b"\xcd\x01\x00"),
        (65535, b"\xcd\xff\xff"),
        (65536, b"\xce\x00\x01\x00\x00"),
        (U32, b"\xce\xff\xff\xff\xff"),
        (2**40, b"\xce\xff\xff\xff\xff"),
    ],
)
def test_msgpack_ints_use_the_smallest_encoding(value, encoded):
    out = encode_result([("i", 0, 0, value, 0)], "t", 0, True)
    assert out == (
        b"\x81\xa1t\x81\xa1i\x82\xaflongest_matched\x00\xa2DP\x81\xa10\x84"
        b"\xaematched_tokens\x00\xaanpu_blocks\x00\xaacpu_blocks" + encoded + b"\xabdisk_blocks\x00"
    )


@pytest.mark.parametrize("n", [0, 1, 31, 32, 255, 256, 65535, 65536])
def test_string_length_encodings(n):
    name = "x" * n
    _check_encoding([(name, 0, 1, 0, 0)], name, 1)
    assert encode_error(name, True) == msgspec.msgpack.encode({"error": name})


def test_map_header_sizes():
    for n in (15, 16, 300):
        hits = [(f"inst-{i}", 0, 1, 0, 0) for i in range(n)]
        _check_encoding(hits, "t", 4)
        hits = [("one", i, 1, 0, 0) for i in range(n)]
        _check_encoding(hits, "t", 4)


def test_json_string_escaping():
    tricky = 'q"b\\s/\x00\x01\x08\x09\x0a\x0c\x0d\x1f\x7f\u00e9\u2028\U0001f600<>&'
    _check_encoding([(tricky, 0, 1, 2, 3)], tricky, 7)
    assert encode_error(tricky, False) == msgspec.json.encode({"error": tricky})


def test_dp_rank_keys():
    hits = [("a", -3, 1, 0, 0), ("a", 2**70, 1, 0, 0), ("a", 0, 1, 0, 0), ("a", True, 1, 0, 0)]
    ref = QueryResult([DpHit(*h) for h in hits]).to_dict("t", 1)
    assert msgspec.json.decode(encode_result(hits, "t", 1, False)) == ref
    assert msgspec.msgpack.decode(encode_result(hits, "t", 1, True)) == ref


def test_encode_rejects_bad_input():
    with pytest.raises(TypeError):
        encode_result([(1, 0, 1, 0, 0)], "t", 1, False)
    with pytest.raises(ValueError):
        encode_result([("a", 0, -1, 0, 0)], "t", 1, False)
    with pytest.raises(ValueError):
        encode_result([("a", 0, 1, 0, 0)], "t", -1, True)


def test_encode_error_shapes():
    assert encode_error("no indexer for model=m tenant=t", False) == (
        b'{"error":"no indexer for model=m tenant=t"}'
    )
    assert msgspec.msgpack.decode(encode_error("bad", True)) == {"error": "bad"}
    assert encode_error("", True) == b"\x81\xa5error\xa0"


hit_st = st.tuples(
    st.one_of(st.sampled_from(["vllm-0", "vllm-1", "pool", ""]), wide_text_st),
    st.integers(0, 9),
    st.one_of(st.integers(0, 300), st.integers(0, 2**34)),
    st.one_of(st.integers(0, 300), st.integers(0, 2**34)),
    st.one_of(st.integers(0, 300), st.integers(0, 2**34)),
)


@settings(max_examples=300, deadline=None)
@given(
    hits=st.lists(hit_st, max_size=40),
    tenant=wide_text_st,
    block_size=st.one_of(
        st.integers(0, 256), st.integers(0, 2**40), st.sampled_from([0, 1, 128, U32])
    ),
)
def test_encode_matches_to_dict(hits, tenant, block_size):
    _check_encoding(hits, tenant, block_size)


def test_roundtrip_through_parse_and_query_shape():
    """The response to the example query (qwen, block_size 128, tokens 1..4), and parse of the
    request, end to end."""
    req = msgspec.msgpack.encode(
        {"model": "qwen", "block_size": 128, "token_ids": [1, 2, 3, 4], "tenant_id": "default"}
    )
    model, bs, tenant, toks, _ = parse_query(req, True, False)
    out = encode_result([DpHit("vllm-prefill-1", 0, 3, 2, 0)], tenant, bs, True)
    assert msgspec.msgpack.decode(out) == {
        "default": {
            "vllm-prefill-1": {
                "longest_matched": 640,
                "DP": {
                    "0": {"matched_tokens": 640, "npu_blocks": 3, "cpu_blocks": 2, "disk_blocks": 0}
                },
            }
        }
    }


# ---------------------------------------------------------------------------------------
# read_u32_array: one msgpack int array, the token_ids rules of parse_query
# ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=I64_MIN, max_value=U64), max_size=40))
def test_read_u32_array_matches_parse_query(tokens):
    raw = msgspec.msgpack.encode(tokens)
    try:
        want = parse_query(msgspec.msgpack.encode(["m", 1, tokens]), True, False)[3]
    except WireError:
        want = None
    try:
        got = _wire.read_u32_array(raw)
    except WireError:
        got = None
    assert got == want
    if want is not None:
        assert list(got) == [t & U32 for t in tokens]


_NOT_U32_ARRAYS = [
    b"",
    b"\xc0",
    b"\xa1x",
    b"\xc4\x04\x01\x00\x00\x00",
    b"\x92\x01",
    b"\x91\x01\x02",
    b"\x91\xa1x",
    b"\x91\xc1",
    b"\x91\xcf" + b"\xff" * 8,
]


@pytest.mark.parametrize("raw", _NOT_U32_ARRAYS)
def test_read_u32_array_rejects(raw):
    with pytest.raises(WireError):
        _wire.read_u32_array(raw)


def test_read_u32_array_takes_raw_and_memoryview():
    raw = msgspec.Raw(msgspec.msgpack.encode([1, 2**32 + 3, -1]))
    assert list(_wire.read_u32_array(raw)) == [1, 3, 2**32 - 1]
    assert list(_wire.read_u32_array(memoryview(bytes(raw)))) == [1, 3, 2**32 - 1]


# ---------------------------------------------------------------------------------------
# extension fields: top_k and instances (docs/api.md, "top_k and instances"), ext=True only
# ---------------------------------------------------------------------------------------
def _both_ext(body, mp, by_hash):
    """The compiled parser and the oracle, with ext: equal results or both WireError."""
    from kvconductor import wire

    try:
        got = parse_query(body, mp, by_hash, True)
    except WireError as ex:
        with pytest.raises(wire.WireError):
            wire.py_parse_query(body, mp, by_hash, True)
        raise ex
    assert wire.py_parse_query(body, mp, by_hash, True) == got
    assert got[8] is False  # no cache_salt / mm_inputs (test_extra_keys_flag has them)
    return got[:8]


def test_extension_fields_map_forms():
    base = {"model": "m", "block_size": 4, "token_ids": [1, 2]}
    for mp in (False, True):
        enc = msgspec.msgpack.encode if mp else msgspec.json.encode
        got = _both_ext(enc({**base, "top_k": 8, "instances": ["a", "b\u00e9"]}), mp, False)
        assert got == ("m", 4, "default", array("I", [1, 2]), None, 8, ["a", "b\u00e9"], False)
        got = _both_ext(enc({**base, "top_k": None, "instances": None}), mp, False)
        assert got[5:] == (None, None, False)
        assert _both_ext(enc(base), mp, False)[5:] == (None, None, False)
        assert _both_ext(enc({**base, "instances": []}), mp, False)[5:] == (None, [], False)
        for value, want in ((True, True), (False, False), (None, False)):
            assert _both_ext(enc({**base, "freshness": value}), mp, False)[7] is want
            assert _both_ext(enc({**base, "freshness": value, "x": 1}), mp, False)[7] is want
        assert _both_ext(enc({**base, "top_k": U32}), mp, False)[5] == U32
        h = {"model": "m", "block_hashes": [U64], "top_k": 1, "instances": ["x"]}
        h["freshness"] = True
        want = ("m", 0, "default", array("Q", [U64]), None, 1, ["x"], True)
        assert _both_ext(enc(h), mp, True) == want
        # without ext the fields are skipped like unknown ones, whatever their value
        bad = enc({**base, "top_k": "x", "instances": 3, "freshness": "yes"})
        assert parse_query(bad, mp, False) == ("m", 4, "default", array("I", [1, 2]), None)


def test_extension_fields_positional_form():
    body = msgspec.msgpack.encode(
        ["m", 4, [1], None, None, 2, ["a"], True, None, None, {"later": 1}]
    )
    want = ("m", 4, "default", array("I", [1]), None, 2, ["a"], True)
    assert _both_ext(body, True, False) == want
    body = msgspec.msgpack.encode(["m", 4, [1], None, None, 2, ["a"], None])
    assert _both_ext(body, True, False)[5:] == (2, ["a"], False)
    body = msgspec.msgpack.encode(["m", 4, struct.pack("<2I", 7, 8), "t", "l", None])
    assert _both_ext(body, True, False) == ("m", 4, "t", array("I", [7, 8]), "l", None, None, False)
    assert parse_query(body, True, False) == ("m", 4, "t", array("I", [7, 8]), "l")
    body = msgspec.msgpack.encode(["m", 0, [5], None, None, 1])
    assert _both_ext(body, True, True) == ("m", 0, "default", array("Q", [5]), None, 1, None, False)
    # ext without the extension elements
    body = msgspec.msgpack.encode(["m", 4, [1]])
    assert _both_ext(body, True, False)[5:] == (None, None, False)


EXT_BAD = [
    ({"top_k": 0}, "top_k must be between 1 and 4294967295"),
    ({"top_k": -1}, "top_k must be between 1 and 4294967295"),
    ({"top_k": 2**32}, "top_k must be between 1 and 4294967295"),
    ({"top_k": 2**63}, "top_k must be between 1 and 4294967295"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "3"}, "invalid type for `top_k`"),
    ({"top_k": True}, "top_k"),
    ({"top_k": [1]}, "invalid type for `top_k`"),
    ({"instances": "a"}, "invalid type for `instances`"),
    ({"instances": [1]}, "instances"),
    ({"instances": ["a", None]}, "instances"),
    ({"instances": {"a": 1}}, "invalid type for `instances`"),
    ({"instances": [["a"]]}, "instances"),
    ({"freshness": 1}, "invalid type for `freshness`: expected a boolean or"),
    ({"freshness": "true"}, "invalid type for `freshness`: expected a boolean or"),
    ({"freshness": [True]}, "invalid type for `freshness`: expected a boolean or"),
    ({"freshness": 0.0}, "invalid type for `freshness`: expected a boolean or"),
]


@pytest.mark.parametrize("extra,fragment", EXT_BAD)
@pytest.mark.parametrize("mp", [False, True])
def test_extension_fields_bad_values(extra, fragment, mp):
    enc = msgspec.msgpack.encode if mp else msgspec.json.encode
    body = enc({"model": "m", "block_size": 4, "token_ids": [1], **extra})
    with pytest.raises(WireError, match=re.escape(fragment)):
        _both_ext(body, mp, False)


def test_extension_fields_bad_positional_and_raw():
    for body in (
        msgspec.msgpack.encode(["m", 4, [1], None, None, "x"]),
        msgspec.msgpack.encode(["m", 4, [1], None, None, 0]),
        msgspec.msgpack.encode(["m", 4, [1], None, None, None, [b"a"]]),
        msgspec.msgpack.encode(["m", 4, [1], None, None, None, "a"]),
        msgspec.msgpack.encode(["m", 4, [1], None, None, None, None, 1]),
        msgspec.msgpack.encode(["m", 4, [1], None, None, None, None, "true"]),
    ):
        with pytest.raises(WireError):
            _both_ext(body, True, False)
    for body in (
        b'{"model":"m","block_size":4,"token_ids":[1],"top_k":01}',
        b'{"model":"m","block_size":4,"token_ids":[1],"top_k":1e1}',
        b'{"model":"m","block_size":4,"token_ids":[1],"instances":["a",]}',
        b'{"model":"m","block_size":4,"token_ids":[1],"instances":["\\ud800"]}',
        b'{"model":"m","block_size":4,"token_ids":[1],"instances":["a" "b"]}',
        b'{"model":"m","block_size":4,"token_ids":[1],"freshness":tru}',
        b'{"model":"m","block_size":4,"token_ids":[1],"freshness":truex}',
        b'{"model":"m","block_size":4,"token_ids":[1],"freshness":falsy}',
        b'{"model":"m","block_size":4,"token_ids":[1],"freshness":True}',
    ):
        with pytest.raises(WireError):
            _both_ext(body, False, False)


@pytest.mark.parametrize("mp", [False, True])
def test_extension_body_truncated_at_every_offset(mp):
    d = {"model": "m", "block_size": 4, "token_ids": [1], "top_k": 300, "instances": ["ab", "c"]}
    d["freshness"] = True
    body = msgspec.msgpack.encode(d) if mp else msgspec.json.encode(d)
    assert parse_query(body, mp, False, True)[5:] == (300, ["ab", "c"], True, False)
    for i in range(len(body)):
        with pytest.raises(WireError):
            parse_query(body[:i], mp, False, True)


def test_extension_instance_names_are_bounded():
    from kvconductor import wire
    from kvconductor.schema import NAME_MAX

    ok = msgspec.json.encode({"model": "m", "block_size": 1, "token_ids": [], "instances": ["a"]})
    assert wire.parse_query_ext(ok, False, False)[6] == ["a"]
    long = msgspec.json.encode(
        {"model": "m", "block_size": 1, "token_ids": [], "instances": ["a", "x" * (NAME_MAX + 1)]}
    )
    with pytest.raises(wire.WireError, match=re.escape("$.instances[1]")):
        wire.parse_query_ext(long, False, False)
    assert wire.parse_query(long, False, False)[0] == "m"  # skipped without ext


# ---------------------------------------------------------------------------------------
# long int arrays: two decoding chains (kvconductor/_readers.pxd, _mp_u32_split) must
# give exactly what one chain gives, on any bytes
# ---------------------------------------------------------------------------------------

#: msgpack int tags and their lengths (tag included)
_INT_LEN = {
    **dict.fromkeys(range(0x80), 1),
    **dict.fromkeys(range(0xE0, 0x100), 1),
    0xCC: 2,
    0xCD: 3,
    0xCE: 5,
    0xCF: 9,
    0xD0: 2,
    0xD1: 3,
    0xD2: 5,
    0xD3: 9,
}


def _one_chain(body: bytes, start: int, n: int) -> tuple[str, object]:
    """The outcome of decoding n ints at ``start`` one element after the other, in the
    words of the parser's error messages: ("ok", (values, end)), ("eof", None),
    ("type", index), ("c1", offset), ("range", index)."""
    if len(body) - start < n:
        return "eof", None  # every element needs at least one byte
    p, values = start, []
    for i in range(n):
        if p >= len(body):
            return "eof", i
        tag = body[p]
        if tag == 0xC1:
            return "c1", p
        if tag not in _INT_LEN:
            return "type", i
        size = _INT_LEN[tag]
        if p + size > len(body):
            return "eof", i
        if tag < 0x80:
            v = tag
        elif tag >= 0xE0:
            v = tag - 0x100
        else:
            v = int.from_bytes(body[p + 1 : p + size], "big", signed=tag >= 0xD0)
            if tag == 0xCF and v > I64_MAX:
                return "range", i
        values.append(v & U32)
        p += size
    return "ok", (values, p)


_token = st.one_of(
    st.integers(0, 127),
    st.integers(128, 65535),
    st.integers(65536, U32),
    st.integers(-32, -1),
    st.integers(-(2**31), -33),
    st.integers(U32 + 1, I64_MAX),
    st.integers(I64_MIN, -(2**31) - 1),
)


@settings(max_examples=scaled(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    toks=st.lists(_token, min_size=250, max_size=1500),
    same=st.sampled_from([None, 1, 3, 5]),
    edit=st.none() | st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
    cut=st.none() | st.floats(0, 1),
)
def test_a_long_int_array_decodes_as_one_chain_would(toks, same, edit, cut):
    if same is not None:  # runs of one encoding: B's guess lands on a tag or inside one
        base = {1: 5, 3: 40_000, 5: 100_000}[same]
        toks = [base + (t & 7) for t in toks]
    body = msgspec.msgpack.encode({"model": "m", "block_size": 16, "token_ids": toks})
    start = body.index(b"token_ids") + len(b"token_ids") + 3  # array16 header
    raw = bytearray(body)
    if edit is not None:  # one byte of the array changed
        at = start + int(edit[0] * (len(raw) - start))
        raw[at] = edit[1]
    if cut is not None:  # the body cut short
        raw = raw[: start + int(cut * (len(raw) - start))]
    data = bytes(raw)
    kind, what = _one_chain(data, start, len(toks))
    try:
        got = parse_query(data, True, False)
        error = None
    except WireError as ex:
        error = str(ex)
    if kind == "ok":
        values, end = what
        if end == len(data):
            assert error is None, error
            assert got[3].tolist() == values
        else:
            assert error is not None  # bytes after the body's last value
    elif kind == "type":
        assert error is not None and f"in `token_ids` at index {what}" in error
    elif kind == "c1":
        assert error == f"invalid msgpack byte 0xc1 at offset {what}"
    elif kind == "range":
        assert error is not None and f"out of range in `token_ids` at index {what}" in error
    else:
        assert error is not None and "truncated" in error


@pytest.mark.parametrize("fmt", ["json", "msgpack", "msgpack_array"])
def test_extra_keys_flag(fmt):
    """``cache_salt`` / ``mm_inputs`` not null: the parsers say so (the values are read by
    ``kvconductor.extrakeys`` only then); null or absent: not."""
    from kvconductor import wire

    mm = [{"identifier": "img", "offset": 1, "length": 2}]
    cases = [({}, False), ({"cache_salt": None, "mm_inputs": None}, False)]
    cases += [({"cache_salt": "s"}, True), ({"mm_inputs": mm}, True), ({"mm_inputs": 5}, True)]
    cases += [({"cache_salt": "", "mm_inputs": None}, True)]
    for extra, want in cases:
        doc = {"model": "m", "block_size": 4, "token_ids": [1, 2], **extra}
        mp = fmt != "json"
        if fmt == "msgpack_array":
            row = ["m", 4, [1, 2], None, None, None, None, None]
            row += [extra.get("cache_salt"), extra.get("mm_inputs")]
            body = msgspec.msgpack.encode(row if extra else row[:3])
        else:
            body = (msgspec.msgpack.encode if mp else msgspec.json.encode)(doc)
        got = parse_query(body, mp, False, True)
        assert got == wire.py_parse_query(body, mp, False, True)
        assert got[8] is want, extra
        assert len(parse_query(body, mp, False)) == 5
