"""Bounds on what one ZeroMQ message may add: refused whole, counted, memory untouched."""

from __future__ import annotations

from tests.helpers.faults import BS, V33, Rig, rss_kb
from tests.helpers.publishers import wait_until


def test_oversized_messages_are_refused_and_counted(tmp_path):
    rig = Rig(tmp_path, "--max-blocks-per-message", "100000", "--max-message-mb", "8")
    try:
        rig.join()
        before = rss_kb(rig.srv.proc.pid)
        # 2M blocks in one message (hashes only, ~18 MB): over both bounds.
        rig.pub.publish(
            V33.batch([V33.stored(list(range(1, 2_000_001)), None, [], BS, medium="GPU")])
        )
        # 200k blocks (~1.8 MB): under the byte bound, over the block bound.
        rig.pub.publish(
            V33.batch([V33.stored(list(range(1, 200_001)), None, [], BS, medium="GPU")])
        )
        toks = list(range(1, 1 + 2 * BS))
        rig.pub.publish(V33.batch([V33.stored([7, 8], None, toks, BS, medium="GPU")]))
        wait_until(
            lambda: rig.source()["dropped"].get("message_too_many_blocks") == 1,
            msg="block bound counted",
        )
        assert rig.source()["dropped"]["message_too_large"] == 1
        # The normal message after them is applied; nothing of the big ones is.
        wait_until(lambda: rig.npu(toks) == 2, msg="applied")
        (idx,) = rig.srv.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == 2
        assert rss_kb(rig.srv.proc.pid) - before < 64 * 1024, "refused messages cost no memory"
    finally:
        rig.close()
