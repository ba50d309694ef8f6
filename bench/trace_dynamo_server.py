"""The trace replay against NVIDIA Dynamo's standalone KV indexer service, beside ours.

``python -m dynamo.indexer`` (PyPI ``ai-dynamo-runtime``, Rust: ``dynamo_kv_router``'s
``services/indexer``) is Dynamo's indexer as a service of its own: engines are registered
over HTTP, their KV events read from ZeroMQ, and matches asked over HTTP. What 1.6.1 takes
(read from its ``--help``, its routes and their error messages):

* ``POST /register`` JSON ``{"instance_id": u64, "endpoint": "tcp://...", "model_name",
  "block_size", "dp_rank"}``: one ZeroMQ listener per (instance, DP) that subscribes (all
  topics) to the engine's PUB and reads **vLLM's wire batches as they are**
  (``[topic, seq, msgpack KVEventBatch]``): the stream of :mod:`bench.trace_server` is
  played to it unchanged, the same bytes from the same publisher processes; it hashes
  each block's ``token_ids`` itself, as we do;
* ``POST /query_by_hash`` JSON only, ``{"block_hashes": [i64], "model_name"}``: the local
  hashes (XXH3-64 of the tokens, seed 1337, the same hash as ours) as *signed* 64-bit
  ints; the answer ``{"scores": {instance: {dp: matched tokens}}, ...}`` lists every
  holder (it has no ``top_k``);
* ``GET /metrics``: ``dynamo_kvrouter_kv_cache_events_applied{event_type, status}``, the
  events applied (one per batch here): quiescence is their sum reaching the batches sent,
  and an event applied with any ``status`` but ``ok`` counts as dropped.

``python bench/trace_replay.py ... --server 0 --server-dynamo`` plays every server run
against it too, in the same run (:func:`bench.trace_server.run_server` with
:class:`DynamoIndexer` as the target).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from typing import Any

from bench import trace_replay as tr
from bench.trace_services import MODEL, SERVER_BLOCK, Conn, Service, _free_port

#: ``--threads`` of the service (its default: 4 indexer threads)
THREADS = 4

_APPLIED = re.compile(
    r'^dynamo_kvrouter_kv_cache_events_applied\{event_type="[a-z]+",status="([a-z_]+)"\} (\S+)$',
    re.M,
)


def available() -> bool:
    """Whether ``python -m dynamo.indexer`` can run here (``ai-dynamo-runtime``)."""
    try:
        return importlib.util.find_spec("dynamo.indexer") is not None
    except ImportError:
        return False


def signed(h: int) -> int:
    """A u64 hash as the i64 Dynamo's JSON takes."""
    return h - (1 << 64) if h >= 1 << 63 else h


class DynamoIndexer(Service):
    """``python -m dynamo.indexer --port P --threads THREADS`` as a target of
    :func:`bench.trace_server.run_server`."""

    name = "dynamo-indexer"
    ctype = "application/json"

    def __init__(self, workers: int, logdir: str, dp: int = 1, threads: int = THREADS) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port)]
        super().__init__(cmd + ["--threads", str(threads)], logdir, dp)

    def register(self, w: int, url: str, iid: str | None = None, conn: Conn | None = None):
        st, body = self.post_json(
            "/register",
            {
                "instance_id": w // self.dp,
                "endpoint": url,
                "model_name": MODEL,
                "block_size": SERVER_BLOCK,
                "dp_rank": w % self.dp,
            },
            conn,
        )
        if st not in (200, 201):
            raise RuntimeError(f"register {w}: {st} {body[:200]!r}")

    def applied(self) -> tuple[int, dict[str, int]]:
        st, data = self.get("/metrics")
        if st != 200:
            return -1, {}
        total = bad = 0
        for status, v in _APPLIED.findall(data.decode()):
            total += int(float(v))
            if status != "ok":
                bad += int(float(v))
        return total, {"gaps": 0, "losses": 0, "dropped": bad}

    def body(self, hashes: list[int], top_k: int | None = None) -> bytes:
        q = {"block_hashes": [signed(h) for h in hashes], "model_name": MODEL}
        return json.dumps(q).encode()

    def items(self, raw: bytes) -> list[int]:
        """``scores`` (matched tokens per instance and DP) as the simulator's items."""
        ans: dict[str, Any] = json.loads(raw)
        dp = self.dp
        return [
            ((int(iid) * dp + int(rank)) << tr.DEPTH_BITS) | (tokens // SERVER_BLOCK)
            for iid, ranks in ans.get("scores", {}).items()
            for rank, tokens in ranks.items()
        ]
