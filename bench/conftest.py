"""Shared benchmark fixtures (pytest-benchmark; run with ``pytest bench --benchmark-only``)."""

import array
import random

import pytest

BLOCK = 16  # tokens per block (vLLM's default)
DOC_BLOCKS = 62_500  # 1M tokens
FULL_HOLDERS = 8  # workers holding the whole 1M-token document
WORKERS = 64
EVENT_BLOCKS = 32  # blocks per BlockStored event, as engines publish them


def make_tokens(n, seed):
    rnd = random.Random(seed)
    return array.array("I", (rnd.randrange(1, 150_000) for _ in range(n)))


def build_index(impl="c"):
    """~1M (worker, block) pairs over 64 HBM workers.

    Workers 0..7 hold the same 62,500-block (1M-token) document, each under its
    own engine hashes; workers 8..63 each hold ~9,000 blocks of their own prompts
    (4 prompts of ~2,250 blocks sharing a 256-block system prompt).
    """
    from kvconductor._hash import hash_blocks
    from kvconductor.index import Index
    from kvconductor.keys import Medium, WorkerKey

    ix = Index("bench", "default", impl=impl)
    doc = make_tokens(DOC_BLOCKS * BLOCK, 1)
    doc_h = hash_blocks(doc, BLOCK)
    system = make_tokens(256 * BLOCK, 2)
    for w in range(WORKERS):
        key = WorkerKey(f"inst-{w // 8}", f"inst-{w // 8}", w % 8, Medium.NPU)
        if w < FULL_HOLDERS:
            chains = [doc_h]
        else:
            chains = []
            for p in range(4):
                body = make_tokens(2_000 * BLOCK, 1000 * w + p)
                chains.append(hash_blocks(system + body, BLOCK))
        base = (w + 1) << 40
        for c, hashes in enumerate(chains):
            seqs = array.array(
                "Q", range(base + c * 10_000_000, base + c * 10_000_000 + len(hashes))
            )
            parent = None
            for i in range(0, len(hashes), EVENT_BLOCKS):
                ix.store(key, parent, seqs[i : i + EVENT_BLOCKS], hashes[i : i + EVENT_BLOCKS])
                parent = seqs[min(i + EVENT_BLOCKS, len(hashes)) - 1]
    return ix, doc


@pytest.fixture(scope="session")
def big_index():
    return build_index()
