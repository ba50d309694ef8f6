"""Extra keys (docs/api.md, "Block hashing", "Extra keys"): false matches between
multimodal prompts, and what a plain query and a plain ingest batch cost, in one process.

``python bench/extra_keys.py [--pairs 200] [--loops 20000]`` from a checkout's root
(``PYTHONPATH=$PWD``): runs on a tree without extra keys too (the before column), where
a query cannot say its images and events' ``extra_keys`` are skipped.

* **false matches**: ``--pairs`` pairs of prompts with the same text and placeholder
  tokens and different images (random offsets and lengths, block size 16): prompt A's
  vLLM 0.33 map-form ``BlockStored`` (its ``extra_keys`` as ``to_event_extra_keys``
  writes them) is applied through the ingest fast path, then prompt B is queried (with
  its ``mm_inputs`` where the tree takes them). vLLM reuses only the blocks before the
  first block an image overlaps; every matched block past them is a false match.
* **cost**: ``parse_query_ext`` of a plain 4096-token msgpack ``/query`` body, and one
  plain 32-block vLLM batch parsed by the fast path (``FastBatch.parse``): µs per call,
  best of 7 runs of ``--loops`` calls.
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from kvconductor._hash import hash_blocks
from kvconductor._ingest import FastBatch
from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.keys import Medium
from kvconductor.wire import parse_query_ext
from tests.helpers.publishers import FakeConductor

BS = 16
IMG = 151655  # an image placeholder token (the same for every image)


def _ctx() -> SubscriberContext:
    """One engine's HBM subscription: instance, DP, URL, model, tenant, block size."""
    return SubscriberContext("eng", 0, "tcp://127.0.0.1:1", "m", "t", BS, (Medium.NPU,))


def _prompt(rng: random.Random):
    """Tokens and the (offset, length) of one image: text, the image's placeholders, text."""
    pre, n, post = rng.randint(0, 80), rng.randint(16, 200), rng.randint(16, 120)
    text = [rng.randint(0, 100_000) for _ in range(pre + post)]
    return text[:pre] + [IMG] * n + text[pre:], (pre, n)


def _event_keys(nblocks: int, ident: str, off: int, n: int) -> list:
    """vLLM's to_event_extra_keys of one image: ``(identifier, offset in block)``."""
    out: list = []
    for b in range(nblocks):
        s, e = b * BS, (b + 1) * BS
        out.append([[ident, off - s]] if s < off + n and off < e else None)
    return out


def false_matches(pairs: int) -> tuple[int, int, int]:
    """(blocks matched, blocks vLLM reuses, pairs) over ``pairs`` prompt pairs."""
    rng = random.Random(7)
    enc = msgspec.msgpack.Encoder()
    matched = reusable = 0
    for p in range(pairs):
        tokens, (off, n) = _prompt(rng)
        nb = len(tokens) // BS
        conductor = FakeConductor()
        applier = Applier(_ctx(), conductor)
        ev = {"type": "BlockStored", "block_hashes": [p * 1000 + i + 1 for i in range(nb)]}
        ev |= {"parent_block_hash": None, "token_ids": tokens[: nb * BS], "block_size": BS}
        ev |= {"medium": "GPU", "lora_name": None}
        ev["extra_keys"] = _event_keys(nb, f"image-a-{p}", off, n)
        applier.apply_payload(enc.encode([time.time(), [ev], 0]))
        body = {"model": "m", "block_size": BS, "token_ids": tokens[: nb * BS], "tenant_id": "t"}
        body["mm_inputs"] = [{"identifier": f"image-b-{p}", "offset": off, "length": n}]
        out = parse_query_ext(enc.encode(body), True, False)
        index = conductor.get_index("m", "t")
        if len(out) > 8 and out[8] is not None:  # a tree that reads mm_inputs
            from kvconductor.extrakeys import extra_local_hashes

            local = extra_local_hashes(out[3], BS, 1337, out[8], False)
            hits = index.query_by_hash(local).hits
        else:
            hits = index.query(out[3], BS).hits
        matched += sum(h[2] for h in hits)
        reusable += off // BS  # the blocks before the image's first
    return matched, reusable, pairs


def _best(fn, loops: int) -> float:
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


def cost(loops: int) -> tuple[float, float]:
    enc = msgspec.msgpack.Encoder()
    tokens = list(range(1000, 1000 + 4096))
    body = enc.encode({"model": "m", "block_size": BS, "token_ids": tokens})
    ev = {"type": "BlockStored", "block_hashes": list(range(1, 33)), "parent_block_hash": None}
    ev |= {"token_ids": tokens[: 32 * BS], "block_size": BS, "medium": "GPU", "lora_name": None}
    batch = enc.encode([1700000000.5, [ev, {**ev, "block_hashes": list(range(33, 65))}], 0])
    fb = FastBatch()
    assert fb.parse(batch, BS) == 2 and len(hash_blocks(tokens, BS)) == 256
    return _best(lambda: parse_query_ext(body, True, False), loops), _best(
        lambda: fb.parse(batch, BS), loops
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--loops", type=int, default=20000)
    a = ap.parse_args()
    m, r, n = false_matches(a.pairs)
    print(f"{n} prompt pairs (same text, other image): {m} blocks matched, {r} reusable")
    print(f"  false matches: {m - r} blocks ({(m - r) / n:.1f} per pair)")
    q, b = cost(a.loops)
    print(f"plain 4096-token msgpack query parsed: {q:.2f} µs")
    print(f"plain 2x32-block vLLM batch parsed by the fast path: {b:.2f} µs")


if __name__ == "__main__":
    main()
