"""An answer's rows read in Python, the conversion alone (docs/api.md, "Reading an answer in
Python"): ``MatchRows`` of 8, 256 and 1,024 rows (the ``top_k=8`` answer, a wide one, every
round-robin engine) to a router's ``{(instance_id, dp_rank): depth}`` dict, to
``(instance_id, dp_rank, npu, cpu, disk)`` tuples, to ``DpHit`` rows and to the V3 dict,
each made in C, beside the same made in Python as before (``_py`` rows: one object per row
in Python). Not asserted: ``pytest bench/test_bench_answer_forms.py --benchmark-only``."""

import pytest

from kvconductor._encode import GroupNames
from kvconductor._index import MatchRows
from kvconductor._py.rows import v3_body
from kvconductor.index import DpHit

pytestmark = pytest.mark.benchmark(group="answer forms")

GROUPS = 1024


@pytest.fixture(scope="module")
def names():
    t = GroupNames()
    for g in range(GROUPS):
        t.add(f"engine-{g:04d}", 0)
    return t


@pytest.fixture(scope="module", params=[8, 256, 1024])
def rows(request):
    n = request.param
    step = GROUPS // n
    return MatchRows([(g, 1 + g % 5, 0, 0) for g in range(0, GROUPS, step)][:n])


def test_scores(benchmark, rows, names):
    out = benchmark(rows.scores, names)
    assert len(out) == len(rows)


def test_tuples(benchmark, rows, names):
    out = benchmark(rows.tuples, names)
    assert len(out) == len(rows)


def test_hits(benchmark, rows, names):
    out = benchmark(rows.hits, names, DpHit)
    assert len(out) == len(rows) and isinstance(out[0], DpHit)


def test_v3(benchmark, rows, names):
    out = benchmark(rows.v3, names, "default", 512)
    assert len(out["default"]) == len(rows)


# -- the same made in Python, as QueryResult did before (for comparison) ----------------------
def _py_hits(rows, names):
    keys = names.keys
    return [DpHit(keys[g][0], keys[g][1], n, c, d) for g, n, c, d in rows.tolist()]


def test_python_hits(benchmark, rows, names):
    out = benchmark(_py_hits, rows, names)
    assert len(out) == len(rows)


def test_python_scores_from_hits(benchmark, rows, names):
    def scores():
        return {
            (h.instance_id, h.dp_rank): h.npu_blocks + h.cpu_blocks + h.disk_blocks
            for h in _py_hits(rows, names)
        }

    assert len(benchmark(scores)) == len(rows)


def test_python_v3_from_hits(benchmark, rows, names):
    def v3():
        hits = _py_hits(rows, names)
        return v3_body(((h[0], str(h[1]), h[2], h[3], h[4]) for h in hits), "default", 512)

    assert len(benchmark(v3)["default"]) == len(rows)
