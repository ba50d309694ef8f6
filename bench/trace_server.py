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
  request was routed to), timed apart: the cost of predictions through HTTP, beside the
  same stream without them; at quiescence, once none is live.

A server needs token ids: each trace id stands for one block of :data:`SERVER_BLOCK`
tokens derived from the id (distinct ids, distinct tokens), so the server's local hash of a
block is XXH3 of those tokens (``kvconductor._hash.hash_blocks``), what the queries send.

Queries run while events are still in flight, so their answers are not compared during the
run. At quiescence (every published batch applied, per ``GET /workers``' sources) every
query is asked again and its answer compared with the simulator's final state; with
``top_k`` the queries ask for it, and at quiescence each is asked whole (the rows and their
group order) and cut (compared with :func:`bench.trace_replay.top_items` of the whole).

The service under test is a *target* (:class:`Server` here; Dynamo's standalone indexer
in :mod:`bench.trace_dynamo_server`): it registers an engine, says how many batches it
applied, builds a query body and reads an answer into the simulator's items.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from xxhash import xxh3_64_intdigest

from bench import trace_replay as tr
from bench.trace_services import (
    MODEL,
    SERVER_BLOCK,
    Conn,
    DoesNotFit,
    Floor,
    RawConn,
    Server,
    Service,
    _raise_nofile,
    resource_limit,
    server_ms,
    sources_that_fit,
)

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


def encode_ops(
    stream: tr.Stream, id_of: dict[int, int], ts: Sequence[float], body_of: Callable
) -> tuple[list[list[tuple[float, bytes]]], list[tuple[float, int, bytes]], Callable]:
    """Per engine, its event batches in stream order: ``(time, payload)``; and the queries:
    ``(time, query index, body_of(server local hashes))``."""
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
            queries.append((t, qi, body_of([sl(id_of[x]) for x in stream.queries[qi]])))
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
    pending = {s: k for k, s in enumerate(socks)}
    for s in socks:
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for s, _ in poller.poll(500):
            s.recv()
            pending.pop(s, None)
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
    """One query client: keep-alive HTTP (:class:`RawConn`, each request's bytes built
    before the clock starts), the target's bodies; times every round trip. With a floor
    port, each query's twin (the same body, ``x-floor-size``: the length of the target's
    answer) goes to the floor beside it, first or second in turn. With ``predicts`` (a
    body per query), each query is followed by the router's prediction
    (``POST /predict_by_hash``), timed apart."""
    items, pace, path, ctype, floor_port, predicts = conn.recv()
    c = RawConn(port)
    f = RawConn(floor_port) if floor_port else None
    reqs = [(t, c.prepare("POST", path, body, ctype)) for t, _qi, body in items]
    preds = (
        None
        if predicts is None
        else [c.prepare("POST", "/predict_by_hash", body, ctype) for body in predicts]
    )
    conn.send("ready")
    start = conn.recv()
    d0 = start - time.time()
    if d0 > 0:
        time.sleep(d0)
    lat: list[int] = []
    floor: list[int] = []
    plat: list[int] = []
    server: list[float] = []
    errors = perrors = 0
    clock = time.perf_counter_ns
    size = 0
    t0 = time.perf_counter()
    for j, (t, (head, tail)) in enumerate(reqs):
        if pace > 0:
            d = start + t / pace - time.time()
            if d > 0:
                time.sleep(d)
        if f is not None and j & 1:
            twin = b"%sx-floor-size: %d\r\n%s" % (head, size, tail)
            a = clock()
            f.send(twin)
            floor.append(clock() - a)
        req = head + tail
        a = clock()
        status, answer, timing = c.send(req)
        lat.append(clock() - a)
        size = len(answer)
        if f is not None and not j & 1:
            twin = b"%sx-floor-size: %d\r\n%s" % (head, size, tail)
            a = clock()
            f.send(twin)
            floor.append(clock() - a)
        if status != 200:
            errors += 1
        ms = server_ms(timing)
        if ms is not None:
            server.append(ms)
        if preds is not None:
            ph, pt = preds[j]
            a = clock()
            pstatus = c.send(ph + pt)[0]
            plat.append(clock() - a)
            perrors += pstatus != 200
    conn.send((lat, server, errors, time.perf_counter() - t0, floor, plat, perrors))
    c.close()
    if f is not None:
        f.close()


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


def _start_clients(
    ctx,
    port: int,
    queries: list,
    pace: float,
    clients: int,
    target,
    procs,
    floor_port=0,
    predicts: list | None = None,
):
    """``clients`` query client processes, each given its share of ``queries`` (and of
    ``predicts``)."""
    cl = []
    for c in range(clients):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_client, args=(b, port), daemon=True)
        p.start()
        procs.append(p)
        mine = predicts[c::clients] if predicts is not None else None
        a.send((queries[c::clients], pace, target.path, target.ctype, floor_port, mine))
        cl.append(a)
    return cl


def _gather(cl, out: dict[str, Any] | None = None):
    """The clients' round trips (ns), ``Server-Timing`` durations (ms), errors, wall time,
    and the paired floor's round trips (ns); their predictions' round trips into ``out``."""
    lat: list[int] = []
    srv: list[float] = []
    floor: list[int] = []
    plat: list[int] = []
    errors = perrors = 0
    wall = 0.0
    for conn in cl:
        lat_c, srv_c, e, w, floor_c, plat_c, pe = conn.recv()
        lat.extend(lat_c)
        srv.extend(srv_c)
        floor.extend(floor_c)
        plat.extend(plat_c)
        errors += e
        perrors += pe
        wall = max(wall, w)
    if out is not None and plat:
        out["predicts"] = len(plat)
        out["predict_errors"] = perrors
        out["predict_p50_us"] = tr.quantile(plat, 0.5) / 1e3
        out["predict_p99_us"] = tr.quantile(plat, 0.99) / 1e3
    return lat, srv, errors, wall, floor


def _start_together(conns) -> float:
    for conn in conns:
        conn.recv()  # ready
    start = time.time() + 0.2
    for conn in conns:
        conn.send(start)
    return start


def run_floor(queries: list, size: int, pace: float, clients: int, target) -> dict[str, Any]:
    """The same queries, clients and pace against the :class:`Floor` alone, every answer
    ``size`` bytes (the mean of the target's answers)."""
    floor = Floor(size)
    procs: list = []
    try:
        ctx = mp.get_context("spawn")
        cl = _start_clients(ctx, floor.port, queries, pace, clients, target, procs)
        _start_together(cl)
        lat, _, _, wall, _ = _gather(cl)
        return {"floor_answer_bytes": size, **Floor.row(lat, wall)}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        floor.stop()


#: Keep-alive connections registering the engines at once (the server registers them one
#: after another; the round trips overlap): 2,000 engines in 2.0-2.2 s instead of 3.1 s.
REGISTER_CONNECTIONS = 4


def register_all(server: Service, urls: dict[int, str], n: int) -> None:
    """Register engines ``0..n-1`` over :data:`REGISTER_CONNECTIONS` connections."""
    from concurrent.futures import ThreadPoolExecutor

    def part(k: int) -> None:
        c = Conn(server.port)
        try:
            for w in range(k, n, REGISTER_CONNECTIONS):
                server.register(w, urls[w], conn=c)
        finally:
            c.close()

    with ThreadPoolExecutor(REGISTER_CONNECTIONS) as ex:
        list(ex.map(part, range(REGISTER_CONNECTIONS)))


def _is_cut(got: list[int], want: list[int], whole: list[int], k: int, hashes, dp: int) -> bool:
    """Whether ``got`` is the ``top_k=k`` answer of the simulator's items ``want``: with one
    DP per instance, :func:`tr.top_items` in the group order of the whole answer ``whole``;
    with several, the whole answer's map (instance, then its DPs) does not show the group
    order across instances, so a valid cut: min(k, holders) rows of the simulator's, every
    row deeper than the k-th depth among them."""
    if dp == 1:
        order = {x >> tr.DEPTH_BITS: j for j, x in enumerate(whole)}
        cut = tr.top_items(want, k, order, xxh3_64_intdigest(array("Q", hashes)))
        return len(got) <= k and tr.digest(got) == tr.digest(cut)
    mask = (1 << tr.DEPTH_BITS) - 1
    kth = sorted((x & mask for x in want), reverse=True)[min(k, len(want)) - 1] if want else 0
    deeper = {x for x in want if x & mask > kth}
    gs = set(got)
    return len(gs) == len(got) == min(k, len(want)) and gs <= set(want) and deeper <= gs


def check_answers(target, stream: tr.Stream, sl, id_of, qs, top_k: int | None) -> dict[str, Any]:
    """Every query of ``qs`` asked again (whole, and cut to ``top_k`` when given) and
    compared with the simulator's final state; a cut answer with :func:`tr.top_items` of
    the whole, in the whole answer's group order (the server names groups in the order
    their first batch was applied, which concurrent sources make the server's own)."""
    mismatches = top_mismatches = answer_bytes = 0
    for qi in qs:
        want = tr.simulate_answer(stream.chains[qi], stream.final_holders)
        hashes = [sl(id_of[x]) for x in stream.queries[qi]]
        st, raw = target.ask(hashes)
        whole = target.items(raw) if st == 200 else []
        ok = st == 200 and tr.digest(whole) == tr.digest(want)
        mismatches += not ok
        if not top_k:
            answer_bytes += len(raw)
            continue
        st, raw = target.ask(hashes, top_k)
        answer_bytes += len(raw)
        if not ok or st != 200:
            top_mismatches += 1
            continue
        got = target.items(raw)
        top_mismatches += not _is_cut(got, want, whole, top_k, hashes, target.dp)
    out: dict[str, Any] = {"checked": len(qs), "mismatches": mismatches + top_mismatches}
    out["answer_bytes_mean"] = answer_bytes // max(1, len(qs))
    if top_k:
        out["whole_mismatches"], out["top_mismatches"] = mismatches, top_mismatches
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
    top_k: int | None = None,
    target: Callable[..., Service] = Server,
    predictions: bool = False,
    prediction_ttl: float = 2.0,
) -> dict[str, Any]:
    """Play ``stream`` against a fresh ``target`` (``target(workers, logdir, dp)``); see
    the module docstring. ``check``: how many queries to ask again at quiescence (None:
    all). ``top_k``: the queries ask for it. ``floor``: the same queries against a bare
    ASGI app on the same uvicorn (:class:`Floor`): paced, each query's twin beside it (the
    same noise of a shared machine on both, the same answer size); at saturation, a run
    of its own afterwards (:func:`run_floor`: the load generator's ceiling).
    ``predictions`` (kv-conductor): each query followed by the router's prediction for the
    engine its request went to (``--prediction-ttl-s prediction_ttl``); the check at
    quiescence waits until none is live (each left no trace)."""
    fit = sources_that_fit() if target is Server else None
    if fit is not None and stream.workers + 1 > fit:
        raise DoesNotFit(
            f"{stream.workers:,} engines (+1 probe) need more ZeroMQ sources than the "
            f"server can open: the hard open-file limit "
            f"{resource_limit():,} fits {fit:,} "
            "(4 files a source); raise it (ulimit -Hn) to run this size"
        )
    id_of = {tr.local_hash(h): h for r in requests for h in r.hash_ids}
    # the time of each op: its request's arrival (queries and events alike)
    ts: list[float] = []
    qi_time = [r.timestamp / 1000 for r in requests]
    cur = 0.0
    for op in stream.ops:
        if op[0] == tr.Q:
            cur = qi_time[op[1]] - qi_time[0]
        ts.append(cur)
    out: dict[str, Any] = {"pace": pace, "top_k": top_k}
    with tempfile.TemporaryDirectory(prefix="kvc-trace-") as tmp:
        if predictions:
            server = Server(
                stream.workers, tmp, stream.dp, ("--prediction-ttl-s", f"{prediction_ttl:g}")
            )
            out["backend"] = f"{server.name} + predictions"
        else:
            server = target(stream.workers, tmp, stream.dp)
            out["backend"] = server.name
        per_worker, queries, sl = encode_ops(stream, id_of, ts, lambda h: server.body(h, top_k))
        predicts = None
        if predictions:
            predicts = [
                server.predict_body([sl(id_of[x]) for x in stream.queries[qi]], stream.routed[qi])
                for _t, qi, _b in queries
            ]
        batches = out["batches"] = sum(len(x) for x in per_worker)
        procs = []
        pubs = []
        probe = None
        paired = Floor() if floor and pace > 0 else None
        try:
            ctx = mp.get_context("spawn")
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
            register_all(server, urls, stream.workers)
            out["register_s"] = round(time.perf_counter() - t_reg, 2)
            if server.probe:
                probe = Probe()
                server.register(-1, probe.url, "probe")
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
            fport = paired.port if paired is not None else 0
            cl = _start_clients(
                ctx, server.port, queries, pace, clients, server, procs, fport, predicts
            )
            cpu0 = server.cpu_s()
            start = _start_together(pubs + cl)
            if probe is not None:
                probe.start(server.port)
            last_publish = max(conn.recv()[2] for conn in pubs)
            lat, srv, errors, q_wall, floor_lat = _gather(cl, out)
            if paired is not None:
                out.update(Floor.row(floor_lat, q_wall), floor_answer_bytes="same")
            # quiescence: every batch applied
            sent = 0
            lags: list[float] = []
            if probe is not None:
                probe.stop()
                sent, lags, probe = probe.sent, probe.lags, None
            deadline = time.monotonic() + 600
            while True:
                applied, losses = server.applied()
                applied -= sent
                if applied >= batches or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            drained = time.time()
            cpu = server.cpu_s() - cpu0
            out.update(
                {
                    "applied": applied,
                    **losses,
                    "events_wall_s": round(drained - start, 3),
                    "events_per_s": batches / max(1e-9, drained - start),
                    "ops_per_s": (batches + len(lat)) / max(1e-9, drained - start, q_wall),
                    "drain_after_last_publish_s": round(drained - last_publish, 3),
                    "queries": len(lat),
                    "server_cpu_s": round(cpu, 2),
                    "server_cpu_us_per_op": cpu * 1e6 / max(1, batches + len(lat)),
                    "query_errors": errors,
                    "queries_per_s": len(lat) / q_wall if q_wall else 0.0,
                    "query_p50_us": tr.quantile(lat, 0.5) / 1e3,
                    "query_p99_us": tr.quantile(lat, 0.99) / 1e3,
                    "server_p50_us": tr.quantile(srv, 0.5) * 1e3 if srv else None,
                    "server_p99_us": tr.quantile(srv, 0.99) * 1e3 if srv else None,
                    "probes": len(lags),
                    "lag_p50_ms": tr.quantile(lags, 0.5) * 1e3 if lags else None,
                    "lag_p99_ms": tr.quantile(lags, 0.99) * 1e3 if lags else None,
                }
            )
            if predictions:  # their outcomes, once none is live (TTL * 9/8 at most)
                deadline = time.monotonic() + 2 * prediction_ttl + 5
                while server.prediction_counts()["live"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                out["prediction_outcomes"] = server.prediction_counts()
            n = len(stream.queries)
            qs = range(n if check is None else min(check, n))
            if server.answers:
                out.update(check_answers(server, stream, sl, id_of, qs, top_k))
            else:  # a floor: the size it was given
                out.update(checked=0, mismatches=0, answer_bytes_mean=server.size)
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
            if probe is not None:
                probe.stop()
            if paired is not None:
                paired.stop()
            server.stop()
        if floor and paired is None and "answer_bytes_mean" in out:
            out.update(run_floor(queries, out["answer_bytes_mean"], pace, clients, server))
    return out


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(tr.main())
