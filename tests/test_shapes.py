"""One declaration per shape: the C tables and the Python twins are tied to kvconductor.schema."""

from __future__ import annotations

import msgspec

from kvconductor import _encode, _wire, schema, wire
from kvconductor.index import DpHit, QueryResult

HITS = [DpHit("a", 0, 1, 2, 3), DpHit("a", 1, 0, 0, 1), DpHit("b", 7, 4, 0, 0)]


def test_c_request_field_table_is_the_schema():
    table = _wire._field_table()
    names = set(schema.QUERY_FIELDS) | set(schema.QUERY_BY_HASH_FIELDS)
    assert {name for _, name, _ in table} == names
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
        row = {
            "model": "m",
            "block_size": 2,
            "token_ids": [5],
            "block_hashes": [5],
            "tenant_id": "t",
            "lora_name": "l",
            "top_k": 3,
            "instances": ["a", "b"],
            "freshness": True,
            "cache_salt": "s",
            "mm_inputs": [{"identifier": "i", "offset": 0, "length": 1}],
        }
        body = msgspec.msgpack.encode([row[n] for n in names])
        for ext in (False, True):
            got = _wire.parse_query(body, True, by_hash, ext)
            assert got == wire.py_parse_query(msgspec.msgpack.encode(row), True, by_hash, ext)
            assert got[5:] == ((3, ["a", "b"], True, True) if ext else ())
        ext = wire.parse_query_ext(body, True, by_hash)  # the extra keys read from position
        assert ext[8] == ("s", (("i", 0, 1),))


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


# ---------------------------------------------------------------------------------------
# the ingest fast path's C tables and their Python twins
# ---------------------------------------------------------------------------------------


def test_hbm_media_are_the_npu_aliases_of_keys():
    from kvconductor import _ingest, keys

    assert set(_ingest.HBM_MEDIA) == {k for k, m in keys._MEDIA.items() if m is keys.Medium.NPU}
    assert len(set(_ingest.HBM_MEDIA)) == len(_ingest.HBM_MEDIA)


def test_rejected_kinds_are_apply_s():
    from kvconductor import _ingest
    from kvconductor.ingest import apply

    assert frozenset(_ingest.REJECTED_KINDS) == apply.REJECTED_KINDS
    assert len(set(_ingest.REJECTED_KINDS)) == len(_ingest.REJECTED_KINDS)


def test_vllm_positions_and_keys_are_the_decoder_structs():
    from kvconductor import _ingest
    from kvconductor.ingest import recognize, vllm

    stored = vllm._AStored.__struct_fields__
    assert len(_ingest.STORED_POSITIONS) == len(stored)
    for c_name, py_name in zip(_ingest.STORED_POSITIONS, stored, strict=True):
        assert c_name == py_name, py_name
    assert vllm._ARemoved.__struct_fields__ == _ingest.REMOVED_POSITIONS
    pool = set(recognize._POOL_KEYS)
    assert set(_ingest.POOL_KEYS) == pool
    declined = set(_ingest.DECLINED_KEYS)
    assert declined <= set(vllm._MStored.__struct_fields__)
    assert set(_ingest.STORED_KEYS) == (
        {"type"} | set(vllm._MStored.__struct_fields__) - pool - declined
    )
    assert set(_ingest.REMOVED_KEYS) == {"type"} | set(vllm._MRemoved.__struct_fields__) - pool
    assert set(_ingest.CLEARED_KEYS) == {"type"} | set(vllm._MCleared.__struct_fields__)
    # the length-switch of _fid recognises exactly the names of the table
    names = set(_ingest.STORED_KEYS) | set(_ingest.REMOVED_KEYS)
    ids = {n: _ingest._fid_of(n) for n in names}
    assert len(set(ids.values())) == len(names)
    assert len({_ingest._fid_of(k) for k in pool}) == 1
    assert _ingest._fid_of(next(iter(pool))) not in ids.values()
    assert len({_ingest._fid_of(k) for k in declined}) == 1
    assert _ingest._fid_of(next(iter(declined))) not in {*ids.values(), _ingest._fid_of("nope")}
    skip = _ingest._fid_of("nope")
    assert "extra_keys" in ids and "cache_salt" in ids
    assert skip not in ids.values()


def test_default_tenant_is_the_schema_s_everywhere():
    """The affinity ranking spells the default tenant itself (it stays free of msgspec)."""
    import inspect

    from kvconductor.coordinator import affinity
    from kvconductor.coordinator.core import TENANT_ID

    assert schema.DEFAULT_TENANT == "default"
    assert inspect.signature(affinity.rank).parameters["tenant_id"].default == (
        schema.DEFAULT_TENANT
    )
    assert TENANT_ID == schema.DEFAULT_TENANT
    assert schema.QueryRequest(model="m", block_size=1, token_ids=[]).tenant_id == "default"
