"""HTTP bodies (kvconductor.schema) and the query wire format (kvconductor.wire).

Wire tests run against the msgspec fallback and, when it is built, the
compiled ``kvconductor._wire``; both must give identical results.
"""

from __future__ import annotations

from array import array

import msgspec
import pytest

from kvconductor import _encode, _wire, wire
from kvconductor.index import DpHit, QueryResult
from kvconductor.schema import (
    KvEventBatch,
    QueryRequest,
    RegisterRequest,
    UnregisterRequest,
    WireValueError,
    events_decoder,
    register_decoder,
    to_u64,
    unregister_decoder,
)

PARSERS = [pytest.param(wire.py_parse_query, id="py"), pytest.param(_wire.parse_query, id="c")]
ENCODERS = [
    pytest.param(wire.py_encode_result, id="py"),
    pytest.param(_encode.encode_result, id="c"),
]

U64_MAX = 2**64 - 1


# -- register / unregister -------------------------------------------------------------


def test_register_defaults():
    req = register_decoder.decode(
        b'{"instance_id":"vllm-prefill-1","type":"vLLM","modelname":"qwen",'
        b'"block_size":128,"dp_rank":0}'
    )
    assert req == RegisterRequest(
        instance_id="vllm-prefill-1",
        engine_type="vLLM",
        modelname="qwen",
        block_size=128,
        dp_rank=0,
    )
    assert req.store_backend == "Mooncake"
    assert req.tenant_id == "default"
    assert req.medium_endpoints is None and req.endpoint is None
    assert req.replay_endpoint is None and req.node_id is None


def test_register_full_example_of_the_contract():
    req = register_decoder.decode(
        b'{"instance_id":"vllm-prefill-1","type":"vLLM","store_backend":"Mooncake",'
        b'"modelname":"qwen","block_size":128,"dp_rank":0,'
        b'"medium_endpoints":{"npu":"tcp://10.0.0.1:5557"},'
        b'"replay_endpoint":"tcp://10.0.0.1:6667","unknown_field":1}'
    )
    assert req.medium_endpoints == {"npu": "tcp://10.0.0.1:5557"}
    assert req.replay_endpoint == "tcp://10.0.0.1:6667"


@pytest.mark.parametrize(
    "body,needle",
    [
        (b'{"type":"vLLM","modelname":"q","block_size":4,"dp_rank":0}', "instance_id"),
        (b'{"instance_id":"a","modelname":"q","block_size":4,"dp_rank":0}', "type"),
        (b'{"instance_id":"a","type":"v","block_size":4,"dp_rank":0}', "modelname"),
        (b'{"instance_id":"a","type":"v","modelname":"q","dp_rank":0}', "block_size"),
        (b'{"instance_id":"a","type":"v","modelname":"q","block_size":4}', "dp_rank"),
        (
            b'{"instance_id":"a","type":"v","modelname":"q","block_size":0,"dp_rank":0}',
            "block_size",
        ),
        (
            b'{"instance_id":"a","type":"v","modelname":"q","block_size":-4,"dp_rank":0}',
            "block_size",
        ),
        (b'{"instance_id":"a","type":"v","modelname":"q","block_size":4,"dp_rank":-1}', "dp_rank"),
        (
            b'{"instance_id":"a","type":"v","modelname":"q","block_size":4,"dp_rank":4294967296}',
            "dp_rank",
        ),
        (
            b'{"instance_id":"a","type":"v","modelname":"q","block_size":"4","dp_rank":0}',
            "block_size",
        ),
        (b'{"instance_id":1,"type":"v","modelname":"q","block_size":4,"dp_rank":0}', "instance_id"),
        (
            b'{"instance_id":"a","type":"v","modelname":"q","block_size":4,"dp_rank":0,'
            b'"medium_endpoints":{"npu":1}}',
            "medium_endpoints",
        ),
    ],
)
def test_register_rejects_bad_fields(body, needle):
    with pytest.raises(msgspec.ValidationError, match=needle):
        register_decoder.decode(body)


def test_register_accepts_null_defaults():
    req = register_decoder.decode(
        b'{"instance_id":"a","type":"v","modelname":"q","block_size":4,"dp_rank":0,'
        b'"store_backend":null,"tenant_id":null,"medium_endpoints":null,"endpoint":null}'
    )
    assert req.store_backend is None and req.tenant_id is None


def test_unregister_requires_every_field_but_tenant():
    full = b'{"instance_id":"a","type":"vLLM","modelname":"q","block_size":0,"dp_rank":3}'
    req = unregister_decoder.decode(full)
    assert req == UnregisterRequest(
        instance_id="a",
        engine_type="vLLM",
        modelname="q",
        block_size=0,
        dp_rank=3,
        tenant_id="default",
    )
    for field in ("type", "modelname", "block_size", "dp_rank", "instance_id"):
        doc = msgspec.json.decode(full)
        del doc[field]
        with pytest.raises(msgspec.ValidationError, match=field):
            unregister_decoder.decode(msgspec.json.encode(doc))


# -- events -------------------------------------------------------------------------------


def test_events_batch_flat_shape_and_aliases():
    batch = events_decoder.decode(
        b'{"instance_id":"i","events":[{"event_id":1,"dp_rank":2,"type":"BlockStored",'
        b'"block_hashes":[100,200],"parent_block_hash":18446744073709551615,'
        b'"token_ids":[1,2,3,4,5,6,7,8],"block_size":4,"medium":"GPU"}]}'
    )
    assert batch.model_name is None and batch.tenant_id is None
    assert batch.block_size == 128 and batch.shutdown is False
    (ev,) = batch.events
    assert ev.kind_name() == "BlockStored"
    assert ev.parent() == U64_MAX
    assert ev.dp_rank == 2 and ev.block_size == 4 and ev.medium == "GPU"


def test_events_parent_negative_i64_is_twos_complement():
    batch = events_decoder.decode(
        b'{"instance_id":"i","events":[{"event_id":1,"type":"stored","parent_hash":-1}]}'
    )
    assert batch.events[0].parent() == U64_MAX


def test_events_event_id_required():
    with pytest.raises(msgspec.ValidationError, match="event_id"):
        events_decoder.decode(b'{"instance_id":"i","events":[{"type":"stored"}]}')


def test_events_instance_id_required():
    with pytest.raises(msgspec.ValidationError, match="instance_id"):
        events_decoder.decode(b'{"events":[]}')


def test_events_defaults():
    batch = events_decoder.decode(b'{"instance_id":"i"}')
    assert batch == KvEventBatch(instance_id="i")
    assert batch.events is None


def test_to_u64_ranges():
    assert to_u64(0, "h") == 0
    assert to_u64(U64_MAX, "h") == U64_MAX
    assert to_u64(-1, "h") == U64_MAX
    assert to_u64(-(2**63), "h") == 2**63
    with pytest.raises(WireValueError):
        to_u64(2**64, "h")
    with pytest.raises(WireValueError):
        to_u64(-(2**63) - 1, "h")


# -- content negotiation (the reference's test_is_msgpack_content_type) ------------------------


@pytest.mark.parametrize(
    "ct,expected",
    [
        ("application/msgpack", True),
        ("application/x-msgpack", True),
        ("application/msgpack; charset=utf-8", True),
        ("Application/MSGPACK", True),
        ("  application/x-msgpack ;q=1", True),
        ("application/json", False),
        (None, False),
        ("", False),
        ("text/plain", False),
    ],
)
def test_is_msgpack_content_type(ct, expected):
    assert wire.is_msgpack_content_type(ct) is expected


# -- parse_query ---------------------------------------------------------------------------


@pytest.mark.parametrize("parse", PARSERS)
def test_parse_json_query(parse):
    body = b'{"model":"qwen","block_size":128,"token_ids":[1,2,3,4],"tenant_id":"t"}'
    model, bs, tenant, values, lora = parse(body, False, False)
    assert (model, bs, tenant, lora) == ("qwen", 128, "t", None)
    assert isinstance(values, array) and values.typecode == "I"
    assert list(values) == [1, 2, 3, 4]


@pytest.mark.parametrize("parse", PARSERS)
def test_parse_tokens_truncate_to_u32(parse):
    body = (
        b'{"model":"m","block_size":4,"token_ids":[-1,4294967296,4294967297,'
        b"-9223372036854775808,9223372036854775807]}"
    )
    _, _, tenant, values, _ = parse(body, False, False)
    assert tenant == "default"
    assert list(values) == [0xFFFFFFFF, 0, 1, 0, 0xFFFFFFFF]


@pytest.mark.parametrize("parse", PARSERS)
def test_parse_msgpack_map_and_positional_array(parse):
    tokens = list(range(100_000))
    as_map = msgspec.msgpack.encode({"model": "m", "block_size": 4, "token_ids": tokens})
    as_array = msgspec.msgpack.encode(["m", 4, tokens, "default"])
    short_array = msgspec.msgpack.encode(["m", 4, tokens])
    for body in (as_map, as_array, short_array):
        model, bs, tenant, values, _ = parse(body, True, False)
        assert (model, bs, tenant) == ("m", 4, "default")
        assert values == array("I", tokens)


@pytest.mark.parametrize("parse", PARSERS)
def test_parse_msgpack_packed_tokens(parse):
    tokens = array("I", [1, 2, 3, 0xFFFFFFFF])
    body = msgspec.msgpack.encode(
        {"model": "m", "block_size": 4, "token_ids": tokens.tobytes(), "tenant_id": "x"}
    )
    assert parse(body, True, False) == ("m", 4, "x", tokens, None)


@pytest.mark.parametrize("parse", PARSERS)
def test_parse_query_by_hash_roundtrip(parse):
    hashes = [(i * 0x9E3779B97F4A7C15) & U64_MAX for i in range(10_000)]
    body = msgspec.msgpack.encode({"model": "m", "block_size": 0, "block_hashes": hashes})
    model, bs, tenant, values, _ = parse(body, True, True)
    assert values.typecode == "Q" and list(values) == hashes
    jbody = msgspec.json.encode({"model": "m", "block_size": 7, "block_hashes": hashes})
    assert parse(jbody, False, True)[3] == values


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize(
    "msgpack,body",
    [
        (False, b""),
        (False, b"{"),
        (False, b"not json"),
        (False, b'{"model":"m","block_size":4}'),
        (False, b'{"block_size":4,"token_ids":[]}'),
        (False, b'{"model":"m","token_ids":[]}'),
        (False, b'{"model":"m","block_size":4,"token_ids":[1,"x"]}'),
        (False, b'{"model":"m","block_size":4,"token_ids":[1.5]}'),
        (False, b'{"model":"m","block_size":4,"token_ids":"abc"}'),
        (False, b'{"model":"m","block_size":-1,"token_ids":[]}'),
        (False, b'{"model":"m","block_size":4294967296,"token_ids":[]}'),
        (False, b'{"model":"m","block_size":4,"token_ids":[9223372036854775808]}'),
        (False, b'{"model":"m","block_size":4,"token_ids":[-9223372036854775809]}'),
        (False, b'{"model":5,"block_size":4,"token_ids":[]}'),
        (False, b'{"model":"m","block_size":4,"token_ids":[]} trailing'),
        (True, b"\xc1\xff\x00"),
        (True, b""),
        (True, msgspec.msgpack.encode({"model": "m", "block_size": 4})),
        (True, msgspec.msgpack.encode({"model": "m", "block_size": 4, "token_ids": b"abc"})),
        (True, msgspec.msgpack.encode({"model": "m", "block_size": 4, "token_ids": ["x"]})),
        (True, msgspec.msgpack.encode(["m"])),
        (True, msgspec.msgpack.encode(5)),
    ],
)
def test_parse_rejects_malformed(parse, msgpack, body):
    with pytest.raises(ValueError):
        parse(body, msgpack, False)


@pytest.mark.parametrize("parse", PARSERS)
def test_parse_rejects_negative_hash(parse):
    with pytest.raises(ValueError):
        parse(b'{"model":"m","block_size":1,"block_hashes":[-1]}', False, True)


def test_parse_query_wrapper_raises_wire_error_and_checks_block_size():
    with pytest.raises(wire.WireError):
        wire.parse_query(b"\xc1\xff\x00", True, False)
    with pytest.raises(wire.WireError, match="block_size must be >= 1"):
        wire.parse_query(b'{"model":"m","block_size":0,"token_ids":[1]}', False, False)
    # /query_by_hash ignores block_size: 0 and absent are fine there.
    assert wire.parse_query(b'{"model":"m","block_size":0,"block_hashes":[1]}', False, True)[1] == 0
    assert wire.parse_query(b'{"model":"m","block_hashes":[1]}', False, True)[1] == 0


def test_parse_twins_agree_on_valid_bodies():
    bodies = [
        (False, False, b'{"model":"m","block_size":4,"token_ids":[]}'),
        (False, False, b' {"tenant_id":"t","token_ids":[5,-5],"block_size":2,"model":"\\u00e9"} '),
        (True, False, msgspec.msgpack.encode(["m", 1, [1, 2, 3], "t"])),
        (True, False, msgspec.msgpack.encode(["m", 1, [1], None])),
        (True, False, msgspec.msgpack.encode(["m", 1, [1], None, "lora-a", {"x": 1}])),
        (
            True,
            False,
            msgspec.msgpack.encode(
                {"model": "m", "block_size": 1, "token_ids": [1], "lora_name": "é"}
            ),
        ),
        (False, False, b'{"model":"m","block_size":4,"token_ids":[1],"lora_name":"a\\u00e9"}'),
        (False, False, b'{"model":"m","block_size":4,"token_ids":[1],"lora_name":""}'),
        (False, False, b'{"model":"m","block_size":4,"token_ids":[1],"tenant_id":null}'),
        (
            False,
            False,
            b'{"model":"m","x":{"y":[1e400,99999999999999999999]},"block_size":4,"token_ids":[-0]}',
        ),
        (
            True,
            True,
            msgspec.msgpack.encode({"model": "m", "block_size": 1, "block_hashes": [0, U64_MAX]}),
        ),
    ]
    for msgpack, by_hash, body in bodies:
        assert _wire.parse_query(body, msgpack, by_hash) == wire.py_parse_query(
            body, msgpack, by_hash
        )


# -- encode_result / encode_error -----------------------------------------------------------

HITS = [
    DpHit("vllm-prefill-1", 0, 3, 2, 0),
    DpHit("vllm-prefill-1", 1, 1, 0, 4),
    DpHit("vllm-union-2", 0, 0, 1, 0),
]


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_result_matches_to_dict(encode):
    expected = QueryResult(HITS).to_dict("default", 128)
    assert msgspec.json.decode(encode(HITS, "default", 128, False)) == expected
    assert msgspec.msgpack.decode(encode(HITS, "default", 128, True)) == expected
    assert expected["default"]["vllm-prefill-1"] == {
        "longest_matched": 640,
        "DP": {
            "0": {"matched_tokens": 640, "npu_blocks": 3, "cpu_blocks": 2, "disk_blocks": 0},
            "1": {"matched_tokens": 640, "npu_blocks": 1, "cpu_blocks": 0, "disk_blocks": 4},
        },
    }


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_result_bytes_equal_msgspec(encode):
    doc = QueryResult(HITS).to_dict("t", 4)
    assert encode(HITS, "t", 4, False) == msgspec.json.encode(doc)
    assert encode(HITS, "t", 4, True) == msgspec.msgpack.encode(doc)


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_empty_result(encode):
    assert msgspec.json.decode(encode([], "default", 4, False)) == {"default": {}}
    assert encode([], "default", 4, True) == b"\x81\xa7default\x80"


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_msgpack_uses_smallest_ints(encode):
    data = encode([DpHit("i", 0, 1, 0, 0)], "d", 200, True)
    assert b"\xcc\xc8" in data  # 200 as uint8
    data = encode([DpHit("i", 0, 5, 0, 0)], "d", 1, True)
    assert b"\xcc" not in data and b"\xcd" not in data  # positive fixint only


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_saturates_u32(encode):
    doc = msgspec.json.decode(encode([DpHit("i", 0, 2**31, 2**31, 0)], "d", 4, False))
    assert doc["d"]["i"]["DP"]["0"]["matched_tokens"] == 0xFFFFFFFF


def test_encode_error():
    for encode in (wire.encode_error, wire.py_encode_error):
        assert msgspec.json.decode(encode("boom", False)) == {"error": "boom"}
        assert msgspec.msgpack.decode(encode("boom", True)) == {"error": "boom"}
    for mp in (False, True):
        msg = 'boom \u00e9"\n\x01'
        assert _encode.encode_error(msg, mp) == wire.py_encode_error(msg, mp)


def test_query_request_struct_documents_the_shape():
    req = msgspec.json.decode(b'{"model":"q","block_size":4,"token_ids":[1]}', type=QueryRequest)
    assert req.tenant_id == "default"
