"""Conductor core: /events normalisation, registration side effects, single writer, maintenance.

Runs on both index implementations (``impl`` fixture of conftest.py).
"""

from __future__ import annotations

import sys
import threading
import time

import msgspec
import pytest

from kvconductor import _hash
from kvconductor.ingest.http_events import (
    CLEARED,
    REMOVED,
    STORED,
    EventError,
    normalize_event,
    normalize_events,
)
from kvconductor.ingest.thread import IngestThread
from kvconductor.keys import Medium
from kvconductor.schema import RegisterRequest, UnregisterRequest, events_decoder
from kvconductor.state.conductor import Conductor, ConductorConfig
from kvconductor.state.protocols import NoSubscriptions

U64_MAX = 2**64 - 1
H1, H2 = 14643705804678351452, 16777012769546811212  # tokens 1..4, 5..8 (docs/api.md)


class RecordingSubs(NoSubscriptions):
    """Subscription manager double: records calls, checks they run on the ingest thread."""

    instances: list[RecordingSubs] = []

    def __init__(self, thread: IngestThread, conductor: Conductor) -> None:
        self.thread = thread
        self.calls: list[tuple] = []
        self.closed = False
        #: (instance, dp, url) -> context of the live (fake) subscriptions.
        self.live: dict = {}
        RecordingSubs.instances.append(self)

    def _rec(self, *call) -> None:
        assert self.thread.on_thread(), "subscription calls must run on the ingest thread"
        self.calls.append(call)

    def subscribe(self, ctx) -> None:
        self._rec("subscribe", ctx)
        self.live[(ctx.instance_id, ctx.dp_rank, ctx.url)] = ctx

    def replace(self, instance_id: str, dp_rank: int, contexts) -> set[str]:
        self._rec("replace", instance_id, dp_rank, tuple(c.url for c in contexts))
        before = {k[2] for k in self.live if k[:2] == (instance_id, dp_rank)}
        for k in [k for k in self.live if k[:2] == (instance_id, dp_rank)]:
            del self.live[k]
        for c in contexts:
            self.live[(instance_id, dp_rank, c.url)] = c
        return {c.url for c in contexts} - before

    def unsubscribe(self, instance_id: str, dp_rank: int) -> int:
        self._rec("unsubscribe", instance_id, dp_rank)
        for k in [k for k in self.live if k[:2] == (instance_id, dp_rank)]:
            del self.live[k]
        return 1

    def request_replay(self, ctx) -> None:
        self._rec("replay", ctx)

    def count(self, instance_id: str, dp_rank: int) -> int:
        # Not recorded: only the mutations are asserted.
        return sum(1 for k in self.live if k[:2] == (instance_id, dp_rank))

    def __len__(self) -> int:
        return len(self.live)

    def sources(self) -> list[dict]:
        self._rec("sources")
        return [{"instance_id": c.instance_id, "url": c.url} for c in self.live.values()]

    def close(self) -> None:
        self._rec("close")
        self.closed = True


@pytest.fixture
def conductor(impl):
    c = Conductor(
        ConductorConfig(index_impl=impl, maintenance_interval=3600), subscriptions=RecordingSubs
    )
    c.start()
    yield c
    assert c.stop(5.0)


def reg(instance_id="vllm-prefill-1", dp_rank=0, **kw) -> RegisterRequest:
    kw.setdefault("engine_type", "vLLM")
    kw.setdefault("modelname", "qwen")
    kw.setdefault("block_size", 4)
    return RegisterRequest(instance_id=instance_id, dp_rank=dp_rank, **kw)


def unreg(instance_id="vllm-prefill-1", dp_rank=0) -> UnregisterRequest:
    return UnregisterRequest(
        instance_id=instance_id, engine_type="vLLM", modelname="qwen", block_size=4, dp_rank=dp_rank
    )


def batch_of(instance_id="vllm-prefill-1", events=(), **kw):
    doc = {"instance_id": instance_id, "events": list(events), **kw}
    return events_decoder.decode(msgspec.json.encode(doc))


def post_events(c: Conductor, instance_id="vllm-prefill-1", events=(), **kw):
    batch = batch_of(instance_id, events, **kw)
    return c.call(c.apply_events, batch, normalize_events(batch))


def stored(event_id, hashes, tokens, parent=None, medium=None, dp_rank=0, **kw):
    ev = {
        "event_id": event_id,
        "dp_rank": dp_rank,
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        **kw,
    }
    if medium:
        ev["medium"] = medium
    return ev


def query(c: Conductor, tokens, model="qwen", tenant="default", block_size=4) -> dict:
    return c.get_index(model, tenant).query(tokens, block_size).to_dict(tenant, block_size)


def dp(npu, cpu, disk, block_size=4) -> dict:
    return {
        "matched_tokens": (npu + cpu + disk) * block_size,
        "npu_blocks": npu,
        "cpu_blocks": cpu,
        "disk_blocks": disk,
    }


# -- normalisation (the reference's normalize tests; no implicit clear; u64 hashes) -----------


def one(ev: dict):
    return normalize_event(batch_of("i", [ev]).events[0])


def test_normalize_engine_stored_event_with_blocks():
    op = one(
        {
            "event_id": 1,
            "type": "stored",
            "blocks": [
                {"block_hash": 10, "tokens_hash": 11},
                {"block_hash": 20, "tokens_hash": -1},
            ],
        }
    )
    assert op.kind == STORED and op.medium is Medium.NPU and op.backend_id is None
    assert list(op.engine_hashes) == [10, 20] and list(op.local_hashes) == [11, U64_MAX]
    assert op.parent is None and op.tokens is None


def test_normalize_rfc_removed_event():
    op = one(
        {
            "event_id": 2,
            "event_type": "removed",
            "seq_hashes": [1, 2],
            "block_hashes": [3],
            "medium": "cpu",
            "backend_id": "master-1",
        }
    )
    assert op.kind == REMOVED and list(op.engine_hashes) == [1, 2, 3]
    assert op.medium is Medium.CPU and op.backend_id == "master-1"


def test_normalize_cleared_and_legacy_types():
    assert one({"event_id": 3, "type": "AllBlocksCleared"}).kind == CLEARED
    assert one({"event_id": 4, "legacy_type": "BlockStored", "block_hashes": [1]}).kind == STORED
    assert one({"event_id": 5, "legacy_type": "BlockRemoved", "block_hashes": [1]}).kind == REMOVED
    assert one({"event_id": 6, "event_type": "", "type": "stored"}).kind == STORED


def test_normalize_engine_block_stored_hashes_tokens():
    op = one(stored(7, [100, 200], list(range(1, 9)), parent=50))
    assert op.kind == STORED and op.parent == 50 and op.block_size == 4
    assert list(op.engine_hashes) == [100, 200] and list(op.tokens) == list(range(1, 9))
    assert op.local_hashes is None


def test_normalize_parent_alias_and_full_u64_range():
    assert one({"event_id": 8, "type": "stored", "parent_block_hash": 999}).parent == 999
    assert one({"event_id": 8, "type": "stored", "parent_hash": U64_MAX}).parent == U64_MAX
    assert one({"event_id": 8, "type": "stored", "parent_hash": -2}).parent == U64_MAX - 1


def test_normalize_pool_fallback_uses_block_hash_as_tokens_hash():
    op = one(
        {"event_id": 9, "type": "stored", "seq_hashes": [5], "block_hashes": [6], "medium": "disk"}
    )
    assert list(op.engine_hashes) == [5, 6] and list(op.local_hashes) == [5, 6]
    assert op.medium is Medium.DISK


@pytest.mark.parametrize(
    "data",
    [
        {
            "type": "BlockStored",
            "block_hashes": [100, 200],
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "block_size": 4,
        },
        {
            "stored": {
                "parent_hash": None,
                "blocks": [
                    {"block_hash": 100, "tokens_hash": H1},
                    {"block_hash": 200, "tokens_hash": H2},
                ],
            }
        },
    ],
)
def test_normalize_nested_shape_is_not_a_clear(data):
    op = one({"event_id": 10, "dp_rank": 1, "data": data})
    assert op.kind == STORED and op.dp_rank == 1
    assert list(op.engine_hashes) == [100, 200]


def test_normalize_nested_removed_and_cleared():
    op = one({"event_id": 11, "data": {"removed": {"block_hashes": [7, 8]}}})
    assert op.kind == REMOVED and list(op.engine_hashes) == [7, 8]
    assert one({"event_id": 12, "data": "cleared"}).kind == CLEARED
    assert one({"event_id": 12, "data": {"cleared": None}}).kind == CLEARED


@pytest.mark.parametrize(
    "ev,needle",
    [
        ({"event_id": 1, "type": "Frobnicated"}, "'Frobnicated'"),
        ({"event_id": 2}, "missing event type"),
        ({"event_id": 3, "data": {}}, "missing event type"),
        ({"event_id": 4, "data": {"blocks": "x", "type": "stored"}}, "invalid data"),
        ({"event_id": 5, "data": [1]}, "data must be"),
        ({"event_id": 6, "type": "stored", "parent_hash": 2**64}, "out of range"),
        ({"event_id": 7, "type": "removed", "block_hashes": [-(2**63) - 1]}, "out of range"),
        (
            {
                "event_id": 8,
                "type": "stored",
                "block_hashes": [1],
                "block_size": 4,
                "token_ids": [2**64],
            },
            "out of range",
        ),
        ({"event_id": 2**64, "type": "stored"}, "event_id"),
    ],
)
def test_normalize_rejects(ev, needle):
    with pytest.raises(EventError, match=needle):
        one(ev)


def test_normalize_events_sorts_stably_by_dp_rank():
    batch = batch_of(
        "i",
        [{"event_id": i, "dp_rank": r, "type": "cleared"} for i, r in enumerate([2, 0, 1, 0, 2])],
    )
    assert [(op.dp_rank, op.event_id) for op in normalize_events(batch)] == [
        (0, 1),
        (0, 3),
        (1, 2),
        (2, 0),
        (2, 4),
    ]


# -- events applied to the index ----------------------------------------------------------------


def test_events_then_query_exact_values(conductor):
    conductor.call(conductor.register, reg())
    out = post_events(conductor, events=[stored(1, [100, 200], list(range(1, 9)))])
    assert out == (1, [])
    assert query(conductor, list(range(1, 13))) == {
        "default": {"vllm-prefill-1": {"longest_matched": 8, "DP": {"0": dp(2, 0, 0)}}}
    }
    assert conductor.get_index("qwen", "default").query_by_hash([H1, H2, 5]).to_dict("default", 1)[
        "default"
    ]["vllm-prefill-1"]["DP"]["0"] == dp(2, 0, 0, 1)


def test_cpu_and_disk_continuations(conductor):
    conductor.call(conductor.register, reg())
    out = post_events(
        conductor,
        events=[
            stored(1, [100], [1, 2, 3, 4], medium="GPU"),
            stored(2, [200], [5, 6, 7, 8], parent=100, medium="cpu"),
            stored(3, [300], [9, 10, 11, 12], parent=200, medium="SSD"),
        ],
    )
    assert out == (3, [])
    assert query(conductor, list(range(1, 13)))["default"]["vllm-prefill-1"] == {
        "longest_matched": 12,
        "DP": {"0": dp(1, 1, 1)},
    }


def test_cpu_only_dp(conductor):
    conductor.call(conductor.register, reg())
    post_events(conductor, events=[stored(1, [100], [1, 2, 3, 4], medium="CPU", dp_rank=3)])
    assert query(conductor, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"] == {"3": dp(0, 1, 0)}


def test_removed_and_cleared(conductor):
    conductor.call(conductor.register, reg())
    post_events(conductor, events=[stored(1, [100, 200], list(range(1, 9)))])
    post_events(conductor, events=[{"event_id": 2, "type": "BlockRemoved", "block_hashes": [200]}])
    hits = query(conductor, list(range(1, 9)))["default"]["vllm-prefill-1"]["DP"]
    assert hits["0"] == dp(1, 0, 0)
    post_events(conductor, events=[{"event_id": 3, "type": "AllBlocksCleared"}])
    assert query(conductor, list(range(1, 9))) == {"default": {}}


def test_nested_event_is_applied_not_cleared(conductor):
    conductor.call(conductor.register, reg())
    post_events(conductor, events=[stored(1, [100, 200], list(range(1, 9)))])
    out = post_events(
        conductor,
        events=[
            {
                "event_id": 2,
                "dp_rank": 0,
                "data": {
                    "type": "BlockStored",
                    "block_hashes": [300],
                    "parent_block_hash": 200,
                    "token_ids": [9, 10, 11, 12],
                    "block_size": 4,
                },
            }
        ],
    )
    assert out == (1, [])
    assert query(conductor, list(range(1, 13)))["default"]["vllm-prefill-1"]["DP"]["0"] == dp(
        3, 0, 0
    )


def test_parent_hash_beyond_i64(conductor):
    conductor.call(conductor.register, reg())
    big = 2**63 + 5
    out = post_events(
        conductor,
        events=[stored(1, [big], [1, 2, 3, 4]), stored(2, [U64_MAX], [5, 6, 7, 8], parent=big)],
    )
    assert out == (2, [])
    out = post_events(conductor, events=[stored(3, [7], [9, 10, 11, 12], parent=-1)])
    assert out == (1, [])  # -1 is U64_MAX in two's complement
    assert query(conductor, list(range(1, 13)))["default"]["vllm-prefill-1"]["DP"]["0"] == dp(
        3, 0, 0
    )


def test_partial_failure_per_dp_group(conductor):
    conductor.call(conductor.register, reg())
    out = post_events(
        conductor,
        events=[
            stored(1, [100], [1, 2, 3, 4], dp_rank=0),
            stored(2, [200], [5, 6, 7, 8], parent=100, dp_rank=0),
            stored(3, [300], [1, 2, 3, 4], dp_rank=1),
            stored(4, [400], [5, 6, 7, 8], parent=0xDEAD, dp_rank=1),
        ],
    )
    assert out == (2, ["dp_rank=1: parent block not found"])
    # The failing group's first event was applied (reference semantics) but not counted.
    hits = query(conductor, list(range(1, 9)))["default"]["vllm-prefill-1"]["DP"]
    assert hits == {"0": dp(2, 0, 0), "1": dp(1, 0, 0)}


def test_invalid_block_sequence(conductor):
    conductor.call(conductor.register, reg())
    out = post_events(conductor, events=[stored(1, [100, 100], list(range(1, 9)))])
    assert out == (0, ["dp_rank=0: invalid block sequence"])


def test_unregistered_instance(conductor):
    from kvconductor.state.events import InstanceNotRegistered

    for kw in ({}, {"model_name": "m", "tenant_id": "t"}):
        with pytest.raises(InstanceNotRegistered, match="instance ghost not found"):
            post_events(
                conductor,
                "ghost",
                [stored(1, [1], [1, 2, 3, 4], dp_rank=0), stored(2, [1], [1, 2, 3, 4], dp_rank=2)],
                **kw,
            )
    assert conductor.indexes == {}
    conductor.call(conductor.register, reg("ghost", modelname="m0"))
    out = post_events(
        conductor, "ghost", [stored(1, [1], [1, 2, 3, 4])], model_name="m", tenant_id="t"
    )
    assert out == (1, [])
    assert query(conductor, [1, 2, 3, 4], "m", "t")["t"]["ghost"]["DP"]["0"] == dp(1, 0, 0)


def test_events_use_the_registered_tenant_and_dp_model(conductor):
    conductor.call(conductor.register, reg(dp_rank=0, modelname="m0", tenant_id="t"))
    conductor.call(conductor.register, reg(dp_rank=1, modelname="m1", tenant_id="t"))
    post_events(
        conductor,
        events=[stored(1, [1], [1, 2, 3, 4], dp_rank=0), stored(2, [1], [1, 2, 3, 4], dp_rank=1)],
    )
    assert list(query(conductor, [1, 2, 3, 4], "m0", "t")["t"]["vllm-prefill-1"]["DP"]) == ["0"]
    assert list(query(conductor, [1, 2, 3, 4], "m1", "t")["t"]["vllm-prefill-1"]["DP"]) == ["1"]


def test_backend_id_routes_to_its_own_worker(conductor):
    conductor.call(conductor.register, reg())
    post_events(conductor, events=[stored(1, [100], [1, 2, 3, 4], backend_id="other")])
    # A removal from the default backend does not touch the other backend's block.
    post_events(conductor, events=[{"event_id": 2, "type": "removed", "block_hashes": [100]}])
    assert query(conductor, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"]["0"] == dp(1, 0, 0)


# -- registration side effects ----------------------------------------------------------------


def test_register_subscribes_per_url_and_replays(conductor):
    subs = conductor.subs
    conductor.call(
        conductor.register,
        reg(
            store_backend="YuanRong",
            replay_endpoint="tcp://h:6667",
            medium_endpoints={"npu": "tcp://h:1", "cpu": "tcp://h:2", "disk": "tcp://h:2"},
        ),
    )
    assert [c[0] for c in subs.calls] == ["replace", "replay"]
    assert subs.calls[0][1:] == ("vllm-prefill-1", 0, ("tcp://h:1", "tcp://h:2"))
    assert {url: c.default_media for (_, _, url), c in subs.live.items()} == {
        "tcp://h:1": (Medium.NPU,),
        "tcp://h:2": (Medium.CPU, Medium.DISK),
    }
    assert subs.calls[1][1].url == "tcp://h:1"
    subs.calls.clear()
    # A changed registration that keeps the engine's URL keeps that socket: no replay.
    conductor.call(
        conductor.register,
        reg(
            store_backend="YuanRong",
            replay_endpoint="tcp://h:6667",
            medium_endpoints={"npu": "tcp://h:1"},
        ),
    )
    assert subs.calls == [("replace", "vllm-prefill-1", 0, ("tcp://h:1",))]
    subs.calls.clear()
    # An identical one keeps the live subscription: nothing stopped, nothing replayed.
    conductor.call(
        conductor.register,
        reg(
            store_backend="YuanRong",
            replay_endpoint="tcp://h:6667",
            medium_endpoints={"npu": "tcp://h:1", "cpu": ""},
        ),
    )
    assert subs.calls == []
    # A new engine URL is a new subscription: it replays.
    conductor.call(
        conductor.register,
        reg(
            store_backend="YuanRong",
            replay_endpoint="tcp://h:6667",
            medium_endpoints={"npu": "tcp://h:3"},
        ),
    )
    assert [c[0] for c in subs.calls] == ["replace", "replay"]
    assert subs.calls[1][1].url == "tcp://h:3"


def test_every_dp_of_an_instance_replays(conductor):
    subs = conductor.subs
    for dp in (0, 1):
        conductor.call(
            conductor.register,
            reg(
                dp_rank=dp,
                replay_endpoint=f"tcp://h:{6667 + dp}",
                medium_endpoints={"npu": f"tcp://h:{5557 + dp}"},
            ),
        )
    replays = [
        (c[1].dp_rank, c[1].url, c[1].replay_endpoint) for c in subs.calls if c[0] == "replay"
    ]
    assert replays == [(0, "tcp://h:5557", "tcp://h:6667"), (1, "tcp://h:5558", "tcp://h:6668")]


def test_register_creates_index_and_http_only_has_no_subscription(conductor):
    conductor.call(conductor.register, reg(modelname="m", tenant_id="t"))
    assert conductor.get_index("m", "t") is not None
    assert conductor.subs.calls == []


def test_rejected_registration_has_no_side_effect(conductor):
    from kvconductor.state.registry import RegistrationError

    conductor.call(conductor.register, reg(medium_endpoints={"npu": "tcp://10.0.0.1:1"}))
    conductor.subs.calls.clear()
    with pytest.raises(RegistrationError):
        conductor.call(
            conductor.register, reg(instance_id="", medium_endpoints={"npu": "tcp://10.0.0.2:1"})
        )
    assert conductor.subs.calls == []
    assert conductor.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0)]


def test_same_backend_reregistration_keeps_data(conductor):
    conductor.call(conductor.register, reg(store_backend="YuanRong"))
    post_events(conductor, events=[stored(1, [100], [1, 2, 3, 4])])
    conductor.call(conductor.register, reg(store_backend="yuanrong"))
    assert query(conductor, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"]["0"] == dp(1, 0, 0)


def test_backend_change_drops_data(conductor):
    conductor.call(conductor.register, reg(store_backend="YuanRong"))
    post_events(
        conductor,
        events=[stored(1, [100], [1, 2, 3, 4]), stored(2, [100], [1, 2, 3, 4], medium="cpu")],
    )
    conductor.call(conductor.register, reg(store_backend="Mooncake"))
    assert query(conductor, [1, 2, 3, 4]) == {"default": {}}


def test_model_change_moves_the_dp(conductor):
    conductor.call(conductor.register, reg(modelname="old"))
    post_events(conductor, events=[stored(1, [100], [1, 2, 3, 4])])
    conductor.call(conductor.register, reg(modelname="new"))
    assert conductor.get_index("old", "default") is None  # emptied and unprotected: reclaimed
    post_events(conductor, events=[stored(2, [100], [1, 2, 3, 4])])
    assert query(conductor, [1, 2, 3, 4], "new")["default"]["vllm-prefill-1"]["DP"]["0"] == dp(
        1, 0, 0
    )
    assert conductor.instance_info("vllm-prefill-1")["model_name"] == "new"


def test_unregister(conductor):
    subs = conductor.subs
    conductor.call(conductor.register, reg(dp_rank=0))
    conductor.call(conductor.register, reg(dp_rank=1))
    post_events(
        conductor,
        events=[
            stored(1, [100], [1, 2, 3, 4], dp_rank=0),
            stored(2, [100], [1, 2, 3, 4], dp_rank=1, medium="cpu"),
        ],
    )
    subs.calls.clear()
    assert conductor.call(conductor.unregister, unreg(dp_rank=1)) is True
    assert subs.calls == [("unsubscribe", "vllm-prefill-1", 1)]
    assert query(conductor, [1, 2, 3, 4])["default"]["vllm-prefill-1"]["DP"] == {"0": dp(1, 0, 0)}
    assert conductor.call(conductor.unregister, unreg(dp_rank=0)) is True
    assert conductor.get_index("qwen", "default") is None
    assert conductor.instance_info("vllm-prefill-1") is None


def test_unregister_removes_the_dp_from_every_index(conductor):
    """A DP's blocks credited in another (model, tenant) (a pool event naming it) leave
    with the DP (issue 36): it no longer answers there, and that index, now empty and
    registered by no one, is reclaimed."""
    from kvconductor.keys import WorkerKey

    conductor.call(conductor.register, reg(dp_rank=0))
    post_events(conductor, events=[stored(1, [100], [1, 2, 3, 4])])

    def credit_elsewhere() -> None:
        other = conductor.get_or_create_index("other", "t")
        key = WorkerKey("vllm-prefill-1", "vllm-prefill-1", 0, Medium.CPU)
        other.store(key, None, [100, 101], [_hash.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)[0], 7])

    conductor.call(credit_elsewhere)
    assert query(conductor, [1, 2, 3, 4], "other", "t")["t"]["vllm-prefill-1"]["DP"] == {
        "0": dp(0, 1, 0)
    }
    assert conductor.call(conductor.unregister, unreg()) is True
    assert conductor.get_index("qwen", "default") is None
    assert conductor.get_index("other", "t") is None  # emptied and reclaimed


def test_unregister_unknown_still_stops_subscriptions(conductor):
    assert conductor.call(conductor.unregister, unreg("nope", 3)) is False
    assert conductor.subs.calls == [("unsubscribe", "nope", 3)]


def test_index_kept_while_another_registration_uses_it(conductor):
    conductor.call(conductor.register, reg("a"))
    conductor.call(conductor.register, reg("b"))
    conductor.call(conductor.unregister, unreg("a"))
    assert conductor.get_index("qwen", "default") is not None


def test_callbacks_for_subscribers(conductor):
    conductor.call(conductor.register, reg(medium_endpoints={"npu": "tcp://10.0.0.1:5557"}))
    conductor.call(
        conductor.register, reg(dp_rank=1, medium_endpoints={"npu": "tcp://10.0.0.1:5558"})
    )
    assert conductor.hbm_ip_lookup("10.0.0.1") == [("vllm-prefill-1", 0), ("vllm-prefill-1", 1)]
    info = conductor.instance_info("vllm-prefill-1")
    assert info["store_backend"] == "Mooncake" and set(info["endpoints"]) == {0, 1}
    idx = conductor.call(conductor.get_or_create_index, "x", "y")
    assert conductor.call(conductor.get_or_create_index, "x", "y") is idx


# -- maintenance ---------------------------------------------------------------------------------


def test_maintenance_expires_offload_and_reclaims_empty_entry(conductor):
    def offload():
        conductor.get_or_create_index("m", "t").offload([1], [2], None, now=0.0)

    conductor.call(offload)
    conductor.call(conductor.maintenance, 1.0)
    assert conductor.get_index("m", "t") is not None  # offload TTL not reached yet
    conductor.call(conductor.maintenance, 10_000.0)
    assert conductor.get_index("m", "t") is None


def test_unmatched_two_phase_entries_are_counted_and_named(conductor, caplog):
    """CPU offloads no pool confirms (or confirmations no offload came for) never reach the
    index: each expiry is counted by kind, with one WARN per index and kind per minute."""
    from kvconductor.keys import Medium, WorkerKey

    caplog.set_level("WARNING", logger="kvconductor")
    pool = WorkerKey("i", "i", 0, Medium.CPU)

    def two_phase(t):
        idx = conductor.get_or_create_index("m", "t")
        idx.offload([1, 2, 3], [11, 12, 13], None, now=t)  # never confirmed
        idx.pool_store(pool, [7], now=t)  # never offloaded

    conductor.call(two_phase, 0.0)
    conductor.call(conductor.maintenance, 59.0)  # pending TTL 60 s, offload TTL 600 s
    assert conductor.expired == {"offload": 0, "pool_confirmation": 0}
    conductor.call(conductor.maintenance, 60.0)
    assert conductor.expired == {"offload": 0, "pool_confirmation": 1}
    conductor.call(conductor.maintenance, 600.0)
    assert conductor.expired == {"offload": 3, "pool_confirmation": 1}
    conductor.call(two_phase, 600.0)
    conductor.call(conductor.maintenance, 1200.0)
    assert conductor.expired == {"offload": 6, "pool_confirmation": 2}
    conductor.call(two_phase, 1190.0)
    conductor.call(conductor.maintenance, 1250.0)  # counted; no WARN within the minute
    assert conductor.expired == {"offload": 6, "pool_confirmation": 3}
    pending = (
        "model=m tenant=t: 1 pool confirmations expired after 60s without the engine's "
        "offload event, so they are not indexed: does the engine publish its CPU/disk "
        "offloads (its subscription has that medium)?"
    )
    offload = (
        "model=m tenant=t: 3 engine offloads to CPU/disk expired after 600s without a pool "
        "confirmation, so they are not indexed: is the KV pool's publisher registered "
        "(medium_endpoints cpu/disk, store_backend) for the instances that offload?"
    )
    assert [r.getMessage() for r in caplog.records] == [pending, offload, offload, pending]


def test_maintenance_keeps_registered_empty_entry(conductor):
    conductor.call(conductor.register, reg())
    conductor.call(conductor.maintenance, 10_000.0)
    assert conductor.get_index("qwen", "default") is not None


def test_maintenance_timer_runs_on_the_ingest_thread(impl):
    c = Conductor(
        ConductorConfig(index_impl=impl, maintenance_interval=0), subscriptions=RecordingSubs
    )
    assert c.interval == 1.0
    seen = []
    orig = c.maintenance

    def spy(now=None):
        seen.append(c.thread.on_thread())
        return orig(now)

    c.maintenance = spy
    c.start()
    try:
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen and all(seen)
    finally:
        assert c.stop(5.0)


# -- lifecycle, introspection --------------------------------------------------------------------


def test_workers_snapshot(conductor):
    conductor.call(conductor.register, reg(medium_endpoints={"gpu": "tcp://10.0.0.1:5557"}))
    post_events(conductor, events=[stored(1, [100, 200], list(range(1, 9)))])
    doc = conductor.call(conductor.workers)
    assert doc["workers"][0]["endpoints"]["0"]["medium_endpoints"] == {"npu": "tcp://10.0.0.1:5557"}
    (summary,) = doc["indexer"]
    assert (
        summary["model_name"],
        summary["tenant_id"],
        summary["worker_count"],
        summary["total_blocks"],
    ) == ("qwen", "default", 1, 2)
    assert doc["sources"] == [{"instance_id": "vllm-prefill-1", "url": "tcp://10.0.0.1:5557"}]


def test_stop_closes_subscriptions_and_thread(impl):
    c = Conductor(ConductorConfig(index_impl=impl), subscriptions=RecordingSubs)
    c.start()
    subs = c.subs
    assert c.stop(5.0) and c.stop(5.0)
    assert subs.closed and not c.thread.is_alive()


def test_missing_subscriber_module_is_an_error_not_a_silent_fallback(monkeypatch, impl):
    # A half-built install must not run without its ZeroMQ ingest (every engine would
    # silently show 0 hits): starting the conductor fails with the ImportError.
    monkeypatch.setitem(sys.modules, "kvconductor.ingest.subscriber", None)
    c = Conductor(ConductorConfig(index_impl=impl))
    with pytest.raises(ImportError):
        c.start()
    c.stop(5.0)


def test_concurrent_readers_while_writing(conductor):
    """Readers query while the writer stores and removes block 2 under block 1 again and
    again: every answer is one the writer could have produced (1 or 2 blocks, counts
    consistent), never a torn or failed one, and both states are seen."""
    conductor.call(conductor.register, reg())
    post_events(conductor, events=[stored(0, [1], [1, 2, 3, 4])])
    errors: list = []
    seen: set = set()
    stop = threading.Event()

    def reader():
        idx = conductor.get_index("qwen", "default")
        while not stop.is_set():
            try:
                d = idx.query(list(range(1, 9)), 4).to_dict("default", 4)
                e = d["default"]["vllm-prefill-1"]["DP"]["0"]
                assert e["npu_blocks"] in (1, 2) and e["matched_tokens"] == 4 * e["npu_blocks"]
                seen.add(e["npu_blocks"])
            except Exception as ex:
                errors.append(ex)
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(1, 400):
            if i % 2:
                post_events(conductor, events=[stored(i, [2], [5, 6, 7, 8], parent=1)])
            else:
                post_events(
                    conductor,
                    events=[
                        {"event_id": i, "dp_rank": 0, "type": "BlockRemoved", "block_hashes": [2]}
                    ],
                )
            if i > 200 and seen == {1, 2}:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert errors == [] and seen == {1, 2}


def test_hash_vectors_used_here():
    assert list(_hash.hash_blocks(list(range(1, 9)), 4)) == [H1, H2]


# -- optional features handed in (kvconductor.state.protocols) ------------------------------
class _Stats:
    written, failed, last_time, last_bytes, last_seconds, last_pause = 3, 1, 5.0, 7, 0.5, 0.25


class _Snapshots:
    """Snapshots double: what /metrics reads of a Snapshotter."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.stats = _Stats()

    def start(self) -> None:
        pass

    def stop(self, final: bool = True) -> None:
        pass


def test_optional_features_are_handed_in_at_construction():
    """Conductor(snapshotter=, shared=, processes=): built with the conductor, typed,
    read by /metrics and /workers without probing; None means off."""
    from kvconductor.http.metrics import Metrics
    from kvconductor.state.protocols import NoSubscriptions

    plain = Conductor(ConductorConfig())
    assert plain.snapshotter is None and plain.shared is None and plain.replicator is None
    assert isinstance(plain.subs, NoSubscriptions)  # until start
    assert b"kvconductor_snapshots" not in Metrics(plain).exposition()
    assert plain.stop()

    c = Conductor(
        ConductorConfig(maintenance_interval=3600),
        subscriptions=NoSubscriptions,
        snapshotter=_Snapshots,
        processes=lambda: {"workers": 2},
    )
    assert isinstance(c.snapshotter, _Snapshots) and c.snapshotter.conductor is c
    text = Metrics(c).exposition().decode()
    assert 'kvconductor_snapshots_total{outcome="written"} 3.0' in text
    assert 'kvconductor_snapshots_total{outcome="failed"} 1.0' in text
    c.start()
    try:
        assert c.call(c.workers)["processes"] == {"workers": 2}
    finally:
        assert c.stop(5.0)


def test_attach_snapshotter():
    c = Conductor(ConductorConfig())
    snap = _Snapshots(c)
    c.attach_snapshotter(snap)
    assert c.snapshotter is snap
    assert c.stop()
