"""kvconductor.http.front: what the one ASGI front door hands to whom."""

from __future__ import annotations

import asyncio

from kvconductor.http.front import FrontDoor
from kvconductor.serve.settings import Settings
from kvconductor.serve.single import uvicorn_config


class Route:
    """A query route that records nothing but answers 200."""

    class _Obs:
        def observe(self, amount: float) -> None:
            pass

    class _Cnt:
        def inc(self) -> None:
            pass

    seconds = _Obs()
    errors = _Cnt()

    async def respond(self, body, msgpack):
        return 200, b"{}", None


def call(app, path: str, method: str = "POST") -> dict:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"x-forwarded-for", b"10.1.2.3"), (b"content-length", b"2")],
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return scope


def test_proxy_headers_apply_to_the_rest_and_not_to_the_query_routes():
    seen: list[tuple] = []

    async def rest(scope, receive, send):
        seen.append(scope["client"])

    door = FrontDoor(rest, {"/query": Route()})
    config = uvicorn_config(door, Settings())
    # uvicorn's own middleware is off: it parses the client's address on every request
    assert config.proxy_headers is False
    call(door, "/register")
    assert seen == [("10.1.2.3", 0)]  # the rest: X-Forwarded-For from a trusted host
    q = call(door, "/query")
    assert q["client"] == ("127.0.0.1", 50000)  # the query route never reads it
    uvicorn_config(door, Settings())  # a second config does not wrap twice
    call(door, "/register")
    assert seen[-1] == ("10.1.2.3", 0) and len(seen) == 2


def collect(chunks, limit=1 << 20, disconnect=False):
    from kvconductor.http.front import _collect, _TooLarge

    msgs = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    if disconnect:
        msgs[-1] = {"type": "http.disconnect"}
    it = iter(msgs)
    read = []

    async def receive():
        read.append(1)
        return next(it)

    try:
        out = asyncio.run(_collect(receive, limit))
    except _TooLarge:
        out = "too large"
    return out, len(read)


def test_a_body_in_chunks_is_collected_whole():
    out, _ = collect([b"abcd", b"efghi", b"jkl"])
    assert out == b"abcdefghijkl"


def test_one_chunk_is_the_body_itself():
    body = b"x" * 100
    assert collect([body])[0] is body


def test_a_body_past_the_limit_is_refused_without_reading_on():
    out, reads = collect([b"x" * 10, b"y" * 10, b"z" * 10, b"w" * 10], limit=15)
    assert (out, reads) == ("too large", 2)
    assert collect([b"x" * 10, b"y" * 10], limit=15)[0] == "too large"  # the last chunk too


def test_a_disconnect_ends_the_collection():
    assert collect([b"x" * 10, b"y" * 10, b"z" * 10], disconnect=True)[0] is None


def _answer_headers(door) -> list[bytes]:
    scope = {"type": "http", "method": "POST", "path": "/query", "headers": []}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(door(scope, receive, send))
    return [k for k, _ in sent[0]["headers"]]


def test_a_workers_front_door_dates_its_query_answers_once_per_second(monkeypatch):
    """``FrontDoor(date=True)`` (a worker, whose uvicorn adds no ``Date``) puts one on the
    query answers; one process's door leaves it to uvicorn (no second one)."""
    import email.utils

    from kvconductor.http import framing

    class Fresh(Route):
        async def respond(self, body, msgpack, fresh=False):
            return 200, b"{}", None

    assert _answer_headers(FrontDoor(None, {"/query": Fresh()}, date=True))[0] == b"date"
    assert b"date" not in _answer_headers(FrontDoor(None, {"/query": Fresh()}))
    now = [1_800_000_000.2]
    monkeypatch.setattr(framing.time, "time", lambda: now[0])
    first = framing.date_header()
    assert first == (b"date", email.utils.formatdate(1_800_000_000, usegmt=True).encode())
    now[0] += 0.7
    assert framing.date_header() is first  # the same second: not formatted again
    now[0] += 0.2
    assert framing.date_header()[1] == b"Fri, 15 Jan 2027 08:00:01 GMT"


def test_head_first_hands_over_a_body_already_here_and_an_empty_chunk_otherwise():
    """:class:`HeadFirst`: the first receive is the real message when the body is here
    (nothing changes), else at once an empty chunk with more to come; an answer started
    before the body was received whole closes the connection."""
    from kvconductor.http.front import HeadFirst

    async def run(ready: bool) -> tuple[list[dict], list[dict]]:
        queue: asyncio.Queue = asyncio.Queue()
        if ready:
            queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})
        sent: list[dict] = []

        async def send(msg):
            sent.append(msg)

        h = HeadFirst(queue.get, send)
        got = [await h.receive()]
        if not ready:
            await h.send({"type": "http.response.start", "status": 401, "headers": []})
            queue.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})
            got.append(await h.receive())
            await h.send({"type": "http.response.start", "status": 200, "headers": []})
        else:
            await h.send({"type": "http.response.start", "status": 200, "headers": [(b"x", b"1")]})
        h.close()
        return got, sent

    got, sent = asyncio.run(run(ready=True))
    assert got == [{"type": "http.request", "body": b"{}", "more_body": False}]
    assert sent[0]["headers"] == [(b"x", b"1")]  # received whole: keep-alive as before
    got, sent = asyncio.run(run(ready=False))
    assert got == [
        {"type": "http.request", "body": b"", "more_body": True},
        {"type": "http.request", "body": b"{}", "more_body": False},
    ]
    assert sent[0]["headers"] == [(b"connection", b"close")]  # answered before the body
    assert sent[1]["headers"] == []
