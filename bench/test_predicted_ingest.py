"""Smoke test of ``bench/predicted_ingest.py``: the same blocks with and without
predictions, and every prediction made is confirmed or contradicted by its engine's
batches (none left)."""

import argparse
import random

from bench import predicted_ingest as pi


def test_every_prediction_is_told_by_its_engines_batches():
    args = argparse.Namespace(
        dps=4, requests=120, blocks=4, system_blocks=2, block_size=16, ahead=2, evict_every=4
    )
    reqs = pi.make_requests(args, random.Random(3))
    _, _, blocks_off, _ = pi.run(args, reqs, False)
    _, _, blocks_on, counts = pi.run(args, reqs, True)
    assert blocks_off == blocks_on > 0
    assert counts["added"] == args.requests - args.ahead
    assert counts["live"] == counts["expired"] == counts["dropped"] == 0
    assert counts["confirmed"] + counts["contradicted"] == counts["added"]
    assert counts["confirmed"] > 0 and counts["contradicted"] > 0
