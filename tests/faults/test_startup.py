"""Engine start-up order: registered before the engine is up, or subscribed after it began.

A PUB drops what it sends before a subscriber's subscription reaches it, so what an
engine published before our SUB connected is either asked for again (replay, once the
SUB is connected) or declared lost (no replay endpoint): never silently missing.
"""

from __future__ import annotations

import time

import pytest

from kvconductor.tools.explain import report
from tests.helpers.faults import BS, V33
from tests.helpers.publishers import FakePublisher, free_tcp_port, wait_until
from tests.helpers.server import Server


def toks(i: int, n: int = 2) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + n * BS))


def prompt_batch(i: int, n: int = 2) -> bytes:
    """Prompt ``i``: ``n`` root-chained blocks, engine hashes 100*(i+1)+k."""
    return V33.batch(
        [V33.stored([100 * (i + 1) + k for k in range(n)], None, toks(i, n), BS, medium="GPU")]
    )


def npu(srv: Server, iid: str, tokens: list[int]) -> int:
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens})
    return r.json()["default"].get(iid, {}).get("DP", {}).get("0", {}).get("npu_blocks", 0)


def register(srv: Server, iid: str, url: str, replay_url: str | None) -> None:
    body = {
        "instance_id": iid,
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": BS,
        "dp_rank": 0,
        "medium_endpoints": {"npu": url},
    }
    if replay_url:
        body["replay_endpoint"] = replay_url
    r = srv.http.post("/register", json=body)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("engines", [1, 10])
def test_registered_before_the_engine_is_up(tmp_path, engines):
    """The Coordinator registers an instance when it learns of it, before its engine
    binds. The engine starts 1.5 s later, publishes 4 batches 20 ms apart after a 0.3 s
    start-up, then goes quiet: every batch is received live or in the replay the
    subscription asks for once its SUB is connected."""
    srv = Server(tmp_path)
    pubs: list[FakePublisher] = []
    try:
        srv.wait_ready()
        ports = [(free_tcp_port(), free_tcp_port()) for _ in range(engines)]
        for e, (p, rp) in enumerate(ports):
            register(srv, f"vllm-{e}", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{rp}")
        time.sleep(1.5)
        pubs = [FakePublisher(p, rp) for p, rp in ports]
        time.sleep(0.3)
        for k in range(4):
            for e, pub in enumerate(pubs):
                pub.publish(prompt_batch(4 * e + k), wait=False)
            time.sleep(0.02)
        last_publish = time.monotonic()

        def all_hit():
            return all(
                npu(srv, f"vllm-{e}", toks(4 * e + k)) == 2
                for e in range(engines)
                for k in range(4)
            )

        wait_until(all_hit, timeout=15, interval=0.05, msg="every prompt hits")
        took = time.monotonic() - last_publish
        print(f"{engines} engine(s): every prompt hit {took:.2f}s after the last publish")
        sources = srv.http.get("/workers").json()["sources"]
        assert len(sources) == engines
        for s in sources:
            assert s["state"] == "live" and s["losses"] == 0 and s["last_seq"] == 3, s
            assert s["batches"] == 4, s
        # the replay was asked once the engine was up (the ROUTER got it), not before
        assert all(pub.replay_requests and pub.replay_requests[0] == 0 for pub in pubs)
    finally:
        for pub in pubs:
            pub.stop()
        srv.terminate()


def chain(k: int) -> bytes:
    """Batch ``k`` of one long prompt: block k (engine hash 0x1000+k) after block k-1."""
    parent = None if k == 0 else 0x1000 + k - 1
    return V33.batch(
        [V33.stored([0x1000 + k], parent, list(range(k * BS + 1, (k + 1) * BS + 1)), BS)]
    )


def test_missed_start_without_replay_is_a_declared_loss(tmp_path):
    """No replay endpoint, and the engine published 47 batches before the subscription
    connected: the first batch seen is a loss that names the missing range, the source
    is degraded, the drops of blocks whose parent came in the missed batches show in
    /workers and /explain, and the engine's later prompts hit."""
    pub = FakePublisher(replay=False)
    srv = Server(tmp_path)
    try:
        for k in range(47):
            pub.publish(chain(k))  # nobody subscribed: the PUB drops them
        srv.wait_ready()
        register(srv, "vllm-prefill-1", pub.url, None)
        wait_until(lambda: pub.subscribers > 0, msg="subscription reached the PUB")
        for k in range(47, 60):
            pub.publish(chain(k))
        pub.publish(prompt_batch(7))  # a new prompt, not chained to the missed ones
        wait_until(lambda: npu(srv, "vllm-prefill-1", toks(7)) == 2, msg="new prompt")
        src = srv.http.get("/workers").json()["sources"][0]
        assert src["last_seq"] == 60 and src["batches"] == 14
        assert (src["losses"], src["state"]) == (1, "degraded")
        assert src["degraded_since"] is not None
        assert src["dropped"] == {"parent_not_found": 13}
        assert src["last_loss"]["why"].startswith("batches 0..46 were published before")
        assert "no replay_endpoint" in src["last_loss"]["why"]
        log = srv.log()
        assert "vllm-prefill-1/dp0@" + pub.url + ": batches 0..46 were published" in log
        assert "source degraded" in log
        doc = srv.http.post(
            "/explain",
            json={"model": "qwen", "block_size": BS, "token_ids": list(range(1, 60 * BS + 1))},
        ).json()
        (s,) = doc["instances"][0]["sources"]
        assert (s["state"], s["losses"], s["dropped"]) == (
            "degraded",
            1,
            {"parent_not_found": 13},
        )
        text = "\n".join(report(doc))
        assert "degraded since" in text and "batches 0..46 were published before" in text
        assert "13 events dropped (parent_not_found" in text
        assert any("parent_not_found" in w for w in doc["warnings"])
        assert any("is degraded" in w and "batches 0..46" in w for w in doc["warnings"])
    finally:
        pub.stop()
        srv.terminate()


def test_quick_reconnect_after_a_long_outage(tmp_path):
    """A source down for a long time comes back within the reconnect cap (1 s), not
    ZeroMQ's 30 s default maximum back-off."""
    port, rport = free_tcp_port(), free_tcp_port()
    srv = Server(tmp_path)
    pub = None
    try:
        srv.wait_ready()
        register(srv, "vllm-prefill-1", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        time.sleep(8)  # 100 ms doubling: 0.1 .. 6.4 s; libzmq's default max would be 30 s
        pub = FakePublisher(port, rport)
        t0 = time.monotonic()
        wait_until(lambda: pub.subscribers > 0, timeout=15, msg="SUB connected")
        took = time.monotonic() - t0
        assert took < 3.0, f"reconnect took {took:.1f}s"
        pub.publish(prompt_batch(1))
        wait_until(lambda: npu(srv, "vllm-prefill-1", toks(1)) == 2, msg="hit")
    finally:
        if pub is not None:
            pub.stop()
        srv.terminate()
