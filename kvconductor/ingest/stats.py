"""Counters and bounds of one ingest source: :class:`SourceStats`, :class:`WarnLimiter`,
:class:`Limits`.

Plain data, no I/O: the tracker, the liveness policy, the applier and the sockets
count into the same :class:`SourceStats` of a subscription; nothing here imports
another ingest module.
"""

from __future__ import annotations

import itertools
import logging
import time
from operator import attrgetter

log = logging.getLogger("kvconductor.ingest")


def hex_preview(payload: bytes, n: int = 32) -> str:
    b = bytes(payload[:n])
    return b.hex(" ") + (" ..." if len(payload) > n else "")


_STAMPS = itertools.count(1)

#: ``[stamp]``: a new stamp (:func:`counts_changed`) after every change of a rarely
#: moving counter of any :class:`SourceStats` (``gaps``, ``replays_ok``, ``mutes``,
#: ``purged_blocks``, ``dropped``): a ``/metrics`` scrape keeps their sums from one
#: scrape to the next instead of reading them again while it holds
#: (``SubscriptionManager.metrics_snapshot``). One list for the process: a change
#: anywhere makes every manager read them again, which is only slower.
COUNTS_STAMP = [0]
#: ``[stamp]``: the same (:func:`state_changed`) for a subscription's state (connected,
#: muted, its tracker, replaying, degraded), which a scrape keeps too: a source that
#: drops all the time does not make it read those again, nor one that flaps the rest.
STATE_STAMP = [0]
#: ``[stamp]``: the same (:func:`labels_changed`) for a subscription's label sets and
#: source kind (a registration's context: ``Subscription.ctx``).
LABELS_STAMP = [0]


def counts_changed() -> None:
    """Something :data:`COUNTS_STAMP` covers has changed (call after the change)."""
    # PERF: next() of a count is one C call, so two threads never write the same stamp
    COUNTS_STAMP[0] = next(_STAMPS)


def state_changed() -> None:
    """Something :data:`STATE_STAMP` covers has changed (call after the change)."""
    STATE_STAMP[0] = next(_STAMPS)


def labels_changed() -> None:
    """Something :data:`LABELS_STAMP` covers has changed (call after the change)."""
    LABELS_STAMP[0] = next(_STAMPS)


class SourceStats:
    """Counters of one subscription (shown by ``sources()``).

    ``gaps``, ``replays_ok``, ``mutes`` and ``purged_blocks`` are properties whose
    setters call :func:`counts_changed` (their slots: the name with a leading ``_``);
    ``dropped`` is written only through :meth:`drop`, which does too. The other
    counters move with every batch and are plain slots."""

    __slots__ = (
        "batches",
        "events",
        "blocks",
        "dropped",
        "_gaps",
        "replays",
        "_replays_ok",
        "replayed_batches",
        "restarts",
        "resyncs",
        "duplicates",
        "last_seq",
        "aged_out",
        "last_event",
        "_mutes",
        "_purged_blocks",
    )

    def __init__(self) -> None:
        self.batches = 0
        self.events = 0
        self.blocks = 0
        #: Messages and events dropped, by reason (written by :meth:`drop` only).
        self.dropped: dict[str, int] = {}
        self._gaps = 0
        self.replays = 0
        self._replays_ok = 0
        self.replayed_batches = 0
        self.restarts = 0
        self.resyncs = 0
        self.duplicates = 0
        self.last_seq: int | None = None
        #: Blocks dropped because they were not re-announced after a loss.
        self.aged_out = 0
        #: Wall-clock time of the last batch received (set by the subscription).
        self.last_event = 0.0
        self._mutes = 0
        self._purged_blocks = 0

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        counts_changed()

    @property
    def gaps(self) -> int:
        """Sequence gaps seen."""
        return self._gaps

    @gaps.setter
    def gaps(self, n: int) -> None:
        self._gaps = n
        counts_changed()

    @property
    def replays_ok(self) -> int:
        """Replays whose end marker arrived (the failed ones: ``dropped["replay_failed"]``)."""
        return self._replays_ok

    @replays_ok.setter
    def replays_ok(self, n: int) -> None:
        self._replays_ok = n
        counts_changed()

    @property
    def mutes(self) -> int:
        """Times the source's (instance, DP) HBM hits were muted (down past
        --source-down-secs)."""
        return self._mutes

    @mutes.setter
    def mutes(self, n: int) -> None:
        self._mutes = n
        counts_changed()

    @property
    def purged_blocks(self) -> int:
        """HBM blocks dropped because the source stayed down past --source-purge-secs."""
        return self._purged_blocks

    @purged_blocks.setter
    def purged_blocks(self, n: int) -> None:
        self._purged_blocks = n
        counts_changed()


# PERF: what a /metrics scrape reads of many SourceStats at once, in C loops
# (kvconductor.ingest.sourcecolumns): the attributes behind the properties, no call
READ_GAPS = attrgetter("_gaps")
READ_REPLAYS_OK = attrgetter("_replays_ok")
READ_MUTES = attrgetter("_mutes")
READ_PURGED = attrgetter("_purged_blocks")


class WarnLimiter:
    """At most one WARN per (source, reason) every ``interval`` seconds."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[tuple, float] = {}
        self._suppressed: dict[tuple, int] = {}

    def warn(self, source: str, reason: str, detail: str, payload: bytes | None) -> None:
        key = (source, reason)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        skipped = self._suppressed.pop(key, 0)
        log.warning(
            "%s: dropped (%s) %s%s%s",
            source,
            reason,
            detail[:200],
            f" payload[{len(payload)}B]={hex_preview(payload)}" if payload is not None else "",
            f" (+{skipped} similar suppressed)" if skipped else "",
        )


#: The limiter of appliers created without one (tests, tools).
DEFAULT_WARN = WarnLimiter()


class Limits:
    """Bounds on what one ZeroMQ message and one source may add to the index.

    A message over a bound is refused whole (nothing of it applied) and counted
    in the source's ``dropped``: ``message_too_large``,
    ``message_too_many_blocks`` or ``source_block_limit`` (the engine source's
    HBM worker, with what a store-only source's bound holds, would hold more blocks than
    ``max_blocks_per_source``). A store-only source's chunk counts as the registered
    blocks it stands for (:mod:`kvconductor.ingest.storeonly`).
    """

    __slots__ = ("max_message_bytes", "max_blocks_per_message", "max_blocks_per_source")

    def __init__(
        self,
        max_message_bytes: int = 256 << 20,
        max_blocks_per_message: int = 1_000_000,
        max_blocks_per_source: int = 4_000_000,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_blocks_per_message = max_blocks_per_message
        self.max_blocks_per_source = max_blocks_per_source
