"""What ``/metrics`` reads of the subscriptions: :class:`SourceSnapshot` (columns, one
entry per (source, medium), and totals) and :func:`label_sets` (a subscription's label
sets, rendered once per registration).

Plain data, no I/O. The label sets are in the Prometheus text format already (label names
sorted, values escaped as ``generate_latest`` does), so a scrape concatenates them with
the family names and values instead of formatting every sample.
"""

from __future__ import annotations

from collections.abc import Iterable

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


class SourceSnapshot:
    """One scrape's reading of the subscriptions (``SubscriptionManager.metrics_snapshot``).

    Per (source, medium), in table order then the source's media: :attr:`labels` (from
    :func:`label_sets`), :attr:`live`, :attr:`muted`, :attr:`last_event` (wall clock).
    Totals over the live subscriptions and the closed ones (retired), so that no sum goes
    down when a subscription closes: :attr:`applied` (events by source kind),
    :attr:`dropped` (by reason), :attr:`gaps`, :attr:`replays_ok`, :attr:`replays_failed`,
    :attr:`mutes`, :attr:`purged_blocks`.
    """

    __slots__ = (
        "applied",
        "dropped",
        "gaps",
        "labels",
        "last_event",
        "live",
        "muted",
        "mutes",
        "purged_blocks",
        "replays_failed",
        "replays_ok",
    )

    def __init__(self) -> None:
        self.labels: list[str] = []
        self.live: list[bool] = []
        self.muted: list[bool] = []
        self.last_event: list[float] = []
        self.applied: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.gaps = 0
        self.replays_ok = 0
        self.replays_failed = 0
        self.mutes = 0
        self.purged_blocks = 0
