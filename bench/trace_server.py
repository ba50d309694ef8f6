"""The trace replay through a real ``kv-conductor`` server (``trace_replay.py --server``).

The recorded stream of :mod:`bench.trace_replay` is played against ``python -m
kvconductor``:

* **events** as vLLM 0.33 wire batches (``[topic, seq, msgpack KVEventBatch]``, one
  ``BlockStored`` or ``BlockRemoved`` per batch) over ZeroMQ, from ``publishers`` processes
  that each bind one PUB socket per engine (instance, DP) they carry; every engine is
  registered (``POST /register``, its own ``medium_endpoints.npu`` URL);
* **queries** as ``POST /query_by_hash`` MessagePack bodies from ``clients`` processes
  (keep-alive connections), each timing its own round trips;
* at the trace's pace times ``pace`` (``pace=0``: as fast as possible, saturation);
* with ``predictions`` (``trace_replay.py --server-predictions``), each query followed by
  the router's prediction (``POST /predict_by_hash``: the query's blocks, for the engine the
  request was routed to), timed apart, so the cost of predictions through HTTP is measured
  beside the same run without them.

A server needs token ids: each trace id stands for one block of :data:`SERVER_BLOCK`
tokens derived from the id (distinct ids, distinct tokens), so the server's local hash of a
block is XXH3 of those tokens (``kvconductor._hash.hash_blocks``), what the queries send.

Queries run while events are still in flight, so their answers are not compared during the
run. At quiescence (every published batch applied, per ``GET /workers``' sources; with
predictions, none live any more) every query is asked again and its answer compared with
the simulator's final state.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from bench import trace_replay as tr

ROOT = Path(__file__).resolve().parent.parent
SERVER_BLOCK = 16  # tokens per block on the wire
MODEL = "trace"
TOPIC = b"kv-events"


# vLLM 0.33 map-form events (the field order of vllm/distributed/kv_events.py; optional
# fields are omitted when None, as vLLM's omit_defaults does); tests/helpers/publishers.py holds
# the byte-exact reference (bench/test_trace_replay.py compares).
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list
    parent_block_hash: Any
    token_ids: list
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list
    medium: Any
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Any = None


def block_tokens(hash_id: int) -> list[int]:
    """The :data:`SERVER_BLOCK` token ids standing for trace block ``hash_id``."""
    x = tr.mix64(hash_id)
    head = [hash_id & 0xFFFFFFFF, (hash_id >> 32) & 0xFFFFFFFF]
    tail = [(tr.mix64(x + k) >> 8) & 0x7FFFFFFF for k in range(SERVER_BLOCK - 2)]
    return head + tail


def server_locals(ids: Sequence[int]) -> list[int]:
    """The server's local hashes of trace blocks ``ids``."""
    from kvconductor._hash import hash_blocks

    toks = array("I")
    for h in ids:
        toks.extend(block_tokens(h))
    return list(hash_blocks(toks, SERVER_BLOCK))


def encode_ops(stream: tr.Stream, id_of: dict[int, int], ts: Sequence[float]):
    """Per engine, its event batches in stream order: ``(time, payload)``; and the queries:
    ``(time, query index, msgpack body)``."""
    enc = msgspec.msgpack.Encoder()
    per_worker: list[list[tuple[float, bytes]]] = [[] for _ in range(stream.workers)]
    queries: list[tuple[float, int, bytes]] = []
    slocal: dict[int, int] = {}

    def sl(h: int) -> int:
        v = slocal.get(h)
        if v is None:
            v = slocal[h] = server_locals([h])[0]
        return v

    for op, t in zip(stream.ops, ts, strict=True):
        if op[0] == tr.Q:
            qi = op[1]
            hashes = [sl(id_of[x]) for x in stream.queries[qi]]
            body = enc.encode({"model": MODEL, "block_hashes": hashes})
            queries.append((t, qi, body))
        elif op[0] == tr.STORE:
            w, par, eh, lh = op[1], op[2], op[3], op[4]
            toks: list[int] = []
            for x in lh:
                toks.extend(block_tokens(id_of[x]))
            ev = BlockStored(list(eh), par, toks, SERVER_BLOCK, None, "GPU", None)
            per_worker[w].append((t, enc.encode(KVEventBatch(t, [ev], w % stream.dp))))
        else:
            w, eh = op[1], op[2]
            ev2 = BlockRemoved(list(eh), "GPU")
            per_worker[w].append((t, enc.encode(KVEventBatch(t, [ev2], w % stream.dp))))
    return per_worker, queries, sl


_GONE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


class Conn:
    """A keep-alive HTTP connection that reconnects once when the server closed it (an idle
    keep-alive connection is closed after a few seconds, as in a paced run's pauses)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def request(self, method: str, path: str, body: bytes | None = None, hdr=None):
        for attempt in (0, 1):
            try:
                self.c.request(method, path, body, hdr or {})
                r = self.c.getresponse()
                return r, r.read()
            except _GONE:
                self.c.close()
                self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.c.close()


def _raise_nofile() -> None:
    """Open files up to the hard limit, or to 65,536 where allowed (root): a subscription
    holds about 4 files on the server, 7,000 engines need more than a usual 20,000."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 65536), max(hard, 65536)))
    except (ValueError, OSError):
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _publisher(conn, workers: list[int]) -> None:
    """One publisher process: an XPUB per engine; sends its ports, waits for each
    subscription, then publishes what it is given (paced by the times when asked)."""
    _raise_nofile()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * len(workers) + 64)  # a context option (setsockopt: sockets)
    socks = []
    ports = []
    for _ in workers:
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        socks.append(s)
    conn.send(ports)
    # wait until every engine's SUB subscribed (a batch sent before would be lost)
    poller = zmq.Poller()
    pending = set(range(len(socks)))
    for s in socks:
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for s, _ in poller.poll(500):
            s.recv()
            pending.discard(socks.index(s))
    conn.send(len(pending))
    items, pace = conn.recv()  # [(t, local index, payload)] and pace
    conn.send("ready")
    start = conn.recv()  # the wall-clock start, shared with the clients
    d0 = start - time.time()
    if d0 > 0:
        time.sleep(d0)
    seq = [0] * len(socks)
    sent = 0
    t_first = time.perf_counter()
    for t, k, payload in items:
        if pace > 0:
            due = start + t / pace
            d = due - time.time()
            if d > 0:
                time.sleep(d)
        socks[k].send_multipart([TOPIC, seq[k].to_bytes(8, "big"), payload])
        seq[k] += 1
        sent += 1
    conn.send((sent, time.perf_counter() - t_first, time.time()))
    conn.recv()  # stop
    for s in socks:
        s.close(linger=0)
    ctx.term()


def _client(conn, port: int) -> None:
    """One query client: keep-alive HTTP, MessagePack bodies; times every round trip. With
    ``predicts`` (one body per item), each query is followed by the router's prediction
    (``POST /predict_by_hash``), timed apart."""
    items, pace, *more = conn.recv()
    predicts = more[0] if more else None
    c = Conn(port)
    conn.send("ready")
    start = conn.recv()
    d0 = start - time.time()
    if d0 > 0:
        time.sleep(d0)
    hdr = {"Content-Type": "application/msgpack"}
    lat: list[int] = []
    plat: list[int] = []
    server: list[float] = []
    errors = perrors = 0
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    for i, (t, _qi, body) in enumerate(items):
        if pace > 0:
            d = start + t / pace - time.time()
            if d > 0:
                time.sleep(d)
        a = clock()
        r, _ = c.request("POST", "/query_by_hash", body, hdr)
        lat.append(clock() - a)
        if r.status != 200:
            errors += 1
        st = r.getheader("Server-Timing")
        if st and "dur=" in st:
            try:
                server.append(float(st.split("dur=")[1].split(";")[0].split(",")[0]))
            except ValueError:
                pass
        if predicts is not None:
            a = clock()
            r, _ = c.request("POST", "/predict_by_hash", predicts[i], hdr)
            plat.append(clock() - a)
            perrors += r.status != 200
    conn.send((lat, server, errors, time.perf_counter() - t0, plat, perrors))
    c.close()


class Probe:
    """Event-to-visible lag: one extra engine (instance ``probe``) whose PUB this process
    owns; while the stream plays, a thread stores a fresh block every ``interval`` seconds
    and asks ``/query_by_hash`` for it every millisecond until the answer lists it. The lag
    includes one query round trip."""

    def __init__(self, interval: float = 0.1) -> None:
        import threading

        self.interval = interval
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.url = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.lags: list[float] = []
        self.sent = 0
        self.stop_flag = threading.Event()
        self.thread: threading.Thread | None = None

    def wait_subscribed(self, timeout: float = 60) -> None:
        if not self.sock.poll(int(timeout * 1000)):
            raise RuntimeError("the probe engine never saw its subscription")
        self.sock.recv()

    def start(self, port: int) -> None:
        import threading

        self.thread = threading.Thread(target=self._run, args=(port,), daemon=True)
        self.thread.start()

    def _run(self, port: int) -> None:
        enc = msgspec.msgpack.Encoder()
        c = Conn(port)
        hdr = {"Content-Type": "application/msgpack"}
        k = 0
        while not self.stop_flag.is_set():
            k += 1
            hid = (1 << 40) + k
            ev = BlockStored(
                [(1 << 62) + k], None, block_tokens(hid), SERVER_BLOCK, None, "GPU", None
            )
            body = enc.encode({"model": MODEL, "block_hashes": server_locals([hid])})
            t0 = time.perf_counter()
            self.sock.send_multipart(
                [TOPIC, (k - 1).to_bytes(8, "big"), enc.encode(KVEventBatch(0.0, [ev], 0))]
            )
            self.sent += 1
            while True:
                _, data = c.request("POST", "/query_by_hash", body, hdr)
                ans = msgspec.msgpack.decode(data)
                if "probe" in (ans.get("default") or {}):
                    self.lags.append(time.perf_counter() - t0)
                    break
                if time.perf_counter() - t0 > 60 or self.stop_flag.is_set():
                    break
                time.sleep(0.001)
            rest = self.interval - (time.perf_counter() - t0)
            if rest > 0:
                self.stop_flag.wait(rest)
        c.close()

    def stop(self) -> None:
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(120)
        self.sock.close(linger=0)
        self.ctx.term()


FLOOR_APP = """
import sys

import uvicorn

from kvconductor.serve.single import _uvicorn_impls

BODY = bytes(int(sys.argv[2]))


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/msgpack")],
        }
    )
    await send({"type": "http.response.body", "body": BODY})


loop, http = _uvicorn_impls()
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop=loop, http=http,
            lifespan="off", log_level="warning", server_header=False)
"""


def run_floor(queries: list, size: int, pace: float, clients: int) -> dict[str, Any]:
    """The same queries, clients and pace against the floor of the HTTP stack: a bare ASGI
    app on the same uvicorn (same loop and HTTP parser as kv-conductor) that answers every
    query with ``size`` bytes (the mean size of kv-conductor's answers) and does nothing
    else. What kv-conductor adds is the difference between the two runs."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOR_APP, str(port), str(size)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the floor app did not start") from None
                time.sleep(0.05)
        ctx = mp.get_context("spawn")
        cl = []
        for c in range(clients):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_client, args=(b, port), daemon=True)
            p.start()
            procs.append(p)
            a.send((queries[c::clients], pace))
            cl.append(a)
        for conn in cl:
            conn.recv()  # ready
        start = time.time() + 0.2
        for conn in cl:
            conn.send(start)
        lat: list[int] = []
        for conn in cl:
            lat.extend(conn.recv()[0])
        return {
            "floor_answer_bytes": size,
            "floor_p50_us": tr.quantile(lat, 0.5) / 1e3,
            "floor_p99_us": tr.quantile(lat, 0.99) / 1e3,
        }
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        proc.terminate()
        proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m kvconductor`` on a free loopback port, its log in a temporary directory."""

    def __init__(self, workers: int, logdir: str, *args: str) -> None:
        self.port = _free_port()
        self.log = open(Path(logdir) / "server.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvconductor",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-snapshots",
                "--max-sources",
                str(workers + 16),
                "--log-level",
                "WARNING",
                *args,
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_raise_nofile,
        )
        self.http = Conn(self.port)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_text()}")
            try:
                if self.get("/health")[1] == b"OK":
                    break
            except OSError:
                self.http = Conn(self.port)
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready")
            time.sleep(0.1)

    def log_text(self) -> str:
        self.log.flush()
        return (Path(self.log.name)).read_text(errors="replace")[-3000:]

    def request(self, method: str, path: str, body: bytes | None = None, ctype: str = ""):
        hdr = {"Content-Type": ctype} if ctype else {}
        r, data = self.http.request(method, path, body, hdr)
        return r.status, data

    def get(self, path: str):
        return self.request("GET", path)

    def post_json(self, path: str, obj: Any):
        return self.request("POST", path, json.dumps(obj).encode(), "application/json")

    def post_msgpack(self, path: str, body: bytes):
        st, data = self.request("POST", path, body, "application/msgpack")
        return st, msgspec.msgpack.decode(data)

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def _applied(server: Server) -> tuple[int, dict[str, int]]:
    st, data = server.get("/workers")
    if st != 200:
        return -1, {}
    sources = json.loads(data).get("sources", [])
    losses = {
        "gaps": sum(s.get("gaps", 0) for s in sources),
        "losses": sum(s.get("losses", 0) for s in sources),
        "dropped": sum(sum((s.get("dropped") or {}).values()) for s in sources),
    }
    return sum(s.get("batches", 0) for s in sources), losses


def _prediction_counts(server: Server) -> dict[str, int]:
    """``kvconductor_predictions_total{outcome}`` and ``kvconductor_predictions_live``."""
    text = server.get("/metrics")[1].decode()
    out = {
        k: int(float(v))
        for k, v in re.findall(r'kvconductor_predictions_total\{outcome="(\w+)"\} (\S+)', text)
    }
    live = re.search(r"^kvconductor_predictions_live (\S+)$", text, re.M)
    out["live"] = int(float(live.group(1))) if live else -1
    return out


def _predict_bodies(stream: tr.Stream, queries: list, sl, id_of: dict[int, int]) -> list[bytes]:
    """Per query, the router's prediction: the query's blocks, for the engine its request
    was routed to (``POST /predict_by_hash``)."""
    enc = msgspec.msgpack.Encoder()
    out = []
    for _t, qi, _body in queries:
        iid, d = tr.instance_of(stream.routed[qi], stream.dp)
        hashes = [sl(id_of[x]) for x in stream.queries[qi]]
        out.append(
            enc.encode({"model": MODEL, "block_hashes": hashes, "instance_id": iid, "dp_rank": d})
        )
    return out


def run_server(
    stream: tr.Stream,
    requests: Sequence[tr.Request],
    *,
    pace: float = 0.0,
    publishers: int = 4,
    clients: int = 2,
    check: int | None = None,
    floor: bool = True,
    predictions: bool = False,
    prediction_ttl: float = 2.0,
) -> dict[str, Any]:
    """Play ``stream`` against a fresh server; see the module docstring. ``check``: how many
    queries to ask again at quiescence (None: all). ``floor``: then play the same queries
    against a bare ASGI app on the same uvicorn (:func:`run_floor`). ``predictions``: each
    query is followed by the router's prediction (``--prediction-ttl-s prediction_ttl``);
    the check at quiescence waits until none is live (every one left no trace)."""
    id_of = {tr.local_hash(h): h for r in requests for h in r.hash_ids}
    # the time of each op: its request's arrival (queries and events alike)
    ts: list[float] = []
    qi_time = [r.timestamp / 1000 for r in requests]
    cur = 0.0
    for op in stream.ops:
        if op[0] == tr.Q:
            cur = qi_time[op[1]] - qi_time[0]
        ts.append(cur)
    per_worker, queries, sl = encode_ops(stream, id_of, ts)
    batches = sum(len(x) for x in per_worker)
    predicts = _predict_bodies(stream, queries, sl, id_of) if predictions else None
    out: dict[str, Any] = {"backend": "server", "pace": pace, "batches": batches}
    with tempfile.TemporaryDirectory(prefix="kvc-trace-") as tmp:
        server = Server(stream.workers, tmp, "--prediction-ttl-s", f"{prediction_ttl:g}")
        procs = []
        try:
            ctx = mp.get_context("spawn")
            pubs = []
            owned: list[list[int]] = [[] for _ in range(publishers)]
            for w in range(stream.workers):
                owned[w % publishers].append(w)
            for p in range(publishers):
                a, b = ctx.Pipe()
                proc = ctx.Process(target=_publisher, args=(b, owned[p]), daemon=True)
                proc.start()
                procs.append(proc)
                pubs.append(a)
            urls: dict[int, str] = {}
            for p, conn in enumerate(pubs):
                for w, port in zip(owned[p], conn.recv(), strict=True):
                    urls[w] = f"tcp://127.0.0.1:{port}"
            t_reg = time.perf_counter()
            for w in range(stream.workers):
                iid, d = tr.instance_of(w, stream.dp)
                st, body = server.post_json(
                    "/register",
                    {
                        "instance_id": iid,
                        "type": "vLLM",
                        "modelname": MODEL,
                        "block_size": SERVER_BLOCK,
                        "dp_rank": d,
                        "medium_endpoints": {"npu": urls[w]},
                    },
                )
                if st != 201:
                    raise RuntimeError(f"register {iid}/{d}: {st} {body[:200]!r}")
            out["register_s"] = round(time.perf_counter() - t_reg, 2)
            probe = Probe()
            st, body = server.post_json(
                "/register",
                {
                    "instance_id": "probe",
                    "type": "vLLM",
                    "modelname": MODEL,
                    "block_size": SERVER_BLOCK,
                    "dp_rank": 0,
                    "medium_endpoints": {"npu": probe.url},
                },
            )
            if st != 201:
                raise RuntimeError(f"register probe: {st} {body[:200]!r}")
            probe.wait_subscribed()
            unsubscribed = sum(conn.recv() for conn in pubs)
            if unsubscribed:
                raise RuntimeError(f"{unsubscribed} engines never saw their subscription")
            # hand out the work, then start everyone together
            for p, conn in enumerate(pubs):
                items = []
                for k, w in enumerate(owned[p]):
                    items.extend((t, k, payload) for t, payload in per_worker[w])
                items.sort(key=lambda x: x[0])  # stable: each engine keeps its order
                conn.send((items, pace))
            cl = []
            for c in range(clients):
                a, b = ctx.Pipe()
                proc = ctx.Process(target=_client, args=(b, server.port), daemon=True)
                proc.start()
                procs.append(proc)
                a.send((queries[c::clients], pace, predicts[c::clients] if predicts else None))
                cl.append(a)
            for conn in pubs + cl:
                conn.recv()  # ready
            start = time.time() + 0.2
            for conn in pubs + cl:
                conn.send(start)
            probe.start(server.port)
            pub_done = [conn.recv() for conn in pubs]
            last_publish = max(x[2] for x in pub_done)
            lat: list[int] = []
            srv: list[float] = []
            plat: list[int] = []
            errors = perrors = 0
            q_wall = 0.0
            for conn in cl:
                lat_c, srv_c, e, wall, plat_c, pe = conn.recv()
                lat.extend(lat_c)
                srv.extend(srv_c)
                errors += e
                q_wall = max(q_wall, wall)
                plat.extend(plat_c)
                perrors += pe
            # quiescence: every batch applied
            probe.stop()
            deadline = time.monotonic() + 600
            while True:
                applied, losses = _applied(server)
                applied -= probe.sent
                if applied >= batches or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            drained = time.time()
            out.update(
                {
                    "applied": applied,
                    **losses,
                    "events_wall_s": round(drained - start, 3),
                    "events_per_s": batches / max(1e-9, drained - start),
                    "drain_after_last_publish_s": round(drained - last_publish, 3),
                    "queries": len(lat),
                    "query_errors": errors,
                    "queries_per_s": len(lat) / q_wall if q_wall else 0.0,
                    "query_p50_us": tr.quantile(lat, 0.5) / 1e3,
                    "query_p99_us": tr.quantile(lat, 0.99) / 1e3,
                    "server_p50_us": tr.quantile(srv, 0.5) * 1e3 if srv else None,
                    "server_p99_us": tr.quantile(srv, 0.99) * 1e3 if srv else None,
                    "probes": len(probe.lags),
                    "lag_p50_ms": tr.quantile(probe.lags, 0.5) * 1e3,
                    "lag_p99_ms": tr.quantile(probe.lags, 0.99) * 1e3,
                    "lag_max_ms": max(probe.lags, default=0.0) * 1e3,
                }
            )
            if predicts:  # the predictions' outcomes, once none is live (TTL * 9/8 at most)
                deadline = time.monotonic() + 2 * prediction_ttl + 5
                while _prediction_counts(server)["live"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                out["predicts"] = len(plat)
                out["predict_errors"] = perrors
                out["predict_p50_us"] = tr.quantile(plat, 0.5) / 1e3
                out["predict_p99_us"] = tr.quantile(plat, 0.99) / 1e3
                out["prediction_outcomes"] = _prediction_counts(server)
            # every answer at quiescence against the simulator's final state
            base = {
                tr.instance_of(w, stream.dp)[0]: w - w % stream.dp for w in range(stream.workers)
            }
            enc = msgspec.msgpack.Encoder()
            qs = (
                range(len(stream.queries))
                if check is None
                else range(min(check, len(stream.queries)))
            )
            mismatches = 0
            answer_bytes = 0
            for qi in qs:
                want = tr.digest(tr.simulate_answer(stream.chains[qi], stream.final_holders))
                body = enc.encode(
                    {"model": MODEL, "block_hashes": [sl(id_of[x]) for x in stream.queries[qi]]}
                )
                st, raw = server.request("POST", "/query_by_hash", body, "application/msgpack")
                answer_bytes += len(raw)
                ans = msgspec.msgpack.decode(raw)
                items2 = []
                for iid, inst in (ans.get("default") or {}).items():
                    for rank, e in inst["DP"].items():
                        blocks = (
                            e["npu_blocks"] + (e["cpu_blocks"] << 10) + (e["disk_blocks"] << 10)
                        )
                        items2.append(((base[iid] + int(rank)) << tr.DEPTH_BITS) | blocks)
                if st != 200 or tr.digest(items2) != want:
                    mismatches += 1
            out["checked"] = len(qs)
            out["mismatches"] = mismatches
            out["answer_bytes_mean"] = answer_bytes // max(1, len(qs))
        finally:
            for conn in pubs:
                try:
                    conn.send("stop")
                except (OSError, BrokenPipeError):
                    pass
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            server.stop()
    if floor and "answer_bytes_mean" in out:
        out.update(run_floor(queries, out["answer_bytes_mean"], pace, clients))
    return out


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(tr.main())
