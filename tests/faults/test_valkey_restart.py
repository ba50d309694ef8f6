"""Valkey restarted empty while engines keep publishing: what their replay rings still hold
is not lost.

Three replicas share one real ``valkey-server``; two engines (vLLM 0.33 wire format, with
replay endpoints) publish 20 batches a second, each storing a new prompt and removing an
older one. Valkey is SIGKILLed and restarted without persistence about 4 s later. After
the store is seeded again, every source resumes from the last cursor its owner knows with
a replay, so at quiescence every replica answers every prompt exactly as the engines hold
it.
"""

from __future__ import annotations

import threading
import time

from tests.helpers.faults import BS, V33
from tests.helpers.publishers import FakePublisher, wait_until
from tests.helpers.server import Server, start_replicas, stop_replicas

KEEP = 10  # an engine holds its last KEEP prompts


def toks(e: int, i: int) -> list[int]:
    return [100_000 * (e + 1) + 2 * BS * i + j for j in range(2 * BS)]


def ehash(e: int, i: int, k: int) -> int:
    return 1_000_000 * (e + 1) + 2 * i + k


def batch(e: int, i: int) -> bytes:
    """Engine ``e``'s batch ``i``: store prompt i (2 blocks), remove prompt i - KEEP."""
    events = [V33.stored([ehash(e, i, 0), ehash(e, i, 1)], None, toks(e, i), BS, medium="GPU")]
    if i >= KEEP:
        events.append(V33.removed([ehash(e, i - KEEP, 0), ehash(e, i - KEEP, 1)], medium="GPU"))
    return V33.batch(events)


class Engine:
    """A publisher thread: batch i every ``period`` seconds until stopped."""

    def __init__(self, e: int, period: float = 0.05) -> None:
        self.e, self.period = e, period
        self.pub = FakePublisher(replay=True)
        self.sent = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.pub.publish(batch(self.e, self.sent))
            self.sent += 1
            self._stop.wait(self.period)

    def stop_publishing(self) -> None:
        self._stop.set()
        self._t.join(10)

    def expected(self, i: int) -> int:
        return 2 if self.sent - KEEP <= i < self.sent else 0


def npu(srv: Server, e: int, i: int) -> int:
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": toks(e, i)})
    assert r.status_code == 200, r.text
    d = r.json()["default"].get(f"eng-{e}", {})
    return d.get("DP", {}).get("0", {}).get("npu_blocks", 0)


class Prober:
    """Queries every replica every 20 ms and records any answer that is not a 200: a
    replica loading the seeded state must keep answering from what it held."""

    def __init__(self, servers: list[Server]) -> None:
        self.servers = servers
        self.bad: list[tuple[int, str]] = []
        self.count = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        body = {"model": "qwen", "block_size": BS, "token_ids": toks(0, 1)}
        while not self._stop.wait(0.02):
            for s in self.servers:
                r = s.http.post("/query", json=body)
                self.count += 1
                if r.status_code != 200:
                    self.bad.append((r.status_code, r.text))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


def test_valkey_restarted_empty_loses_nothing_the_rings_hold(tmp_path, valkey_server):
    engines = [Engine(0), Engine(1)]
    servers: list[Server] = []
    prober = None
    try:
        servers = start_replicas(tmp_path, valkey_server, "abc")
        for e, eng in enumerate(engines):
            body = {
                "instance_id": f"eng-{e}",
                "type": "vLLM",
                "modelname": "qwen",
                "block_size": BS,
                "dp_rank": 0,
                "medium_endpoints": {"npu": eng.pub.url},
                "replay_endpoint": eng.pub.replay_url,
            }
            assert servers[e].http.post("/register", json=body).status_code == 201
        for eng in engines:
            eng.start()
        wait_until(
            lambda: all(npu(s, e, 5) == 2 for s in servers for e in range(2)),
            msg="indexed on every replica",
        )
        prober = Prober(servers)
        time.sleep(1.0)
        valkey_server.kill()
        time.sleep(4.0)
        valkey_server.start()  # empty: no persistence
        time.sleep(4.0)
        for eng in engines:
            eng.stop_publishing()
        prober.stop()
        assert prober.count > 100 and prober.bad == []

        def all_right() -> bool:
            return all(
                npu(s, e, i) == eng.expected(i)
                for s in servers
                for e, eng in enumerate(engines)
                for i in range(eng.sent)
            )

        try:
            wait_until(all_right, timeout=40, interval=0.5, msg="every replica exact")
        except AssertionError:
            wrong = {
                (name, e): [i for i in range(eng.sent) if npu(s, e, i) != eng.expected(i)]
                for name, s in zip("abc", servers, strict=True)
                for e, eng in enumerate(engines)
            }
            logs = "\n".join(s.log()[-3000:] for s in servers)
            raise AssertionError(f"wrong answers {wrong}\n{logs}") from None
        for s in servers:
            for src in s.http.get("/workers").json()["sources"]:
                assert src["losses"] == 0, src
        assert "seeding it again" in "".join(s.log() for s in servers)

        # the two sources end up on two replicas (the first replica to see the restarted
        # store takes both; it hands one over once the others have joined)
        def spread() -> list[int]:
            return sorted(
                s.http.get("/workers").json()["replica"]["sources_consumed"] for s in servers
            )

        wait_until(lambda: spread() == [0, 1, 1], msg="sources spread over replicas")
    finally:
        if prober is not None:
            prober.stop()
        for eng in engines:
            eng.stop_publishing()
            eng.pub.stop()
        stop_replicas(servers)
