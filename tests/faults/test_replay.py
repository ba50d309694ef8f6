"""A replay ROUTER that trickles: the overall deadline ends it (a loss, not a stall)."""

from __future__ import annotations

import threading
import time

import zmq

from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import Server

BS = 4
V33 = schema("vllm", "0.33.0")


class TricklingRouter:
    """Answers a replay request with one batch per ``interval`` seconds and no end marker
    (bounded: it stops after ``limit`` batches)."""

    def __init__(self, interval: float = 0.5, limit: int = 60) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.interval, self.limit = interval, limit
        self.sent = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        if not self.sock.poll(30_000):
            return
        ident = self.sock.recv_multipart()[0]
        while not self._stop.is_set() and self.sent < self.limit:
            # seq i stores a fresh root block i
            toks = list(range(100 * (self.sent + 1), 100 * (self.sent + 1) + BS))
            payload = V33.batch([V33.stored([0x5000 + self.sent], None, toks, BS, medium="GPU")])
            self.sock.send_multipart([ident, b"", b"", self.sent.to_bytes(8, "big"), payload])
            self.sent += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)
        self.sock.close(0)


def test_trickling_replay_hits_the_deadline(tmp_path):
    router = TricklingRouter(interval=0.5)
    pub = FakePublisher(replay=False)
    srv = Server(tmp_path, "--replay-deadline-secs", "2")
    try:
        srv.wait_ready()
        t0 = time.monotonic()
        r = srv.http.post(
            "/register",
            json={
                "instance_id": "vllm-prefill-1",
                "type": "vLLM",
                "modelname": "qwen",
                "block_size": BS,
                "dp_rank": 0,
                "store_backend": "YuanRong",
                "medium_endpoints": {"npu": pub.url},
                "replay_endpoint": router.url,
            },
        )
        assert r.status_code == 201

        def source():
            return srv.http.get("/workers").json()["sources"][0]

        wait_until(
            lambda: (
                source()["replays"] >= 1
                and source()["state"] != "replaying"
                and source()["dropped"].get("replay_failed")
            ),
            timeout=15,
            msg="replay ended by the deadline",
        )
        elapsed = time.monotonic() - t0
        src = source()
        # The ROUTER never went quiet for 5 s: only the 2 s deadline could end it.
        assert 1.5 < elapsed < 10 and src["state"] in ("degraded", "connecting")
        assert src["losses"] >= 1 and 2 <= src["replayed_batches"] <= 8
        assert "not finished within 2s" in srv.log()
        # What did arrive was applied, and the live stream goes on.
        body = {"model": "qwen", "block_size": BS, "token_ids": list(range(100, 100 + BS))}
        assert (
            srv.http.post("/query", json=body).json()["default"]["vllm-prefill-1"]["DP"]["0"][
                "npu_blocks"
            ]
            == 1
        )
    finally:
        srv.terminate()
        pub.stop()
        router.stop()
