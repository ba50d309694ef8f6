"""ReplicaState alone: which log entries of a source count on a replica (``--state-url``).

The entries over a real state store are proven by tests/test_replica.py and
tests/faults/test_valkey_restart.py.
"""

from __future__ import annotations

from kvconductor.ingest.replicated import DUPLICATE, HOLE, NEXT, ReplicaState


def test_older_owner_epochs_are_fenced_off_and_the_fence_only_rises():
    st = ReplicaState(fence=3)
    assert not st.current(2)
    assert st.fence == 3
    assert st.current(3) and st.fence == 3
    assert st.current(5) and st.fence == 5
    assert not st.current(4)
    assert st.fence == 5


def test_a_batch_against_the_cursor():
    st = ReplicaState()
    assert st.place(7) == NEXT  # no cursor: whatever comes first
    st.applied = (7, 0xABC)
    assert [st.place(s) for s in (5, 7, 8, 9, 100)] == [DUPLICATE, DUPLICATE, NEXT, HOLE, HOLE]


def test_a_loss_forgets_the_cursor_and_names_its_grace_period():
    st = ReplicaState()
    st.applied = (7, 1)
    st.lost("4.2")
    assert (st.applied, st.loss_token) == (None, "4.2")
    assert st.place(3) == NEXT


def test_only_the_owner_reports_readiness_and_only_its_changes():
    st = ReplicaState()
    assert not st.down_changed(True)  # passive: the owner reports
    st.owned = True
    assert st.down_changed(True) and st.reported_down is True
    assert not st.down_changed(True)
    assert st.down_changed(False) and st.reported_down is False
    assert not st.down_changed(False)
