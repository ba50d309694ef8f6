"""kvconductor.http.direct: small queries answered by the protocol, below ASGI.

The service is built as ``kv-conductor`` builds it (:func:`build_service`, the uvicorn
config and server wrapper of :mod:`kvconductor.serve.single`) and driven through its
protocol in process, with a transport that records every write. The model each direct
answer is checked against is the app's own answer to the same request: the same query
sent to ``/%71uery`` (percent-escaped, so the protocol hands it to the app, which
unescapes it to ``/query``) must give the same bytes but for ``Date`` and the
``Server-Timing`` duration.
"""

from __future__ import annotations

import asyncio
import json
import re

import msgspec
import pytest
from uvicorn.server import ServerState

from kvconductor.http.limits import HttpLimits
from kvconductor.serve.bootstrap import build_service
from kvconductor.serve.settings import Settings
from kvconductor.serve.single import KvServer, uvicorn_config
from tests.helpers.api import stored
from tests.helpers.transport import Recorder

TOKENS = list(range(100, 132))  # 8 blocks of 4
HASHES = list(range(7001, 7009))


DATE = (b"date", b"Wed, 02 Dec 2026 06:00:00 GMT")


def server_state() -> ServerState:
    """A server's state, with the ``Date`` header uvicorn's server keeps current."""
    state = ServerState()
    state.default_headers = [DATE]
    return state


class Conn:
    """One connection to the service's protocol."""

    def __init__(self, config, state: ServerState) -> None:
        self.t = Recorder()
        self.proto = config.http_protocol_class(
            config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop()
        )
        self.proto.connection_made(self.t)

    async def send(self, raw: bytes, answers: int = 1, timeout: float = 5.0) -> list[bytes]:
        """Feed ``raw``; the ``answers`` responses written after it (heads and bodies)."""
        before = self.t.data.count(b"HTTP/1.1 ")
        if raw:  # nothing: wait for the answers to what was sent before
            self.proto.data_received(raw)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.t.data.count(b"HTTP/1.1 ") < before + answers:
            assert loop.time() < end, self.t.calls
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        return responses(self.t.data)[before:]


def responses(data: bytes) -> list[bytes]:
    """The responses in ``data`` (each head with its ``content-length`` bytes of body)."""
    out = []
    while data:
        end = data.index(b"\r\n\r\n") + 4
        m = re.search(rb"\r\ncontent-length: (\d+)\r\n", data[:end], re.I)
        n = int(m.group(1)) if m else 0
        out.append(data[: end + n])
        data = data[end + n :]
    return out


def request(target: str, body: bytes, ctype: str = "application/json", extra: str = "") -> bytes:
    head = (
        f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def normalized(response: bytes) -> bytes:
    """``response`` without what differs between two answers of the same request."""
    return re.sub(rb"app;dur=[0-9.]+", b"app;dur=X", response)


@pytest.fixture
def service():
    settings = Settings(no_snapshots=True)
    svc = build_service(settings, "single")
    assert svc.start()
    yield svc, settings
    svc.stop()


def serve(svc, settings, limits: HttpLimits | None = None):
    if limits is not None:
        settings = Settings(
            no_snapshots=True,
            request_timeout_secs=limits.request_timeout,
            keep_alive_secs=limits.keep_alive,
        )
    config = uvicorn_config(svc.app, settings)
    config.loop = "none"
    KvServer(config)  # wraps the app as kv-conductor does
    config.load()
    return config


async def load(conn: Conn) -> None:
    reg = {"instance_id": "e1", "type": "vLLM", "modelname": "qwen", "block_size": 4, "dp_rank": 0}
    (r,) = await conn.send(request("/register", json.dumps(reg).encode()))
    assert r.startswith(b"HTTP/1.1 201 "), r
    ev = {"instance_id": "e1", "events": [stored(1, HASHES, TOKENS)]}
    (r,) = await conn.send(request("/events", json.dumps(ev).encode()))
    assert r.startswith(b"HTTP/1.1 200 "), r


def body_of(response: bytes) -> bytes:
    return response[response.index(b"\r\n\r\n") + 4 :]


QUERIES = [
    # (content type, body, extra headers): full hit, JSON and msgpack
    ("application/json", {"model": "qwen", "block_size": 4, "token_ids": TOKENS}, ""),
    ("application/msgpack", {"model": "qwen", "block_size": 4, "token_ids": TOKENS[:13]}, ""),
    # a CORS request (public read route: any origin)
    (
        "application/json",
        {"model": "qwen", "block_size": 4, "token_ids": TOKENS},
        "Origin: http://ui\r\n",
    ),
    # 200 with a warning: block size not registered
    ("application/json", {"model": "qwen", "block_size": 16, "token_ids": TOKENS}, ""),
    # 404 unknown model, 400 bad body, in each encoding
    ("application/json", {"model": "nope", "block_size": 4, "token_ids": TOKENS}, ""),
    ("application/msgpack", {"model": "nope", "block_size": 4, "token_ids": TOKENS}, ""),
    ("application/json", {"model": "qwen", "token_ids": "x"}, ""),
    ("application/msgpack", {"block_size": 4}, ""),
]


@pytest.mark.parametrize("ctype,doc,extra", QUERIES)
def test_a_direct_answer_is_the_apps_answer_byte_for_byte(service, ctype, doc, extra):
    svc, settings = service

    async def go():
        config = serve(svc, settings)
        conn = Conn(config, server_state())
        await load(conn)
        enc = msgspec.msgpack.encode if "msgpack" in ctype else msgspec.json.encode
        body = enc(doc)
        seconds = svc.app.routes["/query"].seconds
        count = sum(seconds.counts)
        conn.proto.cycle = None  # the requests before were the app's
        (direct,) = await conn.send(request("/query", body, ctype, extra))
        assert conn.proto.cycle is None  # answered without an ASGI cycle
        (app,) = await conn.send(request("/%71uery", body, ctype, extra))
        assert conn.proto.cycle is not None  # this one went through the app
        assert normalized(direct) == normalized(app)
        # uvicorn's default headers first, as the app's answers have them
        assert direct.split(b"\r\n")[1] == b"%s: %s" % DATE
        assert b"\r\nserver-timing: app;dur=" in direct
        assert sum(seconds.counts) == count + 2  # both observed in the route's histogram
        return direct

    direct = asyncio.run(go())
    status = int(direct.split(b" ", 2)[1])
    answer = body_of(direct)
    decoded = msgspec.msgpack.decode(answer) if "msgpack" in ctype else msgspec.json.decode(answer)
    if doc.get("model") == "nope":
        assert status == 404 and "no indexer" in decoded["error"]
    elif "model" not in doc or doc.get("token_ids") == "x":
        assert status == 400 and "invalid" in decoded["error"]
    else:
        assert status == 200
        blocks = 0 if doc["block_size"] == 16 else len(doc["token_ids"]) // 4
        rows = decoded["default"]["e1"]["DP"] if blocks else {}
        if blocks:
            assert rows["0"]["npu_blocks"] == blocks
        if doc["block_size"] == 16:
            assert b"x-kv-conductor-warning: block_size 16" in direct.lower()
        if extra:
            assert b"\r\naccess-control-allow-origin: *\r\n" in direct


def test_pipelined_queries_behind_a_request_in_the_app_keep_their_order(service):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        q = request(
            "/query", msgspec.json.encode({"model": "qwen", "block_size": 4, "token_ids": TOKENS})
        )
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        # the health check goes to the app (a task); the queries must wait their turn
        got = await conn.send(health + q + q + health + q, answers=5)
        assert [r.split(b"\r\n", 1)[0] for r in got] == [b"HTTP/1.1 200 OK"] * 5
        assert [body_of(r) == b"OK" for r in got] == [True, False, False, True, False]
        assert len({body_of(r) for r in got if body_of(r) != b"OK"}) == 1
        # a query alone after that is the protocol's again, and answered at once
        conn.proto.data_received(q)
        assert conn.t.data.count(b"HTTP/1.1 ") == 2 + 5 + 1

    asyncio.run(go())


def test_a_query_in_pieces_and_connection_close(service):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        body = msgspec.json.encode({"model": "qwen", "block_size": 4, "token_ids": TOKENS})
        raw = request("/query", body, extra="Connection: close\r\n")
        n = conn.t.data.count(b"HTTP/1.1 ")
        for i in range(0, len(raw) - 1, 7):  # head and body 7 bytes at a time
            conn.proto.data_received(raw[i : min(i + 7, len(raw) - 1)])
        assert conn.t.data.count(b"HTTP/1.1 ") == n and not conn.t.closed
        conn.proto.data_received(raw[-1:])
        last = responses(conn.t.data)[-1]
        assert last.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"\r\nconnection: close\r\n" in last and conn.t.closed
        assert msgspec.json.decode(body_of(last))["default"]["e1"]["DP"]["0"]["npu_blocks"] == 8

    asyncio.run(go())


def test_shutdown_while_a_query_body_arrives_answers_it_then_closes(service):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        body = msgspec.json.encode({"model": "qwen", "block_size": 4, "token_ids": TOKENS})
        raw = request("/query", body)
        conn.proto.data_received(raw[:-5])
        conn.proto.shutdown()  # the server stops: this request is in flight
        assert not conn.t.closed
        conn.proto.data_received(raw[-5:])
        last = responses(conn.t.data)[-1]
        assert last.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close\r\n" in last
        assert conn.t.closed

    asyncio.run(go())


def test_a_query_whose_body_stops_gets_408_at_its_deadline(service):
    svc, settings = service

    async def go():
        limits = HttpLimits(request_timeout=0.2)
        conn = Conn(serve(svc, settings, limits), server_state())
        raw = request("/query", b'{"model": "qwen", "block_size": 4, "token_ids": [1, 2]}')
        conn.proto.data_received(raw[:-3])
        await asyncio.sleep(0.5)  # past the deadline, and past a sweep after it
        (r,) = responses(conn.t.data)
        assert r.startswith(b"HTTP/1.1 408 ") and b"request body incomplete" in r
        conn.proto.data_received(raw[-3:])  # too late: dropped, not answered
        assert conn.t.data.count(b"HTTP/1.1 ") == 1

    asyncio.run(go())


@pytest.mark.parametrize(
    "extra,version",
    [
        ("Expect: 100-continue\r\n", "1.1"),  # the app writes 100 Continue first
        ("", "1.0"),  # HTTP/1.0: the app's answer, then close
    ],
)
def test_what_the_app_answers_instead(service, extra, version):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        body = msgspec.json.encode({"model": "qwen", "block_size": 4, "token_ids": TOKENS})
        raw = request("/query", body, extra=extra).replace(
            b"HTTP/1.1", f"HTTP/{version}".encode(), 1
        )
        conn.proto.cycle = None
        answers = 2 if extra else 1
        got = await conn.send(raw, answers=answers)
        assert conn.proto.cycle is not None  # the app answered
        assert got[-1].startswith(b"HTTP/1.1 200 OK\r\n")
        assert msgspec.json.decode(body_of(got[-1]))["default"]["e1"]["DP"]["0"]["npu_blocks"] == 8
        if extra:
            assert got[0] == b"HTTP/1.1 100 Continue\r\n\r\n"
        else:
            assert conn.t.closed

    asyncio.run(go())


def test_a_chunked_query_goes_to_the_app(service):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        body = msgspec.json.encode({"model": "qwen", "block_size": 4, "token_ids": TOKENS})
        raw = (
            b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        conn.proto.cycle = None
        (r,) = await conn.send(raw)
        assert conn.proto.cycle is not None
        assert msgspec.json.decode(body_of(r))["default"]["e1"]["DP"]["0"]["npu_blocks"] == 8

    asyncio.run(go())


def test_an_idle_connection_after_a_direct_answer_is_closed_after_the_keep_alive(service):
    svc, settings = service

    async def go():
        limits = HttpLimits(keep_alive=0.2)
        config = serve(svc, settings, limits)
        assert config.timeout_keep_alive == 0.2
        state = server_state()
        busy, idle = Conn(config, state), Conn(config, state)
        q = request("/query", b'{"model": "qwen", "block_size": 4, "token_ids": [1, 2]}')
        for conn in (busy, idle):
            (r,) = await conn.send(q)
            assert r.startswith(b"HTTP/1.1 404 ") and conn.proto.cycle is None
        assert busy.proto.timeout_keep_alive_task is None  # no timer per request
        loop = asyncio.get_running_loop()
        end = loop.time() + 0.7
        while loop.time() < end:  # a request every 0.05 s keeps one connection open
            (r,) = await busy.send(q)
            await asyncio.sleep(0.05)
        assert idle.t.closed and not busy.t.closed

    asyncio.run(go())


# -- a large body: answered off the event loop, written by the protocol ------------------

#: A query over the route's 256 KiB threshold (the loaded 8 blocks, then more tokens).
BIG = msgspec.json.encode(
    {"model": "qwen", "block_size": 4, "token_ids": TOKENS + list(range(200_000, 260_000))}
)


@pytest.mark.parametrize("query", ["", "?freshness=true"])
def test_a_large_query_is_answered_off_the_loop_as_the_app_answers_it(service, query):
    svc, settings = service
    assert len(BIG) > svc.app.routes["/query"].large_body_bytes

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        conn.proto.cycle = None
        n = conn.t.data.count(b"HTTP/1.1 ")
        conn.proto.data_received(request("/query" + query, BIG))
        assert conn.t.data.count(b"HTTP/1.1 ") == n  # not answered on the event loop
        assert type(conn.proto.cycle).__name__ == "_InFlight"
        (direct,) = await conn.send(b"", answers=1)
        assert conn.proto.cycle.response_complete and not conn.t.closed
        (app,) = await conn.send(request("/%71uery" + query, BIG))
        assert type(conn.proto.cycle).__name__ == "RequestResponseCycle"
        assert normalized(direct) == normalized(app)
        doc = msgspec.json.decode(body_of(direct))
        assert doc["default"]["e1"]["DP"]["0"]["npu_blocks"] == 8
        assert ("freshness" in doc) is bool(query)

    asyncio.run(go())


def test_a_request_behind_a_large_query_waits_its_turn(service):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        small = request("/query", b'{"model": "nope", "block_size": 4, "token_ids": [1]}')
        health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        got = await conn.send(request("/query", BIG) + small + health, answers=3)
        assert [r.split(b"\r\n", 1)[0] for r in got] == [
            b"HTTP/1.1 200 OK",
            b"HTTP/1.1 404 Not Found",
            b"HTTP/1.1 200 OK",
        ]
        assert body_of(got[2]) == b"OK"

    asyncio.run(go())


def test_a_large_query_whose_client_left_is_not_written(service):
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        seconds = svc.app.routes["/query"].seconds
        count = sum(seconds.counts)
        n = len(conn.t.calls)
        conn.proto.data_received(request("/query", BIG))
        conn.proto.connection_lost(None)
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while sum(seconds.counts) == count:  # answered (and counted) all the same
            assert loop.time() < end
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        assert len(conn.t.calls) == n  # nothing written after the loss

    asyncio.run(go())


def test_shutdown_while_a_large_query_is_answered_closes_after_its_answer(service):
    svc, settings = service

    async def go():
        state = server_state()
        conn = Conn(serve(svc, settings), state)
        await load(conn)
        conn.proto.data_received(request("/query", BIG))
        assert len(state.tasks) == 1  # a graceful shutdown waits for it
        conn.proto.shutdown()
        assert not conn.t.closed
        (r,) = await conn.send(b"", answers=1)
        assert r.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close\r\n" in r
        assert conn.t.closed

    asyncio.run(go())


@pytest.mark.parametrize(
    "query,fresh",
    [
        ("?freshness=true", True),
        ("?freshness=1", True),
        ("?freshness", True),
        ("?freshness=0", False),
        ("?freshness=false", False),
    ],
)
def test_the_freshness_parameter_is_answered_here_as_the_app_answers_it(service, query, fresh):
    """``?freshness=...`` alone (docs/api.md, "freshness") is answered by the protocol; the
    same answer as the app's (its target escaped, so that it goes to the app)."""
    svc, settings = service

    async def go():
        conn = Conn(serve(svc, settings), server_state())
        await load(conn)
        body = msgspec.msgpack.encode(["qwen", 4, TOKENS])  # the positional form
        conn.proto.cycle = None
        (direct,) = await conn.send(request("/query" + query, body, "application/msgpack"))
        assert conn.proto.cycle is None  # answered without an ASGI cycle
        (app,) = await conn.send(request("/%71uery" + query, body, "application/msgpack"))
        assert conn.proto.cycle is not None
        assert normalized(direct) == normalized(app)
        doc = msgspec.msgpack.decode(body_of(direct))
        assert ("freshness" in doc) is fresh
        row = doc["default"]["e1"]["DP"]["0"]
        assert row["npu_blocks"] == 8
        if fresh:
            # fed over POST /events: no ZeroMQ source of its own
            assert row["freshness"] == {"state": "no_source"}
            assert doc["freshness"] == {"all_live": True, "sources": 0, "states": {}}
        conn.proto.cycle = None
        (other,) = await conn.send(request("/query?freshness=1&x=2", body, "application/msgpack"))
        assert conn.proto.cycle is not None  # any other query string: the app's
        assert msgspec.msgpack.decode(body_of(other))["freshness"]["all_live"] is True

    asyncio.run(go())
