"""What ``/metrics`` reads of the subscriptions: :class:`SourceSnapshot` (columns, one
entry per (source, medium), and totals) and :func:`label_sets` (a subscription's label
sets, rendered once per registration).

Plain data, no I/O. The label sets are in the Prometheus text format already (label names
sorted, values escaped as ``generate_latest`` does), so a scrape concatenates them with
the family names and values instead of formatting every sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvconductor.keys import Medium


def escape_label_value(v: str) -> str:
    """A label value of the Prometheus text format: backslash, newline and double quote
    escaped, any other character (UTF-8 included) as is."""
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_sets(instance_id: str, dp_rank: int, media: Iterable[int]) -> tuple[str, ...]:
    """``{dp_rank="..",instance_id="..",medium=".."}`` for each medium of a subscription,
    in the order of its media (label names sorted, as ``generate_latest`` writes them)."""
    head = f'{{dp_rank="{dp_rank}",instance_id="{escape_label_value(instance_id)}",medium="'
    return tuple(f'{head}{escape_label_value(Medium(m).name)}"}}' for m in media)


@dataclass(slots=True, eq=False)
class Totals:
    """The counters a ``/metrics`` scrape sums over the sources
    (:class:`~kvconductor.ingest.stats.SourceStats`'s rare ones, and the failed replays
    among the drops), by a slice of subscriptions, the closed ones or a whole scrape."""

    #: by reason
    dropped: dict[str, int] = field(default_factory=dict)
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    mutes: int = 0
    purged_blocks: int = 0

    def add(self, other: Totals) -> None:
        """Adds ``other``'s counters to these."""
        self.gaps += other.gaps
        self.replays_ok += other.replays_ok
        self.replays_failed += other.replays_failed
        self.mutes += other.mutes
        self.purged_blocks += other.purged_blocks
        dropped = self.dropped
        for reason, n in other.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n


@dataclass(slots=True, eq=False)
class SourceSnapshot(Totals):
    """One scrape's reading of the subscriptions (``SubscriptionManager.metrics_snapshot``).

    Per (source, medium), in table order then the source's media: :attr:`labels` (from
    :func:`label_sets`), :attr:`live`, :attr:`muted`, :attr:`last_event` (wall clock).
    Totals over the live subscriptions and the closed ones (retired), so that no sum goes
    down when a subscription closes: :attr:`applied` (events by source kind) and the
    :class:`Totals`.
    """

    labels: list[str] = field(default_factory=list)
    live: list[bool] = field(default_factory=list)
    muted: list[bool] = field(default_factory=list)
    last_event: list[float] = field(default_factory=list)
    applied: dict[str, int] = field(default_factory=dict)
