"""Which DPs of a node a cluster pool's event belongs to (kvconductor.ingest.poolroute)."""

from __future__ import annotations

from kvconductor.ingest.poolroute import (
    AMBIGUOUS,
    NO_DP_OF_CONTEXT,
    cluster_pool_dps,
    registered_index,
)

#: One node: DPs of two models and two tenants, and one instance no longer registered.
REG = {
    ("a1", 0): ("m1", "A"),
    ("a1", 1): ("m1", "A"),
    ("b1", 0): ("m1", "B"),
    ("a2", 0): ("m2", "A"),
}
PAIRS = [*REG, ("a1", 0), ("gone", 0)]


def reg(iid: str, dp: int):
    return REG.get((iid, dp), (None, None))


def dps(event_model, event_tenant, pool_model="m1", pool_tenant="A", pairs=PAIRS):
    r = cluster_pool_dps(pairs, reg, event_model, event_tenant, pool_model, pool_tenant)
    return r.reason or [(i, d) for i, d, _, _ in r.dps]


def test_the_event_context_wins_then_the_registration():
    assert dps("m1", "A") == [("a1", 0), ("a1", 1)]  # duplicates and unknown DPs left out
    assert dps(None, None) == [("a1", 0), ("a1", 1)]  # the pool registration's (m1, A)
    assert dps("m1", "B") == [("b1", 0)]
    assert dps(None, "B") == [("b1", 0)]
    assert dps("m2", None) == [("a2", 0)]
    assert dps("m3", "A") == NO_DP_OF_CONTEXT
    assert dps(None, None, pool_model="m9") == NO_DP_OF_CONTEXT


def test_the_coordinator_placeholder_model_names_none():
    # tenant A has DPs of m1 and m2: which model is meant is unknown, none is credited
    assert dps(None, None, pool_model="default") == AMBIGUOUS
    assert dps(None, "B", pool_model="default") == [("b1", 0)]
    assert dps("m2", None, pool_model="default") == [("a2", 0)]
    one_model = [("a1", 0), ("b1", 0)]
    assert dps(None, None, pool_model="default", pairs=one_model) == [("a1", 0)]


def test_the_routed_dps_carry_their_index_and_the_drop_says_why():
    r = cluster_pool_dps(PAIRS, reg, None, "B", "m1", "A")
    assert r.dps == [("b1", 0, "m1", "B")] and r.reason == ""
    r = cluster_pool_dps(PAIRS, reg, "m3", "A", "m1", "A")
    assert r.dps == [] and "model=m3 tenant=A" in r.detail and "b1/0 (m1, B)" in r.detail


def test_registered_index_reads_either_shape():
    assert registered_index(None, 0) == (None, None)
    info = {
        "model_name": "a",
        "tenant_id": "b",
        "endpoints": {1: {"model_name": "c", "tenant_id": "d"}},
    }
    assert registered_index(info, 0) == ("a", "b")
    assert registered_index(info, 1) == ("c", "d")


def test_the_lora_adapter_of_the_event_else_of_the_registration():
    loras = {("a1", 0): "ad-1", ("a1", 1): "", ("b1", 0): None}
    pairs = [("a1", 0), ("a1", 1), ("b1", 0)]
    reg2 = {("a1", 0): ("m1", "A"), ("a1", 1): ("m1", "A"), ("b1", 0): ("m1", "A")}

    def route(event_lora, pool_lora):
        r = cluster_pool_dps(
            pairs,
            lambda i, d: reg2[(i, d)],
            None,
            None,
            "m1",
            "A",
            event_lora,
            pool_lora,
            lambda i, d: loras[(i, d)],
        )
        return r.reason or [(i, d) for i, d, _, _ in r.dps]

    # a DP registered with no adapter (V3) serves any; one with another adapter none
    assert route("ad-1", None) == [("a1", 0), ("b1", 0)]
    assert route(None, "ad-1") == [("a1", 0), ("b1", 0)]
    assert route(None, "") == [("a1", 1), ("b1", 0)]  # the base model's
    assert route("ad-2", "") == [("b1", 0)]
    assert route(None, None) == [("a1", 1), ("b1", 0)]  # none named: the base model's
