"""vLLM / SGLang batch decoding against byte-level example payloads of vLLM / SGLang releases."""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest

from kvconductor.ingest.vllm import (
    Cleared,
    DecodeError,
    Dropped,
    Removed,
    Stored,
    decode_event,
    decode_vllm_batch,
    engine_hash,
    parse_hash_str,
)
from tests.helpers.payloads import EX_A_V033, EX_B_V023, EX_C_V092, EX_E_SGL0516, EX_E_SGL0523
from tests.helpers.publishers import H1, H2, TS, hexbytes, schema

NEG5 = (1 << 64) - 5


def _stored_v033(**kw):
    s = schema("vllm", "0.33.0")
    args = {
        "medium": "GPU",
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    args.update(kw)
    return s, s.stored([H1, H2], None, [1, 2, 3, 4], 2, **args)


# --- fixtures are byte-exact ------------------------------------------------------------------


def test_fixture_v033_removed_cleared_bytes():
    s = schema("vllm", "0.33.0")
    b = s.batch([s.removed([H2], medium="GPU", group_idx=0), s.cleared()], dp=1)
    assert b == EX_A_V033 and len(b) == 99


def test_fixture_v033_stored_is_11_key_map_of_200_bytes():
    s, ev = _stored_v033()
    b = s.batch([ev], dp=1)
    assert len(b) == 200
    assert b[11:14] == bytes.fromhex("de000b")


def test_fixture_v023_bytes():
    s = schema("vllm", "0.23.0")
    ev = s.stored(
        [H1, H2],
        None,
        [1, 2, 3, 4],
        2,
        medium="GPU",
        extra_keys=[None, None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    b = s.batch([ev], dp=0)
    assert b == EX_B_V023 and len(b) == 77


def test_fixture_v092_and_v090_bytes():
    s = schema("vllm", "0.9.2")
    assert s.batch([s.stored([H1, H2], None, [1, 2, 3, 4], 2)], dp=0) == EX_C_V092
    s0 = schema("vllm", "0.9.0")
    b = s0.batch([s0.stored([H1, H2], None, [1, 2, 3, 4], 2)])
    assert b == b"\x92" + EX_C_V092[1:-1]
    assert s0.batch([s0.removed([5])])[10:] == hexbytes('91 92 ac "BlockRemoved" 91 05')


def test_fixture_sglang_bytes():
    s = schema("sglang", "0.5.23")
    evs = [
        s.stored([-5], None, [1, 2], 2, medium="GPU"),
        s.removed([-5], medium="GPU"),
        s.cleared(),
    ]
    assert s.batch(evs, dp=0) == EX_E_SGL0523 and len(EX_E_SGL0523) == 177
    s = schema("sglang", "0.5.16")
    evs = [
        s.stored([-5], None, [1, 2], 2, medium="GPU"),
        s.removed([-5], medium="GPU"),
        s.cleared(),
    ]
    assert s.batch(evs, dp=0) == EX_E_SGL0516


# --- decoding the example payloads -------------------------------------------------------------


def test_decode_example_a_v033_map():
    b = decode_vllm_batch(EX_A_V033)
    assert b.ts == TS and b.dp_rank == 1 and b.layout == "ts,events,dp"
    rem, clr = b.events
    assert isinstance(rem, Removed) and list(rem.block_hashes) == [H2]
    assert rem.medium == "GPU" and rem.group_idx == 0
    assert isinstance(clr, Cleared)


def test_decode_example_b_v023_array():
    b = decode_vllm_batch(EX_B_V023)
    assert b.dp_rank == 0 and len(b.events) == 1
    ev = b.events[0]
    assert isinstance(ev, Stored)
    assert list(ev.block_hashes) == [H1, H2] and ev.parent is None
    assert isinstance(ev.tokens, array) and ev.tokens.typecode == "I"
    assert list(ev.tokens) == [1, 2, 3, 4] and ev.block_size == 2
    assert ev.lora_id is None and ev.medium == "GPU" and ev.lora_name is None
    assert ev.group_idx == 0 and ev.kind == "full_attention" and ev.sliding_window is None


def test_decode_example_c_v092_and_v090():
    b = decode_vllm_batch(EX_C_V092)
    ev = b.events[0]
    assert list(ev.block_hashes) == [H1, H2] and list(ev.tokens) == [1, 2, 3, 4]
    assert ev.block_size == 2 and ev.medium is None and ev.kind is None and b.dp_rank == 0
    b0 = decode_vllm_batch(b"\x92" + EX_C_V092[1:-1])
    assert b0.layout == "ts,events" and b0.dp_rank is None
    assert list(b0.events[0].block_hashes) == [H1, H2]


def test_decode_v033_stored_map_all_fields():
    s, ev = _stored_v033(
        lora_name="sql",
        locality="LOCAL",
        ownership="t2",
        session_id="s1",
        lookahead_token_ids=[[9, 9]],
        kv_cache_spec_sliding_window=None,
    )
    b = decode_vllm_batch(s.batch([ev], dp=3))
    e = b.events[0]
    assert isinstance(e, Stored) and b.dp_rank == 3
    assert list(e.block_hashes) == [H1, H2] and list(e.tokens) == [1, 2, 3, 4]
    assert (e.lora_name, e.locality, e.ownership, e.session_id) == ("sql", "LOCAL", "t2", "s1")
    assert e.group_idx == 0 and e.kind == "full_attention"


def test_decode_v033_bytes_hashes_example_d():
    digest1 = bytes(range(32))
    digest2 = bytes(range(100, 132))
    s = schema("vllm", "0.33.0")
    payload = s.batch(
        [
            s.stored(
                [digest1, digest2], bytes(range(50, 82)), [1, 2, 3, 4], 2, medium="GPU", group_idx=0
            )
        ],
        dp=0,
    )
    assert hexbytes('ac "block_hashes" 92 c4 20') + digest1 in payload
    e = decode_vllm_batch(payload).events[0]
    assert list(e.block_hashes) == [
        int.from_bytes(digest1[-8:], "big"),
        int.from_bytes(digest2[-8:], "big"),
    ]
    assert e.parent == int.from_bytes(bytes(range(50, 82))[-8:], "big")
    # 16-byte xxhash digests: the same rule
    e = decode_vllm_batch(s.batch([s.stored([digest1[:16]], None, [1, 2], 2)])).events[0]
    assert list(e.block_hashes) == [int.from_bytes(digest1[8:16], "big")]


def test_bytes_hash_equals_int_form():
    """vLLM's int form is the low 64 bits of the digest = last 8 bytes of the bin form."""
    digest = bytes(range(200, 232))
    assert engine_hash(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)


def test_decode_sglang_map_and_array():
    for payload in (EX_E_SGL0523, EX_E_SGL0516):
        b = decode_vllm_batch(payload)
        st, rm, cl = b.events
        assert isinstance(st, Stored) and list(st.block_hashes) == [NEG5]
        assert list(st.tokens) == [1, 2] and st.block_size == 2 and st.medium == "GPU"
        assert isinstance(rm, Removed) and list(rm.block_hashes) == [NEG5] and rm.medium == "GPU"
        assert isinstance(cl, Cleared)


def test_layout_ts_dp_events():
    payload = msgspec.msgpack.encode([TS, 2, [["BlockRemoved", [7]]]])
    b = decode_vllm_batch(payload)
    assert b.layout == "ts,dp,events" and b.dp_rank == 2
    assert list(b.events[0].block_hashes) == [7]
    b = decode_vllm_batch(msgspec.msgpack.encode([TS, None, []]))
    assert b.layout == "ts,dp,events" and b.events == []
    b = decode_vllm_batch(msgspec.msgpack.encode([1700000000, [], None]))
    assert b.layout == "ts,events,dp" and b.dp_rank is None


def test_array_event_positions_not_types():
    """medium absent but lora_name / kind present: positions decide (the reference assigned
    fields by type and read lora_name as the medium)."""
    ev = ["BlockStored", [1], None, [1, 2], 2, None, None, "my-lora", None, 0, "full_attention"]
    e = decode_event(msgspec.msgpack.encode(ev))
    assert e.medium is None and e.lora_name == "my-lora" and e.kind == "full_attention"
    # trailing fields beyond position 11 are ignored, missing ones default
    ev = [
        "BlockStored",
        [1],
        5,
        [1, 2],
        2,
        3,
        "CPU",
        None,
        [None],
        0,
        "mamba",
        4,
        "LOCAL",
        "x",
        "s",
        [[1]],
    ]
    e = decode_event(msgspec.msgpack.encode(ev))
    assert e.parent == 5 and e.lora_id == 3 and e.medium == "CPU" and e.kind == "mamba"
    assert e.sliding_window == 4
    e = decode_event(msgspec.msgpack.encode(["BlockStored", [1, 2]]))
    assert list(e.block_hashes) == [1, 2] and len(e.tokens) == 0 and e.block_size == 0
    e = decode_event(msgspec.msgpack.encode(["BlockRemoved", [3], "CPU", 1, "REMOTE", "own"]))
    assert list(e.block_hashes) == [3] and e.medium == "CPU" and e.group_idx == 1


def test_hash_forms():
    assert engine_hash(5) == 5
    assert engine_hash(-1) == (1 << 64) - 1
    assert engine_hash(-(1 << 63)) == 1 << 63
    assert engine_hash(b"\x01\x02") == 0x0102
    assert engine_hash(bytes(8) + b"\x00\x00\x00\x00\x00\x00\x00\x09") == 9
    assert engine_hash("0xff") == 255 and engine_hash(" 0XFF ") == 255
    assert engine_hash("123") == 123
    assert engine_hash("abc") == 0xABC
    assert engine_hash("18446744073709551615") == (1 << 64) - 1
    for bad in (None, 1.5, True, "", "xyz", "0x", "-5", "1_0", [1], b""):
        with pytest.raises((TypeError, ValueError)):
            engine_hash(bad)
    assert parse_hash_str("00ff") == 255  # decimal "00ff" fails -> bare hex


def test_hashes_become_u64_arrays_mixed():
    e = decode_event(msgspec.msgpack.encode(["BlockStored", [1, -2, "0x3", b"\x04"], -7, [], 0]))
    assert isinstance(e.block_hashes, array) and e.block_hashes.typecode == "Q"
    assert list(e.block_hashes) == [1, (1 << 64) - 2, 3, 4]
    assert e.parent == (1 << 64) - 7


def test_tokens_truncate_to_u32():
    e = decode_event(msgspec.msgpack.encode(["BlockStored", [1], None, [-1, 4294967296 + 5, 7], 3]))
    assert list(e.tokens) == [0xFFFFFFFF, 5, 7]


def test_bad_events_are_dropped_alone():
    evs = [
        ["BlockStored", [1], None, [1, 2], 2],
        ["BlockStored", [None], None, [1, 2], 2],  # nil hash
        ["BlockStored", [1], None, ["a"], 2],  # bad token
        ["SomethingNew", 1, 2],  # unknown tag
        {"type": "BlockStored", "block_hashes": "nope"},  # wrong type
        {"no_type": 1},
        5,
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        ["AllBlocksCleared", "extra"],
    ]
    b = decode_vllm_batch(msgspec.msgpack.encode([TS, evs, 0]))
    kinds = [type(e).__name__ if not isinstance(e, Dropped) else e.reason for e in b.events]
    assert kinds == [
        "Stored",
        "bad_hash",
        "invalid_event",
        "unknown_event_type",
        "invalid_event",
        "unknown_event_type",
        "invalid_event",
        "bad_hash",
        "Cleared",
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93",
        b"\x93\xcb\x41",
        b"\x91\x01",
        b"\x94\x01\x02\x03\x04",
        msgspec.msgpack.encode([TS, 5, 6]),
        msgspec.msgpack.encode(["x", [], 0]),
        msgspec.msgpack.encode([TS, [], "dp"]),
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode(5),
        EX_B_V023[:-5],
    ],
)
def test_bad_batches_raise_decode_error(payload):
    with pytest.raises(DecodeError):
        decode_vllm_batch(payload)


def test_fuzz_never_raises_anything_but_decode_error():
    rng = random.Random(1234)
    corpus = [EX_A_V033, EX_B_V023, EX_C_V092, EX_E_SGL0523, EX_E_SGL0516]
    for i in range(4000):
        base = bytearray(rng.choice(corpus))
        op = i % 4
        if op == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        elif op == 1:
            data = bytes(base[: rng.randrange(0, len(base))])
        elif op == 2:
            for _ in range(rng.randrange(1, 4)):
                base[rng.randrange(len(base))] = rng.getrandbits(8)
            data = bytes(base)
        else:
            data = bytes(base) + bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 8)))
        try:
            b = decode_vllm_batch(data)
        except DecodeError:
            continue
        for e in b.events:
            assert isinstance(e, (Stored, Removed, Cleared, Dropped))


def _reprs(batch):
    return (batch.ts, batch.dp_rank, batch.layout, [repr(e) for e in batch.events])


def test_fast_path_equals_general_path():
    from kvconductor.ingest.vllm import decode_vllm_fast

    s33, s23 = schema("vllm", "0.33.0"), schema("vllm", "0.23.0")
    payloads = [
        EX_A_V033,
        EX_B_V023,
        EX_C_V092,
        EX_E_SGL0523,
        EX_E_SGL0516,
        b"\x92" + EX_C_V092[1:-1],
        s33.batch(
            [
                s33.stored(
                    [1, -2, b"\x01" * 32],
                    None,
                    [1, -1, 2**32 + 3],
                    2,
                    medium="CPU",
                    lora_name="x",
                    group_idx=1,
                    kv_cache_spec_kind="mamba",
                )
            ]
        ),
        s23.batch([s23.stored([None], None, [1], 1), s23.removed([3], medium="GPU")]),
        msgspec.msgpack.encode(
            [TS, [{"type": "BlockStored", "block_hashes": [1], "seq_hashes": [1]}], 0]
        ),
    ]
    fast = 0
    for p in payloads:
        f = decode_vllm_fast(p)
        g = decode_vllm_batch(p)
        if f is not None:
            fast += 1
            assert _reprs(f) == _reprs(g)
    assert fast >= 7
    assert decode_vllm_fast(payloads[-1]) is None  # pool keys: left to the general path
    rng = random.Random(99)
    for _ in range(3000):
        b = bytearray(rng.choice(payloads))
        b[rng.randrange(len(b))] = rng.getrandbits(8)
        f = decode_vllm_fast(bytes(b))
        if f is None:
            continue
        try:
            g = decode_vllm_batch(bytes(b))
        except DecodeError as ex:
            raise AssertionError(
                f"fast path accepted what the general path rejects: {bytes(b).hex()}"
            ) from ex
        assert _reprs(f) == _reprs(g)


def test_typed_pass_equals_event_by_event():
    """decode_vllm_batch's one typed pass over the events gives what decoding them one by
    one gives (the events of every example, and of random corruptions of them)."""
    s33, s23 = schema("vllm", "0.33.0"), schema("vllm", "0.23.0")
    payloads = [
        EX_A_V033,
        EX_B_V023,
        EX_C_V092,
        EX_E_SGL0523,
        EX_E_SGL0516,
        s33.batch([s33.stored([1, -2, b"\x01" * 32], None, [1, -1, 2**32 + 3], 2, medium="CPU")]),
        s23.batch([s23.stored([None], None, [1], 1), s23.removed([3], medium="GPU")]),
        msgspec.msgpack.encode(
            [TS, [{"type": "BlockStored", "block_hashes": [1], "seq_hashes": [1]}], 0]
        ),
    ]
    rng = random.Random(7)
    corpus = list(payloads)
    for _ in range(3000):
        b = bytearray(rng.choice(payloads))
        b[rng.randrange(len(b))] = rng.getrandbits(8)
        corpus.append(bytes(b))
    typed = 0
    for p in corpus:
        try:
            g = decode_vllm_batch(p, typed=False)
        except DecodeError as ex:
            with pytest.raises(DecodeError) as again:
                decode_vllm_batch(p)
            assert again.value.reason == ex.reason
            continue
        f = decode_vllm_batch(p)
        typed += 1
        assert _reprs(f) == _reprs(g)
    assert typed >= len(payloads)


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        [0, 1, 2],
        [-1, -(2**63), 2**32 + 5, 2**64 - 1],
        list(range(70000, 70600)),
        [1, "x"],
        [1.5],
        [None],
        "abc",
        b"\x01\x00\x00\x00",
        7,
        None,
    ],
)
def test_token_scanner_matches_msgspec_fallback(monkeypatch, tokens):
    from kvconductor.ingest import vllm

    raw = msgspec.Raw(msgspec.msgpack.encode(tokens))

    def run():
        try:
            return list(vllm.raw_tokens(raw))
        except DecodeError as ex:
            return ex.reason

    with_c = run()
    monkeypatch.setattr(vllm, "_read_u32_array", None)
    assert run() == with_c
    if isinstance(tokens, list) and all(type(t) is int for t in tokens):
        assert with_c == [t & 0xFFFFFFFF for t in tokens]
    elif tokens is None:
        assert with_c == []
    else:
        assert with_c == "invalid_event"
