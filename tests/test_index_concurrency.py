"""One writer, many readers: readers never see a torn state.

The writer thread stores, truncates and clears chains of several workers while
reader threads match without the GIL. Every answer must be a state the writer
could have produced between two of its calls: for each worker, a depth d in
[1, N] whose breakpoint is exactly that worker's own engine hash of block d-1.
"""

import threading
import time

import pytest

from kvconductor._hash import hash_blocks

pytest.importorskip("kvconductor._index")

N = 64  # blocks per chain
WORKERS = 6
ROUNDS = 150


def _seqs(w):
    return [(w + 1) * 1_000_003 + i for i in range(N)]


@pytest.fixture
def chain():
    tokens = list(range(N * 4))
    return tokens, list(hash_blocks(tokens, 4))


def _run(writer, reader, n_readers=3):
    stop = threading.Event()
    errors = []

    def read_loop():
        try:
            while not stop.is_set():
                reader()
        except BaseException as ex:
            errors.append(ex)
            stop.set()

    readers = [threading.Thread(target=read_loop) for _ in range(n_readers)]
    for t in readers:
        t.start()
    try:
        writer()
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    assert not errors, errors[0]


def test_tree_readers_see_consistent_prefixes(chain):
    from kvconductor._tree import RadixTree

    _, H = chain
    tree = RadixTree()
    seen = {"answers": 0}

    def writer():
        for r in range(ROUNDS):
            for w in range(WORKERS):
                s = _seqs(w)
                tree.store(w, None, s, H)
                cut = (r * 7 + w * 5) % N
                tree.remove(w, s[cut:])
                if (r + w) % 5 == 0:
                    tree.clear(w)

    def reader():
        for w, depth, last in tree.match(H):
            assert 1 <= depth <= N
            assert last == _seqs(w)[depth - 1], (w, depth, last)
        seen["answers"] += 1

    _run(writer, reader)
    assert seen["answers"] > 0


def test_core_readers_see_consistent_tiers(chain):
    from kvconductor._index import CoreIndex

    tokens, H = chain
    core = CoreIndex()
    for w in range(WORKERS):
        core.set_worker(2 * w, w, 0)  # HBM worker of group w
        core.set_worker(2 * w + 1, w, 1)  # CPU worker of group w
    seen = {"answers": 0}

    def writer():
        for r in range(ROUNDS):
            for w in range(WORKERS):
                s = _seqs(w)
                cut = 1 + (r * 3 + w) % (N - 1)
                core.store(2 * w, None, s[:cut], H[:cut])
                core.store(2 * w + 1, s[cut - 1], s[cut:], H[cut:])
                core.remove(2 * w, s[cut // 2 : cut])
                if (r + w) % 4 == 0:
                    core.clear(2 * w + 1)

    def reader():
        for g, npu, cpu, disk in core.match_tokens(tokens, 4):
            assert 0 <= g < WORKERS
            assert disk == 0
            assert npu + cpu <= N
            assert npu >= 1  # a CPU tail is only reachable from the group's own HBM
        seen["answers"] += 1

    _run(writer, reader)
    assert seen["answers"] > 0


def test_match_releases_the_gil():
    """A long match in one thread must not stop a Python thread from running."""
    from kvconductor._index import CoreIndex

    core = CoreIndex()
    core.set_worker(0, 0, 0)
    n = 200_000
    tokens = list(range(n))
    core.store_tokens(0, None, list(range(1, n + 1)), tokens, 1)
    import array

    buf = array.array("I", tokens)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    t = threading.Thread(target=ticker)
    t.start()
    for _ in range(5):
        assert core.match_tokens(buf, 1) == [(0, n, 0, 0)]
    done.set()
    t.join()
    assert len(ticks) > 5


@pytest.mark.parametrize("kind", ["tree", "lower"])
def test_introspection_while_the_writer_grows_the_arrays(kind):
    """``worker_blocks``/``nbytes`` read the per-worker arrays that the writer realloc-s as
    workers appear: they take the read lock, so a reader sees 0 or 1 block for a worker,
    never freed memory (the ASan CI pass runs this)."""
    import random

    from kvconductor._lower import LowerTier
    from kvconductor._tree import RadixTree

    t = RadixTree() if kind == "tree" else LowerTier()
    nworkers = 3000
    done = threading.Event()
    bad: list = []

    def reader(seed):
        rnd = random.Random(seed)
        last = 0
        while not done.is_set():
            n = t.worker_blocks(rnd.randrange(nworkers))
            size = t.nbytes
            if n not in (0, 1) or size < last:
                bad.append((n, size, last))
            last = size

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    try:
        for w in range(nworkers):
            t.store(w, None, [w + 1], [w + 1])
    finally:
        done.set()
        for th in threads:
            th.join(10)
    assert bad == []
    assert all(t.worker_blocks(w) == 1 for w in range(0, nworkers, 97))


def test_reader_threads_keep_their_own_scratch_across_fleets():
    """A query's scratch is its reader thread's own (grown with the fleet, freed when the
    thread exits): threads that come and go, each querying a small and a wide index in
    turn (a sparse answer, then a dense one, then a miss), get every answer exact."""
    from array import array

    from kvconductor._index import CoreIndex

    def fleet(workers):
        c = CoreIndex()
        for w in range(workers):
            c.set_worker(w, w // 2, 0)  # two workers per group: the per-group maximum
            c.store(w, None, array("Q", [w + 1, 10**6 + w]), array("Q", [7, 100 + w % 3]))
            if w % 500 == 1:  # a root block six workers hold: a sparse answer of the wide
                c.store(w, None, array("Q", [2 * 10**6 + w]), array("Q", [55]))
        return c

    small, wide = fleet(6), fleet(3000)
    queries = [
        (small, array("Q", [7, 101])),
        (wide, array("Q", [7, 102])),
        (wide, array("Q", [7])),
        (small, array("Q", [99])),
        (wide, array("Q", [55, 3])),
    ]
    expected = [c.match_rows(q).tolist() for c, q in queries]
    assert expected[0] == [(0, 2, 0, 0), (1, 1, 0, 0), (2, 2, 0, 0)]
    assert len(expected[1]) == 1500 and expected[1][1] == (1, 2, 0, 0)
    assert expected[2] == [(g, 1, 0, 0) for g in range(1500)]
    assert expected[3] == []
    assert expected[4] == [(g, 1, 0, 0) for g in (0, 250, 500, 750, 1000, 1250)]
    errors = []

    def reader(k):
        try:
            for i in range(60):
                c, q = queries[(i + k) % len(queries)]
                got = c.match_rows(q).tolist()
                if got != expected[(i + k) % len(queries)]:
                    errors.append((k, i, len(got)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    for wave in range(3):
        threads = [threading.Thread(target=reader, args=(k + wave,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    small.close()
    wide.close()
