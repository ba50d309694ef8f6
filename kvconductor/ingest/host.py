"""What the ingest side needs from its owner, declared (not probed).

The owner (:class:`kvconductor.state.conductor.Conductor`, or a test double) satisfies
:class:`IngestHost` structurally. What is optional is handed to
:class:`~kvconductor.ingest.subscriber.SubscriptionManager` at construction as an object
or ``None``: the shared write section of ``--workers N`` (:class:`SharedWrites`), the
settings (:class:`IngestSettings`), the journal of the sources (:class:`SourceJournal`:
``--state-url``'s replicated log, handed in by the composition root; by default
:data:`LOCAL_SOURCES`, which owns every source and journals nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


class PayloadSink(Protocol):
    """Applies an engine or pool message (:class:`kvconductor.ingest.apply.Applier`)."""

    def apply_payload(self, payload: bytes) -> object: ...


class SourceCursor(Protocol):
    """The last batch a sequence tracker applied
    (:class:`kvconductor.ingest.tracker.SequenceTracker`)."""

    @property
    def last_seq(self) -> int | None: ...
    @property
    def last_digest(self) -> int | None: ...


class LoggedSource(Protocol):
    """A source's replicated half (:class:`kvconductor.ingest.replicated.ReplicaState`)."""

    @property
    def applied(self) -> tuple[int, int] | None:
        """(seq, digest) of the last batch the log applied here."""

    def down_changed(self, down: bool) -> bool:
        """The owner sees the source ``down`` (or not): True when that is news."""


class JournalSource(Protocol):
    """What a :class:`SourceJournal` reads of, and calls on, the source an entry is
    about (:class:`kvconductor.ingest.subscription.Subscription`)."""

    key: tuple[str, int, str]
    #: Monotonic time since when the source is not ready (None: ready).
    down_since: float | None

    @property
    def lease_epoch(self) -> int:
        """The epoch of this replica's lease on the source."""

    @property
    def applier(self) -> PayloadSink: ...
    @property
    def tracker(self) -> SourceCursor: ...
    @property
    def replica(self) -> LoggedSource: ...

    def degrade(self, why: str, epoch: int) -> None:
        """Loss ``epoch`` of the tracker, degraded here: the source's blocks are suspects
        until its grace period ends."""

    def age_later(self, token: str) -> None:
        """End loss ``token``'s grace period in ``--loss-grace-secs`` (an ``aged`` entry)."""


class SourceJournal(Protocol):
    """The journal the ZeroMQ sources go through, handed to the subscription manager at
    construction: :data:`LOCAL_SOURCES` (one process: every source is consumed here and
    its batches applied at once) or ``--state-url``'s replicated log
    (:class:`kvconductor.state.replica.ValkeyJournal`: an owned source's batches and
    events are appended, and every replica applies them)."""

    @property
    def replicated(self) -> bool:
        """Sources are leased among replicas: one not owned here is ``remote``."""

    def claims(self, key: tuple[str, int, str]) -> bool:
        """A new subscription of ``key`` is consumed here from the start (else passive
        until this replica takes its lease; the owner replays it then)."""

    def append_batch(self, sub: JournalSource, seq: int, payload: bytes) -> None:
        """Batch ``seq`` of an owned source."""

    def append_loss(self, sub: JournalSource, why: str, epoch: int) -> None:
        """The tracker of an owned source declared loss ``epoch``."""

    def append_source(
        self, sub: JournalSource, kind: str, token: str, extra: str | float | None = None
    ) -> None:
        """A ``loss`` (``extra``: why), ``aged`` or ``down`` (``extra``: seconds not
        ready, negative when ready) entry of an owned source."""

    def report_down(self, subs: Iterable[JournalSource], now: float) -> None:
        """After a source check: tell the other replicas which owned sources went down
        or came back."""

    def cursor(self, sub: JournalSource) -> tuple[int, int] | None:
        """(seq, digest) of the source's last batch applied (snapshots)."""


class LocalSources:
    """:class:`SourceJournal` of one process: it owns every source and journals nothing
    (a batch is applied at once, a loss degrades the source here)."""

    replicated = False

    def claims(self, key: tuple[str, int, str]) -> bool:
        return True

    def append_batch(self, sub: JournalSource, seq: int, payload: bytes) -> None:
        sub.applier.apply_payload(payload)

    def append_loss(self, sub: JournalSource, why: str, epoch: int) -> None:
        sub.degrade(why, epoch)

    def append_source(
        self, sub: JournalSource, kind: str, token: str, extra: str | float | None = None
    ) -> None:
        pass

    def report_down(self, subs: Iterable[JournalSource], now: float) -> None:
        pass

    def cursor(self, sub: JournalSource) -> tuple[int, int] | None:
        t = sub.tracker
        seq, d = t.last_seq, t.last_digest
        return None if seq is None or d is None else (seq, d)


#: The default journal of the sources (no ``--state-url``).
LOCAL_SOURCES = LocalSources()


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
