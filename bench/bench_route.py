"""A payload's route in process: ``Applier.apply_payload`` per batch, without sockets.

The batches of ``bench_ingest.py`` (vLLM >= 0.24 map-form, two 32-block stores per step,
an occasional removal) through the compiled fast path and through the Python decoders
(``fast=False``), and Mooncake-style pool tuples (two events of 32 hashes) through a pool
subscription; thread CPU time per batch, best of ``--passes`` passes over fresh indexes.
Run it from the repository root on two builds, alternating, to compare them
(docs/performance.md, "Payload route").

    python bench/bench_route.py [--passes 7]
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec
from bench_ingest import IID, Conductor, make_batches  # this script's folder

from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.keys import Medium


def per_batch(bs: int, payloads: list[bytes], passes: int, fast=True, pool=False) -> float:
    best = float("inf")
    for _ in range(passes):
        media = (Medium.CPU,) if pool else (Medium.NPU,)
        ctx = SubscriberContext(IID, 0, "tcp://127.0.0.1:1", "m", "t", bs, media, is_pool=pool)
        a = Applier(ctx, Conductor("c"), fast=fast)
        t = time.thread_time()
        for p in payloads:
            a.apply_payload(p)
        best = min(best, time.thread_time() - t)
    return best / len(payloads) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=7)
    n = ap.parse_args().passes
    for bs, count in ((16, 400), (128, 100)):
        ps, _ = make_batches(count, bs, 32, random.Random(7))
        print(f"vLLM block {bs:3d}, fast path  {per_batch(bs, ps, n):8.2f} us/batch")
        print(f"vLLM block {bs:3d}, Python     {per_batch(bs, ps, n, fast=False):8.2f} us/batch")
    rng = random.Random(3)
    pools = [
        msgspec.msgpack.encode(
            [
                1782281033484,
                [
                    {"event_type": "stored", "seq_hashes": [rng.getrandbits(63) for _ in range(32)]}
                    for _ in range(2)
                ],
                0,
            ]
        )
        for _ in range(400)
    ]
    print(f"pool tuples            {per_batch(16, pools, n, pool=True):8.2f} us/batch")


if __name__ == "__main__":
    main()
