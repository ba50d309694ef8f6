"""Bounds on what one ZeroMQ message may add: refused whole, counted, memory untouched."""
from __future__ import annotations

from publishers import FakePublisher, schema, wait_until
from test_server import Server

BS = 4
V33 = schema("vllm", "0.33.0")


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_oversized_messages_are_refused_and_counted(tmp_path):
    pub = FakePublisher(replay=False)
    srv = Server(tmp_path, "--max-blocks-per-message", "100000", "--max-message-mb", "8")
    try:
        srv.wait_ready()
        assert srv.http.post("/register", json={
            "instance_id": "vllm-prefill-1", "type": "vLLM", "modelname": "qwen",
            "block_size": BS, "dp_rank": 0, "store_backend": "YuanRong",
            "medium_endpoints": {"npu": pub.url}}).status_code == 201

        def source():
            return srv.http.get("/workers").json()["sources"][0]

        def joined():
            pub.publish(V33.batch([]))
            return source()["batches"] > 0
        wait_until(joined, msg="subscriber joined")
        before = rss_kb(srv.proc.pid)
        # 2M blocks in one message (hashes only, ~18 MB): over both bounds.
        huge = V33.batch([V33.stored(list(range(1, 2_000_001)), None, [], BS, medium="GPU")])
        pub.publish(huge)
        # 200k blocks (~1.8 MB): under the byte bound, over the block bound.
        pub.publish(V33.batch([V33.stored(list(range(1, 200_001)), None, [], BS,
                                          medium="GPU")]))
        toks = list(range(1, 1 + 2 * BS))
        pub.publish(V33.batch([V33.stored([7, 8], None, toks, BS, medium="GPU")]))
        wait_until(lambda: source()["dropped"].get("message_too_many_blocks") == 1,
                   msg="block bound counted")
        src = source()
        assert src["dropped"]["message_too_large"] == 1
        # The normal message after them is applied; nothing of the big ones is.
        body = {"model": "qwen", "block_size": BS, "token_ids": toks}
        wait_until(lambda: srv.http.post("/query", json=body).json()["default"], msg="applied")
        (idx,) = srv.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == 2
        assert rss_kb(srv.proc.pid) - before < 64 * 1024, "refused messages cost no memory"
    finally:
        srv.terminate()
        pub.stop()
