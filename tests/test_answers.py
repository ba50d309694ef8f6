"""Answers without per-holder Python work: the core's compact result (``MatchRows``), the
per-group name table (``GroupNames``), ``QueryResult`` built on them, the encoder that
renders V3 answers straight from the arrays, and the ``top_k`` / ``instances`` selection.

Every array-backed answer is checked against the DpHit path it replaces (the same bytes,
JSON and msgpack) and the selection against an independent model written from its
definition (docs/api.md, "top_k and instances"): at most ``top_k`` rows, every row
deeper (npu + cpu + disk blocks) than the ``top_k``-th largest depth, and of the rows tied
at that depth the first by ``instances`` order (a rank per group), else ``need``
consecutive ones (wrapping) from a start the request's seed picks.
"""

from __future__ import annotations

from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconductor import _encode
from kvconductor._hash import hash_blocks
from kvconductor._index import CoreIndex, MatchRows
from kvconductor._py.index import CoreIndex as PyCoreIndex
from kvconductor._py.index import MatchRows as PyMatchRows
from kvconductor._py.index import PyGroupNames
from kvconductor.index import DpHit, Index, QueryResult
from kvconductor.keys import Medium, WorkerKey
from kvconductor.wire import encode_result, py_encode_result

U32 = 2**32 - 1
ROW_IMPLS = [MatchRows, PyMatchRows]


# -- an independent model of the selection ---------------------------------------------------
def _splitmix(x):
    """SplitMix64's finaliser, written from its definition."""
    m = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def model_select(rows, top_k=None, keep_groups=None, seed=0, ranks=None):
    """``(rows kept by select, omitted)``, from the definition (not the implementation)."""
    cand = [r for r in rows if keep_groups is None or r[0] in keep_groups]
    if ranks is not None:
        cand = [r for r in cand if r[0] < len(ranks) and ranks[r[0]]]
    if top_k is None or top_k >= len(cand):
        return cand, 0
    totals = [r[1] + r[2] + r[3] for r in cand]
    kth = sorted(totals, reverse=True)[top_k - 1]
    tied = [i for i, t in enumerate(totals) if t == kth]
    need = top_k - sum(t > kth for t in totals)
    if ranks is not None:
        chosen = set(sorted(tied, key=lambda i: (ranks[cand[i][0]], i))[:need])
    else:
        start = _splitmix(seed) % len(tied)
        chosen = {tied[(start + j) % len(tied)] for j in range(need)}
    kept = [r for i, r in enumerate(cand) if totals[i] > kth or i in chosen]
    return kept, len(tied) - need


def mask_of(groups, size):
    m = bytearray(size)
    for g in groups:
        if g < size:
            m[g] = 1
    return bytes(m)


COUNT = st.one_of(st.integers(0, 6), st.integers(0, U32))
ROWS = st.dictionaries(
    st.integers(0, 40), st.tuples(COUNT, COUNT, COUNT).filter(any), max_size=25
).map(lambda d: [(g, *d[g]) for g in sorted(d)])


@pytest.mark.parametrize("cls", ROW_IMPLS)
def test_rows_basics(cls):
    r = cls([(0, 1, 2, 3), (4, 5, 0, 0), (9, U32, U32, U32)])
    assert len(r) == 3
    assert bool(r)
    assert r.tolist() == [(0, 1, 2, 3), (4, 5, 0, 0), (9, U32, U32, U32)]
    assert r.sums() == (1 + 5 + U32, 2 + U32, 3 + U32)
    assert r.last_group() == 9
    empty = cls([])
    assert len(empty) == 0 and not empty
    assert empty.tolist() == [] and empty.sums() == (0, 0, 0) and empty.last_group() == -1


@pytest.mark.parametrize("cls", ROW_IMPLS)
def test_rows_reject_bad_rows(cls):
    with pytest.raises(ValueError):
        cls([(3, 1, 0, 0), (3, 1, 0, 0)])  # group ids strictly increase
    with pytest.raises(ValueError):
        cls([(3, 1, 0, 0), (2, 1, 0, 0)])
    with pytest.raises(OverflowError):
        cls([(0, 2**32, 0, 0)])
    with pytest.raises(OverflowError):
        cls([(0, -1, 0, 0)])


@pytest.mark.parametrize("cls", ROW_IMPLS)
def test_select_boundaries(cls):
    rows = [(0, 3, 0, 0), (1, 1, 1, 0), (2, 5, 0, 0), (3, 0, 0, 2), (4, 1, 0, 0), (5, 0, 3, 0)]
    r = cls(rows)
    # totals 3, 2, 5, 2, 1, 3: top 1 = the 5; top 2 = the 5 and one of the two 3s
    assert r.select(1).tolist() == [(2, 5, 0, 0)] and r.select(1).omitted == 0
    two = r.select(2)
    assert two.omitted == 1 and two.tolist() in (
        [(0, 3, 0, 0), (2, 5, 0, 0)],
        [(2, 5, 0, 0), (5, 0, 3, 0)],
    )
    # the seed picks which: the same seed the same rows, and both come up over seeds
    assert r.select(2, None, 7).tolist() == r.select(2, None, 7).tolist()
    assert len({tuple(r.select(2, None, s).tolist()) for s in range(32)}) == 2
    # ranks (the instances' order): the smaller rank wins the tie, then the row order
    prefer5 = array("I", [2, 1, 1, 1, 1, 1])
    assert r.select(2, None, 0, prefer5).tolist() == [(2, 5, 0, 0), (5, 0, 3, 0)]
    same = array("I", [1] * 6)
    assert r.select(2, None, 0, same).tolist() == [(0, 3, 0, 0), (2, 5, 0, 0)]
    # deeper holders always win: rank never lets a shallower row past a deeper one
    prefer4 = array("I", [9, 9, 9, 9, 1, 9])
    assert r.select(1, None, 0, prefer4).tolist() == [(2, 5, 0, 0)]
    assert r.select(3).tolist() == [(0, 3, 0, 0), (2, 5, 0, 0), (5, 0, 3, 0)]
    assert r.select(3).omitted == 0
    # the 4th depth is 2, held twice: one of them
    four = r.select(4)
    assert len(four) == 4 and four.omitted == 1
    assert {g for g, *_ in four.tolist()} in ({0, 1, 2, 5}, {0, 2, 3, 5})
    assert r.select(6).tolist() == rows
    assert r.select(10**9).tolist() == rows  # more than the rows: all of them
    assert r.select(None).tolist() == rows and r.select(None).omitted == 0
    for bad in (0, -1):
        with pytest.raises(ValueError):
            r.select(bad)
    # instances filter (as a group mask or ranks), then top_k among what is left
    assert r.select(None, mask_of({1, 3, 4, 77}, 6)).tolist() == [rows[1], rows[3], rows[4]]
    assert r.select(1, mask_of({1, 3, 4}, 6), 0, array("I", [0, 2, 0, 1])).tolist() == [rows[3]]
    assert r.select(None, b"").tolist() == []  # a short mask leaves the rest out
    assert r.select(None, None, 0, array("I")).tolist() == []
    assert r.select(2, mask_of({5}, 6)).tolist() == [rows[5]]


@pytest.mark.parametrize("cls", ROW_IMPLS)
def test_select_a_fleet_holding_one_prefix(cls):
    # 1,024 round-robin workers all holding the system prompt's one block: k rows, not 1,024
    r = cls([(g, 1, 0, 0) for g in range(1024)])
    top = r.select(8, None, 12345)
    assert len(top) == 8 and top.omitted == 1016
    groups = [g for g, *_ in top.tolist()]
    start = _splitmix(12345) % 1024
    assert sorted(groups) == sorted((start + j) % 1024 for j in range(8))
    # ties spread: different requests name different workers
    assert len({tuple(r.select(8, None, s).tolist()) for s in range(50)}) > 40
    # the instances' order steers the tie: the first 8 named, whatever their group ids
    order = list(range(1023, -1, -3))
    ranks = array("I", [0] * 1024)
    for pos, g in enumerate(order):
        ranks[g] = pos + 1
    steered = r.select(8, None, 0, ranks)
    assert [g for g, *_ in steered.tolist()] == sorted(order[:8])
    assert steered.omitted == len(order) - 8
    # one deeper holder always wins over the tied crowd
    deeper = cls([(g, 2 if g == 600 else 1, 0, 0) for g in range(1024)])
    assert 600 in [g for g, *_ in deeper.select(1, None, 3).tolist()]
    assert deeper.select(1, None, 3).omitted == 0
    assert 600 in [g for g, *_ in deeper.select(2, None, 0, ranks).tolist()]


@settings(max_examples=300, deadline=None)
@given(
    rows=ROWS,
    k=st.one_of(st.none(), st.integers(1, 30)),
    keep=st.one_of(st.none(), st.sets(st.integers(0, 45))),
    size=st.integers(0, 50),
    seed=st.integers(0, 2**64 - 1),
    rank=st.one_of(st.none(), st.lists(st.integers(0, 4), max_size=50)),
)
def test_select_matches_the_model(rows, k, keep, size, seed, rank):
    mask = None if keep is None else mask_of(keep, size)
    kept_groups = None if keep is None else {g for g in keep if g < size}
    want = model_select(rows, k, kept_groups, seed, rank)
    ranks = None if rank is None else array("I", rank)
    for cls in ROW_IMPLS:
        got = cls(rows).select(k, mask, seed, ranks)
        assert (got.tolist(), got.omitted) == want


# -- the core returns MatchRows ---------------------------------------------------------------
BS = 4
TOK = list(range(500, 540))
H = list(hash_blocks(TOK, BS))


def _core_pair():
    cores = (CoreIndex(), PyCoreIndex())
    for core in cores:
        for w in range(6):
            core.set_worker(w, w // 2, w % 3)  # groups 0..2; tiers HBM/CPU/Disk
    return cores


@pytest.mark.parametrize("which", [0, 1])
def test_core_match_rows(which):
    core = _core_pair()[which]
    core.store(0, None, [1, 2, 3], H[:3])
    core.store(3, None, [7, 8, 9, 10], H[:4])  # group 1, HBM
    core.store(4, None, [7], H[:1])  # group 2, CPU
    rows = core.match_rows(H[:6])
    assert type(rows).__name__ == "MatchRows"
    assert rows.tolist() == core.match(H[:6]) == [(0, 3, 0, 0), (1, 4, 0, 0), (2, 0, 1, 0)]
    toks = core.match_tokens_rows(array("I", TOK[: 6 * BS]), BS)
    assert toks.tolist() == rows.tolist()
    assert core.match_rows([]).tolist() == [] and core.match_tokens_rows([], BS).tolist() == []
    if which == 0:
        core.close()


# -- names and the encoder --------------------------------------------------------------------
NAME = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=40)
DP = st.one_of(st.integers(0, 8), st.integers(-(2**70), 2**70))


@st.composite
def named_rows(draw):
    insts = draw(st.lists(NAME, min_size=1, max_size=6, unique=True))
    keys = draw(
        st.lists(st.tuples(st.sampled_from(insts), DP), min_size=1, max_size=30, unique=True)
    )
    rows = draw(ROWS.filter(lambda r: all(g < len(keys) for g, *_ in r)))
    return keys, rows


def _names(keys):
    names = _encode.GroupNames()
    for i, (inst, dp) in enumerate(keys):
        assert names.add(inst, dp) == i
    return names


def _hits(keys, rows):
    return [DpHit(keys[g][0], keys[g][1], n, c, d) for g, n, c, d in rows]


@settings(max_examples=300, deadline=None)
@given(kr=named_rows(), tenant=NAME, bs=st.one_of(st.integers(0, 64), st.integers(0, U32)))
def test_encode_rows_is_the_dphit_answer(kr, tenant, bs):
    keys, rows = kr
    names = _names(keys)
    hits = _hits(keys, rows)
    for mp in (False, True):
        old = _encode.encode_result(hits, tenant, bs, mp)
        assert _encode.encode_rows(MatchRows(rows), names, tenant, bs, mp) == old
        assert old == py_encode_result(hits, tenant, bs, mp)
    res = QueryResult.of_rows(MatchRows(rows), names)
    assert res.hits == hits
    assert res.to_dict(tenant, bs) == QueryResult(hits).to_dict(tenant, bs)
    assert res.sums() == (sum(h[2] for h in hits), sum(h[3] for h in hits), sum(h[4] for h in hits))
    for mp in (False, True):
        assert encode_result(res, tenant, bs, mp) == _encode.encode_result(hits, tenant, bs, mp)


def test_group_names_api():
    names = _encode.GroupNames()
    assert len(names) == 0 and names.keys == []
    assert names.add("a", 0) == 0
    assert names.add('b"\\\n\u00e9', -3) == 1
    assert names.add("a", 1) == 2
    assert len(names) == 3
    assert names.keys == [("a", 0), ('b"\\\n\u00e9', -3), ("a", 1)]
    assert names.instances_mask(["a", "zz"]) == b"\x01\x00\x01"
    assert names.instances_mask([]) == b"\x00\x00\x00"
    # the first mention of an instance is its rank: 1 + its position in the list
    assert names.instances_rank(["zz", 'b"\\\n\u00e9', "a", "a"]).tolist() == [3, 2, 3]
    assert names.instances_rank([]).tolist() == [0, 0, 0]
    assert names.nbytes() > 0
    with pytest.raises(TypeError):
        names.add(3, 0)
    py = PyGroupNames()
    for k in names.keys:
        py.add(*k)
    assert py.keys == names.keys and len(py) == 3
    assert py.instances_mask(["a", "zz"]) == b"\x01\x00\x01"
    assert py.instances_rank(["zz", 'b"\\\n\u00e9', "a", "a"]).tolist() == [3, 2, 3]


def test_encode_rows_refuses_an_unnamed_group():
    names = _names([("a", 0)])
    with pytest.raises(IndexError):
        _encode.encode_rows(MatchRows([(0, 1, 0, 0), (1, 1, 0, 0)]), names, "t", 1, False)


def test_group_names_many_groups_across_chunks():
    # the table grows in chunks that never move: many groups, every one still named
    names = _encode.GroupNames()
    n = 5000
    for g in range(n):
        names.add(f"i{g % 1700}", g // 1700)
    rows = [(g, 1 + g % 3, 0, g % 2) for g in range(0, n, 7)]
    hits = _hits(names.keys, rows)
    for mp in (False, True):
        assert _encode.encode_rows(MatchRows(rows), names, "t", 16, mp) == (
            _encode.encode_result(hits, "t", 16, mp)
        )


# -- Index answers ----------------------------------------------------------------------------
def key(inst, dp=0, medium=Medium.NPU):
    return WorkerKey(inst, inst, dp, medium)


def _filled(impl):
    ix = Index("m", "t", impl=impl)
    # 5 groups: a/0 holds 4 blocks, a/1 holds 2, b/0 holds 4 on CPU, c/0 holds 1, d/0 holds 3
    ix.store(key("a"), None, [1, 2, 3, 4], H[:4])
    ix.store(key("a", 1), None, [1, 2], H[:2])
    ix.store(key("b", 0, Medium.CPU), None, [5, 6, 7, 8], H[:4])
    ix.store(key("c"), None, [9], H[:1])
    ix.store(key("d"), None, [11, 12, 13], H[:3])
    return ix


@pytest.mark.parametrize("impl", ["c", "py"])
def test_index_results_are_array_backed(impl):
    ix = _filled(impl)
    res = ix.query_by_hash(H[:6])
    assert type(res.rows).__name__ == "MatchRows"
    assert res.hits == [
        DpHit("a", 0, 4, 0, 0),
        DpHit("a", 1, 2, 0, 0),
        DpHit("b", 0, 0, 4, 0),
        DpHit("c", 0, 1, 0, 0),
        DpHit("d", 0, 3, 0, 0),
    ]
    assert len(res) == 5 and res.sums() == (10, 4, 0)
    assert ix.query(TOK[: 6 * BS], BS).hits == res.hits
    doc = res.to_dict("t", 1)
    assert doc["t"]["a"] == {
        "longest_matched": 4,
        "DP": {
            "0": {"matched_tokens": 4, "npu_blocks": 4, "cpu_blocks": 0, "disk_blocks": 0},
            "1": {"matched_tokens": 2, "npu_blocks": 2, "cpu_blocks": 0, "disk_blocks": 0},
        },
    }
    for mp in (False, True):
        body = encode_result(res, "t", 1, mp)
        dec = msgspec.msgpack.decode(body) if mp else msgspec.json.decode(body)
        assert dec == doc


@pytest.mark.parametrize("impl", ["c", "py"])
def test_index_top_k_and_instances(impl):
    ix = _filled(impl)
    # totals: a/0 4, a/1 2, b/0 4, c/0 1, d/0 3
    top1 = ix.query_by_hash(H[:6], top_k=1)
    assert [(h.instance_id, h.dp_rank) for h in top1.hits] in ([("a", 0)], [("b", 0)])  # tie
    assert top1.omitted == 1 and ix.query_by_hash(H[:6], top_k=1).hits == top1.hits
    # the instances' order breaks the tie (the rows not named are left out)
    for first in ("a", "b"):
        steered = ix.query_by_hash(H[:6], top_k=1, instances=[first, "a", "b", "d"])
        assert [(h.instance_id, h.dp_rank) for h in steered.hits] == [(first, 0)]
        assert steered.omitted == 1
    assert ix.query(TOK[: 6 * BS], BS, top_k=1, instances=["b", "a"]).hits == [
        DpHit("b", 0, 0, 4, 0)
    ]
    top3 = ix.query(TOK[: 6 * BS], BS, top_k=3)
    assert [(h.instance_id, h.dp_rank) for h in top3.hits] == [("a", 0), ("b", 0), ("d", 0)]
    only = ix.query_by_hash(H[:6], instances=["a", "c", "nobody"])
    assert [(h.instance_id, h.dp_rank) for h in only.hits] == [("a", 0), ("a", 1), ("c", 0)]
    both = ix.query_by_hash(H[:6], top_k=1, instances=["c", "d"])
    assert [(h.instance_id, h.dp_rank) for h in both.hits] == [("d", 0)]
    assert ix.query_by_hash(H[:6], instances=[]).hits == []
    assert len(ix.query_by_hash(H[:6], top_k=99)) == 5
    assert ix.query_by_hash(H[:6], top_k=99).omitted == ix.query_by_hash(H[:6]).omitted == 0
    with pytest.raises(ValueError):
        ix.query_by_hash(H[:6], top_k=0)
    # the whole answer of a top_k query keeps the V3 shape (longest over the kept DPs)
    top_a = ix.query_by_hash(H[:6], top_k=1, instances=["a", "b"])
    assert top_a.to_dict("t", 2)["t"]["a"]["longest_matched"] == 8


def test_index_answers_agree_between_core_and_twin():
    c, p = _filled("c"), _filled("py")
    for n in range(7):
        for k in (None, 1, 2, 5):
            for insts in (None, ["a"], ["b", "d"], ["b", "a"], ["d", "c", "b", "a"]):
                a = c.query_by_hash(H[:n], top_k=k, instances=insts)
                b = p.query_by_hash(H[:n], top_k=k, instances=insts)
                assert a.hits == b.hits and a.omitted == b.omitted
                for mp in (False, True):
                    assert encode_result(a, "t", 3, mp) == py_encode_result(b, "t", 3, mp)


def test_old_query_result_still_works():
    hits = [DpHit("x", 0, 1, 2, 3)]
    res = QueryResult(hits)
    assert res.hits == hits and len(res) == 1 and res.sums() == (1, 2, 3)
    assert encode_result(res, "t", 1, False) == _encode.encode_result(hits, "t", 1, False)
    assert QueryResult([]).hits == [] and len(QueryResult([])) == 0


# -- freshness (docs/api.md, "freshness"): the compiled rows' encoder against the twin --------
class _Stats:
    """What the encoder reads of a source's ``SourceStats``."""

    def __init__(self, last_event: float) -> None:
        self.last_event = last_event


#: Wall times around a fixed "now" (ages of 0, sub-ms, hours, beyond u32 ms, in the future).
NOW = 1_790_000_000.25
WALL = st.one_of(
    st.floats(NOW - 10, NOW + 1, allow_nan=False),
    st.sampled_from([NOW, NOW - 0.0004999, NOW - 0.0005, NOW - 3600.5, NOW - 5.0e6, 0.0]),
)
ENTRY = st.one_of(
    st.none(),
    st.tuples(
        st.integers(0, len(_encode.FRESH_STATES) - 2),
        st.lists(WALL.map(_Stats), max_size=3).map(tuple),
        st.one_of(st.none(), WALL),
    ),
)
TAIL = st.fixed_dictionaries({"all_live": st.booleans(), "sources": st.integers(0, 5000)}).map(
    lambda d: {**d, "states": {"live": d["sources"]}}
)


@settings(max_examples=300, deadline=None)
@given(
    kr=named_rows(),
    tenant=NAME.filter(lambda t: t != "freshness"),
    bs=st.one_of(st.integers(0, 64), st.integers(0, U32)),
    entries=st.lists(ENTRY, max_size=32),
    tail=TAIL,
)
def test_encode_rows_with_freshness_is_the_twin(kr, tenant, bs, entries, tail):
    from kvconductor.wire import encode_fresh, member, py_encode_fresh

    keys, rows = kr
    names = _names(keys)
    res = QueryResult.of_rows(MatchRows(rows), names)
    py_res = QueryResult.of_rows(PyMatchRows(rows), names)
    for mp in (False, True):
        enc = msgspec.msgpack if mp else msgspec.json
        fresh = (entries, NOW, enc.encode(tail))
        got = encode_fresh(res, tenant, bs, mp, fresh)
        assert got == py_encode_fresh(py_res, tenant, bs, mp, fresh)
        # the same answer as without the flag, plus the members (an independent check of
        # the twin): every DP gains "freshness", the answer gains its own
        doc = enc.decode(got)
        want = res.to_dict(tenant, bs)
        for g, *_ in rows:
            inst, dp = keys[g]
            entry = entries[g] if g < len(entries) else None
            want[tenant][inst]["DP"][str(dp)]["freshness"] = member(entry, NOW)
        want["freshness"] = tail
        assert doc == want
        assert list(doc) == [tenant, "freshness"]


def test_freshness_members_by_hand():
    keys = [("a", 0), ("a", 1), ("b", 0)]
    names = _names(keys)
    res = QueryResult.of_rows(MatchRows([(0, 2, 0, 0), (1, 1, 1, 0), (2, 0, 0, 3)]), names)
    live = (0, (_Stats(NOW - 1.2346), _Stats(NOW - 7.0)), None)  # newest of two sources
    degraded = (4, (_Stats(NOW - 0.0004),), NOW - 61.0)
    fresh = ([live, degraded], NOW, b'{"all_live":false}')
    from kvconductor.wire import encode_fresh

    got = encode_fresh(res, "default", 4, False, fresh)
    assert got == (
        b'{"default":{"a":{"longest_matched":8,"DP":{'
        b'"0":{"matched_tokens":8,"npu_blocks":2,"cpu_blocks":0,"disk_blocks":0,'
        b'"freshness":{"state":"live","last_event_age_ms":1235}},'
        b'"1":{"matched_tokens":8,"npu_blocks":1,"cpu_blocks":1,"disk_blocks":0,'
        b'"freshness":{"state":"degraded","last_event_age_ms":0,"degraded_for_ms":61000}}}},'
        b'"b":{"longest_matched":12,"DP":{"0":{"matched_tokens":12,"npu_blocks":0,'
        b'"cpu_blocks":0,"disk_blocks":3,"freshness":{"state":"no_source"}}}}},'
        b'"freshness":{"all_live":false}}'
    )
    assert encode_result(res, "default", 4, False) == msgspec.json.encode(res.to_dict("default", 4))


def test_request_seed_is_the_wire_s_bytes():
    from kvconductor.index import request_seed

    toks = [5, 2**32 + 7, 9]  # the wire parser truncates token ids to 32 bits
    assert request_seed(toks, "I") == request_seed(array("I", [5, 7, 9]), "I")
    assert request_seed([1, 2**64 - 1], "Q") == request_seed(array("Q", [1, 2**64 - 1]), "Q")
    assert request_seed([1, 2], "Q") != request_seed([2, 1], "Q")
    # an Index answers a list of token ids as it answers the parser's array
    ix = Index("m", "t")
    for i in range(12):
        ix.store(key(f"w{i}"), None, [100 + i], H[:1])
    a = ix.query(TOK[: 2 * BS], BS, top_k=3)
    b = ix.query(array("I", TOK[: 2 * BS]), BS, top_k=3)
    assert a.hits == b.hits and len(a) == 3 and a.omitted == 9
