"""``kv-conductor --workers N`` (kvconductor/serve/owner.py, worker.py, proxy.py): real owner
and worker processes.

The single-process HTTP tests of tests/test_server.py run again here against a server
with two workers (tests/helpers/http_cases.py: same requests, same expected answers), then the
process model: answers identical to one process, worker restarts, owner death,
shutdown, port in use, and the pieces (metrics merge, 503, flags, log lines) alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvconductor import logs
from kvconductor._hash import hash_blocks
from kvconductor._shlock import proc_stamp
from kvconductor.http.metrics import QueryMetrics, merge_query_metrics, query_samples
from kvconductor.logs import set_process_role
from kvconductor.serve import bootstrap, cli, privatedir, worker, workermetrics
from kvconductor.serve import owner as supervision
from kvconductor.serve.settings import Settings
from kvconductor.serve.tuning import TRIM_SECS
from tests.helpers import http_cases
from tests.helpers.server import WORKER_BOUND as BOUND
from tests.helpers.server import (
    Server,
    gone,
    metric,
    ready_workers,
    register_engine,
    run_cli,
    running,
    tls_server,
    wait_workers,
)

pytestmark = pytest.mark.server

MSGPACK = "application/msgpack"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two workers, with the flags of tests/test_server.py's ``server``."""
    with running(
        tmp_path_factory.mktemp("cluster"),
        "--workers",
        "2",
        "--maintenance-interval-secs",
        "1",
        "--max-body-mb",
        "1",
    ) as srv:
        wait_workers(srv, 2)
        yield srv


def test_body_limit_over_http(server):
    http_cases.body_limit_over_http(server)


def test_errors_over_http(server):
    http_cases.errors_over_http(server)


def test_health_on_dual_stack_default_host(server):
    http_cases.health_on_dual_stack_default_host(server)


def test_json_and_msgpack_end_to_end(server):
    http_cases.json_and_msgpack_end_to_end(server)


def test_large_msgpack_query(server):
    http_cases.large_msgpack_query(server)


def test_top_k_and_instances_over_http(server):
    http_cases.top_k_and_instances_over_http(server)


def events(instance: str, first_id: int, hashes: list[int]) -> dict:
    return {
        "instance_id": instance,
        "events": [
            {
                "event_id": first_id,
                "type": "BlockStored",
                "block_hashes": hashes,
                "token_ids": list(range(1, 4 * len(hashes) + 1)),
                "block_size": 4,
            }
        ],
    }


def test_events_and_queries_over_many_connections(server):
    """POST /events and /query over a new connection each (SO_REUSEPORT spreads them
    over the workers): every answer is the single-process one."""
    register_engine(server, "many-conn", block_size=4)
    url = server.url
    for i in range(20):
        r = httpx.post(f"{url}/events", json=events("many-conn", i + 1, [i + 1]), timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok", "events_applied": 1}
    before = metric(server.http.get("/metrics").text, "kvconductor_query_seconds_count")
    for _ in range(10):
        r = httpx.post(
            f"{url}/query",
            json={"model": "qwen", "block_size": 4, "token_ids": [1, 2, 3, 4]},
            timeout=10,
        )
        assert r.status_code == 200
        assert r.json()["default"]["many-conn"]["DP"]["0"]["npu_blocks"] == 1
    text = server.http.get("/metrics").text
    # Counted once each, by whichever process answered it.
    assert metric(text, "kvconductor_query_seconds_count") == before + 10
    assert metric(text, "kvconductor_worker_processes") == 2
    # A streamed (chunked) answer comes through whole: the dump loads.
    r = server.http.get("/debug/dump")
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    path = server.log_path.parent / "through-worker.dump"
    path.write_bytes(r.content)
    check = run_cli("load-dump", str(path))
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["loaded"] == {
        "sources": 0,
        "registrations": 1,
        "indexes": 1,
        "skipped": 0,
    }
    # --load-dump: the owner loads it before the workers start.
    with running(path.parent, "--workers", "2", "--load-dump", str(path)) as warm:
        r = httpx.post(
            f"{warm.url}/query",
            json={"model": "qwen", "block_size": 4, "token_ids": [1, 2, 3, 4]},
            timeout=10,
        )
        assert r.json()["default"]["many-conn"]["DP"]["0"]["npu_blocks"] == 1
        assert "[owner pid=" in warm.log() and "warm start from" in warm.log()


def _answers(url: str, key: str) -> list[tuple]:
    """Status, content type, WWW-Authenticate and body of error answers, each on a new
    connection."""
    auth = {"Authorization": f"Bearer {key}"}
    reqs = [
        ("POST", "/register", {"content": b"{oops", "headers": auth}),
        ("POST", "/events", {"json": events("nobody", 1, [1]), "headers": auth}),
        ("POST", "/events", {"json": events("nobody", 1, [1])}),
        ("POST", "/events", {"json": events("nobody", 1, [1]), "headers": {"Authorization": "x"}}),
        ("GET", "/workers", {}),
        ("GET", "/nope", {}),
        ("PUT", "/register", {}),
        ("POST", "/query", {"content": b"\xc1", "headers": {"Content-Type": MSGPACK}}),
        ("POST", "/query", {"json": {"model": "m", "block_size": 4, "token_ids": [1]}}),
        ("POST", "/register", {"content": b"x" * 2_000_000, "headers": auth}),
        ("POST", "/events", {"content": b"x" * 2_000_000}),
        ("POST", "/query", {"content": b"x" * 2_000_000}),
        ("POST", "/events", {"json": {}, "headers": {"Origin": "https://evil.example"}}),
        ("OPTIONS", "/query", {"headers": {"Origin": "https://a.example"}}),
    ]
    out = []
    for method, path, kw in reqs:
        r = httpx.request(method, url + path, timeout=10, **kw)
        out.append(
            (
                method,
                path,
                r.status_code,
                r.headers.get("content-type"),
                r.headers.get("www-authenticate"),
                r.headers.get("access-control-allow-origin"),
                r.content,
            )
        )
    return out


@pytest.mark.slow
def test_error_answers_identical_to_one_process(tmp_path):
    flags = ("--api-key", "k", "--max-body-mb", "1")
    with running(tmp_path, *flags) as one, running(tmp_path, "--workers", "2", *flags) as many:
        wait_workers(many, 2)
        expected = _answers(one.url, "k")
        assert _answers(many.url, "k") == expected
        codes = [400, 404, 401, 401, 401, 404, 405, 400, 404, 413, 401, 413, 403, 200]
        assert [a[2] for a in expected] == codes


@pytest.mark.slow
def test_worker_restarts_and_owner_sigterm(tmp_path):
    """SIGKILL a worker: the other keeps answering, a new one starts, the restart is
    counted; SIGTERM a worker: it exits 0 and is started again; SIGTERM the owner:
    every process exits, the owner with status 0."""
    srv = Server(tmp_path, "--workers", "2")
    try:
        srv.wait_ready()
        first = wait_workers(srv, 2)
        victim = first["worker-1"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + BOUND
        while True:  # requests keep succeeding meanwhile, on new connections
            assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 200
            now = ready_workers(srv)
            if now["worker-1"] != victim:
                break
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        assert now["worker-2"] == first["worker-2"]
        assert re.search(
            rf"WARN \[owner pid=\d+\] worker-1 pid={victim} exited unexpectedly \(signal SIGKILL\)",
            srv.log(),
        )
        text = srv.http.get("/metrics").text
        assert metric(text, "kvconductor_worker_restarts_total") == 1
        assert metric(text, "kvconductor_worker_processes") == 2
        assert gone(victim)

        second = now["worker-2"]
        os.kill(second, signal.SIGTERM)
        now = wait_workers(srv, 2, exclude={second, victim})
        assert f"worker-2 pid={second} exited unexpectedly (exit status 0)" in srv.log()
        assert metric(srv.http.get("/metrics").text, "kvconductor_worker_restarts_total") == 2
    finally:
        pids = list(ready_workers(srv).values())
        code, _ = srv.terminate()
    assert code == 0, srv.log()
    assert all(gone(p) for p in pids)
    assert "[owner pid=" in srv.log() and "KV conductor shut down" in srv.log()


def test_https_through_workers(tmp_path, pki):
    """The workers terminate TLS with the server's flags; the owner's socket is plain."""
    srv = tls_server(tmp_path, pki, "--workers", "2", "--api-key", "k")
    try:
        srv.wait_ready()
        wait_workers(srv, 2)
        assert srv.http.get("/health").text == "OK"
        r = srv.http.get("/ready")
        assert (r.status_code, r.json()) == (200, {"status": "ready", "sources": 0})
        assert srv.http.get("/workers").status_code == 401
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)
        assert re.search(r"\[worker-1 pid=\d+\] HTTP limits .* tls=on", srv.log())
    finally:
        code, _ = srv.terminate()
        assert code == 0, srv.log()


def test_sigterm_to_the_whole_group_drains_once(tmp_path):
    """Ctrl-C in a terminal, or systemd's KillMode=control-group: every process gets the
    signal; the owner's stop request is no second signal to the workers."""
    srv = Server(tmp_path, "--workers", "2", preexec_fn=os.setpgrp)
    try:
        srv.wait_ready()
        pids = list(wait_workers(srv, 2).values())
        srv.http.close()
        os.killpg(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(10) == 0, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(10)
    assert all(gone(p) for p in pids)
    log = srv.log()
    assert "second shutdown signal" not in log and "killing it" not in log, log
    assert "exited unexpectedly" not in log and "KV conductor shut down" in log, log


def test_owner_sigkill_takes_the_workers_down(tmp_path):
    srv = Server(tmp_path, "--workers", "2")
    try:
        srv.wait_ready()
        pids = list(wait_workers(srv, 2).values())
        srv.proc.kill()
        srv.proc.wait(10)
        deadline = time.monotonic() + 5.0
        while not all(gone(p) for p in pids):
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.05)
        assert "owner process gone; exiting" in srv.log()
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        srv.http.close()


def test_port_in_use_same_error_as_one_process():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = str(s.getsockname()[1])
        one = run_cli("--host", "127.0.0.1", "--port", port)
        many = run_cli("--host", "127.0.0.1", "--port", port, "--workers", "2")

    def error_line(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("kv-conductor: error:")]

    assert many.returncode == one.returncode == 1
    assert error_line(many.stderr) == error_line(one.stderr) != []
    assert "Traceback" not in many.stderr


# ---------------------------------------------------------------- the pieces alone


def test_merge_query_metrics_sums_real_query_metrics():
    owner, w1, w2 = QueryMetrics(), QueryMetrics(), QueryMetrics()
    owner.route_seconds["/query"].observe(0.0002)
    w1.route_seconds["/query"].observe(0.003)
    w1.route_seconds["/query_by_hash"].observe(0.3)
    w1.route_errors["/query"].inc()
    w2.count_hits([("i", 0, 3, 1, 0)])
    w2.no_match.inc(2)
    merged = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in merge_query_metrics(owner, [query_samples(w1), query_samples(w2)])
        for s in fam.samples
    }
    q, qh = (("route", "/query"),), (("route", "/query_by_hash"),)
    assert merged[("kvconductor_query_seconds_count", q)] == 2
    assert merged[("kvconductor_query_seconds_count", qh)] == 1
    assert merged[("kvconductor_query_seconds_sum", q)] == pytest.approx(0.0032)
    assert merged[("kvconductor_query_seconds_bucket", (("le", "0.00025"), *q))] == 1
    assert merged[("kvconductor_query_seconds_bucket", (("le", "0.005"), *q))] == 2
    assert merged[("kvconductor_query_errors_total", q)] == 1
    assert merged[("kvconductor_query_blocks_total", (("tier", "npu"),))] == 3
    assert merged[("kvconductor_query_blocks_total", (("tier", "cpu"),))] == 1
    assert merged[("kvconductor_query_misses_total", (("reason", "no_match"),))] == 2
    # No other process: the local values unchanged.
    alone = merge_query_metrics(owner, [])
    assert [f.samples for f in alone] == [
        list(f.samples) for c in owner.collectors() for f in c.collect()
    ]


def test_owner_keeps_the_counts_of_exited_workers(tmp_path):
    """A worker's last report stays in the sums after it exits (counters never go back);
    the on_worker_exit hooks get its pid."""
    owner = supervision.Owner(Settings(workers=2, host="::", port=1), str(tmp_path), "unused")
    path = str(tmp_path / "w.sock")
    qm = QueryMetrics()
    qm.route_seconds["/query"].observe(0.001)
    workermetrics.serve_query_metrics(path, qm)
    owner._live[4242] = ("worker-1", 4242, path)
    assert _count(owner.worker_query_samples()) == 1
    qm.route_seconds["/query"].observe(0.001)
    assert _count(owner.worker_query_samples()) == 2
    slot = owner.slots[0]
    slot.proc = _Exited(4242)
    owner.stopping = True  # no respawn
    seen: list[int] = []

    def broken(pid: int) -> None:
        raise RuntimeError("a broken hook is logged, the next one still runs")

    supervision.on_worker_exit.extend([broken, seen.append])
    try:
        owner._exited(slot)
    finally:
        del supervision.on_worker_exit[-2:]
    assert seen == [4242] and supervision.on_worker_exit == []
    assert owner.live_workers() == 0
    assert _count(owner.worker_query_samples()) == 2


class _Exited:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode = -9


def _count(parts: list) -> float:
    return sum(
        v
        for samples in parts
        for name, labels, v in samples
        if name == "kvconductor_query_seconds_count" and labels["route"] == "/query"
    )


def _call(app, method: str, path: str, body: bytes = b"", headers=()) -> tuple[int, dict, bytes]:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-length", str(len(body)).encode()), *headers],
        "client": ("127.0.0.1", 5000),
    }
    sent: list[dict] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return msgs.pop(0)

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent)


def test_worker_app_owner_unreachable_is_503_in_the_request_encoding(tmp_path):
    app = bootstrap.create_worker_app(str(tmp_path / "missing.sock"), max_body_bytes=100)
    status, headers, body = _call(app, "POST", "/events", b"{}")
    assert status == 503 and headers[b"content-type"] == b"application/json"
    assert json.loads(body)["error"] == "the index owner process is unavailable; retry later"
    status, headers, body = _call(
        app, "POST", "/query", b"\x80", [(b"content-type", b"application/msgpack")]
    )
    assert status == 503 and headers[b"content-type"] == b"application/msgpack"
    assert "unavailable" in msgspec.msgpack.decode(body)["error"]
    # /health is the worker's own.
    assert _call(app, "GET", "/health")[::2] == (200, b"OK")


def test_worker_app_query_seam(tmp_path):
    """POST /query and /query_by_hash go to query_handler; other routes are forwarded."""
    seen = []

    async def handler(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"local"})

    app = bootstrap.create_worker_app(
        str(tmp_path / "missing.sock"), max_body_bytes=100, query_handler=handler
    )
    assert _call(app, "POST", "/query_by_hash", b"{}")[::2] == (299, b"local")
    assert _call(app, "POST", "/query", b"{}")[0] == 299
    assert _call(app, "POST", "/explain", b"{}")[0] == 503
    assert seen == ["/query_by_hash", "/query"]


def test_workers_flag():
    parse = cli.build_parser(raise_errors=True).parse_args
    assert cli.settings_from_args(parse([])).workers == 1
    assert cli.settings_from_args(parse(["--workers", "3"])).workers == 3
    assert cli.settings_from_args(parse(["--workers", "auto"])).workers == (os.cpu_count() or 1)
    for bad, needle in (("0", "must be within 1..1024"), ("x", "an integer or 'auto'")):
        with pytest.raises(cli.FlagError, match=re.escape(needle)):
            parse(["--workers", bad])
    assert cli.settings_from_args(parse([])).reader_stall_ms == 500
    assert cli.settings_from_args(parse(["--reader-stall-ms", "0"])).reader_stall_ms == 0
    with pytest.raises(cli.FlagError, match=re.escape("must be within 0..600000")):
        parse(["--reader-stall-ms", "600001"])


def test_workers_view_and_metrics_show_the_processes_and_the_shared_lock(server):
    ready = ready_workers(server)
    doc = server.http.get("/workers").json()["processes"]
    assert {(w["name"], w["pid"], w["state"]) for w in doc["workers"]} == {
        (name, pid, "ready") for name, pid in ready.items()
    }
    lock = doc["shared_lock"]
    assert lock["reader_stall_ms"] == 500 and lock["write_sections"] > 0
    assert (lock["stalled_readers"], lock["readers_killed"], lock["stalling"]) == (0, 0, None)
    assert lock["recent_stalls"] == []
    hb = doc["heartbeat"]  # every worker answers: nobody killed, nobody silent for long
    assert hb == {"interval_ms": 100, "timeout_ms": 500, "kills": 0, "recent_kills": []}
    assert all(0 <= w["silent_ms"] < 500 for w in doc["workers"]), doc["workers"]
    text = server.http.get("/metrics").text
    assert metric(text, "kvconductor_worker_heartbeat_kills_total") == 0
    assert "kvconductor_worker_heartbeat_kills_total 0.0" in text
    assert metric(text, "kvconductor_shared_writer_wait_seconds_count") >= lock["write_sections"]
    assert 'kvconductor_shared_writer_wait_seconds_bucket{le="+Inf"}' in text
    assert 'kvconductor_shared_writer_wait_seconds_bucket{le="0.5"}' in text
    assert metric(text, "kvconductor_shared_stalled_readers_total") == 0
    assert metric(text, "kvconductor_shared_readers_killed_total") == 0


def _owner(tmp_path: Path, workers: int = 3) -> supervision.Owner:
    loop = asyncio.new_event_loop()
    owner = supervision.Owner(Settings(workers=workers, host="::", port=1), str(tmp_path), "x.sock")
    owner._loop = loop
    return owner


class _Running:
    pid = 1

    def poll(self):
        return None


def test_respawn_back_off_is_short_while_no_worker_listens(tmp_path):
    """A worker's back-off doubles up to 30 s while another worker listens, starts, or
    is about to; with none, the next start is at most RESPAWN_ALL_DOWN away (one worker
    only: the others keep their back-off)."""
    owner = _owner(tmp_path)
    a, b, c = owner.slots
    for s in (a, b, c):
        s.backoff = 16.0
    b.proc, b.ready = _Running(), True  # listening
    assert owner._respawn_delay(a) == 16.0 and a.backoff == 30.0
    b.ready = False  # starting
    assert owner._respawn_delay(a) == 30.0
    b.proc = None  # none left: a comes back quickly, its back-off still grows
    assert owner._respawn_delay(a) == supervision.RESPAWN_ALL_DOWN and a.backoff == 30.0
    owner._call_respawn(a, supervision.RESPAWN_ALL_DOWN)
    assert owner._respawn_delay(c) == 16.0  # a is about to start: c waits its back-off
    assert owner._respawn_delay(b, supervision.RESPAWN_FIRST) == supervision.RESPAWN_FIRST
    assert b.backoff == 16.0  # an explicit delay (a stall kill) leaves the back-off alone
    owner._loop.close()


def test_stale_private_directories_are_removed(tmp_path):
    """Directories of owners that are gone (dead pid, a pid now another process's, an
    older version's nobody listens on) go; those of running owners, of starting ones
    (no owner file yet; an older version's too young to judge) and anything else stay."""
    me = os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone

    def make(name: str, owner: str | None = None) -> Path:
        d = tmp_path / name
        d.mkdir(mode=0o700)
        if owner is not None:
            (d / privatedir.OWNER_FILE).write_text(owner)
        return d

    dead = make(f"kv-conductor-{child.pid}-aaaa", f"{child.pid} 5\n")
    reused = make(f"kv-conductor-{me}-bbbb", f"{me} {proc_stamp(me) + 1}\n")
    alive = make(f"kv-conductor-{me}-cccc", f"{me} {proc_stamp(me)}\n")
    starting = make(f"kv-conductor-{me}-dddd")
    legacy = make("kv-conductor-eeee")
    young = make("kv-conductor-hhhh")  # an older version's owner between bind and listen
    for d in (legacy, young):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(d / "owner.sock"))
    listening = make("kv-conductor-ffff")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(listening / "owner.sock"))
    srv.listen(1)
    unknown = make("kv-conductor-gggg")
    other = make("something-else")
    old = time.time() - privatedir.LEGACY_DIR_AGE - 10
    for d in (legacy, listening, unknown):
        os.utime(d, (old, old))
    try:
        removed = privatedir.remove_stale_private_dirs(str(tmp_path))
    finally:
        srv.close()
    assert sorted(removed) == sorted(str(d) for d in (dead, reused, legacy))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        d.name for d in (alive, starting, listening, unknown, other, young)
    )


def test_worker_settings_leave_the_api_key_out():
    s = Settings(api_key="secret", port=5, allow_origins=("https://a.example",), workers=3)
    text = worker.settings_json(s)
    assert "secret" not in text
    back = worker.settings_from_json(text)
    assert (back.port, back.allow_origins, back.api_key) == (5, ("https://a.example",), None)


def test_log_lines_name_the_process():
    rec = logging.LogRecord("kvconductor", logging.WARNING, __file__, 1, "x=%d", (1,), None)
    assert re.fullmatch(r"\S+Z  WARN x=1", logs._Formatter().format(rec))
    set_process_role("worker-3")
    try:
        line = logs._Formatter().format(rec)
        doc = json.loads(logs._JsonFormatter().format(rec))
    finally:
        set_process_role(None)
    assert re.fullmatch(rf"\S+Z  WARN \[worker-3 pid={rec.process}\] x=1", line)
    assert (doc["process"], doc["pid"], doc["message"]) == ("worker-3", rec.process, "x=1")


# -- queries answered by the workers from the shared index -------------------------------


def _query_over_new_connection(url: str, tokens: list[int], bs: int) -> dict:
    r = httpx.post(
        f"{url}/query", json={"model": "qwen", "block_size": bs, "token_ids": tokens}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()


def _explained(srv: Server, tokens: list[int], bs: int) -> dict:
    """The owner's in-process answer (``/explain`` runs on its ingest thread): its
    per-instance counts are /query's by contract."""
    r = srv.http.post("/explain", json={"model": "qwen", "block_size": bs, "token_ids": tokens})
    assert r.status_code == 200, r.text
    out: dict = {}
    for inst in r.json()["instances"]:
        counts = (inst["npu_blocks"], inst["cpu_blocks"], inst["disk_blocks"])
        if any(counts):
            out[(inst["instance_id"], inst["dp_rank"])] = counts
    return out


def _as_counts(answer: dict) -> dict:
    out = {}
    for iid, inst in answer.get("default", {}).items():
        for dp, m in inst["DP"].items():
            out[(iid, int(dp))] = (m["npu_blocks"], m["cpu_blocks"], m["disk_blocks"])
    return out


def test_workers_answer_from_the_shared_index_like_the_owner(server):
    """Random registrations, HTTP events and a real ZeroMQ publisher feed the owner;
    queries over new connections (spread over both workers) answer exactly what the
    owner's own index says, at quiescence, after every round."""
    from tests.helpers.publishers import FakePublisher, schema, wait_until

    rng = __import__("random").Random(14)
    bs = 4
    log = server.log()
    assert log.count("shared index attached") >= 2, log  # both workers answer locally
    pub = FakePublisher(replay=False)
    try:
        register_engine(server, "zmq-eng", medium_endpoints={"npu": pub.url})
        v = schema("vllm", "0.33.0")
        docs: list[list[int]] = []
        next_hash = 0x5000_0000
        for rnd in range(4):
            # a new HTTP engine or DP each round, and ZeroMQ blocks of the same prompts
            iid, dp = f"http-eng-{rnd % 2}", rnd // 2
            register_engine(server, iid, dp_rank=dp)
            doc = [rng.randrange(1, 30_000) for _ in range(bs * rng.randrange(2, 12))]
            if docs and rng.random() < 0.5:  # shares a prefix with an earlier prompt
                doc = docs[-1][: bs * 2] + doc
            docs.append(doc)
            n = len(doc) // bs
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            body = {
                "instance_id": iid,
                "events": [
                    {
                        "event_id": 1,
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "token_ids": doc,
                        "block_size": bs,
                        "dp_rank": dp,
                    }
                ],
            }
            r = httpx.post(f"{server.url}/events", json=body, timeout=10)
            assert r.status_code == 200, r.text
            zn = rng.randrange(1, n + 1)
            zh = list(range(next_hash, next_hash + zn))
            next_hash += zn
            batch = v.batch([v.stored(zh, None, doc[: bs * zn], bs, medium="GPU")])

            def indexed(zn=zn, doc=doc, batch=batch):
                pub.publish(batch)
                got = _explained(server, doc[: bs * zn], bs).get(("zmq-eng", 0))
                return got is not None and got[0] == zn

            pub.wait_subscribed()
            wait_until(indexed, timeout=15)
            for q in docs + [doc[: bs * 3] + [7, 7, 7, 7], [rng.randrange(30_000)] * 8]:
                want = _explained(server, q, bs)
                for _ in range(3):
                    assert _as_counts(_query_over_new_connection(server.url, q, bs)) == want
    finally:
        pub.stop()


def _load_chain(url: str, iid: str, tokens: list[int], bs: int, base: int) -> None:
    """One HBM chain of ``tokens`` through POST /events, 8k blocks per request."""
    step = 8192
    nb = len(tokens) // bs
    parent = None
    for s in range(0, nb, step):
        hashes = range(base + s, base + min(nb, s + step))
        ev = {
            "instance_id": iid,
            "events": [
                {
                    "event_id": 1,
                    "type": "BlockStored",
                    "block_hashes": list(hashes),
                    "token_ids": tokens[s * bs : (s + len(hashes)) * bs],
                    "block_size": bs,
                }
            ],
        }
        if parent is not None:
            ev["events"][0]["parent_block_hash"] = parent
        parent = hashes[-1]
        r = httpx.post(f"{url}/events", json=ev, timeout=60)
        assert r.status_code == 200, r.text


def _pids(srv: Server) -> list[int]:
    pids = [srv.proc.pid]
    for task in os.listdir(f"/proc/{srv.proc.pid}/task"):
        with contextlib.suppress(OSError):
            pids += [
                int(p)
                for p in Path(f"/proc/{srv.proc.pid}/task/{task}/children").read_text().split()
            ]
    return pids


def _pss_kib(pids: list[int], field: str = "Pss") -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                total += int(line.split()[1])
    return total


def _read_until(url: str, probe: list[int], bs: int, stop, answered: list[int]) -> None:
    """Query ``probe`` over new connections until ``stop`` is set (another thread)."""
    while not stop.is_set():
        r = httpx.post(
            f"{url}/query", json={"model": "qwen", "block_size": bs, "token_ids": probe}, timeout=30
        )
        answered.append(r.status_code)
        time.sleep(0.01)


@pytest.mark.slow
def test_one_copy_of_the_index_across_workers(tmp_path):
    """Two workers reading the index hold no copy of it: the index's memory is the shared
    mapping (counted once in the summed PSS), and what each worker adds privately is a
    small part of what the index costs one process. The chain is loaded while the
    workers answer queries, so the arena grows under them; every worker then walks the
    whole chain."""
    import random

    rng = random.Random(5)
    bs = 16
    # 300k blocks: ~17 MiB of index, so what each process allocates to serve (a few MiB
    # apiece) stays small beside it
    tokens = [rng.randrange(1, 150_000) for _ in range(bs * 300_000)]
    probe = tokens[: bs * 64]
    local = hash_blocks(tokens, bs)
    growth = {}
    shared = 0
    private: list[int] = []
    for workers in (1, 2):
        args = ["--workers", str(workers)] if workers > 1 else []
        (tmp_path / f"w{workers}").mkdir()
        with running(tmp_path / f"w{workers}", *args) as srv:
            if workers > 1:
                wait_workers(srv, workers)
            register_engine(srv, "big", block_size=bs)
            _load_chain(srv.url, "big", probe, bs, 1 << 40)  # the index exists, warm
            for _ in range(8):
                _query_over_new_connection(srv.url, probe, bs)
            pids = _pids(srv)
            before = _pss_kib(pids)
            before_shmem = _pss_kib(pids, "Pss_Shmem")
            before_anon = [_pss_kib([p], "Pss_Anon") for p in pids[1:]]
            stop = threading.Event()
            answered: list[int] = []
            t = threading.Thread(target=_read_until, args=(srv.url, probe, bs, stop, answered))
            t.start()
            try:
                _load_chain(srv.url, "big", tokens, bs, 1 << 41)
            finally:
                stop.set()
                t.join(30)
            assert answered and set(answered) == {200}
            # every worker walks the whole chain: /query_by_hash of its LocalBlockHashes
            # (a 2.4 MiB body; the 4.8M-token /query body would add its parse buffers)
            body = msgspec.msgpack.encode(
                {"model": "qwen", "block_size": bs, "block_hashes": list(local)}
            )
            for _ in range(6):  # new connections: spread over the workers
                r = httpx.post(
                    f"{srv.url}/query_by_hash",
                    content=body,
                    headers={"Content-Type": MSGPACK},
                    timeout=60,
                )
                hits = msgspec.msgpack.decode(r.content)["default"]["big"]["DP"]["0"]
                assert hits["npu_blocks"] == len(tokens) // bs
            # what serving those bodies left on the heaps goes back to the system (the
            # owner's ingest thread and the workers' event loops trim every TRIM_SECS)
            time.sleep(TRIM_SECS + 1.5)
            growth[workers] = _pss_kib(pids) - before
            if workers > 1:
                shared = _pss_kib(pids, "Pss_Shmem") - before_shmem
                private = [
                    _pss_kib([p], "Pss_Anon") - b
                    for p, b in zip(pids[1:], before_anon, strict=True)
                ]
    # the 300k-block chain costs tens of MiB in one process ...
    assert growth[1] > 10_000, growth
    # ... and with two workers most of it is the shared mapping, counted once; a worker's
    # own growth (buffers of the queries it served) is well under a copy of the index
    assert shared > 0.6 * growth[1], (shared, growth)
    assert len(private) == 2 and max(private) < 0.4 * growth[1], (private, growth)
    assert growth[2] < 1.8 * growth[1], growth  # one copy more would be 2x


def _hammer(url: str, body: bytes, stop: threading.Event, codes: list[int]) -> None:
    """1M-token queries back to back, a new connection each (so both workers get them)
    until ``stop``; a connection cut by a killed worker is not an answer."""
    while not stop.is_set():
        try:
            r = httpx.post(
                f"{url}/query", content=body, headers={"Content-Type": MSGPACK}, timeout=60
            )
        except httpx.TransportError:
            continue
        codes.append(r.status_code)


@pytest.mark.slow
def test_workers_killed_during_queries_never_wedge_ingest(tmp_path):
    """Workers SIGKILLed while they run 1M-token queries (so, often inside a read section
    of the shared lock): events still apply, the new blocks are answered, the dead worker
    is replaced and the survivor never stops answering."""
    import random

    rng = random.Random(9)
    bs = 16
    doc = [rng.randrange(1, 150_000) for _ in range(1_000_000)]
    big = msgspec.msgpack.encode({"model": "qwen", "block_size": bs, "token_ids": doc})
    with running(tmp_path, "--workers", "2") as srv:
        wait_workers(srv, 2)
        register_engine(srv, "big", block_size=bs)
        _load_chain(srv.url, "big", doc, bs, 1 << 40)
        stop = threading.Event()
        codes: list[int] = []
        threads = [
            threading.Thread(target=_hammer, args=(srv.url, big, stop, codes)) for _ in range(3)
        ]
        for t in threads:
            t.start()
        try:
            killed: set[int] = set()
            for round_ in range(3):
                current = wait_workers(srv, 2, exclude=killed)
                time.sleep(0.5)
                victim = sorted(current.values())[0]
                os.kill(victim, signal.SIGKILL)
                killed.add(victim)
                # the ingest thread is not wedged behind the dead reader
                extra = [rng.randrange(1, 150_000) for _ in range(bs * 4)]
                body = events("big", 100 + round_, [1 << 41 | (round_ << 8 | i) for i in range(4)])
                body["events"][0].update(token_ids=extra, block_size=bs)
                r = httpx.post(f"{srv.url}/events", json=body, timeout=30)
                assert r.status_code == 200 and r.json()["events_applied"] == 1, r.text
                got = _query_over_new_connection(srv.url, extra, bs)
                assert got["default"]["big"]["DP"]["0"]["npu_blocks"] == 4
            wait_workers(srv, 2, exclude=killed)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert codes and set(codes) == {200}
        text = srv.http.get("/metrics").text
        assert metric(text, "kvconductor_worker_restarts_total") == 3
        assert metric(text, "kvconductor_worker_processes") == 2
        full = _query_over_new_connection(srv.url, doc[: bs * 1000], bs)
        assert full["default"]["big"]["DP"]["0"]["npu_blocks"] == 1000


def _many_holders(url: str, n: int, bs: int, tokens: list[int]) -> None:
    """``n`` engines (instance ``e<i % 7>``, DP ``i // 7``) registered for model ``many``,
    engine i holding the first 1 + i % 5 blocks of ``tokens`` (some on CPU)."""
    for i in range(n):
        iid, dp = f'e{i % 7}\u00e9"q', i // 7
        body = {"instance_id": iid, "type": "vLLM", "modelname": "many", "block_size": bs}
        r = httpx.post(f"{url}/register", json={**body, "dp_rank": dp}, timeout=10)
        assert r.status_code == 201, r.text
        blocks = 1 + i % 5
        ev = {
            "event_id": 1,
            "dp_rank": dp,
            "type": "BlockStored",
            "block_hashes": [10_000 * (i + 1) + b for b in range(blocks)],
            "token_ids": tokens[: bs * blocks],
            "block_size": bs,
            "medium": "cpu" if i % 3 == 2 else "GPU",
        }
        r = httpx.post(f"{url}/events", json={"instance_id": iid, "events": [ev]}, timeout=10)
        assert r.json()["events_applied"] == 1, r.text


def _answer_bytes(url: str, tokens: list[int], bs: int) -> list[tuple[int, bytes]]:
    """Raw answers of /query and /query_by_hash, JSON and msgpack, with and without the
    extension fields, each over a new connection (so both workers answer some)."""
    hashes = list(hash_blocks(tokens, bs))
    extras = [{}, {"top_k": 1}, {"top_k": 4}, {"instances": ['e1\u00e9"q', "zz"]}, {"top_k": 0}]
    out = []
    for extra in extras:
        for path, body in (
            ("/query", {"model": "many", "block_size": bs, "token_ids": tokens, **extra}),
            ("/query_by_hash", {"model": "many", "block_hashes": hashes, **extra}),
        ):
            for mp in (False, True):
                enc = msgspec.msgpack.encode if mp else msgspec.json.encode
                ct = MSGPACK if mp else "application/json"
                r = httpx.post(
                    url + path, content=enc(body), headers={"content-type": ct}, timeout=30
                )
                out.append((r.status_code, r.content))
    return out


def test_answers_identical_to_one_process(tmp_path):
    """The answers of --workers 2 (rendered from the shared index's rows in the worker
    processes) are byte for byte those of one process, with many holders per block."""
    bs = 4
    tokens = list(range(100, 124))
    with running(tmp_path) as one, running(tmp_path, "--workers", "2") as many:
        wait_workers(many, 2)
        for srv in (one, many):
            _many_holders(srv.url, 60, bs, tokens)
        want = _answer_bytes(one.url, tokens, bs)
        assert [c for c, _ in want] == [200] * 16 + [400] * 4
        assert len(msgspec.json.decode(want[0][1])["default"]) == 7  # every instance
        for _ in range(3):
            assert _answer_bytes(many.url, tokens, bs) == want
