"""The fault suite's rig (``tests/faults/``): one engine publisher registered with one real
server (``python -m kvconductor``)."""

from __future__ import annotations

from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import Server

BS = 4
V33 = schema("vllm", "0.33.0")


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
        body = {
            "instance_id": "vllm-prefill-1",
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": BS,
            "dp_rank": 0,
            "store_backend": "YuanRong",
            "medium_endpoints": {"npu": self.pub.url},
        }
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
