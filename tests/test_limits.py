"""kvconductor.http.limits at the protocol level: uvicorn's httptools protocol with our
limits, driven the way its event loop drives it (``data_received`` with raw bytes) over
a transport that records every write call. The fault suite (tests/faults/
test_http_limits.py) covers the same limits through real sockets."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.server import ServerState

from kvconductor.http.framing import JOIN_BYTES
from kvconductor.http.limits import ConnectionPool, HttpLimits, protocol_class
from tests.helpers.transport import Recorder


def make_app(body: bytes = b'{"ok":true}', delay: float = 0.0):
    async def app(scope, receive, send):
        more = True
        while more:
            msg = await receive()
            more = msg.get("more_body", False)
        if delay:
            await asyncio.sleep(delay)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def connect(app, limits: HttpLimits = HttpLimits(), state: ServerState | None = None):
    loop = asyncio.get_running_loop()
    config = uvicorn.Config(
        app, http=protocol_class(limits), lifespan="off", access_log=False, loop="none"
    )
    config.load()
    proto = config.http_protocol_class(
        config=config, server_state=state or ServerState(), app_state={}, _loop=loop
    )
    t = Recorder()
    proto.connection_made(t)
    return proto, t


async def settle(t: Recorder, count: int, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while t.data.count(b"HTTP/1.1 ") < count:
        assert loop.time() < end, t.calls
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)  # anything written after the last head


def post(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /q HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)
    )


def run(coro):
    return asyncio.run(coro)


def test_a_response_is_one_write():
    async def go():
        proto, t = connect(make_app(b'{"ok":true}'))
        for _ in range(3):  # keep-alive: every response of the connection
            proto.data_received(post(b"{}"))
            await settle(t, len(t.calls) + 1)
        assert len(t.calls) == 3
        for call in t.calls:
            assert call.startswith(b"HTTP/1.1 200 OK\r\n") and call.endswith(b'\r\n\r\n{"ok":true}')

    run(go())


def test_a_large_body_follows_its_head_in_the_same_call_uncopied():
    body = b"x" * (JOIN_BYTES + 1)

    async def go():
        proto, t = connect(make_app(body))
        proto.data_received(post(b"{}"))
        await settle(t, 1)
        assert len(t.calls) == 1  # writelines((head, body))
        assert t.calls[0].endswith(b"\r\n\r\n" + body)

    run(go())


def test_head_request_gets_its_head_without_a_body():
    async def go():
        proto, t = connect(make_app(b"0123456789"))
        proto.data_received(b"HEAD /q HTTP/1.1\r\nHost: x\r\n\r\n")
        await settle(t, 1)
        assert len(t.calls) == 1
        assert t.calls[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert t.calls[0].endswith(b"content-length: 10\r\n\r\n")  # the head only

    run(go())


def test_100_continue_is_written_before_the_body_arrives():
    async def go():
        proto, t = connect(make_app())
        proto.data_received(
            b"POST /q HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        await settle(t, 1)
        assert t.calls == [b"HTTP/1.1 100 Continue\r\n\r\n"]  # alone: the client waits for it
        proto.data_received(b"{}")
        await settle(t, 2)
        assert len(t.calls) == 2 and t.calls[1].startswith(b"HTTP/1.1 200 OK\r\n")

    run(go())


def test_pipelined_requests_are_answered_in_order():
    async def go():
        proto, t = connect(make_app(delay=0.01))
        proto.data_received(post(b"{}") + post(b"{}") + post(b"{}"))
        await settle(t, 3)
        assert t.data.count(b"HTTP/1.1 200 OK\r\n") == 3
        assert t.data.endswith(b'{"ok":true}')
        assert not t.closed

    run(go())


def test_an_app_that_never_sends_its_body_gets_the_connection_closed_with_its_head():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        # returns without the body: uvicorn closes the connection

    async def go():
        proto, t = connect(app)
        proto.data_received(post(b"{}"))
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while not t.closed:
            assert loop.time() < end
            await asyncio.sleep(0.001)
        assert t.data.startswith(b"HTTP/1.1 200 OK\r\n")  # flushed before the close

    run(go())


# -- deadlines and the connection cap, without a timer per request ------------------------


def test_the_sweep_times_out_a_request_past_its_deadline_only():
    limits = HttpLimits(request_timeout=0.2)

    async def go():
        state = ServerState()
        slow, ts = connect(make_app(), limits, state)
        quick, tq = connect(make_app(), limits, state)
        pool: ConnectionPool = state.kvc_pool
        assert pool.interval == pytest.approx(0.05)
        slow.data_received(b"POST /q HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        quick.data_received(post(b"{}"))
        await settle(tq, 1)
        await asyncio.sleep(0.35)  # past the deadline, and past a sweep after it
        assert ts.data.startswith(b"HTTP/1.1 408 "), ts.calls
        assert not tq.closed  # its request completed: no deadline runs between requests

    run(go())


def test_the_cap_evicts_the_least_recently_active_idle_connection():
    limits = HttpLimits(max_connections=3)

    async def go():
        state = ServerState()
        a, ta = connect(make_app(), limits, state)
        b, tb = connect(make_app(), limits, state)
        c, tc = connect(make_app(), limits, state)
        a.data_received(post(b"{}"))  # a was active last; b least recently
        await settle(ta, 1)
        busy_c = b"POST /q HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{"
        c.data_received(busy_c)  # c has a request in the app: never evicted
        d, td = connect(make_app(), limits, state)
        assert tb.closed and not ta.closed and not tc.closed and not td.closed
        e, te = connect(make_app(), limits, state)  # next: a (idle), not c (busy)
        assert ta.closed and not tc.closed
        assert state.kvc_pool.evicted == 2

    run(go())
