"""kvconductor.http.fields: a registration's unknown fields, named once per (instance, field)."""

from __future__ import annotations

import logging

import msgspec

from kvconductor.http.fields import NAMED, UnknownFieldWarnings, unknown_fields
from kvconductor.schema import RegisterRequest
from kvconductor.schema_mooncake import MooncakeRegisterRequest

BODY = {"instance_id": "a", "type": "vLLM", "modelname": "m", "block_size": 4, "dp_rank": 0}


def test_unknown_fields_by_wire_name_in_both_encodings():
    body = {**BODY, "store_onyl": True, "ttl": 5, "tenant_id": None}
    assert unknown_fields(msgspec.json.encode(body), False, RegisterRequest) == [
        "store_onyl",
        "ttl",
    ]
    # "type" is RegisterRequest's engine_type by its wire name: known
    assert unknown_fields(msgspec.json.encode(BODY), False, RegisterRequest) == []
    mc = {**BODY, "endpoint": "tcp://h:1", "lora_idd": 1}
    assert unknown_fields(msgspec.msgpack.encode(mc), True, MooncakeRegisterRequest) == ["lora_idd"]


def test_each_pair_is_named_once_and_the_memory_is_bounded(caplog):
    w = UnknownFieldWarnings(logging.getLogger("kvconductor.test_fields"), "registration", 3)
    with caplog.at_level(logging.WARNING, "kvconductor.test_fields"):
        assert w.warn("a", ["x", "y"]) == ["x", "y"]
        assert w.warn("a", ["x", "y"]) == []
        assert w.warn("b", ["x"]) == ["x"]
        assert w.warn("a", []) == []
        # a fourth pair forgets the oldest, ("a", "x"), which is named again
        assert w.warn("c", ["z"]) == ["z"]
        assert len(w._seen) == 3
        assert w.warn("a", ["x"]) == ["x"]
    assert [r.getMessage() for r in caplog.records] == [
        "registration: fields ignored: x, y (instance_id=a; not fields of a registration: "
        "their defaults apply)",
        "registration: fields ignored: x (instance_id=b; not fields of a registration: "
        "their defaults apply)",
        "registration: fields ignored: z (instance_id=c; not fields of a registration: "
        "their defaults apply)",
        "registration: fields ignored: x (instance_id=a; not fields of a registration: "
        "their defaults apply)",
    ]


def test_one_line_names_at_most_named_fields(caplog):
    w = UnknownFieldWarnings(logging.getLogger("kvconductor.test_fields"), "registration")
    names = [f"f{i:03d}" for i in range(NAMED + 5)]
    with caplog.at_level(logging.WARNING, "kvconductor.test_fields"):
        assert len(w.warn("a", names + ["x" * 500])) == NAMED + 6
    (rec,) = caplog.records
    assert f"f{NAMED - 1:03d} and 6 more (instance_id=a;" in rec.getMessage()
