"""Dead engines: when a source's (instance, DP) stops counting, comes back, is purged.

:class:`Liveness` is a policy without sockets and without a clock, like
:class:`~kvconductor.ingest.tracker.SequenceTracker`: every call carries ``now`` (the
monotonic time), and what it decides is carried out by its host
(:class:`LivenessHost`, the :class:`~kvconductor.ingest.subscriber.SubscriptionManager`):
mute or unmute the HBM workers of an (instance, DP), drop their blocks.

The rules (docs/operations.md, "Dead engines"):

* a source that is not ready (``connecting`` or ``replaying``) is *down* since the first
  check that saw it so (or since its disconnect, set by the subscription); a ready one
  is up again at the next check;
* an (instance, DP) whose HBM sources (engine streams of HBM blocks) are **all** down
  for ``source_down`` seconds (counted from the most recent of their down times) has its
  HBM workers *muted*: their blocks are kept and still take updates, but give no hits.
  The mute is applied again at every check (a worker the DP gained meanwhile is muted
  too); each source of the DP counts one ``mutes`` when the DP becomes muted;
* down for ``source_purge`` seconds (0: never), those HBM blocks are dropped, once per
  outage, counted in the first source's ``purged_blocks``;
* one HBM source ready again unmutes the DP; a muted DP whose sources are all gone
  (unregistered) is unmuted;
* a *passive* source (``--state-url``, consumed by another replica) is down as its
  owner reports it: ``down_since`` is set from the owner's entries, never here;
* a source that is no HBM stream (a pool, or re-registered as one) is never muted.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Protocol

from kvconductor.ingest.stats import SourceStats

log = logging.getLogger("kvconductor.ingest")

#: Source states in which a subscription is ready (``GET /ready``) and counts in answers.
READY_STATES = frozenset(("live", "degraded", "remote"))
#: Period of the checks (:meth:`Liveness.check`) on the ingest thread.
SOURCE_CHECK_SECS = 1.0
#: Defaults of ``--source-down-secs`` and ``--source-purge-secs``.
SOURCE_DOWN = 10.0
SOURCE_PURGE = 600.0

#: (model, tenant, instance_id, dp_rank): the HBM workers a decision is about.
DpKey = tuple[str, str, str, int]


class LivenessSource(Protocol):
    """What the policy reads and sets of one subscription."""

    #: Monotonic time since when the source is not ready (None: ready).
    down_since: float | None
    #: Its (instance, DP)'s HBM hits are muted now.
    muted: bool
    stats: SourceStats

    @property
    def feeds_hbm(self) -> bool:
        """An engine stream of HBM blocks (what a down source mutes and purges)."""

    @property
    def dp_key(self) -> DpKey: ...

    @property
    def passive(self) -> bool:
        """Another replica consumes it: its ``down_since`` is the owner's."""

    @property
    def state(self) -> str:
        """``live``, ``degraded``, ``remote`` (ready) or ``connecting``, ``replaying``."""

    def name(self) -> str:
        """The source, for log lines."""


class LivenessHost(Protocol):
    """What a :class:`Liveness` asks of the subscriptions' owner."""

    def set_dp_muted(self, dp: DpKey, muted: bool) -> None:
        """Mute (or unmute) every HBM worker of ``dp`` in its index."""

    def purge_dp(self, dp: DpKey) -> int:
        """Drop every block of ``dp``'s HBM workers; how many."""


class Liveness:
    """Down, muted and purged (instance, DP)s (see the module docstring)."""

    def __init__(
        self,
        host: LivenessHost,
        *,
        source_down: float = SOURCE_DOWN,
        source_purge: float = SOURCE_PURGE,
    ) -> None:
        self.host = host
        #: Seconds not ready before a source's (instance, DP) HBM hits are muted.
        self.source_down = float(source_down)
        #: Seconds not ready before those HBM blocks are dropped (0: never).
        self.source_purge = float(source_purge)
        #: The DPs muted now, and those purged since they were muted.
        self.muted_dps: set[DpKey] = set()
        self.purged_dps: set[DpKey] = set()

    def check(self, sources: Collection[LivenessSource], now: float) -> None:
        """One check of every source at ``now``. Idempotent."""
        # PERF: one cheap pass over every subscription; the DPs are grouped only when one
        # of their HBM sources is down or they are muted (about 0.3 ms for 4,096 live
        # sources, docs/performance.md).
        down_dps: set[DpKey] = set()
        for src in sources:
            if src.passive:
                # --state-url: down_since comes from the owner's ``down`` entries
                if src.down_since is not None and src.feeds_hbm:
                    down_dps.add(src.dp_key)
            elif src.state in READY_STATES:
                if src.down_since is not None:
                    src.down_since = None
            else:
                if src.down_since is None:
                    src.down_since = now
                if src.feeds_hbm:
                    down_dps.add(src.dp_key)
            if src.muted and not src.feeds_hbm:  # re-registered as a pool stream
                src.muted = False
        if not down_dps and not self.muted_dps:
            return
        groups: dict[DpKey, list[LivenessSource]] = {k: [] for k in down_dps | self.muted_dps}
        for src in sources:
            if src.feeds_hbm:
                subs = groups.get(src.dp_key)
                if subs is not None:
                    subs.append(src)
        muted: set[DpKey] = set()
        for k, subs in groups.items():
            if not subs:  # a muted DP whose subscriptions are gone (unregistered)
                self.host.set_dp_muted(k, False)
                self.purged_dps.discard(k)
                continue
            starts = [s.down_since for s in subs]
            if any(t is None for t in starts):
                self._back(k, subs)
                continue
            down = now - max(t for t in starts if t is not None)
            if down < self.source_down:
                self._back(k, subs)
                continue
            muted.add(k)
            self.host.set_dp_muted(k, True)  # every tick: also a worker the DP gained
            if k not in self.muted_dps:
                for s in subs:
                    s.muted = True
                    s.stats.mutes += 1
                log.warning(
                    "%s: not ready (%s) for %.0fs; its HBM hits no longer count (blocks kept%s)",
                    ", ".join(s.name() for s in subs),
                    "/".join(sorted({s.state for s in subs})),
                    down,
                    f"; dropped after {self.source_purge:g}s down" if self.source_purge else "",
                )
            if self.source_purge > 0 and down >= self.source_purge and k not in self.purged_dps:
                self.purged_dps.add(k)
                n = self.host.purge_dp(k)
                subs[0].stats.purged_blocks += n
                log.warning(
                    "%s: down for %.0fs; %d HBM blocks dropped",
                    ", ".join(s.name() for s in subs),
                    down,
                    n,
                )
        self.muted_dps = muted

    def _back(self, k: DpKey, subs: list[LivenessSource]) -> None:
        self.purged_dps.discard(k)
        if k not in self.muted_dps:
            return
        self.host.set_dp_muted(k, False)
        for s in subs:
            s.muted = False
        log.info(
            "%s: ready again (%s); its HBM hits count again",
            ", ".join(s.name() for s in subs),
            "/".join(sorted({s.state for s in subs})),
        )
