"""The fault suite's rig (``tests/faults/``): one engine publisher registered with one real
server (``python -m kvconductor``); the request bodies, pool events and the Mooncake-dialect
server its tests share."""

from __future__ import annotations

import contextlib

import httpx

from tests.helpers.publishers import FakePublisher, mooncake_tuple, schema, wait_until
from tests.helpers.server import Server, free_port, registration, started

BS = 4
V33 = schema("vllm", "0.33.0")


def two_block_chain(i: int, **stored) -> tuple[bytes, list[int]]:
    """A vLLM 0.33 batch storing chain ``i`` (two blocks, engine hashes 100i+1, 100i+2;
    ``stored`` added to its BlockStored), and its tokens."""
    toks = [9000 + 8 * i + j for j in range(2 * BS)]
    return V33.batch([V33.stored([100 * i + 1, 100 * i + 2], None, toks, BS, **stored)]), toks


def events(event: dict | None = None, **kw) -> dict:
    """A POST /events body of ``vllm-prefill-1``: one ``stored`` event (block 1, tokens
    hash 2), ``event``'s fields added to it, ``kw`` to the body."""
    ev = {
        "event_id": 1,
        "event_type": "stored",
        "blocks": [{"block_hash": 1, "tokens_hash": 2}],
        **(event or {}),
    }
    return {"instance_id": "vllm-prefill-1", "events": [ev], **kw}


def pool_event(
    kind: str, hashes, medium: str = "cpu", backend_id: str | None = None, **fields
) -> bytes:
    """A pool publisher's message of one ``kind`` event on ``hashes`` (Mooncake tuple),
    naming ``backend_id`` (a node) when given, ``fields`` added."""
    ev = {"event_id": 1, "event_type": kind, "medium": medium, "seq_hashes": list(hashes)}
    if backend_id is not None:
        ev["backend_id"] = backend_id
    ev.update(fields)
    return mooncake_tuple([ev])


def publish_until(pairs, cond, msg: str) -> None:
    """Once each publisher of ``pairs`` (publisher, payload) has seen a subscription (a PUB
    drops what it sends before), publish (every payload idempotent) until ``cond()`` holds."""
    for pub, _ in pairs:
        pub.wait_subscribed()

    def step():
        for pub, payload in pairs:
            pub.publish(payload)
        return cond()

    wait_until(step, msg=msg)


def source(srv: Server, instance_id: str) -> dict:
    """``instance_id``'s one entry of ``srv``'s ``/workers`` ``sources``."""
    (s,) = [
        s for s in srv.http.get("/workers").json()["sources"] if s["instance_id"] == instance_id
    ]
    return s


@contextlib.contextmanager
def mooncake_server(tmp_dir, *args: str):
    """A started :class:`Server` also serving the Mooncake dialect (``--mooncake-port``):
    ``srv.mc`` is a client of that port. Stopped on leaving."""
    port = free_port()
    with started(tmp_dir, "--mooncake-port", str(port), *args) as srv:
        srv.mc = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        try:
            yield srv
        finally:
            srv.mc.close()


def rss_kb(pid: int) -> int:
    """Resident set size of process ``pid`` in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Rig:
    """``Rig(tmp_path, *server_flags, replay=..., fields=...)``: ``pub``, ``srv`` and the
    registration ``body`` of instance ``vllm-prefill-1`` DP 0 (``fields`` added to it, or
    ``fields(pub)`` when it is a function); :meth:`start` restarts the server."""

    def __init__(self, tmp_path, *args, replay=False, fields=None):
        self.pub = FakePublisher(replay=replay)
        self.tmp_path, self.args = tmp_path, args
        self.fields = dict((fields(self.pub) if callable(fields) else fields) or {})
        self.srv = self.start()

    def start(self):
        #: Subscriptions the PUB had seen before this server subscribed (join waits for one more).
        self.subs_before = self.pub.subscribers
        srv = Server(self.tmp_path, *self.args)
        srv.wait_ready()
        body = registration(store_backend="YuanRong", medium_endpoints={"npu": self.pub.url})
        if self.pub.replay_url:
            body["replay_endpoint"] = self.pub.replay_url
        body.update(self.fields)
        assert srv.http.post("/register", json=body).status_code == 201
        self.body = body
        return srv

    def source(self):
        return self.srv.http.get("/workers").json()["sources"][0]

    def npu(self, tokens) -> int:
        return self.blocks(tokens, "npu")

    def blocks(self, tokens, medium: str = "npu") -> int:
        """``<medium>_blocks`` of this DP in a ``/query`` answer for ``tokens`` (0 if absent)."""
        r = self.srv.http.post(
            "/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens}
        ).json()
        dp = r["default"].get("vllm-prefill-1", {}).get("DP", {}).get("0", {})
        return dp.get(f"{medium}_blocks", 0)

    def join(self):
        """PUB/SUB slow joiner: wait until the subscription reached the PUB, then publish
        an empty batch and wait until it arrived."""
        before = self.source()["batches"]
        self.pub.wait_subscribed(self.subs_before + 1)
        self.pub.publish(V33.batch([]))
        wait_until(lambda: self.source()["batches"] > before, msg="subscriber joined")

    def close(self):
        self.srv.terminate()
        self.pub.stop()
