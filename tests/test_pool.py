"""Pool event decoding (Mooncake tuple, Memcache map, YuanRong) and FlexHash
(docs/engines.md, "Pool event format")."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from kvconductor.ingest.pool import (
    CLEARED,
    OTHER,
    REMOVED,
    STORED,
    PoolBatch,
    PoolEvent,
    classify,
    decode_pool_payload,
    flex_hash,
)
from kvconductor.ingest.recognize import decode_payload
from kvconductor.ingest.vllm import DecodeError, Dropped, VllmBatch
from kvconductor.schema import NAME_MAX

M64 = (1 << 64) - 1

# a Mooncake master batch (docs/engines.md, "Pool event format"), written as JSON
MOONCAKE_EXAMPLE = json.loads(
    '[1782281033484, [{"event_id":7,"event_type":"stored",'
    '"backend_id":"10.0.0.1","medium":"cpu","seq_hashes":[48879,51966]}], 0]'
)


def test_flex_hash_rules():
    assert flex_hash(0) == 0 and flex_hash(M64) == M64
    assert flex_hash(-1) == M64  # two's complement (the reference: an error)
    assert flex_hash("0xBEEF") == 0xBEEF and flex_hash("  48879 ") == 48879
    assert flex_hash("beef") == 0xBEEF
    assert flex_hash(b"\x01\x00") == 256 and flex_hash(b"") == 0
    assert flex_hash(b"\xff" * 8) == M64
    with pytest.raises(ValueError, match="too long"):
        flex_hash(b"\x00" * 9)
    with pytest.raises(ValueError, match="expected u64, hex, or 0x-prefixed"):
        flex_hash("nothex!")
    for bad in (None, 1.0, True, [1]):
        with pytest.raises(TypeError):
            flex_hash(bad)


def test_classify():
    assert classify("stored") == STORED and classify("BlockStored") == STORED
    assert classify("removed") == REMOVED and classify("KeyRemoved") == REMOVED
    assert classify("cleared") == CLEARED and classify("AllBlocksCleared") == CLEARED
    assert classify("updated") == OTHER and classify("unknown") == OTHER


def test_mooncake_tuple_example():
    payload = msgspec.msgpack.encode(MOONCAKE_EXAMPLE)
    b = decode_payload(payload)
    assert isinstance(b, PoolBatch) and b.layout == "tuple" and b.dp_rank == 0
    (ev,) = b.events
    assert isinstance(ev, PoolEvent)
    assert ev.kind == STORED and ev.backend_id == "10.0.0.1" and ev.medium == "cpu"
    assert ev.hashes == [48879, 51966] and ev.event_id == 7 and ev.dp_rank is None


def test_memcache_map_and_defaults():
    payload = msgspec.msgpack.encode(
        {
            "events": [
                {
                    "event_type": "removed",
                    "backend_id": "10.0.0.2",
                    "seq_hashes": ["0xff", "255", 7],
                    "block_hashes": [7, 8],
                    "model_name": "m",
                    "tenant_id": "t",
                    "dp_rank": 3,
                },
                {"type": "cleared"},
                {"timestamp": None},
            ]
        }
    )
    b = decode_payload(payload)
    assert b.layout == "memcache"
    e1, e2, e3 = b.events
    assert e1.kind == REMOVED and e1.hashes == [255, 7, 8]  # de-duplicated, first kept
    assert (e1.model_name, e1.tenant_id, e1.dp_rank) == ("m", "t", 3)
    assert e2.kind == CLEARED and e2.type_str == "cleared"
    assert e3.kind == OTHER and e3.type_str == "unknown"
    assert decode_payload(msgspec.msgpack.encode({})).events == []
    assert decode_payload(msgspec.msgpack.encode({"events": None})).events == []


def test_bad_hash_drops_only_that_event():
    payload = msgspec.msgpack.encode(
        [
            1,
            [
                {"event_type": "stored", "seq_hashes": [1, -2]},  # negative: fine
                {"event_type": "stored", "seq_hashes": [1, b"\x00" * 9]},  # too long
                {"event_type": "stored", "seq_hashes": ["zz"]},  # not a hash
                {"event_type": "stored", "seq_hashes": 5},  # not a list
                {"event_type": 5},  # wrong type
                {"event_type": "stored", "dp_rank": -1, "seq_hashes": [1]},  # bad dp
                "not-a-map",
                {"event_type": "stored", "block_hashes": [3]},
            ],
            0,
        ]
    )
    evs = decode_payload(payload).events
    reasons = [e.reason if isinstance(e, Dropped) else e.kind for e in evs]
    assert reasons == [
        STORED,
        "bad_hash",
        "bad_hash",
        "invalid_event",
        "invalid_event",
        "invalid_event",
        "invalid_event",
        STORED,
    ]
    assert evs[0].hashes == [1, M64 - 1]


def test_overlong_names_drop_only_that_event():
    """A pool event's strings are ids and names: at most NAME_MAX characters (a model
    name would create an index under it)."""
    ok = "m" * NAME_MAX
    payload = msgspec.msgpack.encode(
        [
            1,
            [
                {"event_type": "stored", "seq_hashes": [1], "model_name": ok, "tenant_id": ok},
                {"event_type": "stored", "seq_hashes": [1], "model_name": ok + "m"},
                {"event_type": "stored", "seq_hashes": [1], "tenant_id": ok + "t"},
                {"event_type": "stored", "seq_hashes": [1], "backend_id": ok + "b"},
                {"event_type": "stored", "seq_hashes": [1], "medium": ok + "c"},
            ],
            0,
        ]
    )
    evs = decode_payload(payload).events
    assert evs[0].model_name == ok and evs[0].tenant_id == ok
    assert [(e.reason, e.detail) for e in evs[1:]] == [
        ("invalid_event", f"{key} is longer than {NAME_MAX} characters")
        for key in ("model_name", "tenant_id", "backend_id", "medium")
    ]


def test_dispatch_vllm_vs_pool():
    # vLLM map events (type tag, no pool keys) stay vLLM even with an int ts
    vl = msgspec.msgpack.encode([1700000000, [{"type": "BlockRemoved", "block_hashes": [1]}], 0])
    assert isinstance(decode_payload(vl), VllmBatch)
    # pool maps with a legacy "type" and pool keys are pool events
    pl = msgspec.msgpack.encode(
        [17, [{"type": "BlockStored", "seq_hashes": [1], "backend_id": "x"}], 0]
    )
    assert isinstance(decode_payload(pl), PoolBatch)
    # a legacy pool "type" that is not a vLLM tag
    pl = msgspec.msgpack.encode([17, [{"type": "stored", "block_hashes": [1]}]])
    b = decode_payload(pl)
    assert isinstance(b, PoolBatch) and b.events[0].kind == STORED and b.dp_rank is None
    # an empty event list is harmless either way
    assert decode_payload(msgspec.msgpack.encode([17, [], 0])).events == []


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode("x"),
        msgspec.msgpack.encode([1]),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"events": 5}),
        msgspec.msgpack.encode([1, [{"event_type": "stored"}], "dp"]),
    ],
)
def test_bad_containers(payload):
    with pytest.raises(DecodeError):
        decode_payload(payload)


def test_fuzz_pool():
    rng = random.Random(7)
    base = [
        msgspec.msgpack.encode(MOONCAKE_EXAMPLE),
        msgspec.msgpack.encode({"events": MOONCAKE_EXAMPLE[1]}),
    ]
    for i in range(3000):
        b = bytearray(rng.choice(base))
        if i % 3 == 0:
            data = bytes(b[: rng.randrange(len(b))])
        elif i % 3 == 1:
            b[rng.randrange(len(b))] = rng.getrandbits(8)
            data = bytes(b)
        else:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40)))
        try:
            out = decode_pool_payload(data)
        except DecodeError:
            continue
        for e in out.events:
            assert isinstance(e, (PoolEvent, Dropped))


@pytest.mark.parametrize("bad", ["a\nb", "nul\x00", "\x1b[31mred", "del\x7f", "c1\x85"])
def test_a_name_with_a_control_character_drops_only_that_event(bad):
    """Control characters (NUL, newline, ESC, DEL, C1) are refused in a pool event's ids and
    names, as on the HTTP routes: they would forge or garble a log line."""
    payload = msgspec.msgpack.encode(
        [
            1,
            [
                {"event_type": "stored", "seq_hashes": [1], "backend_id": "10.0.0.1"},
                {"event_type": "stored", "seq_hashes": [1], "model_name": bad},
                {"event_type": "stored", "seq_hashes": [1], "tenant_id": bad},
                {"event_type": "stored", "seq_hashes": [1], "backend_id": bad},
                {"event_type": "stored", "seq_hashes": [1], "medium": bad},
                {"event_type": bad, "seq_hashes": [1]},
            ],
            0,
        ]
    )
    evs = decode_payload(payload).events
    assert evs[0].backend_id == "10.0.0.1"
    assert [(e.reason, e.detail) for e in evs[1:]] == [
        ("invalid_event", f"{key} holds a control character")
        for key in ("model_name", "tenant_id", "backend_id", "medium", "event_type")
    ]
