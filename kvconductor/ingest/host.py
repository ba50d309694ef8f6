"""What the ingest side needs from its owner, declared (not probed).

The owner (:class:`kvconductor.state.conductor.Conductor`, or a test double) satisfies
:class:`IngestHost` structurally. What is optional is handed to
:class:`~kvconductor.ingest.subscriber.SubscriptionManager` at construction as an object
or ``None``: the shared write section of ``--workers N`` (:class:`SharedWrites`), the
settings (:class:`IngestSettings`); the replicated log of ``--state-url``
(:class:`SourceJournal`) is attached by the replicator when it starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvconductor.index import Index
from kvconductor.ingest.liveness import SOURCE_DOWN, SOURCE_PURGE
from kvconductor.ingest.stats import Limits

#: Default grace period after a loss (``--loss-grace-secs``).
LOSS_GRACE = 600.0
#: Default overall replay deadline (``--replay-deadline-secs``).
REPLAY_DEADLINE = 60.0


class IngestHost(Protocol):
    """The indexes and registrations events are applied to (ingest thread)."""

    def get_index(self, model: str, tenant: str) -> Index | None:
        """The index of (model, tenant), or None."""

    def get_or_create_index(self, model: str, tenant: str) -> Index:
        """The index of (model, tenant), created on first use."""

    def hbm_ip_lookup(self, ip: str) -> Sequence[tuple[str, int]]:
        """(instance_id, dp_rank) pairs registered with HBM endpoints on ``ip``."""

    def instance_info(self, instance_id: str) -> object:
        """An instance's registration (a dict, or an object with ``model``/``tenant``;
        :func:`~kvconductor.ingest.poolroute.registered_index`), or None."""

    def context_dps(
        self, model: str, tenant: str, block_size: int, lora_name: str | None = None
    ) -> Sequence[tuple[str, int]]:
        """The engine (instance, DP)s registered in (model, tenant) with ``block_size``
        (and of adapter ``lora_name``, or of any, when it is given): a shared store's."""

    def note_lora(self, model: str, tenant: str, seed: int) -> None:
        """Blocks of the LoRA adapter of hash seed ``seed`` were stored."""


class WriteSection(Protocol):
    """One shared write section over several writes
    (:class:`kvconductor.state.shared.WriteBatch`)."""

    def __enter__(self) -> None: ...

    def __exit__(self, *exc: object) -> None: ...

    def tick(self) -> None:
        """After each write: let readers in when the section has lasted long enough."""


class SharedWrites(Protocol):
    """``--workers N``: the index lives in shared memory
    (:class:`kvconductor.state.shared.SharedIndexes`)."""

    def batch(self) -> WriteSection:
        """A write section for one drain of a socket."""


class JournalSource(Protocol):
    """What a :class:`SourceJournal` reads of the source an entry is about."""

    key: tuple[str, int, str]

    @property
    def lease_epoch(self) -> int:
        """The epoch of this replica's lease on the source."""


class SourceJournal(Protocol):
    """``--state-url``: the replicated log an owned source's batches and events go
    through (:class:`kvconductor.state.replica.Replicator`); every replica applies them."""

    def append_batch(self, sub: JournalSource, seq: int, payload: bytes) -> None:
        """Batch ``seq`` of an owned source."""

    def append_source(
        self, sub: JournalSource, kind: str, token: str, extra: str | float | None = None
    ) -> None:
        """A ``loss`` (``extra``: why), ``aged`` or ``down`` (``extra``: seconds not
        ready, negative when ready) entry of an owned source."""


@dataclass(frozen=True)
class IngestSettings:
    """The ingest side's settings (the CLI flags;
    :class:`kvconductor.state.conductor.ConductorConfig`)."""

    #: Seconds after a loss before blocks not announced again are dropped.
    loss_grace: float = LOSS_GRACE
    #: Seconds a whole replay may take before it counts as failed (a loss).
    replay_deadline: float = REPLAY_DEADLINE
    #: Seconds a replay may wait for its next message.
    replay_timeout: float = 5.0
    #: Seconds not ready before a source's (instance, DP) HBM hits are muted.
    source_down: float = SOURCE_DOWN
    #: Seconds not ready before those HBM blocks are dropped (0: never).
    source_purge: float = SOURCE_PURGE
    #: Bounds on one message and one source.
    limits: Limits = field(default_factory=Limits)
