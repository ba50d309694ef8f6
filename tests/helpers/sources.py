"""Hand-built subscriptions (no sockets, no ingest thread) for the ``/metrics`` tests and
benchmarks: a :class:`~kvconductor.ingest.subscriber.SubscriptionManager` whose table
holds ``n`` real :class:`~kvconductor.ingest.subscription.Subscription` objects with real
counters and trackers, in every state a scrape distinguishes."""

from __future__ import annotations

import random
import threading
import types

from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.host import LOCAL_SOURCES
from kvconductor.ingest.replicated import ReplicaState
from kvconductor.ingest.sourcecolumns import RetiredTotals
from kvconductor.ingest.stats import SourceStats
from kvconductor.ingest.subscriber import SubscriptionManager
from kvconductor.ingest.subscription import Subscription
from kvconductor.ingest.tracker import SequenceTracker
from kvconductor.keys import Medium

#: instance ids a label must escape (backslash, quote, newline) or carry as UTF-8.
ODD_IDS = ('a"b', "back\\slash", "new\nline", "ünï-\u4e2d", 'all\\"\n', "")
DROP_REASONS = ("parent_not_found", "replay_failed", "message_too_large", "unknown_event")


def _ctx(i: int, rnd: random.Random, odd: bool) -> SubscriberContext:
    iid = ODD_IDS[i % len(ODD_IDS)] + f"-{i}" if odd and i % 7 == 0 else f"inst-{i // 8}"
    pool = odd and i % 11 == 0
    media: tuple[Medium, ...] = (Medium.NPU,)
    if pool:
        media = (Medium.CPU, Medium.DISK) if i % 2 else (Medium.CPU,)
    elif odd and i % 13 == 0:
        media = (Medium.NPU, Medium.CPU)
    return SubscriberContext(
        instance_id=iid,
        dp_rank=i % 8,
        url=f"tcp://10.0.{i // 256}.{i % 256}:5557",
        model="m",
        tenant="t",
        block_size=16,
        default_media=media,
        is_pool=pool,
        engine_type=("vLLM", "SGLang", "other")[i % 3] if odd else "vLLM",
    )


def manager(
    n: int, *, odd: bool = True, seed: int = 1, replicated: bool = False, base: float = 1.7e9
):
    """A manager with ``n`` subscriptions. ``odd``: labels that need escaping, several
    media, pools, every engine kind, every state, counters of every kind; else ``n``
    plain live vLLM sources. ``replicated``: ``--state-url`` (a source not owned by this
    replica is ``remote``, never live). ``base``: about when the last batches came (wall
    clock; the ages are ``now - base`` and a few seconds more or less)."""
    rnd = random.Random(seed)
    mgr = SubscriptionManager.__new__(SubscriptionManager)
    mgr.thread = types.SimpleNamespace(is_alive=lambda: False)
    mgr._subs = {}
    mgr._by_dp = {}
    mgr.journal = types.SimpleNamespace(replicated=True) if replicated else LOCAL_SOURCES
    mgr.retired = RetiredTotals()
    mgr._table_lock = threading.Lock()
    mgr._metric_columns = []
    for i in range(n):
        s = Subscription.__new__(Subscription)
        s.manager = mgr
        s.replica = ReplicaState(0)
        s.replica.owned = rnd.random() < 0.7 or not replicated  # one process: all owned
        s.ctx = _ctx(i, rnd, odd)
        s.stats = st = SourceStats()
        s.tracker = SequenceTracker(s, st, replay=False)
        s.connected = True
        s.muted = False
        s.closed = False
        st.last_event = base + rnd.random() * 100
        if odd:
            s.connected = rnd.random() < 0.8
            s.tracker.replaying = rnd.random() < 0.1
            if rnd.random() < 0.1:
                s.tracker.degraded_since = 1.0
            s.muted = rnd.random() < 0.1
            st.events = rnd.randrange(10**9)
            st.gaps = rnd.randrange(5)
            st.replays_ok = rnd.randrange(3)
            st.mutes = rnd.randrange(3)
            st.purged_blocks = rnd.randrange(1000)
            for reason in DROP_REASONS:
                if rnd.random() < 0.2:
                    st.dropped[reason] = rnd.randrange(1, 100)
            r = rnd.random()
            if r < 0.05:
                st.last_event = base - 3e6  # idle > 1e6 s: Go's exponent form
            elif r < 0.1:
                st.last_event = base + 1_000  # in the future: age 0
            elif r < 0.15:
                st.last_event = base + 100.0 - 1e-5  # a tiny age
        else:
            st.events = 1000 + i
        mgr._subs[(s.ctx.instance_id, s.ctx.dp_rank, s.ctx.url)] = s
    if odd:
        r = mgr.retired
        r.events = {"vllm": 5, "pool": 7, "gone": 1}
        r.dropped = {"parent_not_found": 3, "old_reason": 2}
        r.gaps, r.replays_ok, r.replays_failed, r.mutes, r.purged_blocks = 1, 2, 3, 4, 5
    return mgr
