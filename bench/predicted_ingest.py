"""Ingest with the router's predictions live on every DP: one engine batch per prediction.

A router that predicts every request (``POST /predict``) keeps predictions live on nearly
every DP; this measures what that costs the ingest thread's apply of the engines' batches.
``--dps`` engines (one DP each) take requests round-robin: a prompt is a shared system
prefix and blocks of its own (``--blocks``, ``--block-size`` tokens each); the router
predicts each request ``--ahead`` requests before its engine's batch arrives, so every
batch finds predictions of its DP live; each batch is one ``BlockStored`` of the prompt
(token ids, vLLM's map form), and every ``--evict-every``-th batch starts with a
``BlockRemoved`` of an older prompt's own blocks (an LRU engine at capacity). In process:
``Applier.apply_payload`` timed alone (the prediction's own ``Predictions.add`` apart),
without predictions and with them, ``--runs`` alternating rounds, the median printed.

    python bench/predicted_ingest.py [--dps 64] [--requests 4000] [--blocks 32]
                                     [--ahead 2] [--evict-every 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec

from bench.bench_ingest import Conductor
from kvconductor._hash import hash_blocks
from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.keys import Medium
from kvconductor.predict import Predictions

ENC = msgspec.msgpack.Encoder()
TS = 1700000000.5


def make_requests(args, rng: random.Random):
    """(dp, local hashes, payload) per request, round-robin over the DPs."""
    bs = args.block_size
    system = [rng.randrange(1, 2**31) for _ in range(bs * args.system_blocks)]
    out, last = [], {}
    for i in range(args.requests):
        dp = i % args.dps
        own = [rng.randrange(1, 2**31) for _ in range(bs * args.blocks)]
        tokens = system + own
        local = hash_blocks(tokens, bs)
        ehashes = [h ^ 0x5BD1E995 for h in local]
        evs = []
        old = last.get(dp)
        if old is not None and (i // args.dps) % args.evict_every == args.evict_every - 1:
            evs.append({"type": "BlockRemoved", "block_hashes": old, "medium": "GPU"})
        evs.append(
            {
                "type": "BlockStored",
                "block_hashes": ehashes,
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": bs,
                "medium": "GPU",
            }
        )
        last[dp] = ehashes[args.system_blocks :]
        out.append((dp, local, ENC.encode([TS, evs, i])))
    return out


def run(args, requests, predict: bool):
    conductor = Conductor(None)
    appliers = []
    for dp in range(args.dps):
        ctx = SubscriberContext(
            instance_id=f"engine-{dp}",
            dp_rank=0,
            url=f"tcp://127.0.0.1:{6000 + dp}",
            model="m",
            tenant="t",
            block_size=args.block_size,
            default_media=(Medium.NPU,),
        )
        appliers.append(Applier(ctx, conductor))
    index = conductor.get_or_create_index("m", "t")
    preds = Predictions(clock=lambda: 0.0)
    apply_s = add_s = 0.0
    n = len(requests)
    clock = time.perf_counter
    for i in range(n + args.ahead):
        j = i + args.ahead  # the router predicts request j before request i's batch
        if predict and j < n:
            dp, local, _ = requests[j]
            t0 = clock()
            preds.add(index, f"engine-{dp}", 0, local)
            add_s += clock() - t0
        if i < n:
            dp, _, payload = requests[i]
            t0 = clock()
            appliers[dp].apply_payload(payload)
            apply_s += clock() - t0
    blocks = sum(a.stats.blocks for a in appliers)
    return apply_s, add_s, blocks, preds.counts()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dps", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--system-blocks", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ahead", type=int, default=2)
    ap.add_argument("--evict-every", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    requests = make_requests(args, random.Random(7))
    res: dict[bool, list] = {False: [], True: []}
    for _ in range(args.runs):
        for predict in (False, True):
            res[predict].append(run(args, requests, predict))
    n = args.requests
    for predict, rows in res.items():
        apply_s = statistics.median(r[0] for r in rows)
        add_s = statistics.median(r[1] for r in rows)
        _, _, blocks, counts = rows[-1]
        print(
            f"{'with predictions' if predict else 'no predictions'}: "
            f"{n / apply_s:,.0f} batches/s ({blocks / apply_s:,.0f} "
            f"blocks/s, {apply_s / n * 1e6:.1f} us/batch)"
            + (f", predict {add_s / n * 1e6:.1f} us/request, {counts}" if predict else "")
        )


if __name__ == "__main__":
    main()
