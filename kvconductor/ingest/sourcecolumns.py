"""What a ``/metrics`` scrape reads of the subscriptions, column by column.

:meth:`SubscriptionManager.metrics_snapshot
<kvconductor.ingest.subscriber.SubscriptionManager.metrics_snapshot>` (any thread) hands
:func:`read_columns` one slice of its table at a time; the columns (label sets, live and
muted flags, last events) and the counters' totals go into a
:class:`~kvconductor.ingest.sourcemetrics.SourceSnapshot`, and what only changes with the
table, a registration, a source's state or a rare counter is kept in :class:`Columns`
for the next scrape. :class:`RetiredTotals` holds the counters of the subscriptions
closed so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import and_, attrgetter, is_, itemgetter, not_
from typing import NamedTuple

from kvconductor.ingest.sourcemetrics import SourceSnapshot, Totals
from kvconductor.ingest.stats import (
    READ_GAPS,
    READ_MUTES,
    READ_PURGED,
    READ_REPLAYS_OK,
    SourceStats,
)
from kvconductor.ingest.subscription import READ_CONNECTED, READ_MUTED, READ_TRACKER, Subscription
from kvconductor.ingest.tracker import READ_DEGRADED, READ_REPLAYING


@dataclass(slots=True, eq=False)
class RetiredTotals(Totals):
    """Counters of the subscriptions closed so far, so that the metrics' sums over
    subscriptions never go down when one closes (a counter reset to Prometheus)."""

    #: events by source kind
    events: dict[str, int] = field(default_factory=dict)


_STATS = attrgetter("stats")
_EVENTS = attrgetter("events")
# (the attributes behind the properties of SourceStats, Subscription and SequenceTracker
# are read, without the property's call, by the READ_* readers their modules export)
_DROPPED = attrgetter("dropped")
_KIND = attrgetter("kind")
_OWNED = attrgetter("replica.owned")
_LAST_EVENT = attrgetter("last_event")
_LABELS = attrgetter("metric_labels")
_FIRST = itemgetter(0)
_NONES = repeat(None)  # endless: map() stops at the shorter iterable
_ZEROS = repeat(0)
_ONE = 1


def replays(sub: Subscription) -> tuple[int, int]:
    """(ok, failed) finished replays of ``sub`` (a running one is neither); each counted
    once, when it ends, so both only grow."""
    s = sub.stats
    return s.replays_ok, s.dropped.get("replay_failed", 0)


class Columns(NamedTuple):
    """What a slice of subscriptions keeps from one scrape to the next while it stays
    the same: the same subscriptions, and :data:`~kvconductor.ingest.stats.LABELS_STAMP`
    unchanged (no label set or source kind changed anywhere); the live and muted flags
    while :data:`~kvconductor.ingest.stats.STATE_STAMP` is unchanged too, the rare
    counters' sums while :data:`~kvconductor.ingest.stats.COUNTS_STAMP` is."""

    #: (LABELS_STAMP, STATE_STAMP, COUNTS_STAMP) when read
    stamps: tuple[int, int, int]
    subs: list[Subscription]
    stats: list[SourceStats]
    #: the stats objects per source kind, in the order of the kinds
    kinds: list[tuple[str, list[SourceStats]]]
    #: the label sets flattened
    labels: list[str]
    #: None when each subscription has one medium, else what repeats a column's value
    #: for each medium of its subscription (an itemgetter of the indices after two 0s)
    ks: itemgetter[tuple[int, ...]] | None
    #: the rarely moving counters, summed
    rare: Totals
    #: per label set: connected, not replaying, not degraded (--state-url: not owned
    #: yet, which is read at every scrape)
    live: list[bool]
    #: per label set: muted
    muted: list[bool]


def _sum_rare(stats: list[SourceStats]) -> Totals:
    # PERF: C loops (map/attrgetter, sum). The drops: one sum per reason over the
    # sources that have any (a few reasons, in C) or, when the reasons are many for the
    # drops there are, a Python loop over them. The dicts are read in C calls that run
    # no Python code: the ingest thread cannot add a reason in the middle of one.
    ds = list(filter(None, map(_DROPPED, stats)))
    reasons = set(chain.from_iterable(ds))
    if len(reasons) * len(ds) <= 4 * (sum(map(len, ds)) + len(ds)):
        dropped = {r: sum(map(dict.get, ds, repeat(r), _ZEROS)) for r in sorted(reasons)}
    else:
        dropped = {}
        for d in ds:
            for reason, n in list(d.items()):  # a copy in C
                dropped[reason] = dropped.get(reason, 0) + n
    return Totals(
        dropped,
        sum(map(READ_GAPS, stats)),
        sum(map(READ_REPLAYS_OK, stats)),
        dropped.get("replay_failed", 0),
        sum(map(READ_MUTES, stats)),
        sum(map(READ_PURGED, stats)),
    )


def _repeater(lens: list[int]) -> itemgetter[tuple[int, ...]]:
    """What repeats a column's value ``lens[i]`` times for each ``i``: an itemgetter of
    the indices after two 0s (cut off after the call: a tuple even for fewer than two
    indices)."""
    # PERF: the indices built a run of single media at a time (a C extend), a Python
    # statement only for a source of another count
    idx = [0, 0]
    start = 0
    for i in compress(range(len(lens)), map(_ONE.__ne__, lens)):
        idx += range(start, i)
        idx += repeat(i, lens[i])
        start = i + 1
    idx += range(start, len(lens))
    return itemgetter(*idx)


def _live(subs: list[Subscription]) -> list[bool]:
    """What Subscription.state calls "live" (connected, not replaying, not degraded),
    from the columns (passive sources: see ``read_columns``)."""
    trackers = list(map(READ_TRACKER, subs))
    undegraded = all(map(is_, map(READ_DEGRADED, trackers), _NONES))
    if any(map(READ_REPLAYING, trackers)) or not undegraded:
        return list(
            map(
                and_,
                map(and_, map(READ_CONNECTED, subs), map(not_, map(READ_REPLAYING, trackers))),
                map(is_, map(READ_DEGRADED, trackers), _NONES),
            )
        )
    return list(map(READ_CONNECTED, subs))  # none replaying or degraded (the common case)


def read_columns(
    snap: SourceSnapshot,
    subs: list[Subscription],
    replicated: bool,
    kept: Columns | None,
    stamps: tuple[int, int, int],
) -> Columns:
    """Appends the columns of ``subs`` to ``snap`` and adds their counters to its totals;
    returns what the next scrape may reuse (``kept``: this slice's from the last one,
    ``stamps``: :data:`~kvconductor.ingest.stats.LABELS_STAMP`, ``STATE_STAMP`` and
    ``COUNTS_STAMP``, read before anything else)."""
    # PERF: every column read by map/attrgetter (C loops); no Python statement per
    # subscription but for the rare ones with drops. What only changes with the table,
    # a registration, a source's state or a rare counter (stats objects, kinds, label
    # sets, the live and muted flags, the rare counters' sums) is reused while the stamps
    # are the same and the slice's subscriptions compare equal (identity, in C): each
    # scrape reads only what moves with every batch (events, last event).
    if kept is None or kept.stamps[0] != stamps[0] or kept.subs != subs:
        stats = list(map(_STATS, subs))
        kinds = list(map(_KIND, subs))
        if len(set(kinds)) == 1:  # one engine type (the common case)
            groups = [(kinds[0], stats)]
        else:
            by_kind: dict[str, list[SourceStats]] = {}
            for kind, st in zip(kinds, stats, strict=True):
                by_kind.setdefault(kind, []).append(st)
            groups = sorted(by_kind.items())
        sets = list(map(_LABELS, subs))
        ks: itemgetter[tuple[int, ...]] | None = None
        live, muted = _live(subs), list(map(READ_MUTED, subs))
        lens = list(map(len, sets))
        if all(map(_ONE.__eq__, lens)):
            labels = list(map(_FIRST, sets))
        else:  # sources of several media (or none): a line per medium
            labels = list(chain.from_iterable(sets))
            ks = _repeater(lens)
            live, muted = list(ks(live)[2:]), list(ks(muted)[2:])
        kept = Columns(stamps, subs, stats, groups, labels, ks, _sum_rare(stats), live, muted)
    elif kept.stamps != stamps:
        if kept.stamps[1] != stamps[1]:  # a source's state moved (one flapping)
            live, muted = _live(subs), list(map(READ_MUTED, subs))
            if kept.ks is not None:
                live, muted = list(kept.ks(live)[2:]), list(kept.ks(muted)[2:])
            kept = kept._replace(live=live, muted=muted)
        if kept.stamps[2] != stamps[2]:  # a rare counter moved (a source dropping)
            kept = kept._replace(rare=_sum_rare(kept.stats))
        kept = kept._replace(stamps=stamps)
    stats, labels, ks = kept.stats, kept.labels, kept.ks
    snap.add(kept.rare)
    applied = snap.applied
    for kind, group in kept.kinds:
        applied[kind] = applied.get(kind, 0) + sum(map(_EVENTS, group))
    live = kept.live
    if replicated:  # --state-url: a source this replica does not own is remote
        owned = list(map(_OWNED, subs))
        live = list(map(and_, live, owned if ks is None else ks(owned)[2:]))
    last = list(map(_LAST_EVENT, stats))
    snap.labels += labels
    snap.live += live
    snap.muted += kept.muted
    snap.last_event += last if ks is None else ks(last)[2:]
    return kept
