"""A restart whose flags refuse some registrations of the newest snapshot keeps every other
registration and its blocks (docs/operations.md, "Faults: what the service guarantees").

Real servers (``python -m kvconductor --snapshot-dir DIR``), real ZeroMQ publishers. The
engine ``keep`` publishes its blocks over ZeroMQ (a vLLM 0.33 publisher with a replay
ROUTER); the engine ``gone`` (the one the restart's flags refuse or cannot reopen) gets
its blocks over ``POST /events``. Expected answers are computed by hand: block size 4,
``keep`` holds two blocks of ``TOKENS_KEEP``, ``gone`` three of ``TOKENS_GONE``.
"""

from __future__ import annotations

import socket

import pytest
import xxhash

from kvconductor.state import dump
from tests.helpers.publishers import FakePublisher, free_tcp_port, schema, wait_until
from tests.helpers.server import Server, metric, running

BS = 4
V = schema("vllm", "0.33.0")
TOKENS_KEEP = list(range(100, 108))  # 2 blocks
TOKENS_GONE = list(range(200, 212))  # 3 blocks
SKIPPED = "kvconductor_snapshot_skipped_registrations_total"


def body(instance: str, media: dict, **extra) -> dict:
    return {
        "instance_id": instance,
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": BS,
        "dp_rank": 0,
        "medium_endpoints": media,
        **extra,
    }


def npu(srv: Server, tokens: list[int]) -> dict[str, int]:
    """instance -> NPU blocks of the answer to ``tokens``."""
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens})
    assert r.status_code == 200, r.text
    return {iid: d["DP"]["0"]["npu_blocks"] for iid, d in r.json()["default"].items()}


def instances(srv: Server) -> list[str]:
    return sorted(w["instance_id"] for w in srv.http.get("/workers").json()["workers"])


def fill(srv: Server, pub: FakePublisher, gone: dict) -> None:
    """Register ``keep`` (``pub``) then ``gone`` (``gone``: its registration body) and give
    each its blocks; both answered."""
    keep = body("keep", {"npu": pub.url}, replay_endpoint=pub.replay_url)
    assert srv.http.post("/register", json=keep).status_code == 201
    r = srv.http.post("/register", json=gone)
    assert r.status_code == 201, r.text
    event = {
        "event_id": 1,
        "dp_rank": 0,
        "type": "BlockStored",
        "block_hashes": [21, 22, 23],
        "parent_block_hash": None,
        "token_ids": TOKENS_GONE,
        "block_size": BS,
        "medium": "GPU",
    }
    r = srv.http.post("/events", json={"instance_id": "gone", "events": [event]})
    assert r.status_code == 200, r.text
    pub.wait_subscribed()
    pub.publish(V.batch([V.stored([11, 12], None, TOKENS_KEEP, BS)]))
    wait_until(lambda: npu(srv, TOKENS_KEEP) == {"keep": 2}, msg="keep's blocks indexed")
    assert npu(srv, TOKENS_GONE) == {"gone": 3}


def assert_kept(srv: Server, reason: str) -> str:
    """``keep`` and its blocks loaded, ``gone`` skipped (one WARN, counted) with its blocks
    dropped; returns the WARN line."""
    assert instances(srv) == ["keep"]
    assert npu(srv, TOKENS_KEEP) == {"keep": 2}
    assert npu(srv, TOKENS_GONE) == {}
    text = srv.http.get("/metrics").text
    assert metric(text, f'{SKIPPED}{{reason="{reason}"}}') == 1
    assert metric(text, SKIPPED) == 1
    log = srv.log()
    warns = [ln for ln in log.splitlines() if "snapshot registration skipped" in ln]
    assert len(warns) == 1, log
    assert " WARN" in warns[0] and "instance_id=gone dp_rank=0 " in warns[0], warns
    assert f"reason={reason}:" in warns[0], warns
    assert "registrations=1 indexes=1 sources=1 skipped=1 " in log, log
    assert "Traceback" not in log and ".refused" not in log, log
    return warns[0]


@pytest.fixture
def pub():
    p = FakePublisher(replay=True)
    yield p
    p.stop()


def snapshot_of(tmp_path, pub: FakePublisher, gone: dict, *flags: str):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--snapshot-dir", str(snaps), *flags) as a:
        fill(a, pub, gone)
    return snaps


def test_lower_max_sources_skips_the_registration_past_the_limit(tmp_path, pub):
    other = FakePublisher(replay=False)
    try:
        snaps = snapshot_of(tmp_path, pub, body("gone", {"npu": other.url}))
        with running(tmp_path, "--snapshot-dir", str(snaps), "--max-sources", "1") as b:
            warn = assert_kept(b, "max_sources")
            assert "--max-sources" in warn
    finally:
        other.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_bind_port_busy_at_restart_skips_only_that_registration(tmp_path, pub, workers):
    port = free_tcp_port()
    flags = ("--allow-bind-endpoints", "--workers", str(workers))
    snaps = snapshot_of(tmp_path, pub, body("gone", {"npu": f"tcp://*:{port}"}), *flags)
    with socket.socket() as taken:  # another process took the port meanwhile
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", port))
        taken.listen(1)
        with running(tmp_path, "--snapshot-dir", str(snaps), *flags) as b:
            warn = assert_kept(b, "unavailable")
            assert "Address already in use" in warn, warn
            assert "open-file limit" not in warn, warn
            # the snapshot the restart writes keeps what it serves: the next start agrees
        with running(tmp_path, "--snapshot-dir", str(snaps), *flags) as c:
            assert instances(c) == ["keep"]
            assert npu(c, TOKENS_KEEP) == {"keep": 2}


def test_tightened_endpoint_networks_keeps_the_other_engines(tmp_path, pub):
    other = FakePublisher(replay=False, host="127.0.0.2")
    try:
        snaps = snapshot_of(tmp_path, pub, body("gone", {"npu": other.url}))
        flags = ("--snapshot-dir", str(snaps), "--endpoint-networks", "127.0.0.1/32")
        with running(tmp_path, *flags) as b:
            warn = assert_kept(b, "refused")
            assert "127.0.0.2" in warn, warn
        # nothing was refused whole: both snapshots are in the rotation
        assert not [p for p in snaps.iterdir() if p.name.endswith(".refused")]
    finally:
        other.stop()


def test_ipc_endpoint_without_allow_ipc_keeps_the_other_engines(tmp_path, pub):
    gone = body("gone", {"npu": f"ipc://{tmp_path}/engine.sock"})
    snaps = snapshot_of(tmp_path, pub, gone, "--allow-ipc-endpoints")
    with running(tmp_path, "--snapshot-dir", str(snaps)) as b:
        warn = assert_kept(b, "refused")
        assert "--allow-ipc-endpoints" in warn, warn


def without_request(src, dst) -> None:
    """``dst``: the dump ``src`` whose registration records lost their ``request`` (a
    failure no check names: ``KeyError`` while loading), with a valid checksum, counter+1."""
    records = list(dump._records(dump.file_chunks(str(src))))
    if "counter" in records[0]:
        records[0]["counter"] += 1
    for r in records:
        if r.get("t") == "registration":
            del r["request"]
    body = b"".join(dump._frame(r) for r in records[:-1])
    end = dict(records[-1], checksum=xxhash.xxh3_64_intdigest(body))
    dst.write_bytes(body + dump._frame(end))


def test_a_snapshot_failing_unexpectedly_falls_back_to_the_older_one(tmp_path, pub):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
        keep = body("keep", {"npu": pub.url}, replay_endpoint=pub.replay_url)
        assert a.http.post("/register", json=keep).status_code == 201
        pub.wait_subscribed()
        pub.publish(V.batch([V.stored([11, 12], None, TOKENS_KEEP, BS)]))
        wait_until(lambda: npu(a, TOKENS_KEEP) == {"keep": 2}, msg="keep's blocks indexed")
    (good,) = [p for p in snaps.iterdir() if p.name.startswith("snapshot-")]
    bad = snaps / "snapshot-99999999999999999999-20991231T235959.999999Z.kvc"
    without_request(good, bad)
    dump.verify(dump.file_chunks(str(bad)))  # framing, counts and checksum are right
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as b:
        assert instances(b) == ["keep"]
        assert npu(b, TOKENS_KEEP) == {"keep": 2}
    log = b.log()
    errors = [ln for ln in log.splitlines() if " ERROR " in ln]
    assert len(errors) == 1, log
    assert f"snapshot {bad} refused: KeyError: 'request' (an unexpected failure" in errors[0]
    assert errors[0].endswith(f"(kept as {bad.name}.refused)"), errors
    assert "Traceback" not in log, log


def test_load_dump_failing_unexpectedly_is_one_line(tmp_path, pub):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
        assert a.http.post("/register", json=body("keep", {"npu": pub.url})).status_code == 201
    (good,) = [p for p in snaps.iterdir() if p.name.startswith("snapshot-")]
    bad = tmp_path / "bad.dump"
    without_request(good, bad)
    srv = Server(tmp_path, "--load-dump", str(bad))
    try:
        assert srv.proc.wait(30) == 1
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(10)
        srv.http.close()
        srv._log.close()
    log = srv.log()
    assert "Traceback" not in log, log
    assert (
        f"cannot load dump {bad}: KeyError: 'request' (fix or remove --load-dump to start)"
    ) in log, log


def test_busy_bind_port_at_registration_does_not_advise_the_fd_limit(tmp_path):
    port = free_tcp_port()
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", port))
        taken.listen(1)
        with running(tmp_path, "--allow-bind-endpoints") as srv:
            r = srv.http.post("/register", json=body("gone", {"npu": f"tcp://*:{port}"}))
            assert r.status_code == 503, r.text
            assert r.json() == {
                "error": "cannot open a ZeroMQ subscription now (Address already in use "
                f"(addr='tcp://*:{port}')); "
                "nothing was registered. Check the endpoint (a bind-mode port may be in use "
                "by another process) and register again"
            }
            assert instances(srv) == []
