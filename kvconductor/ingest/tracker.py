"""Sequence tracking of one ZeroMQ subscription: order, gaps, replay, restarts, loss.

:class:`SequenceTracker` decides what happens to each batch of one publisher's
stream; it owns no socket and no clock (every input that may start a loss
carries ``now``, the wall-clock time). What it decides is carried out by its
host (:class:`TrackerHost`, the :class:`~kvconductor.ingest.subscription.Subscription`):
apply a payload to the index, open a replay session, start the grace period of a
loss. A host may finish a replay inside :meth:`TrackerHost.open_replay` (the
session failed at once); the tracker expects that.

The rules (docs/events.md, "Sequence numbers, replay and loss"), ``last`` being
the seq of the last applied batch:

* Connect: a PUB drops what it sends before a subscriber's subscription reaches it,
  so each time the SUB connects (its ZMTP handshake, first connect included) a
  subscription with a replay endpoint asks for what it may have missed: from 0, or
  from ``last`` to verify it. A replay asked before the connect may have been answered
  before anything was published; it does not count: one is asked again after it.
* ``seq == last + 1`` (or nothing applied yet): apply. Except when nothing is
  applied yet and:

  - a replay from ``s`` came back empty (the stream starts at ``s``): a first batch
    past ``s`` means the batches between were sent before our subscription reached
    the PUB; buffer it and replay from ``s`` once more; if that is empty too, or
    fails, they are a loss;
  - there is no replay endpoint and the very first batch of the subscription has
    ``seq > 0``: batches ``0 .. seq-1`` were published before it connected: a loss
    (named, with the range), then apply.
* ``seq > last + 1`` (gap): with replay, buffer the batch and replay from
  ``last`` (one batch of overlap: if the replayed batch ``last`` is
  byte-identical to the one applied, the stream is continuous); without, a loss
  and the stream goes on from ``seq``.
* ``seq <= last``: a batch already applied by replay (identical digest) is a
  duplicate and skipped; anything else means the publisher restarted: a loss,
  and (with replay) the new incarnation is replayed from 0.
* While a replay runs, live batches are buffered (at most ``max_buffer``;
  beyond that they are dropped and counted, the gap they leave is a loss after
  the replay) and merged by seq when it ends; nothing is applied twice.
* Replay result: first replayed seq > wanted (the ring buffer lost it), an
  overlap batch that differs (restart: replay again from 0), an empty replay
  when verifying (restart), or a failed replay -> a loss.

A loss resets the sequence (the next batch is applied whatever its seq), marks
the source degraded since ``now`` and hands an *epoch* to the host; the
degradation ends with :meth:`SequenceTracker.end_degraded` of the newest epoch.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, InitVar, dataclass, field
from operator import attrgetter
from typing import Protocol

from kvconductor._hash import xxh3_64
from kvconductor.ingest.stats import SourceStats, state_changed

log = logging.getLogger("kvconductor.ingest")

#: Live batches kept while a replay runs; beyond that they are dropped and the
#: gap they leave is handled as loss after the replay.
MAX_REPLAY_BUFFER = 200_000


def digest(payload: bytes) -> int:
    """What tells two batches of the same seq apart (XXH3-64 of the payload)."""
    return xxh3_64(payload, 0)


class TrackerHost(Protocol):
    """What a :class:`SequenceTracker` asks of its subscription."""

    def name(self) -> str:
        """The source, for log lines."""

    def apply(self, payload: bytes, seq: int) -> None:
        """Apply batch ``seq`` to the index."""

    def open_replay(self, start: int) -> None:
        """Ask the replay endpoint for ``seq >= start``; report through
        :meth:`SequenceTracker.replayed` and :meth:`SequenceTracker.replay_done`."""

    def lost(self, why: str, epoch: int) -> None:
        """Batches were lost for good: start the grace period that ends with
        ``end_degraded(epoch)``."""

    def no_replay_why(self) -> str:
        """Why the source cannot ask for missed batches (it has no replay endpoint), in
        words for a loss line: which registration would need one."""


@dataclass(slots=True, eq=False)
class SequenceTracker:
    """The sequence and replay state of one subscription (see the module docstring)."""

    host: TrackerHost
    stats: SourceStats
    _: KW_ONLY
    #: The subscription has a replay endpoint (``replay_enabled``).
    replay: InitVar[bool]
    max_buffer: int = MAX_REPLAY_BUFFER
    replay_enabled: bool = field(init=False)
    closed: bool = field(default=False, init=False)
    ever_connected: bool = field(default=False, init=False)
    #: A batch was applied or a loss declared: the stream has a beginning.
    started: bool = field(default=False, init=False)
    last_seq: int | None = field(default=None, init=False)
    last_digest: int | None = field(default=None, init=False)
    _replaying: bool = field(default=False, init=False)
    buffer: list[tuple[int, bytes]] = field(default_factory=list, init=False)
    #: Digests of the batches applied by replay, while the live stream may repeat them.
    dedup: dict[int, int] = field(default_factory=dict, init=False)
    dedup_high: int = field(default=-1, init=False)
    _degraded_since: float | None = field(default=None, init=False)
    loss_epoch: int = field(default=0, init=False)
    #: The last loss: (wall-clock time, why), for ``/workers`` and ``/explain``.
    last_loss: tuple[float, str] | None = field(default=None, init=False)
    # The running replay: where it started, whether its first batch must be the
    # overlap batch ``last_seq``, whether it has delivered a batch, whether a
    # restart was seen (its batches are ignored, a replay from 0 follows).
    _replay_start: int = field(default=0, init=False)
    _verify: bool = field(default=False, init=False)
    _first: bool = field(default=True, init=False)
    _restart: bool = field(default=False, init=False)
    #: While merging after a failed replay: a gap is a loss, no second replay.
    _no_replay: bool = field(default=False, init=False)
    #: The SUB (re)connected while a replay ran: that replay may have been answered
    #: before our subscription reached the PUB; catch up once more when it ends.
    _again: bool = field(default=False, init=False)
    #: Nothing applied yet, and a replay from this seq came back empty: the stream
    #: starts there, so a first live batch past it means batches were missed (the
    #: PUB drops what it sends before our SUB is connected): replay them.
    _expect: int | None = field(default=None, init=False)
    #: The running replay is the one asked for such a missed start.
    _expect_replay: bool = field(default=False, init=False)

    def __post_init__(self, replay: bool) -> None:
        self.replay_enabled = replay

    # -- inputs from the subscription ---------------------------------------------------
    def live(self, seq: int, payload: bytes, now: float) -> None:
        """A batch of the live stream."""
        if self._replaying:  # PERF: per batch, no property call
            if len(self.buffer) >= self.max_buffer:
                self.stats.drop("replay_buffer_overflow")
                return
            self.buffer.append((seq, payload))
            return
        self._process(seq, payload, now)

    def connected(self) -> None:
        """The SUB socket's handshake with a publisher succeeded (first connect or
        reconnect): with a replay endpoint, ask for what was published before our
        subscription reached it (module docstring, "Connect")."""
        self.ever_connected = True
        if self.closed or not self.replay_enabled:
            return
        if self.replaying:
            self._again = True
            return
        self.catch_up()

    def catch_up(self) -> bool:
        """Replay what we may have missed: verify from the last applied seq, or all from 0."""
        if self.last_seq is not None:
            return self.start_replay(self.last_seq, verify=True)
        return self.start_replay(0, verify=False)

    def start_replay(self, start: int, verify: bool) -> bool:
        """Ask for ``seq >= start`` (no-op if closed, without replay, or one is running)."""
        if self.closed or not self.replay_enabled or self.replaying:
            return False
        self.stats.replays += 1
        self._verify = verify and self.last_seq is not None and start == self.last_seq
        self._first = True
        self._restart = False
        self._replay_start = start
        self.replaying = True
        self.host.open_replay(start)
        return True

    def replayed(self, seq: int, payload: bytes, now: float) -> None:
        """A batch of the running replay, in the replay's order."""
        self.stats.replayed_batches += 1
        if self._restart:
            return  # a second replay from 0 follows
        start = self._replay_start
        if self._first:
            self._first = False
            if self._verify:
                if seq == start:
                    if digest(payload) == self.last_digest:
                        return  # overlap batch identical: continuous
                    self.stats.restarts += 1
                    self._loss(f"replayed seq {seq} differs from the applied one (restart)", now)
                    self._restart = True
                    return
                if seq > start:
                    self._loss(f"replay starts at {seq}, wanted {start + 1}: buffer exhausted", now)
            elif seq > start:
                self._loss(f"replay starts at {seq}, wanted {start}: buffer exhausted", now)
        last = self.last_seq
        if last is None or seq == last + 1:
            self._apply_replayed(seq, payload)
        elif seq <= last:
            self.stats.duplicates += 1
        else:
            self.stats.gaps += 1
            self._loss(f"gap {last} -> {seq} inside the replay", now)
            self._apply_replayed(seq, payload)

    def replay_done(self, ok: bool, why: str, now: float) -> None:
        """The replay ended: ``ok`` when its end marker arrived; else ``why`` it failed."""
        self.replaying = False
        if self.closed:
            return
        again, self._again = self._again, False
        try:
            self._replay_ended(ok, why, now)
        finally:
            if again and not self.closed and not self.replaying:
                self.catch_up()

    def _replay_ended(self, ok: bool, why: str, now: float) -> None:
        if ok:
            self.stats.replays_ok += 1
            if self._restart:
                self.start_replay(0, verify=False)
                return
            if self._first and self._verify:
                # Nothing at or after our last seq is buffered: the publisher's
                # newest seq is below ours, so it restarted.
                self.stats.restarts += 1
                self._loss(f"replay from {self._replay_start} is empty (restart)", now)
                self.start_replay(0, verify=False)
                return
            expect_replay, self._expect_replay = self._expect_replay, False
            if self._first and self.last_seq is None:
                if expect_replay:
                    # Asked again for the start of the stream and still nothing: the
                    # publisher keeps no history of what we missed.
                    first = min(seq for seq, _ in self.buffer) if self.buffer else None
                    self._loss(
                        f"seq {first} arrived first, and the replay from "
                        f"{self._replay_start} is empty: the batches before it are lost",
                        now,
                    )
                else:
                    self._expect = self._replay_start
            self._merge(now)
            return
        # Failed (no reply, malformed reply, past the deadline): whatever the replay did
        # not deliver is lost; merge what we have (no second replay, or a dead or
        # trickling ROUTER would stall us forever).
        self.stats.drop("replay_failed")
        self._expect_replay = False
        self._loss(f"replay failed: {why}", now)
        self._no_replay = True
        try:
            self._merge(now)
        finally:
            self._no_replay = False

    @property
    def replaying(self) -> bool:
        """A replay session is open; live batches go to :attr:`buffer`."""
        return self._replaying

    @replaying.setter
    def replaying(self, on: bool) -> None:
        if on != self._replaying:
            self._replaying = on
            state_changed()  # a /metrics scrape reads the source's state again

    @property
    def degraded_since(self) -> float | None:
        """Wall-clock time of the last loss while degraded (None: not degraded)."""
        return self._degraded_since

    @degraded_since.setter
    def degraded_since(self, t: float | None) -> None:
        if t != self._degraded_since:
            self._degraded_since = t
            state_changed()

    def end_degraded(self, epoch: int) -> bool:
        """The grace period of loss ``epoch`` is over: True if the source is live again
        (False: closed, not degraded, or superseded by a later loss)."""
        if self.closed or epoch != self.loss_epoch or self.degraded_since is None:
            return False
        self.degraded_since = None
        return True

    def close(self) -> None:
        self.closed = True
        self.replaying = False
        self.buffer = []

    def state(self, connected: bool) -> str:
        """``replaying``, ``connecting``, ``degraded`` or ``live``."""
        # PERF: every source at every liveness check: no property calls
        if self._replaying:
            return "replaying"
        if not connected:
            return "connecting"
        return "degraded" if self._degraded_since is not None else "live"

    # -- decisions ------------------------------------------------------------------------
    def _apply(self, seq: int, payload: bytes, live: bool = True) -> int:
        self._expect = None
        self.started = True
        self.host.apply(payload, seq)
        d = digest(payload)
        self.last_seq = self.stats.last_seq = seq
        self.last_digest = d
        if live and self.dedup and seq > self.dedup_high:
            self.dedup.clear()  # the live stream has passed the replayed range
        return d

    def _apply_replayed(self, seq: int, payload: bytes) -> None:
        self.dedup[seq] = self._apply(seq, payload, live=False)
        self.dedup_high = seq

    def _process(self, seq: int, payload: bytes, now: float) -> None:
        last, expect = self.last_seq, self._expect
        if last is None and expect is not None and seq > expect:
            self._missed_start(seq, payload, expect, now)
            return
        if last is None and not self.started and seq > 0 and not self.replay_enabled:
            self.stats.gaps += 1
            self._loss(
                f"batches 0..{seq - 1} were published before this subscription "
                f"connected and are lost (first batch seen: {seq}; "
                + self.host.no_replay_why()
                + ")",
                now,
            )
            self._apply(seq, payload)
            return
        if last is None or seq == last + 1:
            self._apply(seq, payload)
            return
        if seq <= last:
            d = self.dedup.get(seq)
            if d is not None and d == digest(payload):
                self.stats.duplicates += 1
                return
            self._restarted(seq, payload, f"seq went back from {last} to {seq}", now)
            return
        self.stats.gaps += 1
        if self.replay_enabled and not self._no_replay:
            log.info("%s: gap %d -> %d, replaying", self.host.name(), last, seq)
            self.buffer.append((seq, payload))
            self.start_replay(last, verify=True)
            return
        self._loss(
            f"gap {last} -> {seq} and "
            + ("the replay failed" if self.replay_enabled else "no replay endpoint"),
            now,
        )
        self._apply(seq, payload)

    def _missed_start(self, seq: int, payload: bytes, start: int, now: float) -> None:
        """The first live batch is ``seq`` but the stream starts at ``start`` (an empty
        replay said so): the batches between were sent before our SUB was connected.
        Replay them once; if that is impossible, they are a loss."""
        self.stats.gaps += 1
        if self.replay_enabled and not self._no_replay:
            log.info(
                "%s: first batch is %d, the stream starts at %s: replaying",
                self.host.name(),
                seq,
                start,
            )
            self.buffer.append((seq, payload))
            self._expect_replay = True
            self.start_replay(start, verify=False)
            return
        self._loss(f"seq {seq} arrived first, the stream starts at {start}: the replay failed", now)
        self._apply(seq, payload)

    def restarted(self, why: str, now: float) -> None:
        """The publisher restarted (seen in the sequence, or its engine found again on new
        URLs): its cache is new, ours a loss (degraded; blocks not announced again within
        the grace period are dropped)."""
        self.stats.restarts += 1
        self._loss(f"publisher restarted ({why})", now)

    def _restarted(self, seq: int, payload: bytes, why: str, now: float) -> None:
        """The publisher restarted: its cache is new; forget ours and catch up from 0."""
        self.restarted(why, now)
        if seq > 0 and self.replay_enabled and not self._no_replay:
            self.buffer.append((seq, payload))
            self.start_replay(0, verify=False)
            return
        self._apply(seq, payload)

    def _loss(self, why: str, now: float) -> None:
        """Batches were lost for good: forget the sequence, degrade, let the host age out."""
        self.stats.resyncs += 1
        self.started = True
        self.degraded_since = now
        self.last_loss = (now, why)
        self.loss_epoch += 1
        self.last_seq = self.last_digest = None
        self._expect = None
        self.dedup.clear()
        self.dedup_high = -1
        self.host.lost(why, self.loss_epoch)

    def _merge(self, now: float) -> None:
        buf, self.buffer = self.buffer, []
        if not buf:
            return
        buf.sort(key=lambda x: x[0])
        for i, (seq, payload) in enumerate(buf):
            if self.replaying:
                self.buffer.extend(buf[i:])
                return
            self._process(seq, payload, now)


# PERF: what a /metrics scrape reads of many trackers at once, in C loops
# (kvconductor.ingest.sourcecolumns): the attributes behind the properties, no call
READ_REPLAYING = attrgetter("_replaying")
READ_DEGRADED = attrgetter("_degraded_since")
