"""Re-registering a live DP while its engine publishes: no batch is lost."""

from __future__ import annotations

import threading

from tests.helpers.faults import BS, V33, Rig
from tests.helpers.publishers import wait_until

N = 3000


def test_reregistrations_during_a_stream_lose_nothing(tmp_path):
    rig = Rig(tmp_path)
    try:
        rig.join()
        base = rig.source()["last_seq"]
        reg = rig.body

        def reregister():
            # Identical ones (the Coordinator's repair timer) and changed ones on the same
            # URL (engine type spelled differently, a replay endpoint added and removed).
            variants = [reg, reg | {"type": "vllm"}, reg | {"replay_endpoint": rig.pub.url}]
            for i in range(30):
                r = rig.srv.http.post("/register", json=variants[i % 3])
                assert r.status_code == 201, r.text

        t = threading.Thread(target=reregister)
        t.start()
        for i in range(N):
            toks = list(range(BS * (i + 1), BS * (i + 2)))
            rig.pub.publish(
                V33.batch([V33.stored([0x10000 + i], None, toks, BS, medium="GPU")]), wait=False
            )
        t.join(60)
        wait_until(lambda: rig.source()["last_seq"] == base + N, timeout=30, msg="all applied")
        src = rig.source()
        assert src["gaps"] == 0 and src["losses"] == 0 and src["state"] == "live"
        (idx,) = rig.srv.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == N
    finally:
        rig.close()
