"""Answers that say how fresh they are (``kvconductor.ingest.freshness``; docs/api.md,
"freshness"): the states collected from the subscriptions, and the answers of a real
server fed by a real ZeroMQ publisher (vLLM 0.33 frames) while its stream is live,
degraded by a lost batch, and muted after its publisher went away."""

from __future__ import annotations

import contextlib
import json
import time
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from kvconductor import _encode
from kvconductor._hash import hash_blocks
from kvconductor.http.responses import freshness_param
from kvconductor.ingest.freshness import STATE_CODE, FreshnessTables, collect
from kvconductor.ingest.stats import STATE_STAMP, state_changed
from tests.helpers.faults import BS, V33, Rig
from tests.helpers.publishers import wait_until


# -- the states, from the subscriptions (no sockets) -------------------------------------------
def _sub(
    iid,
    dp,
    state,
    *,
    model="m",
    tenant="t",
    pool=False,
    muted=False,
    closed=False,
    last=100.0,
    since=None,
):
    return SimpleNamespace(
        ctx=SimpleNamespace(model=model, tenant=tenant, is_pool=pool, instance_id=iid, dp_rank=dp),
        state=state,
        muted=muted,
        closed=closed,
        stats=SimpleNamespace(last_event=last),
        tracker=SimpleNamespace(degraded_since=since),
    )


def test_collect_takes_the_worst_state_of_a_dp_and_counts_every_source():
    subs = [
        _sub("a", 0, "live", last=10.0),
        _sub("a", 0, "degraded", last=12.0, since=50.0),  # the DP's CPU stream
        _sub("a", 1, "live", muted=True),
        _sub("b", 0, "replaying"),
        _sub("b", 0, "degraded", since=40.0),
        _sub("b", 0, "degraded", since=45.0),
        _sub("pool", 0, "connecting", pool=True),  # counted, but no DP of its own
        _sub("c", 0, "live", model="other"),  # another index
        _sub("c", 0, "live", tenant="other"),
        _sub("d", 0, "live", closed=True),  # going away
    ]
    by_key, counts = collect(subs, "m", "t")
    assert set(by_key) == {("a", 0), ("a", 1), ("b", 0)}
    code, stats, since = by_key["a", 0]
    assert (code, since) == (STATE_CODE["degraded"], 50.0)
    assert [s.last_event for s in stats] == [10.0, 12.0]
    assert by_key["a", 1][0] == STATE_CODE["muted"]
    assert by_key["b", 0][0] == STATE_CODE["degraded"] and by_key["b", 0][2] == 40.0
    assert counts == {"live": 1, "degraded": 3, "muted": 1, "replaying": 1, "connecting": 1}
    # worse is later in FRESH_STATES
    assert _encode.FRESH_STATES == (
        "live",
        "remote",
        "connecting",
        "replaying",
        "degraded",
        "muted",
        "no_source",
    )


def test_tables_are_rebuilt_after_a_change_and_only_then():
    subs = [_sub("a", 0, "live")]
    gen = [0]
    calls = []

    def snapshot():
        calls.append(1)
        return tuple(subs)

    tables = FreshnessTables(snapshot, lambda: gen[0])
    keys = [("a", 0), ("b", 0)]
    t1 = tables.table("m", "t")
    assert tables.table("m", "t") is t1 and len(calls) == 1
    assert t1.groups(keys)[0][0] == STATE_CODE["live"] and t1.groups(keys)[1] is None
    assert json.loads(t1.tail[False]) == {"all_live": True, "sources": 1, "states": {"live": 1}}
    assert msgspec.msgpack.decode(t1.tail[True]) == json.loads(t1.tail[False])
    subs[0].state = "replaying"
    state_changed()
    t2 = tables.table("m", "t")
    assert t2 is not t1 and t2.groups(keys)[0][0] == STATE_CODE["replaying"]
    assert json.loads(t2.tail[False])["all_live"] is False
    subs.append(_sub("b", 0, "live"))
    gen[0] += 1  # the table of subscriptions changed
    t3 = tables.table("m", "t")
    assert t3.groups(keys)[1] is not None and len(calls) == 3
    assert t3.groups([*keys, ("c", 0)])[2] is None  # a new name
    # another index's names (the (model, tenant)'s index made anew after a drop): the
    # same number of groups, numbered otherwise
    swapped = [("b", 0), ("a", 0)]
    assert t3.groups(swapped) == [t3.by_key["b", 0], t3.by_key["a", 0]]
    assert t3.groups(keys) == [t3.by_key["a", 0], t3.by_key["b", 0]]
    assert tables.table("m", "t") is t3
    assert STATE_STAMP[0] > 0


@pytest.mark.parametrize(
    "qs,want",
    [
        (b"", False),
        (b"freshness=true", True),
        (b"freshness=1", True),
        (b"freshness", True),
        (b"freshness=TRUE", True),
        (b"freshness=false", False),
        (b"freshness=0", False),
        (b"other=1&freshness=1", True),
        (b"freshness=1&freshness=0", False),  # the last one counts
        (b"other=x", False),
    ],
)
def test_query_parameter(qs, want):
    assert freshness_param(qs) is want


@pytest.mark.parametrize("qs", [b"freshness=yes", b"freshness=2", b"freshness=%31"])
def test_query_parameter_rejects_other_values(qs):
    with pytest.raises(ValueError, match="invalid query parameter `freshness`"):
        freshness_param(qs)


# -- a real server and a real publisher ---------------------------------------------------------
def toks(i: int, n: int = 2) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + n * BS))


def chain(i: int, n: int = 2) -> bytes:
    return V33.batch(
        [V33.stored([100 * (i + 1) + k for k in range(n)], None, toks(i, n), BS, medium="GPU")]
    )


def _query(rig, tokens, *, fresh=True, **extra):
    body = {"model": "qwen", "block_size": BS, "token_ids": tokens, **extra}
    if fresh:
        body["freshness"] = True
    r = rig.srv.http.post("/query", json=body)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture
def rig(tmp_path, request):
    r = Rig(tmp_path, *getattr(request, "param", ()))
    yield r
    r.close()


def test_a_live_stream_and_the_age_of_its_last_event(rig):
    rig.join()
    rig.pub.publish(chain(0))
    wait_until(lambda: rig.npu(toks(0)) == 2, msg="stored")
    plain = _query(rig, toks(0), fresh=False)
    # without the flag: the V3 answer, byte for byte
    assert plain.content == (
        b'{"default":{"vllm-prefill-1":{"longest_matched":8,"DP":{"0":{"matched_tokens":8,'
        b'"npu_blocks":2,"cpu_blocks":0,"disk_blocks":0}}}}}'
    )
    assert _query(rig, toks(0), fresh=False, freshness=False).content == plain.content
    doc = _query(rig, toks(0)).json()
    dp = doc["default"]["vllm-prefill-1"]["DP"]["0"]
    fresh = dp.pop("freshness")
    assert dp == json.loads(plain.content)["default"]["vllm-prefill-1"]["DP"]["0"]
    assert fresh["state"] == "live" and "degraded_for_ms" not in fresh
    age0 = fresh["last_event_age_ms"]
    src = rig.source()
    assert abs(age0 / 1000 - src["last_event_age_s"]) < 2.0
    assert doc["freshness"] == {"all_live": True, "sources": 1, "states": {"live": 1}}
    time.sleep(1.2)  # nothing published: the age grows by the time that passed
    age1 = _query(rig, toks(0)).json()["default"]["vllm-prefill-1"]["DP"]["0"]["freshness"]
    assert age1["last_event_age_ms"] >= age0 + 1100
    rig.pub.publish(chain(1))  # a new event: young again
    wait_until(lambda: rig.npu(toks(1)) == 2, msg="stored")
    again = _query(rig, toks(0)).json()["default"]["vllm-prefill-1"]["DP"]["0"]["freshness"]
    assert again["last_event_age_ms"] < age1["last_event_age_ms"]
    # a miss still says how fresh the index is
    assert _query(rig, [7] * BS).json() == {"default": {}, "freshness": doc["freshness"]}


def test_the_msgpack_forms_and_the_query_parameter(rig):
    rig.join()
    rig.pub.publish(chain(0))
    wait_until(lambda: rig.npu(toks(0)) == 2, msg="stored")
    mp = {"Content-Type": "application/msgpack"}
    positional = msgspec.msgpack.encode(["qwen", BS, toks(0)])
    plain = rig.srv.http.post("/query", content=positional, headers=mp)
    with_param = rig.srv.http.post("/query?freshness=true", content=positional, headers=mp)
    eighth = msgspec.msgpack.encode(["qwen", BS, toks(0), None, None, None, None, True])
    with_element = rig.srv.http.post("/query", content=eighth, headers=mp)
    a, b = msgspec.msgpack.decode(with_param.content), msgspec.msgpack.decode(with_element.content)
    for d in (a, b):
        assert d["default"]["vllm-prefill-1"]["DP"]["0"]["freshness"]["state"] == "live"
        assert d["freshness"] == {"all_live": True, "sources": 1, "states": {"live": 1}}
        del d["default"]["vllm-prefill-1"]["DP"]["0"]["freshness"], d["freshness"]
        assert d == msgspec.msgpack.decode(plain.content)
    assert plain.content == msgspec.msgpack.encode(
        {
            "default": {
                "vllm-prefill-1": {
                    "longest_matched": 8,
                    "DP": {
                        "0": {
                            "matched_tokens": 8,
                            "npu_blocks": 2,
                            "cpu_blocks": 0,
                            "disk_blocks": 0,
                        }
                    },
                }
            }
        }
    )
    bad = rig.srv.http.post("/query?freshness=maybe", content=positional, headers=mp)
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/msgpack"
    assert "invalid query parameter `freshness`" in msgspec.msgpack.decode(bad.content)["error"]
    bad = rig.srv.http.post(
        "/query", json={"model": "qwen", "block_size": BS, "token_ids": [], "freshness": "yes"}
    )
    assert bad.status_code == 400
    assert bad.json() == {
        "error": "invalid JSON request body: invalid type for `freshness`: "
        "expected a boolean or null"
    }
    by_hash = rig.srv.http.post(
        "/query_by_hash?freshness=1",
        json={"model": "qwen", "block_size": BS, "block_hashes": list(hash_blocks(toks(0), BS))},
    )
    row = by_hash.json()["default"]["vllm-prefill-1"]["DP"]["0"]
    assert row["npu_blocks"] == 2 and row["freshness"]["state"] == "live"
    clash = rig.srv.http.post(
        "/query",
        json={
            "model": "qwen",
            "block_size": BS,
            "token_ids": [],
            "tenant_id": "freshness",
            "freshness": True,
        },
    )
    assert clash.status_code == 400 and "tenant_id 'freshness'" in clash.json()["error"]
    assert "bad request" in rig.srv.log() and "freshness" in rig.srv.log()


@pytest.mark.parametrize("rig", [("--loss-grace-secs", "30")], indirect=True)
def test_a_lost_batch_makes_the_answer_degraded(rig):
    rig.join()
    rig.pub.publish(chain(0))
    rig.pub.publish(chain(1), drop=True)  # lost on the wire
    rig.pub.publish(chain(2))
    wait_until(lambda: rig.npu(toks(2)) == 2, msg="after the gap")
    src = rig.source()
    assert src["state"] == "degraded"
    doc = _query(rig, toks(0)).json()
    fresh = doc["default"]["vllm-prefill-1"]["DP"]["0"]["freshness"]
    assert fresh["state"] == "degraded"
    lost_for = time.time() - src["degraded_since"]
    assert abs(fresh["degraded_for_ms"] / 1000 - lost_for) < 2.0
    assert doc["freshness"] == {"all_live": False, "sources": 1, "states": {"degraded": 1}}


@pytest.mark.parametrize(
    "rig", [("--source-down-secs", "1", "--source-purge-secs", "600")], indirect=True
)
def test_a_muted_source_is_counted_not_answered(rig):
    rig.join()
    rig.pub.publish(chain(0))
    wait_until(lambda: rig.npu(toks(0)) == 2, msg="stored")
    rig.pub.stop()  # the engine went away: down, then muted
    wait_until(lambda: rig.source()["muted"], msg="muted")
    doc = _query(rig, toks(0)).json()
    assert doc == {
        "default": {},
        "freshness": {"all_live": False, "sources": 1, "states": {"muted": 1}},
    }


@pytest.mark.parametrize("rig", [("--workers", "2")], indirect=True)
def test_workers_answer_with_their_owners_states(rig):
    """``--workers 2``: the workers answer the queries from shared memory and read the
    states from their owner (``GET /freshness`` over its UNIX socket)."""
    rig.join()
    rig.pub.publish(chain(0))
    wait_until(lambda: rig.npu(toks(0)) == 2, msg="stored")
    for _ in range(12):  # new connections: both workers answer some
        with httpx.Client(base_url=rig.srv.url, timeout=10.0) as c:
            r = c.post(
                "/query",
                json={"model": "qwen", "block_size": BS, "token_ids": toks(0), "freshness": True},
            )
        assert r.status_code == 200, r.text
        doc = r.json()
        fresh = doc["default"]["vllm-prefill-1"]["DP"]["0"]["freshness"]
        assert fresh["state"] == "live" and 0 <= fresh["last_event_age_ms"] < 60_000
        assert doc["freshness"] == {"all_live": True, "sources": 1, "states": {"live": 1}}
    state = rig.srv.http.get("/freshness", params={"model": "qwen"}).json()
    assert state["dps"][0][:3] == ["vllm-prefill-1", 0, "live"]
    assert abs(state["time"] - state["dps"][0][3] - rig.source()["last_event_age_s"]) < 2.0
    assert state["states"] == {"live": 1} and state["all_live"] is True


def test_a_worker_that_cannot_reach_its_owner_says_so(tmp_path):
    from kvconductor.ingest.freshness import FreshnessUnavailable
    from kvconductor.serve.proxy import OwnerFreshness

    with pytest.raises(FreshnessUnavailable, match="the owner cannot be reached"):
        OwnerFreshness(str(tmp_path / "gone.sock"), timeout=1.0)("m", "t")


def test_a_stalled_owner_holds_a_worker_for_its_timeout_once(tmp_path):
    """An owner that accepts but never answers: the worker's read gives up after its
    timeout (no second try), and the view answers the next queries from that failure
    until its time is up, without asking again."""
    import socket as _socket

    from kvconductor.ingest.freshness import FreshnessUnavailable
    from kvconductor.serve.proxy import OwnerFreshness
    from kvconductor.state.shared import FRESHNESS_TTL, SharedView

    path = str(tmp_path / "owner.sock")
    srv = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    try:
        reader = OwnerFreshness(path, timeout=0.2)
        calls = []

        def source(model, tenant):
            calls.append(model)
            return reader(model, tenant)

        view = SharedView.__new__(SharedView)  # only its freshness cache is used here
        view.freshness_source = source
        view._fresh = {}
        with pytest.raises(FreshnessUnavailable, match="cannot be reached"):
            view.freshness("m", "t")
        with pytest.raises(FreshnessUnavailable):
            view.freshness("m", "t")  # the same failure, without asking again
        assert calls == ["m"]
        srv.setblocking(False)
        accepted = []
        with contextlib.suppress(BlockingIOError):
            while True:
                accepted.append(srv.accept()[0])
        assert len(accepted) == 1  # one connection: no second try after the timeout
        for c in accepted:
            c.close()
        view._fresh["m", "t"] = (time.monotonic() - FRESHNESS_TTL, view._fresh["m", "t"][1])
        with pytest.raises(FreshnessUnavailable):
            view.freshness("m", "t")  # its time is up: asked again
        assert calls == ["m", "m"]
    finally:
        srv.close()
