"""SubscriptionManager over real tcp on 127.0.0.1: live ingest, replay, gaps, restarts, pools."""

from __future__ import annotations

import os
import random
import threading
import time
import types

import msgspec
import pytest
import zmq

from kvconductor.ingest.apply import Applier
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.subscriber import SubscriptionManager
from kvconductor.ingest.thread import IngestThread
from kvconductor.keys import Medium, StoreBackend
from tests.helpers.harness import Harness
from tests.helpers.publishers import (
    FakeConductor,
    FakePublisher,
    InstanceInfo,
    PoolPublisher,
    hits,
    mooncake_tuple,
    schema,
    wait_until,
)

BS = 4
V33 = schema("vllm", "0.33.0")
V09 = schema("vllm", "0.9.0")
IID = "vllm-prefill-a"


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()
    assert harness.thread.errors == 0


@pytest.fixture
def pubs():
    created = []

    def make(*a, **kw):
        p = FakePublisher(*a, **kw)
        created.append(p)
        return p

    yield make
    for p in created:
        p.stop()


def ctx(
    url,
    iid=IID,
    dp=0,
    replay=None,
    media=(Medium.NPU,),
    is_pool=False,
    model="m",
    backend=StoreBackend.MOONCAKE,
):
    return SubscriberContext(
        instance_id=iid,
        dp_rank=dp,
        url=url,
        model=model,
        tenant="t",
        block_size=BS,
        default_media=tuple(media),
        store_backend=backend,
        is_pool=is_pool,
        replay_endpoint=replay,
    )


def toks(i, nblocks=4):
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + nblocks * BS))


def stored(s, i, nblocks=4, medium="GPU", base=None, parent=None, start=0):
    t = toks(i, start + nblocks)[start * BS :]
    b = (i + 1) * 1000 if base is None else base
    return (
        s.stored([b + start + k for k in range(nblocks)], parent, t, BS, medium=medium, group_idx=0)
        if "medium" in s.stored_fields
        else s.stored([b + start + k for k in range(nblocks)], parent, t, BS)
    )


def warm_up(h, pub, s=V33, iid=IID, dp=0):
    """PUB/SUB slow joiner: wait until the subscription reached the PUB, then publish
    an empty batch and wait until it arrived."""
    src0 = h.source(iid, dp, pub.url)
    before = src0["batches"] if src0 else 0
    pub.wait_subscribed()
    pub.publish(s.batch([]))
    wait_until(lambda: h.source(iid, dp, pub.url)["batches"] > before, msg="first live batch")


# --- live ---------------------------------------------------------------------------------------


def test_publish_reaches_index(h, pubs):
    pub = pubs(topic=b"kv-events", replay=False)
    h.subscribe(ctx(pub.url))
    warm_up(h, pub)
    pub.publish(V33.batch([stored(V33, 0), stored(V33, 1, 2)], dp=0))
    wait_until(lambda: h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}, msg="blocks indexed")
    assert h.hits(toks(1, 2)) == {(IID, 0): (2, 0, 0)}
    src = h.source()
    assert src["state"] == "live" and src["blocks"] == 6 and src["gaps"] == 0
    assert src["last_seq"] == pub.seq - 1
    assert set(src) >= {
        "instance_id",
        "dp_rank",
        "url",
        "state",
        "last_seq",
        "batches",
        "events",
        "blocks",
        "gaps",
        "replays",
        "restarts",
        "dropped",
    }


def test_vllm_09_layout_over_tcp(h, pubs):
    pub = pubs(replay=False)
    h.subscribe(ctx(pub.url, dp=3))
    warm_up(h, pub, V09, dp=3)
    pub.publish(V09.batch([stored(V09, 0)]))
    wait_until(lambda: h.hits(toks(0)) == {(IID, 3): (4, 0, 0)}, msg="0.9 batch indexed")


def test_garbage_frames_never_stop_the_thread(h, pubs):
    pub = pubs(replay=False)
    h.subscribe(ctx(pub.url))
    warm_up(h, pub)
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    url2 = f"tcp://127.0.0.1:{raw_port}"
    h.subscribe(ctx(url2, dp=1))
    rng = random.Random(5)
    good = V33.batch([stored(V33, 2)])
    try:

        def send_junk():
            raw.send_multipart([b"", (0).to_bytes(8, "big"), V33.batch([])])
            src = h.source(IID, 1)
            return src and src["batches"]

        wait_until(send_junk, msg="raw publisher connected")
        seq = 1
        for i in range(300):
            kind = i % 4
            if kind == 0:
                raw.send_multipart([b"x"])
            elif kind == 1:
                raw.send_multipart([b"", b"\x01\x02", good])
            elif kind == 2:
                raw.send_multipart([b"", seq.to_bytes(8, "big"), good[: rng.randrange(len(good))]])
                seq += 1
            else:
                raw.send_multipart(
                    [
                        b"",
                        seq.to_bytes(8, "big"),
                        bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40))),
                    ]
                )
                seq += 1
        raw.send_multipart([b"", seq.to_bytes(8, "big"), good])
        wait_until(lambda: h.hits(toks(2)) == {(IID, 1): (4, 0, 0)}, msg="good batch after junk")
        src = h.source(IID, 1)
        assert src["dropped"]["short_message"] == 75 and src["dropped"]["bad_seq_frame"] == 75
        assert sum(src["dropped"].values()) >= 150 + 75
        assert h.thread.is_alive()
    finally:
        raw.close(linger=0)


def test_unsubscribe_and_replace(h, pubs):
    pub = pubs(replay=False)
    h.subscribe(ctx(pub.url))
    h.subscribe(ctx(pub.url))  # replaces, does not duplicate
    h.subscribe(ctx("tcp://127.0.0.1:1", dp=0))  # second URL of the same DP: connecting
    # A socket that cannot be opened raises and leaves nothing behind (the registration
    # that asked for it is rolled back).
    with pytest.raises(zmq.ZMQError):
        h.subscribe(ctx("", dp=0))
    assert len(h.call(h.mgr.sources)) == 2
    assert h.source(url="tcp://127.0.0.1:1")["state"] == "connecting"
    assert h.call(h.mgr.unsubscribe, IID, 0) == 2
    assert h.call(h.mgr.unsubscribe, IID, 0) == 0
    assert h.call(h.mgr.sources) == []


def _by_dp_rebuilt(mgr) -> dict:
    """The (instance, DP) -> {url: subscription} index as a scan of the table gives it."""
    out: dict = {}
    for (iid, dp, url), sub in mgr._subs.items():
        out.setdefault((iid, dp), {})[url] = sub
    return out


def test_dp_index_follows_the_table(h):
    """The (instance, DP) index that replace/count/unsubscribe use stays what a scan of
    every subscription gives, in the same order, through subscribe, replace (kept, new
    and dropped URLs), a failed replace, unsubscribe and close."""
    mgr = h.mgr

    def check():
        def same():
            idx = mgr._by_dp
            want = _by_dp_rebuilt(mgr)
            assert idx == want
            # within a DP, the table's order (the order replace hands over and closes in)
            assert {k: list(v) for k, v in idx.items()} == {k: list(v) for k, v in want.items()}
            return {k: len(v) for k, v in idx.items()}

        return h.call(same)

    url = "tcp://127.0.0.1:{}".format
    h.subscribe(ctx(url(1), dp=0))
    h.subscribe(ctx(url(2), dp=0))
    h.subscribe(ctx(url(3), dp=1))
    h.subscribe(ctx(url(4), iid="other", dp=0))
    h.subscribe(ctx(url(1), dp=0))  # re-subscribed: moves to the end of its DP
    assert check() == {(IID, 0): 2, (IID, 1): 1, ("other", 0): 1}
    assert h.call(mgr.count, IID, 0) == 2 and h.call(mgr.count, "nobody", 0) == 0
    assert list(h.call(lambda: mgr._by_dp[IID, 0])) == [url(2), url(1)]
    # keep url(1), drop url(2), add url(5) and url(6)
    opened = h.call(mgr.replace, IID, 0, [ctx(url(5)), ctx(url(1)), ctx(url(6))])
    assert opened == {url(5), url(6)}
    assert check() == {(IID, 0): 3, (IID, 1): 1, ("other", 0): 1}
    assert list(h.call(lambda: mgr._by_dp[IID, 0])) == [url(1), url(5), url(6)]
    with pytest.raises(zmq.ZMQError):  # an unopenable URL: nothing changes
        h.call(mgr.replace, IID, 0, [ctx(url(7)), ctx("")])
    assert check() == {(IID, 0): 3, (IID, 1): 1, ("other", 0): 1}
    assert h.call(mgr.replace, IID, 1, []) == set()
    assert check() == {(IID, 0): 3, ("other", 0): 1}
    assert h.call(mgr.unsubscribe, IID, 0) == 3
    assert check() == {("other", 0): 1}
    assert h.call(mgr.count, IID, 0) == 0
    h.call(mgr.close)
    assert check() == {}
    assert h.call(len, mgr) == 0


def test_idle_thread_does_not_spin(h, pubs):
    pub = pubs(replay=False)
    h.subscribe(ctx(pub.url))
    warm_up(h, pub)
    tid = h.call(threading.get_native_id)

    def cpu():
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    c0, t0 = cpu(), time.monotonic()
    time.sleep(1.5)
    used, wall = cpu() - c0, time.monotonic() - t0
    assert used < 0.5 * wall, f"ingest thread used {used:.2f}s CPU in {wall:.2f}s idle"


# --- replay, gaps, restarts ---------------------------------------------------------------------


def _workload(seed=11, n=30):
    """Realistic batches: new chains, continuations, removals, some clears of nothing."""
    rng = random.Random(seed)
    batches = []
    for i in range(n):
        evs = [stored(V33, i, rng.randrange(1, 5))]
        if i >= 2 and rng.random() < 0.5:
            j = rng.randrange(i)
            evs.append(V33.removed([(j + 1) * 1000], medium="GPU", group_idx=0))
        if i >= 1 and rng.random() < 0.3:
            evs.append(
                stored(V33, i - 1, 2, start=4)
            )  # continuation of chain i-1 (parent = last block)
            evs[-1].parent_block_hash = i * 1000 + 3
        batches.append(V33.batch(evs, dp=0))
    return batches


def _snapshot(index, n=30):
    out = {i: hits(index, toks(i, 6), BS) for i in range(n)}
    s = index.summary()
    s.pop("bytes", None)
    return out, s


@pytest.mark.parametrize("layout", ["new", "old"])
def test_gap_replay_matches_no_loss_run(h, pubs, layout):
    batches = _workload()
    ref = FakeConductor()
    a = Applier(ctx("tcp://ref"), ref)
    for b in batches:
        assert a.apply_payload(b)
    expected = _snapshot(ref.indexes[("m", "t")])

    pub = pubs(topic=b"kv-events", layout=layout)
    c = ctx(pub.url, replay=pub.replay_url)
    h.subscribe(c, replay=True)  # first registration: replay from 0
    wait_until(
        lambda: h.source()["replays"] >= 1 and h.source()["state"] != "replaying",
        msg="initial replay",
    )
    wait_until(lambda: h.source()["state"] == "live", msg="connected")
    drop = {5, 6, 7, 15, 22}
    for i, b in enumerate(batches):
        pub.publish(b, drop=i in drop)
    wait_until(
        lambda: h.source()["last_seq"] == len(batches) - 1 and h.source()["state"] == "live",
        msg="all batches applied",
    )
    got = _snapshot(h.index())
    assert got == expected
    src = h.source()
    assert src["gaps"] >= 1 and src["replays"] >= 2 and src["restarts"] == 0
    assert src["resyncs"] == 0 and src["state"] == "live"
    assert all(r >= 0 for r in pub.replay_requests)


def test_initial_replay_catches_up_and_buffer_exhaustion(h, pubs):
    pub = pubs(buffer_steps=3, layout="old")
    for i in range(6):
        pub.publish(V33.batch([stored(V33, i, 2)]))
    h.subscribe(ctx(pub.url, replay=pub.replay_url), replay=True)
    wait_until(lambda: h.source()["last_seq"] == 5, msg="replayed")
    src = h.source()
    # seqs 0..2 fell out of the 3-batch ring: a loss; the stream goes on from seq 3
    assert src["state"] in ("degraded", "connecting") and src["resyncs"] == 1
    assert [bool(h.hits(toks(i, 2))) for i in range(6)] == [False] * 3 + [True] * 3
    assert pub.replay_requests[0] == 0


def test_initial_replay_complete(h, pubs):
    pub = pubs()
    for i in range(5):
        pub.publish(V33.batch([stored(V33, i, 2)]))
    h.subscribe(ctx(pub.url, replay=pub.replay_url), replay=True)
    wait_until(
        lambda: h.source()["last_seq"] == 4 and h.source()["state"] == "live", msg="replayed"
    )
    pub.publish(V33.batch([stored(V33, 5, 2)]))
    wait_until(lambda: h.source()["last_seq"] == 5, msg="live after replay")
    assert all(h.hits(toks(i, 2)) == {(IID, 0): (2, 0, 0)} for i in range(6))
    src = h.source()
    assert src["resyncs"] == 0 and src["gaps"] == 0 and src["replayed_batches"] == 5


@pytest.mark.parametrize("with_replay", [True, False])
def test_publisher_restart_keeps_then_ages_out_old_blocks(h, pubs, with_replay):
    """A restarted publisher is a loss: the old incarnation's blocks stay (nothing is wiped
    at once), the new one's are applied, and after the grace period the old blocks that
    nobody announced again are dropped.

    Without replay the restart is seen only as the seq going back (docs/events.md,
    "Limits"), and the new publisher's warm-up batches keep counting up until the SUB has
    reconnected: one per 20 ms poll, over a reconnect delay of 100 ms (libzmq 4.3.5) or
    100-200 ms (4.3.4, bundled by pyzmq 25 wheels, adds random jitter). So the first
    incarnation ends at a seq far above that, as a publisher that has been up a while does.
    """
    h.call(lambda: setattr(h.mgr, "loss_grace", 3.0))
    pub = pubs(replay=with_replay, start_seq=0 if with_replay else 1000)
    c = ctx(pub.url, replay=pub.replay_url)
    h.subscribe(c, replay=with_replay)
    if not with_replay:
        warm_up(h, pub)
    else:
        wait_until(lambda: h.source()["state"] == "live", msg="live")
    for i in range(5):
        pub.publish(V33.batch([stored(V33, i, 2)]))
    wait_until(lambda: h.hits(toks(4, 2)), msg="first incarnation indexed")
    if with_replay:
        wait_until(lambda: all(h.hits(toks(i, 2)) for i in range(5)), msg="all of incarnation 1")
    port, rport = pub.port, pub.replay_port
    pub.stop()
    wait_until(lambda: h.source()["state"] == "connecting", msg="disconnect seen")
    pub2 = pubs(port, rport, replay=with_replay)
    if with_replay:
        # published before we reconnect: recovered through the replay from 0
        pub2.publish(V33.batch([stored(V33, 7, 2)]))
    else:
        warm_up(h, pub2)
    pub2.publish(V33.batch([stored(V33, 8, 2)]))
    wait_until(
        lambda: h.hits(toks(8, 2)) == {(IID, 0): (2, 0, 0)}, msg="second incarnation indexed"
    )
    wait_until(lambda: h.source()["state"] != "replaying", msg="replay done")
    src = h.source()
    assert src["restarts"] >= 1 and src["state"] == "degraded" and src["degraded_since"]
    assert all(h.hits(toks(i, 2)) == {(IID, 0): (2, 0, 0)} for i in range(5)), "kept meanwhile"
    wait_until(lambda: h.source()["state"] == "live", msg="grace period over")
    assert all(h.hits(toks(i, 2)) == {} for i in range(5)), "old incarnation aged out"
    assert h.source()["aged_out_blocks"] == 10 and h.source()["degraded_since"] is None
    assert h.hits(toks(8, 2)) == {(IID, 0): (2, 0, 0)}
    if with_replay:
        assert h.hits(toks(7, 2)) == {(IID, 0): (2, 0, 0)}
        assert 0 in pub2.replay_requests


def test_gap_without_replay_keeps_state_and_ages_out_the_unconfirmed(h, pubs):
    """A lost batch costs no more than what it carried: what was indexed before stays, later
    stores whose parents were indexed before the gap still apply (the reference cleared the
    DP, so every later store failed as parent_not_found), and after the grace period only
    the blocks that nothing announced again are dropped."""
    h.call(lambda: setattr(h.mgr, "loss_grace", 1.5))
    pub = pubs(replay=False)
    h.subscribe(ctx(pub.url))
    warm_up(h, pub)
    pub.publish(V33.batch([stored(V33, 0, 2)]))  # blocks 1000, 1001
    pub.publish(V33.batch([stored(V33, 3, 2)]))  # blocks 4000, 4001
    pub.publish(V33.batch([stored(V33, 1, 2)]), drop=True)  # lost
    pub.publish(V33.batch([stored(V33, 2, 2)]))
    wait_until(lambda: h.hits(toks(2, 2)), msg="after the gap")
    src = h.source()
    assert src["gaps"] == 1 and src["resyncs"] == 1 and src["state"] == "degraded"
    # Nothing was wiped: only the lost batch's blocks are missing.
    assert h.hits(toks(0, 2)) == {(IID, 0): (2, 0, 0)} and h.hits(toks(3, 2)) == {
        (IID, 0): (2, 0, 0)
    }
    assert h.hits(toks(1, 2)) == {}
    # The engine extends chain 0 (parent 1001, cached before the gap): it applies.
    pub.publish(V33.batch([stored(V33, 0, 2, parent=1001, start=2)]))
    wait_until(lambda: h.hits(toks(0, 4)) == {(IID, 0): (4, 0, 0)}, msg="extension applied")
    assert "parent_not_found" not in h.source()["dropped"]
    wait_until(lambda: h.source()["state"] == "live", msg="grace period over")
    # Chain 0 was confirmed through its child, chain 2 came after the loss; chain 3 was
    # never announced again: dropped.
    assert h.hits(toks(0, 4)) == {(IID, 0): (4, 0, 0)}
    assert h.hits(toks(2, 2)) == {(IID, 0): (2, 0, 0)}
    assert h.hits(toks(3, 2)) == {}
    assert h.source()["aged_out_blocks"] == 2


def test_second_loss_restarts_the_grace_period(h, pubs):
    h.call(lambda: setattr(h.mgr, "loss_grace", 2.0))
    pub = pubs(replay=False)
    h.subscribe(ctx(pub.url))
    warm_up(h, pub)
    pub.publish(V33.batch([stored(V33, 0, 2)]))
    pub.publish(V33.batch([]), drop=True)
    pub.publish(V33.batch([stored(V33, 1, 2)]))
    wait_until(lambda: h.source()["resyncs"] == 1, msg="first loss")
    pub.publish(V33.batch([]), drop=True)
    pub.publish(V33.batch([stored(V33, 2, 2)]))
    wait_until(lambda: h.source()["resyncs"] == 2, msg="second loss")
    # Chain 1 was stored between the losses: a suspect of the second one.
    wait_until(lambda: h.source()["state"] == "live", msg="grace period over")
    assert h.hits(toks(0, 2)) == {} and h.hits(toks(1, 2)) == {}
    assert h.hits(toks(2, 2)) == {(IID, 0): (2, 0, 0)}
    assert h.source()["aged_out_blocks"] == 4


def test_replay_endpoint_dead_falls_back_to_resync(h, pubs):
    pub = pubs(replay=False)
    from tests.helpers.publishers import free_tcp_port

    dead = f"tcp://127.0.0.1:{free_tcp_port()}"
    h.call(lambda: setattr(h.mgr, "replay_timeout", 0.5))
    h.subscribe(ctx(pub.url, replay=dead), replay=True)
    wait_until(lambda: h.source()["dropped"].get("replay_failed"), msg="replay times out")
    warm_up(h, pub)
    pub.publish(V33.batch([stored(V33, 0, 2)]))
    pub.publish(V33.batch([stored(V33, 1, 2)]), drop=True)
    pub.publish(V33.batch([stored(V33, 2, 2)]))
    wait_until(lambda: h.hits(toks(2, 2)) and h.source()["state"] != "replaying", msg="resynced")
    src = h.source()
    assert src["dropped"]["replay_failed"] >= 2 and src["resyncs"] >= 1
    assert h.thread.is_alive()


# --- pools --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["pool_first", "engine_first"])
def test_mooncake_pool_confirmations(h, pubs, order):
    h.conductor.ip_index["127.0.0.1"] = [(IID, 0), (IID, 1)]
    h.conductor.instances[IID] = InstanceInfo("m", "t", BS)
    eng = pubs(replay=False)
    pool = PoolPublisher()
    try:
        h.subscribe(ctx(eng.url))
        h.subscribe(
            ctx(
                pool.url,
                iid="mooncake-pool",
                model="default",
                is_pool=True,
                media=(Medium.NPU, Medium.CPU, Medium.DISK),
            )
        )
        warm_up(h, eng)

        def pool_warm():
            src = h.source("mooncake-pool", 0)
            if src and src["batches"]:
                return True
            pool.publish(mooncake_tuple([]))
            return False

        wait_until(pool_warm, msg="pool subscriber connected")
        eng.publish(V33.batch([stored(V33, 0, 2)]))  # blocks 0,1 on GPU
        wait_until(lambda: h.hits(toks(0, 4)) == {(IID, 0): (2, 0, 0)}, msg="gpu")
        conf = mooncake_tuple(
            [
                {
                    "event_id": 1,
                    "event_type": "stored",
                    "backend_id": "127.0.0.1",
                    "medium": "cpu",
                    "seq_hashes": [1002, 1003],
                }
            ]
        )
        off = V33.batch([stored(V33, 0, 2, medium="CPU", start=2, parent=1001)])
        if order == "pool_first":
            pool.publish(conf)
            wait_until(lambda: h.index().summary()["pending_pool"] == 4, msg="pending x2 DPs")
            eng.publish(off)
        else:
            eng.publish(off)
            wait_until(lambda: h.index().summary()["offload"] == 2, msg="phase 1")
            pool.publish(conf)
        wait_until(lambda: h.hits(toks(0, 4)) == {(IID, 0): (2, 2, 0)}, msg="CPU hits")
        assert ("default", "t") not in h.conductor.indexes
    finally:
        pool.stop()


def test_yuanrong_per_port_media_over_tcp(h, pubs):
    eng = pubs(replay=False)
    cpu, disk = PoolPublisher(), PoolPublisher()
    try:
        yr = {"iid": "yr-1", "dp": 2, "backend": StoreBackend.YUANRONG}
        h.subscribe(ctx(eng.url, **yr))
        h.subscribe(ctx(cpu.url, media=(Medium.CPU,), **yr))
        h.subscribe(ctx(disk.url, media=(Medium.DISK,), **yr))
        warm_up(h, eng, iid="yr-1", dp=2)
        for p in (cpu, disk):

            def warm(p=p):
                src = h.source("yr-1", 2, p.url)
                if src and src["batches"]:
                    return True
                p.publish(mooncake_tuple([]))
                return False

            wait_until(warm, msg="pool port connected")
        eng.publish(
            V33.batch([stored(V33, 0, 1), stored(V33, 0, 3, medium="CPU", start=1, parent=1000)])
        )
        wait_until(lambda: h.index() and h.index().summary()["offload"] == 3, msg="offload")
        cpu.publish(mooncake_tuple([{"event_type": "stored", "seq_hashes": [1001, 1002]}], dp=0))
        disk.publish(
            msgspec.msgpack.encode(
                {"events": [{"event_type": "stored", "seq_hashes": ["0x3e9", "0x3ea", "0x3eb"]}]}
            )
        )
        wait_until(lambda: h.hits(toks(0, 4)) == {("yr-1", 2): (1, 2, 1)}, msg="per-port media")
    finally:
        cpu.stop()
        disk.stop()


def test_documented_payloads_over_tcp(h, pubs):
    """The spec's byte-level examples, streamed by a publisher, end up in the index."""
    from tests.helpers.payloads import EX_A_V033, EX_B_V023, EX_C_V092, EX_E_SGL0523

    pub = pubs(topic=b"kv-events", replay=False)
    c = SubscriberContext(
        instance_id=IID,
        dp_rank=0,
        url=pub.url,
        model="m",
        tenant="t",
        block_size=2,
        default_media=(Medium.NPU,),
    )
    h.call(h.mgr.subscribe, c)
    warm_up(h, pub)
    idx = lambda: h.index()

    def q(tokens):
        return hits(idx(), tokens, 2)

    for payload in (EX_C_V092, b"\x92" + EX_C_V092[1:-1], EX_B_V023):
        pub.publish(payload)
        wait_until(lambda: q([1, 2, 3, 4]) == {(IID, 0): (2, 0, 0)}, msg="stored")
        pub.publish(EX_A_V033)  # BlockRemoved(H2) + AllBlocksCleared
        wait_until(lambda: q([1, 2, 3, 4]) == {}, msg="cleared")
    s33 = V33
    d1, d2 = bytes(range(32)), bytes(range(32, 64))
    pub.publish(s33.batch([s33.stored([d1, d2], None, [1, 2, 3, 4], 2, medium="GPU", group_idx=0)]))
    wait_until(lambda: q([1, 2, 3, 4]) == {(IID, 0): (2, 0, 0)}, msg="bytes hashes stored")
    h2 = int.from_bytes(d2[-8:], "big")
    pub.publish(
        s33.batch([s33.removed([h2], medium="GPU", group_idx=0)])
    )  # int form of the bin hash
    wait_until(lambda: q([1, 2, 3, 4]) == {(IID, 0): (1, 0, 0)}, msg="removed by int form")
    pub.publish(EX_E_SGL0523)  # SGLang: store -5, remove -5, clear
    wait_until(lambda: h.source()["events"] == 14 and q([1, 2, 3, 4]) == {}, msg="sglang batch")
    src = h.source()
    assert src["dropped"] == {} and src["gaps"] == 0


def test_bound_sub_for_connecting_publishers(h):
    """A '*' URL is bound: the engine's PUB connects to the conductor."""
    from tests.helpers.publishers import free_tcp_port

    errors = []
    for _ in range(5):  # another process may take the free port first
        port = free_tcp_port()
        try:
            h.subscribe(ctx(f"tcp://*:{port}"))
            break
        except zmq.ZMQError as ex:
            errors.append(repr(ex))
            assert h.call(h.mgr.sources) == []  # a failed open leaves nothing behind
    else:
        pytest.fail(f"no free port could be bound: {errors}")
    # connect only once the SUB listens: a connect to a closed loopback port can
    # pick that very port as its source port and hold it (TCP self-connect)
    wait_until(lambda: h.source()["connected"], msg="SUB bound")
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        seq = 0

        def send(payload):
            nonlocal seq
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1

        wait_until(lambda: send(V33.batch([])) or h.source()["batches"], msg="bound SUB receives")
        send(V33.batch([stored(V33, 0)]))
        wait_until(lambda: h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}, msg="indexed via bound SUB")
    finally:
        pub.close(linger=0)


def test_replay_asked_when_the_engine_comes_up_after_registration(h, pubs):
    """Registered while the engine is down: no replay is asked (it would be answered
    before the engine published anything); the SUB's first handshake asks, so what the
    engine published before we connected is recovered."""
    from tests.helpers.publishers import free_tcp_port

    h.call(lambda: setattr(h.mgr, "replay_timeout", 0.5))
    port, rport = free_tcp_port(), free_tcp_port()
    c = ctx(f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    h.subscribe(c, replay=True)
    time.sleep(1.0)  # two replay timeouts: a replay asked now would have failed
    src = h.source()
    assert (src["replays"], src["dropped"], src["losses"]) == (0, {}, 0)
    pub = pubs(port, rport)
    for i in range(3):
        pub.publish(V33.batch([stored(V33, i, 2)]))
    wait_until(
        lambda: all(h.hits(toks(i, 2)) == {(IID, 0): (2, 0, 0)} for i in range(3)),
        msg="replayed on the first connect",
    )
    assert pub.replay_requests[0] == 0 and h.source()["losses"] == 0


# --- dead engines: mute, back, purge (check_sources with a scripted clock) ------------------


def test_check_sources_mutes_a_dp_only_when_all_its_hbm_sources_are_down(h, pubs):
    p1, p2 = pubs(replay=False), pubs(replay=False)
    pool = pubs(replay=False)
    for p in (p1, p2):
        h.subscribe(ctx(p.url))
    h.subscribe(ctx(pool.url, media=(Medium.CPU,), is_pool=True))
    for p in (p1, p2):
        warm_up(h, p)
    p1.publish(V33.batch([stored(V33, 0)]))
    wait_until(lambda: h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}, msg="indexed")
    mgr = h.mgr
    assert (mgr.liveness.source_down, mgr.liveness.source_purge) == (10.0, 600.0)  # defaults
    t = time.monotonic()
    h.call(mgr.check_sources, t)
    assert [s["down_since"] for s in h.call(mgr.sources) if not s["is_pool"]] == [None, None]

    p1.stop()
    wait_until(lambda: h.source(url=p1.url)["state"] == "connecting", msg="p1 down")
    h.call(mgr.check_sources, t + 1)
    h.call(mgr.check_sources, t + 100)  # p2 still serves the DP: nothing muted
    assert h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}
    assert h.source(url=p1.url)["muted"] is False

    p2.stop()
    wait_until(lambda: h.source(url=p2.url)["state"] == "connecting", msg="p2 down")
    t = time.monotonic()  # the DP is down since p2 went, a moment before t
    h.call(mgr.check_sources, t + 8.9)
    assert h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}
    h.call(mgr.check_sources, t + 10)
    assert h.hits(toks(0)) == {}
    assert [(s["muted"], s["mutes"]) for s in h.call(mgr.sources)] == [
        (True, 1),
        (True, 1),
        (False, 0),  # the pool stream is never muted
    ]
    idx = h.index()
    assert idx.worker_blocks(idx.workers_of(IID, 0)[0]) == 4  # kept
    h.call(mgr.check_sources, t + 598.9)
    assert idx.worker_blocks(idx.workers_of(IID, 0)[0]) == 4
    h.call(mgr.check_sources, t + 600)  # 600 s down: purged once
    h.call(mgr.check_sources, t + 700)
    assert idx.worker_blocks(idx.workers_of(IID, 0)[0]) == 0
    assert [s["purged_blocks"] for s in h.call(mgr.sources)] == [4, 0, 0]
    snap = mgr.metrics_snapshot()
    assert snap.muted == [True, True, False]
    assert (snap.mutes, snap.purged_blocks) == (2, 4)


def test_unsubscribing_a_muted_dp_unmutes_its_workers(h, pubs):
    p = pubs(replay=False)
    h.subscribe(ctx(p.url))
    warm_up(h, p)
    p.publish(V33.batch([stored(V33, 0)]))
    wait_until(lambda: h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}, msg="indexed")
    p.stop()
    wait_until(lambda: h.source()["state"] == "connecting", msg="down")
    t = time.monotonic()
    h.call(h.mgr.check_sources, t)
    h.call(h.mgr.check_sources, t + 10)
    assert h.hits(toks(0)) == {}
    h.call(h.mgr.unsubscribe, IID, 0)
    h.call(h.mgr.check_sources, t + 11)
    assert h.hits(toks(0)) == {(IID, 0): (4, 0, 0)}  # the index keeps what unregister decides


# --- the sources' journal, handed in at construction (kvconductor.ingest.host) ----------------
class RecordingSources:
    """A replicated SourceJournal double: claims nothing, records what it is handed."""

    replicated = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def claims(self, key):
        return False

    def append_batch(self, sub, seq, payload):
        self.calls.append(("batch", sub.key, seq, payload))

    def append_loss(self, sub, why, epoch):
        self.calls.append(("loss", sub.key, why, epoch))

    def append_source(self, sub, kind, token, extra=None):
        self.calls.append((kind, sub.key, token, extra))

    def report_down(self, subs, now):
        self.calls.append(("report_down", len(list(subs))))

    def cursor(self, sub):
        return sub.replica.applied


def test_the_local_journal_owns_every_source_and_applies_at_once(h):
    from kvconductor.ingest.host import LOCAL_SOURCES

    assert h.mgr.journal is LOCAL_SOURCES
    h.subscribe(ctx("tcp://127.0.0.1:1"))
    sub = h.call(h.mgr.get, IID, 0, "tcp://127.0.0.1:1")
    assert sub.owned and not sub.passive and sub.down_since is not None
    applied = []
    sub.applier = types.SimpleNamespace(apply_payload=applied.append)
    h.call(sub.apply, b"payload", 7)
    assert applied == [b"payload"]
    assert h.call(h.mgr.cursors) == []  # the tracker applied nothing


def test_a_replicated_journal_gets_the_batches_losses_and_down_reports():
    """Handed to the manager at construction: a new subscription is passive (remote,
    up until its owner says otherwise, no replay asked), and what an owned one brings
    goes to the journal, never applied here directly."""
    thread = IngestThread(context=zmq.Context.instance())
    thread.start()
    rec = RecordingSources()
    try:
        mgr = thread.call(lambda: SubscriptionManager(thread, FakeConductor(), journal=rec))
        c = ctx("tcp://127.0.0.1:1", replay="tcp://127.0.0.1:2")
        thread.call(mgr.subscribe, c)
        thread.call(mgr.request_replay, c)
        sub = thread.call(mgr.get, IID, 0, "tcp://127.0.0.1:1")
        assert sub.passive and not sub.owned and sub.down_since is None
        assert sub.state == "remote" and sub.replay is None
        thread.call(sub.apply, b"payload", 7)
        thread.call(sub.lost, "a gap", 2)
        thread.call(mgr.check_sources)
        assert rec.calls == [
            ("batch", sub.key, 7, b"payload"),
            ("loss", sub.key, "a gap", 2),
            ("report_down", 1),
        ]
        assert thread.call(mgr.cursors) == []  # the log applied nothing here
        thread.call(mgr.close)
    finally:
        thread.stop()


def test_logged_loss_and_aged_entries_degrade_and_end_on_a_passive_source(caplog):
    """What every replica does with a source's ``loss`` and ``aged`` log entries: the
    cursor is forgotten and the source's blocks are suspects, then the suspects not
    announced again are dropped (the same lines as a loss of an owned source)."""
    thread = IngestThread(context=zmq.Context.instance())
    thread.start()
    try:
        mgr = thread.call(
            lambda: SubscriptionManager(thread, FakeConductor(), journal=RecordingSources())
        )
        thread.call(mgr.subscribe, ctx("tcp://127.0.0.1:1"))
        sub = thread.call(mgr.get, IID, 0, "tcp://127.0.0.1:1")
        sub.replica.applied = (4, 44)
        caplog.set_level("INFO", logger="kvconductor.ingest")
        thread.call(mgr.loss_logged, sub.key, 3, "3.1", "a gap")
        assert sub.replica.applied is None and sub.replica.loss_token == "3.1"
        assert sub.stats.resyncs == 1 and sub.tracker.last_loss[1] == "a gap"
        assert "a gap; source degraded: 0 blocks kept" in caplog.text
        thread.call(mgr.aged_logged, sub.key, 3, "other")  # not this loss: nothing
        assert sub.replica.loss_token == "3.1"
        thread.call(mgr.aged_logged, sub.key, 3, "3.1")
        assert sub.replica.loss_token is None
        assert "grace period after the loss is over; 0 blocks" in caplog.text
        thread.call(mgr.close)
    finally:
        thread.stop()
