"""LocalBlockHash: golden vectors of docs/api.md "Block hashing" and agreement with xxhash; a
store-only chunk's block hashes (split_chunk_hashes) and a chain's prefix hashes
(chain_hashes) against their oracles, kvconductor._py.hash."""

import array as _array
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconductor import _hash
from kvconductor._py import hash as py_hash

GOLDEN = [
    ([0, 1, 2, 3], 4, [9143094415614847814]),
    ([1, 2, 3, 4], 4, [14643705804678351452]),
    ([1, 2, 3, 4, 5, 6, 7, 8], 4, [14643705804678351452, 16777012769546811212]),
    ([0, 1, 2, 3, 4, 5], 4, [9143094415614847814, 12189426826560619506]),
    ([10, 20, 30, 40], 4, [16324159493528209483]),
    ([1, 2, 3], 4, [15024015205894559313]),
    ([-1], 1, [3109405589439059943]),
    ([4294967295], 1, [3109405589439059943]),
    ([1, 2, 3, 4, 5], 128, [1914873892905420881]),
    (list(range(12)), 4, [9143094415614847814, 12124091508212882195, 1088361764653601668]),
]


@pytest.mark.parametrize("tokens,bs,expected", GOLDEN)
def test_golden_vectors(tokens, bs, expected):
    assert list(_hash.hash_blocks(tokens, bs)) == expected


def test_golden_hex_forms():
    assert _hash.hash_blocks([0, 1, 2, 3], 4)[0] == 0x7EE2CBEDC694AB46
    assert _hash.hash_blocks([1, 2, 3, 4, 5], 128)[0] == 0x1A92FFA9004C0851


def test_sanity_empty_input_hashes():
    assert _hash.xxh3_64(b"", 0) == 0x2D06800538D394C2
    assert _hash.xxh3_64(b"", 1337) == 0xD1F3E77444430AB9


def test_empty_and_zero_block_size_give_no_hashes():
    assert list(_hash.hash_blocks([], 4)) == []
    assert list(_hash.hash_blocks([1, 2, 3], 0)) == []


@pytest.mark.parametrize(
    "n,bs,count", [(6, 4, 2), (1000, 128, 8), (100, 4, 25), (10000, 4, 2500), (131072, 4, 32768)]
)
def test_block_counts(n, bs, count):
    assert len(_hash.hash_blocks(list(range(n)), bs)) == count


def test_different_sequences_differ():
    assert _hash.hash_blocks([1, 2, 3, 4], 4)[0] != _hash.hash_blocks([1, 2, 3, 5], 4)[0]
    assert _hash.hash_blocks([1, 2, 3], 4)[0] != _hash.hash_blocks([1, 2, 3, 4], 4)[0]


def test_u32_buffer_input_equals_list_input():
    import array

    toks = list(range(1000, 3000))
    assert _hash.hash_blocks(array.array("I", toks), 16) == _hash.hash_blocks(toks, 16)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=300),
    st.integers(min_value=1, max_value=70),
)
def test_matches_xxhash_package(tokens, bs):
    u32 = [t & 0xFFFFFFFF for t in tokens]
    expected = []
    for i in range(0, len(u32), bs):
        chunk = u32[i : i + bs]
        expected.append(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(chunk)}I", *chunk), seed=1337))
    assert list(_hash.hash_blocks(tokens, bs)) == expected


def test_lora_seed():
    assert _hash.lora_seed(None) == 1337
    assert _hash.lora_seed("") == 1337
    expected = (1337 + xxhash.xxh3_64_intdigest(b"adapter-a", seed=0)) % 2**64
    assert _hash.lora_seed("adapter-a") == expected
    toks = [1, 2, 3, 4]
    salted = _hash.hash_blocks(toks, 4, _hash.lora_seed("adapter-a"))[0]
    assert salted == xxhash.xxh3_64_intdigest(struct.pack("<4I", *toks), seed=expected)
    assert salted != _hash.hash_blocks(toks, 4)[0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(-(2**63), 2**64 - 1)), max_size=200),
    st.sampled_from(["list", "tuple", "iter", "range"]),
)
def test_to_u32_tokens_fast_path_and_fallback(tokens, kind):
    # Fast path (array's C loop) for in-range ids; the masking fallback otherwise. Both
    # give the low 32 bits of each id, and an iterator survives a fallback.
    import array

    if kind == "range":
        tokens = list(range(len(tokens)))
    src = {
        "list": tokens,
        "tuple": tuple(tokens),
        "iter": iter(tokens),
        "range": range(len(tokens)),
    }[kind]
    out = _hash.to_u32_tokens(src)
    assert isinstance(out, array.array) and out.typecode == "I"
    assert list(out) == [t & 0xFFFFFFFF for t in tokens]


def test_to_u32_tokens_buffers_and_odd_items():
    import array

    buf = array.array("I", [1, 2, 3])
    assert _hash.to_u32_tokens(buf).obj is buf  # no copy for u32 buffers
    assert list(_hash.to_u32_tokens([True, 2.0, -1])) == [1, 2, 0xFFFFFFFF]
    with pytest.raises(TypeError):
        _hash.to_u32_tokens(b"\x01\x00\x00\x00")


# -- a store-only chunk's block hashes: C against the oracle (kvconductor._py.hash) --------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=20),
    st.integers(0, 40),
)
def test_split_chunk_hashes_matches_the_oracle(hashes, k):
    assert _hash.split_chunk_hashes(hashes, k) == py_hash.split_chunk_hashes(hashes, k)


def test_split_chunk_hashes_keeps_the_chunk_hash_last():
    out = _hash.split_chunk_hashes(_array.array("Q", [5, 2**64 - 1]), 3)
    assert len(out) == 6
    assert out[2] == 5 and out[5] == 2**64 - 1
    assert out[0] == py_hash.sub_block_hash(5, 0) and out[1] == py_hash.sub_block_hash(5, 1)
    assert len(set(out)) == 6
    assert _hash.split_chunk_hashes([7], 1) == _array.array("Q", [7])
    assert _hash.split_chunk_hashes([7], 0) == _array.array("Q")


# -- a chain's prefix hashes: C against the oracle and xxhash itself ----------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=40),
    st.integers(0, 2**64 - 1),
)
def test_chain_hashes_match_the_oracle(hashes, seed):
    assert _hash.chain_hashes(hashes, seed) == py_hash.chain_hashes(hashes, seed)


def test_chain_hashes_are_xxh3_of_the_previous_and_the_block():
    out = _hash.chain_hashes(_array.array("Q", [5, 2**64 - 1]), 7)
    first = xxhash.xxh3_64_intdigest(struct.pack("<QQ", 0, 5), 7)
    assert list(out) == [
        first,
        xxhash.xxh3_64_intdigest(struct.pack("<QQ", first, 2**64 - 1), 7),
    ]
    assert _hash.chain_hashes([], 7) == _array.array("Q")
    with pytest.raises(OverflowError):
        _hash.chain_hashes([2**64], 7)


def test_sub_block_hash_golden():
    # splitmix64 (Vigna) of h + (j + 1) * 0x9E3779B97F4A7C15: its first output from seed 0
    assert py_hash.sub_block_hash(0, 0) == 0xE220A8397B1DCDAF


# -- extra keys (docs/api.md, "Block hashing") -----------------------------------------------

_IDS = st.sampled_from(["img-a", "img-b", "vid-é", ""])
_ITEM = st.one_of(
    st.tuples(st.just("mm"), _IDS, st.integers(-(2**63), 2**64 - 1)),
    st.tuples(st.just("salt"), st.text(max_size=6)),
    st.tuples(st.just("embeds"), st.binary(max_size=40)),
)


@given(st.lists(_ITEM, max_size=5))
@settings(max_examples=200, deadline=None)
def test_extra_digest_matches_the_twin(items):
    assert _hash.extra_digest(items) == py_hash.extra_digest(items)
    assert (_hash.extra_digest(items) == 0) == (not items)


def test_extra_digest_golden():
    """The mixing written out with the xxhash package (docs/api.md, "Block hashing")."""

    def pair(a, b, seed):
        return xxhash.xxh3_64_intdigest(struct.pack("<QQ", a, b), seed)

    mm = pair(xxhash.xxh3_64_intdigest(b"img", 0x6D), 2**64 - 3, 0x6D)
    salt = xxhash.xxh3_64_intdigest(b"s", 0x73)
    d = pair(pair(0, mm, 0), salt, 0)
    assert _hash.extra_digest([("mm", "img", -3), ("salt", "s")]) == d
    local = _hash.hash_blocks([1, 2, 3, 4], 4)[0]
    assert list(_hash.mix_extra([local, 7], [d, 0])) == [pair(local, d, 1337), 7]


@st.composite
def _mm_inputs(draw):
    """Non-overlapping inputs, as vLLM's placeholders are."""
    out, pos = [], draw(st.integers(0, 12))
    for _ in range(draw(st.integers(0, 4))):
        n = draw(st.integers(1, 20))
        out.append((draw(_IDS), pos, n))
        pos += n + draw(st.integers(0, 9))
    return draw(st.permutations(out))


@given(
    st.integers(0, 80),
    st.integers(1, 16),
    st.one_of(st.none(), st.text(max_size=4)),
    _mm_inputs(),
    st.lists(st.integers(0, 2**64 - 1), max_size=8),
)
@settings(max_examples=200, deadline=None)
def test_query_extra_digests_and_mix_match_the_twin(n, bs, salt, mm, local):
    c = _hash.query_extra_digests(n, bs, salt, mm)
    assert c == py_hash.query_extra_digests(n, bs, salt, mm)
    assert len(c) == -(-n // bs)
    assert _hash.mix_extra(local, c, 99) == py_hash.mix_extra(local, c, 99)


_EVENT_ITEM = st.one_of(
    st.text(max_size=4),
    st.binary(max_size=8),
    st.tuples(_IDS, st.integers(-(2**63), 2**64 - 1)).map(list),
    st.sampled_from([7, None, 1.5, [1, 2], ["x", 1.5], ["x"], {"a": 1}, ["x", 1, 2], True]),
)


@given(
    st.one_of(
        st.none(),
        st.lists(st.one_of(st.none(), st.lists(_EVENT_ITEM, max_size=4)), max_size=4),
        st.sampled_from([5, "x", {"a": [1]}, b"\x00"]),
    ),
    st.sampled_from([None, "", "lora-a", "x"]),
    st.integers(0, 4),
)
@settings(max_examples=300, deadline=None)
def test_event_extra_digests_match_the_twin(value, lora, nblocks):
    """The compiled reader of an event's extra_keys (``_ingest``) and its twin agree on
    every value: the same digests, or both refuse the shape."""
    import msgspec

    from kvconductor import _ingest

    raw = msgspec.msgpack.encode(value)
    try:
        want = py_hash.event_extra_digests(raw, lora, nblocks)
    except ValueError:
        with pytest.raises(ValueError):
            _ingest.extra_key_digests(raw, lora, nblocks)
        return
    assert _ingest.extra_key_digests(raw, lora, nblocks) == want


def test_event_extra_digests_skip_only_the_leading_lora_name():
    import msgspec

    from kvconductor import _ingest

    enc = msgspec.msgpack.encode
    salt = _hash.extra_digest([("salt", "a")])
    for fn in (_ingest.extra_key_digests, py_hash.event_extra_digests):
        assert fn(enc([["a"]]), "a", 1) is None  # LoRA only: its seed says it
        assert list(fn(enc([["a", "a"]]), "a", 1)) == [salt]  # then a salt "a"
        assert list(fn(enc([["a"]]), None, 1)) == [salt]
        assert fn(enc([None, []]), None, 2) is None
        with pytest.raises(ValueError):
            fn(enc([None]), None, 2)
        with pytest.raises(ValueError):
            fn(b"\xa3\xed\xa0\x80", None, 1)
