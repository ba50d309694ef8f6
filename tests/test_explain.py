"""POST /explain (kvconductor.http.api, Conductor.explain) and ``kv-conductor explain``
(kvconductor.tools.explain): every mismatch case an operator meets is named, and the counts are
/query's.

Block size 4; tokens 1..24 are six blocks. In-process cases go through the Falcon app
with real registrations and HTTP /events; the CLI runs against a real server fed by a
ZeroMQ FakePublisher.
"""

from __future__ import annotations

import json

import falcon.testing as ft
import msgspec
import pytest

from kvconductor._hash import hash_blocks
from kvconductor.http.api import create_app
from kvconductor.schema import (
    STOP_END_OF_PROMPT,
    STOP_MUTED,
    STOP_NO_FIRST_BLOCK,
    STOP_NO_WORKER,
    STOP_NOT_HELD,
    STOP_PARENT_MISMATCH,
    STOP_TIER_EXHAUSTED,
)
from kvconductor.serve import cli
from kvconductor.tools import explain
from tests.helpers.api import events, query, register, stored

TOKENS = list(range(1, 25))

# ``conductor`` / ``client`` (tests/conftest.py): the app over a started Conductor without
# sockets, Falcon alone and behind QueryFastPath


def explain_body(client, tokens, model="qwen", block_size=4, msgpack=False, **kw):
    body = {"model": model, "block_size": block_size, "token_ids": tokens, **kw}
    if msgpack:
        r = client.simulate_post(
            "/explain",
            body=msgspec.msgpack.encode(body),
            headers={"Content-Type": "application/msgpack"},
        )
        assert r.headers["content-type"] == "application/msgpack"
        return r.status_code, msgspec.msgpack.decode(r.content)
    r = client.simulate_post("/explain", json=body)
    assert r.headers["content-type"] == "application/json"
    return r.status_code, r.json


def instance(doc, iid, dp=0):
    (row,) = [i for i in doc["instances"] if i["instance_id"] == iid and i["dp_rank"] == dp]
    return row


def counts(row):
    return row["npu_blocks"], row["cpu_blocks"], row["disk_blocks"]


def query_counts(client, tokens, iid, dp=0, **kw):
    e = query(client, tokens, **kw).get("default", {}).get(iid, {}).get("DP", {}).get(str(dp))
    return (0, 0, 0) if e is None else (e["npu_blocks"], e["cpu_blocks"], e["disk_blocks"])


def store(client, iid, eid, hashes, tokens, parent=None, medium="GPU", dp_rank=0, **kw):
    r = events(client, [stored(eid, hashes, tokens, parent, medium, dp_rank)], iid, **kw)
    assert r.status_code == 200, r.text


def test_unknown_model_has_no_index(client):
    register(client)
    st, doc = explain_body(client, TOKENS, model="llama")
    assert st == 200
    assert doc["index_found"] is False and doc["instances"] == []
    assert doc["registered_block_sizes"] == [] and doc["query_blocks"] == 6
    assert "no index for model=llama tenant=default" in doc["warnings"][0]
    # an unknown tenant of a known model too
    st, doc = explain_body(client, TOKENS, tenant_id="acme")
    assert doc["index_found"] is False and "tenant=acme" in doc["warnings"][0]


def test_block_size_mismatch_names_the_registered_sizes(client):
    register(client)
    store(client, "vllm-prefill-1", 1, [101, 102], TOKENS[:8])
    st, doc = explain_body(client, TOKENS, block_size=16)
    assert st == 200 and doc["index_found"] is True
    assert doc["registered_block_sizes"] == [4] and doc["query_blocks"] == 2
    assert doc["warnings"][0].startswith("block_size 16 matches no registration of model=qwen")
    assert "(registered block sizes: 4)" in doc["warnings"][0]
    row = instance(doc, "vllm-prefill-1")
    assert counts(row) == (0, 0, 0)
    assert row["tiers"]["npu"] == {
        "blocks": 0,
        "at_block": 0,
        "stop": STOP_NO_FIRST_BLOCK,
        "held": 2,
    }


def test_partial_prefix_stops_where_the_cache_ends_and_counts_equal_query(client):
    register(client)
    register(client, "vllm-prefill-2")
    store(client, "vllm-prefill-1", 1, [101, 102, 103], TOKENS[:12])
    store(client, "vllm-prefill-2", 1, [201, 202], TOKENS[:8])
    for msgpack in (False, True):
        st, doc = explain_body(client, TOKENS, msgpack=msgpack)
        assert st == 200
        one, two = instance(doc, "vllm-prefill-1"), instance(doc, "vllm-prefill-2")
        assert counts(one) == (3, 0, 0) == query_counts(client, TOKENS, "vllm-prefill-1")
        assert counts(two) == (2, 0, 0) == query_counts(client, TOKENS, "vllm-prefill-2")
        # nobody holds block 3: the cache ends there; block 2 is held by prefill-1 only
        assert one["tiers"]["npu"] == {
            "blocks": 3,
            "at_block": 3,
            "stop": STOP_TIER_EXHAUSTED,
            "held": 3,
        }
        assert two["tiers"]["npu"]["stop"] == STOP_NOT_HELD
        assert two["tiers"]["npu"]["at_block"] == 2
        # no CPU or Disk worker: the walk cannot go further there
        assert one["tiers"]["cpu"] == {
            "blocks": 0,
            "at_block": 3,
            "stop": STOP_NO_WORKER,
            "held": 0,
        }
        assert one["workers"] == [
            {
                "medium": "npu",
                "backend_id": "vllm-prefill-1",
                "held": 3,
                "at_block": 3,
                "stop": STOP_TIER_EXHAUSTED,
            }
        ]
        assert one["registered"] is True and one["block_size"] == 4
    st, doc = explain_body(client, TOKENS[:12])
    assert instance(doc, "vllm-prefill-1")["tiers"]["npu"]["stop"] == STOP_END_OF_PROMPT


def test_a_block_under_another_parent_is_a_parent_mismatch(client):
    register(client)
    # the engine holds blocks 1..3 of the prompt, but after a different first block
    store(client, "vllm-prefill-1", 1, [100, 102, 103], [9, 9, 9, 9] + TOKENS[4:12])
    st, doc = explain_body(client, TOKENS)
    row = instance(doc, "vllm-prefill-1")
    assert counts(row) == (0, 0, 0) == query_counts(client, TOKENS, "vllm-prefill-1")
    # block 0 differs (nobody has it as a first block); from block 1 on: another parent
    assert row["tiers"]["npu"]["stop"] == STOP_NO_FIRST_BLOCK
    store(client, "vllm-prefill-1", 2, [101], TOKENS[:4])
    st, doc = explain_body(client, TOKENS)
    row = instance(doc, "vllm-prefill-1")
    assert counts(row) == (1, 0, 0) == query_counts(client, TOKENS, "vllm-prefill-1")
    assert row["tiers"]["npu"] == {
        "blocks": 1,
        "at_block": 1,
        "stop": STOP_PARENT_MISMATCH,
        "held": 4,
    }


def test_lora_blocks_do_not_match_base_model_queries(client):
    register(client)
    r = events(
        client,
        [stored(1, [101, 102], TOKENS[:8]) | {"lora_name": "sql-adapter"}],
        "vllm-prefill-1",
    )
    assert r.status_code == 200, r.text
    st, doc = explain_body(client, TOKENS[:8])
    row = instance(doc, "vllm-prefill-1")
    assert counts(row) == (0, 0, 0)
    assert row["tiers"]["npu"]["stop"] == STOP_NO_FIRST_BLOCK
    assert any("lora_name" in w and "first block" in w for w in doc["warnings"])
    st, doc = explain_body(client, TOKENS[:8], lora_name="sql-adapter")
    row = instance(doc, "vllm-prefill-1")
    assert doc["lora_name"] == "sql-adapter"
    assert counts(row) == (2, 0, 0) and row["tiers"]["npu"]["stop"] == STOP_END_OF_PROMPT


def test_engine_offload_without_pool_confirmation(client, conductor):
    register(client)
    store(client, "vllm-prefill-1", 1, [101, 102], TOKENS[:8])
    # the engine moves blocks 2..3 to CPU (phase 1 of a ZeroMQ offload); no pool confirms
    idx = conductor.get_index("qwen", "default")
    conductor.call(idx.offload, [103, 104], list(hash_blocks(TOKENS[8:16], 4)), 102)
    st, doc = explain_body(client, TOKENS[:16])
    row = instance(doc, "vllm-prefill-1")
    assert counts(row) == (2, 0, 0) == query_counts(client, TOKENS[:16], "vllm-prefill-1")
    assert doc["offload_pending"] == 2
    assert row["tiers"]["cpu"]["stop"] == STOP_NO_WORKER
    assert any("await a pool's confirmation" in w for w in doc["warnings"])


def test_data_under_an_unregistered_dp_rank(client):
    register(client, dp_rank=0)
    register(client, dp_rank=1)
    # DP 1's events arrive labelled as DP 2 (a publisher on the wrong port offset)
    store(client, "vllm-prefill-1", 1, [101, 102], TOKENS[:8], dp_rank=2)
    st, doc = explain_body(client, TOKENS[:8])
    dp1, dp2 = instance(doc, "vllm-prefill-1", 1), instance(doc, "vllm-prefill-1", 2)
    assert dp1["registered"] is True and counts(dp1) == (0, 0, 0)
    assert dp1["tiers"]["npu"]["stop"] == STOP_NO_WORKER
    assert dp2["registered"] is False and dp2["block_size"] is None and counts(dp2) == (2, 0, 0)
    assert any("DP 1 holds no blocks" in w for w in doc["warnings"])
    assert any("DP 2 holds blocks in this index but no registration" in w for w in doc["warnings"])


def test_a_muted_dp_is_named(client, conductor):
    register(client)
    store(client, "vllm-prefill-1", 1, [101, 102], TOKENS[:8])
    idx = conductor.get_index("qwen", "default")
    (key,) = idx.workers_of("vllm-prefill-1", 0)
    conductor.call(idx.set_muted, key, True)
    st, doc = explain_body(client, TOKENS[:8])
    row = instance(doc, "vllm-prefill-1")
    assert counts(row) == (0, 0, 0) == query_counts(client, TOKENS[:8], "vllm-prefill-1")
    assert row["tiers"]["npu"] == {"blocks": 0, "at_block": 0, "stop": STOP_MUTED, "held": 2}
    assert any("vllm-prefill-1 DP 0 is muted" in w for w in doc["warnings"])


@pytest.mark.parametrize(
    "body",
    [b"{", b'{"model": "qwen", "block_size": 0, "token_ids": [1]}', b'{"model": "qwen"}', b"[]"],
)
def test_bad_bodies_get_the_same_400_as_query(client, body):
    q = client.simulate_post("/query", body=body, headers={"Content-Type": "application/json"})
    e = client.simulate_post("/explain", body=body, headers={"Content-Type": "application/json"})
    assert q.status_code == e.status_code == 400
    assert q.json == e.json
    mq = client.simulate_post(
        "/query", body=b"\xc1", headers={"Content-Type": "application/msgpack"}
    )
    me = client.simulate_post(
        "/explain", body=b"\xc1", headers={"Content-Type": "application/msgpack"}
    )
    assert mq.status_code == me.status_code == 400
    assert me.headers["content-type"] == "application/msgpack"
    assert msgspec.msgpack.decode(mq.content) == msgspec.msgpack.decode(me.content)


def test_explain_is_protected_like_workers(conductor):
    body = {"model": "qwen", "block_size": 4, "token_ids": [1, 2, 3, 4]}
    app = ft.TestClient(create_app(conductor, api_key="s3cret"))
    assert app.simulate_post("/explain", json=body).status_code == 401
    ok = app.simulate_post("/explain", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json["index_found"] is False
    app = ft.TestClient(create_app(conductor, api_key="s3cret", open_workers=True))
    assert app.simulate_post("/explain", json=body).status_code == 200


# -- the CLI -----------------------------------------------------------------------------


def test_parse_tokens():
    assert explain.parse_tokens("[1, 2, 3]") == [1, 2, 3]
    assert explain.parse_tokens(" 1,2 3\n4, ") == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        explain.parse_tokens("[1, true]")
    with pytest.raises(ValueError):
        explain.parse_tokens("1 x")


def test_report_lines():
    doc = {
        "model": "qwen",
        "tenant": "default",
        "lora_name": None,
        "index_found": True,
        "block_size": 4,
        "registered_block_sizes": [4],
        "query_blocks": 6,
        "warnings": ["something"],
        "pool_sources": [],
        "instances": [
            {
                "instance_id": "e1",
                "dp_rank": 0,
                "registered": True,
                "npu_blocks": 3,
                "cpu_blocks": 0,
                "disk_blocks": 0,
                "tiers": {
                    t: {"blocks": b, "at_block": 3, "stop": s, "held": 3}
                    for t, b, s in (
                        ("npu", 3, STOP_TIER_EXHAUSTED),
                        ("cpu", 0, STOP_NO_WORKER),
                        ("disk", 0, STOP_NO_WORKER),
                    )
                },
                "sources": [
                    {
                        "url": "tcp://h:5557",
                        "media": ["npu"],
                        "state": "live",
                        "events": 2,
                        "last_event_age_s": 1.25,
                    }
                ],
            }
        ],
    }
    assert explain.report(doc) == [
        "model=qwen tenant=default block_size=4 query_blocks=6",
        "index: found; registered block sizes: 4",
        "e1 DP 0: 3 blocks: npu 3 (to block 3: tier_exhausted, nothing cached after this "
        "prefix in the tier); cpu 0 (to block 3: no_worker, no worker on this tier); "
        "disk 0 (to block 3: no_worker, no worker on this tier)",
        "    source tcp://h:5557 (npu): live, 2 events, last event 1.2s ago",
        "warning: something",
    ]
    # a source that lost batches and dropped events says what and why under its line
    src = doc["instances"][0]["sources"][0]
    src.update(
        state="degraded",
        losses=1,
        degraded_since=1796140800.0,
        last_loss={"at": 1796140800.0, "why": "batches 0..46 were published before ..."},
        dropped={"parent_not_found": 13, "replay_failed": 1},
    )
    doc["pool_sources"] = [
        {
            "url": "tcp://p:6000",
            "state": "live",
            "events": 5,
            "losses": 2,
            "degraded_since": None,
            "last_loss": {"at": 1796140860.0, "why": "gap 3 -> 5 and no replay endpoint"},
            "dropped": {},
        },
    ]
    assert explain.report(doc)[3:-1] == [
        "    source tcp://h:5557 (npu): degraded, 2 events, last event 1.2s ago",
        "        1 loss(es), degraded since 2026-12-01 16:00:00 UTC; last: batches 0..46 were "
        "published before ... (at 2026-12-01 16:00:00 UTC)",
        "        13 events dropped (parent_not_found: blocks stored after a parent block this "
        "source never announced, lost or published before it connected; not indexed)",
        "        1 events dropped (replay_failed: the replay endpoint did not answer in full)",
        "pool source tcp://p:6000: live, 5 events",
        "    2 loss(es), live again; last: gap 3 -> 5 and no replay endpoint (at 2026-12-01 "
        "16:01:00 UTC)",
    ]


def test_cli_against_a_live_server(tmp_path, capsys):
    from tests.helpers.publishers import FakePublisher, schema, wait_until
    from tests.helpers.server import Server, register_engine

    srv = Server(tmp_path)
    pub = FakePublisher(replay=False)
    try:
        srv.wait_ready()
        register_engine(srv, "vllm-prefill-1", medium_endpoints={"npu": pub.url})
        v = schema("vllm", "0.33.0")
        batch = v.batch([v.stored([0xA0, 0xA1, 0xA2], None, TOKENS[:12], 4, medium="GPU")])
        body = {"model": "qwen", "block_size": 4, "token_ids": TOKENS}

        def indexed():
            pub.publish(batch)
            doc = srv.http.post("/explain", json=body).json()
            return [i["npu_blocks"] for i in doc["instances"]] == [3]

        pub.wait_subscribed()
        wait_until(indexed, msg="blocks indexed")
        q = srv.http.post("/query", json=body).json()
        assert q["default"]["vllm-prefill-1"]["DP"]["0"]["npu_blocks"] == 3
        tokens_file = tmp_path / "tokens.txt"
        tokens_file.write_text(" ".join(map(str, TOKENS)))
        args = ["--url", srv.url, "--model", "qwen", "--block-size", "4"]
        assert explain.main([*args, "--tokens-file", str(tokens_file)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "model=qwen tenant=default block_size=4 query_blocks=6"
        assert out[1] == "index: found; registered block sizes: 4"
        assert out[2].startswith("vllm-prefill-1 DP 0: 3 blocks: npu 3 (to block 3: tier_exhausted")
        assert out[3].startswith(f"    source {pub.url} (npu): live, ")
        # through `kv-conductor explain` (the CLI dispatches to kvconductor.tools.explain)
        assert cli.main(["explain", *args, "--tokens", json.dumps(TOKENS), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["instances"][0]["tiers"]["npu"]["stop"] == STOP_TIER_EXHAUSTED
        # an HTTP error: one line, exit 1
        assert explain.main([*args, "--block-size", "0", "--tokens", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("kv-conductor explain: HTTP 400 from ") and err.count("\n") == 1
    finally:
        pub.stop()
        srv.terminate()
    # an unreadable tokens file: exit 2
    assert (
        explain.main(["--url", srv.url, "--model", "q", "--tokens-file", str(tmp_path / "none")])
        == 2
    )
    assert capsys.readouterr().err.startswith("kv-conductor explain: error: ")
    # nobody listens any more: exit 1, one line
    assert explain.main(["--url", srv.url, "--model", "qwen", "--tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kv-conductor explain: cannot reach ") and err.count("\n") == 1
