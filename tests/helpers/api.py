"""The HTTP API in-process (falcon.testing): the request helpers and the subscription
double of ``tests/test_api.py``, shared with ``tests/test_explain.py`` and
``tests/test_openapi.py``. The ``conductor`` and ``client`` fixtures built on them are in
``tests/conftest.py``.

Block size 4; ``H1``, ``H2`` are the golden hashes of tokens 1..4 and 5..8 (docs/api.md,
"Block hashing").
"""

from __future__ import annotations

from kvconductor.ingest.thread import IngestThread
from kvconductor.state.conductor import Conductor
from kvconductor.state.protocols import NoSubscriptions

H1, H2 = 14643705804678351452, 16777012769546811212  # tokens 1..4, 5..8 (docs/api.md)


class RecordingSubs(NoSubscriptions):
    """Subscription manager double (no sockets)."""

    def __init__(self, thread: IngestThread, conductor: Conductor) -> None:
        self.subs: dict = {}
        self.replays: list = []

    def subscribe(self, ctx) -> None:
        self.subs[(ctx.instance_id, ctx.dp_rank, ctx.url)] = ctx

    def unsubscribe(self, instance_id: str, dp_rank: int) -> int:
        keys = [k for k in self.subs if k[:2] == (instance_id, dp_rank)]
        for k in keys:
            del self.subs[k]
        return len(keys)

    def request_replay(self, ctx) -> None:
        self.replays.append(ctx)

    def count(self, instance_id: str, dp_rank: int) -> int:
        return sum(1 for k in self.subs if k[:2] == (instance_id, dp_rank))

    def replace(self, instance_id: str, dp_rank: int, contexts) -> set[str]:
        before = {k[2] for k in self.subs if k[:2] == (instance_id, dp_rank)}
        self.unsubscribe(instance_id, dp_rank)
        for ctx in contexts:
            self.subscribe(ctx)
        return {c.url for c in contexts} - before

    def __len__(self) -> int:
        return len(self.subs)

    def sources(self) -> list[dict]:
        return [
            {"instance_id": k[0], "dp_rank": k[1], "url": k[2], "state": "test"}
            for k in sorted(self.subs)
        ]

    def close(self) -> None:
        self.subs.clear()


def register(client, instance_id="vllm-prefill-1", dp_rank=0, expect=201, headers=None, **kw):
    body = {
        "instance_id": instance_id,
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 4,
        "dp_rank": dp_rank,
        **kw,
    }
    r = client.simulate_post("/register", json=body, headers=headers)
    assert r.status_code == expect, r.text
    return r


def unregister(client, instance_id="vllm-prefill-1", dp_rank=0, headers=None):
    return client.simulate_post(
        "/unregister",
        json={
            "instance_id": instance_id,
            "type": "vLLM",
            "modelname": "qwen",
            "block_size": 4,
            "dp_rank": dp_rank,
        },
        headers=headers,
    )


def events(client, events, instance_id="vllm-prefill-1", headers=None, **kw):
    return client.simulate_post(
        "/events", json={"instance_id": instance_id, "events": events, **kw}, headers=headers
    )


def stored(event_id, hashes, tokens, parent=None, medium="GPU", dp_rank=0):
    return {
        "event_id": event_id,
        "dp_rank": dp_rank,
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "medium": medium,
    }


def query(client, tokens, model="qwen", tenant=None, block_size=4, expect=200):
    body = {"model": model, "block_size": block_size, "token_ids": tokens}
    if tenant is not None:
        body["tenant_id"] = tenant
    r = client.simulate_post("/query", json=body)
    assert r.status_code == expect, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json
