"""The trace replay's lean load generator (:class:`bench.trace_services.RawConn`) reads the
same answers as ``http.client`` (:class:`bench.trace_services.Conn`) from the services it
measures, and from a server that sends chunked bodies or closes its keep-alive connection."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from bench.trace_services import Conn, Floor, RawConn, Server, server_ms


def _both(port: int, method: str, path: str, body: bytes = b"", ctype: str = ""):
    """The same request through ``http.client`` and :class:`RawConn`: ``(status, body,
    Server-Timing present)`` of each."""
    c, raw = Conn(port), RawConn(port)
    try:
        r, data = c.request(method, path, body or None, {"Content-Type": ctype} if ctype else {})
        want = (r.status, data, r.getheader("Server-Timing") is not None)
        st, got, timing = raw.request(method, path, body, ctype)
        return want, (st, got, bool(timing))
    finally:
        c.close()
        raw.close()


@pytest.mark.server
def test_raw_client_reads_what_http_client_reads_from_kv_conductor(tmp_path):
    server = Server(4, str(tmp_path))
    try:
        server.register(0, "tcp://127.0.0.1:1", "e0")
        msgpack = server.body([1, 2, 3])
        cases = [
            ("GET", "/health", b"", ""),
            ("POST", "/query_by_hash", msgpack, "application/msgpack"),
            ("POST", "/query_by_hash", msgpack.replace(b"trace", b"other"), "application/msgpack"),
            (
                "POST",
                "/query_by_hash",
                json.dumps(msgspec.msgpack.decode(msgpack)).encode(),
                "application/json",
            ),
            ("GET", "/query_by_hash", b"", ""),
            ("GET", "/no-such-route", b"", ""),
        ]
        statuses = []
        for case in cases:
            want, got = _both(server.port, *case)
            assert got == want, case
            statuses.append(want[0])
        assert statuses == [200, 200, 404, 200, 405, 404]
        # one connection, many answers: each read where the last one ended
        raw = RawConn(server.port, size=64)  # the buffer grows to the largest answer
        reqs = [raw.prepare(m, p, b, t) for m, p, b, t in cases]
        want = [_both(server.port, *case)[0][:2] for case in cases]
        for _ in range(3):
            assert [raw.send(h + t)[:2] for h, t in reqs] == want
        raw.close()
    finally:
        server.stop()


@pytest.mark.parametrize("size", [64, 1 << 17])
def test_an_answer_read_in_one_recv_or_many(size):
    """The whole answer already waiting (headers far before the end of the first read), then
    two answers in one read: each answer where it is, the second kept for the next read."""
    a, b = socket.socketpair()
    raw = RawConn(0, size=size)
    raw.sock = a
    body = bytes(range(256)) * 80
    one = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nServer-Timing: q;dur=2\r\n\r\n" % len(body)
    b.sendall(one + body)
    assert raw.send(b"GET / HTTP/1.1\r\n\r\n") == (200, body, b"q;dur=2")
    b.sendall(one + body + b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno")
    assert raw.send(b"GET / HTTP/1.1\r\n\r\n") == (200, body, b"q;dur=2")
    assert raw.send(b"GET / HTTP/1.1\r\n\r\n") == (404, b"no", b"")
    raw.close()
    b.close()


def test_server_timing_is_read_as_milliseconds():
    assert server_ms(b"index;dur=0.125, total;dur=3") == 0.125
    assert server_ms(b"") is None and server_ms(b"dur=x") is None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Server-Timing", "app;dur=1.5")
            self.end_headers()
            for part in (body, b"-", body[::-1]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        if self.path == "/close":  # says so; /drop closes without saying
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        if self.path == "/drop":
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def plain_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_port
    srv.shutdown()
    srv.server_close()


def test_raw_client_reads_a_chunked_answer(plain_server):
    want, got = _both(plain_server, "POST", "/chunked", b"abc", "text/plain")
    assert got == want == (200, b"abc-cba", True)
    raw = RawConn(plain_server)
    assert raw.request("POST", "/chunked", b"xy")[::2] == (200, b"app;dur=1.5")
    assert raw.request("POST", "/chunked", b"z" * 5000)[1] == b"z" * 5000 + b"-" + b"z" * 5000
    raw.close()


@pytest.mark.parametrize("path", ["/close", "/drop"])
def test_raw_client_reconnects_once_when_the_server_closed(plain_server, path):
    raw = RawConn(plain_server)
    for k in range(3):
        body = b"q%d" % k
        assert raw.request("POST", path, body) == (201, body, b"")
    raw.close()


@pytest.mark.server
def test_raw_client_reads_what_http_client_reads_from_dynamos_indexer(tmp_path):
    """Dynamo's service (Rust, axum) answers with ``content-length``, never chunked."""
    from bench import trace_dynamo_server as tds

    if not tds.available():
        pytest.skip("ai-dynamo-runtime is not installed")
    svc = tds.DynamoIndexer(2, str(tmp_path), threads=1)
    try:
        ask = ("POST", "/query_by_hash", svc.body([1, 2 << 62]), svc.ctype)
        want, got = _both(svc.port, *ask)
        assert got == want and want[0] == 404  # no engine of the model yet
        svc.register(0, "tcp://127.0.0.1:1")
        want, got = _both(svc.port, *ask)
        assert got == want and want[0] == 200 and "scores" in json.loads(want[1])
        assert _both(svc.port, "GET", "/no-such-route") == ((404, b"", False),) * 2
    finally:
        svc.stop()


@pytest.mark.server
def test_a_floor_twin_gets_as_many_bytes_as_its_size_header():
    """The paired floor's twin: the query's prepared bytes with ``x-floor-size`` spliced in."""
    floor = Floor()
    try:
        raw = RawConn(floor.port)
        head, tail = raw.prepare("POST", "/query_by_hash", b"\x80", "application/msgpack")
        for size in (0, 673, 84918, 5):
            st, body, _ = raw.send(b"%sx-floor-size: %d\r\n%s" % (head, size, tail))
            assert (st, body) == (200, bytes(size))
        raw.close()
    finally:
        floor.stop()
