"""A snapshot follows every registration change within about a second: a cluster pool
(Mooncake) registered, then the server SIGKILLed long before its first periodic snapshot
(60 s), is back after the restart, and its events give CPU hits (docs/operations.md,
"Faults: what the service guarantees"). No Coordinator generation re-registers cluster
pools: without the snapshot, the pool would be gone until the Coordinator restarts.

Real server with the default 60 s interval, real ZeroMQ publishers: the engine
``vllm-1`` (vLLM 0.33, its HBM URL on 127.0.0.1) and the pool ``mooncake-pool`` (its
events name ``backend_id`` 127.0.0.1). Expected counts by hand: block size 4, 8 tokens,
2 blocks offloaded by the engine and confirmed by the pool on CPU.
"""

from __future__ import annotations

import signal
import time

from tests.helpers.publishers import (
    FakePublisher,
    PoolPublisher,
    mooncake_tuple,
    schema,
    wait_until,
)
from tests.helpers.server import Server, running

BS = 4
V = schema("vllm", "0.33.0")
TOKENS = list(range(100, 108))
HASHES = [0xA1, 0xA2]
POOL = "mooncake-pool"


def cpu(srv: Server) -> int:
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": TOKENS})
    assert r.status_code == 200, r.text
    return r.json()["default"].get("vllm-1", {}).get("DP", {}).get("0", {}).get("cpu_blocks", 0)


def instances(srv: Server) -> list[str]:
    return sorted(w["instance_id"] for w in srv.http.get("/workers").json()["workers"])


def snapshots(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("snapshot-"))


def test_pool_registered_then_killed_before_the_periodic_snapshot(tmp_path):
    engine = FakePublisher(replay=False)
    pool = PoolPublisher()
    snaps = tmp_path / "snaps"
    try:
        a = Server(tmp_path, "--snapshot-dir", str(snaps))  # the default 60 s interval
        try:
            a.wait_ready()
            reg = {"type": "vLLM", "modelname": "qwen", "block_size": BS, "dp_rank": 0}
            r = a.http.post(
                "/register",
                json={**reg, "instance_id": "vllm-1", "medium_endpoints": {"npu": engine.url}},
            )
            assert r.status_code == 201, r.text
            r = a.http.post(
                "/register",
                json={
                    **reg,
                    "instance_id": POOL,
                    "store_backend": "Mooncake",
                    "endpoint": pool.url,
                },
            )
            assert r.status_code == 201, r.text
            time.sleep(1.5)
            written = snapshots(snaps)
        finally:
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait(10)
            a.http.close()
            a._log.close()
        with running(tmp_path, "--snapshot-dir", str(snaps)) as b:
            assert instances(b) == [POOL, "vllm-1"]
            (store,) = [
                w for w in b.http.get("/workers").json()["workers"] if w["instance_id"] == POOL
            ]
            assert store["endpoints"]["0"]["pool"] == {"kind": "cluster"}
            # one snapshot for the two changes (coalesced), none of the 60 s timer
            assert len(written) == 1, written
            # the engine offloads to CPU (phase 1), the pool confirms (phase 2): CPU hits
            offload = V.batch([V.stored(HASHES, None, TOKENS, BS, medium="CPU")])
            confirm = mooncake_tuple(
                [
                    {
                        "event_id": 1,
                        "event_type": "stored",
                        "medium": "cpu",
                        "seq_hashes": HASHES,
                        "backend_id": "127.0.0.1",
                    }
                ]
            )
            engine.wait_subscribed(2)  # the killed server's subscription, then this one's
            pool.wait_subscribed(2)

            def step() -> bool:
                engine.publish(offload)
                pool.publish(confirm)
                return cpu(b) == 2

            wait_until(step, msg="CPU hits through the restored pool")
    finally:
        engine.stop()
        pool.stop()
