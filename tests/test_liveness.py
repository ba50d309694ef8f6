"""Liveness alone: down, muted, back, purged, with a scripted clock, no sockets.

The host below records what the policy asks for; the behaviour over real ZeroMQ
sockets is proven by tests/test_subscriber.py ("dead engines") and
tests/test_server_zmq.py.
"""

from __future__ import annotations

import logging

import pytest

from kvconductor.ingest.liveness import SOURCE_DOWN, SOURCE_PURGE, DpKey, Liveness
from kvconductor.ingest.stats import SourceStats

DP0: DpKey = ("m", "t", "eng", 0)
DP1: DpKey = ("m", "t", "eng", 1)


class Src:
    """One subscription as the policy sees it."""

    def __init__(self, name: str, dp: DpKey = DP0, *, hbm: bool = True) -> None:
        self._name = name
        self.dp_key = dp
        self.feeds_hbm = hbm
        self.passive = False
        self.state = "live"
        self.down_since: float | None = None
        self.muted = False
        self.stats = SourceStats()

    def name(self) -> str:
        return self._name


class Host:
    """Records mutes and purges; ``blocks`` is what each DP's HBM workers hold."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, DpKey, bool | None]] = []
        self.muted: dict[DpKey, bool] = {}
        self.blocks: dict[DpKey, int] = {DP0: 4, DP1: 7}

    def set_dp_muted(self, dp: DpKey, muted: bool) -> None:
        self.calls.append(("mute", dp, muted))
        self.muted[dp] = muted

    def purge_dp(self, dp: DpKey) -> int:
        self.calls.append(("purge", dp, None))
        n, self.blocks[dp] = self.blocks[dp], 0
        return n


@pytest.fixture
def host() -> Host:
    return Host()


def test_defaults():
    lv = Liveness(Host())
    assert (lv.source_down, lv.source_purge) == (SOURCE_DOWN, SOURCE_PURGE) == (10.0, 600.0)


def test_a_live_source_is_never_down(host):
    lv = Liveness(host)
    s = Src("a")
    for t in (0.0, 100.0, 10_000.0):
        lv.check([s], t)
    assert (s.down_since, s.muted, s.stats.mutes, host.calls) == (None, False, 0, [])


def test_down_is_dated_at_the_first_check_that_sees_it_and_cleared_when_ready(host):
    lv = Liveness(host)
    s = Src("a")
    s.state = "connecting"
    lv.check([s], 100.0)
    assert s.down_since == 100.0
    lv.check([s], 105.0)
    assert s.down_since == 100.0  # not moved by later checks
    s.state = "degraded"  # ready (a loss's grace period still counts)
    lv.check([s], 106.0)
    assert s.down_since is None


def test_muted_at_source_down_then_back_then_muted_again(host, caplog):
    caplog.set_level(logging.INFO, "kvconductor.ingest")
    lv = Liveness(host, source_down=10.0, source_purge=0)
    s = Src("a")
    s.state = "connecting"
    lv.check([s], 50.0)
    lv.check([s], 59.9)
    assert (s.muted, host.calls) == (False, [])
    lv.check([s], 60.0)
    assert (s.muted, s.stats.mutes, lv.muted_dps) == (True, 1, {DP0})
    assert host.calls == [("mute", DP0, True)]
    lv.check([s], 61.0)  # re-applied every check (a worker the DP gained meanwhile)
    assert host.calls == [("mute", DP0, True)] * 2
    assert s.stats.mutes == 1  # counted once per outage
    assert "not ready (connecting) for 10s" in caplog.text
    assert "dropped after" not in caplog.text  # source_purge 0: never
    s.state = "live"
    lv.check([s], 62.0)
    assert (s.muted, s.down_since, lv.muted_dps) == (False, None, set())
    assert host.calls[-1] == ("mute", DP0, False)
    assert "ready again (live)" in caplog.text
    s.state = "replaying"
    lv.check([s], 70.0)
    lv.check([s], 80.0)
    assert (s.muted, s.stats.mutes) == (True, 2)


def test_a_dp_is_muted_only_when_all_its_hbm_sources_are_down_for_the_shortest_time(host):
    lv = Liveness(host, source_down=10.0)
    a, b = Src("a"), Src("b")
    pool = Src("pool", hbm=False)
    a.state = pool.state = "connecting"
    lv.check([a, b, pool], 0.0)
    lv.check([a, b, pool], 100.0)  # b still serves the DP
    assert (a.muted, b.muted, host.calls) == (False, False, [])
    assert pool.down_since == 0.0  # down, but no HBM stream: never muted
    b.state = "connecting"
    lv.check([a, b, pool], 105.0)
    lv.check([a, b, pool], 114.9)  # down since 105 (b), not since 0 (a)
    assert host.calls == []
    lv.check([a, b, pool], 115.0)
    assert (a.muted, b.muted, pool.muted) == (True, True, False)
    assert (a.stats.mutes, b.stats.mutes, pool.stats.mutes) == (1, 1, 0)


def test_purged_once_per_outage_into_the_first_sources_count(host, caplog):
    lv = Liveness(host, source_down=10.0, source_purge=600.0)
    a, b = Src("a"), Src("b")
    a.state = b.state = "connecting"
    lv.check([a, b], 0.0)
    lv.check([a, b], 599.9)
    assert ("purge", DP0, None) not in host.calls
    lv.check([a, b], 600.0)
    lv.check([a, b], 700.0)
    assert host.calls.count(("purge", DP0, None)) == 1
    assert (a.stats.purged_blocks, b.stats.purged_blocks, host.blocks[DP0]) == (4, 0, 0)
    assert "down for 600s; 4 HBM blocks dropped" in caplog.text
    # back, then down again: a new outage is purged again
    a.state = "live"
    lv.check([a, b], 701.0)
    a.state = "connecting"
    host.blocks[DP0] = 3
    lv.check([a, b], 800.0)
    lv.check([a, b], 1400.0)
    assert (a.stats.purged_blocks, host.blocks[DP0]) == (7, 0)


def test_dps_are_decided_apart(host):
    lv = Liveness(host, source_down=10.0)
    a, b = Src("a", DP0), Src("b", DP1)
    a.state = "connecting"
    lv.check([a, b], 0.0)
    lv.check([a, b], 10.0)
    assert host.calls == [("mute", DP0, True)]
    assert (a.muted, b.muted, lv.muted_dps) == (True, False, {DP0})


def test_a_muted_dp_whose_sources_are_gone_is_unmuted(host):
    lv = Liveness(host, source_down=10.0)
    a = Src("a")
    a.state = "connecting"
    lv.check([a], 0.0)
    lv.check([a], 10.0)
    assert lv.muted_dps == {DP0}
    lv.check([], 11.0)  # unregistered
    assert host.calls[-1] == ("mute", DP0, False)
    assert lv.muted_dps == set()
    lv.check([], 12.0)
    assert len(host.calls) == 2  # nothing left to do


def test_a_passive_source_is_down_as_its_owner_reports(host):
    lv = Liveness(host, source_down=10.0)
    a = Src("a")
    a.passive, a.state = True, "remote"
    lv.check([a], 0.0)
    assert a.down_since is None  # never dated here
    a.down_since = -5.0  # the owner: down for 5 s at 0
    lv.check([a], 4.9)
    assert not a.muted
    lv.check([a], 5.0)
    assert a.muted and a.down_since == -5.0
    a.down_since = None  # the owner: ready again
    lv.check([a], 6.0)
    assert not a.muted


def test_a_source_reregistered_as_a_pool_stream_is_unmuted(host):
    lv = Liveness(host, source_down=10.0)
    a = Src("a")
    a.state = "connecting"
    lv.check([a], 0.0)
    lv.check([a], 10.0)
    assert a.muted
    a.feeds_hbm = False
    lv.check([a], 11.0)
    assert not a.muted
    assert host.calls[-1] == ("mute", DP0, False)  # its DP has no HBM source left
