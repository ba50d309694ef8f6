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


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    more = True
    size = 0
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        size += len(msg.get("body", b""))
        more = msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})
