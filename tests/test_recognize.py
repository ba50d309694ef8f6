"""kvconductor.ingest.recognize: the compiled reader of an array payload's kind against
its Python twin, and the route (recognise, then decode once) against the Python reader
alone, over well-formed, odd and mutated payloads."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvconductor._ingest import (
    PAYLOAD_POOL,
    PAYLOAD_UNSURE,
    PAYLOAD_VLLM,
    PAYLOAD_VLLM_TAG,
    array_payload_kind,
)
from kvconductor.ingest import recognize as rz
from kvconductor.ingest.ops import DecodeError
from tests.helpers.payloads import EX_A_V033, EX_B_V023, EX_C_V092, EX_E_SGL0516, EX_E_SGL0523
from tests.helpers.publishers import TS, memcache_map, mooncake_tuple

ENC = msgspec.msgpack.Encoder()
STORED = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1, 2, 3, 4], "block_size": 2}


def _key(name: bytes) -> bytes:
    return bytes([0xA0 | len(name)]) + name


def _one_map(*pairs: bytes) -> bytes:
    """``[TS, [{pairs}], 0]`` written by hand (keys msgspec would not write)."""
    return (
        b"\x93\xcb"
        + ENC.encode(TS)[1:]
        + b"\x91"
        + bytes([0x80 | (len(pairs) // 2)])
        + b"".join(pairs)
        + b"\x00"
    )


CORPUS = [
    EX_A_V033,
    EX_B_V023,
    EX_C_V092,
    EX_E_SGL0516,
    EX_E_SGL0523,
    ENC.encode([TS, [STORED], 0]),
    ENC.encode([TS, [STORED]]),
    ENC.encode([TS, 0, [STORED]]),
    ENC.encode([TS, None, [STORED]]),
    ENC.encode([TS, [], 0]),
    ENC.encode([TS, [["BlockStored", [1], None, [1, 2], 2]], 0]),
    ENC.encode([TS, [{"type": "AllBlocksCleared"}], 0]),
    ENC.encode([TS, [{"type": "BlockStored", "event_id": 1}], 0]),
    ENC.encode([TS, [{"type": "Nope"}], 0]),
    ENC.encode([TS, [{"block_hashes": [1]}], 0]),
    ENC.encode([TS, [{"type": b"BlockStored"}], 0]),
    ENC.encode([TS, [{"type": 7}], 0]),
    ENC.encode([TS, [{"type": "BlockStored", "x": msgspec.msgpack.Ext(1, b"")}], 0]),
    ENC.encode([TS, 0, [{"event_type": "stored", "seq_hashes": [1]}]]),
    ENC.encode([TS, [7, STORED], 0]),
    ENC.encode([TS, [{1: 2}], 0]),
    ENC.encode([TS, [STORED], 0, 1]),
    ENC.encode([TS]),
    ENC.encode([TS, "x", 0]),
    mooncake_tuple([{"event_type": "stored", "seq_hashes": [1, 2], "medium": "cpu"}]),
    mooncake_tuple([{"type": "stored", "block_hashes": ["0x10"]}], dp=3),
    mooncake_tuple([{"event_type": "stored", "seq_hashes": [-1, b"123456789"]}]),
    memcache_map([{"event_type": "stored", "seq_hashes": [1]}]),
    # the last "type" of a map counts; non-ASCII keys, valid and invalid UTF-8
    _one_map(_key(b"type"), _key(b"Nope"), _key(b"type"), _key(b"BlockStored")),
    _one_map(_key(b"type"), _key(b"BlockStored"), _key(b"type"), _key(b"Nope")),
    _one_map(_key("é".encode()), b"\x01"),
    _one_map(_key(b"\xff\xfe"), b"\x01"),
    _one_map(_key(b"\xff\xfe"), b"\x01", _key(b"type"), _key(b"BlockStored")),
    _one_map(_key(b"type"), b"\xa2\xff\xfe"),
    _one_map(_key(b"type"), _key(b"BlockStored"), _key(b"deep"), b"\x91" * 40 + b"\xc0"),
]


def _mutants(rng: random.Random, payload: bytes, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        b = bytearray(payload)
        r = rng.random()
        if r < 0.3 and len(b) > 1:
            del b[rng.randrange(1, len(b)) :]
        elif r < 0.6:
            b[rng.randrange(len(b))] = rng.randrange(256)
        else:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        out.append(bytes(b))
    return out


def _all_payloads() -> list[bytes]:
    rng = random.Random(37)
    out = list(CORPUS)
    for p in CORPUS:
        out += _mutants(rng, p, 60)
    return out


def _outcome(payload: bytes) -> object:
    try:
        b = rz.decode_payload(payload)
    except DecodeError as ex:
        return ("error", ex.reason, ex.detail)
    return (type(b).__name__, repr(b.ts), b.dp_rank, b.layout, [repr(e) for e in b.events])


def test_the_compiled_reader_agrees_with_its_twin():
    """Where the compiled reader is sure, the Python reader names the same kind (or the
    envelope is bad, which only the vLLM decoder reports)."""
    sure = 0
    for p in _all_payloads():
        if not p or p[0] not in range(0x90, 0xA0):
            continue
        k = array_payload_kind(p)
        assert k in (PAYLOAD_UNSURE, PAYLOAD_VLLM, PAYLOAD_POOL)
        if k == PAYLOAD_UNSURE:
            continue
        sure += 1
        twin = rz._python_kind(p)
        if twin.parts is None:  # the envelope does not split: an error either way
            with pytest.raises(DecodeError):
                rz.decode_payload(p)
            continue
        assert twin.kind == k, p.hex(" ")
    assert sure > 1000


def test_the_route_decodes_as_the_python_reader_alone(monkeypatch):
    """Recognised in C then decoded once, or recognised and split in Python: the same
    batch, or the same error with the same detail."""
    payloads = _all_payloads()
    routed = [_outcome(p) for p in payloads]
    monkeypatch.setattr(rz, "_array_kind", None)
    for p, got in zip(payloads, routed, strict=True):
        assert _outcome(p) == got, p.hex(" ")


@pytest.mark.parametrize(
    "payload,kind",
    [
        (EX_A_V033, rz.VLLM),
        (ENC.encode([TS, 0, [STORED]]), rz.VLLM),
        (ENC.encode([TS, [["BlockStored", [1]]], 0]), rz.VLLM),
        (mooncake_tuple([{"event_type": "stored", "seq_hashes": [1]}]), rz.POOL),
        (ENC.encode([TS, [{"type": "BlockStored", "event_id": 1}], 0]), rz.POOL),
        (ENC.encode([TS, [{"block_hashes": [1]}], 0]), rz.POOL),
        (memcache_map([]), rz.MEMCACHE),
        (ENC.encode([TS]), rz.VLLM),  # a bad envelope: the vLLM decoder says why
    ],
)
def test_kinds(payload, kind):
    rec = rz.recognize(payload)
    if rec.by_tag:  # the first event's tag read, its rest not: decode() reads it
        assert rec.kind == rz.VLLM
        rec = rz._array(payload, True)
    assert rec.kind == kind and not rec.by_tag


def test_recognition_stops_at_the_tag(monkeypatch):
    """vLLM's map events start with their tag: recognition reads no further; a pool key
    later in that event makes it a pool tuple when decode() reads the rest."""
    monkeypatch.setattr(rz, "_array_kind", array_payload_kind)  # KVCONDUCTOR_IMPL=py too
    assert rz.recognize(EX_A_V033).by_tag
    late = ENC.encode([TS, [{"type": "BlockStored", "event_id": 1, "seq_hashes": [5]}], 0])
    rec = rz.recognize(late)
    assert rec.kind == rz.VLLM and rec.by_tag
    assert type(rz.decode(late, rec)).__name__ == "PoolBatch"
    assert array_payload_kind(late, False) == PAYLOAD_VLLM_TAG
    assert array_payload_kind(late) == PAYLOAD_POOL


@pytest.mark.parametrize("payload,reason", [(b"", "empty_payload"), (ENC.encode(5), "not_a_batch")])
def test_no_kind(payload, reason):
    with pytest.raises(DecodeError) as e:
        rz.recognize(payload)
    assert e.value.reason == reason


def test_a_pool_tuple_is_decoded_once(monkeypatch):
    """The pool decoder gets the events recognition read (no second whole decode)."""
    p = mooncake_tuple([{"event_type": "stored", "seq_hashes": [1, 2]}])
    monkeypatch.setattr(rz, "_array_kind", None)
    rec = rz.recognize(p)
    assert rec.kind == rz.POOL and rec.raw_events is not None
    calls = []
    monkeypatch.setattr(
        "kvconductor.ingest.pool.decode_pool_payload", lambda payload: calls.append(payload)
    )
    batch = rz.decode(p, rec)
    assert not calls and [e.hashes for e in batch.events] == [[1, 2]]
