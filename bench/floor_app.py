"""The HTTP stack's floor: a bare ASGI app for ``bench/floor.py``.

It does on uvicorn (uvloop + httptools, the stack kv-conductor runs on) only what
every query must do: read the whole request body and answer ``200`` with a fixed
msgpack body (``FLOOR_ANSWER``: a file holding kv-conductor's own answer to the same
query, so both send the same bytes back). No routing, no parsing, no metrics: the
time per request of this app is what the stack itself costs.

    FLOOR_ANSWER=answer.bin python -m uvicorn floor_app:app --app-dir bench \\
        --loop uvloop --http httptools --lifespan off --no-access-log
"""

from __future__ import annotations

import os

_path = os.environ.get("FLOOR_ANSWER")
if _path:
    with open(_path, "rb") as f:
        ANSWER = f.read()
else:
    ANSWER = b"\x81\xa5model\xa5bench"  # {"model": "bench"}
_HEADERS = [
    (b"content-type", b"application/msgpack"),
    (b"content-length", str(len(ANSWER)).encode()),
]


async def _drained(receive) -> bool:
    """Read the whole request body; False when the client went away first."""
    more = True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return False
        more = msg.get("more_body", False)
    return True


async def app(scope, receive, send) -> None:
    if scope["type"] != "http" or not await _drained(receive):
        return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


_SIZED: dict[int, tuple[list, bytes]] = {}


async def sized_app(scope, receive, send) -> None:
    """``app`` answering as many bytes as the request's ``x-floor-size`` header says: the
    floor paired with each query of ``bench/trace_server.py`` (the query's twin, sent
    beside it, gets the size of the service's answer to it)."""
    if scope["type"] != "http" or not await _drained(receive):
        return
    n = next((int(v) for k, v in scope["headers"] if k == b"x-floor-size"), 0)
    answer = _SIZED.get(n)
    if answer is None:
        hdr = [(b"content-type", b"application/msgpack"), (b"content-length", b"%d" % n)]
        answer = _SIZED[n] = (hdr, bytes(n))
    await send({"type": "http.response.start", "status": 200, "headers": answer[0]})
    await send({"type": "http.response.body", "body": answer[1]})
