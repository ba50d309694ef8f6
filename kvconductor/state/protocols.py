"""The declared seams of the state floor (like falcon's ``_typing.py``).

Optional features are objects handed to the :class:`~kvconductor.state.conductor.
Conductor` at construction (or through its explicit ``attach_*`` methods), typed by the
Protocols here, never attributes found by probing:

* :class:`~kvconductor.state.journal.Journal` (in :mod:`kvconductor.state.journal`): the
  path every HTTP mutation takes; a replicated one exposes a :class:`Replica`;
* :class:`Snapshots`: the ``--snapshot-dir`` writer
  (:class:`kvconductor.state.snapshot.Snapshotter`);
* :class:`Subscriptions`: the ZeroMQ subscriptions the conductor drives
  (:class:`kvconductor.ingest.subscriber.SubscriptionManager`; :class:`NoSubscriptions`
  when there are none: before start, a dump check, test doubles);
* :class:`QuerySource` and :class:`IndexView`: what the HTTP query resources read, served
  by the conductor in its own process and by :class:`kvconductor.state.shared.SharedView`
  in a ``--workers N`` worker.

This module imports nothing of the state floor: the conductor, the journal and the
modules above them all name their seams from here, so the import map has no circle.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

from kvconductor.ingest.freshness import FreshnessTable, FreshnessTables
from kvconductor.ingest.sourcemetrics import SourceSnapshot
from kvconductor.schema import JSONObject, JSONValue

if TYPE_CHECKING:
    from kvconductor.index import QueryResult
    from kvconductor.ingest.context import SubscriberContext
    from kvconductor.ingest.subscription import Subscription

__all__ = [
    "IndexView",
    "JSONObject",
    "JSONValue",
    "NoSubscriptions",
    "QuerySource",
    "Replica",
    "ReplicaInfo",
    "SnapshotCounts",
    "SnapshotStats",
    "Snapshots",
    "SourceInfo",
    "SourceKey",
    "Subscriptions",
]

#: A JSON document (what ``/workers``, ``/debug/dump`` and the dump records hold).

#: A ZeroMQ source: (instance_id, dp_rank, url).
SourceKey = tuple[str, int, str]


# -- queries ---------------------------------------------------------------------------------
class IndexView(Protocol):
    """One (model, tenant) index as the query resources read it
    (:class:`kvconductor.index.Index`, :class:`kvconductor.state.shared.ViewIndex`)."""

    def query(
        self,
        tokens: Sequence[int],
        block_size: int,
        seed: int,
        *,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
    ) -> QueryResult: ...

    def query_by_hash(
        self,
        local_hashes: Sequence[int],
        *,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
    ) -> QueryResult: ...


class QuerySource(Protocol):
    """What ``POST /query`` and ``POST /query_by_hash`` need (any thread): the index of a
    (model, tenant), the registered block sizes and LoRA seeds seen (the miss reasons),
    and threads for large queries."""

    @property
    def block_sizes(self) -> Mapping[tuple[str, str], frozenset[int]]: ...

    @property
    def lora_seeds(self) -> Mapping[tuple[str, str], frozenset[int]]: ...

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor: ...

    def get_index(self, model: str, tenant: str) -> IndexView | None: ...

    def freshness(self, model: str, tenant: str) -> FreshnessTable | None:
        """The states behind the (model, tenant)'s answers (``"freshness"`` queries);
        None where this process cannot tell. May raise
        :class:`~kvconductor.ingest.freshness.FreshnessUnavailable`."""
        ...


# -- replicas and snapshots ------------------------------------------------------------------
class ReplicaInfo(TypedDict):
    """``GET /workers``' ``replica`` object (docs/api.md)."""

    id: str
    state_store: str
    loaded: bool
    applied_id: str
    log_last_id: str
    log_length: int
    lag_s: float
    replicas: int
    sources_consumed: int
    sources_handed_over: int
    entries_applied: int
    batches_applied: int
    entries_appended: int
    append_failures: int
    bootstraps: int
    snapshots_written: int


class Replica(Protocol):
    """A replicated journal (``--state-url``) as ``/ready``, ``/workers`` and ``/metrics``
    read it."""

    @property
    def bootstrapped(self) -> bool:
        """The state was loaded from the store (readiness)."""
        ...

    def info(self) -> ReplicaInfo: ...


@dataclass
class SnapshotStats:
    """What ``/metrics`` reports of the snapshots (written by the snapshot thread of
    :class:`kvconductor.state.snapshot.Snapshotter`)."""

    written: int = 0
    failed: int = 0
    #: Wall-clock time of the last snapshot written (0: none yet).
    last_time: float = 0.0
    last_bytes: int = 0
    #: Seconds the last snapshot took: copy on the ingest thread, encode, write.
    last_seconds: float = 0.0
    #: Seconds the ingest thread was held for the last one's copy.
    last_pause: float = 0.0


#: The snapshots' counts as ``/metrics`` reads them: the record itself.
SnapshotCounts = SnapshotStats


class Snapshots(Protocol):
    """The ``--snapshot-dir`` writer of a conductor."""

    @property
    def stats(self) -> SnapshotCounts: ...

    def start(self) -> None: ...

    def nudge(self) -> None:
        """A registration changed: write a snapshot soon (any thread; coalesced)."""

    def stop(self, final: bool = True) -> None: ...


# -- subscriptions ---------------------------------------------------------------------------
class LastLoss(TypedDict):
    at: float
    why: str


class SourceInfo(TypedDict, total=False):
    """The fields of a ``/workers`` ``sources`` entry the state floor reads (docs/api.md,
    GET /workers; :meth:`kvconductor.ingest.subscription.Subscription.info` writes it)."""

    instance_id: str
    dp_rank: int
    url: str
    state: str
    connected: bool
    events: int
    blocks: int
    losses: int
    degraded_since: float | None
    last_loss: LastLoss | None
    dropped: dict[str, int]


class Subscriptions(Protocol):
    """The ZeroMQ subscriptions of a conductor (ingest thread, except
    :meth:`metrics_snapshot`)."""

    #: The states behind answers (``"freshness"`` queries; any thread).
    freshness: FreshnessTables

    @property
    def resume(self) -> dict[SourceKey, tuple[int, int, int]]:
        """Sequence cursors a dump's sources resume from when a registration reopens
        them (filled by :func:`kvconductor.state.dump.load_dump`, emptied after it)."""
        ...

    def count(self, instance_id: str, dp_rank: int) -> int: ...
    def __len__(self) -> int: ...
    def replace(
        self, instance_id: str, dp_rank: int, contexts: list[SubscriberContext]
    ) -> set[str]: ...
    def unsubscribe(self, instance_id: str, dp_rank: int) -> int: ...
    def restarted(self, instance_id: str, dp_rank: int, urls: set[str], why: str) -> None: ...
    def request_replay(self, ctx: SubscriberContext) -> None: ...
    def sources(self) -> list[dict[str, object]]:
        """Per subscription its ``/workers`` ``sources`` entry (:class:`SourceInfo`)."""
        ...

    def get(self, instance_id: str, dp_rank: int, url: str) -> Subscription | None: ...
    def check_sources(self, now: float | None = None) -> None: ...
    def seed_store_only(self) -> None: ...
    def cursors(self) -> list[JSONObject]: ...
    def metrics_snapshot(self, pause: Callable[[], None] | None = None) -> SourceSnapshot: ...
    def close(self) -> None: ...

    # the replicated log's source entries (kvconductor.state.replica; the subscriptions
    # journal through the conductor's journal's ``sources``, handed in at construction)
    def apply_logged(self, key: SourceKey, seq: int, epoch: int, payload: bytes) -> bool: ...
    def loss_logged(self, key: SourceKey, epoch: int, token: str, why: str) -> None: ...
    def aged_logged(self, key: SourceKey, epoch: int, token: str) -> None: ...
    def down_logged(self, key: SourceKey, epoch: int, secs: float) -> None: ...
    def raise_fence_floor(self, floor: int) -> None: ...
    def highest_fence(self) -> int: ...
    def release_all(self) -> int: ...
    def source_states(self) -> dict[SourceKey, bool]: ...


class NoSubscriptions:
    """:class:`Subscriptions` without sockets: registrations open none, and there is
    nothing to check, resume or report. A conductor has these until it starts; dump
    checks (``kv-conductor load-dump``) and test doubles build on them."""

    def __init__(self, thread: object = None, conductor: object = None) -> None:
        self.freshness = FreshnessTables(tuple, int)  # no sources, generation 0

    @property
    def resume(self) -> dict[SourceKey, tuple[int, int, int]]:
        return {}  # nothing resumes: what a dump fills in here is dropped

    def count(self, instance_id: str, dp_rank: int) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    def replace(
        self, instance_id: str, dp_rank: int, contexts: list[SubscriberContext]
    ) -> set[str]:
        return set()

    def unsubscribe(self, instance_id: str, dp_rank: int) -> int:
        return 0

    def restarted(self, instance_id: str, dp_rank: int, urls: set[str], why: str) -> None:
        pass

    def request_replay(self, ctx: SubscriberContext) -> None:
        pass

    def sources(self) -> list[dict[str, object]]:
        return []

    def get(self, instance_id: str, dp_rank: int, url: str) -> Subscription | None:
        return None

    def check_sources(self, now: float | None = None) -> None:
        pass

    def seed_store_only(self) -> None:
        pass

    def cursors(self) -> list[JSONObject]:
        return []

    def metrics_snapshot(self, pause: Callable[[], None] | None = None) -> SourceSnapshot:
        return SourceSnapshot()

    def close(self) -> None:
        pass

    def apply_logged(self, key: SourceKey, seq: int, epoch: int, payload: bytes) -> bool:
        return False

    def loss_logged(self, key: SourceKey, epoch: int, token: str, why: str) -> None:
        pass

    def aged_logged(self, key: SourceKey, epoch: int, token: str) -> None:
        pass

    def down_logged(self, key: SourceKey, epoch: int, secs: float) -> None:
        pass

    def raise_fence_floor(self, floor: int) -> None:
        pass

    def highest_fence(self) -> int:
        return 0

    def release_all(self) -> int:
        return 0

    def source_states(self) -> dict[SourceKey, bool]:
        return {}
