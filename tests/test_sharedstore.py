"""A shared store's blocks, placed after their HBM holder's chain (ingest.sharedstore)."""

from __future__ import annotations

import pytest

from kvconductor.index import Index
from kvconductor.ingest.sharedstore import hbm_keys, store_shared
from kvconductor.keys import Medium, WorkerKey
from tests.helpers.publishers import hits

BS = 4
TOK = list(range(100, 116))  # 4 blocks
H = [0x700 + i for i in range(4)]


def key(iid: str, medium: Medium = Medium.CPU) -> WorkerKey:
    return WorkerKey(iid, iid, 0, medium)


@pytest.fixture
def index(impl):
    idx = Index("m", "t", impl=impl)
    yield idx
    idx.close()


def test_blocks_go_to_every_target_after_the_holders_chain(index):
    index.store_tokens(key("a", Medium.NPU), None, H, TOK, BS)
    placed, joined, waiting = store_shared(index, [key("a"), key("b")], H, 0.0)
    assert (placed, joined, waiting) == (8, 0, 0)
    index.remove(key("a", Medium.NPU), H[2:])
    # a: 2 blocks in HBM, continued on CPU to 4; b: no HBM, 4 on CPU from the root
    assert hits(index, TOK, BS) == {("a", 0): (2, 2, 0), ("b", 0): (0, 4, 0)}
    # the holder's parent and local hash: the same block on each tier
    assert (
        index.block_of(key("b"), H[1])
        == index.block_of(key("a"), H[1])
        == (
            H[0],
            index.block_of(key("a"), H[1])[1],
        )
    )


def test_a_block_no_one_holds_in_hbm_waits_for_an_offload(index):
    placed, joined, waiting = store_shared(index, [key("a"), key("b")], [0x999], 0.0)
    assert (placed, joined, waiting) == (0, 0, 2)
    assert index.summary()["pending_pool"] == 2
    index.offload([0x999], [12345], None, 1.0)
    assert index.worker_blocks(key("a")) == index.worker_blocks(key("b")) == 1


def test_hbm_keys_one_per_dp():
    ks = [key("a"), key("a", Medium.DISK), key("b")]
    assert hbm_keys(ks) == [key("a", Medium.NPU), key("b", Medium.NPU)]
