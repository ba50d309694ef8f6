"""One declaration per shape: the C tables and the Python twins are tied to kvconductor.schema."""
from __future__ import annotations

import msgspec

from kvconductor import _encode, _wire, schema, wire
from kvconductor.index import DpHit, QueryResult

HITS = [DpHit("a", 0, 1, 2, 3), DpHit("a", 1, 0, 0, 1), DpHit("b", 7, 4, 0, 0)]


def test_c_request_field_table_is_the_schema():
    table = _wire._field_table()
    assert {name for _, name, _ in table} == set(schema.QUERY_FIELDS) | set(schema.QUERY_BY_HASH_FIELDS)
    for fid, name, back in table:
        assert back == fid, name
    assert len({fid for fid, _, _ in table}) == len(table)


def test_oracle_structs_are_the_schema():
    assert wire._TokensMap.__struct_fields__ == schema.QUERY_FIELDS
    assert wire._TokensArray.__struct_fields__ == schema.QUERY_FIELDS
    assert set(wire._HashesMap.__struct_fields__) == set(schema.QUERY_BY_HASH_FIELDS)
    assert wire._HashesArray.__struct_fields__ == schema.QUERY_BY_HASH_FIELDS


def test_positional_order_is_the_schema_order():
    for by_hash, names in ((False, schema.QUERY_FIELDS), (True, schema.QUERY_BY_HASH_FIELDS)):
        row = {"model": "m", "block_size": 2, "token_ids": [5], "block_hashes": [5],
               "tenant_id": "t", "lora_name": "l"}
        body = msgspec.msgpack.encode([row[n] for n in names])
        assert _wire.parse_query(body, True, by_hash) == \
            wire.py_parse_query(msgspec.msgpack.encode(row), True, by_hash)


def test_encoded_response_keys_are_the_schema():
    for mp in (False, True):
        decode = msgspec.msgpack.decode if mp else msgspec.json.decode
        for encode in (_encode.encode_result, wire.py_encode_result):
            doc = decode(encode(HITS, "t", 16, mp))
            assert list(doc) == ["t"]
            for inst in doc["t"].values():
                assert tuple(inst) == schema.INSTANCE_MATCH_KEYS
                for dp in inst["DP"].values():
                    assert tuple(dp) == schema.DP_MATCH_KEYS
            msgspec.convert(doc, schema.QueryResponse)
        for encode in (_encode.encode_error, wire.py_encode_error):
            assert tuple(decode(encode("x", mp))) == (schema.ERROR_KEY,)
    assert tuple(QueryResult(HITS).to_dict("t", 16)["t"]["a"]) == schema.INSTANCE_MATCH_KEYS
