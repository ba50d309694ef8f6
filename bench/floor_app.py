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


async def _body(receive) -> bytes | None:
    """The whole request body; None when the client went away first."""
    parts = []
    more = True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        parts.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(parts)


async def _drained(receive) -> bool:
    """Read the whole request body; False when the client went away first."""
    return await _body(receive) is not None


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


class _Receiver:
    """The event stream's floor: one SUB socket connected to every engine registered, on a
    thread of its own that receives each message (``kvconductor._recv.recv_messages``, as
    kv-conductor's ingest thread does, else pyzmq's ``recv_multipart``), counts it and
    drops it; like the ingest thread, it gives the GIL and the CPU away (``os.sched_yield``)
    after each receive (at most 64 messages: here nothing is done per message, the ingest
    thread yields after each one it applies) and runs at kv-conductor's ingest priority
    (``INGEST_NICE``). No parse, no index: what any Python service on this stack pays to
    take the stream in beside its queries."""

    def __init__(self) -> None:
        import queue
        import threading

        self.pending: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.count = 0
        threading.Thread(target=self._run, name="floor-ingest", daemon=True).start()

    def _run(self) -> None:
        import queue

        import zmq

        try:
            from kvconductor._recv import AVAILABLE
            from kvconductor._recv import recv_messages as fast
        except ImportError:
            AVAILABLE = False
        from kvconductor.ingest.thread import lower_priority
        from kvconductor.serve.tuning import INGEST_NICE

        lower_priority(INGEST_NICE)  # as kv-conductor's ingest thread
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while True:
            try:
                while True:
                    sub.connect(self.pending.get_nowait())
            except queue.Empty:
                pass
            if not poller.poll(20):
                continue
            if AVAILABLE:
                msgs: list[list[bytes]] = []
                fast(sub.underlying, 64, msgs)
                self.count += len(msgs)
            else:
                for _ in range(64):
                    try:
                        sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.count += 1
            os.sched_yield()


class _Counter:
    """What each engine's source reports, as a subscription's events: only the count."""

    closed = False

    def __init__(self, receiver: _SourcesReceiver) -> None:
        self.receiver = receiver

    def handshake(self) -> None:
        pass

    def disconnected(self) -> None:
        pass

    def message(self, frames: list[bytes]) -> None:
        self.receiver.count += 1

    def receive_error(self, ex: Exception) -> None:
        pass


class _SourcesReceiver:
    """The event stream's floor with one SUB socket per engine (``FLOOR_SOURCES=1``), as a
    service must have that knows which engine sent a message: kv-conductor's own ingest
    loop (:class:`~kvconductor.ingest.thread.IngestThread`, each engine's SUB and monitor
    in a :class:`~kvconductor.ingest.source.SubSource`, the same options, drain, yield
    after every message and priority), whose handler only counts. No sequence check, no
    parse, no index: what kv-conductor's ingest costs apart from what it does with a
    message."""

    def __init__(self) -> None:
        from kvconductor.ingest.thread import IngestThread
        from kvconductor.serve.tuning import INGEST_NICE, zmq_context

        self.count = 0
        most = int(os.environ.get("FLOOR_SOURCES_MAX", "8192"))
        self.thread = IngestThread(zmq_context(most), nice=INGEST_NICE)
        self.thread.start()
        self.sources: list = []

    def _open(self, url: str) -> None:
        from kvconductor.ingest.source import SubSource

        src = SubSource(self.thread, _Counter(self), None)
        src.open(url, 64 << 20)
        self.sources.append(src)

    async def subscribe(self, url: str) -> None:
        import asyncio

        await asyncio.wrap_future(self.thread.submit(self._open, url))


_RECEIVER: _Receiver | _SourcesReceiver | None = None
_TEXT = [(b"content-type", b"text/plain")]


async def ingest_app(scope, receive, send) -> None:
    """``app`` that also takes in the engines' event stream (:class:`_Receiver`):
    ``POST /register`` ``{"endpoint": "tcp://..."}`` subscribes to one more engine,
    ``GET /applied`` answers the messages received so far; any other request gets
    ``app``'s answer. The floor of a service that ingests while it answers: through one
    SUB for every engine (:class:`_Receiver`), or with ``FLOOR_SOURCES=1`` through a SUB
    per engine on kv-conductor's ingest loop (:class:`_SourcesReceiver`)."""
    global _RECEIVER
    if scope["type"] != "http":
        return
    body = await _body(receive)
    if body is None:
        return
    path = scope["path"]
    if path == "/register":
        import json

        url = json.loads(body)["endpoint"]
        if _RECEIVER is None:
            _RECEIVER = _SourcesReceiver() if os.environ.get("FLOOR_SOURCES") else _Receiver()
        if isinstance(_RECEIVER, _SourcesReceiver):
            await _RECEIVER.subscribe(url)
        else:
            _RECEIVER.pending.put(url)
        status, headers, answer = 201, _TEXT, b"subscribed"
    elif path == "/applied":
        status, headers, answer = 200, _TEXT, b"%d" % (_RECEIVER.count if _RECEIVER else 0)
    else:
        status, headers, answer = 200, _HEADERS, ANSWER
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": answer})
