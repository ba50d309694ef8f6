"""An answer read in Python (docs/api.md, "Reading an answer in Python"): ``MatchRows``'s
forms built in C (``kvconductor/_index_answers.pxi``: ``scores``, ``tuples``, ``hits``,
``v3``) against their twin (``kvconductor/_py/rows.py``) and against the definition written
here from ``tolist()`` and the names, and ``QueryResult``'s forms over them.

Every drawn answer goes through every pair of (compiled, twin) rows and (compiled, twin)
name tables, whole and after ``select`` (``top_k`` cuts, ``instances`` masks and ranks),
with names of many DP ranks per instance, an instance's groups not adjacent, and the
empty answer.
"""

from __future__ import annotations

import gc
import sys
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconductor._encode import GroupNames
from kvconductor._index import MatchRows
from kvconductor._py.rows import MatchRows as PyMatchRows
from kvconductor._py.rows import PyGroupNames
from kvconductor.index import DpHit, Index, QueryResult
from kvconductor.keys import Medium, WorkerKey
from kvconductor.schema import DP_MATCH_KEYS, INSTANCE_MATCH_KEYS

U32 = 2**32 - 1
ROW_IMPLS = [MatchRows, PyMatchRows]
NAME_IMPLS = [GroupNames, PyGroupNames]


# -- the definition ----------------------------------------------------------------------------
def model_forms(rows, keys, tenant, bs):
    """``(scores, tuples, v3)`` of ``rows`` (``(group, npu, cpu, disk)``) named by ``keys``
    (group id -> (instance_id, dp_rank)), from the definition."""
    scores = {keys[g]: n + c + d for g, n, c, d in rows}
    tuples = [(keys[g][0], keys[g][1], n, c, d) for g, n, c, d in rows]
    insts: dict = {}
    for g, n, c, d in rows:
        iid, dp = keys[g]
        matched = min((n + c + d) * bs, U32)
        inst = insts.setdefault(iid, {"longest_matched": 0, "DP": {}})
        inst["DP"][str(dp)] = {
            "matched_tokens": matched,
            "npu_blocks": n,
            "cpu_blocks": c,
            "disk_blocks": d,
        }
        inst["longest_matched"] = max(inst["longest_matched"], matched)
    return scores, tuples, {tenant: insts}


def test_the_definition_uses_the_schema_keys():
    assert INSTANCE_MATCH_KEYS == ("longest_matched", "DP")
    assert DP_MATCH_KEYS == ("matched_tokens", "npu_blocks", "cpu_blocks", "disk_blocks")


def _tables(keys):
    out = []
    for cls in NAME_IMPLS:
        names = cls()
        for inst, dp in keys:
            names.add(inst, dp)
        out.append(names)
    return out


def check_forms(rows_objs, tables, keys, tenant, bs):
    """Every form of every (rows, names) pair equals the definition's (C, twin, model)."""
    want = model_forms(rows_objs[0].tolist(), keys, tenant, bs)
    for rows in rows_objs:
        assert rows.tolist() == rows_objs[0].tolist()
        for names in tables:
            scores, tuples = rows.scores(names), rows.tuples(names)
            hits = rows.hits(names, DpHit)
            v3 = rows.v3(names, tenant, bs)
            assert (scores, tuples, v3) == want
            assert list(scores) == [k for k, _ in want[0].items()]  # row order
            assert hits == tuples and all(type(h) is DpHit for h in hits)
            assert all(type(t) is tuple for t in tuples)
            assert rows.hits(names, tuple) == tuples
            # the V3 dict orders instances by first row and DPs by row, as the JSON does
            assert [list(i["DP"]) for i in v3[tenant].values()] == [
                list(i["DP"]) for i in want[2][tenant].values()
            ]
            assert list(v3[tenant]) == list(want[2][tenant])


# -- strategies --------------------------------------------------------------------------------
NAME = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
COUNT = st.one_of(st.integers(0, 6), st.integers(250, 260), st.integers(0, U32))
BS = st.one_of(st.integers(0, 64), st.integers(0, U32), st.integers(U32, 2**70))


@st.composite
def named_answers(draw):
    """(keys, rows): instances with up to 64 DP ranks each, groups in a drawn order (an
    instance's groups need not be adjacent), rows over a subset of the groups."""
    insts = draw(st.lists(NAME, min_size=1, max_size=5, unique=True))
    ndp = draw(st.one_of(st.integers(1, 3), st.integers(1, 64)))
    keys = [(i, dp) for i in insts for dp in range(ndp)]
    keys = draw(st.permutations(keys))
    groups = draw(st.sets(st.integers(0, len(keys) - 1), max_size=len(keys)))
    rows = [(g, *draw(st.tuples(COUNT, COUNT, COUNT).filter(any))) for g in sorted(groups)]
    return keys, rows


@settings(max_examples=200, deadline=None)
@given(kr=named_answers(), tenant=NAME, bs=BS)
def test_forms_match_the_twin_and_the_definition(kr, tenant, bs):
    keys, rows = kr
    check_forms([cls(rows) for cls in ROW_IMPLS], _tables(keys), keys, tenant, bs)


@settings(max_examples=200, deadline=None)
@given(
    kr=named_answers(),
    k=st.one_of(st.none(), st.integers(1, 10)),
    pick=st.one_of(st.none(), st.lists(st.integers(0, 5), max_size=6)),
    seed=st.integers(0, 2**64 - 1),
    bs=BS,
)
def test_forms_of_selected_answers(kr, k, pick, seed, bs):
    """After ``top_k`` (the rotation's cut) and ``instances`` (mask or ranks): the same."""
    keys, rows = kr
    tables = _tables(keys)
    insts = list(dict.fromkeys(i for i, _ in keys))
    named = None if pick is None else [insts[p % len(insts)] for p in pick]

    def cuts(r):
        if named is None:
            return [r.select(k, None, seed)]
        rank, mask = tables[0].instances_rank(named), tables[1].instances_mask(named)
        return [r.select(k, None, 0, rank), r.select(k, mask, seed)]

    for c, p in zip(cuts(MatchRows(rows)), cuts(PyMatchRows(rows)), strict=True):
        assert k is None or len(c) <= k
        check_forms([c, p], tables, keys, "t", bs)


@pytest.mark.parametrize("rows_cls", ROW_IMPLS)
@pytest.mark.parametrize("names_cls", NAME_IMPLS)
def test_empty_answers(rows_cls, names_cls):
    names = names_cls()
    empty = rows_cls()
    assert empty.scores(names) == {} and empty.tuples(names) == []
    assert empty.hits(names, DpHit) == [] and empty.v3(names, "t", 16) == {"t": {}}
    names.add("a", 0)
    cut = rows_cls([(0, 1, 0, 0)]).select(None, b"\x00")
    assert cut.scores(names) == {} and cut.v3(names, "x", 1) == {"x": {}}


@pytest.mark.parametrize("rows_cls", ROW_IMPLS)
@pytest.mark.parametrize("names_cls", NAME_IMPLS)
def test_errors(rows_cls, names_cls):
    names = names_cls()
    names.add("a", 0)
    rows = rows_cls([(0, 1, 0, 0), (1, 2, 0, 0)])
    for form in (rows.scores, rows.tuples):
        with pytest.raises(IndexError):
            form(names)
    with pytest.raises(IndexError):
        rows.hits(names, DpHit)
    with pytest.raises(IndexError):
        rows.v3(names, "t", 1)
    one = rows_cls([(0, 1, 0, 0)])
    with pytest.raises(ValueError):
        one.v3(names, "t", -1)

    class Loose(tuple):  # has a __dict__: not the tuple's layout
        pass

    for bad in (Loose, int, list, "DpHit"):
        with pytest.raises(TypeError):
            one.hits(names, bad)

    class Pair(NamedTuple):  # any NamedTuple of five fields is fine
        a: str
        b: int
        c: int
        d: int
        e: int

    assert one.hits(names, Pair) == [Pair("a", 0, 1, 0, 0)]


def test_saturation_and_large_counts():
    names = GroupNames()
    names.add("a", 0)
    names.add("a", 1)
    rows = [(0, U32, U32, U32), (1, 0, 0, 1)]
    for cls in ROW_IMPLS:
        r = cls(rows)
        assert r.scores(names) == {("a", 0): 3 * U32, ("a", 1): 1}
        v3 = r.v3(names, "t", 2**80)
        assert v3["t"]["a"]["longest_matched"] == U32
        assert v3["t"]["a"]["DP"]["1"]["matched_tokens"] == U32
        assert r.v3(names, "t", 0)["t"]["a"]["DP"]["0"]["matched_tokens"] == 0


def test_keys_are_the_tables_own_objects_and_nothing_leaks():
    """A row's key costs no allocation: the scores' keys, the hits' instance ids and the V3
    DP keys are the name table's objects; and building the forms leaves no reference."""
    names = GroupNames()
    for g in range(300):
        names.add(f"inst-{g // 4}", g % 4)
    rows = MatchRows([(g, 1 + g % 300, g % 2, 0) for g in range(0, 300, 3)])
    scores = rows.scores(names)
    assert all(k is names.keys[g] for k, (g, *_) in zip(scores, rows.tolist(), strict=True))
    hits = rows.hits(names, DpHit)
    assert all(h[0] is names.keys[g][0] for h, (g, *_) in zip(hits, rows.tolist(), strict=True))
    v3 = rows.v3(names, "t", 16)
    dp_objs = {id(k) for inst in v3["t"].values() for k in inst["DP"]}
    assert dp_objs <= {id(s) for s in names.dp_keys}
    del scores, hits, v3
    gc.collect()
    before = [sys.getrefcount(o) for o in (*names.keys[:8], *names.dp_keys[:8])]
    for _ in range(200):
        rows.scores(names)
        rows.tuples(names)
        rows.hits(names, DpHit)
        rows.v3(names, "t", 16)
    gc.collect()
    assert [sys.getrefcount(o) for o in (*names.keys[:8], *names.dp_keys[:8])] == before


# -- QueryResult ---------------------------------------------------------------------------------
H = [0x1000 + i for i in range(8)]


def _filled(impl):
    ix = Index("m", "t", impl=impl)
    k = [WorkerKey(i, i, dp, m) for i, dp, m in (("a", 0, Medium.NPU), ("b", 0, Medium.CPU))]
    ix.store(k[0], None, [1, 2, 3], H[:3])
    ix.store(WorkerKey("a", "a", 7, Medium.NPU), None, [1, 2], H[:2])
    ix.store(k[1], None, [5, 6, 7, 8], H[:4])
    ix.store(WorkerKey("c", "c", 0, Medium.NPU), None, [9], H[:1])
    return ix


@pytest.mark.parametrize("impl", ["c", "py"])
def test_query_result_forms(impl):
    ix = _filled(impl)
    res = ix.query_by_hash(H[:6])
    want = [("a", 0, 3, 0, 0), ("a", 7, 2, 0, 0), ("b", 0, 0, 4, 0), ("c", 0, 1, 0, 0)]
    assert res.tuples() == want and list(res) == want and res.hits == want
    assert all(isinstance(h, DpHit) for h in res) and res.hits[2].cpu_blocks == 4
    assert res.scores() == {("a", 0): 3, ("a", 7): 2, ("b", 0): 4, ("c", 0): 1}
    assert (
        res.to_dict("t", 10)
        == model_forms([(g, *r[2:]) for g, r in enumerate(want)], [r[:2] for r in want], "t", 10)[2]
    )
    top = ix.query_by_hash(H[:6], top_k=2, instances=["c", "b", "a"])
    assert top.scores() == {("a", 0): 3, ("b", 0): 4} and len(top.tuples()) == 2
    only = ix.query_by_hash(H[:6], instances=["a"])
    assert only.scores() == {("a", 0): 3, ("a", 7): 2}
    # a QueryResult over DpHit rows (tests, tools) gives the same forms
    old = QueryResult([DpHit(*r) for r in want])
    assert old.scores() == res.scores() and old.tuples() == want and list(old) == want
    assert old.to_dict("t", 10) == res.to_dict("t", 10)
    assert all(type(t) is tuple for t in old.tuples())
