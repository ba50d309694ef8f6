"""The real service in a subprocess (``python -m kvconductor --port N``), over real HTTP.

Clients: httpx with JSON bodies and msgspec-encoded MessagePack bodies.
Teardown sends SIGTERM and fails the test if the process had to be killed.
The server helpers are ``tests/helpers/server.py``; the HTTP cases that
``tests/test_cluster.py`` runs again with two workers are ``tests/helpers/http_cases.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import msgspec
import pytest

from kvconductor._hash import hash_blocks
from tests.helpers import http_cases
from tests.helpers.http_cases import register
from tests.helpers.server import (
    HAS_IPV6,
    ROOT,
    SHUTDOWN_BOUND,
    STARTUP_BOUND,
    Server,
    free_port,
    gunicorn_cmd,
    run_cli,
    running,
    wait_health,
)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(
        tmp_path_factory.mktemp("srv"), "--maintenance-interval-secs", "1", "--max-body-mb", "1"
    ) as srv:
        yield srv


def test_health_on_dual_stack_default_host(server):
    http_cases.health_on_dual_stack_default_host(server)


def test_json_and_msgpack_end_to_end(server):
    http_cases.json_and_msgpack_end_to_end(server)


def test_large_msgpack_query(server):
    http_cases.large_msgpack_query(server)


def test_errors_over_http(server):
    http_cases.errors_over_http(server)


def test_body_limit_over_http(server):
    http_cases.body_limit_over_http(server)


def test_sigterm_drains_and_exits(tmp_path):
    srv = Server(tmp_path, "--host", "127.0.0.1", "--api-key", "k")
    srv.wait_ready()
    assert register(srv.http).status_code == 401
    assert (
        srv.http.post(
            "/register",
            headers={"Authorization": "Bearer k"},
            json={
                "instance_id": "a",
                "type": "vLLM",
                "modelname": "m",
                "block_size": 4,
                "dp_rank": 0,
            },
        ).status_code
        == 201
    )
    code, elapsed = srv.terminate(signal.SIGTERM)
    log = srv.log()
    assert code == 0, log
    assert elapsed < SHUTDOWN_BOUND
    assert f"KV conductor starting on 127.0.0.1:{srv.port}" in log
    assert "register request" in log and "worker registered" in log
    assert "received shutdown signal, draining connections..." in log
    assert "KV conductor shut down" in log
    assert "Traceback" not in log


def test_sigint_exits(tmp_path):
    srv = Server(tmp_path, "--host", "127.0.0.1", env={"KV_CONDUCTOR_LOG": "debug"})
    srv.wait_ready()
    code, _ = srv.terminate(signal.SIGINT)
    assert code == 0
    assert "KV conductor shut down" in srv.log()


def test_json_log_format_writes_one_object_per_line(tmp_path):
    srv = Server(tmp_path, "--host", "127.0.0.1", "--log-format", "json")
    srv.wait_ready()
    assert srv.http.post("/query", content=b"{").status_code == 400  # logs a WARN
    code, _ = srv.terminate()
    assert code == 0
    lines = [msgspec.json.decode(line) for line in srv.log().splitlines() if line.strip()]
    assert lines and all(set(d) == {"ts", "level", "message"} for d in lines), srv.log()
    assert all(d["ts"].endswith("Z") and d["ts"][10] == "T" for d in lines)
    messages = [d["message"] for d in lines]
    assert any(m.startswith("KV conductor starting") and "log_format=json" in m for m in messages)
    assert any(d["level"] == "WARN" and "path=/query" in d["message"] for d in lines), messages
    assert messages[-1] == "KV conductor shut down"


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == "kv-conductor 0.1.0"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--host", "localhost"], "invalid host address"),
        (["--host", "10.0.0.300"], "invalid host address"),
        (["--port", "70000"], "invalid port"),
        (["-p", "abc"], "invalid port"),
        (["--maintenance-interval-secs", "-1"], "must be >= 0"),
        (["--pending-ttl-secs", "1.5"], "whole number"),
        (["--max-body-mb", "0"], "must be > 0"),
        (["--log-level", "loud"], "invalid log level"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kv-conductor: error:"), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


def test_port_in_use_fails_cleanly():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run_cli("--host", "127.0.0.1", "--port", str(port))
    assert r.returncode == 1
    assert "failed to bind TCP listener" in r.stderr and "Traceback" not in r.stderr


def test_gunicorn_factory(tmp_path):
    port = free_port()
    cmd = gunicorn_cmd(port, "-w", "1", no_snapshots=False)
    log_path = tmp_path / "gunicorn.log"
    snaps = tmp_path / "snaps"
    flags = f"--pending-ttl-secs 30 --snapshot-dir {snaps} --snapshot-interval-secs 0"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", KV_CONDUCTOR_ARGS=flags),
        )
    try:
        wait_health(proc, f"http://127.0.0.1:{port}", log_path)
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        assert register(http).status_code == 201
        assert http.get("/workers").json()["workers"][0]["instance_id"] == "vllm-prefill-1"
        http.close()
        # The settings (env flags, then factory flags) and the serving switch interval.
        text = log_path.read_text()
        assert "KV conductor starting under gunicorn" in text
        assert (
            "workers=1 version=0.1.0 maintenance_interval=1s pending_ttl=30s "
            "content_ttl=300s offload_ttl=600s loss_grace=600s source_down=10s "
            "source_purge=600s max_sources=4096 "
            "replay_deadline=60s max_message_mb=256 max_blocks_per_message=1000000 "
            "max_blocks_per_source=4000000 max_body_bytes=67108864 log_level=info "
            f"log_format=text auth=off endpoints=tcp-connect snapshots={snaps}@0s "
            "query_path=asgi switch_interval=0.0005"
        ) in text, text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SHUTDOWN_BOUND * 2) == 0
        assert "KV conductor shut down" in log_path.read_text()
        # the lifespan shutdown wrote the last snapshot, with the registration
        from kvconductor.state import dump

        (snap,) = snaps.glob("snapshot-*.kvc")
        assert dump.load_file(str(snap))["loaded"]["registrations"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_gunicorn_default_snapshot_dir_and_reload(tmp_path):
    """Under gunicorn the default snapshot directory is that of the port gunicorn binds.
    A reload (SIGHUP) starts the new worker before the old one stops: the new one waits
    for the directory's lock, so it loads the old one's last snapshot."""
    port = free_port()
    state = tmp_path / "state"
    snaps = state / "kvconductor" / str(port)
    cmd = gunicorn_cmd(
        port,
        "-w",
        "1",
        "-k",
        "kvconductor.app.KvConductorWorker",
        factory_args="",
        no_snapshots=False,
    )
    log_path = tmp_path / "gunicorn.log"
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        XDG_STATE_HOME=str(state),
        KV_CONDUCTOR_ARGS="--snapshot-interval-secs 0",
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_health(proc, f"http://127.0.0.1:{port}", log_path)
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        assert register(http).status_code == 201
        assert f" snapshots={snaps}@0s " in log_path.read_text()
        proc.send_signal(signal.SIGHUP)

        def reloaded() -> bool:
            text = log_path.read_text()
            return text.count("KV conductor started (lifespan)") == 2

        deadline = time.monotonic() + STARTUP_BOUND
        while not reloaded():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        workers = http.get("/workers").json()["workers"]
        assert [w["instance_id"] for w in workers] == ["vllm-prefill-1"], log_path.read_text()
        http.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SHUTDOWN_BOUND * 2) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text()
    assert f"warm start from snapshot {snaps}/snapshot-" in text, text
    assert "Traceback" not in text and " ERROR " not in text, text


@pytest.mark.parametrize(
    "extra,env,message",
    [
        (("-w", "2"), {}, "gunicorn started with 2 workers"),
        (("-w", "1"), {"WEB_CONCURRENCY": "3"}, None),  # -w wins over the environment
        ((), {"WEB_CONCURRENCY": "2"}, "2 workers; the index lives in one process"),
        (
            ("-w", "1"),
            {"KV_CONDUCTOR_ARGS": "--pending-ttl-sec 5"},
            "kv-conductor: error: unrecognized arguments: --pending-ttl-sec 5",
        ),
        (
            ("-w", "1"),
            {"KV_CONDUCTOR_ARGS": "--max-body-mb -1"},
            "kv-conductor: error: argument --max-body-mb: invalid size '-1'",
        ),
    ],
)
def test_gunicorn_refuses_many_workers_and_bad_flags(tmp_path, extra, env, message):
    """The master stops at once with the reason (no worker restart loop)."""
    port = free_port()
    env = (
        {k: v for k, v in os.environ.items() if k not in ("KV_CONDUCTOR_ARGS", "WEB_CONCURRENCY")}
        | {"PYTHONUNBUFFERED": "1"}
        | env
    )
    proc = subprocess.Popen(
        gunicorn_cmd(port, *extra, factory_args=""),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if message is None:
            # Accepted: it serves; stop it.
            http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
            deadline = time.monotonic() + STARTUP_BOUND
            while True:
                assert proc.poll() is None
                try:
                    if http.get("/health").text == "OK":
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            http.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(SHUTDOWN_BOUND * 2) == 0
            return
        out, _ = proc.communicate(timeout=STARTUP_BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # gunicorn's "App failed to load." (4). With two workers failing at once the master
    # can meet the second exit while halting and end with a HaltServer traceback (1):
    # stopped all the same, with the message.
    assert proc.returncode in ((4, 1) if "2 workers" in message else (4,)), out
    assert message in out, out
    if "2 workers" in message:  # points to the way that works
        assert "or run `kv-conductor --workers 2`" in out, out
    assert "App failed to load" in out
    # Each worker booted at most once: none was restarted (the master may halt on the first
    # worker's failure before it spawned the second).
    workers = 2 if "2 workers" in message else 1
    assert 1 <= out.count("Booting worker") <= workers, out


def test_bind_falls_back_to_ipv4_without_ipv6(monkeypatch, caplog):
    import errno

    from kvconductor.serve import single as server_module

    real_listen = server_module._listen

    def no_ipv6(family, addr, dual_stack, **kw):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_listen(family, addr, dual_stack, **kw)

    monkeypatch.setattr(server_module, "_listen", no_ipv6)
    sock = server_module.bind_socket("::", 0)
    try:
        assert sock.family == socket.AF_INET
        assert server_module.format_address(sock).startswith("0.0.0.0:")
        assert any("falling back to 0.0.0.0" in m for m in caplog.messages)
    finally:
        sock.close()
    with pytest.raises(OSError):
        server_module.bind_socket("::1", 0)  # an explicit IPv6 address does not fall back
    # The owner of --workers N: bound with SO_REUSEPORT, not listening, same fallback.
    held = server_module.bind_socket("::", 0, reuse_port=True, listen=False)
    try:
        assert held.family == socket.AF_INET
        assert held.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0
        monkeypatch.undo()
        port = held.getsockname()[1]
        worker = server_module.bind_socket("0.0.0.0", port, reuse_port=True)
        assert worker.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        worker.close()
    finally:
        held.close()


@pytest.mark.skipif(not HAS_IPV6, reason="no IPv6 on this host")
def test_bind_dual_stack():
    from kvconductor.serve import single as server_module

    sock = server_module.bind_socket("::", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        assert server_module.format_address(sock) == f"[::]:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_worker_servers_trim_their_heap_every_trim_secs(monkeypatch):
    """The ``--workers N`` processes have no ingest thread: their event loop trims the
    heap every TRIM_SECS (on uvicorn's 0.1 s tick); a server running the conductor leaves
    it to the ingest thread."""
    import asyncio

    import uvicorn

    from kvconductor.serve import single as srv_mod
    from kvconductor.serve.tuning import TRIM_SECS
    from kvconductor.serve.worker import WorkerServer

    calls: list[int] = []
    monkeypatch.setattr(srv_mod, "trim_heap", lambda: calls.append(1))

    async def app(scope, receive, send):  # never called
        raise AssertionError

    async def ticks(server, n):
        for counter in range(n):
            await server.on_tick(counter)

    n = 2 * round(TRIM_SECS * 10) + 1
    for server, expected in (
        (WorkerServer(uvicorn.Config(app), lambda: None), 2),
        (srv_mod.KvServer(uvicorn.Config(app)), 0),
    ):
        calls.clear()
        asyncio.run(ticks(server, n))
        assert len(calls) == expected


def test_top_k_and_instances_over_http(server):
    http_cases.top_k_and_instances_over_http(server)


def test_top_k_over_a_fleet_holding_one_prefix(tmp_path):
    # 1,024 engines all holding the prompt's first block (a system prompt on a round-robin
    # fleet) and one holding two: top_k=8 answers 8 rows, not 1,024, and says how many
    # rows tied at the cut it left out
    n, tokens = 1024, list(range(1, 9))
    names = [f"w{i:04d}" for i in range(n)]
    with running(tmp_path) as srv:
        http = srv.http
        for i, iid in enumerate(names):
            assert register(http, instance_id=iid, modelname="fleet").status_code == 201
            blocks = 2 if i == 700 else 1
            ev = {
                "event_id": 1,
                "dp_rank": 0,
                "type": "BlockStored",
                "block_hashes": [1000 * (i + 1) + b for b in range(blocks)],
                "token_ids": tokens[: 4 * blocks],
                "block_size": 4,
            }
            r = http.post("/events", json={"instance_id": iid, "events": [ev]})
            assert r.status_code == 200, r.text
        q = {"model": "fleet", "block_size": 4, "token_ids": tokens}
        # without top_k: the whole V3 answer, byte for byte, and no new header
        whole = {
            iid: {
                "longest_matched": 8 if i == 700 else 4,
                "DP": {
                    "0": {
                        "matched_tokens": 8 if i == 700 else 4,
                        "npu_blocks": 2 if i == 700 else 1,
                        "cpu_blocks": 0,
                        "disk_blocks": 0,
                    }
                },
            }
            for i, iid in enumerate(names)
        }
        r = http.post("/query", json=q)
        assert r.content == msgspec.json.encode({"default": whole})
        assert http_cases.TOP_K_OMITTED_HEADER not in r.headers
        # top_k=8: the deeper holder and 7 of the 1,023 tied at one block
        r = http.post("/query", json={**q, "top_k": 8})
        got = r.json()["default"]
        assert len(got) == 8 and "w0700" in got
        assert r.headers[http_cases.TOP_K_OMITTED_HEADER] == "1016"
        assert all(v == whole[i] for i, v in got.items())
        # the same request, the same rows; other requests, other rows (ties spread)
        assert http.post("/query", json={**q, "top_k": 8}).json()["default"] == got
        seen = set()
        for extra in range(20):
            other = {**q, "token_ids": [*tokens, 100 + extra], "top_k": 8}
            seen |= set(http.post("/query", json=other).json()["default"])
        assert len(seen) > 50
        # instances in a given order (a router's candidates by load): the first 8 of that
        # order among the tied rows, the deeper holder first whatever its place
        order = names[::-3]  # w0700 is not in it
        for k, named, want in (
            (8, order, order[:8]),
            (8, [*order, "w0700"], ["w0700", *order[:7]]),
            (3, [*order, "w0700"], ["w0700", *order[:2]]),
        ):
            tied_out = len(order) - len(want) + ("w0700" in want)
            r = http.post("/query", json={**q, "top_k": k, "instances": named})
            assert sorted(r.json()["default"]) == sorted(want)
            assert r.headers[http_cases.TOP_K_OMITTED_HEADER] == str(tied_out)
            hq = {
                "model": "fleet",
                "block_hashes": list(hash_blocks(tokens, 4)),
                "top_k": k,
                "instances": named,
            }
            code, _, doc = http_cases.msgpack_post(http, "/query_by_hash", hq)
            assert code == 200 and sorted(doc["default"]) == sorted(want)
