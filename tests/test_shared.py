"""kvconductor.state.shared: the owner's indexes in the shared arena, read by other processes.

Every answer a view gives is compared with the owner's own ``Index`` (the in-process
answer) at quiescence; the child-process tests attach a real second interpreter at the
arena's fixed address.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from kvconductor import _index
from kvconductor.keys import Medium, WorkerKey
from kvconductor.state.conductor import Conductor, ConductorConfig
from kvconductor.state.shared import SharedIndexes, SharedView

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="shared mode needs Linux (memfd, futex)"
)

BS = 16


@pytest.fixture
def owner():
    """A started Conductor in shared mode; stopped and unmapped afterwards."""
    c = Conductor(ConductorConfig())
    c.shared = SharedIndexes()
    c.start()
    yield c
    c.stop()
    c.shared.close()


def _key(i: int, dp: int = 0, medium: Medium = Medium.NPU) -> WorkerKey:
    return WorkerKey(f"inst-{i}", "", dp, medium)


def _store(c: Conductor, key: WorkerKey, hashes: list[int], toks: list[int]) -> int:
    """Store ``toks`` for ``key`` in index (m, t), on the ingest thread."""
    return c.call(lambda: c.get_or_create_index("m", "t").store_tokens(key, None, hashes, toks, BS))


def _answer(result) -> list:
    return sorted(tuple(h) for h in result.hits)


def _run_child(owner: Conductor, code: str, *args: str, timeout: float = 60) -> str:
    fds = owner.shared.fds()
    prog = textwrap.dedent(
        """
        import sys
        from kvconductor.state.shared import SharedView
        view = SharedView.attach(int(sys.argv[1]), int(sys.argv[2]))
        """
    ) + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", prog, str(fds[0]), str(fds[1]), *args],
        pass_fds=fds,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_view_answers_what_the_owner_holds(owner):
    rng = random.Random(7)
    prompts = [[rng.randrange(50_000) for _ in range(BS * rng.randrange(1, 9))] for _ in range(6)]

    def load():
        for i, toks in enumerate(prompts):
            idx = owner.get_or_create_index("m", "t" if i % 2 else "u")
            n = len(toks) // BS
            for w in range(1 + i % 3):
                key = _key(w, dp=i % 2, medium=Medium.NPU if w < 2 else Medium.CPU)
                if key.medium is Medium.NPU:
                    idx.store_tokens(key, None, [1000 * i + b for b in range(n)], toks, BS)
                else:
                    idx.offload([1000 * i + b for b in range(n)], [0] * n, None)

    owner.call(load)
    view = SharedView(owner.shared.arena, owner.shared.lock)
    for tenant in ("t", "u"):
        mine = owner.get_index("m", tenant)
        theirs = view.get_index("m", tenant)
        assert theirs is not None and theirs.group_keys == mine.group_keys
        for i, toks in enumerate(prompts):
            got = _answer(theirs.query(toks, BS, 1337))
            assert got == _answer(mine.query(toks, BS))
            assert bool(got) == ((tenant == "t") == bool(i % 2))  # stored where it was sent
    assert view.get_index("m", "nope") is None


def test_a_child_process_reads_the_same_structures(owner):
    toks = list(range(8 * BS))
    key = _key(1)

    def load():
        idx = owner.get_or_create_index("m", "t")
        idx.store_tokens(key, None, list(range(1, 9)), toks, BS)
        return idx.core.address()

    addr = owner.call(load)
    assert owner.shared.arena.address <= addr < owner.shared.arena.address + (64 << 30)
    out = _run_child(
        owner,
        """
        idx = view.get_index("m", "t")
        idx.core.check_invariants()
        print(sorted(tuple(h) for h in idx.query(list(range(8 * 16)), 16, 1337).hits))
        print(hex(idx.core.address()))
        """,
    )
    hits, child_addr = out.strip().splitlines()
    assert hits == str(_answer(owner.get_index("m", "t").query(toks, BS)))
    assert hits == str([("inst-1", 0, 8, 0, 0)])
    assert int(child_addr, 16) == addr  # same structures, not a copy


def test_new_groups_and_dropped_indexes_reach_the_view(owner):
    toks = list(range(2 * BS))
    view = SharedView(owner.shared.arena, owner.shared.lock)
    assert view.get_index("m", "t") is None
    _store(owner, _key(1), [1, 2], toks)
    first = view.get_index("m", "t")
    assert _answer(first.query(toks, BS, 1337)) == [("inst-1", 0, 2, 0, 0)]
    old_core = first.core
    # a second group: published before its blocks, so every answer can name it
    _store(owner, _key(2), [1, 2], toks)
    assert _answer(first.query(toks, BS, 1337)) == [("inst-1", 0, 2, 0, 0), ("inst-2", 0, 2, 0, 0)]
    with pytest.raises(_index.StaleIndexError):
        old_core.match_tokens(toks, BS, 1337)  # built from an older directory
    owner.call(owner.drop_index, ("m", "t"))
    assert view.get_index("m", "t") is None
    assert _answer(first.query(toks, BS, 1337)) == []  # a handle kept across the drop


def test_block_sizes_and_lora_seeds_are_published(owner):
    view = SharedView(owner.shared.arena, owner.shared.lock)

    def change():
        owner.get_or_create_index("m", "t")
        owner.note_lora("m", "t", 99)

    owner.call(change)
    assert view.get_index("m", "t") is not None
    assert view.lora_seeds == {("m", "t"): frozenset({99})}


def test_only_the_writer_thread_writes(owner):
    idx = owner.call(lambda: owner.get_or_create_index("m", "t"))
    with pytest.raises(RuntimeError, match="writer thread"):
        idx.store_tokens(_key(1), None, [1], list(range(BS)), BS)
    with pytest.raises(RuntimeError, match="writer thread"):
        _index.CoreIndex()
    view = SharedView(owner.shared.arena, owner.shared.lock)
    with pytest.raises(RuntimeError, match="read-only"):
        view.get_index("m", "t").core.set_worker(0, 0, 0)


def test_closed_index_answers_empty_and_frees_its_blocks(owner):
    before = owner.shared.arena.stats()["live_blocks"]

    def make():
        idx = owner.get_or_create_index("m", "t")
        idx.store_tokens(_key(1), None, list(range(1, 65)), list(range(64 * BS)), BS)
        return idx

    idx = owner.call(make)
    assert owner.shared.arena.stats()["live_blocks"] > before
    owner.call(owner.drop_index, ("m", "t"))
    assert idx.core.closed
    assert idx.query(list(range(BS)), BS).hits == []
    assert idx.sizes()["hbm_pairs"] == 0
    with pytest.raises(_index.IndexClosedError):
        owner.call(idx.store_tokens, _key(1), None, [1], list(range(BS)), BS)
    # the dropped index's blocks went back; what is left is the directory
    assert owner.shared.arena.stats()["live_blocks"] == before
    owner.shared.arena.check_invariants()


def test_a_reader_killed_inside_its_read_section_does_not_wedge_the_writer(owner):
    owner.call(lambda: owner.get_or_create_index("m", "t"))
    fds = owner.shared.fds()
    prog = textwrap.dedent(
        """
        import os, sys, time
        from kvconductor._shlock import SharedLock
        lock = SharedLock.attach(int(sys.argv[1]))
        lock.read_enter()
        print("inside", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", prog, str(fds[1])], pass_fds=fds, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "inside"
        done = threading.Event()

        def write():
            owner.get_index("m", "t").store_tokens(_key(1), None, [1], list(range(BS)), BS)
            done.set()

        fut = threading.Thread(target=lambda: owner.call(write, timeout=None), daemon=True)
        fut.start()
        # the writer is waiting for the reader's slot; the reader dies there
        assert not done.wait(0.3)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert done.wait(30), "the writer stayed wedged behind a dead reader"
        fut.join(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert owner.shared.stats()["reclaimed_reader_slots"] >= 1
    assert _answer(owner.get_index("m", "t").query(list(range(BS)), BS)) == [("inst-1", 0, 1, 0, 0)]


def test_the_arena_grows_while_a_child_reads(owner):
    """A child queries in a loop while the owner stores enough to grow the arena
    (ftruncate of the memfd, same mapping); at quiescence it answers like the owner."""
    rng = random.Random(3)
    toks = [rng.randrange(1 << 20) for _ in range(64 * BS)]
    owner.call(lambda: owner.get_or_create_index("m", "t"))
    committed0 = owner.shared.arena.stats()["committed"]
    fds = owner.shared.fds()
    prog = textwrap.dedent(
        """
        import sys, time
        from kvconductor.state.shared import SharedView
        view = SharedView.attach(int(sys.argv[1]), int(sys.argv[2]))
        toks = [int(t) for t in sys.argv[3].split(",")]
        n = 0
        while True:
            idx = view.get_index("m", "t")
            r = idx.query(toks, 16, 1337)
            n += 1
            if sys.stdin.readline().strip() == "stop":
                break
        idx = view.get_index("m", "t")
        idx.core.check_invariants()
        print(sorted(tuple(h) for h in idx.query(toks, 16, 1337).hits), n)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", prog, str(fds[0]), str(fds[1]), ",".join(map(str, toks))],
        pass_fds=fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:

        def grow(i):
            idx = owner.get_index("m", "t")
            base = 1 + i * 10_000
            stream = [rng.randrange(1 << 20) for _ in range(2000 * BS)]
            idx.store_tokens(_key(i), None, list(range(base, base + 2000)), stream, BS)
            if i % 4 == 0:
                idx.store_tokens(_key(i), None, list(range(base + 5000, base + 5064)), toks, BS)

        for i in range(24):
            owner.call(grow, i)
            child.stdin.write("go\n")
            child.stdin.flush()
        child.stdin.write("stop\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0
    assert owner.shared.arena.stats()["committed"] > committed0
    hits, n = out.strip().rsplit(" ", 1)
    expect = _answer(owner.get_index("m", "t").query(toks, BS))
    assert len(expect) == 6 and hits == str(expect)
    assert int(n) == 25


def test_workers_on_other_threads_use_their_own_slots(owner):
    toks = list(range(4 * BS))
    _store(owner, _key(1), [1, 2, 3, 4], toks)
    view = SharedView(owner.shared.arena, owner.shared.lock)
    results = []

    def reader():
        for _ in range(200):
            results.append(_answer(view.get_index("m", "t").query(toks, BS, 1337)))

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(50):  # writes interleave with the readers
        owner.call(owner.get_index("m", "t").store_tokens, _key(2 + i), None, [1], toks[:BS], BS)
    for t in threads:
        t.join()
    assert len(results) == 800
    assert all(r[0] == ("inst-1", 0, 4, 0, 0) for r in results)
    final = _answer(view.get_index("m", "t").query(toks, BS, 1337))
    assert final == _answer(owner.get_index("m", "t").query(toks, BS))
    assert len(final) == 51


def test_a_write_batch_holds_readers_once_and_nests_the_writes(owner):
    toks = list(range(2 * BS))
    _store(owner, _key(1), [1, 2], toks)
    view = SharedView(owner.shared.arena, owner.shared.lock)
    batch = owner.shared.batch()
    owner.call(batch.__enter__)
    try:
        # writes and a directory publish inside the batch nest in its section
        _store(owner, _key(2), [1, 2], toks)
        owner.call(owner.shared.publish, owner)
        done = threading.Event()
        got = []

        def read():
            got.append(_answer(view.get_index("m", "t").query(toks, BS, 1337)))
            done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert not done.wait(0.3), "a reader got in while the write batch was held"
    finally:
        owner.call(batch.__exit__, None, None, None)
    assert done.wait(30)
    assert got == [[("inst-1", 0, 2, 0, 0), ("inst-2", 0, 2, 0, 0)]]
    with pytest.raises(RuntimeError, match="outside"):
        owner.call(_index.shared_write_exit)
    with pytest.raises(RuntimeError, match="writer thread"):
        _index.shared_write_enter()  # not the ingest thread


def test_a_view_runs_no_python_inside_a_read_section(owner):
    """A worker thread inside a read section must not wait for the GIL (another thread
    may hold it for a long parse), or the writer, and with it every reader, would wait
    too, and a healthy worker could pass for a stalled one: the directory is copied
    inside one GIL-free section, so no Python code of the view runs inside one."""
    _store(owner, _key(1), [1], list(range(BS)))

    class Spy:
        """The view's arena, checking on every Python-level read that no section is held."""

        def __init__(self, arena) -> None:
            self.arena = arena
            self.address = arena.address
            self.inside = []

        def read(self, addr: int, n: int) -> bytes:
            self.inside.append(owner.shared.lock.stats()["active"])
            return self.arena.read(addr, n)

        def __getattr__(self, name: str):
            return getattr(self.arena, name)

    spy = Spy(owner.shared.arena)
    view = SharedView(spy, owner.shared.lock)
    _store(owner, _key(2), [1], list(range(BS)))  # a new group: a new directory
    assert view.get_index("m", "t") is not None and view.generation == owner.shared.generation
    assert view.reloads == 2
    assert set(spy.inside) <= {0}, spy.inside
    got = _answer(view.get_index("m", "t").query(list(range(BS)), BS, 1337))
    assert got == [("inst-1", 0, 1, 0, 0), ("inst-2", 0, 1, 0, 0)]


@pytest.mark.slow
def test_long_queries_during_writes_answer_within_the_states_they_saw(owner):
    """Child processes query a long prompt back to back (its HBM walk takes several
    steps, between which the writer gets in) while the owner keeps cutting and
    re-storing the tail of one worker's copy (the path's nodes freed and made again)
    and storing and dropping unrelated chains (freed nodes reused elsewhere). Every
    answer is checked against the model of what a reader may see: a worker that
    held the same blocks throughout answers exactly them, one that changed answers a
    depth between its shortest and longest copy, nobody else appears; at quiescence
    the children answer what the owner does."""
    n = 5 * 2048 + 100  # blocks: several steps of a worker's walk
    half, low = n // 2, n // 2 + 1500
    rng = random.Random(11)
    doc = [rng.randrange(1, 1 << 20) for _ in range(n * BS)]
    ehs = list(range(1, n + 1))
    _store(owner, _key(0), ehs[:half], doc[: half * BS])  # stable: half the prompt
    _store(owner, _key(1), ehs, doc)  # changes: n or low blocks
    fds = owner.shared.fds()
    prog = textwrap.dedent(
        """
        import sys
        from kvconductor.state.shared import SharedView
        view = SharedView.attach(int(sys.argv[1]), int(sys.argv[2]))
        n, half, low, seed = (int(x) for x in sys.argv[3:7])
        import random
        rng = random.Random(seed)
        doc = [rng.randrange(1, 1 << 20) for _ in range(n * 16)]
        stop = open(sys.argv[7], "rb")
        count = 0
        while True:
            last = stop.read(1)
            hits = {h.instance_id: h.npu_blocks for h in
                    view.get_index("m", "t").query(doc, 16, 1337).hits}
            if last:
                from kvconductor import _index
                yields, restarts = _index._query_counters()
                print("final", sorted(hits.items()), count, yields, flush=True)
                print("restarts", restarts, file=sys.stderr)
                break
            assert hits.get("inst-0") == half, hits
            assert low <= hits.get("inst-1", -1) <= n, hits
            assert set(hits) == {"inst-0", "inst-1"}, hits
            count += 1
        """
    )
    tmp_stop = tempfile.NamedTemporaryFile(prefix="kvc-test-stop-")
    stop = tmp_stop.name
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                prog,
                str(fds[0]),
                str(fds[1]),
                str(n),
                str(half),
                str(low),
                "11",
                stop,
            ],
            pass_fds=fds,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:

        def churn(i):
            idx = owner.get_index("m", "t")
            idx.remove(_key(1), ehs[low:])  # the tail's nodes are freed (only inst-1 held them)
            base = 1_000_000 + i * 10_000
            other = [rng.randrange(1, 1 << 20) for _ in range(1500 * BS)]
            idx.store_tokens(_key(2), None, list(range(base, base + 1500)), other, BS)
            idx.store_tokens(_key(1), ehs[low - 1], ehs[low:], doc[low * BS :], BS)
            idx.clear(_key(2))

        for i in range(150):
            owner.call(churn, i)
            assert all(c.poll() is None for c in children), [c.communicate() for c in children]
        tmp_stop.write(b"x")
        tmp_stop.flush()
        outs = [c.communicate(timeout=60) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        tmp_stop.close()
    expect = sorted(
        (h.instance_id, h.npu_blocks) for h in owner.get_index("m", "t").query(doc, BS).hits
    )
    assert expect == [("inst-0", half), ("inst-1", n)]
    for c, (out, err) in zip(children, outs, strict=True):
        assert c.returncode == 0, err
        final, rest = out.strip().split(" ", 1)
        hits, count, yields = rest.rsplit(" ", 2)
        assert final == "final" and hits == str(expect)
        # the walks let the writer in between their steps (the writer never waited for
        # a whole long query)
        assert int(count) > 0 and int(yields) > 0
