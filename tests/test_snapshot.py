"""Warm restart: ``--snapshot-dir`` (kvconductor/snapshot.py, the dump format version 2).

In process: the snapshot store (atomic files, the newest kept, corrupt ones refused)
and a Hypothesis differential test that a snapshot plus the events after it gives the
same index as every event applied to one conductor. Through real servers and a real
ZeroMQ vLLM publisher with a replay ring: a restart (SIGTERM, SIGKILL) resumes every
source from its snapshot cursor, with no re-registration and no lost batch; a corrupt
snapshot is refused and the older one loaded; a publisher that restarted while the
service was down is detected and its old blocks age out.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor.ingest.http_events import normalize_events
from kvconductor.schema import RegisterRequest, UnregisterRequest, events_decoder
from kvconductor.state import dump, snapshot
from kvconductor.state.conductor import Conductor, ConductorConfig
from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import Server, dp_entry, register_engine, running

BS = 4


# -- the store --------------------------------------------------------------------------
def _conductor() -> Conductor:
    c = Conductor(ConductorConfig(maintenance_interval=3600), subscriptions=dump._NoSubscriptions)
    c.start()
    return c


def _register(c: Conductor, instance: str, dp: int = 0) -> None:
    req = RegisterRequest(
        instance_id=instance, engine_type="vLLM", modelname="qwen", block_size=BS, dp_rank=dp
    )
    c.call(c.register, req)


def _post(c: Conductor, instance: str, events: list[dict]) -> None:
    batch = events_decoder.decode(msgspec.json.encode({"instance_id": instance, "events": events}))
    c.call(c.apply_events, batch, normalize_events(batch))


def _stored(eid: int, hashes: list[int], tokens: list[int], parent=None, medium="GPU", dp=0):
    return {
        "event_id": eid,
        "dp_rank": dp,
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "medium": medium,
    }


def _snapshot_files(directory) -> list[str]:
    """The snapshot files of a directory (not its lock file), sorted by name."""
    return sorted(
        n for n in os.listdir(directory) if n.startswith("snapshot-") and n.endswith(".kvc")
    )


def _summary(c: Conductor) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "bytes"} for s in c.call(c.workers)["indexer"]]


def _write(store: snapshot.SnapshotStore, c: Conductor) -> str:
    """Write a snapshot of ``c`` into ``store``; its path."""
    snap = c.call(dump.snapshot, c)
    return store.write(lambda counter: dump.encode(snap, counter=counter))[0]


def test_store_writes_atomically_and_keeps_the_two_newest(tmp_path):
    c = _conductor()
    try:
        _register(c, "a")
        _post(c, "a", [_stored(0, [11, 12], list(range(8)))])
        store = snapshot.SnapshotStore(str(tmp_path / "snaps"))
        store.prepare()
        (tmp_path / "snaps" / ".snapshot-old.tmp").write_bytes(b"half")
        store.prepare()  # an interrupted write's temporary is removed
        assert _snapshot_files(tmp_path / "snaps") == []
        paths = [_write(store, c) for _ in range(3)]
        names = _snapshot_files(tmp_path / "snaps")
        assert names == sorted(os.path.basename(p) for p in paths[1:])
        assert [
            re.fullmatch(r"snapshot-(\d{12})-\d{8}T\d{6}\.\d{6}Z\.kvc", n)[1] for n in names
        ] == [
            "000000000002",
            "000000000003",
        ]
        assert store.snapshots() == paths[:0:-1]  # newest first

        # a write that fails half way leaves neither a snapshot nor a temporary
        def failing():
            yield b"\xc6\x00\x00\x00\x01\xc0"
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space left"):
            store.write(lambda counter: failing())
        assert _snapshot_files(tmp_path / "snaps") == names

        # the newest is corrupt: refused, the older one loads
        newest = tmp_path / "snaps" / names[-1]
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
        d = _conductor()
        try:
            got = snapshot.warm_start(d, store)
            assert got is not None and got["path"] == str(tmp_path / "snaps" / names[0])
            assert got["registrations"] == 1 and got["indexes"] == 1
            assert _summary(d) == _summary(c)
        finally:
            d.stop()
        # the refused one is kept aside, out of the rotation: the next write keeps the
        # good one beside the new one
        assert _snapshot_files(tmp_path / "snaps") == [names[0]]
        assert (tmp_path / "snaps" / (names[-1] + ".refused")).read_bytes() == bytes(data)
        newer = _write(store, c)
        assert _snapshot_files(tmp_path / "snaps") == [names[0], os.path.basename(newer)]
        store.release()
    finally:
        c.stop()


class _Clock:
    """Stands in for the ``datetime`` module of :mod:`kvconductor.state.snapshot`: ``now``
    answers :attr:`at`, a time the test steps."""

    timezone = datetime.timezone

    def __init__(self, at: datetime.datetime) -> None:
        self.at = at
        clock = self

        class _DateTime(datetime.datetime):
            @classmethod
            def now(cls, tz=None):
                return clock.at

        self.datetime = _DateTime


def test_the_newest_snapshot_is_the_highest_counter_not_the_latest_clock(tmp_path, monkeypatch):
    utc = datetime.timezone.utc
    clock = _Clock(datetime.datetime(2030, 1, 1, tzinfo=utc))
    monkeypatch.setattr(snapshot, "datetime", clock)
    c = _conductor()
    try:
        store = snapshot.SnapshotStore(str(tmp_path))
        store.prepare()
        _register(c, "a")
        first = _write(store, c)
        clock.at = datetime.datetime(2020, 1, 1, tzinfo=utc)  # the clock stepped back
        _register(c, "b")
        second = _write(store, c)
        assert store.snapshots() == [second, first]
        assert [dump.verify(dump.file_chunks(p))["counter"] for p in (first, second)] == [1, 2]
        store.release()
        # the next process: the same order, and it counts on from the highest
        again = snapshot.SnapshotStore(str(tmp_path))
        again.prepare()
        assert again.snapshots() == [second, first]
        d = _conductor()
        try:
            got = snapshot.warm_start(d, again)
            assert got is not None and got["path"] == second and got["registrations"] == 2
        finally:
            d.stop()
        third = _write(again, c)
        assert dump.verify(dump.file_chunks(third))["counter"] == 3
        assert again.snapshots() == [third, second]  # the lowest counter was deleted
        again.release()
    finally:
        c.stop()


def test_snapshots_written_before_counters_load_and_count_as_older(tmp_path):
    """A snapshot of an earlier kvconductor (no counter in its header, the UTC time in
    its name) still loads; any snapshot with a counter is newer."""
    c = _conductor()
    try:
        _register(c, "a")
        legacy = tmp_path / "snapshot-20991231T000000.000000Z.kvc"
        legacy.write_bytes(b"".join(dump.write_dump(c)))
        assert "counter" not in dump.verify([legacy.read_bytes()])
        store = snapshot.SnapshotStore(str(tmp_path))
        store.prepare()
        assert store.snapshots() == [str(legacy)]
        d = _conductor()
        try:
            assert snapshot.warm_start(d, store)["path"] == str(legacy)
        finally:
            d.stop()
        _register(c, "b")
        newer = _write(store, c)
        assert dump.verify(dump.file_chunks(newer))["counter"] == 1
        assert store.snapshots() == [newer, str(legacy)]
        store.release()
    finally:
        c.stop()


def test_one_store_per_directory(tmp_path):
    """The lock: a second store of the directory (another process, or this one) is
    refused with the holder's pid, and leaves the holder's temporary files alone."""
    first = snapshot.SnapshotStore(str(tmp_path / "d"))
    first.prepare()
    tmp = tmp_path / "d" / ".snapshot-00000000000000000001-20260101T000000.000000Z.tmp"
    tmp.write_bytes(b"being written")
    second = snapshot.SnapshotStore(str(tmp_path / "d"))
    with pytest.raises(snapshot.DirectoryInUse) as ex:
        second.prepare()
    assert ex.value.pid == os.getpid()
    assert str(ex.value) == (
        f"snapshot directory {tmp_path / 'd'} is in use by kv-conductor pid {os.getpid()} "
        f"(lock {tmp_path / 'd' / 'lock'})"
    )
    assert tmp.exists()
    first.release()
    second.prepare()  # free again: the interrupted write's temporary is removed now
    assert not tmp.exists()
    assert (tmp_path / "d" / "lock").read_text() == f"{os.getpid()}\n"
    second.release()


def test_a_registration_change_is_snapshotted_within_the_follow_delay_coalesced(tmp_path):
    """Periodic interval 1 h, follow 0.3 s: three registrations at once are one snapshot
    about 0.3 s later; an unchanged re-registration writes none; an unregistration one."""
    store = snapshot.SnapshotStore(str(tmp_path))
    store.prepare()
    c = _conductor()
    snapper = snapshot.Snapshotter(c, store, 3600, follow=0.3)
    c.attach_snapshotter(snapper)
    snapper.start()
    try:
        t0 = time.monotonic()
        for name in ("a", "b", "c"):
            _register(c, name)
        wait_until(lambda: snapper.stats.written == 1, timeout=5, msg="one snapshot")
        assert 0.25 <= time.monotonic() - t0 < 2.0
        time.sleep(0.6)
        assert snapper.stats.written == 1  # coalesced: not one per change
        loaded = dump.load_file(store.snapshots()[0])
        assert sorted(w["instance_id"] for w in loaded["workers"]) == ["a", "b", "c"]
        _register(c, "a")  # the Coordinator's re-register timer: nothing changed
        time.sleep(0.6)
        assert snapper.stats.written == 1
        unreg = UnregisterRequest(
            instance_id="b", engine_type="vLLM", modelname="qwen", block_size=BS, dp_rank=0
        )
        c.call(c.unregister, unreg)
        wait_until(lambda: snapper.stats.written == 2, timeout=5, msg="a second snapshot")
        loaded = dump.load_file(store.snapshots()[0])
        assert sorted(w["instance_id"] for w in loaded["workers"]) == ["a", "c"]
    finally:
        snapper.stop(final=False)
        c.stop()


def test_no_follow_snapshot_with_interval_zero(tmp_path):
    """``--snapshot-interval-secs 0``: only at shutdown, registration changes included."""
    store = snapshot.SnapshotStore(str(tmp_path))
    store.prepare()
    c = _conductor()
    snapper = snapshot.Snapshotter(c, store, 0, follow=0.1)
    c.attach_snapshotter(snapper)
    snapper.start()
    try:
        _register(c, "a")
        time.sleep(0.5)
        assert snapper.stats.written == 0 and store.snapshots() == []
    finally:
        snapper.stop(final=True)
        c.stop()
    assert snapper.stats.written == 1


def test_no_valid_snapshot_starts_empty(tmp_path, caplog):
    store = snapshot.SnapshotStore(str(tmp_path))
    (tmp_path / "snapshot-20260101T000000.000000Z.kvc").write_bytes(
        dump._frame({"format": "kvconductor-dump", "version": 9})
    )
    (tmp_path / "snapshot-20250101T000000.000000Z.kvc").write_bytes(b"not a dump at all")
    c = _conductor()
    try:
        with caplog.at_level("ERROR", logger="kvconductor.snapshot"):
            assert snapshot.warm_start(c, store) is None
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [
            f"snapshot {tmp_path}/snapshot-20260101T000000.000000Z.kvc refused: unsupported "
            "dump version 9: this kvconductor reads versions 1 and 2 (kept as "
            "snapshot-20260101T000000.000000Z.kvc.refused)",
            f"snapshot {tmp_path}/snapshot-20250101T000000.000000Z.kvc refused: not a "
            "kvconductor dump: byte 0x6e where a record starts (kept as "
            "snapshot-20250101T000000.000000Z.kvc.refused)",
        ]
        assert c.call(c.workers)["workers"] == [] and c.indexes == {}
    finally:
        c.stop()


# -- snapshot + tail == full replay (Hypothesis) -------------------------------------------
ALPHABET = [[2000 + 4 * b + i for i in range(BS)] for b in range(5)]
INSTANCES = [("i0", 0), ("i0", 1), ("i1", 0)]
MEDIA = ["GPU", "GPU", "CPU", "DISK"]


@st.composite
def event_batches(draw):
    """Batches of BlockStored (fresh chains or children of a block stored before),
    BlockRemoved and AllBlocksCleared for three (instance, DP)s."""
    batches = []
    stored: dict[tuple[str, int], list[tuple[int, list[int]]]] = {k: [] for k in INSTANCES}
    next_hash = 1
    for eid in range(draw(st.integers(1, 14))):
        inst, dp = draw(st.sampled_from(INSTANCES))
        kind = draw(st.sampled_from(["store", "store", "store", "child", "remove", "clear"]))
        held = stored[(inst, dp)]
        medium = draw(st.sampled_from(MEDIA))
        if kind == "child" and held:
            ph, ptoks = draw(st.sampled_from(held))
            blk = draw(st.sampled_from(ALPHABET))
            ev = _stored(eid, [next_hash], blk, parent=ph, medium=medium, dp=dp)
            held.append((next_hash, ptoks + blk))
            next_hash += 1
        elif kind == "remove" and held:
            gone = draw(st.lists(st.sampled_from([h for h, _ in held]), min_size=1, max_size=3))
            ev = {
                "event_id": eid,
                "dp_rank": dp,
                "type": "BlockRemoved",
                "block_hashes": gone,
                "medium": medium,
            }
        elif kind == "clear":
            ev = {"event_id": eid, "dp_rank": dp, "type": "AllBlocksCleared"}
        else:
            chain = draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4))
            hashes = list(range(next_hash, next_hash + len(chain)))
            next_hash += len(chain)
            toks: list[int] = []
            for h, blk in zip(hashes, chain, strict=True):
                toks += blk
                held.append((h, list(toks)))
            ev = _stored(eid, hashes, [t for b in chain for t in b], medium=medium, dp=dp)
        batches.append((inst, [ev]))
    cut = draw(st.integers(0, len(batches)))
    prompts = [toks for held in stored.values() for _, toks in held] + [ALPHABET[0] * 3]
    return batches, cut, prompts


def _answers(c: Conductor, prompts: list[list[int]]) -> list[dict]:
    idx = c.get_index("qwen", "default")
    return [idx.query(p, BS).to_dict("default", BS) for p in prompts]


@settings(
    max_examples=int(os.environ.get("KVC_DIFFERENTIAL_EXAMPLES", "200")) // 4,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(event_batches())
def test_snapshot_plus_tail_equals_full_replay(case):
    batches, cut, prompts = case
    full, part = _conductor(), _conductor()
    warm = _conductor()
    try:
        for c in (full, part):
            for inst in ("i0", "i1"):
                for dp in (0, 1):
                    _register(c, inst, dp)
        for inst, events in batches:
            _post(full, inst, events)
        for inst, events in batches[:cut]:
            _post(part, inst, events)
        data = b"".join(dump.write_dump(part))
        assert warm.call(dump.load_dump, warm, [data])["registrations"] == 4
        for inst, events in batches[cut:]:
            _post(warm, inst, events)
        assert _summary(warm) == _summary(full)
        assert _answers(warm, prompts) == _answers(full, prompts)
    finally:
        for c in (full, part, warm):
            c.stop()


# -- real servers ----------------------------------------------------------------------------
V = schema("vllm", "0.33.0")


def _chain(i: int) -> tuple[bytes, list[int]]:
    """Batch storing chain ``i`` (two blocks, engine hashes 100i+1, 100i+2) and its tokens."""
    toks = [7000 + 8 * i + j for j in range(2 * BS)]
    return V.batch([V.stored([100 * i + 1, 100 * i + 2], None, toks, BS, medium="GPU")]), toks


def _npu(server, toks: list[int]) -> int:
    r = server.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": toks})
    assert r.status_code == 200, r.text
    e = dp_entry(r.json(), "eng")
    return 0 if e is None else e["npu_blocks"]


def _expect(server, want: dict[int, int], msg: str) -> None:
    toks = {i: _chain(i)[1] for i in want}
    wait_until(lambda: all(_npu(server, toks[i]) == n for i, n in want.items()), msg=msg)


def _metric(server, name: str) -> float:
    text = server.http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _engine(server, pub: FakePublisher) -> None:
    """Register engine ``eng`` publishing at ``pub``, with its replay endpoint, and wait
    until its subscription is live (a PUB drops what it sends before that)."""
    register_engine(
        server, "eng", medium_endpoints={"npu": pub.url}, replay_endpoint=pub.replay_url
    )
    wait_until(
        lambda: [s["state"] for s in server.http.get("/workers").json()["sources"]] == ["live"],
        msg="the engine's subscription live",
    )


def _published(pub: FakePublisher, batches: list[bytes]) -> None:
    for b in batches:
        pub.publish(b)


def test_sigterm_restart_resumes_each_source_from_its_cursor(tmp_path):
    snaps = tmp_path / "snaps"
    pub = FakePublisher(replay=True)
    try:
        with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
            _engine(a, pub)
            _published(pub, [_chain(i)[0] for i in range(5)])  # seq 0-4
            pub.publish(V.batch([V.removed([102], medium="GPU")]))  # seq 5: chain 1 cut to 1
            _expect(a, {0: 2, 1: 1, 4: 2}, "first batches indexed")
            assert _snapshot_files(snaps) == []  # interval 0: only at shutdown
        log = a.log()
        assert "snapshot written path=" in log and " sources=1 " in log, log
        assert len(_snapshot_files(snaps)) == 1
        # while the service is down, the engine goes on (its ring keeps the batches)
        _published(pub, [_chain(i)[0] for i in (5, 6)])  # seq 6, 7
        pub.publish(V.batch([V.removed([1, 2], medium="GPU")]))  # seq 8: chain 0 gone
        requests_before = len(pub.replay_requests)
        with running(tmp_path, "--snapshot-dir", str(snaps)) as b:
            _expect(b, {0: 0, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2}, "tail replayed")
            # resumed at the snapshot's cursor (seq 5, verified), not replayed from 0
            assert pub.replay_requests[requests_before:] == [5]
            workers = b.http.get("/workers").json()["workers"]
            assert [w["instance_id"] for w in workers] == ["eng"]
            assert _metric(b, 'kvconductor_replays_total{outcome="ok"}') == 1
            assert _metric(b, 'kvconductor_replays_total{outcome="failed"}') == 0
        assert "warm start from snapshot " in b.log()
        assert "registrations=1 indexes=1 sources=1" in b.log()
    finally:
        pub.stop()


def test_sigkill_restart_from_the_periodic_snapshot(tmp_path):
    snaps = tmp_path / "snaps"
    pub = FakePublisher(replay=True)
    try:
        a = Server(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "1")
        try:
            a.wait_ready()
            _engine(a, pub)
            _published(pub, [_chain(i)[0] for i in range(3)])
            _expect(a, {0: 2, 1: 2, 2: 2}, "indexed")
            n = _metric(a, 'kvconductor_snapshots_total{outcome="written"}')
            wait_until(
                lambda: _metric(a, 'kvconductor_snapshots_total{outcome="written"}') >= n + 1,
                msg="a snapshot after the batches",
            )
            assert _metric(a, "kvconductor_snapshot_last_bytes") > 0
        finally:
            a.proc.kill()
            a.proc.wait(10)
            a.http.close()
            a._log.close()
        _published(pub, [_chain(3)[0]])
        with running(tmp_path, "--snapshot-dir", str(snaps)) as b:
            _expect(b, {0: 2, 1: 2, 2: 2, 3: 2}, "snapshot + tail")
    finally:
        pub.stop()


def test_publisher_restarted_while_down_ages_out_its_old_blocks(tmp_path):
    snaps = tmp_path / "snaps"
    pub = FakePublisher(replay=True)
    try:
        with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
            _engine(a, pub)
            _published(pub, [_chain(i)[0] for i in range(4)])  # seq 0-3
            _expect(a, {0: 2, 3: 2}, "indexed")
        port, replay_port = pub.port, pub.replay_port
        pub.stop()
        # a new engine process on the same ports: its sequence starts again at 0
        pub = FakePublisher(port=port, replay_port=replay_port, replay=True)
        _published(pub, [_chain(i)[0] for i in (8, 9)])
        with running(tmp_path, "--snapshot-dir", str(snaps), "--loss-grace-secs", "1") as b:
            _expect(b, {0: 0, 3: 0, 8: 2, 9: 2}, "restart seen; old blocks dropped")
        assert "restart" in b.log()
    finally:
        pub.stop()


def test_snapshot_dir_problems(tmp_path):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "snapshot-20991231T000000.000000Z.kvc").write_bytes(b"\xc6\x00\x00")
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
        assert a.http.get("/workers").json()["workers"] == []
    log = a.log()
    assert (
        f"snapshot {snaps}/snapshot-20991231T000000.000000Z.kvc refused: truncated dump: "
        "the input ends inside a record" in log
    )
    assert f"no usable snapshot in {snaps}: starting empty" in log
    # the shutdown wrote a good (empty) one; the refused one is kept aside
    assert len(_snapshot_files(snaps)) == 1
    assert (snaps / "snapshot-20991231T000000.000000Z.kvc.refused").exists()

    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    srv = Server(tmp_path, "--snapshot-dir", str(not_dir))
    try:
        assert srv.proc.wait(60) == 1
    finally:
        srv.http.close()
        srv._log.close()
    assert f"cannot use snapshot directory {not_dir}: " in srv.log()

    out = Server(tmp_path, "--snapshot-dir", str(snaps), "--load-dump", str(not_dir))
    try:
        assert out.proc.wait(60) == 2
    finally:
        out.http.close()
        out._log.close()
    assert "--load-dump and --snapshot-dir exclude each other" in out.log()


def test_sigterm_writes_the_last_snapshot_under_workers(tmp_path):
    """--workers 2: the owner process writes the snapshot at shutdown too."""
    snaps = tmp_path / "snaps"
    pub = FakePublisher(replay=True)
    try:
        with running(
            tmp_path,
            "--workers",
            "2",
            "--snapshot-dir",
            str(snaps),
            "--snapshot-interval-secs",
            "0",
        ) as a:
            _engine(a, pub)
            _published(pub, [_chain(i)[0] for i in range(2)])
            _expect(a, {0: 2, 1: 2}, "indexed")
        assert len(_snapshot_files(snaps)) == 1
        with running(tmp_path, "--snapshot-dir", str(snaps)) as b:
            _expect(b, {0: 2, 1: 2}, "loaded")
    finally:
        pub.stop()


# -- the default directory -----------------------------------------------------------------
def _register_http(server, instance: str) -> None:
    body = {"instance_id": instance, "type": "vLLM", "modelname": "qwen", "block_size": BS}
    r = server.http.post("/register", json={**body, "dp_rank": 0})
    assert r.status_code == 201, r.text


def _instances(server) -> list[str]:
    return [w["instance_id"] for w in server.http.get("/workers").json()["workers"]]


def test_warm_restart_is_the_default_under_the_state_directory(tmp_path):
    """No flag: snapshots go to $XDG_STATE_HOME/kvconductor/<port> (created with its
    parents), named in the start line; a restart on the same port loads them."""
    state = tmp_path / "state"
    env = {"XDG_STATE_HOME": str(state)}
    args = ("--snapshot-interval-secs", "0")
    with running(tmp_path, *args, env=env, default_snapshots=True) as a:
        _register_http(a, "eng")
    snaps = state / "kvconductor" / str(a.port)
    assert f" snapshots={snaps}@0s " in a.log(), a.log()
    assert len(_snapshot_files(snaps)) == 1
    with running(tmp_path, *args, env=env, port=a.port, default_snapshots=True) as b:
        assert _instances(b) == ["eng"]
    assert f"warm start from snapshot {snaps}/snapshot-" in b.log(), b.log()


def test_no_snapshots_writes_nothing(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}
    with running(tmp_path, "--no-snapshots", env=env, default_snapshots=True) as a:
        _register_http(a, "eng")
    assert " snapshots=off " in a.log(), a.log()
    assert "snapshot written" not in a.log()
    assert sorted(os.listdir(tmp_path)) == [f"kvc-{a.port}.log"]


def test_unusable_default_directory_warns_and_serves(tmp_path):
    """The default directory cannot be created (here its parent is a file): one WARN
    line, and the service runs without snapshots; an explicit --snapshot-dir would stop
    it (test_snapshot_dir_problems)."""
    state = tmp_path / "state"
    state.write_text("a file, not a directory")
    with running(tmp_path, env={"XDG_STATE_HOME": str(state)}, default_snapshots=True) as a:
        _register_http(a, "eng")
        assert _instances(a) == ["eng"]
    snaps = state / "kvconductor" / str(a.port)
    warns = [line for line in a.log().splitlines() if " WARN " in line]
    assert (
        len(warns) == 1
        and (f"WARN cannot use the default snapshot directory {snaps}: [Errno 20] Not a directory")
        in warns[0]
    ), a.log()
    assert warns[0].endswith(
        "; running without snapshots: a restart starts cold (give --snapshot-dir DIR, "
        "or --no-snapshots to run without them on purpose)"
    ), warns[0]
    assert "snapshot written" not in a.log()
