"""HTTP resource limits of the real server (``python -m kvconductor``), over raw sockets.

Request-head size (``--max-header-kb``), the deadline for a whole request
(``--request-timeout-secs``), the keep-alive idle timeout (``--keep-alive-secs``)
and the connection cap (``--max-connections``). Loopback only; every loop is
bounded in count and time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers.faults import rss_kb
from tests.helpers.server import ROOT, SHUTDOWN_BOUND, Server, free_port, running, wait_health


def rss_mb(pid: int) -> float:
    return rss_kb(pid) / 1024


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_until_closed(sock: socket.socket, bound: float) -> tuple[bytes, float, bool]:
    """Everything the server sends until it closes: (data, seconds, closed in time)."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < bound:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return data, time.monotonic() - t0, True
        if not chunk:
            return data, time.monotonic() - t0, True
        data += chunk
    return data, time.monotonic() - t0, False


def status_and_json(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def send_until_refused(sock: socket.socket, chunks, bound: float) -> int:
    """Send ``chunks`` until the peer stops taking them; returns bytes sent."""
    sent = 0
    sock.settimeout(bound)
    try:
        for chunk in chunks:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    return sent


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    with running(
        tmp_path_factory.mktemp("limits"),
        "--host",
        "127.0.0.1",
        "--max-body-mb",
        "1",
        "--request-timeout-secs",
        "1",
        "--keep-alive-secs",
        "1",
        "--max-header-kb",
        "16",
    ) as srv:
        yield srv
    assert "Traceback" not in srv.log()


def test_oversized_head_is_431_and_not_buffered(limited):
    """A 2 MB header is refused at the limit (not read to the end), without memory growth."""
    before = rss_mb(limited.proc.pid)
    s = connect(limited.port)
    t0 = time.monotonic()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    filler = b"a" * 65536
    sent = send_until_refused(s, (filler for _ in range(32)), 5.0)  # 2 MiB
    data, _, closed = read_until_closed(s, 5.0)
    elapsed = time.monotonic() - t0
    s.close()
    status, headers, body = status_and_json(data)
    assert status == 431, data[:300]
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert b'"error"' in body and b"16384" in body
    assert closed and elapsed < 5.0
    grown = rss_mb(limited.proc.pid) - before
    assert grown < 5.0, f"RSS grew {grown:.1f} MB after {sent} bytes"
    # A head under the limit still works, and the server is healthy.
    r = httpx.get(f"{limited.url}/health", headers={"X-Pad": "b" * 12000}, timeout=5)
    assert r.status_code == 200 and r.text == "OK"
    assert "request head too large" in limited.log()


def test_oversized_request_line_is_431(limited):
    s = connect(limited.port)
    s.sendall(b"GET /" + b"x" * 40000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    data, _, closed = read_until_closed(s, 5.0)
    s.close()
    assert closed and status_and_json(data)[0] == 431


def test_malformed_request_is_a_json_400(limited):
    """uvicorn's own answer to a request it cannot parse was text/plain."""
    s = connect(limited.port)
    s.sendall(b"GARBAGE\x01 / HTTP/1.1\r\nHost: x\r\n\r\n")
    data, _, closed = read_until_closed(s, 5.0)
    s.close()
    status, headers, body = status_and_json(data)
    assert closed and status == 400, data
    assert headers["content-type"] == "application/json" and b'"error"' in body


def test_connection_sending_nothing_is_closed(limited):
    s = connect(limited.port)
    data, elapsed, closed = read_until_closed(s, 5.0)
    s.close()
    assert closed and data == b"", data
    assert 0.8 < elapsed < 3.0, elapsed


def test_slowloris_head_is_closed(limited):
    """One byte at a time: the deadline counts from the first byte, not the last."""
    s = connect(limited.port)
    t0 = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    closed = False
    data = b""
    for i in range(len(head)):  # bounded: at most ~100 x 0.25 s, but the server closes first
        try:
            s.sendall(head[i : i + 1])
        except OSError:
            closed = True
            break
        time.sleep(0.25)
        if time.monotonic() - t0 > 3.0:
            break
        s.setblocking(False)
        try:
            chunk = s.recv(65536)
            data += chunk
            if not chunk:
                closed = True
                break
        except BlockingIOError:
            pass
        except OSError:
            closed = True
            break
        finally:
            s.setblocking(True)
    if not closed:
        more, _, closed = read_until_closed(s, 3.0)
        data += more
    elapsed = time.monotonic() - t0
    s.close()
    assert closed and elapsed < 3.5, elapsed
    status, _, body = status_and_json(data)
    assert status == 408 and b'"error"' in body


@pytest.mark.parametrize("path", ["/register", "/query"])
def test_body_shorter_than_content_length_is_closed_and_not_applied(limited, path):
    """A lying Content-Length: the (valid JSON) body is never acted on; 408 and close."""
    body = (
        b'{"instance_id":"liar","type":"vLLM","modelname":"m","block_size":4,"dp_rank":0}'
        if path == "/register"
        else b'{"model":"m","block_size":4,"token_ids":[1,2,3,4]}'
    )
    s = connect(limited.port)
    s.sendall(
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: " + str(len(body) + 50).encode() + b"\r\n\r\n" + body
    )
    data, elapsed, closed = read_until_closed(s, 5.0)
    s.close()
    assert closed and 0.8 < elapsed < 3.0, elapsed
    status, _, resp = status_and_json(data)
    assert status == 408 and b'"error"' in resp
    assert httpx.get(f"{limited.url}/workers", timeout=5).json()["workers"] == []


def test_keep_alive_idle_connection_is_closed(limited):
    s = connect(limited.port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while not first.endswith(b"\r\n\r\nOK"):  # the whole answer, head and body
        chunk = s.recv(65536)
        assert chunk, first
        first += chunk
    assert first.startswith(b"HTTP/1.1 200")
    data, elapsed, closed = read_until_closed(s, 5.0)
    s.close()
    assert closed and data == b"" and elapsed < 3.0


def test_slow_but_steady_requests_on_keep_alive_are_served(limited):
    """Each request gets its own deadline: many requests on one connection are fine."""
    with httpx.Client(base_url=limited.url, timeout=5) as http:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:
            assert http.get("/health").status_code == 200
            time.sleep(0.3)


def test_connection_cap_evicts_idle_connections_for_health(tmp_path):
    srv = Server(tmp_path, "--host", "127.0.0.1", "--max-connections", "50")
    socks = []
    try:
        srv.wait_ready()
        for _ in range(60):
            socks.append(connect(srv.port))
        time.sleep(0.3)
        r = httpx.get(f"{srv.url}/health", timeout=5)
        assert r.status_code == 200 and r.text == "OK"
        # The oldest idle sockets were closed to make room; the newest are still open.
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        assert 10 <= closed <= 12, closed
        assert "evicted idle connection" in srv.log()
    finally:
        for s in socks:
            s.close()
        code, _ = srv.terminate()
        assert code == 0, srv.log()


def test_connection_cap_refuses_with_503_when_all_are_busy(tmp_path):
    srv = Server(tmp_path, "--host", "127.0.0.1", "--max-connections", "4")
    busy = []
    try:
        srv.wait_ready()
        for _ in range(4):  # requests in progress (bodies not complete): never evicted
            s = connect(srv.port)
            s.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            busy.append(s)
        time.sleep(0.3)
        s = connect(srv.port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, _, closed = read_until_closed(s, 5.0)
        s.close()
        status, headers, body = status_and_json(data)
        assert status == 503 and closed, data
        assert headers["content-type"] == "application/json" and b'"error"' in body
        for s in busy:
            s.close()
        busy.clear()
        deadline = time.monotonic() + 5
        while True:
            try:
                if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "connection refused" in srv.log()
    finally:
        for s in busy:
            s.close()
        code, _ = srv.terminate()
        assert code == 0, srv.log()


def test_h11_fallback_has_the_same_limits(tmp_path):
    """Without httptools uvicorn uses h11: same 431, deadline and cap."""
    port = free_port()
    log_path = tmp_path / "h11.log"
    code = (
        "import sys, kvconductor.serve.single as s; s._uvicorn_impls = lambda: ('asyncio', 'h11'); "
        "from kvconductor.serve.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--request-timeout-secs",
                "1",
                "--max-header-kb",
                "8",
                "--no-snapshots",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    try:
        wait_health(proc, f"http://127.0.0.1:{port}", log_path)
        _assert_431_on_a_big_header(port)
        s = connect(port)
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        data, elapsed, closed = read_until_closed(s, 5.0)
        s.close()
        assert closed and elapsed < 3.0 and status_and_json(data)[0] == 408
        s = connect(port)
        s.sendall(b"GARBAGE\x01 / HTTP/1.1\r\nHost: x\r\n\r\n")
        data, _, closed = read_until_closed(s, 5.0)
        s.close()
        status, headers, _ = status_and_json(data)
        assert closed and status == 400 and headers["content-type"] == "application/json"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(SHUTDOWN_BOUND) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert "Traceback" not in log_path.read_text()


def _assert_431_on_a_big_header(port: int) -> None:
    """A 64 KiB header against --max-header-kb 8: 431, then the server closes."""
    s = connect(port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    send_until_refused(s, (b"a" * 4096 for _ in range(16)), 5.0)
    data, _, closed = read_until_closed(s, 5.0)
    s.close()
    assert closed and status_and_json(data)[0] == 431, data[:200]


def test_gunicorn_worker_enforces_limits(tmp_path):
    """``-k kvconductor.app.KvConductorWorker`` applies the flags of the factory."""
    from tests.helpers.server import gunicorn_cmd

    port = free_port()
    cmd = gunicorn_cmd(
        port,
        "-w",
        "1",
        "-k",
        "kvconductor.app.KvConductorWorker",
        factory_args='"--request-timeout-secs", "1", "--max-header-kb", "8"',
    )
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    try:
        wait_health(proc, f"http://127.0.0.1:{port}", log_path)
        _assert_431_on_a_big_header(port)
        s = connect(port)
        data, elapsed, closed = read_until_closed(s, 5.0)
        s.close()
        assert closed and data == b"" and elapsed < 3.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SHUTDOWN_BOUND * 2) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text()
    assert "HTTP limits max_header_bytes=8192 request_timeout=1s" in text, text
    assert "does not enforce the HTTP limits" not in text
    assert "Traceback" not in text and "KV conductor shut down" in text


def test_fd_limit_lowers_the_connection_cap(tmp_path):
    """Under a 300-fd limit the cap is lowered so the process keeps fds for itself."""
    import resource

    port = free_port()
    log_path = tmp_path / "fd.log"

    def low_fd_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvconductor",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-snapshots",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=low_fd_limit,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    socks = []
    try:
        wait_health(proc, f"http://127.0.0.1:{port}", log_path)
        for _ in range(320):  # more sockets than the process may open
            socks.append(connect(port))
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert r.status_code == 200
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(SHUTDOWN_BOUND) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = log_path.read_text()
    assert "--max-connections lowered from 1000 to 150" in text, text
    assert "Traceback" not in text and "ERROR" not in text, text
