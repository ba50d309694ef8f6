"""Warm restart cost at scale: snapshot, write, verify and load of N (worker, block) pairs.

Builds one index in process: 64 HBM workers in 8 groups; the 8 workers of a group hold
the same chain under their own engine hashes (so the HBM tree has members shared by
several workers, as a real prefix cache does), plus 8 engine-offloaded CPU rows per
group. Then measures what ``--snapshot-dir`` does:

* snapshot: the copy of every table the ingest thread makes (events wait for it);
* write: encoding every record and writing the file (fsync, rename), off the ingest thread;
* verify: the pass over the file a start makes before it loads anything;
* load: decoding and restoring into an empty service, invariant check included;

and checks that the loaded index has the same counts.

    python bench/warm_start.py --pairs 1000000 [--pairs 10000000] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import tempfile
import time
from array import array

WORKERS = 64
GROUP = 8
CHUNK = 4096  # blocks per store call


def build(conductor, pairs: int) -> None:
    from kvconductor.keys import Medium, WorkerKey

    ix = conductor.get_or_create_index("bench", "default")
    per_worker = pairs // WORKERS
    rnd = random.Random(7)
    for g in range(WORKERS // GROUP):
        locs = array("Q", (rnd.getrandbits(64) for _ in range(per_worker)))
        for k in range(GROUP):
            w = g * GROUP + k
            key = WorkerKey(f"inst-{g}", f"inst-{g}", k, Medium.NPU)
            base = (w + 1) << 40
            seqs = array("Q", range(base, base + per_worker))
            parent = None
            for i in range(0, per_worker, CHUNK):
                ix.store(key, parent, seqs[i : i + CHUNK], locs[i : i + CHUNK])
                parent = seqs[min(i + CHUNK, per_worker) - 1]


def measure(pairs: int, directory: str) -> dict:
    from kvconductor.state import dump, snapshot
    from kvconductor.state.conductor import Conductor, ConductorConfig

    def conductor() -> Conductor:
        c = Conductor(
            ConductorConfig(maintenance_interval=3600), subscriptions=dump._NoSubscriptions
        )
        c.start()
        return c

    src = conductor()
    t = time.perf_counter()
    src.call(build, src, pairs, timeout=None)
    built = time.perf_counter() - t
    want = src.call(src.workers)["indexer"]
    store = snapshot.SnapshotStore(directory)
    store.prepare()
    t = time.perf_counter()
    snap = src.call(dump.snapshot, src, timeout=None)
    t_snap = time.perf_counter() - t
    t = time.perf_counter()
    path, size = store.write(functools.partial(dump.encode, snap))  # encode(snap, counter)
    t_write = time.perf_counter() - t
    store.release()
    del snap
    src.stop()
    del src
    dst = conductor()
    t = time.perf_counter()
    dump.verify(dump.file_chunks(path))
    t_verify = time.perf_counter() - t
    t = time.perf_counter()
    loaded = dst.call(dump.load_dump, dst, dump.file_chunks(path), timeout=None)
    t_load = time.perf_counter() - t
    got = dst.call(dst.workers)["indexer"]
    dst.stop()
    strip = [{k: v for k, v in s.items() if k != "bytes"} for s in want]
    assert [{k: v for k, v in s.items() if k != "bytes"} for s in got] == strip
    assert loaded["indexes"] == 1
    hbm = want[0]["hbm_blocks"]
    return {
        "pairs": pairs,
        "hbm_pairs": hbm,
        "build_s": round(built, 3),
        "snapshot_s": round(t_snap, 3),
        "write_s": round(t_write, 3),
        "file_mb": round(size / 1e6, 1),
        "bytes_per_pair": round(size / max(1, hbm), 1),
        "verify_s": round(t_verify, 3),
        "load_s": round(t_load, 3),
        "warm_start_s": round(t_verify + t_load, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, action="append", help="(worker, block) pairs (repeatable)")
    ap.add_argument("--dir", help="snapshot directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print JSON lines")
    args = ap.parse_args()
    rows = []
    for pairs in args.pairs or [1_000_000]:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            rows.append(measure(pairs, d))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))


if __name__ == "__main__":
    main()
