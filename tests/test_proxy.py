"""kvconductor.serve.proxy: the worker's HTTP/1.1 client of the owner, fed real bytes.

Each test puts byte sequences into an ``asyncio.StreamReader`` (whole, or split across
reads the way a socket hands them over) and checks what :func:`read_head`,
:func:`read_chunk` and :func:`relay_body` make of them, and the error each malformed or
cut-off answer raises. The forwarding itself runs against a real owner in
tests/test_cluster.py.
"""

from __future__ import annotations

import asyncio

import pytest

from kvconductor.serve.proxy import (
    HEAD_LIMIT,
    BadResponse,
    Head,
    read_chunk,
    read_head,
    relay_body,
    request_head,
)


async def _reader(*parts: bytes, eof: bool = True, gap: bool = False) -> asyncio.StreamReader:
    """A reader holding ``parts``; ``gap``: each part arrives after the reader waited
    (a chunk split across reads)."""
    reader = asyncio.StreamReader(limit=HEAD_LIMIT)
    if not gap:
        for p in parts:
            reader.feed_data(p)
        if eof:
            reader.feed_eof()
        return reader

    async def feed() -> None:
        for p in parts:
            await asyncio.sleep(0)
            reader.feed_data(p)
        if eof:
            reader.feed_eof()

    asyncio.get_running_loop().create_task(feed())
    return reader


def run(coro):
    return asyncio.run(coro)


# -- heads ---------------------------------------------------------------------------


def test_head_with_content_length():
    async def go():
        r = await _reader(
            b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
            b"Content-Length: 15\r\ndate: Tue, 01 Dec 2026 00:00:00 GMT\r\n\r\n"
            b'{"status":"ok"}'
        )
        head = await read_head(r)
        return head, await r.read()

    head, rest = run(go())
    assert head == Head(
        201,
        [
            (b"content-type", b"application/json"),
            (b"content-length", b"15"),
            (b"date", b"Tue, 01 Dec 2026 00:00:00 GMT"),
        ],
        length=15,
    )
    assert rest == b'{"status":"ok"}'  # the head ends where the body starts


def test_head_without_content_length_chunked_and_close():
    async def go():
        r = await _reader(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
            b"Keep-Alive: timeout=5\r\ncontent-type: application/msgpack\r\n\r\n"
        )
        return await read_head(r)

    head = run(go())
    # framing headers are the worker server's to write: left out of the relayed ones
    assert head == Head(200, [(b"content-type", b"application/msgpack")], None, True, True)


def test_head_without_framing_reads_until_close():
    async def go():
        r = await _reader(b"HTTP/1.0 200 OK\r\nx-a: 1\r\n\r\nabc", b"def")
        head = await read_head(r)
        sent: list[dict] = []

        async def send(m):
            sent.append(m)

        keep = await relay_body(r, head, send)
        return head, keep, sent

    head, keep, sent = run(go())
    assert (head.status, head.length, head.chunked, head.close) == (200, None, False, False)
    assert keep is False  # the end of the body was the end of the connection
    assert b"".join(m["body"] for m in sent) == b"abcdef" and not sent[-1].get("more_body")


def test_interim_answers_are_skipped_and_a_chunked_framing_wins():
    async def go():
        r = await _reader(
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 7\r\n"
            b"transfer-encoding: chunked\r\n\r\n",
        )
        return await read_head(r)

    head = run(go())
    assert (head.status, head.length, head.chunked) == (413, None, True)
    assert head.headers == [(b"content-length", b"7")]


def test_head_split_across_reads():
    async def go():
        r = await _reader(
            b"HTTP/1.1 404 Not", b" Found\r\ncontent-le", b"ngth: 2\r", b"\n\r\n{}", gap=True
        )
        head = await read_head(r)
        return head, await r.readexactly(2)

    head, body = run(go())
    assert (head.status, head.length, body) == (404, 2, b"{}")


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b"HTTP/1.1\r\n\r\n", "bad status line"),  # no status code
        (b"garbage 200 OK\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "bad status code"),
        (b"HTTP/1.1 20 OK\r\n\r\n", "bad status code"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\n: empty name\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 12a\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "bad Content-Length"),
    ],
)
def test_malformed_heads_are_bad_responses(raw, needle):
    async def go():
        return await read_head(await _reader(raw))

    with pytest.raises(BadResponse, match=needle):
        run(go())
    assert issubclass(BadResponse, ValueError)  # OwnerClient.forward turns it into a 503


def test_head_past_the_limit_is_a_bad_response():
    async def go():
        r = await _reader(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (HEAD_LIMIT + 10) + b"\r\n\r\n")
        return await read_head(r)

    with pytest.raises(BadResponse, match="longer than"):
        run(go())


def test_connection_closed_before_the_head_ends():
    async def go():
        return await read_head(await _reader(b"HTTP/1.1 200 OK\r\ncontent-len"))

    with pytest.raises(asyncio.IncompleteReadError) as info:
        run(go())
    assert info.value.partial == b"HTTP/1.1 200 OK\r\ncontent-len"


# -- chunked bodies ------------------------------------------------------------------


def test_chunks_extensions_and_trailers():
    async def go():
        r = await _reader(
            b"5\r\nhello\r\n1A;name=x\r\n" + b"z" * 26 + b"\r\n0\r\nx-t: 1\r\n\r\nNEXT"
        )
        out = []
        while data := await read_chunk(r):
            out.append(data)
        return out, await r.read()

    chunks, rest = run(go())
    assert chunks == [b"hello", b"z" * 26]
    assert rest == b"NEXT"  # the trailers were read, nothing of the next answer


def test_a_chunk_split_across_reads():
    async def go():
        r = await _reader(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            b"a\r\n01234",
            b"56789\r",
            b"\n3\r\nabc\r\n0\r",
            b"\n\r\n",
            gap=True,
            eof=False,
        )
        head = await read_head(r)
        sent: list[dict] = []

        async def send(m):
            sent.append(m)

        keep = await relay_body(r, head, send)
        return keep, sent

    keep, sent = run(go())
    assert keep is True  # chunked, no Connection: close: the connection is reused
    assert [m["body"] for m in sent] == [b"0123456789", b"abc", b""]
    assert [m.get("more_body", False) for m in sent] == [True, True, False]


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b"zz\r\n", "bad chunk size"),
        (b"-5\r\nhello\r\n", "bad chunk size"),
        (b"0x5\r\nhello\r\n", "bad chunk size"),
        (b"\r\n", "bad chunk size"),
        (b"1" * 17 + b"\r\n", "bad chunk size"),
        (b"3\r\nabcXY", "not followed by CRLF"),
    ],
)
def test_malformed_chunks_are_bad_responses(raw, needle):
    async def go():
        return await read_chunk(await _reader(raw))

    with pytest.raises(BadResponse, match=needle):
        run(go())


def test_connection_closed_mid_body():
    async def chunked():
        return await read_chunk(await _reader(b"10\r\nonly-9-by"))

    with pytest.raises(asyncio.IncompleteReadError) as info:
        run(chunked())
    assert (info.value.partial, info.value.expected) == (b"only-9-by", 16)

    async def sized():
        r = await _reader(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
        head = await read_head(r)
        sent: list[dict] = []

        async def send(m):
            sent.append(m)

        await relay_body(r, head, send)

    with pytest.raises(asyncio.IncompleteReadError) as info:
        run(sized())
    assert (info.value.partial, info.value.expected) == (b"12345", 10)


def test_a_head_answer_and_204_have_no_body():
    async def go(status: bytes, head_only: bool):
        r = await _reader(b"HTTP/1.1 " + status + b" X\r\ncontent-length: 5\r\n\r\n")
        head = await read_head(r)
        sent: list[dict] = []

        async def send(m):
            sent.append(m)

        return await relay_body(r, head, send, head_only), sent

    assert run(go(b"200", True)) == (True, [{"type": "http.response.body", "body": b""}])
    assert run(go(b"204", False)) == (True, [{"type": "http.response.body", "body": b""}])


# -- the request head ----------------------------------------------------------------


def test_request_head_drops_hop_by_hop_headers_and_adds_the_client():
    scope = {
        "method": "POST",
        "path": "/events",
        "raw_path": b"/events",
        "query_string": b"a=1",
        "headers": [
            (b"host", b"x"),
            (b"connection", b"keep-alive"),
            (b"transfer-encoding", b"chunked"),
            (b"content-length", b"99"),
            (b"x-forwarded-for", b"10.0.0.1"),
        ],
        "client": ("127.0.0.1", 4000),
    }
    assert request_head(scope, 3) == (
        b"POST /events?a=1 HTTP/1.1\r\nhost: x\r\n"
        b"x-forwarded-for: 10.0.0.1, 127.0.0.1\r\ncontent-length: 3\r\n\r\n"
    )
    scope.update(method="GET", query_string=b"", headers=[], client=None)
    assert request_head(scope, None) == b"GET /events HTTP/1.1\r\n\r\n"
