"""End to end through the real server: engines and pools publish over ZeroMQ/tcp,
the Coordinator registers and queries over HTTP.

Every expectation is computed by hand from the published chains (block_size 4).
"""

from __future__ import annotations

import time

import pytest

from kvconductor._hash import hash_blocks
from tests.helpers.http_cases import msgpack_post
from tests.helpers.publishers import (
    FakePublisher,
    PoolPublisher,
    mooncake_tuple,
    schema,
    wait_until,
)
from tests.helpers.server import Server, dp_entry, register_engine, started

pytestmark = pytest.mark.server

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4 tokens
HASHES = [0xA000 + i for i in range(6)]  # engine block hashes, one per block


@pytest.fixture
def server(tmp_path):
    with started(tmp_path) as s:
        yield s


def query(server, tokens, msgpack=False):
    body = {"model": "qwen", "block_size": BS, "token_ids": tokens}
    if msgpack:
        status, ctype, doc = msgpack_post(server.http, "/query", body)
        assert ctype.startswith("application/msgpack")
        return status, doc
    r = server.http.post("/query", json=body)
    return r.status_code, r.json()


def test_vllm_publisher_to_query(server):
    """register -> vLLM 0.33 map events over tcp -> /query reports the NPU hits."""
    pub = FakePublisher(replay=False)
    try:
        register_engine(
            server, "vllm-prefill-1", store_backend="YuanRong", medium_endpoints={"npu": pub.url}
        )
        v = schema("vllm", "0.33.0")
        # Keep publishing until the SUB is connected (PUB drops before that).
        first = v.batch([v.stored(HASHES[:4], None, TOKENS[:16], BS, medium="GPU")])

        def indexed():
            pub.publish(first)
            st, body = query(server, TOKENS[:16])
            e = dp_entry(body, "vllm-prefill-1") if st == 200 else None
            return e is not None and e["npu_blocks"] == 4

        pub.wait_subscribed()  # published before, a batch would be a loss
        wait_until(indexed, msg="first batch indexed")
        pub.publish(v.batch([v.stored(HASHES[4:6], HASHES[3], TOKENS[16:24], BS, medium="GPU")]))
        wait_until(
            lambda: (
                (dp_entry(query(server, TOKENS)[1], "vllm-prefill-1") or {}).get("npu_blocks") == 6
            ),
            msg="second batch indexed",
        )
        st, body = query(server, TOKENS + [1, 2, 3, 4], msgpack=True)
        assert st == 200
        # 6 cached blocks of 4 tokens; the 7th block is not cached.
        assert body == {
            "default": {
                "vllm-prefill-1": {
                    "longest_matched": 24,
                    "DP": {
                        "0": {
                            "matched_tokens": 24,
                            "npu_blocks": 6,
                            "cpu_blocks": 0,
                            "disk_blocks": 0,
                        }
                    },
                }
            }
        }
        # An eviction of block 3 cuts the prefix to 3 blocks.
        pub.publish(v.batch([v.removed([HASHES[3]], medium="GPU")]))
        wait_until(
            lambda: (
                (dp_entry(query(server, TOKENS)[1], "vllm-prefill-1") or {}).get("npu_blocks") == 3
            ),
            msg="removal applied",
        )
        sources = server.http.get("/workers").json()["sources"]
        assert any(s["instance_id"] == "vllm-prefill-1" and s["state"] == "live" for s in sources)
    finally:
        pub.stop()


def test_gap_is_replayed_through_the_server(server):
    """A batch lost on the PUB socket is fetched from the replay ROUTER."""
    pub = FakePublisher()
    try:
        v = schema("vllm", "0.33.0")
        warm = v.batch([v.stored(HASHES[:1], None, TOKENS[:4], BS, medium="GPU")])
        register_engine(
            server,
            "vllm-prefill-2",
            store_backend="YuanRong",
            medium_endpoints={"npu": pub.url},
            replay_endpoint=pub.replay_url,
        )

        def warmed():
            pub.publish(warm)
            return (dp_entry(query(server, TOKENS[:4])[1], "vllm-prefill-2") or {}).get(
                "npu_blocks"
            ) == 1

        wait_until(warmed, msg="warm-up batch indexed")
        # seq n+1 never reaches the subscriber; seq n+2 reveals the gap.
        pub.publish(
            v.batch([v.stored(HASHES[1:3], HASHES[0], TOKENS[4:12], BS, medium="GPU")]), drop=True
        )
        pub.publish(v.batch([v.stored(HASHES[3:4], HASHES[2], TOKENS[12:16], BS, medium="GPU")]))
        wait_until(
            lambda: (
                (dp_entry(query(server, TOKENS[:16])[1], "vllm-prefill-2") or {}).get("npu_blocks")
                == 4
            ),
            msg="gap replayed",
        )
        src = [
            s
            for s in server.http.get("/workers").json()["sources"]
            if s["instance_id"] == "vllm-prefill-2"
        ]
        assert src and src[0]["gaps"] >= 1 and src[0]["replays"] >= 1
    finally:
        pub.stop()


def test_mooncake_pool_confirms_engine_offload(server):
    """Engine offloads blocks 2..3 to CPU; the Mooncake master confirms them for the node."""
    eng = FakePublisher(replay=False)
    pool = PoolPublisher()
    try:
        register_engine(
            server, "vllm-prefill-3", store_backend="Mooncake", medium_endpoints={"npu": eng.url}
        )
        register_engine(server, "mooncake-pool", store_backend="Mooncake", endpoint=pool.url)
        v = schema("vllm", "0.33.0")
        hbm = v.batch([v.stored(HASHES[:2], None, TOKENS[:8], BS, medium="GPU")])

        def hbm_indexed():
            eng.publish(hbm)
            return (dp_entry(query(server, TOKENS[:8])[1], "vllm-prefill-3") or {}).get(
                "npu_blocks"
            ) == 2

        wait_until(hbm_indexed, msg="HBM blocks indexed")
        eng.publish(v.batch([v.stored(HASHES[2:4], HASHES[1], TOKENS[8:16], BS, medium="CPU")]))
        confirm = mooncake_tuple(
            [
                {
                    "event_id": 1,
                    "event_type": "stored",
                    "backend_id": "127.0.0.1",
                    "medium": "cpu",
                    "seq_hashes": HASHES[2:4],
                }
            ]
        )

        def cpu_hit():
            pool.publish(confirm)
            e = dp_entry(query(server, TOKENS[:16])[1], "vllm-prefill-3") or {}
            return e.get("cpu_blocks") == 2

        wait_until(cpu_hit, msg="pool confirmation joined")
        st, body = query(server, TOKENS[:16])
        # NPU blocks 0..1, CPU blocks 2..3 chained after the engine's own HBM breakpoint.
        assert body["default"]["vllm-prefill-3"] == {
            "longest_matched": 16,
            "DP": {"0": {"matched_tokens": 16, "npu_blocks": 2, "cpu_blocks": 2, "disk_blocks": 0}},
        }
    finally:
        eng.stop()
        pool.stop()


def test_hash_golden_vectors_over_query_by_hash(server):
    """/query_by_hash with the golden LocalBlockHashes of docs/api.md "Block hashing" agrees
    with /query."""
    pub = FakePublisher(replay=False)
    try:
        register_engine(
            server,
            "vllm-prefill-4",
            dp_rank=1,
            store_backend="YuanRong",
            medium_endpoints={"gpu": pub.url},
        )
        v = schema("vllm", "0.9.2")
        toks = list(range(12))
        b = v.batch([v.stored([11, 12, 13], None, toks, BS)], dp=1)

        def indexed():
            pub.publish(b)
            return dp_entry(query(server, toks)[1], "vllm-prefill-4", 1) is not None

        pub.wait_subscribed()
        wait_until(indexed, msg="0.9.2 array batch indexed")
        hashes = list(hash_blocks(toks, BS))
        assert hashes == [9143094415614847814, 12124091508212882195, 1088361764653601668]
        r = server.http.post(
            "/query_by_hash", json={"model": "qwen", "block_size": BS, "block_hashes": hashes}
        )
        assert r.json() == {
            "default": {
                "vllm-prefill-4": {
                    "longest_matched": 3,
                    "DP": {
                        "1": {
                            "matched_tokens": 3,
                            "npu_blocks": 3,
                            "cpu_blocks": 0,
                            "disk_blocks": 0,
                        }
                    },
                }
            }
        }
    finally:
        pub.stop()


def test_conductor_restart_replays_every_dp_of_an_instance(tmp_path):
    """Two DP publishers of one instance keep publishing while the conductor restarts:
    each DP's registration brings its own replay, so both DPs come back (the reference
    replayed only the first DP of an instance). The registration is the Coordinator's
    ``register_post`` shape, with the unset media as empty strings."""
    v = schema("vllm", "0.33.0")
    pubs = [FakePublisher() for _ in range(2)]
    # DP d caches its own 3-block chain of distinct tokens.
    chains = [[1000 * (d + 1) + i for i in range(12)] for d in range(2)]

    def register(srv, d):
        register_engine(
            srv,
            "vllm-prefill-7",
            dp_rank=d,
            store_backend="Mooncake",
            medium_endpoints={"xpu": pubs[d].url, "cpu": "", "disk": ""},
            replay_endpoint=pubs[d].replay_url,
        )

    def hits(srv, d):
        return (dp_entry(query(srv, chains[d])[1], "vllm-prefill-7", d) or {}).get("npu_blocks")

    try:
        for d, pub in enumerate(pubs):
            pub.publish(
                v.batch(
                    [
                        v.stored(
                            [0xD000 + 16 * d + i for i in range(3)],
                            None,
                            chains[d],
                            BS,
                            medium="GPU",
                        )
                    ],
                    dp=d,
                )
            )
        # The conductor starts after the engines published (a restart): only replay
        # can bring these blocks back.
        srv = Server(tmp_path)
        try:
            srv.wait_ready()
            for d in range(2):
                register(srv, d)
            for d in range(2):
                wait_until(lambda d=d: hits(srv, d) == 3, msg=f"DP {d} replayed")
            assert query(srv, chains[0])[1] == {
                "default": {
                    "vllm-prefill-7": {
                        "longest_matched": 12,
                        "DP": {
                            "0": {
                                "matched_tokens": 12,
                                "npu_blocks": 3,
                                "cpu_blocks": 0,
                                "disk_blocks": 0,
                            }
                        },
                    }
                }
            }
            assert [p.replay_requests for p in pubs] == [[0], [0]]
            log = srv.log()
            assert (
                "empty endpoint URLs ignored: medium_endpoints['cpu'], "
                "medium_endpoints['disk']" in log
            )
        finally:
            srv.terminate()
        # A second restart: the same again, and the identical re-registration that the
        # Coordinator's repair timer sends afterwards neither resubscribes nor replays.
        srv = Server(tmp_path)
        try:
            srv.wait_ready()
            for d in range(2):
                register(srv, d)
            for d in range(2):
                wait_until(lambda d=d: hits(srv, d) == 3, msg=f"DP {d} replayed again")
            register(srv, 1)
            src = [
                s
                for s in srv.http.get("/workers").json()["sources"]
                if s["instance_id"] == "vllm-prefill-7"
            ]
            assert sorted((s["dp_rank"], s["replays"]) for s in src) == [(0, 1), (1, 1)]
            assert [p.replay_requests for p in pubs] == [[0, 0], [0, 0]]
        finally:
            srv.terminate()
    finally:
        for p in pubs:
            p.stop()


def test_lora_events_over_zmq_and_lora_queries_through_the_client(server):
    """vLLM 0.33 publishes one chain for a LoRA adapter and one for the base model over
    ZeroMQ; the Coordinator client's ``lora_name`` selects which one it sees."""
    from kvconductor.client import ConductorClient

    pub = FakePublisher(replay=False)
    v = schema("vllm", "0.33.0")
    try:
        register_engine(server, "vllm-prefill-9", medium_endpoints={"npu": pub.url})
        lora_batch = v.batch(
            [v.stored(HASHES[:4], None, TOKENS[:16], BS, medium="GPU", lora_name="sql-adapter")]
        )
        base_batch = v.batch([v.stored(HASHES[4:5], None, TOKENS[:4], BS, medium="GPU")])
        with ConductorClient(server.url) as client:

            def npu(lora, packed=False):
                res = client.query("qwen", TOKENS[:16], BS, lora_name=lora, packed=packed)
                return (dp_entry(res, "vllm-prefill-9") or {}).get("npu_blocks", 0)

            def indexed():
                pub.publish(lora_batch)
                pub.publish(base_batch)
                return npu("sql-adapter") == 4 and npu(None) == 1

            pub.wait_subscribed()
            wait_until(indexed, msg="LoRA and base chains indexed")
            assert npu("sql-adapter", packed=True) == 4
            assert npu("") == 1
            assert npu("other-adapter") == 0
    finally:
        pub.stop()


def test_ready_flips_with_a_publisher_killed_and_restarted(server):
    """/ready: 200 with no source; 503 naming a source while its publisher is down; 200
    again once the SUB has reconnected to the restarted publisher."""

    def ready():
        r = server.http.get("/ready")
        return r.status_code, r.json()

    assert ready() == (200, {"status": "ready", "sources": 0})
    pub = FakePublisher(replay=False)
    port = pub.port
    register_engine(server, "vllm-prefill-1", medium_endpoints={"npu": pub.url})
    try:
        wait_until(lambda: ready() == (200, {"status": "ready", "sources": 1}), msg="ready")
        pub.stop()
        down = wait_until(lambda: (lambda s: s[0] == 503 and s)(ready()), msg="not ready")
        assert down[1] == {
            "error": "not ready: 1 of 1 ZeroMQ sources are connecting or replaying",
            "sources": [{"instance_id": "vllm-prefill-1", "dp_rank": 0, "state": "connecting"}],
        }
        assert server.http.get("/health").text == "OK"  # liveness is not readiness
        pub = FakePublisher(port=port, replay=False)
        wait_until(lambda: ready()[0] == 200, msg="ready again")
    finally:
        pub.stop()


# -- dead engines: --source-down-secs and --source-purge-secs ---------------------------------


def _metric(server, name: str, **labels) -> float:
    """One sample of a live server's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = server.http.get("/metrics")
    assert r.status_code == 200
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _source(server, instance_id: str) -> dict:
    return next(
        s for s in server.http.get("/workers").json()["sources"] if s["instance_id"] == instance_id
    )


def _hbm_blocks(server) -> int:
    return sum(i["hbm_blocks"] for i in server.http.get("/workers").json()["indexer"])


@pytest.fixture
def fast_down(tmp_path):
    s = Server(tmp_path, "--source-down-secs", "1", "--source-purge-secs", "4")
    s.wait_ready()
    yield s
    s.terminate()


def _publish_until_indexed(server, pub, instance_id: str, nblocks: int) -> None:
    v = schema("vllm", "0.33.0")
    batch = v.batch([v.stored(HASHES[:nblocks], None, TOKENS[: BS * nblocks], BS, medium="GPU")])

    def indexed():
        pub.publish(batch)
        e = dp_entry(query(server, TOKENS)[1], instance_id)
        return e is not None and e["npu_blocks"] == nblocks

    pub.wait_subscribed()
    wait_until(indexed, msg=f"{instance_id} indexed")


def test_a_source_down_past_the_threshold_stops_counting_then_comes_back_then_is_purged(
    fast_down,
):
    """A publisher gone for --source-down-secs (1 s) mutes its DP's HBM hits (blocks kept,
    /workers, /metrics and the log say so); reconnected, its hits count again; gone for
    --source-purge-secs (4 s), its blocks are dropped."""
    server = fast_down
    a, b = FakePublisher(replay=False), FakePublisher(replay=False)
    port = a.port
    try:
        register_engine(server, "engine-a", medium_endpoints={"npu": a.url})
        register_engine(server, "engine-b", medium_endpoints={"npu": b.url})
        _publish_until_indexed(server, a, "engine-a", 4)
        _publish_until_indexed(server, b, "engine-b", 2)
        assert _source(server, "engine-a")["muted"] is False
        assert _metric(server, "kvconductor_source_muted", instance_id="engine-a") == 0
        seq = a.seq
        a.stop()
        t0 = time.monotonic()
        wait_until(
            lambda: dp_entry(query(server, TOKENS)[1], "engine-a") is None, msg="engine-a muted"
        )
        assert time.monotonic() - t0 >= 1.0  # not before --source-down-secs
        # engine-b is untouched; engine-a's 4 blocks are still held (state kept)
        assert dp_entry(query(server, TOKENS)[1], "engine-b")["npu_blocks"] == 2
        assert _hbm_blocks(server) == 6
        src = _source(server, "engine-a")
        assert (src["muted"], src["mutes"], src["state"]) == (True, 1, "connecting")
        assert src["down_since"] is not None
        assert src["media"] == ["npu"] and src["last_event_age_s"] >= 1.0
        assert _metric(server, "kvconductor_source_muted", instance_id="engine-a") == 1
        assert _metric(server, "kvconductor_source_mutes_total") == 1
        assert "its HBM hits no longer count" in server.log()

        a = FakePublisher(port=port, replay=False, start_seq=seq)  # back, sequence continuous
        wait_until(
            lambda: (dp_entry(query(server, TOKENS)[1], "engine-a") or {}).get("npu_blocks") == 4,
            msg="engine-a hits back",
        )
        src = _source(server, "engine-a")
        assert (src["muted"], src["state"], src["down_since"]) == (False, "live", None)
        assert _metric(server, "kvconductor_source_muted", instance_id="engine-a") == 0
        assert "its HBM hits count again" in server.log()

        a.stop()
        wait_until(lambda: _hbm_blocks(server) == 2, timeout=30, msg="engine-a purged")
        src = _source(server, "engine-a")
        assert (src["muted"], src["mutes"], src["purged_blocks"]) == (True, 2, 4)
        assert _metric(server, "kvconductor_source_purged_blocks_total") == 4
        assert "4 HBM blocks dropped" in server.log()
    finally:
        a.stop()
        b.stop()


_FROZEN_PUBLISHER = """
import sys, time, zmq
payload = open(sys.argv[2], "rb").read()
pub = zmq.Context().socket(zmq.PUB)
pub.bind("tcp://127.0.0.1:" + sys.argv[1])
seq = 0
while True:
    pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    seq += 1
    time.sleep(0.05)
"""


def test_a_frozen_publisher_host_is_noticed_without_a_tcp_close(fast_down, tmp_path):
    """SIGSTOP freezes the publisher's process: its TCP connection stays open and its kernel
    still accepts new ones, yet ZMTP heartbeats notice it and its hits stop counting; SIGCONT
    brings them back."""
    import signal
    import subprocess
    import sys

    from tests.helpers.server import free_port

    server = fast_down
    v = schema("vllm", "0.33.0")
    payload = tmp_path / "batch.msgpack"
    payload.write_bytes(v.batch([v.stored(HASHES[:3], None, TOKENS[:12], BS, medium="GPU")]))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _FROZEN_PUBLISHER, str(port), str(payload)])
    try:
        register_engine(server, "engine-f", medium_endpoints={"npu": f"tcp://127.0.0.1:{port}"})
        wait_until(
            lambda: (dp_entry(query(server, TOKENS)[1], "engine-f") or {}).get("npu_blocks") == 3,
            msg="engine-f indexed",
        )
        proc.send_signal(signal.SIGSTOP)
        # heartbeat timeout (3 s) + --source-down-secs (1 s) + one check (1 s), with slack
        wait_until(
            lambda: dp_entry(query(server, TOKENS)[1], "engine-f") is None,
            timeout=20,
            msg="frozen engine muted",
        )
        assert _source(server, "engine-f")["muted"] is True
        proc.send_signal(signal.SIGCONT)
        wait_until(
            lambda: (dp_entry(query(server, TOKENS)[1], "engine-f") or {}).get("npu_blocks") == 3,
            timeout=20,
            msg="engine-f back",
        )
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
