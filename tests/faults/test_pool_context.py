"""A cluster pool's blocks belong only to the DPs of their (model, tenant), through the
real server, real ZeroMQ publishers and both HTTP dialects (issue 36, row 17).

One node (127.0.0.1) hosts three engines: ``a1`` (model m1, tenant A), ``b1`` (m1,
tenant B) and ``a2`` (m2, tenant A). Each holds blocks 0..1 of one prompt in HBM and has
offloaded blocks 0..3 to CPU (the two-phase join's phase 1). A Mooncake store publisher
registered over the Mooncake dialect for (m1, A) confirms blocks 0..3 naming the node in
``backend_id``. Only ``a1`` holds them on CPU: ``b1`` and ``a2`` appear in no other
context's answer and hold nothing on CPU in their own. Expected values by hand (block
size 4, 16 tokens): a1 holds 2 HBM + 2 more CPU blocks = Mooncake's gpu 8, cpu 16.
"""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.publishers import (
    FakePublisher,
    PoolPublisher,
    mooncake_tuple,
    schema,
    wait_until,
)
from tests.helpers.server import Server, free_port

BS = 4
V = schema("vllm", "0.33.0")
NODE = "127.0.0.1"
TOKENS = list(range(100, 116))  # 4 blocks
HASHES = [0x5100 + i for i in range(4)]
ENGINES = {"a1": ("m1", "A"), "b1": ("m1", "B"), "a2": ("m2", "A")}


@pytest.fixture
def server(tmp_path):
    port = free_port()
    srv = Server(tmp_path, "--mooncake-port", str(port))
    srv.wait_ready()
    srv.mc = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
    yield srv
    srv.mc.close()
    srv.terminate()


@pytest.fixture
def pubs():
    made: list = []
    yield made
    for p in made:
        p.stop()


def mc_register(
    srv, instance_id: str, kind: str, url: str, model: str, tenant: str, **extra
) -> None:
    body = {
        "endpoint": url,
        "type": kind,
        "modelname": model,
        "tenant_id": tenant,
        "instance_id": instance_id,
        "block_size": BS,
        "dp_rank": 0,
        **extra,
    }
    r = srv.mc.post("/register", json=body)
    assert r.status_code == 200, r.text


def mc_query(srv, model: str, tenant: str, lora: str = "") -> dict:
    body = {"model": model, "tenant_id": tenant, "block_size": BS, "token_ids": TOKENS}
    if lora:
        body["lora_name"] = lora
    r = srv.mc.post("/query", json=body)
    assert r.status_code == 200, r.text
    return {
        iid: {r: (m["gpu"], m["cpu"], m["disk"]) for r, m in inst["rank_matches"].items()}
        for iid, inst in r.json()["instances"].items()
    }


def v3_query(srv, model: str, tenant: str) -> dict:
    body = {"model": model, "tenant_id": tenant, "block_size": BS, "token_ids": TOKENS}
    r = srv.http.post("/query", json=body)
    if r.status_code == 404:
        return {}
    assert r.status_code == 200, r.text
    return {
        iid: {d: (c["npu_blocks"], c["cpu_blocks"]) for d, c in inst["DP"].items()}
        for iid, inst in r.json()[tenant].items()
    }


def pool_event(kind: str, hashes, **fields) -> bytes:
    ev = {"event_id": 1, "event_type": kind, "medium": "cpu", "seq_hashes": list(hashes)}
    ev.update(fields)
    return mooncake_tuple([ev])


def publish_until(pairs, cond, msg: str) -> None:
    for pub, _ in pairs:
        pub.wait_subscribed()

    def step():
        for pub, payload in pairs:
            pub.publish(payload)
        return cond()

    wait_until(step, msg=msg)


def engines(server, pubs) -> dict[str, FakePublisher]:
    """The three engines, registered over the Mooncake dialect, each with blocks 0..1 in
    HBM and 0..3 offloaded to CPU (phase 1, waiting for the pool's word)."""
    out = {}
    for iid, (model, tenant) in ENGINES.items():
        p = FakePublisher(replay=False, host=NODE)
        pubs.append(p)
        mc_register(server, iid, "vLLM", p.url, model, tenant)
        out[iid] = p
    hbm = V.batch([V.stored(HASHES[:2], None, TOKENS[:8], BS, medium="GPU")])
    cpu = V.batch([V.stored(HASHES, None, TOKENS, BS, medium="CPU")])
    for iid, (model, tenant) in ENGINES.items():
        publish_until(
            [(out[iid], hbm)],
            lambda m=model, t=tenant, i=iid: (
                mc_query(server, m, t).get(i, {}).get("0") == (8, 8, 8)
            ),
            f"{iid}'s HBM blocks indexed",
        )
        out[iid].publish(cpu)
    return out


def test_pool_blocks_go_only_to_the_dps_of_their_model_and_tenant(server, pubs):
    engines(server, pubs)
    store = PoolPublisher(host=NODE)
    pubs.append(store)
    mc_register(server, "mooncake-store", "Mooncake", store.url, "m1", "A")

    # The store names its context in the event (Mooncake's publisher sends model_name
    # from its configuration and tenant_id per object).
    confirm = pool_event("stored", HASHES, backend_id=NODE, model_name="m1", tenant_id="A")
    publish_until(
        [(store, confirm)],
        lambda: mc_query(server, "m1", "A").get("a1", {}).get("0") == (8, 16, 16),
        "the store's blocks credited to a1",
    )
    # (one event is applied at once: whatever else it credited is in place too)
    assert mc_query(server, "m1", "A") == {"a1": {"0": (8, 16, 16)}}
    assert mc_query(server, "m1", "B") == {"b1": {"0": (8, 8, 8)}}
    assert mc_query(server, "m2", "A") == {"a2": {"0": (8, 8, 8)}}
    # V3 says the same, in exclusive blocks.
    assert v3_query(server, "m1", "A") == {"a1": {"0": (2, 2)}}
    assert v3_query(server, "m1", "B") == {"b1": {"0": (2, 0)}}
    assert v3_query(server, "m2", "A") == {"a2": {"0": (2, 0)}}

    # Without model_name/tenant_id the pool registration's (m1, A) is the context.
    gone = pool_event("removed", HASHES[3:], backend_id=NODE)
    publish_until(
        [(store, gone)],
        lambda: mc_query(server, "m1", "A")["a1"]["0"] == (8, 12, 12),
        "the store's removal applied to a1",
    )
    assert mc_query(server, "m1", "B") == {"b1": {"0": (8, 8, 8)}}
    assert mc_query(server, "m2", "A") == {"a2": {"0": (8, 8, 8)}}

    # An event of a context with no DP on the node is dropped, counted and said.
    other = pool_event("stored", HASHES, backend_id=NODE, model_name="m3", tenant_id="A")
    publish_until(
        [(store, other)],
        lambda: source(server, "mooncake-store")["dropped"].get("no_dp_of_pool_context"),
        "the m3 event dropped",
    )
    assert "no_dp_of_pool_context" in server.log()
    assert mc_query(server, "m2", "A") == {"a2": {"0": (8, 8, 8)}}


def cpu_blocks(srv, model: str, tenant: str) -> int:
    """The CPU blocks of the (model, tenant) index (``/workers`` ``indexer[]``)."""
    for idx in srv.http.get("/workers").json()["indexer"]:
        if (idx["model_name"], idx["tenant_id"]) == (model, tenant):
            return idx["cpu_blocks"]
    return 0


def source(srv, instance_id: str) -> dict:
    (s,) = [
        s for s in srv.http.get("/workers").json()["sources"] if s["instance_id"] == instance_id
    ]
    return s


def test_v3_pool_of_the_coordinator_placeholder_model(server, pubs):
    """A V3 Mooncake pool registered with the Coordinator's ``default`` model: an event
    naming its model goes to that model's DPs only; one naming none goes to the DPs of
    the pool's tenant when they are of one model, and to none when they are of several."""
    engines(server, pubs)
    store = PoolPublisher(host=NODE)
    pubs.append(store)
    r = server.http.post(
        "/register",
        json={
            "instance_id": "mooncake-pool",
            "type": "vLLM",
            "store_backend": "Mooncake",
            "modelname": "default",
            "tenant_id": "A",
            "block_size": BS,
            "dp_rank": 0,
            "endpoint": store.url,
        },
    )
    assert r.status_code == 201, r.text
    confirm = pool_event("stored", HASHES, backend_id=NODE, model_name="m2")
    publish_until(
        [(store, confirm)],
        lambda: mc_query(server, "m2", "A").get("a2", {}).get("0") == (8, 16, 16),
        "the pool's m2 blocks credited to a2",
    )
    assert mc_query(server, "m1", "A") == {"a1": {"0": (8, 8, 8)}}
    assert mc_query(server, "m1", "B") == {"b1": {"0": (8, 8, 8)}}
    # no model named: tenant A has DPs of m1 and m2 on the node: ambiguous, none credited
    publish_until(
        [(store, pool_event("stored", HASHES, backend_id=NODE))],
        lambda: source(server, "mooncake-pool")["dropped"].get("pool_context_ambiguous"),
        "the ambiguous event dropped",
    )
    assert mc_query(server, "m1", "A") == {"a1": {"0": (8, 8, 8)}}


# -- row 18: unregistering removes a DP's blocks from every index -----------------------------


def v3_register(srv, instance_id: str, model: str, tenant: str, media: dict, **extra) -> None:
    body = {
        "instance_id": instance_id,
        "type": "vLLM",
        "modelname": model,
        "tenant_id": tenant,
        "block_size": BS,
        "dp_rank": 0,
        "medium_endpoints": media,
        **extra,
    }
    r = srv.http.post("/register", json=body)
    assert r.status_code == 201, r.text


def test_unregister_removes_the_dp_from_every_index(server, pubs):
    """``e1`` (m1, A) has its own pool port (the previous YuanRong Coordinator's per-DP
    registration); its pool names the model ``mx`` in its events, which is where the
    blocks are credited: ``e1`` holds them on CPU in (mx, A), joined with the offload of
    ``f1``, an engine of (mx, A). Unregistered (over V3, then over the Mooncake dialect),
    ``e1`` leaves (mx, A) too; registered again and confirmed again, it holds exactly the
    four blocks once (cpu 16 tokens, never 32)."""
    ef, ee, pp = (FakePublisher(replay=False, host=NODE) for _ in range(3))
    pubs.extend([ef, ee, pp])
    mc_register(server, "f1", "vLLM", ef.url, "mx", "A")
    e1_media = {"npu": ee.url, "cpu": pp.url}
    v3_register(server, "e1", "m1", "A", e1_media, store_backend="YuanRong")
    hbm = V.batch([V.stored(HASHES[:2], None, TOKENS[:8], BS, medium="GPU")])
    publish_until(
        [(ef, hbm)], lambda: mc_query(server, "mx", "A").get("f1"), "f1's HBM blocks indexed"
    )
    ef.publish(V.batch([V.stored(HASHES, None, TOKENS, BS, medium="CPU")]))
    confirm = pool_event("stored", HASHES, model_name="mx", tenant_id="A")

    def credited() -> bool:
        return mc_query(server, "mx", "A").get("e1", {}).get("0") == (0, 16, 16)

    publish_until([(pp, confirm)], credited, "e1 credited in (mx, A)")
    assert mc_query(server, "mx", "A") == {"f1": {"0": (8, 8, 8)}, "e1": {"0": (0, 16, 16)}}
    assert v3_query(server, "mx", "A") == {"f1": {"0": (2, 0)}, "e1": {"0": (0, 4)}}

    unreg = {"instance_id": "e1", "type": "vLLM", "modelname": "m1", "block_size": BS}
    r = server.http.post("/unregister", json={**unreg, "tenant_id": "A", "dp_rank": 0})
    assert r.status_code == 200, r.text
    assert v3_query(server, "mx", "A") == {"f1": {"0": (2, 0)}}
    assert "e1" not in mc_query(server, "mx", "A")
    assert "blocks[mx/A]=4" in server.log()

    # Registered again: the pool's word counts once, as the first time.
    v3_register(server, "e1", "m1", "A", e1_media, store_backend="YuanRong")
    publish_until([(pp, confirm)], credited, "e1 credited again")
    pp.publish(confirm)
    pp.publish(confirm)
    publish_until(
        [(ef, hbm)], lambda: v3_query(server, "mx", "A")["e1"] == {"0": (0, 4)}, "settled"
    )
    assert v3_query(server, "mx", "A") == {"f1": {"0": (2, 0)}, "e1": {"0": (0, 4)}}

    # The Mooncake dialect's /unregister takes the same path.
    r = server.mc.post("/unregister", json={"instance_id": "e1", "tenant_id": "A", "dp_rank": 0})
    assert r.status_code == 200, r.text
    assert mc_query(server, "mx", "A") == {"f1": {"0": (8, 8, 8)}}


# -- row 19: a Mooncake store as Mooncake's docs set it up ------------------------------------


def store_events(kind: str, hashes, **fields) -> bytes:
    """What Mooncake's store publisher sends (its publisher design): one event per
    object, ``backend_id`` its configured name, ``model_name``/``block_size`` from its
    configuration, ``tenant_id`` per object, the engine's block hash as the key, no
    parent, no token ids; the legacy ``type`` alias beside ``event_type``."""
    legacy = {"stored": "BlockStored", "removed": "BlockRemoved"}[kind]
    return mooncake_tuple(
        [
            {
                "event_type": kind,
                "type": legacy,
                "backend_id": "pool-a",
                "model_name": "m",
                "block_size": BS,
                "tenant_id": "A",
                "medium": "cpu",
                "seq_hashes": [h],
                "block_hashes": [h],
                "parent_block_hash": None,
                "token_ids": None,
                **fields,
            }
            for h in hashes
        ]
    )


def test_a_mooncake_store_is_shared_by_its_context(server, pubs):
    """``pa`` and ``pb`` serve (m, A), ``pc`` serves (m, B); the engines send no CPU
    event. ``pa`` holds blocks 0..3 in HBM when the store announces them, then keeps
    0..1. Mooncake's conductor answers every rank of (m, A) from the shared store: pa gpu
    8, cpu 16; pb gpu 0, cpu 16 (its HBM run stops at 0 and goes on in the store); pc, of
    tenant B, nothing."""
    ea, eb, ec = (FakePublisher(replay=False, host=NODE) for _ in range(3))
    store = PoolPublisher(host=NODE)
    pubs.extend([ea, eb, ec, store])
    mc_register(server, "pa", "vLLM", ea.url, "m", "A")
    mc_register(server, "pb", "vLLM", eb.url, "m", "A")
    mc_register(server, "pc", "vLLM", ec.url, "m", "B")
    mc_register(server, "mooncake-store", "Mooncake", store.url, "m", "A")
    full = V.batch([V.stored(HASHES, None, TOKENS, BS, medium="GPU")])
    publish_until(
        [(ea, full)],
        lambda: mc_query(server, "m", "A").get("pa", {}).get("0") == (16, 16, 16),
        "pa's HBM blocks indexed",
    )
    publish_until(
        [(store, store_events("stored", HASHES))],
        lambda: mc_query(server, "m", "A")["pb"]["0"] == (0, 16, 16),
        "the store's blocks shared by (m, A)",
    )
    evict = V.batch([V.removed(HASHES[2:], medium="GPU")])
    publish_until(
        [(ea, evict)],
        lambda: mc_query(server, "m", "A")["pa"]["0"][0] == 8,
        "pa's HBM eviction",
    )
    assert mc_query(server, "m", "A") == {"pa": {"0": (8, 16, 16)}, "pb": {"0": (0, 16, 16)}}
    assert mc_query(server, "m", "B") == {"pc": {"0": (0, 0, 0)}}
    assert v3_query(server, "m", "A") == {"pa": {"0": (2, 2)}, "pb": {"0": (0, 4)}}

    # A removal leaves every rank of the context; another tenant's object none of (m, A).
    publish_until(
        [(store, store_events("removed", HASHES[3:]))],
        lambda: mc_query(server, "m", "A")["pb"]["0"] == (0, 12, 12),
        "the store's removal",
    )
    assert mc_query(server, "m", "A") == {"pa": {"0": (8, 12, 12)}, "pb": {"0": (0, 12, 12)}}
    src = source(server, "mooncake-store")
    assert src["dropped"] == {}
    workers = {w["instance_id"]: w for w in server.http.get("/workers").json()["workers"]}
    assert workers["mooncake-store"]["endpoints"]["0"]["pool"] == {"kind": "shared"}

    publish_until(
        [(store, store_events("stored", HASHES, tenant_id="Z"))],
        lambda: source(server, "mooncake-store")["dropped"].get("no_dp_of_pool_context"),
        "the tenant Z objects dropped",
    )
    assert mc_query(server, "m", "B") == {"pc": {"0": (0, 0, 0)}}


def test_shared_store_is_refused_on_an_engine_registration(server):
    r = server.http.post(
        "/register",
        json={
            "instance_id": "e",
            "type": "vLLM",
            "modelname": "m",
            "block_size": BS,
            "dp_rank": 0,
            "medium_endpoints": {"npu": "tcp://127.0.0.1:5557"},
            "shared_store": True,
        },
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": "shared_store applies to a cluster pool: store_backend Mooncake or Memcache "
        "with its publisher in endpoint and no medium_endpoints"
    }
    assert "shared_store applies to a cluster pool" in server.log()


def test_a_store_of_one_lora_adapter_is_not_the_base_models(server, pubs):
    """``la`` serves adapter ``ad-1`` of (m, A), ``lb`` the base model, on one node; the
    store is registered for ``ad-1``. Only ``la`` holds its blocks: the ``ad-1`` answer
    lists ``la`` alone (Mooncake's: the ranks of that adapter's context), the base
    model's answer shows ``lb`` with nothing."""
    ea, eb = (FakePublisher(replay=False, host=NODE) for _ in range(2))
    store = PoolPublisher(host=NODE)
    pubs.extend([ea, eb, store])
    mc_register(server, "la", "vLLM", ea.url, "m", "A", lora_name="ad-1")
    mc_register(server, "lb", "vLLM", eb.url, "m", "A")
    mc_register(server, "lora-store", "Mooncake", store.url, "m", "A", lora_name="ad-1")
    full = V.batch([V.stored(HASHES, None, TOKENS, BS, medium="GPU", lora_name="ad-1")])
    publish_until(
        [(ea, full)],
        lambda: mc_query(server, "m", "A", "ad-1").get("la", {}).get("0") == (16, 16, 16),
        "la's adapter blocks indexed",
    )
    publish_until(
        [(store, store_events("stored", HASHES, lora_name="ad-1"))],
        lambda: cpu_blocks(server, "m", "A") == 4,
        "the store's adapter blocks applied",
    )
    publish_until(
        [(ea, V.batch([V.removed(HASHES[2:], medium="GPU")]))],
        lambda: mc_query(server, "m", "A", "ad-1")["la"]["0"][0] == 8,
        "la's HBM eviction",
    )
    assert mc_query(server, "m", "A", "ad-1") == {"la": {"0": (8, 16, 16)}}
    assert mc_query(server, "m", "A") == {"lb": {"0": (0, 0, 0)}}
