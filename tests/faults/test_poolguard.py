"""A node pool registered with its engine's URL (a Coordinator with only the legacy
``endpoint`` setting resolves the pool's CPU/Disk URL to DP 0's engine publisher): the
engine's batches on the pool's subscription are dropped and counted, so the pool never
shows in a ``/query`` answer (docs/api.md, "Node pools"), and DP 0 gets them once."""

from __future__ import annotations

import pytest

from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import Server

BS = 4
V = schema("vllm", "0.33.0")
POOL = "yuanrong-pool-127.0.0.1-qwen"
BATCHES = 20


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    srv.wait_ready()
    yield srv
    srv.terminate()


def _register(srv, instance_id: str, media: dict) -> None:
    body = {
        "instance_id": instance_id,
        "type": "vLLM",
        "store_backend": "YuanRong",
        "modelname": "qwen",
        "block_size": BS,
        "dp_rank": 0,
        "medium_endpoints": media,
    }
    r = srv.http.post("/register", json=body)
    assert r.status_code == 201, r.text


def test_engine_batches_on_a_pools_url_are_dropped(server):
    eng = FakePublisher(replay=False)
    try:
        # what build_dp_registration / build_node_pool_registration send with only
        # `endpoint` = "tcp://{host}:5557": the same URL for DP 0's npu and the pool
        _register(server, "vllm-prefill-1", {"npu": eng.url})
        _register(server, POOL, {"cpu": eng.url, "disk": eng.url})
        eng.wait_subscribed(2)
        tokens = list(range(100, 100 + BATCHES * BS))
        hashes = [0xA00 + i for i in range(BATCHES)]
        for i in range(BATCHES):
            parent = hashes[i - 1] if i else None
            toks = tokens[i * BS : (i + 1) * BS]
            eng.publish(V.batch([V.stored([hashes[i]], parent, toks, BS, medium="GPU")]))

        def sources():
            return {s["instance_id"]: s for s in server.http.get("/workers").json()["sources"]}

        def handled(s):
            return s["batches"] + sum(s["dropped"].values())

        wait_until(
            lambda: all(handled(s) >= BATCHES for s in sources().values()),
            msg="both subscriptions handled every batch",
        )
        src = sources()
        assert src[POOL]["dropped"] == {"engine_batch_on_pool": BATCHES}
        assert src["vllm-prefill-1"]["dropped"] == {}
        r = server.http.post(
            "/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens}
        )
        assert r.status_code == 200
        ans = r.json()["default"]
        assert POOL not in ans
        assert ans["vllm-prefill-1"]["DP"]["0"]["npu_blocks"] == BATCHES
        (idx,) = server.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == BATCHES
        assert "engine_batch_on_pool" in server.log()
    finally:
        eng.stop()
