"""Node-level KV pools (YuanRong CPU/Disk published once per node) through the real server.

The newest Coordinator registers each engine DP with only its HBM publisher
(``{"npu": url}``) and, once per (node, model), a pool registration with only CPU/Disk
publishers (``yuanrong-pool-<ip>-<model>``). The pool's blocks belong to every DP
registered with an HBM URL on that node, never to the pool itself. The previous
Coordinator generation registered the CPU/Disk ports per DP; both shapes are served.

Two nodes are two loopback addresses (127.0.0.1 and 127.0.0.2). Every expectation is
computed by hand from the published chains (block size 4).
"""

from __future__ import annotations

import pytest

from tests.helpers.faults import pool_event, publish_until, source
from tests.helpers.publishers import FakePublisher, PoolPublisher, schema
from tests.helpers.server import register_engine, registration, started, workers

BS = 4
V = schema("vllm", "0.33.0")
NODE_A, NODE_B = "127.0.0.1", "127.0.0.2"
TOKENS_A = list(range(100, 116))  # 4 blocks
HASHES_A = [0xA00 + i for i in range(4)]
TOKENS_B = list(range(200, 212))  # 3 blocks
HASHES_B = [0xB00 + i for i in range(3)]
TOKENS_C = list(range(300, 316))  # 4 blocks
HASHES_C = [0xC00 + i for i in range(4)]


@pytest.fixture
def server(tmp_path):
    with started(tmp_path) as srv:
        yield srv


def engine(pubs, host: str = NODE_A) -> FakePublisher:
    p = FakePublisher(replay=False, host=host)
    pubs.append(p)
    return p


def pool(pubs, host: str = NODE_A) -> PoolPublisher:
    p = PoolPublisher(host=host)
    pubs.append(p)
    return p


def register(srv, instance_id: str, dp: int, media: dict) -> None:
    register_engine(srv, instance_id, dp, store_backend="YuanRong", medium_endpoints=media)


def node_pool_id(ip: str) -> str:
    return f"yuanrong-pool-{ip}-qwen"


def register_node_pool(srv, ip: str, url: str) -> None:
    """The newest Coordinator's node pool: CPU and Disk on one port, DP rank 0."""
    register(srv, node_pool_id(ip), 0, {"cpu": url, "disk": url})


def answer(srv, tokens) -> dict:
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens})
    assert r.status_code == 200, r.text
    return r.json()["default"]


def dp(srv, tokens, instance_id: str, rank: int) -> dict:
    return answer(srv, tokens).get(instance_id, {}).get("DP", {}).get(str(rank), {})


def counts(matched: int, npu: int = 0, cpu: int = 0, disk: int = 0) -> dict:
    return {"matched_tokens": matched, "npu_blocks": npu, "cpu_blocks": cpu, "disk_blocks": disk}


def offload(tokens, hashes, medium: str = "CPU") -> bytes:
    """The engine's own BlockStored of blocks it moved to CPU (two-phase join, phase 1)."""
    return V.batch([V.stored(list(hashes), None, list(tokens), BS, medium=medium)])


def test_node_pool_blocks_belong_to_every_dp_of_its_node(server, pubs):
    e10, e11, e20 = engine(pubs), engine(pubs), engine(pubs, NODE_B)
    pool_a, pool_b = pool(pubs), pool(pubs, NODE_B)
    register(server, "vllm-prefill-1", 0, {"npu": e10.url})
    register(server, "vllm-prefill-1", 1, {"npu": e11.url})
    register(server, "vllm-prefill-2", 0, {"npu": e20.url})
    register_node_pool(server, NODE_A, pool_a.url)
    register_node_pool(server, NODE_B, pool_b.url)

    # DP 0 of node A holds blocks 0..1 in HBM and has offloaded 0..3 to CPU; node A's pool
    # confirms 0..3 naming its node in backend_id: both DPs of node A hold them on CPU.
    hbm = V.batch([V.stored(HASHES_A[:2], None, TOKENS_A[:8], BS, medium="GPU")])
    publish_until([(e10, hbm)], lambda: dp(server, TOKENS_A, "vllm-prefill-1", 0), "HBM indexed")
    publish_until(
        [
            (e10, offload(TOKENS_A, HASHES_A)),
            (pool_a, pool_event("stored", HASHES_A, "cpu", NODE_A)),
        ],
        lambda: dp(server, TOKENS_A, "vllm-prefill-1", 1).get("cpu_blocks") == 4,
        "node A's pool credited to its DPs",
    )
    assert answer(server, TOKENS_A) == {
        "vllm-prefill-1": {
            "longest_matched": 16,
            "DP": {"0": counts(16, npu=2, cpu=2), "1": counts(16, cpu=4)},
        }
    }
    # Node B's pool sends no backend_id: the node is the host of the pool's URL. The
    # pool's word puts the engine's CPU offload on Disk.
    publish_until(
        [(e20, offload(TOKENS_B, HASHES_B)), (pool_b, pool_event("stored", HASHES_B, "disk"))],
        lambda: dp(server, TOKENS_B, "vllm-prefill-2", 0).get("disk_blocks") == 3,
        "node B's pool credited to its DP",
    )
    assert answer(server, TOKENS_B) == {
        "vllm-prefill-2": {"longest_matched": 12, "DP": {"0": counts(12, disk=3)}}
    }
    # A removal on node A's pool: block 3 goes from both DPs of node A.
    publish_until(
        [(pool_a, pool_event("removed", HASHES_A[3:], "cpu", NODE_A))],
        lambda: dp(server, TOKENS_A, "vllm-prefill-1", 1).get("cpu_blocks") == 3,
        "pool removal applied",
    )
    assert answer(server, TOKENS_A) == {
        "vllm-prefill-1": {
            "longest_matched": 12,
            "DP": {"0": counts(12, npu=2, cpu=1), "1": counts(12, cpu=3)},
        }
    }

    # /workers: each pool is a node pool, with the node it serves and the DPs there now.
    doc = workers(server)
    by_id = {w["instance_id"]: w for w in doc["workers"]}
    assert by_id[node_pool_id(NODE_A)]["endpoints"]["0"]["pool"] == {
        "kind": "node",
        "node_ip": NODE_A,
        "serves": [
            {"instance_id": "vllm-prefill-1", "dp_rank": 0},
            {"instance_id": "vllm-prefill-1", "dp_rank": 1},
        ],
    }
    assert by_id[node_pool_id(NODE_B)]["endpoints"]["0"]["pool"] == {
        "kind": "node",
        "node_ip": NODE_B,
        "serves": [{"instance_id": "vllm-prefill-2", "dp_rank": 0}],
    }
    assert "pool" not in by_id["vllm-prefill-1"]["endpoints"]["0"]
    assert {s["instance_id"]: s["is_pool"] for s in doc["sources"]}[node_pool_id(NODE_A)]
    assert source(server, node_pool_id(NODE_A))["dropped"] == {}
    (idx,) = doc["indexer"]
    assert idx["cpu_blocks"] == 3 + 3 and idx["disk_blocks"] == 3

    # /explain: the pools are pool sources of the index, never instances holding blocks.
    ex = server.http.post(
        "/explain", json={"model": "qwen", "block_size": BS, "token_ids": TOKENS_A}
    ).json()
    assert sorted((i["instance_id"], i["dp_rank"]) for i in ex["instances"]) == [
        ("vllm-prefill-1", 0),
        ("vllm-prefill-1", 1),
        ("vllm-prefill-2", 0),
    ]
    assert sorted(s["url"] for s in ex["pool_sources"]) == sorted([pool_a.url, pool_b.url])
    assert all(s["is_pool"] for s in ex["pool_sources"])


def test_per_dp_pool_ports_of_the_previous_generation(server, pubs):
    """The previous Coordinator registered CPU/Disk per DP beside its HBM URL: each DP's
    pool port feeds that DP only, whatever ``backend_id`` its events carry, although both
    DPs are on one node."""
    e0, e1 = engine(pubs), engine(pubs)
    p0, p1 = pool(pubs), pool(pubs)
    register(server, "vllm-prefill-3", 0, {"npu": e0.url, "cpu": p0.url, "disk": p0.url})
    register(server, "vllm-prefill-3", 1, {"npu": e1.url, "cpu": p1.url, "disk": p1.url})
    publish_until(
        [(e0, offload(TOKENS_A, HASHES_A)), (p0, pool_event("stored", HASHES_A, "cpu", NODE_A))],
        lambda: dp(server, TOKENS_A, "vllm-prefill-3", 0).get("cpu_blocks") == 4,
        "DP 0's own pool port credited",
    )
    publish_until(
        [(e1, offload(TOKENS_B, HASHES_B)), (p1, pool_event("stored", HASHES_B, "disk"))],
        lambda: dp(server, TOKENS_B, "vllm-prefill-3", 1).get("disk_blocks") == 3,
        "DP 1's own pool port credited",
    )
    assert answer(server, TOKENS_A) == {
        "vllm-prefill-3": {"longest_matched": 16, "DP": {"0": counts(16, cpu=4)}}
    }
    assert answer(server, TOKENS_B) == {
        "vllm-prefill-3": {"longest_matched": 12, "DP": {"1": counts(12, disk=3)}}
    }
    eps = {w["instance_id"]: w for w in workers(server)["workers"]}["vllm-prefill-3"]["endpoints"]
    assert "pool" not in eps["0"] and "pool" not in eps["1"]


def test_node_pool_before_its_engines_and_engines_coming_and_going(server, pubs):
    """A pool event counts for the DPs registered on its node when it is applied: before
    any, it is dropped (counted, WARN); a DP registered later gets what the pool publishes
    from then on; an unregistered DP's blocks go, the others keep theirs."""
    e10, e11 = engine(pubs), engine(pubs)
    pool_a = pool(pubs)
    pid = node_pool_id(NODE_A)
    register_node_pool(server, NODE_A, pool_a.url)
    publish_until(
        [(pool_a, pool_event("stored", HASHES_A, "cpu", NODE_A))],
        lambda: source(server, pid)["dropped"].get("no_dp_on_node", 0) >= 1,
        "pool event without a DP on its node counted",
    )
    assert answer(server, TOKENS_A) == {}
    warnings = [w["message"] for w in workers(server)["recent_warnings"]]
    assert any(
        "dropped (no_dp_on_node)" in m and f"no DP is registered with an HBM URL on {NODE_A}" in m
        for m in warnings
    ), warnings
    assert workers(server)["workers"][0]["endpoints"]["0"]["pool"] == {
        "kind": "node",
        "node_ip": NODE_A,
        "serves": [],
    }

    # The first engine of the node registers: the pool's blocks are its from now on.
    register(server, "vllm-prefill-1", 0, {"npu": e10.url})
    publish_until(
        [
            (e10, offload(TOKENS_A, HASHES_A)),
            (pool_a, pool_event("stored", HASHES_A, "cpu", NODE_A)),
        ],
        lambda: dp(server, TOKENS_A, "vllm-prefill-1", 0).get("cpu_blocks") == 4,
        "pool credited to the engine registered after it",
    )
    # A second DP registers later: what the pool published before is not its.
    register(server, "vllm-prefill-1", 1, {"npu": e11.url})
    assert answer(server, TOKENS_A) == {
        "vllm-prefill-1": {"longest_matched": 16, "DP": {"0": counts(16, cpu=4)}}
    }
    # What the pool publishes now is both DPs'.
    publish_until(
        [(e11, offload(TOKENS_C, HASHES_C)), (pool_a, pool_event("stored", HASHES_C, "cpu"))],
        lambda: dp(server, TOKENS_C, "vllm-prefill-1", 1).get("cpu_blocks") == 4,
        "pool credited to both DPs",
    )
    assert answer(server, TOKENS_C) == {
        "vllm-prefill-1": {
            "longest_matched": 16,
            "DP": {"0": counts(16, cpu=4), "1": counts(16, cpu=4)},
        }
    }
    # DP 0 leaves: its blocks go with it; DP 1 keeps its own and alone takes what comes.
    r = server.http.post("/unregister", json=registration())
    assert r.status_code == 200, r.text
    assert answer(server, TOKENS_A) == {}
    publish_until(
        [(pool_a, pool_event("removed", HASHES_C[3:], "cpu", NODE_A))],
        lambda: dp(server, TOKENS_C, "vllm-prefill-1", 1).get("cpu_blocks") == 3,
        "pool removal applied to the remaining DP",
    )
    assert answer(server, TOKENS_C) == {
        "vllm-prefill-1": {"longest_matched": 12, "DP": {"1": counts(12, cpu=3)}}
    }
    assert workers(server)["workers"][1]["endpoints"]["0"]["pool"]["serves"] == [
        {"instance_id": "vllm-prefill-1", "dp_rank": 1}
    ]
    # The pool goes (the node's last DP would take it along): its subscription closes, the
    # blocks it credited stay with the DP.
    r = server.http.post("/unregister", json=registration(pid))
    assert r.status_code == 200, r.text
    doc = workers(server)
    assert [w["instance_id"] for w in doc["workers"]] == ["vllm-prefill-1"]
    assert all(s["instance_id"] != pid for s in doc["sources"])
    assert answer(server, TOKENS_C) == {
        "vllm-prefill-1": {"longest_matched": 12, "DP": {"1": counts(12, cpu=3)}}
    }
