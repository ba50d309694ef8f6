"""The journal: the one path every HTTP mutation of the state goes through.

:meth:`Conductor.mutate <kvconductor.state.conductor.Conductor.mutate>` hands each
``register``, ``unregister``, ``events`` and ``predict`` request to the conductor's
:class:`Journal`, with the request body as received and the arguments parsed from it:

* :class:`LocalJournal` (one process, the default) applies it at once on the ingest
  thread and returns what applying it did;
* :class:`~kvconductor.state.replica.ValkeyJournal` (``--state-url``) appends the body to
  the replicated log; every replica applies the entry (the body decoded again, so that
  all of them apply the same thing) and the one that accepted the request answers with
  what applying it did here.

Both apply a mutation through one table, :data:`MUTATIONS`: each kind names the
conductor method that applies it and how its arguments are decoded from a logged body.
So single-process and replicated mode run the same mutation code; a kind not in the
table is refused (:class:`UnknownMutation`) before anything is changed.

The conductor is seen here only through :class:`MutationHost` (this module is below
:mod:`kvconductor.state.conductor` in the import map).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from kvconductor.ingest.host import LOCAL_SOURCES, SourceJournal
from kvconductor.ingest.http_events import EventOp, normalize_events
from kvconductor.schema import (
    KvEventBatch,
    PredictRecord,
    RegisterRequest,
    UnregisterRequest,
    events_decoder,
    predict_record_decoder,
    register_decoder,
    unregister_decoder,
)

if TYPE_CHECKING:
    from kvconductor.ingest.thread import IngestThread
    from kvconductor.state.protocols import Replica

__all__ = [
    "MUTATIONS",
    "Journal",
    "LocalJournal",
    "Mutation",
    "MutationHost",
    "UnknownMutation",
    "apply_logged",
    "apply_mutation",
    "mutation",
]

#: A mutation's arguments, as :meth:`Conductor.mutate` got them or decoded from a body.
Args = tuple[object, ...]


class MutationHost(Protocol):
    """What the mutations are applied to (the conductor; ingest thread)."""

    def register(self, req: RegisterRequest) -> None: ...

    def unregister(self, req: UnregisterRequest) -> bool: ...

    def apply_events(self, batch: KvEventBatch, ops: list[EventOp]) -> object: ...

    def predict(self, rec: PredictRecord) -> int: ...


class UnknownMutation(ValueError):
    """A mutation kind the table does not have (nothing was applied)."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"unknown mutation kind {kind!r}")
        self.kind = kind


@dataclass(frozen=True)
class Mutation:
    """One kind of HTTP mutation: how its arguments come from a logged request body, and
    how they are applied to the conductor (ingest thread)."""

    kind: str
    decode: Callable[[bytes], Args]
    apply: Callable[[MutationHost, Args], object]


def _decode_register(body: bytes) -> Args:
    return (register_decoder.decode(body),)


def _register(host: MutationHost, args: Args) -> object:
    (req,) = args
    host.register(cast(RegisterRequest, req))
    return None


def _decode_unregister(body: bytes) -> Args:
    return (unregister_decoder.decode(body),)


def _unregister(host: MutationHost, args: Args) -> object:
    (req,) = args
    return host.unregister(cast(UnregisterRequest, req))


def _decode_events(body: bytes) -> Args:
    batch = events_decoder.decode(body)
    return (batch, normalize_events(batch))


def _events(host: MutationHost, args: Args) -> object:
    batch, ops = args
    return host.apply_events(cast(KvEventBatch, batch), cast("list[EventOp]", ops))


def _decode_predict(body: bytes) -> Args:
    return (predict_record_decoder.decode(body),)


def _predict(host: MutationHost, args: Args) -> object:
    (rec,) = args
    return host.predict(cast(PredictRecord, rec))


#: The HTTP mutations, by kind: the one table both journals apply through.
MUTATIONS: dict[str, Mutation] = {
    m.kind: m
    for m in (
        Mutation("register", _decode_register, _register),
        Mutation("unregister", _decode_unregister, _unregister),
        Mutation("events", _decode_events, _events),
        Mutation("predict", _decode_predict, _predict),
    )
}


def mutation(kind: str) -> Mutation:
    """The table's entry of ``kind``; :class:`UnknownMutation` when there is none."""
    m = MUTATIONS.get(kind)
    if m is None:
        raise UnknownMutation(kind)
    return m


def apply_mutation(host: MutationHost, kind: str, args: Args) -> object:
    """Apply ``kind`` with parsed ``args`` to ``host`` (ingest thread)."""
    return mutation(kind).apply(host, args)


def apply_logged(host: MutationHost, kind: str, body: bytes) -> object:
    """Apply a logged ``kind`` entry: its arguments decoded from ``body`` (ingest
    thread; what every replica does with an HTTP entry of the replicated log)."""
    m = mutation(kind)
    return m.apply(host, m.decode(body))


class Journal(Protocol):
    """Where :meth:`Conductor.mutate` sends every HTTP mutation."""

    @property
    def replica(self) -> Replica | None:
        """The replicated journal's status (``/ready``, ``/workers``, ``/metrics``);
        None for a journal that is not replicated."""
        ...

    @property
    def sources(self) -> SourceJournal:
        """What the ZeroMQ sources' batches and events go through (handed to the
        subscriptions at construction)."""
        ...

    def start(self) -> None:
        """Once the conductor runs, before the HTTP server serves."""
        ...

    async def submit(self, kind: str, body: bytes, args: Args) -> object:
        """Apply the mutation ``kind`` of the request ``body`` (parsed into ``args``) and
        return what applying it did here, or raise what applying it raised."""
        ...

    def stop(self) -> None:
        """After the HTTP server stopped, before the conductor stops."""
        ...


class LocalJournal:
    """One process holds the state: a mutation is applied at once, on the ingest thread
    (the conductor's single writer)."""

    replica: Replica | None = None

    def __init__(self, host: MutationHost, thread: IngestThread) -> None:
        self.host = host
        self.thread = thread

    @property
    def sources(self) -> SourceJournal:
        """Every source consumed here, its batches applied at once."""
        return LOCAL_SOURCES

    async def submit(self, kind: str, body: bytes, args: Args) -> object:
        m = mutation(kind)  # refused before the ingest thread sees it
        result: object = await self.thread.run(m.apply, self.host, args)
        return result

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass
