"""Message loss, publisher restarts and conductor kills through the real server.

A lost batch costs at most what it carried: state is kept, the source is
``degraded`` in /workers, and after ``--loss-grace-secs`` only the blocks that
nothing announced again are dropped (docs/operations.md, "Faults").
"""

from __future__ import annotations

import pytest

from tests.helpers.faults import BS, V33, Rig
from tests.helpers.publishers import FakePublisher, wait_until


def toks(i: int, n: int = 2) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + n * BS))


def chain(i: int, n: int = 2, parent=None, start: int = 0) -> bytes:
    """Blocks [start, start+n) of prompt i, engine hashes 100*(i+1)+k."""
    t = toks(i, start + n)[start * BS :]
    return V33.batch(
        [V33.stored([100 * (i + 1) + start + k for k in range(n)], parent, t, BS, medium="GPU")]
    )


@pytest.fixture
def rig(tmp_path, request):
    args, replay = getattr(request, "param", ((), False))
    r = Rig(tmp_path, *args, replay=replay)
    yield r
    r.close()


@pytest.mark.parametrize("rig", [(("--loss-grace-secs", "2"), False)], indirect=True)
def test_loss_without_replay_keeps_state(rig):
    rig.join()
    rig.pub.publish(chain(0))
    rig.pub.publish(chain(3))
    rig.pub.publish(chain(1), drop=True)  # lost on the wire
    rig.pub.publish(chain(2))
    wait_until(lambda: rig.npu(toks(2)) == 2, msg="after the gap")
    src = rig.source()
    assert (src["gaps"], src["losses"], src["state"]) == (1, 1, "degraded")
    assert src["degraded_since"] is not None
    assert rig.npu(toks(0)) == 2 and rig.npu(toks(3)) == 2 and rig.npu(toks(1)) == 0
    # The engine keeps extending what it cached before the gap: applied.
    rig.pub.publish(chain(0, 2, parent=101, start=2))
    wait_until(lambda: rig.npu(toks(0, 4)) == 4, msg="extension applied")
    assert "parent_not_found" not in rig.source()["dropped"]
    wait_until(lambda: rig.source()["state"] == "live", msg="grace over")
    assert rig.npu(toks(0, 4)) == 4 and rig.npu(toks(2)) == 2 and rig.npu(toks(3)) == 0
    assert rig.source()["aged_out_blocks"] == 2
    assert "source degraded: 4 blocks kept" in rig.srv.log()


@pytest.mark.parametrize("rig", [((), True)], indirect=True)
def test_loss_with_replay_recovers_everything(rig):
    rig.join()
    rig.pub.publish(chain(0))
    rig.pub.publish(chain(1), drop=True)
    rig.pub.publish(chain(2))
    wait_until(lambda: rig.npu(toks(1)) == 2 and rig.npu(toks(2)) == 2, msg="replayed")
    src = rig.source()
    assert src["gaps"] == 1 and src["replays"] >= 1 and src["losses"] == 0
    assert src["state"] == "live" and rig.npu(toks(0)) == 2


@pytest.mark.parametrize("rig", [(("--loss-grace-secs", "3"), False)], indirect=True)
def test_publisher_restart_without_replay(rig):
    rig.join()
    for i in range(3):
        rig.pub.publish(chain(i))
    for _ in range(40):
        # The first incarnation's seq runs well past what the new one sends while the SUB
        # reconnects, so the restart shows as the seq going back (without a replay
        # endpoint a new incarnation that happens to continue at last + 1 is invisible).
        rig.pub.publish(V33.batch([]))
    wait_until(
        lambda: rig.npu(toks(2)) == 2 and rig.source()["last_seq"] >= 40, msg="first incarnation"
    )
    port = rig.pub.port
    rig.pub.stop()
    rig.pub = FakePublisher(port, replay=False)  # restarted engine: seq 0 again
    rig.join()
    rig.pub.publish(chain(5))
    wait_until(lambda: rig.npu(toks(5)) == 2, msg="second incarnation")
    # Seen as a restart (seq went back) or as a gap (the new incarnation's first batches
    # were sent before the SUB reconnected): a loss either way.
    assert rig.source()["losses"] >= 1
    # Kept meanwhile (the reference cleared them), aged out after the grace period.
    assert rig.npu(toks(0)) == 2
    wait_until(
        lambda: rig.source()["state"] == "live" and rig.npu(toks(0)) == 0,
        msg="old incarnation aged out",
    )
    assert rig.npu(toks(5)) == 2


@pytest.mark.parametrize("rig", [((), True)], indirect=True)
def test_conductor_killed_and_restarted(rig):
    rig.join()
    for i in range(3):
        rig.pub.publish(chain(i))
    wait_until(lambda: rig.npu(toks(2)) == 2, msg="indexed")
    rig.srv.kill()
    rig.pub.publish(chain(4))  # while the conductor is down
    rig.srv = rig.start()  # registration brings replay
    wait_until(lambda: all(rig.npu(toks(i)) == 2 for i in (0, 1, 2, 4)), msg="replayed")
    assert rig.source()["state"] == "live"
