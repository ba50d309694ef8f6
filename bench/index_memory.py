"""In-process index memory: ``python bench/index_memory.py [--workers 8] [--blocks 1000000]``.

Stores ``--blocks`` blocks over ``--workers`` HBM workers in 32-block events (precomputed
hashes) into a bare ``CoreIndex`` and reports, per (worker, block) pair:

* ``rss``: the process's RSS growth across the stores, read after the heap is trimmed
  (``kvconductor.serve.tuning.trim_heap``, as the server's ingest thread does every 10 s);
* ``allocated``: the index's own bytes (``stats()["nbytes"]``, what
  ``kvconductor_index_bytes`` reports: allocated capacity);
* ``touched``: the HBM tree's arrays up to their high-water marks plus every table slot
  (``hbm_layout()["used_bytes"]``).

``--shared K``: every block is held by K workers (the same documents, each worker with
its own engine hashes) instead of each worker holding its own chain. ``--runs`` repeats
in fresh processes and prints the median.
"""

from __future__ import annotations

import argparse
import array
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
EVENT = 32


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def one(workers: int, blocks: int, shared: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench.conftest import make_tokens
    from kvconductor._hash import hash_blocks
    from kvconductor._index import CoreIndex
    from kvconductor.serve.tuning import trim_heap

    per = blocks // workers
    core = CoreIndex()
    events = []
    for w in range(workers):
        core.set_worker(w, w, 0)
        doc = w // shared if shared else w
        hashes = hash_blocks(make_tokens(per * BLOCK, 500 + doc), BLOCK)
        seqs = array.array("Q", range((w + 1) << 40, ((w + 1) << 40) + per))
        for i in range(0, per, EVENT):
            parent = None if i == 0 else seqs[i - 1]
            events.append((w, parent, seqs[i : i + EVENT], hashes[i : i + EVENT]))
    trim_heap()
    r0 = rss()
    t0 = time.perf_counter()
    for ev in events:
        core.store(*ev)
    took = time.perf_counter() - t0
    trim_heap()
    grown = rss() - r0
    s = core.stats()
    # (older builds, measured for a before/after, have no hbm_layout)
    lay = core.hbm_layout() if hasattr(core, "hbm_layout") else {"used_bytes": 0, "records_live": 0}
    pairs = s["hbm_pairs"]
    return {
        "pairs": pairs,
        "nodes": s["nodes"],
        "rss": round(grown / pairs, 1),
        "allocated": round(s["nbytes"] / pairs, 1),
        "touched": round(lay["used_bytes"] / pairs, 1),
        "member_records": lay["records_live"],
        "store_blocks_per_s": round(pairs / took),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) pairs")
    ap.add_argument("--shared", type=int, default=0, help="workers holding each document")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.workers, args.blocks, args.shared)))
        return
    runs = []
    for _ in range(args.runs):
        cmd = [sys.executable, __file__, "--one", "--workers", str(args.workers)]
        cmd += ["--blocks", str(args.blocks), "--shared", str(args.shared)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out))
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"{args.workers} workers, {med['pairs']:,.0f} pairs on {med['nodes']:,.0f} nodes "
        f"(median of {len(runs)} processes), bytes per pair:"
    )
    print(f"  RSS growth {med['rss']}  allocated {med['allocated']}  touched {med['touched']}")
    print(
        f"  member records {med['member_records']:,.0f}; "
        f"store {med['store_blocks_per_s'] / 1e6:.2f}M blocks/s"
    )


if __name__ == "__main__":
    main()
