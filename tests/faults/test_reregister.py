"""Re-registering a live DP while its engine publishes: no batch is lost."""
from __future__ import annotations

import threading

from publishers import FakePublisher, schema, wait_until
from test_server import Server

BS = 4
V33 = schema("vllm", "0.33.0")
N = 3000


def test_reregistrations_during_a_stream_lose_nothing(tmp_path):
    pub = FakePublisher(replay=False)
    srv = Server(tmp_path)
    try:
        srv.wait_ready()
        reg = {"instance_id": "vllm-prefill-1", "type": "vLLM", "modelname": "qwen",
               "block_size": BS, "dp_rank": 0, "store_backend": "YuanRong",
               "medium_endpoints": {"npu": pub.url}}
        assert srv.http.post("/register", json=reg).status_code == 201

        def source():
            return srv.http.get("/workers").json()["sources"][0]

        def joined():
            pub.publish(V33.batch([]))
            return source()["batches"] > 0
        wait_until(joined, msg="subscriber joined")
        base = source()["last_seq"]

        def reregister():
            # Identical ones (the Coordinator's repair timer) and changed ones on the same
            # URL (engine type spelled differently, a replay endpoint added and removed).
            variants = [reg, reg | {"type": "vllm"}, reg | {"replay_endpoint": pub.url}]
            for i in range(30):
                r = srv.http.post("/register", json=variants[i % 3])
                assert r.status_code == 201, r.text
        t = threading.Thread(target=reregister)
        t.start()
        for i in range(N):
            toks = list(range(BS * (i + 1), BS * (i + 2)))
            pub.publish(V33.batch([V33.stored([0x10000 + i], None, toks, BS, medium="GPU")]),
                        wait=False)
        t.join(60)
        wait_until(lambda: source()["last_seq"] == base + N, timeout=30, msg="all applied")
        src = source()
        assert src["gaps"] == 0 and src["losses"] == 0 and src["state"] == "live"
        (idx,) = srv.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == N
    finally:
        srv.terminate()
        pub.stop()
