"""Which replica consumes which ZeroMQ source (``--state-url``; the module docstring of
:mod:`kvconductor.state.replica`, "Sources"): the keeper's round of heartbeat, lease
renewals and take-overs, and the hand-over of sources over a replica's share.

:class:`ReplicaLeases` is a part of :class:`kvconductor.state.replica.ValkeyJournal`
(its base class): these methods run on the journal's keeper thread (the subscription
changes on the ingest thread, through ``conductor.call``), on the journal's own
attributes, declared below.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, cast

from kvconductor.state.store import EPOCH, GEN, LEASE, LOG, MEMBERS, ReplicaStats, lease_key, text

if TYPE_CHECKING:
    from valkey import Valkey
    from valkey.commands.core import Script

    from kvconductor.state.conductor import Conductor

log = logging.getLogger("kvconductor.replica")

__all__ = ["SHED_ROUNDS", "ReplicaLeases"]

#: Keeper rounds over its share before a replica hands a source over.
SHED_ROUNDS = 3


class ReplicaLeases:
    """Leases of the sources a :class:`~kvconductor.state.replica.ValkeyJournal` consumes."""

    # The journal's attributes these methods use (set by ValkeyJournal.__init__).
    conductor: Conductor
    client: Valkey
    id: str
    lease_ms: int
    gen: str | None
    errors: tuple[type[BaseException], ...]
    stats: ReplicaStats
    _needs_bootstrap: bool
    #: Sources this replica holds the lease of: key -> lease value (keeper thread).
    _leases: dict[tuple[str, int, str], str]
    #: Rounds each source was seen without an owner (keeper thread).
    _free_rounds: dict[tuple[str, int, str], int]
    #: Keeper rounds in a row this replica held more sources than its share.
    _over_share: int
    _take_lease: Script
    _renew: Script
    _release: Script

    if TYPE_CHECKING:  # the journal's methods these call

        def _set_up(self, up: bool, ex: BaseException | None = None) -> None: ...

        def _give_up(self, key: tuple[str, int, str]) -> None: ...

    def _drop_all_leases(self) -> None:
        """The store is unreachable: the leases cannot be renewed, so they will lapse;
        stop consuming now rather than append into the void."""
        for key in list(self._leases):
            self.conductor.thread.submit(self._give_up, key)

    def _keep(self) -> None:
        r = self.client
        now_ms = int(time.time() * 1000)
        pipe = r.pipeline(transaction=False)
        pipe.zadd(MEMBERS, {self.id: now_ms})
        pipe.zremrangebyscore(MEMBERS, 0, now_ms - 10 * self.lease_ms)
        pipe.zcount(MEMBERS, now_ms - 2 * self.lease_ms, "+inf")
        pipe.exists(LOG)
        pipe.get(GEN)
        _, _, live, has_log, gen = pipe.execute()
        self._set_up(True)
        self.stats.replicas = int(live)
        if gen is None or text(gen) != self.gen or self._needs_bootstrap:
            return  # not loaded in this generation: the reader seeds or loads it first
        if has_log:
            info: dict[str, bytes | int]
            try:
                info = cast("dict[str, bytes | int]", r.xinfo_stream(LOG))
            except self.errors:
                raise
            except Exception:  # the stream vanished in between (a re-seed)
                info = {}
            self.stats.log_last_id = text(info.get("last-generated-id", b"0-0"))
            self.stats.log_length = int(info.get("length", 0))
        states = self.conductor.call(self.conductor.subs.source_states)
        # renew what we hold; forget what is gone or lost
        for key, token in list(self._leases.items()):
            if key not in states:
                self._release(keys=[lease_key(key)], args=[token])
                self._leases.pop(key, None)
                continue
            if not self._renew(keys=[lease_key(key), GEN], args=[token, self.lease_ms, self.gen]):
                log.warning("lost the lease of %s", lease_key(key)[len(LEASE) :])
                self._leases.pop(key, None)
                self.conductor.call(self._release_local, key)
            elif not states[key]:
                # held, but the subscription was made anew (a snapshot was loaded)
                epoch = int(token.rpartition(":")[2])
                if not self.conductor.call(self._activate, key, epoch):
                    self._release(keys=[lease_key(key)], args=[token])
                    self._leases.pop(key, None)
        keys = set(states)
        share = math.ceil(len(keys) / max(1, int(live)))
        self._shed_surplus(share)
        free = [k for k in keys if k not in self._leases]
        if not free:
            self._free_rounds.clear()
            return
        pipe = r.pipeline(transaction=False)
        for k in free:
            pipe.exists(lease_key(k))
        owned_elsewhere = pipe.execute()
        for k, taken in zip(free, owned_elsewhere, strict=True):
            if taken:
                self._free_rounds.pop(k, None)
                continue
            rounds = self._free_rounds.get(k, 0) + 1
            self._free_rounds[k] = rounds
            if len(self._leases) >= share and rounds < 2:
                continue  # leave it to a replica with fewer sources
            epoch = int(
                self._take_lease(
                    keys=[GEN, lease_key(k), EPOCH], args=[self.gen, self.id, self.lease_ms]
                )
            )
            if not epoch:
                continue
            token = f"{self.id}:{epoch}"
            self._free_rounds.pop(k, None)
            self._leases[k] = token
            if not self.conductor.call(self._activate, k, epoch):
                self._release(keys=[lease_key(k)], args=[token])
                self._leases.pop(k, None)
            else:
                self.stats.takeovers += 1

    def _shed_surplus(self, share: int) -> None:
        """Holding more sources than ``share`` (sources / live replicas) for
        :data:`SHED_ROUNDS` rounds in a row: give one back, so that sources spread over
        the replicas (the first replica to see a restarted store, or the only one running
        for a while, takes them all). The next owner resumes it from the replicated
        cursor with a replay: nothing is lost in the hand-over."""
        if len(self._leases) <= share:
            self._over_share = 0
            return
        self._over_share += 1
        if self._over_share < SHED_ROUNDS:
            return
        self._over_share = 0
        key, token = next(reversed(self._leases.items()))
        self._leases.pop(key, None)
        self.conductor.call(self._release_local, key)
        self._release(keys=[lease_key(key)], args=[token])
        self.stats.handed_over += 1
        log.info(
            "%s: handed over (this replica held %d sources, its share is %d)",
            lease_key(key)[len(LEASE) :],
            len(self._leases) + 1,
            share,
        )

    def _activate(self, key: tuple[str, int, str], epoch: int) -> bool:
        import zmq

        sub = self.conductor.subs.get(*key)
        if sub is None or sub.closed:
            return False
        try:
            sub.activate(epoch)
        except (zmq.ZMQError, OSError) as ex:
            log.error("%s: cannot open the subscription: %s", sub.name(), ex)
            return False
        return True

    def _release_local(self, key: tuple[str, int, str]) -> None:
        sub = self.conductor.subs.get(*key)
        if sub is not None:
            sub.release()
