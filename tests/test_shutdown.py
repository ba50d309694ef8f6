"""Shutdown of the real server with requests in flight: INFO/WARN lines, no tracebacks.

A slow client keeps a request in flight (a body sent a few bytes at a time);
the server gets SIGTERM (and a second signal during the drain). It must exit
0 without an ERROR line or a traceback, within the documented bounds.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time

import pytest

from kvconductor.serve.single import GRACEFUL_SECS as GRACEFUL
from tests.helpers.server import Server

pytestmark = pytest.mark.server


class SlowBody:
    """A request whose body trickles in (a few bytes every 0.2 s) on its own thread."""

    def __init__(self, port: int, path: str, content_type: str = "application/json") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: 1000000\r\n\r\n".encode()
            + b'{"model": "m", "x": "'
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set() and time.monotonic() - t0 < 15:
            try:
                self.sock.sendall(b"aaaa")
            except OSError:
                return
            time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def assert_quiet(log: str) -> None:
    assert "Traceback" not in log, log
    assert not re.search(r"\bERROR\b", log), log
    assert "KV conductor shut down" in log, log


@pytest.mark.parametrize(
    "first,second",
    [
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGINT, signal.SIGINT),
        (signal.SIGTERM, signal.SIGINT),
    ],
)
def test_second_signal_during_drain_exits_quietly(tmp_path, first, second):
    srv = Server(tmp_path, "--host", "127.0.0.1")
    srv.wait_ready()
    slow = [SlowBody(srv.port, "/query"), SlowBody(srv.port, "/register")]
    try:
        time.sleep(0.5)
        srv.http.close()
        t0 = time.monotonic()
        srv.proc.send_signal(first)
        time.sleep(0.5)
        srv.proc.send_signal(second)
        code = srv.proc.wait(GRACEFUL + 5)
        elapsed = time.monotonic() - t0
    finally:
        for s in slow:
            s.close()
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(10)
    log = srv.log()
    assert code == 0, log
    assert elapsed < GRACEFUL, f"the second signal did not cut the drain short: {elapsed:.1f}s"
    assert "received shutdown signal, draining connections..." in log
    assert "second shutdown signal" in log
    assert_quiet(log)


def test_drain_timeout_with_requests_in_flight_is_quiet(tmp_path):
    srv = Server(tmp_path, "--host", "127.0.0.1")
    srv.wait_ready()
    slow = [SlowBody(srv.port, "/query", "application/msgpack"), SlowBody(srv.port, "/events")]
    try:
        time.sleep(0.5)
        code, elapsed = srv.terminate(signal.SIGTERM)
    finally:
        for s in slow:
            s.close()
    log = srv.log()
    assert code == 0, log
    assert GRACEFUL - 0.5 < elapsed < GRACEFUL + 3, elapsed
    assert "closing 2 connection(s) with requests in flight" in log, log
    assert_quiet(log)


def test_request_that_ignores_the_disconnect_is_cancelled_quietly(caplog):
    """In process: an app that never returns is cancelled after the drain, with no ERROR
    record and no traceback (uvicorn logs 'Exception in ASGI application' otherwise)."""
    import asyncio
    import logging

    import uvicorn

    from kvconductor.serve.single import KvServer

    started = threading.Event()

    async def stuck_app(scope, receive, send):
        started.set()
        await asyncio.sleep(60)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    config = uvicorn.Config(
        stuck_app,
        lifespan="off",
        log_config=None,
        loop="asyncio",
        http="h11",
        timeout_graceful_shutdown=0.5,
    )
    server = KvServer(config)
    caplog.set_level(logging.INFO)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    client = None
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client = socket.create_connection(sock.getsockname(), timeout=5)
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert started.wait(5)
        t0 = time.monotonic()
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - t0 < 4
    finally:
        if client is not None:
            client.close()
        sock.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("cancelling 1 request(s) still running" in m for m in messages), messages
    assert any("request cancelled by shutdown" in m for m in messages), messages
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], messages


def test_gunicorn_worker_shutdown_with_request_in_flight_is_quiet(tmp_path):
    import os
    import subprocess

    from tests.helpers.server import ROOT, SHUTDOWN_BOUND, free_port, gunicorn_cmd, wait_health

    port = free_port()
    log_path = tmp_path / "gunicorn.log"
    cmd = gunicorn_cmd(port, "-w", "1", "-k", "kvconductor.app.KvConductorWorker", factory_args="")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    slow = None
    try:
        wait_health(proc, f"http://127.0.0.1:{port}", log_path)
        slow = SlowBody(port, "/register")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(GRACEFUL + SHUTDOWN_BOUND) == 0
    finally:
        if slow is not None:
            slow.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = log_path.read_text()
    assert "closing 1 connection(s) with requests in flight (drain exceeded 3s)" in log, log
    assert_quiet(log)
