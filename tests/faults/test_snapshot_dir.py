"""The snapshot directory under faults: two servers on one directory, a holder killed,
a clock stepped back, a snapshot that verifies but does not form a valid index.

Real servers (``python -m kvconductor --snapshot-dir DIR``); snapshot files are changed
between runs the way a clock step or a bug would leave them, re-encoded with a valid
checksum (:func:`rewrite`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash

from kvconductor.state import dump
from tests.helpers.publishers import wait_until
from tests.helpers.server import Server, register_engine, running


def instances(srv: Server) -> list[str]:
    return sorted(w["instance_id"] for w in srv.http.get("/workers").json()["workers"])


def snapshots(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("snapshot-"))


def rewrite(src: Path, dst: Path, change) -> None:
    """Write ``dst``: the dump ``src`` after ``change(records)`` (header first, end record
    last), framed again with a valid checksum."""
    records = list(dump._records(dump.file_chunks(str(src))))
    change(records)
    body = b"".join(dump._frame(r) for r in records[:-1])
    end = dict(records[-1], checksum=xxhash.xxh3_64_intdigest(body))
    dst.write_bytes(body + dump._frame(end))


def test_second_server_on_one_directory_refuses_to_start(tmp_path):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
        register_engine(a, "first")
        # a write of the first server in progress: its temporary file
        foreign = snaps / ".snapshot-00000000000000000007-20260101T000000.000000Z.tmp"
        foreign.write_bytes(b"half a snapshot")
        b = Server(tmp_path, "--snapshot-dir", str(snaps))
        assert b.exit_code() == 1
        log = b.log()
        assert (
            f"kv-conductor: error: snapshot directory {snaps} is in use by kv-conductor "
            f"pid {a.proc.pid} (lock {snaps}/lock): give this server its own directory "
            "(--snapshot-dir DIR) or run it without snapshots (--no-snapshots)"
        ) in log, log
        assert "KV conductor shut down" not in log and "warm start" not in log
        assert foreign.read_bytes() == b"half a snapshot"  # not deleted by the refused one
        assert instances(a) == ["first"]  # the first one serves on
    assert len(snapshots(snaps)) == 1
    assert (snaps / "lock").exists()


def test_killed_holder_does_not_block_the_next_start(tmp_path):
    snaps = tmp_path / "snaps"
    a = Server(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "1")
    try:
        a.wait_ready()
        register_engine(a, "first")
        wait_until(lambda: len(snapshots(snaps)) >= 1, msg="a periodic snapshot")
        # the lock file names the holder
        assert (snaps / "lock").read_text().split() == [str(a.proc.pid)]
    finally:
        a.kill()
    with running(tmp_path, "--snapshot-dir", str(snaps)) as b:
        assert instances(b) == ["first"]
        assert (snaps / "lock").read_text().split() == [str(b.proc.pid)]
    assert "in use by" not in b.log()


def test_the_owner_of_workers_holds_the_lock(tmp_path):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--workers", "2", "--snapshot-dir", str(snaps)) as a:
        b = Server(tmp_path, "--snapshot-dir", str(snaps))
        assert b.exit_code() == 1
        assert f"in use by kv-conductor pid {a.proc.pid} " in b.log(), b.log()


def test_clock_stepped_back_loads_the_newest_by_counter(tmp_path):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
        register_engine(a, "first")
    (older,) = snapshots(snaps)
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as b:
        assert instances(b) == ["first"]
        register_engine(b, "second")
    (newer,) = set(snapshots(snaps)) - {older}
    # the older snapshot was written while the clock ran ahead: its name has the later time
    ahead = snaps / "snapshot-20991231T235959.999999Z.kvc"
    (snaps / older).rename(ahead)
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as c:
        assert instances(c) == ["first", "second"]
    assert f"warm start from snapshot {snaps / newer}: registrations=2 " in c.log(), c.log()
    # two kept: the one the restart wrote and the one it loaded; the oldest by counter went
    assert not ahead.exists() and len(snapshots(snaps)) == 2


def test_snapshot_breaking_the_index_invariants_falls_back_to_the_older_one(tmp_path):
    snaps = tmp_path / "snaps"
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as a:
        register_engine(a, "first")
        events = {
            "instance_id": "first",
            "events": [
                {
                    "event_id": 1,
                    "dp_rank": 0,
                    "type": "BlockStored",
                    "block_hashes": [11, 12],
                    "parent_block_hash": None,
                    "token_ids": list(range(8)),
                    "block_size": 4,
                    "medium": "GPU",
                }
            ],
        }
        assert a.http.post("/events", json=events).status_code == 200
    (good,) = snapshots(snaps)

    def break_it(records: list) -> None:
        """A second registration, and an HBM node row no worker holds: restore accepts
        it, the tree's invariants do not (an empty node)."""
        header = records[0]
        if "counter" in header:
            header["counter"] += 1
        i = next(i for i, r in enumerate(records) if r.get("t") == "registration")
        second = {**records[i], "request": {**records[i]["request"], "instance_id": "second"}}
        records.insert(i + 1, second)
        nodes = next(r for r in records if r.get("t") == "hbm_nodes")
        nodes["parents"] += struct.pack("<I", 0)
        nodes["locals"] += struct.pack("<Q", 999)
        next(r for r in records if r.get("t") == "index_end")["hbm_nodes"] += 1
        records[-1]["registrations"] += 1

    bad = snaps / "snapshot-20991231T235959.999999Z.kvc"
    rewrite(snaps / good, bad, break_it)
    dump.verify(dump.file_chunks(str(bad)))  # it verifies: header, framing, checksum
    with running(tmp_path, "--snapshot-dir", str(snaps), "--snapshot-interval-secs", "0") as b:
        assert instances(b) == ["first"]  # the older one, with nothing of the refused one
    log = b.log()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert errors == [
        errors[0].split(" ERROR ")[0]
        + f" ERROR snapshot {bad} refused: dump of index qwen/default does not form a "
        "valid index: HBM tree: empty node 3 survived (no members, no children) "
        f"(kept as {bad.name}.refused)"
    ], log
    assert not bad.exists() and (snaps / f"{bad.name}.refused").exists()
    assert f"warm start from snapshot {snaps / good}: registrations=1 " in log, log
