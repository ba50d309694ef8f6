"""SequenceTracker alone: every transition with real sequence numbers, no sockets, no clock.

The host below records what the tracker asks for; the behaviour over real ZeroMQ
sockets is proven by tests/test_subscriber.py, tests/test_server_zmq.py and
tests/faults/test_replay.py / test_loss.py.
"""

from __future__ import annotations

import pytest

from kvconductor.ingest.stats import SourceStats
from kvconductor.ingest.tracker import SequenceTracker


class Host:
    """Records applied payloads, replay requests and losses."""

    def __init__(self) -> None:
        self.applied: list[bytes] = []
        self.replays: list[int] = []
        self.losses: list[tuple[str, int]] = []
        self.tracker: SequenceTracker | None = None
        #: Set to a reason to make the next open_replay fail at once (inside the call).
        self.fail_now: str | None = None

    def name(self) -> str:
        return "engine/dp0@tcp://h:5557"

    def apply(self, payload: bytes, seq: int) -> None:
        self.applied.append(payload)

    def open_replay(self, start: int) -> None:
        self.replays.append(start)
        if self.fail_now is not None:
            why, self.fail_now = self.fail_now, None
            self.tracker.replay_done(False, why, 50.0)

    def lost(self, why: str, epoch: int) -> None:
        self.losses.append((why, epoch))

    def no_replay_why(self) -> str:
        return "no replay_endpoint"


def make(replay: bool = True, **kw) -> tuple[SequenceTracker, Host, SourceStats]:
    host, stats = Host(), SourceStats()
    host.tracker = SequenceTracker(host, stats, replay=replay, **kw)
    return host.tracker, host, stats


def b(seq: int, tag: str = "") -> bytes:
    return f"batch-{seq}{tag}".encode()


def feed(t: SequenceTracker, *seqs: int, now: float = 1.0, tag: str = "") -> None:
    for s in seqs:
        t.live(s, b(s, tag), now)


def test_in_order_batches_are_applied_from_whatever_seq_comes_first():
    t, host, stats = make()
    feed(t, 41, 42, 43)
    assert host.applied == [b(41), b(42), b(43)]
    assert (t.last_seq, stats.last_seq, stats.gaps, host.replays, host.losses) == (
        43,
        43,
        0,
        [],
        [],
    )
    assert t.state(connected=True) == "live"


def test_gap_requests_a_verifying_replay_from_the_last_seq_and_buffers_live_batches():
    t, host, stats = make()
    feed(t, 1, 2)
    feed(t, 5, 6)  # 3 and 4 lost on the wire
    assert host.replays == [2] and t.replaying and stats.gaps == 1 and stats.replays == 1
    assert t.buffer == [(5, b(5)), (6, b(6))] and host.applied == [b(1), b(2)]
    assert t.state(connected=True) == "replaying"


def test_replay_success_merges_the_buffer_without_applying_anything_twice():
    t, host, stats = make()
    feed(t, 1, 2)
    feed(t, 5)  # gap: replay from 2
    for s in (2, 3, 4, 5):  # overlap batch 2 identical, then 3..5
        t.replayed(s, b(s), 2.0)
    feed(t, 6)  # live while the replay still runs
    t.replay_done(True, "complete", 3.0)
    assert host.applied == [b(1), b(2), b(3), b(4), b(5), b(6)]
    assert stats.duplicates == 1  # the buffered live 5, already applied by replay
    assert (t.last_seq, t.replaying, t.buffer, host.losses) == (6, False, [], [])
    assert stats.replayed_batches == 4 and t.degraded_since is None


def test_duplicate_live_batch_after_replay_is_skipped_and_dedup_ends_past_the_replayed_range():
    t, host, stats = make()
    t.catch_up()  # registration: replay from 0
    assert host.replays == [0]
    for s in (0, 1, 2):
        t.replayed(s, b(s), 1.0)
    t.replay_done(True, "complete", 1.0)
    feed(t, 2)  # the live copy of a replayed batch
    assert stats.duplicates == 1 and host.applied == [b(0), b(1), b(2)]
    feed(t, 3)
    assert t.dedup == {} and t.last_seq == 3


def test_replay_failure_is_a_loss_with_its_reason_and_the_buffer_is_applied_without_second_replay():
    t, host, stats = make()
    feed(t, 1)
    feed(t, 4, 5)
    t.replay_done(False, "no reply from tcp://h:6667 for 5.0s (0 batches received)", 7.5)
    assert host.losses == [
        ("replay failed: no reply from tcp://h:6667 for 5.0s (0 batches received)", 1)
    ]
    assert host.applied == [b(1), b(4), b(5)] and host.replays == [1]
    assert t.degraded_since == 7.5 and t.state(connected=True) == "degraded"
    assert stats.dropped == {"replay_failed": 1} and stats.resyncs == 1


def test_gap_without_replay_endpoint_is_a_loss_and_the_stream_goes_on():
    t, host, stats = make(replay=False)
    feed(t, 0, 1)
    feed(t, 3, now=9.0)
    assert host.losses == [("gap 1 -> 3 and no replay endpoint", 1)]
    assert host.applied == [b(0), b(1), b(3)] and t.last_seq == 3 and t.degraded_since == 9.0
    assert host.replays == [] and t.last_loss == (9.0, "gap 1 -> 3 and no replay endpoint")


def test_first_batch_past_0_without_replay_is_a_loss_naming_the_missed_range():
    t, host, stats = make(replay=False)
    feed(t, 47, 48, now=3.0)
    why = (
        "batches 0..46 were published before this subscription connected and are lost "
        "(first batch seen: 47; no replay_endpoint)"
    )
    assert host.losses == [(why, 1)] and t.last_loss == (3.0, why)
    assert host.applied == [b(47), b(48)] and t.last_seq == 48
    assert (stats.gaps, stats.resyncs, t.state(connected=True)) == (1, 1, "degraded")
    feed(t, 50, now=4.0)  # later gaps are gaps
    assert host.losses[1] == ("gap 48 -> 50 and no replay endpoint", 2)


def test_first_batch_0_or_the_cursor_successor_without_replay_is_no_loss():
    t, host, _ = make(replay=False)
    feed(t, 0, 1)
    assert host.losses == [] and host.applied == [b(0), b(1)]
    t, host, _ = make(replay=False)
    t.last_seq, t.last_digest = 9, 123  # warm start: a snapshot's cursor
    feed(t, 10)
    assert host.losses == [] and host.applied == [b(10)]


def test_after_a_loss_the_next_batch_is_taken_whatever_its_seq():
    t, host, _ = make(replay=False)
    feed(t, 0)
    t.live(0, b(0, "-new"), 2.0)  # restart: loss, applied
    feed(t, 7)  # the sequence was reset by the loss: no second "missed start" loss
    assert len(host.losses) == 2 and host.losses[1][0] == "gap 0 -> 7 and no replay endpoint"


def test_replay_failing_before_the_first_connect_is_asked_again_on_the_first_connect():
    t, host, _ = make()
    t.catch_up()  # registration, engine not up yet
    t.replay_done(False, "connect refused", 1.0)
    assert host.replays == [0] and host.losses[0][0] == "replay failed: connect refused"
    t.connected()  # the engine came up
    assert host.replays == [0, 0]
    t.replay_done(True, "complete", 2.0)
    t.connected()  # a reconnect: replay again (nothing applied yet)
    assert host.replays == [0, 0, 0]


def test_first_connect_replays_even_after_an_early_replay():
    """A replay answered before the SUB connected may predate everything the engine
    published: only one asked once connected counts."""
    t, host, _ = make()
    t.catch_up()
    t.replay_done(True, "complete", 1.0)
    t.connected()
    assert host.replays == [0, 0] and t.replaying


def test_connect_during_a_replay_asks_again_when_it_ends():
    t, host, _ = make()
    t.catch_up()  # asked before the connect
    t.connected()
    assert host.replays == [0] and t.replaying  # one at a time
    t.replayed(0, b(0), 1.0)
    t.replay_done(True, "complete", 1.0)
    assert host.replays == [0, 0] and t.replaying and t._verify  # verifies from 0
    t.replay_done(False, "no reply", 2.0)
    assert host.replays == [0, 0]  # asked once per connect, no loop


def test_reconnect_verifies_from_the_last_applied_seq():
    t, host, _ = make()
    t.connected()
    assert host.replays == [0]
    t.replay_done(True, "complete", 1.0)  # empty: the stream starts at 0
    feed(t, 0, 1)
    t.connected()
    assert host.replays == [0, 1] and t._verify


def test_engine_restart_seq_going_back_is_a_loss_and_replays_the_new_incarnation_from_0():
    t, host, stats = make()
    feed(t, 10, 11)
    t.live(3, b(3, "-new"), 4.0)
    assert host.losses == [("publisher restarted (seq went back from 11 to 3)", 1)]
    assert stats.restarts == 1 and host.replays == [0] and t.buffer == [(3, b(3, "-new"))]
    for s in (0, 1, 2, 3):
        t.replayed(s, b(s, "-new"), 5.0)
    t.replay_done(True, "complete", 5.0)
    assert host.applied[2:] == [b(s, "-new") for s in (0, 1, 2, 3)]
    assert stats.duplicates == 1 and t.last_seq == 3


def test_engine_restart_without_replay_applies_the_batch():
    t, host, stats = make(replay=False)
    feed(t, 10)
    t.live(0, b(0, "-new"), 4.0)
    assert stats.restarts == 1 and host.applied == [b(10), b(0, "-new")] and t.last_seq == 0


def test_publisher_found_on_new_endpoints_is_a_restart_then_caught_up_from_0():
    # A new subscription of an engine followed to its new ports (engine_url): the same
    # loss as a sequence going back, then the usual catch-up from 0 at the handshake.
    t, host, stats = make()
    t.restarted("found on new endpoints", 2.0)
    assert host.losses == [("publisher restarted (found on new endpoints)", 1)]
    assert stats.restarts == 1 and t.degraded_since == 2.0 and t.last_seq is None
    t.connected()
    assert host.replays == [0]
    t.replayed(0, b(0), 3.0)
    t.replay_done(True, "complete", 3.0)
    feed(t, 1)
    assert host.applied == [b(0), b(1)] and t.last_seq == 1


def test_overlap_batch_that_differs_means_a_restart_and_a_replay_from_0():
    t, host, stats = make()
    feed(t, 1, 2)
    feed(t, 4)  # gap: replay from 2, verifying
    t.replayed(2, b(2, "-other"), 3.0)
    t.replayed(3, b(3, "-other"), 3.0)  # ignored: a replay from 0 follows
    assert host.losses == [("replayed seq 2 differs from the applied one (restart)", 1)]
    t.replay_done(True, "complete", 3.0)
    assert host.replays == [2, 0] and stats.restarts == 1 and host.applied == [b(1), b(2)]


def test_empty_verifying_replay_means_the_publisher_restarted():
    t, host, stats = make()
    feed(t, 1, 2)
    t.connected()
    t.connected()  # reconnect: verify from 2
    t.replay_done(True, "complete", 3.0)
    assert host.losses == [("replay from 2 is empty (restart)", 1)] and host.replays == [2, 0]
    assert stats.restarts == 1


@pytest.mark.parametrize("verify, first, wanted", [(True, 5, 3), (False, 2, 0)])
def test_replay_starting_after_the_wanted_seq_is_a_loss(verify, first, wanted):
    t, host, _ = make()
    if verify:
        feed(t, 1, 2)
        feed(t, 9)  # replay from 2
    else:
        t.catch_up()  # replay from 0
    t.replayed(first, b(first), 2.0)
    assert host.losses == [(f"replay starts at {first}, wanted {wanted}: buffer exhausted", 1)]
    assert host.applied[-1] == b(first) and t.last_seq == first


def test_gap_inside_the_replay_is_a_loss():
    t, host, stats = make()
    t.catch_up()
    t.replayed(0, b(0), 1.0)
    t.replayed(2, b(2), 1.0)
    assert host.losses == [("gap 0 -> 2 inside the replay", 1)] and stats.gaps == 1
    assert host.applied == [b(0), b(2)]


def test_live_batches_beyond_the_buffer_bound_are_dropped_and_counted():
    t, host, stats = make(max_buffer=2)
    feed(t, 1)
    feed(t, 3, 4, 5, 6)
    assert [s for s, _ in t.buffer] == [3, 4] and stats.dropped == {"replay_buffer_overflow": 2}


def test_replay_failing_inside_open_replay_still_applies_the_gap_batch():
    t, host, _ = make()
    feed(t, 1)
    host.fail_now = "connect 'tcp://bad' failed"
    feed(t, 3)
    assert host.losses == [("replay failed: connect 'tcp://bad' failed", 1)]
    assert host.applied == [b(1), b(3)] and not t.replaying


def test_degradation_ends_only_with_the_newest_loss_epoch():
    t, host, _ = make(replay=False)
    feed(t, 0, 1)
    feed(t, 3, now=10.0)
    feed(t, 5, now=20.0)
    assert [e for _, e in host.losses] == [1, 2] and t.degraded_since == 20.0
    assert not t.end_degraded(1)  # superseded by the second loss
    assert t.end_degraded(2) and t.degraded_since is None
    assert not t.end_degraded(2)  # already live


def test_hand_over_keeps_the_sequence_when_the_replay_endpoint_goes_away():
    t, host, _ = make()
    feed(t, 1, 2)
    t.replay_enabled = False  # retarget: the new registration has no replay endpoint
    feed(t, 3)  # the same socket goes on: no loss
    feed(t, 5)
    assert host.losses == [("gap 3 -> 5 and no replay endpoint", 1)] and host.replays == []
    t.replay_enabled = True  # and back
    feed(t, 7)
    assert host.replays == [5]


def test_closed_tracker_starts_nothing_and_ignores_a_late_replay_end():
    t, host, _ = make()
    feed(t, 1)
    feed(t, 3)
    t.close()
    t.replay_done(False, "late", 1.0)
    assert host.losses == [] and not t.start_replay(0, verify=False) and t.buffer == []
    assert not t.end_degraded(t.loss_epoch)


# -- the start of the stream, after an empty replay -----------------------------------------------
# A fresh subscription's replay from 0 can come back empty while the SUB is still
# connecting; the publisher then sends 0, 1, 2 (dropped by the PUB: no subscriber yet)
# and the first batch that arrives is 3.


def test_first_batch_past_an_empty_replay_start_replays_the_missed_batches():
    t, host, stats = make()
    t.catch_up()  # registration: replay from 0, empty
    t.replay_done(True, "complete", 1.0)
    feed(t, 3, 4)
    assert host.replays == [0, 0] and t.replaying and host.applied == []
    assert t.buffer == [(3, b(3)), (4, b(4))] and stats.gaps == 1
    for s in (0, 1, 2, 3):
        t.replayed(s, b(s), 2.0)
    t.replay_done(True, "complete", 2.0)
    assert host.applied == [b(0), b(1), b(2), b(3), b(4)]
    assert host.losses == [] and t.last_seq == 4 and stats.duplicates == 1


def test_first_batch_at_the_empty_replay_start_is_applied_at_once():
    t, host, _ = make()
    t.catch_up()
    t.replay_done(True, "complete", 1.0)
    feed(t, 0, 1)
    assert host.replays == [0] and host.applied == [b(0), b(1)] and host.losses == []


def test_missed_start_that_cannot_be_replayed_is_one_loss_then_the_stream_goes_on():
    t, host, _ = make()
    t.catch_up()
    t.replay_done(True, "complete", 1.0)
    feed(t, 3)
    t.replay_done(True, "complete", 2.0)  # still empty: no history kept
    assert host.losses == [
        ("seq 3 arrived first, and the replay from 0 is empty: the batches before it are lost", 1)
    ]
    assert host.applied == [b(3)] and host.replays == [0, 0] and not t.replaying
    feed(t, 4, 6)  # an ordinary gap afterwards: a verifying replay from 4
    assert host.replays == [0, 0, 4]


def test_missed_start_whose_replay_fails_is_a_loss_and_applies_the_batch():
    t, host, _ = make()
    t.catch_up()
    t.replay_done(True, "complete", 1.0)
    host.fail_now = "no reply"
    feed(t, 3)
    assert host.replays == [0, 0] and host.applied == [b(3)]
    assert [why for why, _ in host.losses] == ["replay failed: no reply"]


def test_without_an_empty_replay_the_first_batch_is_taken_whatever_its_seq():
    t, host, _ = make()  # with a replay endpoint, no replay asked yet
    feed(t, 41)
    assert host.applied == [b(41)] and host.replays == []
