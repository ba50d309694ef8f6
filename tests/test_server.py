"""The real service in a subprocess (``python -m kvconductor --port N``), over real HTTP.

Clients: httpx with JSON bodies and msgspec-encoded MessagePack bodies.
Teardown sends SIGTERM and fails the test if the process had to be killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from kvconductor._hash import hash_blocks

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent
SHUTDOWN_BOUND = 5.0
STARTUP_BOUND = 30.0


def _has_ipv6() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


HAS_IPV6 = _has_ipv6()


def free_port() -> int:
    """A port free on IPv4 and (when available) IPv6."""
    family, addr = (socket.AF_INET6, ("::", 0)) if HAS_IPV6 else (socket.AF_INET, ("", 0))
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(addr)
        return s.getsockname()[1]


#: Flags that choose the snapshot directory; without one a test's server gets
#: ``--no-snapshots`` (a test's server never writes outside the test's directories).
SNAPSHOT_FLAGS = ("--snapshot-dir", "--no-snapshots")


class Server:
    """One ``python -m kvconductor`` process with its stderr captured in a file.

    Without a snapshot flag in ``args`` it runs with ``--no-snapshots``;
    ``default_snapshots=True`` leaves the default directory in use (then point
    ``XDG_STATE_HOME`` into the test's directory with ``env``)."""

    def __init__(
        self,
        tmp_path: Path,
        *args: str,
        env: dict | None = None,
        preexec_fn=None,
        port: int | None = None,
        default_snapshots: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.log_path = tmp_path / f"kvc-{self.port}.log"
        self._log = open(self.log_path, "wb")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        if not default_snapshots and not any(a in SNAPSHOT_FLAGS for a in args):
            args = (*args, "--no-snapshots")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvconductor", "--port", str(self.port), *args],
            cwd=ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=10.0)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_BOUND
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.log()}")
            try:
                if self.http.get("/health").text == "OK":
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready in {STARTUP_BOUND}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, sig: int = signal.SIGTERM) -> tuple[int, float]:
        """Send ``sig``; returns (exit code, seconds). Kills and fails past the bound."""
        self.http.close()
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(SHUTDOWN_BOUND)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            self._log.close()
            pytest.fail(
                f"server ignored {signal.Signals(sig).name} for {SHUTDOWN_BOUND}s:\n{self.log()}"
            )
        elapsed = time.monotonic() - t0
        self._log.close()
        return code, elapsed


def wait_health(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Wait until ``proc`` (any server command) answers ``GET /health``; fail with its log."""
    deadline = time.monotonic() + STARTUP_BOUND
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=5).text == "OK":
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)


@contextlib.contextmanager
def running(tmp_dir: Path, *args: str, **kw):
    """A started :class:`Server`; on leaving it must stop with exit code 0."""
    srv = Server(tmp_dir, *args, **kw)
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            code, _ = srv.terminate()
            assert code == 0, srv.log()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(
        tmp_path_factory.mktemp("srv"), "--maintenance-interval-secs", "1", "--max-body-mb", "1"
    ) as srv:
        yield srv


def register(http: httpx.Client, **kw) -> httpx.Response:
    body = {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 4,
        "dp_rank": 0,
        **kw,
    }
    return http.post("/register", json=body)


def msgpack_post(http: httpx.Client, path: str, body) -> tuple[int, str, object]:
    r = http.post(
        path, content=msgspec.msgpack.encode(body), headers={"Content-Type": "application/msgpack"}
    )
    return r.status_code, r.headers["content-type"], msgspec.msgpack.decode(r.content)


def test_health_on_dual_stack_default_host(server):
    assert server.http.get("/health").text == "OK"
    if HAS_IPV6:
        r = httpx.get(f"http://[::1]:{server.port}/health", timeout=10)
        assert r.status_code == 200 and r.text == "OK"
    assert (
        f"KV conductor starting on [::]:{server.port}" in server.log()
        or f"KV conductor starting on 0.0.0.0:{server.port}" in server.log()
    )


def test_json_and_msgpack_end_to_end(server):
    http = server.http
    r = register(http, medium_endpoints={"npu": "tcp://127.0.0.1:1"}, store_backend="YuanRong")
    assert r.status_code == 201 and r.json() == {"status": "ok"}
    r = http.post(
        "/events",
        json={
            "instance_id": "vllm-prefill-1",
            "events": [
                {
                    "event_id": 1,
                    "dp_rank": 0,
                    "type": "BlockStored",
                    "block_hashes": [100, 200],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    "block_size": 4,
                    "medium": "GPU",
                },
                {
                    "event_id": 2,
                    "dp_rank": 0,
                    "type": "BlockStored",
                    "block_hashes": [300],
                    "parent_block_hash": 200,
                    "token_ids": [9, 10, 11, 12],
                    "block_size": 4,
                    "medium": "cpu",
                },
            ],
        },
    )
    assert r.status_code == 200 and r.json() == {"status": "ok", "events_applied": 2}
    query = {"model": "qwen", "block_size": 4, "token_ids": list(range(1, 17))}
    r = http.post("/query", json=query)
    expected = {
        "default": {
            "vllm-prefill-1": {
                "longest_matched": 12,
                "DP": {
                    "0": {"matched_tokens": 12, "npu_blocks": 2, "cpu_blocks": 1, "disk_blocks": 0}
                },
            }
        }
    }
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == expected
    code, ct, doc = msgpack_post(http, "/query", query)
    assert (code, ct, doc) == (200, "application/msgpack", expected)
    code, ct, doc = msgpack_post(http, "/query", ["qwen", 4, list(range(1, 17)), "default"])
    assert doc == expected
    hashes = [14643705804678351452, 16777012769546811212]
    code, ct, doc = msgpack_post(
        http, "/query_by_hash", {"model": "qwen", "block_size": 4, "block_hashes": hashes}
    )
    assert code == 200 and doc["default"]["vllm-prefill-1"]["longest_matched"] == 2
    code, ct, doc = msgpack_post(http, "/query", {"model": "x", "block_size": 4, "token_ids": []})
    assert (code, ct, doc) == (
        404,
        "application/msgpack",
        {"error": "no indexer for model=x tenant=default"},
    )
    workers = http.get("/workers").json()
    assert workers["workers"][0]["instance_id"] == "vllm-prefill-1"
    assert workers["indexer"][0]["total_blocks"] == 3
    assert [s["url"] for s in workers["sources"]] == ["tcp://127.0.0.1:1"]
    r = http.post(
        "/unregister",
        json={
            "instance_id": "vllm-prefill-1",
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": 4,
            "dp_rank": 0,
        },
    )
    assert r.status_code == 200
    doc = http.get("/workers").json()
    assert isinstance(doc.pop("recent_warnings"), list)  # other tests of this server warn
    doc.pop("processes", None)  # --workers N (tests/test_cluster.py runs this test too)
    assert doc == {"workers": [], "indexer": [], "sources": []}


def test_large_msgpack_query(server):
    http = server.http
    assert register(http, instance_id="big").status_code == 201
    tokens = list(range(1, 9)) + [7] * 200_000
    r = http.post(
        "/events",
        json={
            "instance_id": "big",
            "events": [
                {
                    "event_id": 1,
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "token_ids": list(range(1, 9)),
                    "block_size": 4,
                }
            ],
        },
    )
    assert r.json()["events_applied"] == 1
    code, _, doc = msgpack_post(
        http, "/query", {"model": "qwen", "block_size": 4, "token_ids": tokens}
    )
    assert code == 200 and doc["default"]["big"]["DP"]["0"]["npu_blocks"] == 2
    http.post(
        "/unregister",
        json={
            "instance_id": "big",
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": 4,
            "dp_rank": 0,
        },
    )


def test_errors_over_http(server):
    http = server.http
    r = http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]
    r = http.put("/register")
    assert r.status_code == 405 and r.json()["error"]
    r = http.post("/register", content=b"{oops", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("invalid JSON request body")
    r = http.post(
        "/query", content=b"\xc1\xff\x00", headers={"Content-Type": "application/msgpack"}
    )
    assert r.status_code == 400 and r.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(r.content)["error"].startswith("invalid msgpack request body")
    r = http.post("/events", json={"instance_id": "x", "events": [{"event_id": 1, "type": "?"}]})
    assert r.status_code == 400
    assert http.get("/health").text == "OK"


def test_body_limit_over_http(server):
    http = server.http
    big = b"[" + b"1," * 600_000 + b"1]"  # > 1 MiB
    r = http.post("/query", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    r = http.post("/events", content=chunks())  # chunked: no Content-Length
    assert r.status_code == 413 and r.json()["error"]
    assert http.get("/health").text == "OK"


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


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvconductor", *args],
        cwd=ROOT,
        timeout=60,
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
    )


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


def _gunicorn_cmd(
    port: int,
    *extra: str,
    factory_args: str = '"--maintenance-interval-secs", "1"',
    no_snapshots: bool = True,
):
    """gunicorn serving the factory on 127.0.0.1:``port``; ``--no-snapshots`` among the
    factory's flags unless ``no_snapshots=False`` (the test then chooses the directory)."""
    pytest.importorskip("uvicorn_worker")
    if no_snapshots:
        factory_args = ", ".join(a for a in (factory_args, '"--no-snapshots"') if a)
    help_text = subprocess.run(
        [sys.executable, "-m", "gunicorn", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    cmd = [
        sys.executable,
        "-m",
        "gunicorn",
        "-k",
        "uvicorn_worker.UvicornWorker",
        "-b",
        f"127.0.0.1:{port}",
        *extra,
    ]
    if "--no-control-socket" in help_text:
        cmd.append("--no-control-socket")
    cmd.append(f"kvconductor.app:gunicorn_app({factory_args})")
    return cmd


def test_gunicorn_factory(tmp_path):
    port = free_port()
    cmd = _gunicorn_cmd(port, "-w", "1", no_snapshots=False)
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
            "switch_interval=0.0005"
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
    cmd = _gunicorn_cmd(
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
        _gunicorn_cmd(port, *extra, factory_args=""),
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
    from kvconductor.serve.worker import WorkerServer
    from kvconductor.state.conductor import TRIM_SECS

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


def _topk_fixture(http: httpx.Client) -> tuple[list[int], dict]:
    """Six (instance, DP) groups of model ``topk`` holding 1..5 blocks of one prompt:
    a/0 5, a/1 2, b/0 4, c/0 4, d/0 1, e/0 3 blocks (HBM); returns the prompt and the
    full V3 answer (block_size 4)."""
    tokens = list(range(1, 25))  # 6 blocks of 4
    held = {("a", 0): 5, ("a", 1): 2, ("b", 0): 4, ("c", 0): 4, ("d", 0): 1, ("e", 0): 3}
    for n, ((iid, dp), blocks) in enumerate(held.items()):
        r = register(http, instance_id=iid, dp_rank=dp, modelname="topk")
        assert r.status_code == 201, r.text
        ev = {
            "event_id": 1,
            "dp_rank": dp,
            "type": "BlockStored",
            "block_hashes": [1000 * (n + 1) + b for b in range(blocks)],
            "token_ids": tokens[: 4 * blocks],
            "block_size": 4,
        }
        r = http.post("/events", json={"instance_id": iid, "events": [ev]})
        assert r.json() == {"status": "ok", "events_applied": 1}, r.text
    full: dict = {}
    for (iid, dp), blocks in held.items():
        inst = full.setdefault(iid, {"longest_matched": 0, "DP": {}})
        inst["DP"][str(dp)] = {
            "matched_tokens": 4 * blocks,
            "npu_blocks": blocks,
            "cpu_blocks": 0,
            "disk_blocks": 0,
        }
        inst["longest_matched"] = max(inst["longest_matched"], 4 * blocks)
    return tokens, full


def _cut(full: dict, keep: set) -> dict:
    out = {}
    for iid, inst in full.items():
        dps = {dp: v for dp, v in inst["DP"].items() if (iid, int(dp)) in keep}
        if dps:
            best = max(v["matched_tokens"] for v in dps.values())
            out[iid] = {"longest_matched": best, "DP": dps}
    return out


def test_top_k_and_instances_over_http(server):
    http = server.http
    tokens, full = _topk_fixture(http)
    try:
        q = {"model": "topk", "block_size": 4, "token_ids": tokens}
        # without the extension: exactly the V3 answer, every (instance, DP)
        assert http.post("/query", json=q).json() == {"default": full}
        full_keys = {("a", 0), ("a", 1), ("b", 0), ("c", 0), ("d", 0), ("e", 0)}
        # top_k=1: a/0 (5 blocks); top_k=2: b/0 and c/0 tie at the 2nd depth (4 blocks)
        cases = [
            ({"top_k": 1}, {("a", 0)}),
            ({"top_k": 2}, {("a", 0), ("b", 0), ("c", 0)}),
            ({"top_k": 3}, {("a", 0), ("b", 0), ("c", 0)}),
            ({"top_k": 100}, full_keys),
            ({"instances": ["a", "d", "nobody"]}, {("a", 0), ("a", 1), ("d", 0)}),
            ({"instances": ["d", "e"], "top_k": 1}, {("e", 0)}),
            ({"instances": []}, set()),
            ({"top_k": None, "instances": None}, full_keys),
        ]
        for extra, keep in cases:
            want = {"default": _cut(full, keep)}
            r = http.post("/query", json={**q, **extra})
            assert r.status_code == 200 and r.json() == want, extra
            code, ct, doc = msgpack_post(http, "/query", {**q, **extra})
            assert (code, ct, doc) == (200, "application/msgpack", want), extra
            # the positional form: top_k and instances are the 6th and 7th elements
            row = ["topk", 4, tokens, None, None, extra.get("top_k"), extra.get("instances")]
            assert msgpack_post(http, "/query", row)[2] == want, extra
            # /query_by_hash: the same rows, counts in blocks
            hq = {"model": "topk", "block_hashes": list(hash_blocks(tokens, 4)), **extra}
            code, _, doc = msgpack_post(http, "/query_by_hash", hq)
            assert code == 200
            assert {i: v["longest_matched"] for i, v in doc["default"].items()} == {
                i: v["longest_matched"] // 4 for i, v in want["default"].items()
            }
        # bad values: 400 with {"error": ...} in the request's encoding
        for extra, detail in (
            ({"top_k": 0}, "top_k must be between 1 and 4294967295"),
            ({"top_k": -3}, "top_k must be between 1 and 4294967295"),
            ({"top_k": "2"}, "invalid type for `top_k`: expected an integer or null"),
            (
                {"instances": "a"},
                "invalid type for `instances`: expected an array of strings or null",
            ),
        ):
            r = http.post("/query", json={**q, **extra})
            assert r.status_code == 400
            assert r.json() == {"error": f"invalid JSON request body: {detail}"}
            code, ct, doc = msgpack_post(http, "/query_by_hash", {**hq, **extra})
            assert (code, ct) == (400, "application/msgpack")
            assert doc == {
                "error": "invalid msgpack request body: " + detail.replace("null", "nil")
            }
        assert http.get("/health").text == "OK"  # still serving
    finally:
        for iid, dp in (("a", 0), ("a", 1), ("b", 0), ("c", 0), ("d", 0), ("e", 0)):
            body = {"instance_id": iid, "type": "vLLM", "modelname": "topk", "block_size": 4}
            http.post("/unregister", json={**body, "dp_rank": dp})
