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
from tests.helpers.server import running, wait_workers

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


def _exchange(port: int, request: bytes, bound: float = 5.0) -> bytes:
    """Send ``request``; what arrives until one whole answer (head and its
    Content-Length) is in, or the server closes."""
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


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(head[0].split()[1]), headers


def _fill(srv) -> None:
    r = srv.http.post(
        "/register",
        json={
            "instance_id": "vllm-prefill-1",
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": BS,
            "dp_rank": 0,
            "store_backend": "YuanRong",
            "medium_endpoints": {"npu": "tcp://127.0.0.1:1"},
        },
    )
    assert r.status_code == 201, r.text
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
                s1, h1 = _head(_exchange(one.port, request))
                s2, h2 = _head(_exchange(many.port, request))
                assert s1 == s2, name
                assert sorted(h1) == sorted(h2), (name, h1, h2)
                _check_date(h1.get("date"))
                _check_date(h2.get("date"))
        assert [_head(_exchange(one.port, r))[0] for r in QUERY_REQUESTS.values()] == [
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
            status, headers = _head(_exchange(srv.port, big))
            assert status == 431
            _check_date(headers.get("date"))
