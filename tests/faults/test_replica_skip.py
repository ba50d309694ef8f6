"""Replicas on Valkey (``--state-url``) under flags that differ from the replica that wrote
the state store's snapshot, and what ``/workers`` says of sources another replica
consumes (docs/operations.md, "Faults: what the service guarantees").

Real ``kv-conductor`` replicas, a real ``valkey-server`` (the ``valkey_server`` fixture)
and real ZeroMQ vLLM publishers. Expected counts by hand: block size 4, each batch stores
one chain of two blocks.
"""

from __future__ import annotations

import pytest

from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import LEASE, Server, metric, running, start_replicas, stop_replicas

pytestmark = pytest.mark.server

BS = 4
V = schema("vllm", "0.33.0")
SKIPPED = "kvconductor_snapshot_skipped_registrations_total"


def chain(i: int) -> tuple[bytes, list[int]]:
    """Batch storing chain ``i`` (engine hashes 100i+1, 100i+2) and its tokens."""
    toks = [9000 + 8 * i + j for j in range(2 * BS)]
    return V.batch([V.stored([100 * i + 1, 100 * i + 2], None, toks, BS)]), toks


def reg(instance: str, **fields) -> dict:
    return {
        "instance_id": instance,
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": BS,
        "dp_rank": 0,
        **fields,
    }


def workers(srv: Server) -> dict:
    r = srv.http.get("/workers")
    assert r.status_code == 200, r.text
    return r.json()


def npu(srv: Server, toks: list[int]) -> dict[str, int]:
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": toks})
    assert r.status_code == 200, r.text
    return {iid: d["DP"]["0"]["npu_blocks"] for iid, d in r.json()["default"].items()}


def replica(tmp_path, valkey, name: str, *args: str):
    return running(
        tmp_path, "--state-url", valkey.url, "--replica-id", name, "--lease-secs", LEASE, *args
    )


def test_a_replica_shows_the_applied_last_seq_of_a_source_it_does_not_own(tmp_path, valkey_server):
    pub = FakePublisher(replay=True)
    servers: list[Server] = []
    try:
        servers = start_replicas(tmp_path, valkey_server, "ab")
        body = reg("eng", medium_endpoints={"npu": pub.url}, replay_endpoint=pub.replay_url)
        assert servers[0].http.post("/register", json=body).status_code == 201

        def states() -> list[str]:
            return sorted(workers(s)["sources"][0]["state"] for s in servers)

        wait_until(lambda: states() == ["live", "remote"], msg="one owner, one passive")
        for i in range(4):  # seqs 0..3
            pub.publish(chain(i)[0])
        wait_until(
            lambda: all(npu(s, chain(3)[1]) == {"eng": 2} for s in servers),
            msg="the last batch on every replica",
        )
        srcs = {workers(s)["sources"][0]["state"]: workers(s)["sources"][0] for s in servers}
        assert srcs["live"]["last_seq"] == 3
        assert srcs["remote"]["last_seq"] == 3  # the log's applied cursor, not None
        pub.publish(chain(4)[0])
        wait_until(lambda: all(npu(s, chain(4)[1]) == {"eng": 2} for s in servers), msg="batch 4")
        assert sorted(workers(s)["sources"][0]["last_seq"] for s in servers) == [4, 4]
    finally:
        stop_replicas(servers)
        pub.stop()


@pytest.mark.parametrize(
    ("writer_flags", "reader_flags", "reason"),
    [
        (("--allow-ipc-endpoints",), (), "refused"),
        ((), ("--max-sources", "1"), "max_sources"),
    ],
)
def test_a_replica_loading_a_snapshot_skips_only_what_its_flags_refuse(
    tmp_path, valkey_server, writer_flags, reader_flags, reason
):
    pub = FakePublisher(replay=True)
    other = FakePublisher(replay=False)
    gone_url = f"ipc://{tmp_path}/gone.sock" if reason == "refused" else other.url
    try:
        flags = ("--snapshot-interval-secs", "1", *writer_flags)
        with replica(tmp_path, valkey_server, "a", *flags) as a:
            keep = reg("keep", medium_endpoints={"npu": pub.url}, replay_endpoint=pub.replay_url)
            assert a.http.post("/register", json=keep).status_code == 201
            r = a.http.post("/register", json=reg("gone", medium_endpoints={"npu": gone_url}))
            assert r.status_code == 201, r.text
            event = {
                "event_id": 1,
                "dp_rank": 0,
                "type": "BlockStored",
                "block_hashes": [21, 22],
                "parent_block_hash": None,
                "token_ids": chain(9)[1],
                "block_size": BS,
                "medium": "GPU",
            }
            r = a.http.post("/events", json={"instance_id": "gone", "events": [event]})
            assert r.status_code == 200, r.text
            pub.wait_subscribed()
            pub.publish(chain(0)[0])
            wait_until(lambda: npu(a, chain(0)[1]) == {"keep": 2}, msg="keep's blocks on a")
            assert npu(a, chain(9)[1]) == {"gone": 2}
            written = workers(a)["replica"]["snapshots_written"]
            wait_until(
                lambda: workers(a)["replica"]["snapshots_written"] >= written + 1,
                msg="a snapshot with both",
            )
        with replica(tmp_path, valkey_server, "b", *reader_flags) as b:
            assert [w["instance_id"] for w in workers(b)["workers"]] == ["keep"]
            assert npu(b, chain(0)[1]) == {"keep": 2}
            assert npu(b, chain(9)[1]) == {}
            text = b.http.get("/metrics").text
            assert metric(text, f'{SKIPPED}{{reason="{reason}"}}') == 1
            log = b.log()
            warns = [ln for ln in log.splitlines() if "snapshot registration skipped" in ln]
            assert len(warns) == 1 and "instance_id=gone dp_rank=0 " in warns[0], log
            assert f"reason={reason}:" in warns[0], warns
            assert "loaded the state store's snapshot at " in log, log
            assert "Traceback" not in log, log
    finally:
        pub.stop()
        other.stop()
