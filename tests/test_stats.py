"""kvconductor.ingest.stats: the counters of a source, declared once (``SourceStats``),
and ``Stamped``, the attributes whose writes tell a ``/metrics`` scrape to read again."""

from __future__ import annotations

import dataclasses

import pytest

from kvconductor.ingest.sourcemetrics import Totals
from kvconductor.ingest.stats import (
    COUNTS_STAMP,
    READ_GAPS,
    READ_MUTES,
    READ_PURGED,
    READ_REPLAYS_OK,
    STATE_STAMP,
    SourceStats,
    Stamped,
)
from kvconductor.ingest.subscription import Subscription

RARE = {"gaps": READ_GAPS, "replays_ok": READ_REPLAYS_OK, "mutes": READ_MUTES}
RARE["purged_blocks"] = READ_PURGED


@pytest.mark.parametrize("name", sorted(RARE))
def test_a_rare_counter_moves_the_counts_stamp_and_is_read_without_a_call(name):
    s = SourceStats()
    before = COUNTS_STAMP[0]
    setattr(s, name, getattr(s, name) + 3)
    assert COUNTS_STAMP[0] != before
    assert getattr(s, name) == RARE[name](s) == 3
    assert isinstance(vars(SourceStats)[name], Stamped)
    assert vars(SourceStats)[name].__doc__  # its help, not Stamped's


def test_the_plain_counters_move_no_stamp():
    s = SourceStats()
    before = COUNTS_STAMP[0]
    s.batches += 1
    s.events += 2
    s.blocks += 3
    assert COUNTS_STAMP[0] == before
    s.drop("unknown_event", 2)
    assert COUNTS_STAMP[0] != before and s.dropped == {"unknown_event": 2}


def test_source_stats_is_slotted_and_its_stamped_values_are_no_arguments():
    s = SourceStats()
    with pytest.raises(AttributeError):
        s.not_a_counter = 1
    assert "_gaps" not in {f.name for f in dataclasses.fields(SourceStats) if f.init}


def test_a_state_attribute_moves_the_state_stamp_only_when_it_changes():
    sub = Subscription.__new__(Subscription)
    before = STATE_STAMP[0]
    sub.connected = False  # the first write always counts
    first = STATE_STAMP[0]
    assert first != before
    sub.connected = False
    assert STATE_STAMP[0] == first
    sub.connected = True
    assert STATE_STAMP[0] != first and sub.connected is True


def test_totals_add():
    t = Totals({"a": 1}, 1, 2, 3, 4, 5)
    t.add(Totals({"a": 2, "b": 1}, 10, 20, 30, 40, 50))
    got = (t.dropped, t.gaps, t.replays_ok, t.replays_failed, t.mutes, t.purged_blocks)
    assert got == ({"a": 3, "b": 1}, 11, 22, 33, 44, 55)
