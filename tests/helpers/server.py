"""The real service in a subprocess, as the tests start it: ``python -m kvconductor``
(:class:`Server`, :func:`running`, :func:`run_cli`), under gunicorn (:func:`gunicorn_cmd`),
over TLS (:func:`tls_server`), with ``--workers`` (:func:`wait_workers`) and as replicas on
Valkey (:func:`start_replicas`); and what the tests ask of it over HTTP
(:func:`register_engine`, :func:`dp_entry`, :func:`metric`) or raw over a socket
(:func:`exchange`).

A server started here never writes outside the test's directory: without a snapshot flag
it runs with ``--no-snapshots``. Teardown sends SIGTERM and fails the test if the process
had to be killed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


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


#: The ports :func:`free_port` gave out last: the kernel may hand a port just closed out
#: again, and a test that asks for two ports (``--port`` and ``--dynamo-port``) before its
#: server binds either must not get the same one twice.
_GIVEN: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A port free on IPv4 and (when available) IPv6, none of the last 256 given out."""
    family, addr = (socket.AF_INET6, ("::", 0)) if HAS_IPV6 else (socket.AF_INET, ("", 0))
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(addr)
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.append(port)
            return port


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

    def kill(self) -> None:
        """SIGKILL (no shutdown, no final snapshot), wait for it and release the files."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.http.close()
        self._log.close()

    def exit_code(self, bound: float = STARTUP_BOUND) -> int:
        """The exit code of a server that must exit by itself within ``bound`` seconds (one
        refusing to start); past it, killed and failed with its log. Releases the files."""
        try:
            return self.proc.wait(bound)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server did not exit in {bound}s:\n{self.log()}") from None
        finally:
            self.http.close()
            self._log.close()


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
def started(tmp_dir: Path, *args: str, **kw):
    """A started :class:`Server`, stopped with SIGTERM on leaving (its exit code is not
    checked: :func:`running` checks it)."""
    srv = Server(tmp_dir, *args, **kw)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


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


@contextlib.contextmanager
def dialect_server(tmp_dir: Path, flag: str, *args: str):
    """A :func:`running` server with a dialect's port (``flag``: ``--mooncake-port``,
    ``--dynamo-port``) and an ``httpx.Client`` of that port, as ``(server, client)``.
    Registered endpoints that never connect stay live (blocks come over ``POST
    /events``): no source goes down or is purged however slowly the test runs."""
    port = free_port()
    keep = ("--source-down-secs", "86400", "--source-purge-secs", "0")
    url = f"http://127.0.0.1:{port}"
    with (
        running(tmp_dir, flag, str(port), *keep, *args) as srv,
        httpx.Client(base_url=url, timeout=10.0) as client,
    ):
        yield srv, client


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvconductor", *args],
        cwd=ROOT,
        timeout=60,
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
    )


def gunicorn_cmd(
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


def registration(instance_id: str = "vllm-prefill-1", **fields) -> dict:
    """A V3 registration body of DP 0 of a vLLM engine of model qwen (block size 4);
    ``fields`` are added (or replace these)."""
    return {
        "instance_id": instance_id,
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 4,
        "dp_rank": 0,
        **fields,
    }


def register_engine(server, instance_id: str, dp_rank: int = 0, **fields) -> None:
    """POST /register of one DP of a vLLM engine of model qwen (block size 4); 201."""
    r = server.http.post("/register", json=registration(instance_id, dp_rank=dp_rank, **fields))
    assert r.status_code == 201, r.text


def dp_entry(resp, instance, dp=0):
    return resp.get("default", {}).get(instance, {}).get("DP", {}).get(str(dp))


def tls_server(tmp_path, pki, *extra: str) -> Server:
    """A :class:`Server` on 127.0.0.1 over TLS with the ``pki`` fixture's certificate (not
    waited for); its ``http`` client trusts the ``pki`` CA."""
    srv = Server(
        tmp_path, "--host", "127.0.0.1", "--tls-cert", pki["cert"], "--tls-key", pki["key"], *extra
    )
    srv.url = f"https://127.0.0.1:{srv.port}"
    srv.http.close()
    srv.http = httpx.Client(base_url=srv.url, timeout=10.0, verify=trusting(pki))
    return srv


def trusting(pki, client: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"])
    if client:
        ctx.load_cert_chain(client)
    return ctx


def exchange(port: int, request: bytes, bound: float = 5.0) -> bytes:
    """Send ``request`` raw on a new connection to 127.0.0.1:``port``; what arrives until
    one whole answer (head and its Content-Length) is in, or the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=bound) as s:
        s.sendall(request)
        data = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound:
            if b"\r\n\r\n" in data:
                head, _, body = data.partition(b"\r\n\r\n")
                m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if m and len(body) >= int(m.group(1)):
                    return data
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
        return data


# -- --workers N: the owner and its worker processes

READY = re.compile(r"\] (worker-\d+) pid=(\d+) ready")
WORKER_BOUND = 15.0


def ready_workers(srv: Server) -> dict[str, int]:
    """The latest ready pid of each worker, from the owner's log lines."""
    return {name: int(pid) for name, pid in READY.findall(srv.log())}


def wait_workers(srv: Server, n: int, exclude: set[int] = frozenset()) -> dict[str, int]:
    deadline = time.monotonic() + WORKER_BOUND
    while True:
        found = ready_workers(srv)
        if len(found) == n and not exclude & set(found.values()):
            return found
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """``pid`` has exited (a zombie not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def workers(srv: Server) -> dict:
    """``GET /workers`` of ``srv`` (200)."""
    r = srv.http.get("/workers")
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str) -> float:
    """Sum of the samples called ``name`` (any labels) in a text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- replicas on Valkey (--state-url)

LEASE = "1"


def replica(tmp_path, valkey, name: str, *args: str):
    """:func:`running` replica ``name`` of ``valkey`` (lease ``LEASE``), ``args`` added."""
    return running(
        tmp_path, "--state-url", valkey.url, "--replica-id", name, "--lease-secs", LEASE, *args
    )


def start_replicas(tmp_path, valkey, names, lease: str = LEASE) -> list[Server]:
    """Replicas ``names`` of ``valkey``, started one after the other (each ready)."""
    servers: list[Server] = []
    try:
        for name in names:
            s = Server(
                tmp_path, "--state-url", valkey.url, "--replica-id", name, "--lease-secs", lease
            )
            servers.append(s)
            s.wait_ready()
    except BaseException:
        stop_replicas(servers)
        raise
    return servers


def stop_replicas(servers: list[Server]) -> None:
    """SIGTERM every replica still running and close its client and log."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(20)
        s.http.close()
        s._log.close()
