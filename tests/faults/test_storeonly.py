"""A store-only source (LMCache's chunks on CPU) through the real server: a chunk counts as
the registered blocks it stands for against the message and source bounds, and the bound
follows the removals the source does send (docs/api.md, "Store-only sources")."""

from __future__ import annotations

from tests.helpers.faults import BS, V33, Rig
from tests.helpers.publishers import wait_until

CHUNK = 2 * BS  # one chunk = two registered blocks


def _toks(i: int) -> list[int]:
    return list(range(1000 + i * CHUNK, 1000 + (i + 1) * CHUNK))


def _chunk(h: int, parent: int | None, tokens: list[int]) -> bytes:
    return V33.batch([V33.stored([h], parent, tokens, len(tokens), medium="CPU")])


def _settled(rig: Rig, batches: int) -> dict:
    """The source once ``batches`` messages beyond the join were handled (applied or
    refused)."""

    def done():
        s = rig.source()
        return s if s["batches"] + sum(s["dropped"].values()) >= batches else None

    return wait_until(done, msg=f"{batches} messages handled")


def test_a_chunk_counts_as_the_blocks_it_stands_for(tmp_path):
    rig = Rig(
        tmp_path,
        "--max-blocks-per-message",
        "1000",
        "--max-blocks-per-source",
        "1500",
        fields={"store_only": {"ttl_secs": 600, "capacity": 100000}},
    )
    try:
        rig.join()
        base = rig.source()["batches"]
        # one hash standing for 5000 registered blocks (20000 tokens): over 1000 a message;
        # then 60000 blocks in 1.2 MB (ids of 5 msgpack bytes): weighed before decoding
        big = list(range(1, 1 + 5000 * BS))
        rig.pub.publish(_chunk(77, None, big))
        rig.pub.publish(_chunk(76, None, [100_000] * (60_000 * BS)))
        # 800 blocks: accepted; 800 more would make 1600 > 1500 held by the source
        mid = [list(range(100_000 + i * 800 * BS, 100_000 + (i + 1) * 800 * BS)) for i in range(2)]
        rig.pub.publish(_chunk(78, None, mid[0]))
        rig.pub.publish(_chunk(79, None, mid[1]))
        rig.pub.publish(_chunk(80, None, _toks(0)))
        s = _settled(rig, base + 5)
        assert s["dropped"] == {"message_too_many_blocks": 2, "source_block_limit": 1}
        assert s["store_only"]["blocks"] == 802
        (idx,) = rig.srv.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == 802
        assert rig.blocks(big[: 10 * BS], "cpu") == 0
        assert rig.blocks(mid[0], "cpu") == 800
        assert rig.blocks(mid[1], "cpu") == 0
        assert rig.blocks(_toks(0), "cpu") == 2
        assert "dropped (message_too_many_blocks) 5000 blocks > 1000" in rig.srv.log()
        assert rig.blocks([100_000] * (2 * BS), "cpu") == 0
    finally:
        rig.close()


def test_the_bound_follows_removals(tmp_path):
    rig = Rig(
        tmp_path,
        fields=lambda pub: {
            "store_only": {"ttl_secs": 600, "capacity": 6},
            # the engine's publisher carries its CPU tier too: AllBlocksCleared clears it
            "medium_endpoints": {"npu": pub.url, "cpu": pub.url},
        },
    )
    try:
        rig.join()
        base = rig.source()["batches"]
        chain = _toks(0) + _toks(1) + _toks(2)
        rig.pub.publish(_chunk(1, None, _toks(0)))
        rig.pub.publish(_chunk(2, 1, _toks(1)))
        rig.pub.publish(_chunk(3, 2, _toks(2)))
        _settled(rig, base + 3)
        assert rig.blocks(chain, "cpu") == 6
        # the source removes the third chunk (its one hash): both of its blocks go
        rig.pub.publish(V33.batch([V33.removed([3], medium="CPU")]))
        s = _settled(rig, base + 4)
        assert rig.blocks(chain, "cpu") == 4
        assert (s["store_only"]["blocks"], s["store_only"]["removed_blocks"]) == (4, 2)
        # a new chunk fits the capacity of 6: nothing announced before leaves early
        other = _toks(9)
        rig.pub.publish(_chunk(50, None, other))
        s = _settled(rig, base + 5)
        assert rig.blocks(other, "cpu") == 2
        assert rig.blocks(chain, "cpu") == 4
        so = s["store_only"]
        assert (so["blocks"], so["evicted_blocks"], so["expired_blocks"]) == (6, 0, 0)
        (idx,) = rig.srv.http.get("/workers").json()["indexer"]
        assert idx["total_blocks"] == 6
        # AllBlocksCleared: the bound holds nothing more than the index
        rig.pub.publish(V33.batch([V33.cleared()]))
        s = _settled(rig, base + 6)
        assert rig.blocks(other, "cpu") == 0
        assert s["store_only"]["blocks"] == 0
    finally:
        rig.close()
