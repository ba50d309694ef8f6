"""An engine's HTTP side and its publishers for ``engine_url`` (tests/test_engine_url.py,
bench/engine_url.py): vLLM 0.33.0's own ``ZmqEventPublisher`` per DP rank and a plain HTTP
server answering ``GET /kv_event_sources`` with the body vLLM's own route function and
``KVEventsConfig`` make (tests/helpers/realpub.py; vLLM's API server needs torch)."""

from __future__ import annotations

import http.server
import threading
import time

from tests.helpers.publishers import wait_until
from tests.helpers.realpub import vllm_kv_events, vllm_route

BS = 4


#: How a slow engine answers (:attr:`EngineHttp.slow`): its headers a byte at a time;
#: its headers, then its body a byte at a time; its body without ``Content-Length``, the
#: connection then kept open with nothing more.
SLOW_MODES = ("headers", "body", "open")
#: Seconds between two trickled bytes (within the reader's per-read timeout), and the
#: longest a slow answer goes on.
TRICKLE_SECS = 0.4
TRICKLE_FOR_SECS = 30.0


class EngineHttp:
    """The engine's API server as far as the route goes: ``GET /kv_event_sources`` answers
    :attr:`body` (with :attr:`status`, :attr:`headers`), after :attr:`delay` seconds;
    :attr:`slow`, one of :data:`SLOW_MODES`, answers it as a slow-loris server does."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.status = 200
        self.headers: dict[str, str] = {}
        self.delay = 0.0
        self.slow: str | None = None
        self.gets = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.gets += 1
                time.sleep(owner.delay)
                if self.path != "/kv_event_sources":
                    self.send_error(404)
                    return
                if owner.slow is not None:
                    _slow(self.wfile, owner.slow, owner.body)
                    self.close_connection = True
                    return
                self.send_response(owner.status)
                for k, v in owner.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                try:
                    self.wfile.write(owner.body)
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def serve(self, sources: dict) -> None:
        """Answer what vLLM 0.33's API server answers for an engine client with
        ``sources`` (DP rank -> the publisher's ``get_publisher_config()``)."""
        _, render = vllm_route()
        self.body, self.status, self.headers = render(sources), 200, {}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _slow(out, mode: str, body: bytes) -> None:
    """Answer ``body`` as slow ``mode`` does (:data:`SLOW_MODES`), until the reader hangs
    up or :data:`TRICKLE_FOR_SECS` passed."""
    length = b"" if mode == "open" else b"Content-Length: %d\r\n" % len(body)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + length
    head += b"X-Pad: " + b"p" * 200 + b"\r\n\r\n"
    end = time.monotonic() + TRICKLE_FOR_SECS
    try:
        if mode == "headers":
            _trickle(out, head, end)
            return
        out.write(head)
        if mode == "body":
            _trickle(out, body, end)
            return
        out.write(body)
        out.flush()
        time.sleep(TRICKLE_FOR_SECS)  # never closes (within the bound)
    except OSError:
        return  # the reader hung up


def _trickle(out, data: bytes, end: float) -> None:
    """``data`` a byte every :data:`TRICKLE_SECS` until done or ``end`` (the rest, if
    any, is never sent)."""
    for i in range(len(data)):
        out.write(data[i : i + 1])
        out.flush()
        time.sleep(TRICKLE_SECS)
        if time.monotonic() > end:
            return


class Engine:
    """One vLLM engine: a publisher per DP rank (vLLM's own, binding ``endpoints[rank]``,
    replay on port 0 too) and its API server's route."""

    def __init__(
        self, http: EngineHttp, endpoints: dict[int, str], replay: dict[int, str] | None = None
    ) -> None:
        k = vllm_kv_events()
        self.k = k
        self.http = http
        self.pubs = {
            rank: k.ZmqEventPublisher(
                data_parallel_rank=rank,
                endpoint=ep,
                replay_endpoint=(replay or {}).get(rank, "tcp://*:0"),
            )
            for rank, ep in endpoints.items()
        }
        http.serve({r: p.get_publisher_config() for r, p in self.pubs.items()})

    def up(self, rank: int, endpoint: str = "tcp://*:0", replay: str = "tcp://*:0") -> str:
        """Rank ``rank``'s publisher (re)started on ``endpoint`` and ``replay`` (port 0:
        new ports), the route answering its endpoint; returns it."""
        self.pubs[rank] = self.k.ZmqEventPublisher(
            data_parallel_rank=rank, endpoint=endpoint, replay_endpoint=replay
        )
        self.http.serve({r: p.get_publisher_config() for r, p in self.pubs.items()})
        return self.pubs[rank].get_publisher_config().endpoint

    def store(self, rank: int, hashes: list[int], tokens: list[int]) -> None:
        k = self.k
        ev = k.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BS,
            lora_id=None,
            medium=k.MEDIUM_GPU,
            lora_name=None,
        )
        self.pubs[rank].publish(k.KVEventBatch(ts=time.time(), events=[ev]))

    def shutdown(self) -> None:
        for p in self.pubs.values():
            p.shutdown()


def hits(http, iid: str, tokens: list[int], dp: int, model: str = "qwen") -> int:
    """``npu_blocks`` of (``iid``, ``dp``) in ``POST /query``'s answer for ``tokens``."""
    r = http.post("/query", json={"model": model, "block_size": BS, "token_ids": tokens})
    assert r.status_code == 200, r.text
    e = r.json().get("default", {}).get(iid, {}).get("DP", {}).get(str(dp))
    return 0 if e is None else e["npu_blocks"]


def until_hits(http, iid: str, eng: Engine, rank: int, hashes: list[int], tokens: list[int]):
    """Publish ``hashes`` (of ``tokens``) on ``rank`` until ``/query`` answers them (the
    SUB may connect after a first send)."""

    def answered() -> bool:
        if hits(http, iid, tokens, rank) == len(hashes):
            return True
        eng.store(rank, hashes, tokens)
        return False

    wait_until(answered, timeout=30, interval=0.2, msg=f"DP {rank}'s blocks answered")
