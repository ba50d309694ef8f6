"""Ingest throughput: vLLM map-form batches over tcp loopback into a SubscriptionManager + Index.

Pre-encodes realistic vLLM >= 0.24 batches (map events, uint64 hashes, ~32
blocks per BlockStored, two stores per scheduler step plus an occasional
eviction), pushes them from a PUB socket in a separate process (as a real engine
would) as fast as possible, and measures
how many blocks per second the ingest thread decodes, hashes and applies
(median of several runs, each with fresh chains). Then it leaves the thread
idle for a few seconds and reports the CPU time the ingest thread used.

    python bench/bench_ingest.py [--block-size 16 128] [--batches 1500] [--runs 5] [--impl c|py]
                                 [--general] [--readers K [--reader-tokens 1000000]
                                 [--reader-nice 19]]

``--impl`` picks the index core (default: ``KVCONDUCTOR_IMPL``, i.e. compiled);
``--general`` turns the compiled batch fast path off (the Python decoders feed the
index, what ``Applier(..., fast=False)`` does).

``--readers K`` (or ``--shared`` alone) runs the index in shared mode (``--workers N``: structures
in the shared arena, every write also taking the cross-process lock) and starts K
processes that attach to it, as workers do, and match a ``--reader-tokens`` prompt
(a full hit: it is stored first) back to back for the whole run; their query rate is
printed too, and how long the ingest thread's write sections waited for the readers
inside (share of the runs' wall time, mean wait per section): what the readers' read
sections cost ingest, apart from their CPU (on a small machine K busy readers also
take CPU from the ingest thread).
"""

from __future__ import annotations

import argparse
import array
import multiprocessing as mp
import os
import random
import statistics
import threading
import time

import msgspec
import zmq

from kvconductor.index import Index
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.subscriber import SubscriptionManager
from kvconductor.ingest.thread import IngestThread
from kvconductor.keys import Medium

IID = "vllm-prefill-bench"


class Conductor:
    def __init__(self, impl, shared=None):
        self.impl = impl
        self.indexes = {}
        self.block_sizes = {}
        self.lora_seeds = {}
        self.shared = shared

    def get_or_create_index(self, model, tenant):
        idx = self.indexes.get((model, tenant))
        if idx is None:
            idx = self.indexes[(model, tenant)] = Index(model, tenant, impl=self.impl)
            if self.shared is not None:
                idx.on_new_group = lambda: self.shared.publish(self)
                self.shared.publish(self)
        return idx

    def get_index(self, model, tenant):
        return self.indexes.get((model, tenant))

    def hbm_ip_lookup(self, ip):
        return []

    def note_lora(self, model, tenant, seed):
        pass

    def instance_info(self, iid):
        return None


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object
    lora_name: object
    extra_keys: object = None
    group_idx: object = None
    kv_cache_spec_kind: object = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list
    medium: object
    group_idx: object = None


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: object = None


def make_batches(n: int, bs: int, blocks_per_event: int, rng: random.Random):
    enc = msgspec.msgpack.Encoder()
    out, blocks = [], 0
    live_hashes = []
    for _ in range(n):
        evs = []
        for _ in range(2):
            hs = [rng.getrandbits(64) for _ in range(blocks_per_event)]
            toks = [rng.randrange(150_000) for _ in range(bs * blocks_per_event)]
            evs.append(
                BlockStored(
                    hs,
                    None,
                    toks,
                    bs,
                    None,
                    "GPU",
                    None,
                    [None] * blocks_per_event,
                    0,
                    "full_attention",
                )
            )
            blocks += blocks_per_event
            live_hashes.append(hs[-1])
        if rng.random() < 0.25 and live_hashes:
            evs.append(BlockRemoved([live_hashes.pop(rng.randrange(len(live_hashes)))], "GPU", 0))
        out.append(enc.encode(Batch(time.time(), evs, 0)))
    return out, blocks


def thread_cpu(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _publisher(
    conn, bs: int, batches: int, runs: int, blocks_per_event: int, seed: int | None = None
) -> None:
    """The engine side, in its own process (as a real engine is): PUB + payloads
    (the same documents for every publisher unless ``seed`` differs)."""
    rng = random.Random(bs if seed is None else seed)
    payload_sets = [make_batches(batches, bs, blocks_per_event, rng) for _ in range(runs + 1)]
    zctx = zmq.Context()
    # XPUB: it sees the subscriber's subscription, so the first batch (seq 0) is sent only
    # once it will be delivered (a PUB drops what it sends before: the slow joiner, a
    # loss that would put the subscription on its general path for the whole run)
    pub = zctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    conn.send((port, [b for _, b in payload_sets]))
    seq = 0
    subscribed = False
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        if cmd == "warm":
            while not subscribed and pub.poll(50, zmq.POLLIN):
                subscribed = pub.recv()[:1] == b"\x01"
            if not subscribed:
                conn.send(-1)
                continue
            pub.send_multipart(
                [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [], 0])]
            )
            seq += 1
            conn.send(seq - 1)
            continue
        payloads = payload_sets[cmd][0]
        for p in payloads:
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), p])
            seq += 1
        conn.send(seq - 1)
    pub.close(linger=0)
    zctx.term()


_READER = """
import sys, time, random, array
from kvconductor.state.shared import SharedView
view = SharedView.attach(int(sys.argv[1]), int(sys.argv[2]))
rnd = random.Random(int(sys.argv[4]))
doc = array.array("I", (rnd.randrange(1, 150_000) for _ in range(int(sys.argv[3]))))
bs = int(sys.argv[5])
print("ready", flush=True)
n = 0
t0 = time.perf_counter()
stop = open(sys.argv[6], "rb")
while not stop.read(1):
    idx = view.get_index("bench", "default")
    hits = idx.query(doc, bs, 1337).hits
    assert hits and hits[0].npu_blocks == len(doc) // bs, hits
    n += 1
print(n, time.perf_counter() - t0, flush=True)
"""


def _start_readers(shared, k: int, tokens: int, bs: int, nice: int = 0):
    import subprocess
    import sys
    import tempfile

    stop = tempfile.NamedTemporaryFile(prefix="kvc-bench-stop-")
    fds = shared.fds()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _READER,
                str(fds[0]),
                str(fds[1]),
                str(tokens),
                "7",
                str(bs),
                stop.name,
            ],
            pass_fds=fds,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        for _ in range(k)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return stop, procs


def _stop_readers(stop, procs) -> float:
    stop.write(b"x")
    stop.flush()
    rate = 0.0
    for p in procs:
        n, dt = p.stdout.readline().split()
        rate += int(n) / float(dt)
        p.wait(30)
    stop.close()
    return rate


def run(
    bs: int,
    batches: int,
    runs: int,
    blocks_per_event: int,
    impl: str | None,
    idle_s: float,
    readers: int = 0,
    reader_tokens: int = 1_000_000,
    shared_mode: bool = False,
    reader_nice: int = 0,
):
    parent, child = mp.Pipe()
    proc = mp.Process(target=_publisher, args=(child, bs, batches, runs, blocks_per_event))
    proc.start()
    port, blocks_per_set = parent.recv()
    url = f"tcp://127.0.0.1:{port}"
    shared = None
    if readers or shared_mode:
        from kvconductor.state.shared import SharedIndexes

        shared = SharedIndexes()
    conductor = Conductor(impl, shared)
    thread = IngestThread(zmq.Context.instance())
    thread.start()
    reader_procs = None
    if shared is not None:
        from kvconductor.keys import WorkerKey

        thread.call(shared.install)
        rnd = random.Random(7)
        doc = array.array("I", (rnd.randrange(1, 150_000) for _ in range(reader_tokens)))
        nblk = reader_tokens // bs

        def preload():
            idx = conductor.get_or_create_index("bench", "default")
            key = WorkerKey("reader-doc", "", 0, Medium.NPU)
            idx.store_tokens(key, None, range(1 << 40, (1 << 40) + nblk), doc, bs)

        thread.call(preload)
        if readers:
            reader_procs = _start_readers(shared, readers, reader_tokens, bs, reader_nice)
    mgr = thread.call(lambda: SubscriptionManager(thread, conductor, shared=shared))
    ctx = SubscriberContext(
        instance_id=IID,
        dp_rank=0,
        url=url,
        model="bench",
        tenant="default",
        block_size=bs,
        default_media=(Medium.NPU,),
    )
    thread.call(mgr.subscribe, ctx)
    tid = thread.call(threading.get_native_id)

    def src():
        return thread.call(mgr.sources)[0]

    # slow joiner: warm up until the subscription is live and receiving
    deadline = time.monotonic() + 30
    while src()["batches"] == 0:
        parent.send("warm")
        parent.recv()
        time.sleep(0.02)
        if time.monotonic() > deadline:
            raise SystemExit("subscriber never connected")
    # one untimed run to warm caches, then the timed ones
    rates, cpu_per_block = [], []
    wait_s = wait_n = wall_s = 0.0
    for r in range(runs + 1):
        w0 = shared.wait_histogram() if shared is not None else None
        c0 = thread_cpu(tid)
        t0 = time.perf_counter()
        parent.send(r)
        target = parent.recv()
        while src()["last_seq"] != target:
            time.sleep(0.002)
        dt = time.perf_counter() - t0
        c1 = thread_cpu(tid)
        if r == 0:
            continue
        rates.append(blocks_per_set[r] / dt)
        cpu_per_block.append((c1 - c0) / blocks_per_set[r])
        if w0 is not None:
            # how long the ingest thread's write sections waited for readers inside
            w1 = shared.wait_histogram()
            wait_s += w1["sum"] - w0["sum"]
            wait_n += w1["count"] - w0["count"]
            wall_s += dt
    s = src()
    assert s["gaps"] == 0, s
    reader_rate = _stop_readers(*reader_procs) if reader_procs else 0.0
    time.sleep(0.5)
    c0, t0 = thread_cpu(tid), time.monotonic()
    time.sleep(idle_s)
    idle_cpu, idle_wall = thread_cpu(tid) - c0, time.monotonic() - t0
    summary = conductor.indexes[("bench", "default")].summary()
    thread.call(mgr.close)
    thread.stop()
    parent.send("stop")
    proc.join(10)
    impl_name = type(conductor.indexes[("bench", "default")].core).__module__
    return {
        "bs": bs,
        "impl": impl_name,
        "batches": batches,
        "blocks/run": blocks_per_set[0],
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "us_cpu_per_block": 1e6 * statistics.median(cpu_per_block),
        "idle_cpu": idle_cpu,
        "idle_wall": idle_wall,
        "dropped": s["dropped"],
        "hbm_blocks": summary["hbm_blocks"],
        "reader_qps": reader_rate,
        # shared mode: share of the timed runs' wall time the writer spent waiting for
        # readers to leave, and the mean wait of a write section (ms)
        "wait_share": wait_s / wall_s if wall_s else 0.0,
        "wait_ms": 1e3 * wait_s / wait_n if wait_n else 0.0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--blocks-per-event", type=int, default=32)
    ap.add_argument("--impl", choices=["c", "py"], default=None)
    ap.add_argument("--idle", type=float, default=3.0, help="idle seconds for the CPU measurement")
    ap.add_argument(
        "--general", action="store_true", help="no compiled batch fast path (the Python decoders)"
    )
    ap.add_argument("--readers", type=int, default=0, help="processes querying the shared index")
    ap.add_argument("--reader-tokens", type=int, default=1_000_000, help="their prompt length")
    ap.add_argument(
        "--shared", action="store_true", help="shared mode even without readers (its own cost)"
    )
    ap.add_argument(
        "--reader-nice",
        type=int,
        default=0,
        help="the readers' nice increment: on a machine with fewer spare cores than readers, "
        "what their read sections cost ingest apart from the CPU they take",
    )
    args = ap.parse_args()
    if args.general:
        from kvconductor.ingest import apply

        apply._FastBatch = None  # read by every Applier when it is created
    rows = []
    for bs in args.block_size:
        n = args.batches if bs <= 16 else max(100, args.batches // 4)
        rows.append(
            run(
                bs,
                n,
                args.runs,
                args.blocks_per_event,
                args.impl,
                args.idle,
                args.readers,
                args.reader_tokens,
                args.shared,
                args.reader_nice,
            )
        )
    hdr = (
        f"{'block_size':>10} {'core':>18} {'batches/run':>11} {'blocks/run':>10} "
        f"{'blocks/s median':>15} {'min':>10} {'max':>10} {'cpu us/block':>12} "
        f"{'idle cpu':>14} {'dropped':>8} {'reader q/s':>10} {'wait %':>7} {'wait ms':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['bs']:>10} {r['impl']:>18} {r['batches']:>11} {r['blocks/run']:>10} "
            f"{r['median']:>15,.0f} {r['min']:>10,.0f} {r['max']:>10,.0f} "
            f"{r['us_cpu_per_block']:>12.2f} "
            f"{r['idle_cpu']:>6.3f}s/{r['idle_wall']:.1f}s {sum(r['dropped'].values()):>8} "
            f"{r['reader_qps']:>10.1f} {100 * r['wait_share']:>6.1f}% {r['wait_ms']:>8.3f}"
        )


if __name__ == "__main__":
    main()
