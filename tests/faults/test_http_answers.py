"""What the real server writes on the wire, one process against ``--workers 2``, over raw
sockets: the query routes' headers (``Date``, RFC 9110), refusals from a request's head
(413 and 401 before the body, not 408 after the request timeout) and a complete request
followed in the same packet by bytes that do not parse (answered, then 400). Loopback
only; every wait is bounded.
"""

from __future__ import annotations

import email.utils
import re
import socket
import time

import httpx

from tests.helpers.publishers import wait_until
from tests.helpers.server import exchange, register_engine, running, wait_workers

BS = 4
QUERY = b'{"model":"qwen","block_size":4,"token_ids":[1,2,3,4,5,6,7,8]}'
IMF_FIXDATE = re.compile(r"^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT$")


def _post(target: bytes, body: bytes, *headers: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % target
    head += b"".join(h + b"\r\n" for h in headers)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


#: Query-route requests answered by the front door, the direct path and the ASGI path.
QUERY_REQUESTS = {
    "direct 200": _post(b"/query", QUERY),
    "direct freshness 200": _post(b"/query?freshness=true", QUERY),
    "ASGI 200 (another query string)": _post(b"/query?x=1", QUERY),
    "ASGI 400 by hash (chunked)": (
        b"POST /query_by_hash HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    ),
    "direct 400": _post(b"/query", b"{"),
    "404 unknown model": _post(b"/query", b'{"model":"nope","block_size":4,"token_ids":[1]}'),
    "413 from the head": b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
}


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(head[0].split()[1]), headers


def _fill(srv) -> None:
    register_engine(
        srv,
        "vllm-prefill-1",
        block_size=BS,
        store_backend="YuanRong",
        medium_endpoints={"npu": "tcp://127.0.0.1:1"},
    )
    event = {
        "event_id": 1,
        "dp_rank": 0,
        "type": "BlockStored",
        "block_hashes": [100, 200],
        "parent_block_hash": None,
        "token_ids": list(range(1, 9)),
        "block_size": BS,
    }
    r = srv.http.post("/events", json={"instance_id": "vllm-prefill-1", "events": [event]})
    assert r.status_code == 200, r.text

    def visible() -> bool:
        r = httpx.post(f"{srv.url}/query", content=QUERY, timeout=5)
        return r.status_code == 200 and "vllm-prefill-1" in r.json()["default"]

    wait_until(visible, timeout=10, msg="blocks visible to the query routes")


def _check_date(value: str | None) -> None:
    assert value is not None and IMF_FIXDATE.match(value), value
    sent = email.utils.parsedate_to_datetime(value).timestamp()
    assert abs(sent - time.time()) < 5


def test_worker_query_answers_carry_the_same_headers_as_one_process_date_included(tmp_path):
    with (
        running(tmp_path, "--host", "127.0.0.1") as one,
        running(tmp_path, "--host", "127.0.0.1", "--workers", "2") as many,
    ):
        wait_workers(many, 2)
        for srv in (one, many):
            _fill(srv)
        for name, request in QUERY_REQUESTS.items():
            # a few times: each worker may take the connection
            for _ in range(4):
                s1, h1 = _head(exchange(one.port, request))
                s2, h2 = _head(exchange(many.port, request))
                assert s1 == s2, name
                assert sorted(h1) == sorted(h2), (name, h1, h2)
                _check_date(h1.get("date"))
                _check_date(h2.get("date"))
        assert [_head(exchange(one.port, r))[0] for r in QUERY_REQUESTS.values()] == [
            200,
            200,
            200,
            400,
            400,
            404,
            413,
        ]
        # a refusal written by the protocol (431: the head over --max-header-kb) too
        big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
        for srv in (one, many):
            status, headers = _head(exchange(srv.port, big))
            assert status == 431
            _check_date(headers.get("date"))


# -- refusals from the head (413, 401, 403) do not wait for the body ---------------------------

KEY = "k"
LIMIT = 1024 * 1024  # --max-body-mb 1
TIMEOUT = 6  # --request-timeout-secs: the 408 these answers used to wait for

#: (name, request head without its body, status answered from the head)
FROM_THE_HEAD = [
    ("no token, body to come", b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 100", 401),
    (
        "wrong token, chunked body to come",
        b"POST /unregister HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
        b"Transfer-Encoding: chunked",
        401,
    ),
    (
        "wrong token, Content-Length over the limit",
        b"POST /events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
        b"Content-Length: 999999999",
        401,
    ),
    (
        "token, Content-Length over the limit",
        b"POST /events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Length: %d"
        % (LIMIT + 1),
        413,
    ),
    (
        "token, Content-Length over the limit, /explain",
        b"POST /explain HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        b"Content-Length: 999999999",
        413,
    ),
    (
        "an origin not allowed",
        b"POST /register HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.test\r\n"
        b"Authorization: Bearer k\r\nContent-Length: 100",
        403,
    ),
    ("no such route", b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 100", 404),
]


def _slow_exchange(port: int, pieces: list[bytes], pause: float, bound: float = 10.0):
    """Send ``pieces`` ``pause`` seconds apart on one connection, keep-alive; the answer
    and the seconds it took from the first piece."""
    s = socket.create_connection(("127.0.0.1", port), timeout=bound)
    t0 = time.monotonic()
    for i, piece in enumerate(pieces):
        if i:
            time.sleep(pause)
        s.sendall(piece)
    return s, t0


def _read_answer(s: socket.socket, t0: float, bound: float = 10.0) -> tuple[bytes, float]:
    data = b""
    s.settimeout(0.1)
    while time.monotonic() - t0 < bound:
        if b"\r\n\r\n" in data:
            head, _, body = data.partition(b"\r\n\r\n")
            m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            if m and len(body) >= int(m.group(1)):
                break
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def _refusals_from_the_head(srv) -> None:
    for name, head, status in FROM_THE_HEAD:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        with s:
            t0 = time.monotonic()
            s.sendall(head + b"\r\n\r\n")  # and no body: the client waits for an answer
            raw, secs = _read_answer(s, t0)
        got, headers = _head(raw)
        assert got == status, (name, raw[:300])
        assert secs < 2.0, (name, secs)  # not the request timeout's 408 (6 s)
        assert headers["content-type"] == "application/json", name
        assert b'{"error":' in raw.partition(b"\r\n\r\n")[2], name
        assert headers.get("connection") == "close", name  # the body is never read
        if status == 401:
            assert headers["www-authenticate"] == 'Bearer realm="kv-conductor"'
    # what arrives whole (or late but complete) is served as before, keep-alive
    reg = (
        b'{"instance_id":"late-1","type":"vLLM","modelname":"qwen","block_size":4,'
        b'"dp_rank":0,"store_backend":"YuanRong","medium_endpoints":{"npu":"tcp://127.0.0.1:1"}}'
    )
    head = (
        b"POST /register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(reg)
    )
    s, t0 = _slow_exchange(srv.port, [head, reg[:20], reg[20:]], 0.3)
    with s:
        raw, _ = _read_answer(s, t0)
        status, headers = _head(raw)
        assert status == 201, raw
        assert headers.get("connection") != "close"
        chunked = (
            b"POST /unregister HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        body = (
            b'{"instance_id":"late-1","type":"vLLM","modelname":"qwen","block_size":4,"dp_rank":0}'
        )
        s.sendall(chunked)
        time.sleep(0.3)
        s.sendall(b"%x\r\n%s\r\n" % (10, body[:10]))
        time.sleep(0.3)
        s.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 10, body[10:]))
        raw, _ = _read_answer(s, time.monotonic())
        assert _head(raw)[0] == 200, raw
    # a chunked body past the limit, arriving slowly: 413 as soon as it passes
    big = (
        b"POST /events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"%x\r\n%s\r\n" % (600_000, b" " * 600_000)
    s, t0 = _slow_exchange(srv.port, [big, piece, piece], 0.3)
    with s:
        raw, secs = _read_answer(s, t0)
    assert _head(raw)[0] == 413 and secs < 3.0, raw[:300]
    r = srv.http.get("/workers", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and "late-1" not in r.text


def test_refusals_come_from_the_head_without_waiting_for_the_body_one_process(tmp_path):
    flags = ("--api-key", KEY, "--max-body-mb", "1", "--request-timeout-secs", str(TIMEOUT))
    with running(tmp_path, "--host", "127.0.0.1", *flags) as srv:
        _refusals_from_the_head(srv)


def test_refusals_come_from_the_head_without_waiting_for_the_body_workers(tmp_path):
    flags = ("--api-key", KEY, "--max-body-mb", "1", "--request-timeout-secs", str(TIMEOUT))
    with running(tmp_path, "--host", "127.0.0.1", "--workers", "2", *flags) as srv:
        wait_workers(srv, 2)
        _refusals_from_the_head(srv)


# -- a complete request followed in the same packet by bytes that do not parse ----------------

GARBAGE = b"\x01\x02 not http \xff\r\n\r\n"
REG = (
    b'{"instance_id":"piped-1","type":"vLLM","modelname":"qwen","block_size":4,'
    b'"dp_rank":0,"store_backend":"YuanRong","medium_endpoints":{"npu":"tcp://127.0.0.1:1"}}'
)
#: (name, complete requests, the statuses of their answers), each sent with GARBAGE
#: after it in one packet: every complete request is answered, in order, then 400.
PIPELINED = [
    (
        "direct path: a query",
        [_post(b"/query", b'{"model":"m","block_size":4,"token_ids":[1]}')],
        [404],
    ),
    ("ASGI path: a query with another query string", [_post(b"/query?x=1", QUERY)], [404]),
    ("ASGI path: GET /health", [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"], [200]),
    ("ASGI path: a registration", [_post(b"/register", REG)], [201]),
    ("ASGI path: two requests", [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"] * 2, [200, 200]),
]


def _everything(port: int, data: bytes, bound: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data`` in one packet; all the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=bound) as s:
        s.sendall(data)
        out = b""
        s.settimeout(0.1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return out, True
            if not chunk:
                return out, True
            out += chunk
        return out, False


def _pipelined_then_garbage(srv) -> None:
    for name, requests, statuses in PIPELINED:
        raw, closed = _everything(srv.port, b"".join(requests) + GARBAGE)
        got = [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]
        assert got == [*statuses, 400], (name, raw)
        assert closed, name
        last = raw[raw.rindex(b"HTTP/1.1 400") :]
        assert b"connection: close" in last, name
        assert last.endswith(b'{"error":"invalid HTTP request: Invalid HTTP request received."}')
    r = srv.http.get("/workers")
    assert [w["instance_id"] for w in r.json()["workers"]] == ["piped-1"]  # acted on


def test_a_complete_request_before_bytes_that_do_not_parse_is_answered_then_400(tmp_path):
    with (
        running(tmp_path, "--host", "127.0.0.1") as one,
        running(tmp_path, "--host", "127.0.0.1", "--workers", "2") as many,
    ):
        wait_workers(many, 2)
        _pipelined_then_garbage(one)
        _pipelined_then_garbage(many)
        assert "Invalid HTTP request received." in one.log()
