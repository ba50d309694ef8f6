"""kvconductor.ingest.storeonly: a store-only source's bound (one entry per chunk, its
blocks counted before the split; the split itself is tests/test_hash.py's)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvconductor._py import hash as py_hash
from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.stats import Limits
from kvconductor.ingest.storeonly import (
    WEIGH_BYTES,
    StoreOnlyBound,
    chunk_blocks,
    chunk_factor,
    claimed_blocks,
)
from kvconductor.keys import Medium, StoreBackend, WorkerKey
from tests.helpers.publishers import FakeConductor, hits, mooncake_tuple, schema

BS = 4
CHUNK = 8  # two registered blocks per chunk
IID = "lmc"
V33 = schema("vllm", "0.33.0")
CPU = WorkerKey(IID, IID, 0, Medium.CPU)


def _ctx(**kw):
    return SubscriberContext(
        instance_id=IID,
        dp_rank=0,
        url="tcp://127.0.0.1:1",
        model="m",
        tenant="t",
        block_size=BS,
        default_media=(Medium.NPU,),
        store_backend=StoreBackend.MOONCAKE,
        **kw,
    )


def _chunk(h, parent, tokens):
    return V33.stored([h], parent, tokens, CHUNK, medium="CPU")


def _toks(i):
    return list(range(1000 + i * CHUNK, 1000 + (i + 1) * CHUNK))


def test_chunk_blocks():
    assert chunk_factor(256, 16) == 16
    assert chunk_blocks(3, 256, 16) == 48
    assert chunk_blocks(3, 16, 16) == 3
    assert chunk_blocks(3, 0, 16) == 3
    assert chunk_blocks(3, 24, 16) == 3  # not a multiple: dropped later as a mismatch


# -- the bound ------------------------------------------------------------------------------


def test_bound_counts_blocks_with_one_entry_per_chunk():
    b = StoreOnlyBound(600.0, 100)
    b.note(CPU, [1, 2], 0.0, k=16)
    assert (len(b.held), b.blocks) == (2, 32)
    b.note(CPU, [1], 1.0, k=16)  # a re-announcement is no second holding
    assert (len(b.held), b.blocks) == (2, 32)
    assert list(b.held) == [(CPU, 2), (CPU, 1)]
    gone = b.forget(CPU, [2])
    assert gone == py_hash.split_chunk_hashes([2], 16)
    assert (b.blocks, b.removed) == (16, 16)
    assert b.clear([CPU]) == 16
    assert (b.blocks, len(b.held), b.removed) == (0, 0, 32)


def test_bound_capacity_is_in_registered_blocks():
    b = StoreOnlyBound(600.0, 40)
    b.note(CPU, [1, 2], 0.0, k=16)
    b.note(CPU, [3], 0.0, k=16)
    due = b.due(1.0)
    assert due == {CPU: py_hash.split_chunk_hashes([1], 16)}
    assert (b.blocks, b.evicted, b.expired) == (32, 16, 0)
    assert b.due(601.0) == {CPU: py_hash.split_chunk_hashes([2, 3], 16)}
    assert (b.blocks, b.expired) == (0, 32)


def test_bound_seeded_blocks_join_their_reannounced_chunk():
    """A warm start seeds single blocks; the chunk announced again is one entry."""
    b = StoreOnlyBound(600.0, 100)
    b.seed(CPU, py_hash.split_chunk_hashes([9], 4), 0.0)
    assert (len(b.held), b.blocks) == (4, 4)
    b.note(CPU, [9], 1.0, k=4)
    assert (len(b.held), b.blocks) == (1, 4)


# -- through the applier ------------------------------------------------------------------


@pytest.fixture
def fake(impl):
    return FakeConductor(impl)


def test_a_chunk_counts_as_its_blocks_against_the_message_bound(fake):
    eng = Applier(_ctx(store_only=(600.0, 1000)), fake, limits=Limits(max_blocks_per_message=3))
    # one chunk hash standing for 4 registered blocks: over a bound of 3, refused whole
    big = V33.stored([77], None, list(range(16)), 16, medium="CPU")
    assert not eng.apply_payload(V33.batch([big]))
    assert eng.stats.dropped == {"message_too_many_blocks": 1}
    assert eng.store_bound.blocks == 0
    assert hits(fake.indexes.get(("m", "t")), list(range(16)), BS) == {}
    # 2 registered blocks: under the bound
    assert eng.apply_payload(V33.batch([_chunk(1, None, _toks(0))]))
    assert hits(fake.indexes[("m", "t")], _toks(0), BS) == {(IID, 0): (0, 2, 0)}


def test_a_chunk_counts_as_its_blocks_against_the_source_bound(fake):
    eng = Applier(_ctx(store_only=(600.0, 1000)), fake, limits=Limits(max_blocks_per_source=5))
    assert eng.apply_payload(V33.batch([_chunk(1, None, _toks(0)), _chunk(2, 1, _toks(1))]))
    assert eng.store_bound.blocks == 4
    # 2 more would make 6 > 5: refused whole
    assert not eng.apply_payload(V33.batch([_chunk(3, 2, _toks(2))]))
    assert eng.stats.dropped == {"source_block_limit": 1}
    # the source removes a chunk: room again
    assert eng.apply_payload(V33.batch([V33.removed([1], medium="CPU")]))
    assert eng.store_bound.blocks == 2
    assert eng.apply_payload(V33.batch([_chunk(4, None, _toks(3))]))
    assert eng.store_bound.blocks == 4


def test_removals_and_clears_leave_the_bound(fake):
    eng = Applier(_ctx(store_only=(600.0, 4)), fake)
    chunks = [_chunk(i + 1, i or None, _toks(i)) for i in range(2)]
    eng.apply_payload(V33.batch(chunks))
    idx = fake.indexes[("m", "t")]
    toks = _toks(0) + _toks(1)
    assert hits(idx, toks, BS) == {(IID, 0): (0, 4, 0)}
    # BlockRemoved of the second chunk's hash: both of its registered blocks go
    eng.apply_payload(V33.batch([V33.removed([2], medium="CPU")]))
    assert hits(idx, toks, BS) == {(IID, 0): (0, 2, 0)}
    assert idx.worker_blocks(CPU) == 2
    info = eng.store_bound.info()
    assert (info["blocks"], info["removed_blocks"], info["evicted_blocks"]) == (2, 2, 0)
    # a new chunk fits the capacity of 4: nothing is evicted early
    other = list(range(5000, 5008))
    eng.apply_payload(V33.batch([_chunk(50, None, other)]))
    assert eng.store_bound.info()["evicted_blocks"] == 0
    assert hits(idx, toks, BS) == {(IID, 0): (0, 2, 0)}
    assert hits(idx, other, BS) == {(IID, 0): (0, 2, 0)}
    assert idx.worker_blocks(CPU) == 4


def test_all_blocks_cleared_empties_the_bound_of_the_cleared_media(fake):
    ctx = replace(_ctx(store_only=(600.0, 100)), default_media=(Medium.NPU, Medium.CPU))
    eng = Applier(ctx, fake)
    eng.apply_payload(V33.batch([_chunk(1, None, _toks(0))]))
    assert eng.store_bound.blocks == 2
    eng.apply_payload(V33.batch([V33.cleared()]))
    assert eng.store_bound.info()["blocks"] == 0
    assert hits(fake.indexes[("m", "t")], _toks(0), BS) == {}


def test_expiry_removes_every_block_of_a_chunk(fake):
    eng = Applier(_ctx(store_only=(30.0, 100)), fake)
    eng.apply_payload(V33.batch([_chunk(1, None, _toks(0))]))
    assert eng.expire_store_only(time.monotonic() + 31) == 2
    assert fake.indexes[("m", "t")].worker_blocks(CPU) == 0


def test_claimed_blocks_reads_the_weight_without_the_tokens():
    big = V33.stored([1, 2], None, list(range(2 * 16)), 16, medium="CPU")
    hbm = V33.stored([3, 4, 5], None, list(range(12)), BS, medium="GPU")
    payload = V33.batch([big, hbm, V33.removed([9], medium="CPU"), V33.cleared()])
    # 2 chunks of 4 blocks, 3 HBM blocks, 1 removal
    assert claimed_blocks(payload, BS) == 8 + 3 + 1
    assert claimed_blocks(V33.batch([]), BS) == 0
    assert claimed_blocks(mooncake_tuple([{"event_type": "stored", "seq_hashes": [1]}]), BS) is None
    assert claimed_blocks(b"\x00garbage", BS) is None


def test_a_big_chunk_is_refused_before_it_is_decoded(fake):
    """Over ``WEIGH_BYTES`` the message is weighed without its token ids: refused the same."""
    eng = Applier(_ctx(store_only=(600.0, 10**6)), fake, limits=Limits(max_blocks_per_message=1000))
    n = 250_000  # ids over 2**16: 5 bytes each in msgpack, 1.25 MB
    payload = V33.batch([V33.stored([77], None, [100_000] * n, n, medium="CPU")])
    assert len(payload) >= WEIGH_BYTES
    assert claimed_blocks(payload, BS) == n // BS
    assert not eng.apply_payload(payload)
    assert eng.stats.dropped == {"message_too_many_blocks": 1}
    assert (eng.stats.batches, eng.store_bound.blocks) == (0, 0)
    # under the bound the same size is applied
    eng = Applier(_ctx(store_only=(600.0, 10**6)), fake)
    assert eng.apply_payload(payload)
    assert eng.store_bound.blocks == n // BS
    assert fake.indexes[("m", "t")].worker_blocks(CPU) == n // BS
