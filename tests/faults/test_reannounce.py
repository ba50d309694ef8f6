"""vLLM's per-request ``kv_cache_report_mode="full"``: blocks reused from the prefix cache
are announced again as ``BlockStored``. A re-announcement is no second holding: one later
``BlockRemoved`` removes the block (llm-d found the opposite in review). Through the real
server, on the compiled fast path (HBM batches), on the general path (a batch with a CPU
event) and for a store-only source's CPU chunk."""

from __future__ import annotations

from tests.helpers.faults import BS, V33, Rig
from tests.helpers.publishers import wait_until

TOK = list(range(500, 500 + 3 * BS))
E = [0x51, 0x52, 0x53]


def _handled(rig: Rig, n: int) -> dict:
    def done():
        s = rig.source()
        return s if s["batches"] + sum(s["dropped"].values()) >= n else None

    return wait_until(done, msg=f"{n} batches handled")


def _total(rig: Rig) -> int:
    (idx,) = rig.srv.http.get("/workers").json()["indexer"]
    return idx["total_blocks"]


def test_a_reannounced_hbm_block_goes_with_one_removal(tmp_path):
    rig = Rig(tmp_path)
    try:
        rig.join()
        n = rig.source()["batches"]
        full = V33.stored(E, None, TOK, BS, medium="GPU")
        rig.pub.publish(V33.batch([full]))
        # the next request reuses the prefix: "full" mode announces the blocks again
        rig.pub.publish(V33.batch([full]))
        rig.pub.publish(V33.batch([V33.stored(E[1:], E[0], TOK[BS:], BS, medium="GPU")]))
        _handled(rig, n + 3)
        assert (rig.npu(TOK), _total(rig)) == (3, 3)
        rig.pub.publish(V33.batch([V33.removed([E[2]], medium="GPU")]))
        _handled(rig, n + 4)
        assert (rig.npu(TOK), _total(rig)) == (2, 2)
        # general path: the same in a batch that also carries a CPU event (offload phase 1)
        cpu = V33.stored([0x99], None, list(range(9000, 9000 + BS)), BS, medium="CPU")
        rig.pub.publish(V33.batch([full, cpu]))
        _handled(rig, n + 5)
        assert rig.npu(TOK) == 3
        rig.pub.publish(V33.batch([V33.removed([E[0]], medium="GPU")]))
        _handled(rig, n + 6)
        assert (rig.npu(TOK), _total(rig)) == (0, 2)
        rig.pub.publish(V33.batch([V33.removed([E[1], E[2]], medium="GPU"), cpu]))
        _handled(rig, n + 7)
        assert (rig.npu(TOK[BS:]), _total(rig)) == (0, 0)
        assert rig.source()["dropped"] == {}
    finally:
        rig.close()


def test_a_reannounced_store_only_chunk_goes_with_one_removal(tmp_path):
    rig = Rig(tmp_path, fields={"store_only": {"ttl_secs": 600, "capacity": 1000}})
    try:
        rig.join()
        n = rig.source()["batches"]
        chunk = V33.stored([0x77], None, TOK[: 2 * BS], 2 * BS, medium="CPU")
        for _ in range(3):
            rig.pub.publish(V33.batch([chunk]))
        s = _handled(rig, n + 3)
        assert rig.blocks(TOK, "cpu") == 2
        assert (s["store_only"]["blocks"], _total(rig)) == (2, 2)
        rig.pub.publish(V33.batch([V33.removed([0x77], medium="CPU")]))
        s = _handled(rig, n + 4)
        assert rig.blocks(TOK, "cpu") == 0
        assert (s["store_only"]["blocks"], _total(rig)) == (0, 0)
    finally:
        rig.close()
