"""Every door to ``/query`` answers every request alike (kvconductor.http.querydoor,
kvconductor.http.framing).

One shared list of requests (:data:`CASES`) goes, raw over a socket, through each door
of a real server: the protocol (``--query-path protocol``, the default), ASGI
(``--query-path asgi``) and a worker of ``--workers 2`` (over the owner's index in shared
memory). Status line, headers (names, values and order) and body must be the same bytes
from all three, but for the values of ``Date`` and ``Server-Timing`` (a clock and a
duration); so must the query metrics each server counted. One server per door for the
module, loaded the same way; every wait is bounded.
"""

from __future__ import annotations

import re

import msgspec
import pytest

from kvconductor._hash import hash_blocks
from tests.helpers.api import stored
from tests.helpers.publishers import wait_until
from tests.helpers.server import Server, exchange, metric, registration, wait_workers

KEY = "k"
LIMIT = 1024 * 1024  # --max-body-mb 1
TOKENS = list(range(1, 17))  # 4 blocks of 4
DOORS = {
    "protocol": ("--query-path", "protocol"),
    "asgi": ("--query-path", "asgi"),
    "worker": ("--workers", "2"),
}


def _post(
    target: bytes,
    body: bytes,
    ctype: bytes = b"application/json",
    *headers: bytes,
    length: int | None = None,
) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n" % (target, ctype)
    head += b"".join(h + b"\r\n" for h in headers)
    n = len(body) if length is None else length
    return head + b"Content-Length: %d\r\n\r\n" % n + body


def _json(doc: dict) -> bytes:
    return msgspec.json.encode(doc)


def _msgpack(doc: dict) -> bytes:
    return msgspec.msgpack.encode(doc)


def _chunked(target: bytes, body: bytes, pieces: int = 2) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % target
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    step = max(1, -(-len(body) // pieces))
    out = [head]
    for i in range(0, len(body), step):
        part = body[i : i + step]
        out.append(b"%x\r\n%s\r\n" % (len(part), part))
    return b"".join(out) + b"0\r\n\r\n"


#: (instance, token ids stored, their engine hashes): two engines, one a prefix of the other.
ENGINES = (("e1", TOKENS, [11, 12, 13, 14]), ("e2", TOKENS[:8], [21, 22]))
Q = {"model": "qwen", "block_size": 4, "token_ids": TOKENS}
BY_HASH = {"model": "qwen", "block_hashes": list(hash_blocks(TOKENS, 4))}
MSGPACK = b"application/msgpack"

#: (name, raw request): every request goes through every door.
CASES = [
    ("JSON, full hit", _post(b"/query", _json(Q))),
    ("MessagePack, full hit", _post(b"/query", _msgpack(Q), MSGPACK)),
    ("by hash, JSON", _post(b"/query_by_hash", _json(BY_HASH))),
    ("by hash, MessagePack", _post(b"/query_by_hash", _msgpack(BY_HASH), MSGPACK)),
    ("top_k 1", _post(b"/query", _json({**Q, "top_k": 1}))),
    ("a miss", _post(b"/query", _json({**Q, "token_ids": [99, 98, 97, 96]}))),
    ("unknown model 404", _post(b"/query", _json({**Q, "model": "nope"}))),
    ("unknown model 404, MessagePack", _post(b"/query", _msgpack({**Q, "model": "nope"}), MSGPACK)),
    ("bad body 400", _post(b"/query", b"{")),
    ("bad body 400, MessagePack", _post(b"/query", _msgpack({"block_size": 4}), MSGPACK)),
    ("bad body 400, by hash", _post(b"/query_by_hash", _json({"model": "qwen"}))),
    ("empty body 400", _post(b"/query", b"")),
    ("warning header: block size not registered", _post(b"/query", _json({**Q, "block_size": 16}))),
    ("warning header: unknown LoRA", _post(b"/query", _json({**Q, "lora_name": "ad"}))),
    ("freshness parameter", _post(b"/query?freshness=true", _json(Q))),
    ("freshness parameter off", _post(b"/query?freshness=0", _json(Q))),
    ("freshness parameter, bad value 400", _post(b"/query?freshness=maybe", _json(Q))),
    ("another query string", _post(b"/query?x=1", _json(Q))),
    ("CORS origin", _post(b"/query", _json(Q), b"application/json", b"Origin: http://ui.test")),
    (
        "CORS origin, top_k and a warning",
        _post(
            b"/query",
            _json({**Q, "top_k": 1, "block_size": 16}),
            b"application/json",
            b"Origin: http://ui.test",
        ),
    ),
    (
        "CORS origin on a 404",
        _post(b"/query", _json({**Q, "model": "nope"}), b"application/json", b"Origin: http://a"),
    ),
    ("Connection: close", _post(b"/query", _json(Q), b"application/json", b"Connection: close")),
    ("a body in chunks", _chunked(b"/query", _json(Q))),
    ("a body in chunks, 400", _chunked(b"/query_by_hash", b"{}")),
    ("oversized 413 from the head", _post(b"/query", b"", length=LIMIT + 1)),
    (
        "oversized 413, MessagePack, CORS",
        _post(b"/query", b"", MSGPACK, b"Origin: http://ui.test", length=10 * LIMIT),
    ),
    ("oversized 413, in chunks", _chunked(b"/query", b" " * (LIMIT + 10), pieces=3)),
    (
        "a large body, off the event loop",
        _post(b"/query", _json({**Q, "token_ids": TOKENS * 20_000})),
    ),
    (
        "wrong token 401 (the rest of the routes)",
        _post(
            b"/register", _json(registration("x")), b"application/json", b"Authorization: Bearer no"
        ),
    ),
    ("GET on a query route 405", b"GET /query HTTP/1.1\r\nHost: x\r\n\r\n"),
    (
        "CORS preflight",
        b"OPTIONS /query HTTP/1.1\r\nHost: x\r\nOrigin: http://ui.test\r\n"
        b"Access-Control-Request-Method: POST\r\n\r\n",
    ),
    ("HTTP/1.0", _post(b"/query", _json(Q)).replace(b"HTTP/1.1", b"HTTP/1.0", 1)),
]

#: The values that differ between two answers to one request: a clock and a duration.
_VARYING = re.compile(rb"^(date: |server-timing: app;dur=).*$", re.I | re.M)


def normalized(raw: bytes) -> bytes:
    head, sep, body = raw.partition(b"\r\n\r\n")
    return _VARYING.sub(rb"\1X", head) + sep + body


def _load(srv: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for instance, tokens, hashes in ENGINES:
        r = srv.http.post("/register", json=registration(instance), headers=auth)
        assert r.status_code == 201, r.text
        body = {"instance_id": instance, "events": [stored(1, hashes, tokens)]}
        r = srv.http.post("/events", json=body, headers=auth)
        assert r.status_code == 200, r.text

    def visible() -> bool:
        r = srv.http.post("/query", json=Q)
        return r.status_code == 200 and len(r.json().get("default", {})) == 2

    wait_until(visible, timeout=10, msg="blocks visible to the query routes")


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """One loaded server per door (started together, to start faster)."""
    tmp = tmp_path_factory.mktemp("doors")
    common = ("--host", "127.0.0.1", "--api-key", KEY, "--max-body-mb", "1")
    servers = {name: Server(tmp, *common, *flags) for name, flags in DOORS.items()}
    try:
        for srv in servers.values():
            srv.wait_ready()
        wait_workers(servers["worker"], 2)
        for srv in servers.values():
            _load(srv)
        yield servers
    finally:
        for name, srv in servers.items():
            if srv.proc.poll() is None:
                code, _ = srv.terminate()
                assert code == 0, (name, srv.log())


def _query_counts(srv: Server) -> tuple[float, ...]:
    r = srv.http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    names = ("kvconductor_query_seconds_count", "kvconductor_query_errors_total")
    return tuple(metric(r.text, name) for name in names)


@pytest.mark.parametrize(("name", "request_"), CASES, ids=[c[0] for c in CASES])
def test_every_door_answers_alike(doors, name, request_):
    answers = {door: normalized(exchange(srv.port, request_)) for door, srv in doors.items()}
    first = answers["protocol"]
    assert first.startswith(b"HTTP/1.1 "), first[:200]
    for door, answer in answers.items():
        assert answer == first, (door, answer[:600], first[:600])
    # a worker's two processes: either may take the connection
    worker = doors["worker"]
    for _ in range(3):
        assert normalized(exchange(worker.port, request_)) == first


def test_a_web_page_may_read_the_query_headers(doors):
    """A cross-origin query answer names its own headers (the warning and the rows left
    out at the top_k cut) in Access-Control-Expose-Headers, else a browser hides them;
    an answer to a request without Origin has no CORS header at all."""
    raw = dict(CASES)["CORS origin, top_k and a warning"]
    head = exchange(doors["protocol"].port, raw).partition(b"\r\n\r\n")[0].decode().lower() + "\r\n"
    assert "access-control-allow-origin: *\r\n" in head, head
    assert (
        "access-control-expose-headers: x-kv-conductor-warning, x-kv-conductor-top-k-omitted\r\n"
        in head
    ), head
    assert "x-kv-conductor-top-k-omitted: 0\r\n" in head and "x-kv-conductor-warning: " in head
    plain = exchange(doors["protocol"].port, dict(CASES)["top_k 1"]).partition(b"\r\n\r\n")[0]
    assert b"access-control" not in plain.lower(), plain


def test_the_doors_count_their_answers_alike(doors):
    """The bookkeeping is one code: the same requests, the same counts (the worker's are
    summed by its owner, fetched within a bound)."""
    before = {door: _query_counts(srv) for door, srv in doors.items()}
    for _, request_ in CASES:
        for srv in doors.values():
            exchange(srv.port, request_)
    queries = sum(b"/query" in r.split(b" ", 2)[1] for _, r in CASES if r.startswith(b"POST"))
    want = None
    for door, srv in doors.items():
        base = before[door][0]
        wait_until(
            lambda srv=srv, base=base: _query_counts(srv)[0] - base >= queries,
            timeout=10,
            msg=f"{door}: the query metrics",
        )
        got = tuple(a - b for a, b in zip(_query_counts(srv), before[door], strict=True))
        want = want or got
        assert got == want, (door, got, want)
    assert want is not None and want[0] == queries and want[1] > 0


def _split(raw: bytes) -> tuple[str, str, bytes, dict[str, str], bytes] | None:
    """``(method, path, query string, headers, body)`` of a raw request with its whole
    body after the head; ``None`` for one the Falcon test client cannot send as it is."""
    head, _, body = raw.partition(b"\r\n\r\n")
    line, *fields = head.decode("latin-1").split("\r\n")
    method, target, version = line.split(" ")
    headers = dict(f.split(": ", 1) for f in fields)
    if version != "HTTP/1.1" or int(headers.get("Content-Length", -1)) != len(body):
        return None  # chunked, a length without its body
    path, _, query = target.partition("?")
    return method, path, query.encode(), headers, body


def test_falcons_own_post_is_the_same_door(conductor):
    """The Falcon app without a front door (``create_app`` without ``fast_query``)
    answers its ``POST`` through the same door: status, body and headers as the front
    door's (Falcon writes its own framing: the order and ``Date`` are its server's)."""
    import falcon.testing as ft

    from kvconductor.http.api import create_app
    from tests.helpers.api import events, register

    alone = ft.TestClient(create_app(conductor))
    front = ft.TestClient(create_app(conductor, fast_query=True))
    for instance, tokens, hashes in ENGINES:
        register(alone, instance)
        events(alone, [stored(1, hashes, tokens)], instance_id=instance)
    compared = 0
    for name, raw in CASES:
        parts = _split(raw)
        if parts is None or parts[1] not in ("/query", "/query_by_hash"):
            continue
        method, path, query, headers, body = parts
        got = []
        for client in (alone, front):
            r = client.simulate_request(
                method, path, query_string=query.decode(), headers=headers, body=body
            )
            seen = {k.lower(): v for k, v in r.headers.items() if k.lower() != "server-timing"}
            got.append((r.status_code, seen, "server-timing" in r.headers, r.content))
        assert got[0] == got[1], name
        compared += 1
    assert compared >= 15
