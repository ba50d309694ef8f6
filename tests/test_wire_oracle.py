"""The compiled query parser against its msgspec oracle (``kvconductor.wire.py_parse_query``).

Random bodies, valid and not: field order, unknown and nested extra fields, strings
with escapes and non-ASCII text, ints at the u32 / i64 / u64 boundaries, floats,
nulls, wrong types, positional msgpack arrays, packed tokens, truncated bodies; JSON
and MessagePack; ``/query`` and ``/query_by_hash``. Through
:func:`kvconductor.wire.parse_query` (the range checks common to both), the two
must give equal results or both raise :class:`kvconductor.wire.WireError`.
"""

from __future__ import annotations

import json
import struct

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor import _wire, wire
from kvconductor.schema import QUERY_BY_HASH_FIELDS, QUERY_FIELDS
from tests.helpers.examples import scaled

_EDGES = [
    0,
    1,
    2**32 - 1,
    2**32,
    2**32 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**64 + 1,
    -1,
    -(2**32),
    -(2**63),
    -(2**63) - 1,
    -(2**64),
]
ints = st.one_of(st.sampled_from(_EDGES), st.integers(-(2**65), 2**65), st.integers(0, 200_000))
_ODD_TEXTS = ["", "default", 'é"\\\n\x01', "\U0001f600"]
texts = st.one_of(st.text(max_size=12), st.sampled_from(_ODD_TEXTS))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), texts)
nested = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
int_lists = st.lists(ints, max_size=8)
values = st.one_of(int_lists, int_lists, int_lists, nested, st.lists(scalars, max_size=3))
# well-typed values (edges included), for bodies that should parse
good_sizes = st.one_of(st.sampled_from([1, 16, 2**32 - 1]), st.integers(1, 2**32 - 1))
good_tokens = st.lists(
    st.one_of(
        st.sampled_from([e for e in _EDGES if -(2**63) <= e < 2**63]),
        st.integers(-(2**63), 2**63 - 1),
    ),
    max_size=8,
)
good_hashes = st.lists(
    st.one_of(st.sampled_from([e for e in _EDGES if 0 <= e < 2**64]), st.integers(0, 2**64 - 1)),
    max_size=8,
)
good_names = st.one_of(st.none(), texts)


def _field(draw, name, by_hash, good):
    if name == "model":
        return draw(texts if good else st.one_of(texts, scalars))
    if name == "block_size":
        return draw(good_sizes if good else st.one_of(ints, scalars))
    if name in ("token_ids", "block_hashes"):
        return draw((good_hashes if by_hash else good_tokens) if good else values)
    if name == "top_k":
        good_k = st.one_of(st.none(), st.integers(1, 2**32 - 1))
        return draw(good_k if good else st.one_of(ints, scalars, texts))
    if name == "instances":
        good_i = st.one_of(st.none(), st.lists(texts, max_size=3))
        return draw(good_i if good else st.one_of(good_i, scalars, nested))
    if name == "freshness":
        good_f = st.one_of(st.none(), st.booleans())
        return draw(good_f if good else st.one_of(good_f, scalars, nested))
    if name == "mm_inputs":
        one = st.fixed_dictionaries(
            {"identifier": texts, "offset": st.integers(0, 40), "length": st.integers(1, 9)}
        )
        good_m = st.one_of(st.none(), st.lists(one, max_size=3))
        return draw(good_m if good else st.one_of(good_m, scalars, nested))
    return draw(good_names if good else st.one_of(st.none(), texts, scalars, nested))


def _fits_msgpack(obj) -> bool:
    if isinstance(obj, bool) or not isinstance(obj, (int, list, dict)):
        return True
    if isinstance(obj, int):
        return -(2**63) <= obj < 2**64
    items = obj if isinstance(obj, list) else list(obj.values())
    return all(_fits_msgpack(v) for v in items)


@st.composite
def bodies(draw):
    by_hash = draw(st.booleans())
    fmt = draw(st.sampled_from(["json", "json_ascii", "msgpack", "msgpack_array"]))
    names = list(QUERY_BY_HASH_FIELDS if by_hash else QUERY_FIELDS)
    good = draw(st.integers(0, 2)) > 0  # 2/3: well-typed but for one field
    bad = draw(st.one_of(st.none(), st.sampled_from(names))) if good else None
    if fmt == "msgpack_array":
        n = draw(st.integers(3, len(names) + 2) if good else st.integers(0, len(names) + 2))
        doc = [
            _field(draw, names[i], by_hash, good and names[i] != bad)
            if i < len(names)
            else draw(nested)
            for i in range(n)
        ]
    else:
        doc = {}
        for name in draw(st.permutations(names)):
            if draw(st.integers(0, 19 if good else 5)) == 0:
                continue  # a missing field
            doc[name] = _field(draw, name, by_hash, good and name != bad)
        for key in draw(
            st.lists(st.sampled_from(["extra", "x", "token_ids", "block_hashes", "é"]), max_size=2)
        ):
            if key not in doc:
                doc[key] = draw(nested)
    msgpack = fmt.startswith("msgpack")
    if msgpack:
        if not _fits_msgpack(doc):
            doc = json.loads(json.dumps(doc), parse_int=lambda s: int(s) % 2**32)
        packed = draw(st.integers(0, 5)) == 0
        if packed and isinstance(doc, dict) and "token_ids" in doc:
            doc["token_ids"] = draw(st.binary(max_size=17))
        body = msgspec.msgpack.encode(doc)
    elif fmt == "json_ascii":
        body = json.dumps(doc, ensure_ascii=True).encode()
    else:
        body = json.dumps(doc, ensure_ascii=False).encode()
    if draw(st.integers(0, 6)) == 0 and body:
        body = body[: draw(st.integers(0, len(body) - 1))]  # truncated
    return body, msgpack, by_hash


def _parse(impl, body, msgpack, by_hash, ext=False):
    saved = wire._parse_impl
    wire._parse_impl = impl
    try:
        if ext:
            model, bs, tenant, vals, lora, top_k, insts, fresh, extras = wire.parse_query_ext(
                body, msgpack, by_hash
            )
            out = ("ok", model, bs, tenant, vals.typecode, list(vals), lora, top_k, insts, fresh)
            return (*out, extras)
        model, bs, tenant, vals, lora = wire.parse_query(body, msgpack, by_hash)
        return ("ok", model, bs, tenant, vals.typecode, list(vals), lora)
    except wire.WireError:
        return ("WireError",)
    finally:
        wire._parse_impl = saved


def _assert_same(body, msgpack, by_hash):
    for ext in (False, True):
        assert _parse(_wire.parse_query, body, msgpack, by_hash, ext) == _parse(
            wire.py_parse_query, body, msgpack, by_hash, ext
        ), (body, ext)


@settings(max_examples=scaled(3000), deadline=None, suppress_health_check=list(HealthCheck))
@given(bodies())
def test_compiled_parser_matches_the_oracle(case):
    _assert_same(*case)


_DEEP = b"[" * 1100 + b"]" * 1100
_HEAD = b"\x83\xa5model\xa1m\xaablock_size\x01"  # msgpack map of 3: model, block_size, ...
_HEAD4 = b"\x84" + _HEAD[1:]
_EDGE_BODIES = [
    (False, False, b'{"model":"m","block_size":4,"tok\\u0065n_ids":[1]}'),
    (False, False, b'{"model":"m","block_size":4,"token_ids":[1],"token_ids":[2]}'),
    (False, False, b'{"model":"m","block_size":4.0,"token_ids":[1]}'),
    (False, False, b'{"model":"m","block_size":-0,"block_hashes":[1]}'),
    (False, True, b'{"model":"m","block_size":-0,"block_hashes":[-0]}'),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[1e3]}'),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[01]}'),
    (False, False, b'{"model":"\\ud800","block_size":1,"token_ids":[]}'),
    (False, False, b'{"model":"\\ud83d\\ude00","block_size":1,"token_ids":[]}'),
    (False, False, b'{"model":"\xff","block_size":1,"token_ids":[]}'),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[],"x":' + _DEEP + b"}"),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[18446744073709551616]}'),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[-9223372036854775809]}'),
    (False, False, b' {"model":"m","block_size":1,"token_ids":[ 1 , 2 ] } '),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[1,]}'),
    (False, False, b'{"model":"m","block_size":1,"token_ids":[1]} x'),
    (False, False, b""),
    (True, False, b""),
    (True, False, msgspec.msgpack.encode({"model": "m", "block_size": 1.0, "token_ids": [1]})),
    (True, False, _HEAD + b"\xa9token_ids\x91\xc1"),
    (True, False, _HEAD4 + b"\xa9token_ids\x91\x01\xa1x\xc7\x01\x05\x00"),
    (True, False, _HEAD + b"\xa9token_ids\xc4\x03\x01\x02\x03"),
    (True, False, _HEAD4 + b"\xa9token_ids\x91\x01\xa9token_ids\x91\x02"),
    (True, False, b"\x83\xa5model\xa2\xff\xfe\xaablock_size\x01\xa9token_ids\x90"),
    (True, False, _HEAD4 + b"\xa9token_ids\x90\x01\x02"),
    (True, True, msgspec.msgpack.encode(["m", 1, [2**64 - 1], None, ""])),
    (True, True, msgspec.msgpack.encode(["m", 1, [-1]])),
    (True, False, msgspec.msgpack.encode(["m", 0, [1]])),
    (True, True, msgspec.msgpack.encode(["m", 0, [1]])),
    (True, True, msgspec.msgpack.encode({"model": "m", "block_hashes": [1]})),
    (True, False, msgspec.msgpack.encode({"model": "m", "token_ids": [1]})),
] + [
    (
        True,
        False,
        msgspec.msgpack.encode(
            {"model": "m", "block_size": 1, "token_ids": struct.pack(f"<{n}I", *range(n))}
        ),
    )
    for n in (0, 1, 3)
]


def test_edge_bodies_match_the_oracle():
    for msgpack, by_hash, body in _EDGE_BODIES:
        _assert_same(body, msgpack, by_hash)
