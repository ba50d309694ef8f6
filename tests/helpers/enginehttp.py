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


class EngineHttp:
    """The engine's API server as far as the route goes: ``GET /kv_event_sources`` answers
    :attr:`body` (with :attr:`status`, :attr:`headers`), after :attr:`delay` seconds."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.status = 200
        self.headers: dict[str, str] = {}
        self.delay = 0.0
        self.gets = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.gets += 1
                time.sleep(owner.delay)
                if self.path != "/kv_event_sources":
                    self.send_error(404)
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


class Engine:
    """One vLLM engine: a publisher per DP rank (vLLM's own, binding ``endpoints[rank]``,
    replay on port 0 too) and its API server's route."""

    def __init__(self, http: EngineHttp, endpoints: dict[int, str]) -> None:
        k = vllm_kv_events()
        self.k = k
        self.http = http
        self.pubs = {
            rank: k.ZmqEventPublisher(
                data_parallel_rank=rank, endpoint=ep, replay_endpoint="tcp://*:0"
            )
            for rank, ep in endpoints.items()
        }
        http.serve({r: p.get_publisher_config() for r, p in self.pubs.items()})

    def up(self, rank: int) -> str:
        """Rank ``rank``'s publisher (re)started on port 0 (its replay too), the route
        answering its new endpoint; returns it."""
        self.pubs[rank] = self.k.ZmqEventPublisher(
            data_parallel_rank=rank, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
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
