"""``SubscriptionManager.check_sources`` (dead engines: mute, unmute, purge), which the
ingest thread runs every second, over 4,096 subscriptions (``--max-sources``' default)."""

import time
import types

import pytest

pytestmark = pytest.mark.benchmark(group="sources")

N = 4096


class _Ctx:
    def __init__(self, i: int) -> None:
        from kvconductor.keys import Medium

        self.instance_id = f"inst-{i // 8}"
        self.dp_rank = i % 8
        self.url = f"tcp://10.0.{i // 256}.{i % 256}:5557"
        self.model, self.tenant = "m", "t"
        self.is_pool = False
        self.engine_type = "vLLM"
        self.default_media = (Medium.NPU,)


class _Tracker:
    """What check_sources reads of a SequenceTracker (no sockets, no publisher)."""

    replaying = False
    degraded_since = None

    def state(self, connected: bool) -> str:
        return "live" if connected else "connecting"


def _manager(connected: bool):
    from kvconductor.ingest.host import LOCAL_SOURCES
    from kvconductor.ingest.liveness import Liveness
    from kvconductor.ingest.replicated import ReplicaState
    from kvconductor.ingest.stats import SourceStats
    from kvconductor.ingest.subscriber import SubscriptionManager
    from kvconductor.ingest.subscription import Subscription

    mgr = SubscriptionManager.__new__(SubscriptionManager)
    mgr.liveness = Liveness(mgr, source_down=10.0, source_purge=600.0)
    mgr.thread = types.SimpleNamespace(is_alive=lambda: False)
    mgr.conductor = types.SimpleNamespace(get_index=lambda model, tenant: None)
    mgr._subs = {}
    mgr._bounded = {}  # no store-only source
    mgr.journal = LOCAL_SOURCES
    for i in range(N):
        s = Subscription.__new__(Subscription)
        s.manager = mgr
        s.replica = ReplicaState(0, owned=True)  # no --state-url: every source owned
        s.ctx = _Ctx(i)
        s.feeds_hbm = Subscription._feeds_hbm(s.ctx)
        s.tracker = _Tracker()
        s.connected = connected
        s.down_since = None
        s.muted = False
        s.stats = SourceStats()
        mgr._subs[(s.ctx.instance_id, s.ctx.dp_rank, s.ctx.url)] = s
    return mgr


def test_check_4096_live_sources(benchmark):
    mgr = _manager(connected=True)
    benchmark(mgr.check_sources)
    assert not mgr.liveness.muted_dps


def test_check_4096_muted_sources(benchmark, caplog):
    """A whole-cluster outage: every DP muted, re-applied each tick."""
    caplog.set_level("ERROR")  # 4,096 WARN lines at the first check
    mgr = _manager(connected=False)
    now = time.monotonic()
    mgr.check_sources(now)
    benchmark(mgr.check_sources, now + 20)
    assert len(mgr.liveness.muted_dps) == N


def test_heartbeat_cost_measures_idle_subscriptions(capsys):
    """``bench/heartbeat_cost.py`` small: a row per I/O thread count, and one without
    heartbeats, each with the CPU of the subscribing process."""
    import json

    from bench import heartbeat_cost as hc

    assert (
        hc.main(["--sources", "8", "--io-threads", "1", "2", "--seconds", "0.3", "--no-heartbeats"])
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["sources"], r["io_threads"], r["heartbeats"]) for r in rows] == [
        (8, 1, True),
        (8, 2, True),
        (8, 1, False),
    ]
    assert all(r["core_percent"] >= 0 for r in rows)


def test_ingest_loop_counts_every_message_and_its_cpu(capsys):
    """``bench/ingest_loop.py`` small: every message sent over every socket is received
    by the ingest thread's handlers, and its CPU per message is read."""
    import json

    from bench import ingest_loop as il

    assert il.main(["--sockets", "4", "--messages", "200", "--runs", "1"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["sockets"], row["messages"], row["sent"]) == (4, 200, 200)
    assert row["cpu_us_per_message"] >= 0
