"""The conductor core: registry + one index per (model, tenant) + the single writer.

:class:`Conductor` owns the :class:`~kvconductor.ingest.thread.IngestThread`.
**Every mutation runs on that thread**: registration and unregistration
(registry, HBM-IP index, subscriptions, index clean-up), HTTP ``/events``, the
periodic maintenance sweep, and the ``/workers`` snapshot (so it never sees a
half-applied change). HTTP handlers reach it with ``await conductor.run(fn,
...)``; the HTTP mutations go through the conductor's journal
(:meth:`Conductor.mutate`, :mod:`kvconductor.state.journal`), which applies them there
(one process) or logs them for every replica (``--state-url``). Queries do not go
through the thread: :meth:`Conductor.get_index` is a
plain dict lookup and :class:`~kvconductor.index.Index` is safe for
concurrent readers.

Subscriptions (ZeroMQ SUB sockets, replay) are delegated to
``kvconductor.ingest.subscriber.SubscriptionManager``. It calls back
:meth:`Conductor.get_or_create_index`, :meth:`Conductor.hbm_ip_lookup` and
:meth:`Conductor.instance_info`, on the ingest thread.

The conductor's jobs that have a room of their own: registration and unregistration
(:mod:`kvconductor.state.registration`), ``POST /events`` (:mod:`kvconductor.state.events`)
and ``POST /explain``'s document (:mod:`kvconductor.state.explain`); each runs on the
ingest thread with what the conductor hands it. The process tuning (open files, the
ZeroMQ context's size, glibc malloc, the periodic heap trim) is the serving process's
(:mod:`kvconductor.serve.tuning`): the composition root hands the conductor its ingest
thread and its heap trim.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar, cast, overload

import zmq

from kvconductor.index import Index
from kvconductor.ingest.freshness import FreshnessTable
from kvconductor.ingest.host import IngestSettings
from kvconductor.ingest.http_events import EventOp
from kvconductor.ingest.liveness import READY_STATES, SOURCE_CHECK_SECS
from kvconductor.ingest.thread import IngestThread
from kvconductor.logs import RecentWarnings
from kvconductor.predict import PredictionLimits, Predictions
from kvconductor.schema import (
    ExplainResponse,
    KvEventBatch,
    PredictRecord,
    RegisterRequest,
    SourceNotReady,
    UnregisterRequest,
)
from kvconductor.state.events import (
    DpNotRegistered,
    EventsOutcome,
    InstanceNotRegistered,
    apply_events,
)
from kvconductor.state.explain import ExplainState, explain
from kvconductor.state.journal import Journal, LocalJournal
from kvconductor.state.protocols import (
    JSONObject,
    NoSubscriptions,
    Replica,
    ReplicaInfo,
    Snapshots,
    SourceInfo,
    Subscriptions,
)
from kvconductor.state.registration import (
    SKIP_REASONS,
    RegistrationUnavailable,
    register,
    unregister,
)
from kvconductor.state.registry import RegistrationError, Registry
from kvconductor.urls import UrlPolicy

if TYPE_CHECKING:
    from typing_extensions import TypeVarTuple, Unpack

    from kvconductor.state.shared import SharedIndexes

    _Ts = TypeVarTuple("_Ts")

log = logging.getLogger("kvconductor")

_T = TypeVar("_T")

# The errors the HTTP layer maps to status codes are importable from here too (their
# rooms: ``registry``, ``registration``, ``events``).
__all__ = [
    "Conductor",
    "ConductorConfig",
    "DpNotRegistered",
    "EventsOutcome",
    "InstanceNotRegistered",
    "RegistrationError",
    "RegistrationUnavailable",
    "SKIP_REASONS",
    "StateUnavailable",
]


@dataclass
class ConductorConfig:
    """Runtime settings of the core (the CLI flags, docs/operations.md "Starting it")."""

    maintenance_interval: float = 30.0
    pending_ttl: float = 60.0
    content_ttl: float = 300.0
    offload_ttl: float = 600.0
    #: ``"c"`` / ``"py"`` / ``None`` (Index picks; env ``KVCONDUCTOR_IMPL``).
    index_impl: str | None = None
    #: Worker threads for large queries (parse + hash + match off the event loop).
    query_threads: int = 2
    #: The ZeroMQ sources' settings: loss grace, replay deadline, down and purge times,
    #: the bounds on one message and one source (handed to the subscriptions as is).
    ingest: IngestSettings = field(default_factory=IngestSettings)
    #: ZeroMQ subscriptions (one per registered instance, DP and URL) at most; more: 503.
    max_sources: int = 4096
    #: Which endpoint URLs registrations may name (bind mode, ipc://, networks).
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)
    #: The routers' predictions (``POST /predict``): TTL (0: off) and bounds.
    predictions: PredictionLimits = field(default_factory=PredictionLimits)


# ---------------------------------------------------------------------------------------
# Errors the HTTP layer maps to status codes
# ---------------------------------------------------------------------------------------


class StateUnavailable(RuntimeError):
    """``--state-url``: the state store cannot be reached or did not confirm a change in
    time (HTTP 503; kvconductor.state.replica)."""


# ---------------------------------------------------------------------------------------
# Subscriptions
# ---------------------------------------------------------------------------------------


#: Builds a conductor's subscriptions on its ingest thread, at start.
SubscriptionsFactory = Callable[[IngestThread, "Conductor"], Subscriptions]
#: Builds an optional feature that needs the conductor (its journal, its snapshotter).
JournalFactory = Callable[["Conductor"], Journal]
SnapshotsFactory = Callable[["Conductor"], Snapshots]


def _default_subscriptions(thread: IngestThread, conductor: Conductor) -> Subscriptions:
    # Imported here, not at the top: the subscriber imports the ingest package, which
    # tests load without a conductor. An ImportError is never swallowed: a service
    # without its ZeroMQ ingest would answer 0 hits for every engine and say nothing.
    from kvconductor.ingest.subscriber import SubscriptionManager

    return SubscriptionManager(
        thread,
        conductor,
        settings=conductor.config.ingest,
        shared=conductor.shared,
        journal=conductor.journal.sources,
    )


class WorkersDoc(TypedDict, total=False):
    """``GET /workers`` (docs/api.md)."""

    workers: list[JSONObject]
    indexer: list[dict[str, object]]
    sources: list[SourceInfo]
    recent_warnings: list[dict[str, str]]
    replica: ReplicaInfo
    processes: JSONObject


class Conductor:
    """Registry, indexes per (model, tenant), the ingest thread and the maintenance timer.

    Methods documented "ingest thread" must run there (``await self.run(fn,
    ...)`` from async code, ``self.call(fn, ...)`` from plain threads).
    """

    def __init__(
        self,
        config: ConductorConfig | None = None,
        *,
        thread: IngestThread | None = None,
        subscriptions: SubscriptionsFactory | None = None,
        journal: JournalFactory | None = None,
        snapshotter: SnapshotsFactory | None = None,
        shared: SharedIndexes | None = None,
        processes: Callable[[], JSONObject] | None = None,
        heap_trim: Callable[[float], None] | None = None,
    ) -> None:
        """``journal``: builds the journal every HTTP mutation goes through (default: a
        :class:`~kvconductor.state.journal.LocalJournal`, applied at once on the ingest
        thread; ``--state-url``: a :class:`~kvconductor.state.replica.ValkeyJournal`).
        ``snapshotter``: builds the ``--snapshot-dir`` writer (default: none).
        ``shared``: ``--workers N``'s shared arena, lock and directory (default: one
        process, private memory). ``processes``: ``--workers N``, the owner's view of
        its worker processes for ``/workers``. ``subscriptions``: builds the ZeroMQ
        subscriptions at start (default: the real ones). ``thread``: the ingest thread
        (the service's has a ZeroMQ context sized for ``--max-sources``,
        :func:`kvconductor.serve.tuning.zmq_context`; default: a thread with a context
        of its own, of libzmq's default size). ``heap_trim``: called on the ingest thread
        with ``time.monotonic()`` on every source check (the service's gives freed heap
        memory back to the system, :class:`kvconductor.serve.tuning.HeapTrim`; default:
        none). The journal's source role (``journal.sources``) is handed to the
        subscriptions when they are made; the snapshotter, which can only be made once
        the snapshot directory is loaded, is handed in with :meth:`attach_snapshotter`."""
        self.config = config or ConductorConfig()
        self.thread = thread or IngestThread(context=zmq.Context())
        self.registry = Registry(self.config.url_policy)
        #: (model, tenant) -> Index. Mutated on the ingest thread; read anywhere.
        self.indexes: dict[tuple[str, str], Index] = {}
        #: While the state is being replaced by a snapshot's (a replica's bootstrap), the
        #: indexes it had: queries are answered from them until the new ones are in place
        #: (:meth:`get_index`), never a 404 for an index that exists before and after.
        self.replacing: dict[tuple[str, str], Index] | None = None
        #: The ZeroMQ subscriptions (made on the ingest thread at :meth:`start`; none
        #: before).
        self.subs: Subscriptions = NoSubscriptions()
        self._subs_factory = subscriptions or _default_subscriptions
        self._started = False
        self._stopped = False
        self._stopping = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: Registered (instance, DP) pairs; replaced by the ingest thread, read anywhere.
        self.registrations = 0
        #: +1 on every registration change (ingest thread; read anywhere): readers that
        #: keep something derived from the registry know when to derive it again.
        self.registry_generation = 0
        #: (model, tenant) -> the block sizes registered for it (query miss reasons);
        #: a new dict is swapped in on every change, read anywhere.
        self.block_sizes: dict[tuple[str, str], frozenset[int]] = {}
        #: (model, tenant) -> hash seeds of the LoRA adapters events stored blocks of (query
        #: miss reasons); grown on the ingest thread by swapping in a new frozenset.
        self.lora_seeds: dict[tuple[str, str], frozenset[int]] = {}
        #: Events applied through POST /events since start (ingest thread; metrics).
        self.http_events_applied = 0
        #: Two-phase entries expired unmatched (ingest thread; metrics): engine offloads no
        #: pool confirmed, pool confirmations no engine offload came for.
        self.expired = {"offload": 0, "pool_confirmation": 0}
        #: Registrations of a loaded snapshot or dump skipped, by reason (ingest thread;
        #: metrics; :mod:`kvconductor.state.restore`).
        self.skipped_registrations = dict.fromkeys(SKIP_REASONS, 0)
        self._expiry_warned: dict[tuple[str, str, str], float] = {}
        #: The last WARN+ records of the process's ``kvconductor`` loggers (``/workers``),
        #: collected between start() and stop().
        self.recent_warnings = RecentWarnings()
        #: ``--workers N``: the shared arena, lock and directory (see
        #: :mod:`kvconductor.state.shared`). None: one process, private memory.
        self.shared: SharedIndexes | None = shared
        #: ``--workers N``: the owner's view of its worker processes and the shared lock
        #: for ``/workers`` (``processes``; any thread). None: one process.
        self.processes: Callable[[], JSONObject] | None = processes
        #: The path of every HTTP mutation (:mod:`kvconductor.state.journal`).
        self.journal: Journal = (
            journal(self) if journal is not None else LocalJournal(self, self.thread)
        )
        #: ``--snapshot-dir``: the :class:`kvconductor.state.snapshot.Snapshotter` (None: off).
        self.snapshotter: Snapshots | None = snapshotter(self) if snapshotter is not None else None
        self._heap_trim = heap_trim
        #: The routers' live predictions (``POST /predict``; ingest thread).
        self.predictions = Predictions(self.config.predictions)
        self._prediction_sweep = False

    # -- optional features made after the conductor -----------------------------------
    def attach_snapshotter(self, snapshotter: Snapshots) -> None:
        """``--snapshot-dir``: the writer of this conductor's snapshots (made once the
        directory is locked and its newest snapshot loaded)."""
        self.snapshotter = snapshotter

    @property
    def replicator(self) -> Replica | None:
        """``--state-url``: the replicated journal's status (None: this process alone
        holds the state): the one "is there a replica" of ``/ready``, ``/workers`` and
        ``/metrics``."""
        return self.journal.replica

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the ingest thread, the subscription manager and the maintenance timer."""
        if self._started:
            return
        self._started = True
        self.recent_warnings.install()
        if not self.thread.is_alive():
            self.thread.start()
        self.thread.call(self._start_on_thread)

    def _start_on_thread(self) -> None:
        if self.shared is not None:
            self.shared.install()
            self.shared.publish(self)
        self.subs = self._subs_factory(self.thread, self)
        self.thread.call_later(self.interval, self._maintenance_tick)
        self.thread.call_later(SOURCE_CHECK_SECS, self._source_tick)

    @property
    def interval(self) -> float:
        """Effective maintenance period: ``max(1, n)`` seconds (``--maintenance-interval-secs``)."""
        return max(1.0, float(self.config.maintenance_interval))

    def stop(self, timeout: float = 5.0) -> bool:
        """Close subscriptions, stop the ingest thread; True when it exited in time."""
        if self._stopped:
            return True
        self._stopped = True
        ok = True
        if self._started and self.thread.is_alive():
            deadline = time.monotonic() + timeout
            try:
                self.thread.call(self._stop_on_thread, timeout=timeout)
            except Exception:  # shutdown must go on
                log.exception("closing subscriptions failed")
            ok = self.thread.stop(max(0.1, deadline - time.monotonic()))
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.recent_warnings.uninstall()
        return ok

    def _stop_on_thread(self) -> None:
        self._stopping = True
        self.subs.close()
        if self.shared is not None:
            # unpublish and free every shared index while this is still the writer thread
            for key in list(self.indexes):
                self.drop_index(key)

    async def run(self, fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts]) -> _T:
        """Await ``fn(*args)`` on the ingest thread."""
        result: _T = await self.thread.run(fn, *args)
        return result

    @overload
    async def mutate(
        self, kind: Literal["register"], body: bytes, req: RegisterRequest, /
    ) -> None: ...
    @overload
    async def mutate(
        self, kind: Literal["unregister"], body: bytes, req: UnregisterRequest, /
    ) -> bool: ...
    @overload
    async def mutate(
        self, kind: Literal["events"], body: bytes, batch: KvEventBatch, ops: list[EventOp], /
    ) -> EventsOutcome: ...
    @overload
    async def mutate(self, kind: Literal["predict"], body: bytes, rec: PredictRecord, /) -> int: ...
    async def mutate(self, kind: str, body: bytes, /, *args: object) -> object:
        """An HTTP mutation: ``kind`` (``register``, ``unregister``, ``events``,
        ``predict``: the table :data:`kvconductor.state.journal.MUTATIONS`) of the request
        ``body`` parsed into ``args``, through :attr:`journal`. Alone: applied at once on
        the ingest thread. With ``--state-url``: ``body`` is appended to the replicated
        log, and what applying it did here is returned (every replica applies it), or
        :class:`StateUnavailable` raised."""
        return await self.journal.submit(kind, body, args)

    def call(
        self, fn: Callable[[Unpack[_Ts]], _T], *args: Unpack[_Ts], timeout: float | None = 30.0
    ) -> _T:
        """Run ``fn(*args)`` on the ingest thread and wait (plain threads, tests)."""
        result: _T = self.thread.call(fn, *args, timeout=timeout)
        return result

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Worker threads for large queries (created on first use)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, self.config.query_threads), thread_name_prefix="kv-query"
            )
        return self._executor

    # -- readers (any thread) ------------------------------------------------------------------
    def get_index(self, model: str, tenant: str) -> Index | None:
        """The index of (model, tenant), or None (query: 404)."""
        idx = self.indexes.get((model, tenant))
        if idx is None:
            old = self.replacing
            if old is not None:
                return old.get((model, tenant))
        return idx

    def freshness(self, model: str, tenant: str) -> FreshnessTable:
        """The states behind (model, tenant)'s answers (any thread)."""
        return self.subs.freshness.table(model, tenant)

    # -- callbacks for subscribers (ingest thread) ------------------------------------------------
    def get_or_create_index(self, model: str, tenant: str) -> Index:
        """The index of (model, tenant), created on first use (ingest thread)."""
        key = (model, tenant)
        idx = self.indexes.get(key)
        if idx is None:
            idx = self.indexes[key] = Index(model, tenant, impl=self.config.index_impl)
            log.debug("indexer created model=%s tenant=%s", model, tenant)
            if self.shared is not None:
                idx.on_new_group = self._directory_changed
                self.shared.publish(self)
        return idx

    def _directory_changed(self) -> None:
        """``--workers N``: publish what workers name answers with (ingest thread): an
        index, a group, the block sizes or LoRA seeds changed."""
        if self.shared is not None:
            self.shared.publish(self)

    def drop_index(self, key: tuple[str, str]) -> None:
        """Forget the index of ``key`` (ingest thread). With ``--workers N`` the directory
        without it is published first, then its shared state is freed."""
        idx = self.indexes.pop(key)
        self.predictions.drop_index(idx)
        if self.shared is not None:
            self.shared.publish(self)
            idx.close()

    def hbm_ip_lookup(self, ip: str) -> list[tuple[str, int]]:
        """(instance_id, dp_rank) pairs registered with HBM endpoints on ``ip``."""
        return self.registry.hbm_ip_lookup(ip)

    def context_dps(
        self, model: str, tenant: str, block_size: int, lora_name: str | None = None
    ) -> list[tuple[str, int]]:
        """The engine (instance, DP)s registered in (model, tenant) with ``block_size``
        (and of adapter ``lora_name``, or of any, when it is given)."""
        return self.registry.context_dps(model, tenant, block_size, lora_name)

    def instance_info(self, instance_id: str) -> dict[str, object] | None:
        """Registered model/tenant/block_size/store_backend/endpoints of an instance."""
        entry = self.registry.get(instance_id)
        return None if entry is None else entry.info()

    # -- registration (ingest thread) ---------------------------------------------------------
    def register(self, req: RegisterRequest) -> None:
        """Register (or re-register) one DP of an instance (docs/api.md, POST /register;
        :func:`kvconductor.state.registration.register`).

        Raises :class:`RegistrationError` (HTTP 400) before changing anything,
        :class:`RegistrationUnavailable` (HTTP 503) when its subscriptions cannot be
        opened (nothing changed).
        """
        register(self, req, self.config.max_sources)

    def unregister(self, req: UnregisterRequest) -> bool:
        """Unregister one DP; False when the instance is unknown (404).

        See docs/api.md, POST /unregister (:func:`kvconductor.state.registration.unregister`).
        """
        return unregister(self, req)

    def note_lora(self, model: str, tenant: str, seed: int) -> None:
        """An event stored blocks of the LoRA adapter of hash seed ``seed`` (ingest thread)."""
        key = (model, tenant)
        seen = self.lora_seeds.get(key)
        if seen is None or seed not in seen:
            self.lora_seeds[key] = (seen or frozenset()) | {seed}
            self._directory_changed()

    def registrations_changed(self) -> None:
        """Take :attr:`registrations` and :attr:`block_sizes` from the registry's counts
        (ingest thread; after a registration or unregistration, O(indexes))."""
        self.registry_generation += 1
        block_sizes = self.registry.block_sizes()
        changed = block_sizes != self.block_sizes
        self.block_sizes = block_sizes
        self.registrations = self.registry.registrations
        if changed:
            self._directory_changed()

    def follow(self) -> None:
        """A registration changed: the snapshot writer (``--snapshot-dir``) writes one
        within about a second (coalesced), so a restart keeps it even before the next
        periodic snapshot."""
        if self.snapshotter is not None:
            self.snapshotter.nudge()

    def reclaim(self, key: tuple[str, str]) -> bool:
        """Drop the index of ``key`` if it is empty and no registration refers to it."""
        idx = self.indexes.get(key)
        if idx is None or key in self.registry.protected() or not idx.is_empty():
            return False
        self.drop_index(key)
        log.debug("indexer removed model=%s tenant=%s", key[0], key[1])
        return True

    # -- /events (ingest thread) --------------------------------------------------------------
    def apply_events(self, batch: KvEventBatch, ops: list[EventOp]) -> EventsOutcome:
        """Apply validated events per dp_rank group (:func:`kvconductor.state.events.
        apply_events`): a failing group stops at its first error and contributes 0 to the
        applied count; :class:`InstanceNotRegistered` (nothing applied) for an unknown
        instance."""
        out = apply_events(self.registry, self.get_or_create_index, self.note_lora, batch, ops)
        self.http_events_applied += out.applied
        return out

    # -- /predict (ingest thread) -------------------------------------------------------------
    def predict(self, rec: PredictRecord) -> int:
        """Hold a router's prediction (docs/api.md, POST /predict): the blocks predicted.
        :class:`InstanceNotRegistered` for an instance no registration names,
        :class:`DpNotRegistered` for a dp_rank it does not register."""
        entry = self.registry.get(rec.instance_id)
        if entry is None:
            raise InstanceNotRegistered(rec.instance_id)
        if rec.dp_rank not in entry.endpoints:
            raise DpNotRegistered(rec.instance_id, rec.dp_rank, entry.endpoints)
        if not self.predictions.enabled or not rec.block_hashes:
            return 0
        idx = self.get_or_create_index(rec.model, rec.tenant_id)
        n = self.predictions.add(idx, rec.instance_id, rec.dp_rank, rec.block_hashes)
        if not self._prediction_sweep and not self._stopping:
            self._prediction_sweep = True
            self.thread.call_later(self.predictions.limits.ttl / 8, self._prediction_tick)
        return n

    def _prediction_tick(self) -> None:
        """Expire predictions every ``ttl / 8`` while some live (no timer otherwise)."""
        self.predictions.sweep()
        if self.predictions.live and not self._stopping:
            self.thread.call_later(self.predictions.limits.ttl / 8, self._prediction_tick)
        else:
            self._prediction_sweep = False

    # -- maintenance (ingest thread) ------------------------------------------------------------
    def _maintenance_tick(self) -> None:
        if self._stopping:
            return
        try:
            self.maintenance()
        finally:
            if not self._stopping:
                self.thread.call_later(self.interval, self._maintenance_tick)

    def _source_tick(self) -> None:
        """Dead engines: mute, unmute, purge (``SubscriptionManager.check_sources``);
        first the heap trim handed in (``heap_trim``), if any."""
        if self._stopping:
            return
        if self._heap_trim is not None:
            self._heap_trim(time.monotonic())
        try:
            self.subs.check_sources()
        except Exception:  # the next tick tries again; never kill the ingest thread
            log.exception("source check failed")
        finally:
            if not self._stopping:
                self.thread.call_later(SOURCE_CHECK_SECS, self._source_tick)

    def maintenance(self, now: float | None = None) -> int:
        """TTL sweeps on every index, then reclaim empty indexes no registration refers to
        (docs/api.md, "Differences from the reference": index reclaim)."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        pruned = 0
        for idx in list(self.indexes.values()):
            before = idx.sizes()
            pruned += idx.maintenance(now, cfg.pending_ttl, cfg.content_ttl, cfg.offload_ttl)
            after = idx.sizes()  # the sweep only removes; nothing else writes meanwhile
            self._expired(idx, "offload", before["offload"] - after["offload"], now)
            self._expired(idx, "pool_confirmation", before["pending"] - after["pending"], now)
        protected = self.registry.protected()
        reclaimed = 0
        for key, idx in list(self.indexes.items()):
            if key not in protected and idx.is_empty():
                self.drop_index(key)
                reclaimed += 1
        log.debug(
            "cache maintenance completed pruned=%d reclaimed=%d indexers=%d",
            pruned,
            reclaimed,
            len(self.indexes),
        )
        return pruned + reclaimed

    _EXPIRY_HINTS = {
        "offload": (
            "engine offloads to CPU/disk expired after {ttl:g}s without a pool "
            "confirmation, so they are not indexed: is the KV pool's publisher registered "
            "(medium_endpoints cpu/disk, store_backend) for the instances that offload?",
            "offload_ttl",
        ),
        "pool_confirmation": (
            "pool confirmations expired after {ttl:g}s without the engine's offload "
            "event, so they are not indexed: does the engine publish its CPU/disk "
            "offloads (its subscription has that medium)?",
            "pending_ttl",
        ),
    }

    def _expired(self, idx: Index, kind: str, n: int, now: float) -> None:
        """Count ``n`` expired two-phase entries; WARN at most once a minute per index."""
        if n <= 0:
            return
        self.expired[kind] += n
        key = (idx.model, idx.tenant, kind)
        last = self._expiry_warned.get(key)
        if last is not None and now - last < 60.0:
            return
        self._expiry_warned[key] = now
        text, ttl = self._EXPIRY_HINTS[kind]
        log.warning(
            "model=%s tenant=%s: %d %s",
            idx.model,
            idx.tenant,
            n,
            text.format(ttl=getattr(self.config, ttl)),
        )

    # -- introspection (ingest thread) ------------------------------------------------------------
    def readiness(self) -> tuple[int, list[SourceNotReady]]:
        """``GET /ready``: (ZeroMQ sources, those not ready). A source is ready when its
        SUB socket is connected and no replay of it is running (``live`` or ``degraded``)."""
        sources = self.sources()
        waiting = [
            SourceNotReady(s["instance_id"], s["dp_rank"], s["state"])
            for s in sources
            if s["state"] not in READY_STATES
        ]
        return len(sources), waiting

    def sources(self) -> list[SourceInfo]:
        """The subscriptions' ``/workers`` ``sources`` entries (ingest thread)."""
        return cast("list[SourceInfo]", self.subs.sources())

    def workers(self) -> WorkersDoc:
        """``GET /workers``: registrations, per-index summaries, subscription sources and
        the recent warnings of the process (oldest first)."""
        doc: WorkersDoc = {
            "workers": self.registry.snapshot(),
            "indexer": [self.indexes[k].summary() for k in sorted(self.indexes)],
            "sources": self.sources(),
            "recent_warnings": self.recent_warnings.snapshot(),
        }
        if self.replicator is not None:
            doc["replica"] = self.replicator.info()
        if self.processes is not None:
            doc["processes"] = self.processes()
        return doc

    def explain(
        self, model: str, tenant: str, block_size: int, tokens, lora_name: str | None, extras=None
    ) -> ExplainResponse:
        """``POST /explain`` (ingest thread: a consistent view of the registry, the sources
        and the index): why each (instance, DP) of (model, tenant) matches what it does
        for this query (docs/api.md, POST /explain; :mod:`kvconductor.state.explain`), with its
        ``extras`` (:class:`~kvconductor.extrakeys.QueryExtras` or None)."""
        state = ExplainState(
            self.registry,
            self.indexes,
            self.block_sizes,
            self.sources,
            self.subs,
            self.predictions,
        )
        return explain(state, model, tenant, block_size, tokens, lora_name, extras)
