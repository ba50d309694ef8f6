"""The compiled ingest fast path (``kvconductor._ingest``) against the general Python path.

Every test applies the same payloads through two ``Applier`` objects on two
conductors with compiled indexes: one with the fast path (which falls back to the
Python path for whatever it does not handle), one with ``fast=False``. After the
payloads, stats, drop counters, ``touched`` keys, worker registries, core sizes
and query answers must be identical. A random generator of batches (array and map
events, every envelope layout, HBM and other media, LoRA names, attention kinds,
block sizes, parents that exist or not, removals, clears, int / negative / bin /
bad hashes, junk and pool-looking events) drives a Hypothesis test, a seeded loop
and a byte-mutation fuzz.
"""

from __future__ import annotations

import random

import msgspec
import pytest

pytest.importorskip("kvconductor._ingest")
pytest.importorskip("kvconductor._index")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor.ingest import apply as _apply_mod
from tests.helpers.payloads import EX_A_V033, EX_B_V023, EX_C_V092, EX_E_SGL0516, EX_E_SGL0523
from tests.helpers.publishers import H1, H2, FakeConductor, schema

if _apply_mod._FastBatch is None:  # KVCONDUCTOR_IMPL=py
    pytest.skip("ingest fast path disabled", allow_module_level=True)

from kvconductor._hash import hash_blocks, lora_seed
from kvconductor._index import CoreIndex
from kvconductor._ingest import FastBatch
from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.recognize import POOL, recognize
from kvconductor.keys import Medium
from kvconductor.predict import Predictions

BS = 4
IID = "vllm-a"
TS = 1700000000.5
ENC = msgspec.msgpack.Encoder()
ABSENT = object()

# Token blocks of BS tokens: every stored chain and every query is built from them.
BLOCKS = [list(range(100 + BS * i, 100 + BS * (i + 1))) for i in range(4)]
QUERIES = (
    [[*a] for a in BLOCKS]
    + [a + b for a in BLOCKS for b in BLOCKS]
    + [a + b + c for a in BLOCKS[:3] for b in BLOCKS[:3] for c in BLOCKS[:3]]
)
SEEDS = [1337, lora_seed("sql-adapter"), lora_seed("lora-é")]
# Engine hashes; several encodings of the same u64 (int / bin / digest tail) on purpose.
GOOD_HASHES = [
    1,
    2,
    3,
    7,
    -1,
    -5,
    2**64 - 1,
    H1,
    H2,
    (2).to_bytes(8, "big"),
    b"\x03",
    bytes(24) + (7).to_bytes(8, "big"),
    bytes(range(16)),
]
BAD_HASHES = ["0x10", "12", True, 1.5, None, b""]
HASH_QUERIES = [[h] for h in (1, 2, 3, 7, 2**64 - 1, 2**64 - 5)] + [
    [a, b] for a in (1, 2, 3, 7) for b in (1, 2, 3, 7, 2**64 - 1)
]
# (common values, rare values): a rare value is drawn with probability RARE.
RARE = 0.06
MEDIA = (
    [ABSENT, None, "GPU", "GPU", "GPU", "gpu", "NPU", "DEVICE", ""],
    ["CPU", "STORAGE", "cpu_pinned", "weird", 7],
)
LORAS = ([ABSENT, None, None, None, "", "sql-adapter"], ["lora-é", 5])
KINDS = (
    [
        ABSENT,
        ABSENT,
        None,
        "full_attention",
        "mla_attention",
        "",
        "sliding_window",
        "SlidingWindow_MLA",
        "MAMBA",
        "chunked_local_attention",
        "sink_full_attention",
    ],
    ["Ünknown", 3],
)
BLOCK_SIZES = ([BS, BS, BS, BS, BS, 0, None, 8, 2], [-1, True, 2**40])
EXTRA = {
    "group_idx": ([0, 0, 1, None, "g", 1.5], [[1]]),
    "lora_id": ([None, 3, 1.5, False], [[1]]),
    "session_id": (["s-1", None], ["ß"]),
    "locality": (["LOCAL", "REMOTE"], [{}]),
    "ownership": (["tier-2"], []),
    "extra_keys": (
        [[None, None], [["a", 1]], None, [[[[]]]], b"\x00"],
        [msgspec.msgpack.Ext(1, b"")],
    ),
    "lookahead_token_ids": ([[[1, 2], [3]]], []),
    "kv_cache_spec_sliding_window": ([None, 128], []),
    "cache_salt": (["salt", "é", ""], [5, None, b"x", ["s"]]),
    "whatever": ([{"x": [1, {"y": None}]}], [msgspec.msgpack.Ext(1, b"x")]),
}
JUNK = [
    42,
    ["Nope", 1],
    [],
    {"type": "Nope"},
    {"block_hashes": [1]},
    {"event_type": "stored", "seq_hashes": [1], "backend_id": "10.0.0.1"},
    {"type": "BlockStored", "block_hashes": [1], "event_id": 3},
    {"type": "BlockRemoved", "block_hashes": [2], "seq_hashes": None},
]


# --------------------------------------------------------------------------------------
# random batches (one generator, driven by random.Random or by Hypothesis)


class HypoRng:
    """The subset of random.Random the generator uses, drawing from Hypothesis."""

    def __init__(self, data) -> None:
        self.data = data

    def random(self) -> float:
        return self.data.draw(st.integers(0, 99)) / 100.0

    def randint(self, a: int, b: int) -> int:
        return self.data.draw(st.integers(a, b))

    def choice(self, seq):
        return self.data.draw(st.sampled_from(seq))


def _pick(r, values):
    common, rare = values
    return r.choice(rare) if rare and r.random() < RARE else r.choice(common)


def _hash(r):
    return r.choice(BAD_HASHES) if r.random() < 0.02 else r.choice(GOOD_HASHES)


def _tokens(r, nblocks: int) -> list:
    toks = [t for _ in range(nblocks) for t in r.choice(BLOCKS)]
    if toks and r.random() < 0.15:
        del toks[-r.randint(1, BS - 1) :]  # a partial tail block
    if r.random() < 0.04:
        toks.append(r.choice([2**32 + 100, -1, 2**63 + 5, 2**64 - 1]))
    if r.random() < 0.02:
        toks = r.choice([None, "1234", [1.5], 9])
    return toks


def _extra_keys(r, n: int, lora) -> list:
    """vLLM's per-block ``extra_keys`` (docs/api.md, "Block hashing"), now and then off."""
    out: list = []
    for i in range(n):
        if r.random() < 0.3:
            out.append(None)
            continue
        e: list = [lora] if isinstance(lora, str) and lora and r.random() < 0.7 else []
        for _ in range(r.randint(0, 2)):
            e.append([r.choice(["img-a", "img-b", "é"]), r.randint(-40, 40)])
        if i == 0 and r.random() < 0.5:
            e.append(r.choice(["salt", "ß", ""]))
        if r.random() < 0.1:
            e.append(r.choice([b"\x01" * 32, [1, 2], 7, ["x", 1.5], "ok"]))
        out.append(e)
    if r.random() < 0.05:
        out.append(None)  # one entry too many
    return out


def _stored(r, as_map: bool):
    n = r.randint(0, 4)
    hashes = [_hash(r) for _ in range(n)]
    if r.random() < 0.03:
        hashes = r.choice([None, "x", 5])
    parent = None if r.random() < 0.6 else _hash(r)
    nb = n if r.random() < 0.85 else r.randint(0, 5)
    fields = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": _tokens(r, nb),
        "block_size": _pick(r, BLOCK_SIZES),
        "lora_id": None,
        "medium": _pick(r, MEDIA),
        "lora_name": _pick(r, LORAS),
        "extra_keys": None,
        "group_idx": 0,
        "kv_cache_spec_kind": _pick(r, KINDS),
        "kv_cache_spec_sliding_window": None,
        "locality": None,
        "ownership": None,
        "session_id": None,
    }
    for k, vals in EXTRA.items():
        if r.random() < 0.12:
            fields[k] = _pick(r, vals)
    if r.random() < 0.25 and isinstance(hashes, list):
        fields["extra_keys"] = _extra_keys(r, len(hashes), fields["lora_name"])
    if not as_map:
        order = [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "ownership",
            "session_id",
        ]
        arr = ["BlockStored"] + [None if fields[k] is ABSENT else fields[k] for k in order]
        return arr[: r.choice([2, 5, 6, 7, 8, 10, 12, 12, 12, 12, 15])]
    d = {"type": "BlockStored"}
    for k, v in fields.items():
        if v is ABSENT or (v is None and r.random() < 0.3):
            continue
        if k in ("block_hashes", "token_ids") and r.random() < 0.03:
            continue
        if k in EXTRA and k not in ("group_idx", "lora_id") and v is None:
            continue
        d[k] = v
    return _maybe_move_type(r, d)


def _maybe_move_type(r, d: dict) -> dict:
    if r.random() < 0.1:
        t = d.pop("type")
        items = list(d.items())
        items.insert(r.randint(0, len(items)), ("type", t))
        d = dict(items)
    return d


def _removed(r, as_map: bool):
    hashes = [_hash(r) for _ in range(r.randint(0, 2))]
    medium = _pick(r, MEDIA)
    if not as_map:
        arr = [
            "BlockRemoved",
            hashes,
            None if medium is ABSENT else medium,
            _pick(r, EXTRA["group_idx"]),
            "LOCAL",
        ]
        return arr[: r.choice([2, 3, 4, 4, 5])]
    d = {"type": "BlockRemoved", "block_hashes": hashes}
    if medium is not ABSENT:
        d["medium"] = medium
    if r.random() < 0.5:
        d["group_idx"] = _pick(r, EXTRA["group_idx"])
    if r.random() < 0.1:
        d["lora_id"] = r.choice(["x", [1], {"a": 1}])  # not a field of BlockRemoved: skipped
    return _maybe_move_type(r, d)


def _cleared(r, as_map: bool):
    if not as_map:
        return ["AllBlocksCleared"] if r.random() < 0.9 else ["AllBlocksCleared", 1, [2]]
    d = {"type": "AllBlocksCleared"}
    if r.random() < 0.1:
        d["medium"] = "CPU"  # not a field of AllBlocksCleared: skipped
    return d


def gen_events(r) -> list:
    mode = r.random()
    evs = []
    for _ in range(r.randint(0, 5)):
        as_map = (mode < 0.5) if mode < 0.9 else (r.random() < 0.5)
        x = r.random()
        if x < 0.02:
            evs.append(r.choice(JUNK))
        elif x < 0.65:
            evs.append(_stored(r, as_map))
        elif x < 0.9:
            evs.append(_removed(r, as_map))
        else:
            evs.append(_cleared(r, as_map))
    return evs


def gen_payload(r) -> bytes:
    evs = gen_events(r)
    x = r.random()
    if x < 0.8:
        obj = [TS, evs, r.choice([0, 0, 1, 300, -1])]
    elif x < 0.88:
        obj = [TS, evs]
    elif x < 0.91:
        obj = [1700000000, evs, 0]
    elif x < 0.94:
        obj = [TS, 0, evs]
    elif x < 0.96:
        obj = [TS, evs, None]
    elif x < 0.98:
        obj = [TS, evs, "x"]
    else:
        return ENC.encode([TS, evs, 0]) + b"\x00"
    return ENC.encode(obj)


# --------------------------------------------------------------------------------------
# the two paths side by side


def make_ctx(media=(Medium.NPU,), bs=BS, dp=0, iid=IID, is_pool=False):
    return SubscriberContext(
        instance_id=iid,
        dp_rank=dp,
        url="tcp://127.0.0.1:1",
        model="m",
        tenant="t",
        block_size=bs,
        default_media=tuple(media),
        is_pool=is_pool,
    )


class Pair:
    """One subscription applied through the fast path and through the Python path."""

    def __init__(self, media=(Medium.NPU,), bs=BS, impl="c", conductor_cls=FakeConductor) -> None:
        self.fc, self.pc = conductor_cls(impl), conductor_cls(impl)
        c = make_ctx(media, bs)
        self.fast = Applier(c, self.fc)
        self.slow = Applier(c, self.pc, fast=False)
        assert self.slow._fast is None
        self.fb = self.fast._fast
        self.taken = 0

    def apply(self, payload: bytes) -> bool:
        """Apply through both; True when the fast path handled it."""
        before = self.fb.parsed if self.fb is not None else 0
        r1 = self.fast.apply_payload(payload)
        r2 = self.slow.apply_payload(payload)
        assert r1 == r2, payload.hex(" ")
        took = self.fb is not None and self.fb.parsed > before
        self.taken += took
        self.check_stats(payload)
        return took

    def check_stats(self, payload: bytes = b"") -> None:
        a, b = self.fast.stats, self.slow.stats
        for f in ("batches", "events", "blocks", "dropped"):
            assert getattr(a, f) == getattr(b, f), (f, payload.hex(" "))
        assert self.fast.touched == self.slow.touched

    def check(self) -> None:
        self.check_stats()
        assert self.fc.lora_seeds == self.pc.lora_seeds  # adapters seen (query warnings)
        assert set(self.fc.indexes) == set(self.pc.indexes)
        for key, fi in self.fc.indexes.items():
            si = self.pc.indexes[key]
            assert fi.workers_of(IID) == si.workers_of(IID)
            assert fi.group_keys == si.group_keys
            fs, ss = fi.core.stats(), si.core.stats()
            fs.pop("nbytes", None)
            ss.pop("nbytes", None)
            assert fs == ss
            assert {k: v for k, v in fi.summary().items() if k != "bytes"} == {
                k: v for k, v in si.summary().items() if k != "bytes"
            }
            for k in fi.workers_of(IID):
                assert fi.core.worker_blocks(fi.worker_id(k)) == si.core.worker_blocks(
                    si.worker_id(k)
                )
            for q in QUERIES:
                for bs in (BS, 8):
                    for seed in SEEDS:
                        assert fi.query(q, bs, seed).hits == si.query(q, bs, seed).hits, (
                            q,
                            bs,
                            seed,
                        )
            for q in HASH_QUERIES:
                assert fi.query_by_hash(q).hits == si.query_by_hash(q).hits, q

    def finish(self) -> None:
        self.check()
        assert self.fast.clear_all() == self.slow.clear_all()
        self.check()


MEDIA_SETS = [(Medium.NPU,), (Medium.NPU, Medium.CPU, Medium.DISK), (Medium.CPU, Medium.NPU)]


# --------------------------------------------------------------------------------------
# the differential tests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_differential_hypothesis(data):
    r = HypoRng(data)
    pair = Pair(media=r.choice(MEDIA_SETS), bs=r.choice([BS, BS, 0]))
    for _ in range(r.randint(1, 6)):
        pair.apply(gen_payload(r))
    pair.finish()


@pytest.mark.parametrize("seed", range(6))
def test_differential_seeded(seed):
    r = random.Random(seed)
    pair = Pair(media=MEDIA_SETS[seed % 3], bs=0 if seed == 5 else BS)
    n = 250
    for _ in range(n):
        pair.apply(gen_payload(r))
    pair.finish()
    # both paths were exercised
    assert 0.25 * n < pair.taken < 0.9 * n, pair.taken
    assert pair.fast.stats.blocks > 0


@pytest.mark.parametrize("seed", range(4))
def test_differential_byte_mutations(seed):
    """Truncated, flipped and spliced payloads: the fast path takes or declines, never differs."""
    r = random.Random(100 + seed)
    pair = Pair(media=MEDIA_SETS[seed % 3])
    for _ in range(300):
        p = bytearray(gen_payload(r))
        for _ in range(r.randint(1, 3)):
            k = r.random()
            if not p:
                break
            i = r.randrange(len(p))
            if k < 0.4:
                p[i] = r.randrange(256)
            elif k < 0.6:
                del p[i:]
            elif k < 0.8:
                p[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 4)))
            else:
                del p[i : i + r.randint(1, 4)]
        pair.apply(bytes(p))
    pair.finish()


# --------------------------------------------------------------------------------------
# live predictions on the DP: both paths tell them the same (kvconductor.ingest.predicted)

# Predicted prompts (local hashes): token chains of BLOCKS, and engine hashes standing as
# local hashes (a store without tokens), so that some are confirmed by the batches.
PREDICTED = [
    hash_blocks([t for b in chain for t in b], BS)
    for chain in ([BLOCKS[0]], [BLOCKS[0], BLOCKS[1]], [BLOCKS[1], BLOCKS[2], BLOCKS[3]])
] + [[1], [1, 2], [3, 7], [2**64 - 1]]


class PredictedPair(Pair):
    """A :class:`Pair` whose DP has predictions on both sides, made before each batch."""

    def __init__(self, media) -> None:
        super().__init__(media=media)
        self.preds = [Predictions(clock=lambda: 0.0) for _ in (0, 1)]
        self.with_predictions = 0  # batches the fast path took with predictions live

    def predict(self, locals_) -> None:
        for conductor, pred in zip((self.fc, self.pc), self.preds, strict=True):
            pred.add(conductor.get_or_create_index("m", "t"), IID, 0, locals_)

    def apply(self, payload: bytes) -> bool:
        live = self.preds[0].live
        took = super().apply(payload)
        self.with_predictions += took and live > 0
        assert self.preds[0].counts() == self.preds[1].counts(), payload.hex(" ")
        return took


@pytest.mark.parametrize("seed", range(4))
def test_fast_path_with_live_predictions_tells_them_as_the_general_path(seed):
    """The same batches, predictions made before each: the same confirmed, contradicted
    and live counts, the same answers (the predicted rows included) on both paths."""
    r = random.Random(seed)
    pair = PredictedPair(media=MEDIA_SETS[seed % 3])
    for _ in range(200):
        for _ in range(r.randint(0, 2)):
            pair.predict(r.choice(PREDICTED))
        pair.apply(gen_payload(r))
    pair.check()
    out = pair.preds[0].outcomes
    assert out["confirmed"] > 0 and out["contradicted"] > 0, out
    assert pair.with_predictions > 20, pair.with_predictions


def test_stores_before_a_removal_confirm_then_the_removal_contradicts():
    """One batch [store A, remove X, store B]: the prediction of A is confirmed by the
    store before the removal, the one of B contradicted, on the fast path too."""
    pair = PredictedPair(media=(Medium.NPU,))
    a, b = BLOCKS[0], BLOCKS[1]
    pair.predict(hash_blocks(a, BS))
    pair.predict(hash_blocks(b, BS))
    evs = [
        ["BlockStored", [1], None, a, BS],
        ["BlockRemoved", [9]],
        ["BlockStored", [2], None, b, BS],
    ]
    assert pair.apply(ENC.encode([TS, evs, 0]))
    assert pair.with_predictions == 1
    out = pair.preds[0].outcomes
    assert (out["confirmed"], out["contradicted"], pair.preds[0].live) == (1, 1, 0)
    pair.check()


# --------------------------------------------------------------------------------------
# byte-exact engine payloads: the fast path takes every version family


VERSIONS = [
    ("vllm", v)
    for v in (
        "0.9.0",
        "0.9.2",
        "0.10.2",
        "0.14.0",
        "0.17.0",
        "0.20.0",
        "0.22.0",
        "0.23.0",
        "0.24.0",
        "0.26.0",
        "0.29.0",
        "0.30.0",
        "0.33.0",
    )
] + [
    ("sglang", v)
    for v in ("0.4.6", "0.4.7", "0.5.6", "0.5.9", "0.5.19", "0.5.20", "0.5.22", "0.5.23")
]


def _kw(s, **kw):
    """The keyword arguments this release's BlockStored/BlockRemoved has."""
    names = set(s.stored_fields) | set(s.removed_fields)
    return {k: v for k, v in kw.items() if k in names}


@pytest.mark.parametrize("engine,version", VERSIONS)
def test_version_families_take_the_fast_path(engine, version):
    s = schema(engine, version)
    pair = Pair()
    toks = [t for b in BLOCKS for t in b]
    neg = engine == "sglang"
    h = [-11, -12, -13, -14] if neg else [H1, H2, 5, 6]
    kw = _kw(
        s,
        medium="GPU",
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        extra_keys=[None, None],
        locality="LOCAL",
        session_id="req-1",
        lookahead_token_ids=None,
    )
    payloads = [
        s.batch([s.stored(h[:2], None, toks[:8], BS, **kw)]),
        s.batch(
            [s.stored(h[2:], h[1], toks[8:], BS, **kw), s.removed([h[3]], **_kw(s, medium="GPU"))]
        ),
    ]
    if "lora_name" in s.stored_fields:
        payloads.append(
            s.batch([s.stored([77, 78], None, toks[:8], BS, **kw, lora_name="sql-adapter")])
        )
    for p in payloads:
        assert pair.apply(p), (version, pair.fb.reason)
    idx = pair.fc.indexes[("m", "t")]
    assert [tuple(x) for x in idx.query(toks, BS).hits] == [(IID, 0, 3, 0, 0)]
    if "lora_name" in s.stored_fields:
        assert [tuple(x) for x in idx.query(toks, BS, lora_seed("sql-adapter")).hits] == [
            (IID, 0, 2, 0, 0)
        ]
    pair.check()
    assert pair.apply(s.batch([s.cleared()]))
    assert idx.summary()["hbm_blocks"] == 0
    assert pair.fast.stats.blocks == pair.slow.stats.blocks > 0
    pair.finish()


@pytest.mark.parametrize(
    "payload",
    [EX_A_V033, EX_B_V023, EX_C_V092, b"\x92" + EX_C_V092[1:-1], EX_E_SGL0523, EX_E_SGL0516],
    ids=["a-v0.33", "b-v0.23", "c-v0.9.2", "c-v0.9.0", "e-sgl0.5.23", "e-sgl0.5.16"],
)
def test_spec_examples_take_the_fast_path(payload):
    pair = Pair(bs=2)
    assert pair.apply(payload), pair.fb.reason
    pair.finish()


def test_common_case_is_all_fast():
    """The benchmark's traffic: map events, 2 x 32-block BlockStored + occasional removal."""
    s = schema("vllm", "0.33.0")
    rng = random.Random(1)
    pair = Pair(bs=16)
    parent = None
    for i in range(60):
        evs = []
        for _ in range(2):
            hs = [rng.getrandbits(64) for _ in range(32)]
            toks = [rng.randrange(150_000) for _ in range(16 * 32)]
            evs.append(
                s.stored(
                    hs,
                    parent,
                    toks,
                    16,
                    medium="GPU",
                    extra_keys=[None] * 32,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
            parent = hs[-1] if rng.random() < 0.5 else None
        if i % 4 == 0:
            evs.append(s.removed([hs[0]], medium="GPU", group_idx=0))
        pair.apply(s.batch(evs))
    assert pair.fb.parsed == 60 and pair.fb.rejected == 0
    assert pair.fast.stats.blocks == pair.slow.stats.blocks == 60 * 64
    assert pair.fast.stats.dropped == {}
    pair.check()


# --------------------------------------------------------------------------------------
# what the fast path declines, and its bookkeeping


def _map_batch(*events: bytes, dp: bytes = b"\x00") -> bytes:
    n = len(events)
    return b"\x93\xcb" + msgspec.msgpack.encode(TS)[1:] + bytes([0x90 | n]) + b"".join(events) + dp


def _s(x: str) -> bytes:
    b = x.encode()
    return bytes([0xA0 | len(b)]) + b


STORED_HEAD = _s("type") + _s("BlockStored") + _s("block_hashes") + b"\x91\x05"


@pytest.mark.parametrize(
    "payload,reason",
    [
        (
            ENC.encode([TS, [{"type": "BlockStored", "block_hashes": [1], "medium": "CPU"}], 0]),
            "medium",
        ),
        (
            ENC.encode([TS, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "weird"}], 0]),
            "medium",
        ),
        (ENC.encode([TS, [{"type": "BlockStored", "block_hashes": ["0x10"]}], 0]), "hash"),
        (ENC.encode([TS, [{"type": "BlockStored", "block_hashes": [True]}], 0]), "hash"),
        (ENC.encode([TS, [{"type": "BlockStored", "block_hashes": [b""]}], 0]), "hash"),
        (ENC.encode([TS, [{"type": "BlockStored", "event_id": 1}], 0]), "pool_key"),
        (ENC.encode([TS, [{"type": "AllBlocksCleared", "backend_id": None}], 0]), "pool_key"),
        (ENC.encode([TS, [{"type": "BlockStored", "lora_name": "é"}], 0]), "field"),
        (ENC.encode([TS, [{"type": "BlockStored", "kv_cache_spec_kind": 5}], 0]), "field"),
        (ENC.encode([TS, [{"type": "BlockStored", "session_id": [1]}], 0]), "field"),
        (ENC.encode([TS, [{"type": "BlockStored", "block_size": -1}], 0]), "block_size"),
        (ENC.encode([TS, [{"type": "BlockStored", "block_size": 2**40}], 0]), "block_size"),
        (ENC.encode([TS, [{"type": "BlockStored", "token_ids": [2**63]}], 0]), "tokens"),
        (ENC.encode([TS, [{"type": "BlockStored", "token_ids": [1.0]}], 0]), "tokens"),
        (ENC.encode([TS, [{"type": "Nope"}], 0]), "event"),
        (ENC.encode([TS, [{"block_hashes": [1]}], 0]), "event"),
        (ENC.encode([TS, [["BlockStored", [1]], 7], 0]), "event"),
        (
            ENC.encode(
                [TS, [{"type": "BlockStored", "extra_keys": msgspec.msgpack.Ext(1, b"")}], 0]
            ),
            "skipped_value",
        ),
        (
            _map_batch(b"\x83" + STORED_HEAD + _s("extra_keys") + b"\x91" * 40 + b"\xc0"),
            "skipped_value",
        ),
        (
            _map_batch(b"\x83" + STORED_HEAD + _s("extra_keys") + b"\x91" * 20 + b"\xc0"),
            "extra_keys",  # not vLLM's shape: the Python path drops the event
        ),
        (ENC.encode([TS, [{"type": "BlockStored", "extra_keys": [["a", 1]]}], 0]), "extra_keys"),
        (_map_batch(b"\x83" + STORED_HEAD + _s("block_hashes") + b"\x91\x06"), "duplicate_key"),
        (_map_batch(b"\x82" + STORED_HEAD, dp=b"\x00\x00"), "envelope"),
        (_map_batch(b"\x82" + STORED_HEAD, dp=b"\xa1x"), "envelope"),
        (ENC.encode([1700000000, [], 0]), "envelope"),
        (ENC.encode([TS, 0, []]), "envelope"),
        (_map_batch(b"\x82" + STORED_HEAD)[:-3], "truncated"),
    ],
)
def test_declined_batches_go_to_the_python_path(payload, reason):
    pair = Pair()
    pair.apply(
        ENC.encode(
            [
                TS,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1, 2],
                        "token_ids": BLOCKS[0] + BLOCKS[1],
                        "block_size": BS,
                    }
                ],
                0,
            ]
        )
    )
    declined = pair.fb.rejected
    assert not pair.apply(payload)
    # a first event that names a pool tuple is decoded as one: never tried in C
    assert pair.fb.rejected == declined + (recognize(payload).kind != POOL)
    fb = FastBatch()  # what the compiled decoder says of it on its own
    assert fb.parse(payload, BS) == -1
    assert fb.reason == reason
    pair.finish()


def test_accepted_oddities():
    """Things msgspec accepts that the fast path handles too."""
    pair = Pair()
    cases = [
        _map_batch(b"\x83" + _s("block_size") + b"\x04" + STORED_HEAD),  # "type" not first
        _map_batch(b"\x83" + STORED_HEAD + _s("zzz") + b"\xa2\xff\xfe"),  # bad UTF-8, skipped
        # vLLM's extra_keys: the LoRA name skipped, an [identifier, offset] pair, a salt
        _map_batch(b"\x83" + STORED_HEAD + _s("extra_keys") + b"\x91\x92\x92\xa1i\x03\xa1s"),
        ENC.encode(
            [
                TS,
                [
                    [
                        "BlockStored",
                        [9],
                        None,
                        [],
                        4,
                        None,
                        None,
                        None,
                        None,
                        0,
                        None,
                        None,
                        "extra",
                        ["more"],
                        {"x": 1},
                    ]
                ],
                None,
            ]
        ),  # trailing fields
        ENC.encode(
            [
                TS,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [11],
                        "token_ids": [-1, 2**32 + 3],
                        "block_size": BS,
                        "medium": "",
                        "lora_name": "",
                    }
                ],
                2**64 - 1,
            ]
        ),
        ENC.encode(
            [TS, [{"type": "BlockRemoved", "block_hashes": [11], "parent_block_hash": "x"}]]
        ),
        ENC.encode(
            [
                TS,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [b"\x00" * 31 + b"\x0c"],
                        "block_size": 0,
                        "kv_cache_spec_kind": "sliding_window",
                    }
                ],
                0,
            ]
        ),
        ENC.encode([TS, [{"type": "BlockStored", "block_hashes": [13], "block_size": 8}], 0]),
    ]
    for p in cases:
        assert pair.apply(p), (p.hex(" "), pair.fb.reason)
    assert pair.fast.stats.dropped == {"attention_kind": 1, "block_size_mismatch": 1}
    pair.finish()


def test_store_errors_are_counted_like_the_python_path():
    pair = Pair()
    s = schema("vllm", "0.33.0")
    assert pair.apply(
        s.batch(
            [
                s.stored([7], 999, BLOCKS[0], BS, medium="GPU"),  # no parent
                s.stored([1, 2], None, BLOCKS[0] + BLOCKS[1], BS, medium="GPU"),
                s.stored([3, 3], 2, BLOCKS[2] + BLOCKS[3], BS, medium="GPU"),
            ]
        )
    )  # repeat
    assert pair.fast.stats.dropped == {"parent_not_found": 1, "invalid_block_sequence": 1}
    assert pair.fast.stats.blocks == 2
    pair.finish()


def test_lora_adapters_seen_are_recorded_on_both_paths():
    """The adapters whose blocks events store are recorded per (model, tenant) (a query
    naming another gets a warning); more than 16 in one batch go the Python path."""
    s = schema("vllm", "0.33.0")
    pair = Pair()

    def batch(names):
        return s.batch(
            [
                s.stored([100 + i], None, BLOCKS[0], BS, medium="GPU", lora_name=n)
                for i, n in enumerate(names)
            ]
        )

    assert pair.apply(batch(["sql", "chat", None]))
    key = next(iter(pair.fc.indexes))
    assert pair.fc.lora_seeds == {key: frozenset({lora_seed("sql"), lora_seed("chat")})}
    many = [f"adapter-{i}" for i in range(17)]
    assert not pair.apply(batch(many))
    assert pair.fb.reason == "too_many_loras"
    assert pair.fc.lora_seeds[key] == frozenset(lora_seed(n) for n in ["sql", "chat", *many])
    assert pair.apply(batch(many[:16]))  # 16 distinct: the fast path takes it
    pair.finish()


class CountingConductor(FakeConductor):
    def __init__(self, impl=None, fail=False):
        super().__init__(impl)
        self.calls = 0
        self.fail = fail

    def get_or_create_index(self, model, tenant):
        self.calls += 1
        if self.fail:
            raise RuntimeError("registry closed")
        return super().get_or_create_index(model, tenant)


def test_lazy_index_and_worker_creation():
    pair = Pair(media=(Medium.NPU, Medium.CPU), conductor_cls=CountingConductor)
    assert pair.apply(ENC.encode([TS, [], 0]))  # no events: no index
    assert pair.fc.calls == pair.pc.calls == 0
    assert pair.apply(
        ENC.encode(
            [TS, [["AllBlocksCleared"], ["BlockRemoved", []], ["BlockStored", [], None, [], 4]], 0]
        )
    )
    assert pair.fc.calls == pair.pc.calls == 1
    idx = pair.fc.indexes[("m", "t")]
    assert idx.workers_of(IID) == [] and pair.fast.touched == {}  # nothing needed a worker
    assert pair.apply(ENC.encode([TS, [["BlockRemoved", [5], "GPU"]], 0]))
    assert len(idx.workers_of(IID)) == 1 and pair.fast.touched == {}
    assert pair.apply(ENC.encode([TS, [["BlockStored", [5], None, BLOCKS[0], 4]], 0]))
    assert set(pair.fast.touched[("m", "t")]) == set(idx.workers_of(IID))
    pair.finish()


def test_get_or_create_index_failure_counts_like_python_path():
    pair = Pair(conductor_cls=lambda impl: CountingConductor(impl, fail=True))
    assert pair.apply(
        ENC.encode([TS, [["BlockStored", [5], None, BLOCKS[0], 4], ["AllBlocksCleared"]], 0])
    )
    assert pair.fast.stats.events == 1 and pair.fast.stats.dropped == {"apply_error": 1}
    pair.check_stats()


def test_pure_python_core_disables_the_fast_path():
    pair = Pair(impl="py")
    s = schema("vllm", "0.33.0")
    pair.apply(s.batch([s.stored([1, 2], None, BLOCKS[0] + BLOCKS[1], BS, medium="GPU")]))
    assert pair.fast._fast is None
    pair.apply(s.batch([s.removed([2], medium="GPU"), s.cleared()]))
    pair.finish()


def test_pool_and_non_hbm_subscriptions_have_no_fast_path():
    c = FakeConductor("c")
    assert Applier(make_ctx(is_pool=True), c)._fast is None
    assert Applier(make_ctx(media=(Medium.CPU,)), c)._fast is None
    assert Applier(make_ctx(), c)._fast is not None


def test_fast_batch_api_errors():
    fb = FastBatch()
    core = CoreIndex()
    core.set_worker(0, 0, 0)
    core.set_worker(1, 0, 1)
    with pytest.raises(RuntimeError):
        fb.apply(core, 0)
    p = ENC.encode([TS, [["BlockStored", [5], None, BLOCKS[0], 4], ["AllBlocksCleared"]], 0])
    assert fb.parse(p, BS) == 2 and fb.needs_worker and fb.touches and fb.has_clear
    with pytest.raises(ValueError):
        fb.apply(core, 1)  # a CPU worker
    assert fb.parse(p, BS) == 2
    with pytest.raises(KeyError):
        fb.apply(core, 0, [7])  # unknown clear worker
    assert core.stats()["hbm_pairs"] == 0  # nothing applied
    assert fb.parse(memoryview(bytearray(p)), BS) == 2
    assert fb.apply(core, 0, [0, 1]) == (1, 0, 0, 0)  # stored, then cleared
    assert core.stats()["hbm_pairs"] == 0
    assert fb.parse(b"", BS) == -1 and fb.reason == "envelope"
    assert fb.parsed == 3 and fb.rejected == 1


def test_huge_batch_then_small():
    fb = FastBatch()
    core = CoreIndex()
    core.set_worker(0, 0, 0)
    n = (1 << 20) // BS + 8
    big = ENC.encode([TS, [["BlockStored", list(range(1, n + 1)), None, [1] * (n * BS), BS]], 0])
    assert fb.parse(big, BS) == 1
    assert fb.apply(core, 0) == (n, 0, 0, 0)
    small = ENC.encode(
        [TS, [["BlockRemoved", [1, 2]], ["BlockStored", [n + 9], None, [3] * BS, BS]], 0]
    )
    assert fb.parse(small, BS) == 2
    assert fb.apply(core, 0) == (1, 0, 0, 0)
    assert core.stats()["hbm_pairs"] == n - 2 + 1


def test_fast_batch_scratch_is_counted_and_freed():
    """FastBatch's scratch goes through the counted allocator (the leak check sees it)."""
    import gc

    from kvconductor import _ingest

    base = _ingest._live_allocations()
    fb = FastBatch()
    p = ENC.encode([TS, [["BlockStored", [5], None, BLOCKS[0], 4]], 0])
    assert fb.parse(p, BS) == 1
    assert _ingest._live_allocations() > base  # hashes, tokens, records
    del fb
    gc.collect()
    assert _ingest._live_allocations() == base


def test_extra_keys_and_sglang_salt_make_other_blocks():
    """vLLM's ``extra_keys`` and SGLang's ``cache_salt`` (docs/api.md, "Extra keys"): both
    paths store the blocks under the local hashes a query with the same extra keys makes
    (``kvconductor._py.hash``, the twin, computes them here), and not under the plain ones."""
    from kvconductor._py import hash as py_hash

    toks = list(range(50, 62))  # 3 blocks
    plain = list(hash_blocks(toks, BS))
    mm = [["img", 2], ["img", -2]]
    vllm_keys = [[mm[0]], [mm[1], "ignored-salt-like"], None]
    v = schema("vllm", "0.33.0")
    sg = schema("sglang", "0.5.22")
    for payload, want in (
        (
            v.batch([v.stored([1, 2, 3], None, toks, BS, extra_keys=vllm_keys)]),
            py_hash.mix_extra(
                plain,
                [
                    py_hash.extra_digest([("mm", "img", 2)]),
                    py_hash.extra_digest([("mm", "img", -2), ("salt", "ignored-salt-like")]),
                    0,
                ],
            ),
        ),
        (
            sg.batch([sg.stored([1, 2, 3], None, toks, BS, cache_salt="s")]),
            py_hash.mix_extra(plain, py_hash.query_extra_digests(len(toks), BS, "s")),
        ),
        (sg.batch([sg.stored([1, 2, 3], None, toks, BS, cache_salt="")]), plain),
    ):
        pair = Pair()
        assert pair.apply(payload)  # the fast path takes them
        for conductor in (pair.fc, pair.pc):
            idx = next(iter(conductor.indexes.values()))
            assert idx.query_by_hash(list(want)).hits == [(IID, 0, 3, 0, 0)]
            if list(want) != plain:
                assert idx.query_by_hash(plain).hits == []
        pair.finish()
    # a salted SGLang event with a parent: its chain's first block carried the salt
    pair = Pair()
    salted = py_hash.mix_extra(plain, py_hash.query_extra_digests(len(toks), BS, "s"))
    assert pair.apply(sg.batch([sg.stored([1], None, toks[:4], BS, cache_salt="s")]))
    assert pair.apply(sg.batch([sg.stored([2, 3], 1, toks[4:], BS, cache_salt="s")]))
    for conductor in (pair.fc, pair.pc):
        idx = next(iter(conductor.indexes.values()))
        assert idx.query_by_hash(list(salted)).hits == [(IID, 0, 3, 0, 0)]
    pair.finish()


# --------------------------------------------------------------------------------------
# the GIL held through small batches and queries (never while waiting for a lock)

_GIL_RACE = r"""
import sys, threading, time
import msgspec
from kvconductor._hash import hash_blocks
from kvconductor._index import CoreIndex
from kvconductor._ingest import FastBatch

BS = 4
enc = msgspec.msgpack.Encoder()
core = CoreIndex()
core.set_worker(0, 0, 0)
fb = FastBatch()
tokens = list(range(BS * 64))
locs = list(hash_blocks(tokens, BS))
stop = threading.Event()
exports = [0]

def export_loop():
    # a read section that takes the GIL back inside it (arrays built under the lock)
    while not stop.is_set():
        core.export_hbm()
        exports[0] += 1

t = threading.Thread(target=export_loop)
t.start()
deadline = time.monotonic() + float(sys.argv[1])
rounds = 0
while time.monotonic() < deadline:
    hs = [rounds * 1000 + i + 1 for i in range(64)]
    p = enc.encode([1.0, [["BlockStored", hs, None, tokens, BS]], 0])
    assert fb.parse(p, BS) == 1
    assert fb.apply(core, 0) == (64, 0, 0, 0)
    assert core.match_rows(locs).tolist()[0][1] == 64
    p = enc.encode([1.0, [["BlockRemoved", hs]], 0])
    assert fb.parse(p, BS) == 1
    fb.apply(core, 0)
    rounds += 1
stop.set()
t.join()
print(rounds, exports[0])
"""


def test_small_batches_and_queries_hold_the_gil_without_deadlock():
    """A small batch is applied, and a short query answered, with the GIL held only when
    the lock is free at once (try-lock): a reader that takes the GIL back inside its read
    section (``export_hbm``) must never wait for a writer that holds the GIL while waiting
    for the lock. A blocking lock taken with the GIL held hangs this within milliseconds."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _GIL_RACE, "1.5"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    rounds, exports = map(int, out.stdout.split())
    assert rounds > 10 and exports > 10
