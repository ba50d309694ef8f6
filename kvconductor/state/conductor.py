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
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, TypedDict, TypeVar, cast, overload

import zmq

from kvconductor._hash import DEFAULT_SEED, lora_seed
from kvconductor.errors import IndexUpdateError, InvalidBlockSequence, ParentBlockNotFound
from kvconductor.index import Index
from kvconductor.ingest.freshness import FreshnessTable
from kvconductor.ingest.host import IngestSettings
from kvconductor.ingest.http_events import REMOVED, STORED, EventOp
from kvconductor.ingest.liveness import READY_STATES, SOURCE_CHECK_SECS, SOURCE_DOWN, SOURCE_PURGE
from kvconductor.ingest.stats import Limits
from kvconductor.ingest.thread import IngestThread
from kvconductor.keys import WorkerKey
from kvconductor.logs import RecentWarnings
from kvconductor.schema import (
    DEFAULT_TENANT,
    EXPLAIN_TIERS,
    STOP_MUTED,
    STOP_NO_FIRST_BLOCK,
    ExplainInstance,
    ExplainLoss,
    ExplainResponse,
    ExplainSource,
    ExplainTier,
    ExplainWorker,
    KvEventBatch,
    RegisterRequest,
    SourceNotReady,
    UnregisterRequest,
)
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
from kvconductor.state.registry import RegistrationError, Registry
from kvconductor.urls import UrlPolicy

if TYPE_CHECKING:
    from typing_extensions import TypeVarTuple, Unpack

    from kvconductor.state.shared import SharedIndexes

    _Ts = TypeVarTuple("_Ts")

#: Source states in which ``GET /ready`` counts a ZeroMQ source as ready.

log = logging.getLogger("kvconductor")

_T = TypeVar("_T")

__all__ = [
    "Conductor",
    "ConductorConfig",
    "InstanceNotRegistered",
    "RegistrationError",
    "RegistrationUnavailable",
    "SKIP_REASONS",
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
    #: Seconds after a lost batch before blocks not announced again are dropped.
    loss_grace: float = 600.0
    #: Seconds a whole vLLM replay may take before it counts as a loss.
    replay_deadline: float = 60.0
    #: Seconds a source may be not ready before its HBM hits stop counting.
    source_down: float = SOURCE_DOWN
    #: Seconds a source may be not ready before its HBM blocks are dropped (0: never).
    source_purge: float = SOURCE_PURGE
    #: ZeroMQ subscriptions (one per registered instance, DP and URL) at most; more: 503.
    max_sources: int = 4096
    #: Bounds on one ZeroMQ message and one engine source (refused whole, counted).
    limits: Limits = field(default_factory=Limits)
    #: Which endpoint URLs registrations may name (bind mode, ipc://, networks).
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)


# ---------------------------------------------------------------------------------------
# Errors the HTTP layer maps to status codes
# ---------------------------------------------------------------------------------------


#: Why a registration of a loaded snapshot or dump was skipped
#: (:mod:`kvconductor.state.restore`): the current flags refuse its URLs
#: (``--endpoint-networks``, ``--allow-ipc-endpoints``, ``--allow-bind-endpoints``, or any
#: other validation), ``--max-sources`` is reached, or a subscription cannot be opened now
#: (a bind-mode port in use, no file descriptor).
SKIP_REASONS = ("refused", "max_sources", "unavailable")


class RegistrationUnavailable(RuntimeError):
    """A registration the server cannot take now (HTTP 503); nothing was changed.
    :attr:`reason`: ``max_sources`` (the ``--max-sources`` limit) or ``unavailable``
    (a subscription cannot be opened now: a bind-mode port in use, no file descriptor)."""

    def __init__(self, message: str, reason: str = "unavailable") -> None:
        super().__init__(message)
        self.reason = reason


class StateUnavailable(RuntimeError):
    """``--state-url``: the state store cannot be reached or did not confirm a change in
    time (HTTP 503; kvconductor.state.replica)."""


class InstanceNotRegistered(LookupError):
    """An /events batch for an instance that is not registered (HTTP 404, nothing applied).

    The reference created a (model, tenant) index for it from ``model_name``:
    an index no unregistration could ever remove.
    """

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"instance {instance_id} not found")


def _error_text(ex: IndexUpdateError) -> str:
    """The reference's message of an index error (docs/api.md, "Validation and answers");
    details go to the log."""
    if isinstance(ex, ParentBlockNotFound):
        return "parent block not found"
    if isinstance(ex, InvalidBlockSequence):
        return "invalid block sequence"
    return str(ex)


class EventsOutcome(NamedTuple):
    applied: int
    errors: list[str]


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

    cfg = conductor.config
    settings = IngestSettings(
        loss_grace=cfg.loss_grace,
        replay_deadline=cfg.replay_deadline,
        source_down=cfg.source_down,
        source_purge=cfg.source_purge,
        limits=cfg.limits,
    )
    return SubscriptionManager(thread, conductor, settings=settings, shared=conductor.shared)


# ---------------------------------------------------------------------------------------
# Resources
# ---------------------------------------------------------------------------------------

#: ZeroMQ sockets per subscription: the SUB, and the PAIR pair of its monitor.
SOCKETS_PER_SOURCE = 3
#: File descriptors per subscription: one per socket (its mailbox) and its TCP connection.
FDS_PER_SOURCE = 4
#: File descriptors of the process itself (listener, epoll, logs, threads), with room to spare.
FD_HEADROOM = 256


def zmq_context(max_sources: int) -> zmq.Context:
    """A ZeroMQ context sized for ``max_sources`` subscriptions (plus replay DEALERs).

    libzmq's default of 1023 sockets capped a process at 341 subscriptions.
    """
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, SOCKETS_PER_SOURCE * max_sources + 256)
    return ctx


def fds_needed(max_sources: int, max_connections: int = 1024) -> int:
    """Open files the process needs: subscriptions, HTTP connections, headroom."""
    return FDS_PER_SOURCE * max_sources + max_connections + FD_HEADROOM


def open_file_limits() -> tuple[int | None, int | None]:
    """The soft and hard ``RLIMIT_NOFILE`` (``None``: unlimited, or not POSIX)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None, None
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (None if soft == inf else soft), (None if hard == inf else hard)


def raise_fd_limit(max_sources: int, max_connections: int) -> int | None:
    """Raise the soft ``RLIMIT_NOFILE`` for ``--max-sources`` and ``--max-connections``
    (docs/operations.md, "Open files"); both ``kv-conductor`` and the gunicorn app call it
    at start. Returns the soft limit after the change (``None``: unlimited or not POSIX).

    Like Go's runtime, the soft limit is raised to the hard limit (to
    :func:`fds_needed` when the hard limit is unlimited). When it stays below what is
    needed, one WARN says so; the HTTP connection cap is then fitted by
    :func:`kvconductor.serve.single.fit_connection_cap`.
    """
    soft, hard = open_file_limits()
    if soft is None:
        return None
    import resource

    needed = fds_needed(max_sources, max_connections)
    preferred = needed if hard is None else hard
    # Fallbacks for a system that refuses the preferred value (a soft limit above
    # OPEN_MAX, say): what is needed, then at least the HTTP connections.
    targets: list[int] = []
    for t in (preferred, needed, max_connections + FD_HEADROOM):
        if soft < t and (hard is None or t <= hard) and t not in targets:
            targets.append(t)
    error = None
    for target in targets:
        try:
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (target, resource.RLIM_INFINITY if hard is None else hard)
            )
        except (ValueError, OSError) as ex:
            error = error or ex
            continue
        log.info("raised the open-file limit from %d to %d", soft, target)
        soft = target
        break
    else:
        if error is not None:
            log.warning(
                "could not raise the open-file limit from %d to %d: %s", soft, preferred, error
            )
    if soft < needed:
        log.warning(
            "open-file limit %d is below the %d that --max-sources needs; "
            "registrations past the limit will be refused with 503",
            soft,
            needed,
        )
    return soft


# ---------------------------------------------------------------------------------------
# The conductor
# ---------------------------------------------------------------------------------------


#: Seconds between two :func:`trim_heap` calls of the ingest thread.
TRIM_SECS = 10.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``; a no-op
    elsewhere).

    PERF: engine messages wait in ZeroMQ's queue while the ingest thread catches up, and
    are freed once applied; glibc keeps the freed pages (in the middle of its heaps,
    where its automatic trimming never looks), so after a burst the process stayed about
    as large as the burst: 158 B of RSS per (worker, block) for 57 B of index after 1M
    blocks, 50 B with this every 10 s (docs/performance.md, "Server memory"). A few
    milliseconds on the ingest thread."""
    if _TRIM is not None:
        _TRIM(0)


#: glibc ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: :func:`tune_malloc`: blocks below this come from the heap, and the heap's top shrinks
#: only past this much free memory (the periodic :func:`trim_heap` still returns it).
MALLOC_KEEP_BYTES = 32 << 20


def tune_malloc() -> bool:
    """Keep large short-lived buffers in glibc's heap (server processes, at start).

    PERF: an answer listing 7,000 (instance, DP) rows is a 0.6-0.8 MB ``bytes``; with
    glibc's defaults each one came from fresh pages (an mmap, or a heap top trimmed
    after the previous free), ~270 page faults per query: 4-6 ms on the development
    machine against 0.4 ms to encode it (docs/performance.md, "Answers with thousands of
    holders"). With both thresholds at :data:`MALLOC_KEEP_BYTES` the freed pages are
    reused; :func:`trim_heap` every ``TRIM_SECS`` still gives them back when idle.
    False (nothing changed) without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)
    )


class _LossFields(TypedDict, total=False):
    losses: int
    degraded_since: float | None
    last_loss: ExplainLoss | None
    dropped: dict[str, int]


def _loss_fields(info: SourceInfo | None) -> _LossFields:
    """The loss and drop fields of an :class:`ExplainSource` from a ``/workers`` source."""
    if info is None:
        return {}
    loss = info.get("last_loss")
    return {
        "losses": int(info.get("losses") or 0),
        "degraded_since": info.get("degraded_since"),
        "last_loss": None if loss is None else ExplainLoss(at=loss["at"], why=loss["why"]),
        "dropped": dict(info.get("dropped") or {}),
    }


class WorkersDoc(TypedDict, total=False):
    """``GET /workers`` (docs/api.md)."""

    workers: list[JSONObject]
    indexer: list[dict[str, object]]
    sources: list[SourceInfo]
    recent_warnings: list[dict[str, str]]
    replica: ReplicaInfo
    processes: JSONObject


def _source_warnings(s: ExplainSource, label: str, now: float) -> list[str]:
    """``/explain`` warnings of one source: not ready, degraded by a loss (and why),
    events dropped (``parent_not_found``: blocks chained to batches it never received)."""
    out = []
    if s.state not in ("live", "degraded"):
        out.append(f"{label} is {s.state}")
    if s.state == "degraded" and s.last_loss is not None:
        out.append(
            f"{label} is degraded: {s.last_loss.why} ({now - s.last_loss.at:.0f}s ago); the "
            "blocks it held then count until they age out unless announced again"
        )
    if s.dropped:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.dropped.items()))
        line = f"{label} dropped events ({reasons})"
        if "parent_not_found" in s.dropped:
            line += (
                ": parent_not_found events store blocks after a parent block this source "
                "never announced (it was lost, or published before the subscription "
                "connected); those blocks are not indexed"
            )
        out.append(line)
    return out


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
    ) -> None:
        """``journal``: builds the journal every HTTP mutation goes through (default: a
        :class:`~kvconductor.state.journal.LocalJournal`, applied at once on the ingest
        thread; ``--state-url``: a :class:`~kvconductor.state.replica.ValkeyJournal`).
        ``snapshotter``: builds the ``--snapshot-dir`` writer (default: none).
        ``shared``: ``--workers N``'s shared arena, lock and directory (default: one
        process, private memory). ``processes``: ``--workers N``, the owner's view of
        its worker processes for ``/workers``. ``subscriptions``: builds the ZeroMQ
        subscriptions at start (default: the real ones). Features that can only be made
        after the conductor are handed in with :meth:`attach_journal` and
        :meth:`attach_snapshotter`."""
        self.config = config or ConductorConfig()
        self.thread = thread or IngestThread(context=zmq_context(self.config.max_sources))
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
        self._last_trim = time.monotonic()

    # -- optional features made after the conductor -----------------------------------
    def attach_journal(self, journal: Journal) -> None:
        """Send every HTTP mutation through ``journal`` from now on (before the HTTP
        server serves: ``--state-url``'s :class:`~kvconductor.state.replica.ValkeyJournal`
        is made for a started conductor)."""
        self.journal = journal

    def attach_snapshotter(self, snapshotter: Snapshots) -> None:
        """``--snapshot-dir``: the writer of this conductor's snapshots (made once the
        directory is locked and its newest snapshot loaded)."""
        self.snapshotter = snapshotter

    @property
    def replicator(self) -> Replica | None:
        """``--state-url``: the replicated journal's status (None: this process alone
        holds the state)."""
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
                self._drop_index(key)

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
    async def mutate(self, kind: str, body: bytes, /, *args: object) -> object:
        """An HTTP mutation: ``kind`` (``register``, ``unregister``, ``events``: the
        table :data:`kvconductor.state.journal.MUTATIONS`) of the request ``body`` parsed
        into ``args``, through :attr:`journal`. Alone: applied at once on the ingest
        thread. With ``--state-url``: ``body`` is appended to the replicated log, and what
        applying it did here is returned (every replica applies it), or
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

    def _drop_index(self, key: tuple[str, str]) -> None:
        """Forget the index of ``key`` (ingest thread). With ``--workers N`` the directory
        without it is published first, then its shared state is freed."""
        idx = self.indexes.pop(key)
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
        """Register (or re-register) one DP of an instance (docs/api.md, POST /register).

        Raises :class:`RegistrationError` (HTTP 400) before changing anything.
        """
        log.info(
            "register request instance_id=%s dp_rank=%d type=%s modelname=%s tenant_id=%s "
            "block_size=%d store_backend=%s medium_endpoints=%s endpoint=%s "
            "replay_endpoint=%s",
            req.instance_id,
            req.dp_rank,
            req.engine_type,
            req.modelname,
            req.tenant_id or DEFAULT_TENANT,
            req.block_size,
            req.store_backend,
            req.medium_endpoints or {},
            req.endpoint,
            req.replay_endpoint,
        )
        saved = self.registry.save_dp(req.instance_id, req.dp_rank)
        out = self.registry.register(req)  # validates before changing anything
        if out.unchanged:
            # The Coordinator's repair path and periodic re-register timer resend what we
            # have: keep the live subscriptions (no batch lost, no replay).
            log.info(
                "re-registration unchanged; subscriptions kept instance_id=%s dp_rank=%d",
                req.instance_id,
                req.dp_rank,
            )
            self.get_or_create_index(out.model_name, out.tenant_id)
            self._registrations_changed()
            return
        # Subscriptions first: the only step that can fail for want of resources. On a
        # failure everything is put back as it was and the request gets a 503.
        opened = self._subscribe_or_roll_back(req, out, saved)
        for ip in out.ips_removed:
            if ip not in out.ips_added:
                log.info(
                    "HBM IP removed from index ip=%s instance_id=%s dp_rank=%d",
                    ip,
                    out.instance_id,
                    out.dp_rank,
                )
        if out.drop_from is not None:
            old = self.indexes.get(out.drop_from)
            dropped = old.remove_dp(out.instance_id, out.dp_rank) if old is not None else 0
            log.info(
                "registration changed; dropped old data instance_id=%s dp_rank=%d "
                "model=%s tenant=%s blocks=%d",
                out.instance_id,
                out.dp_rank,
                out.drop_from[0],
                out.drop_from[1],
                dropped,
            )
        for ip in out.ips_added:
            log.info(
                "HBM IP indexed for pool auto-attach ip=%s instance_id=%s dp_rank=%d",
                ip,
                out.instance_id,
                out.dp_rank,
            )
        self.get_or_create_index(out.model_name, out.tenant_id)
        self._registrations_changed()
        self._follow()
        if out.drop_from is not None:
            self._reclaim(out.drop_from)
        if out.replay is not None and out.replay.url in opened:
            # A new subscription: catch up from the engine's replay buffer. A URL that was
            # already subscribed kept its socket and lost nothing.
            self.subs.request_replay(out.replay)
        log.info(
            "worker registered instance_id=%s dp_rank=%d model=%s tenant=%s subscribers=%d "
            "is_pool=%s replay=%s",
            out.instance_id,
            out.dp_rank,
            out.model_name,
            out.tenant_id,
            len(out.contexts),
            out.is_pool,
            out.replay is not None,
        )
        entry = self.registry.get(out.instance_id)
        ep = entry.endpoints.get(out.dp_rank) if entry is not None else None
        if ep is not None and ep.node_pool:
            log.info(
                "node pool instance_id=%s node_ip=%s model=%s tenant=%s serves %d DP(s) now",
                out.instance_id,
                ep.node_ip,
                out.model_name,
                out.tenant_id,
                len(self.registry.node_pool_dps(ep)),
            )

    def _subscribe_or_roll_back(self, req: RegisterRequest, out, saved: tuple) -> set[str]:
        """Replace (instance, DP)'s subscriptions by ``out.contexts`` (returns the URLs
        opened), or undo everything and raise :class:`RegistrationUnavailable`."""
        iid, dp = req.instance_id, req.dp_rank
        current = self.subs.count(iid, dp)
        total = len(self.subs) - current + len(out.contexts)
        if total > self.config.max_sources:
            self.registry.restore_dp(saved)
            msg = (
                f"source limit reached: this registration needs {len(out.contexts)} "
                f"ZeroMQ subscription(s) and {len(self.subs) - current} of at most "
                f"{self.config.max_sources} are in use (--max-sources)"
            )
            log.warning("registration refused instance_id=%s dp_rank=%d: %s", iid, dp, msg)
            raise RegistrationUnavailable(msg, "max_sources")
        if out.reregistered:
            log.info("re-registering existing worker instance_id=%s dp_rank=%d", iid, dp)
        if not out.contexts and not current:
            return set()  # HTTP-only, and was: no sockets to touch
        try:
            # URLs kept keep their sockets (no batch lost); new ones open first.
            opened = self.subs.replace(iid, dp, out.contexts)
        except (zmq.ZMQError, OSError) as ex:
            self.registry.restore_dp(saved)
            msg = f"cannot open a ZeroMQ subscription now ({ex}); nothing was registered. " + (
                "Raise the process's open-file limit or lower --max-sources"
                if ex.errno in (errno.EMFILE, errno.ENFILE)
                else "Check the endpoint (a bind-mode port may be in use by another process) "
                "and register again"
            )
            log.error("registration rolled back instance_id=%s dp_rank=%d: %s", iid, dp, msg)
            raise RegistrationUnavailable(msg) from None
        return opened

    def unregister(self, req: UnregisterRequest) -> bool:
        """Unregister one DP; False when the instance is unknown (404).

        See docs/api.md, POST /unregister.
        """
        log.info("unregister request instance_id=%s dp_rank=%d", req.instance_id, req.dp_rank)
        n = self.subs.unsubscribe(req.instance_id, req.dp_rank)
        out = self.registry.unregister(req.instance_id, req.dp_rank)
        if not out.found:
            log.info("unregister: instance not found instance_id=%s", req.instance_id)
            return False
        self._registrations_changed()
        self._follow()
        for ip in out.ips_removed:
            log.info(
                "HBM IP removed from index ip=%s instance_id=%s dp_rank=%d",
                ip,
                req.instance_id,
                req.dp_rank,
            )
        # Every index, not only the registered one: a pool event naming another (model,
        # tenant) credits the DP there (issue 36: it kept appearing in those answers, and
        # registered again its old and new blocks added up).
        per_index = self._remove_dp_everywhere(req.instance_id, req.dp_rank)
        for key in {*per_index, *(() if out.index_key is None else (out.index_key,))}:
            self._reclaim(key)
        others = {k: v for k, v in per_index.items() if k != out.index_key}
        log.info(
            "worker unregistered instance_id=%s dp_rank=%d subscribers_stopped=%d blocks=%d "
            "instance_removed=%s%s",
            req.instance_id,
            req.dp_rank,
            n,
            sum(per_index.values()),
            out.instance_removed,
            "".join(f" blocks[{m}/{t}]={v}" for (m, t), v in sorted(others.items())),
        )
        return True

    def _remove_dp_everywhere(self, instance_id: str, dp_rank: int) -> dict[tuple[str, str], int]:
        """Drop (instance, DP)'s blocks and pending waits from every index holding a worker
        of it; the blocks removed per index (O(indexes))."""
        out: dict[tuple[str, str], int] = {}
        for key, idx in list(self.indexes.items()):
            if idx.workers_of(instance_id, dp_rank):
                out[key] = idx.remove_dp(instance_id, dp_rank)
        return out

    def note_lora(self, model: str, tenant: str, seed: int) -> None:
        """An event stored blocks of the LoRA adapter of hash seed ``seed`` (ingest thread)."""
        key = (model, tenant)
        seen = self.lora_seeds.get(key)
        if seen is None or seed not in seen:
            self.lora_seeds[key] = (seen or frozenset()) | {seed}
            self._directory_changed()

    def _registrations_changed(self) -> None:
        """Take :attr:`registrations` and :attr:`block_sizes` from the registry's counts
        (ingest thread; after a registration or unregistration, O(indexes))."""
        self.registry_generation += 1
        block_sizes = self.registry.block_sizes()
        changed = block_sizes != self.block_sizes
        self.block_sizes = block_sizes
        self.registrations = self.registry.registrations
        if changed:
            self._directory_changed()

    def _follow(self) -> None:
        """A registration changed: the snapshot writer (``--snapshot-dir``) writes one
        within about a second (coalesced), so a restart keeps it even before the next
        periodic snapshot."""
        if self.snapshotter is not None:
            self.snapshotter.nudge()

    def _reclaim(self, key: tuple[str, str]) -> bool:
        """Drop the index of ``key`` if it is empty and no registration refers to it."""
        idx = self.indexes.get(key)
        if idx is None or key in self.registry.protected() or not idx.is_empty():
            return False
        self._drop_index(key)
        log.debug("indexer removed model=%s tenant=%s", key[0], key[1])
        return True

    # -- /events (ingest thread) --------------------------------------------------------------
    def apply_events(self, batch: KvEventBatch, ops: list[EventOp]) -> EventsOutcome:
        """Apply validated events per dp_rank group (docs/api.md, "Validation and answers").

        A failing group stops at its first error and contributes 0 to the
        applied count; other groups still apply. Raises
        :class:`InstanceNotRegistered` (nothing applied) for an unknown instance.
        """
        if batch.shutdown:
            log.info("shutdown flag set in events batch instance_id=%s", batch.instance_id)
        entry = self.registry.get(batch.instance_id)
        if entry is None:
            raise InstanceNotRegistered(batch.instance_id)
        applied = 0
        errors: list[str] = []
        i = 0
        while i < len(ops):
            dp = ops[i].dp_rank
            j = i
            while j < len(ops) and ops[j].dp_rank == dp:
                j += 1
            group = ops[i:j]
            i = j
            ep = entry.endpoints.get(dp)
            model = batch.model_name or (ep.model_name if ep else entry.model_name)
            tenant = batch.tenant_id or (ep.tenant_id if ep else entry.tenant_id)
            idx = self.get_or_create_index(model, tenant or DEFAULT_TENANT)
            try:
                for op in group:
                    if op.seed != DEFAULT_SEED and op.tokens is not None:
                        self.note_lora(idx.model, idx.tenant, op.seed)
                    self._apply_op(idx, batch.instance_id, op)
            except IndexUpdateError as ex:
                log.debug(
                    "event group failed instance_id=%s dp_rank=%d detail=%s",
                    batch.instance_id,
                    dp,
                    ex,
                )
                errors.append(f"dp_rank={dp}: {_error_text(ex)}")
                continue
            except Exception as ex:  # reported, never fatal to the thread
                log.exception(
                    "failed to apply events instance_id=%s dp_rank=%d", batch.instance_id, dp
                )
                errors.append(f"dp_rank={dp}: internal error: {ex}")
                continue
            applied += len(group)
        self.http_events_applied += applied
        if errors:
            log.warning(
                "failed to apply events instance_id=%s applied=%d errors=%s",
                batch.instance_id,
                applied,
                errors,
            )
        return EventsOutcome(applied, errors)

    @staticmethod
    def _apply_op(idx: Index, instance_id: str, op: EventOp) -> None:
        key = WorkerKey(instance_id, op.backend_id or instance_id, op.dp_rank, op.medium)
        if op.kind == STORED:
            if op.tokens is not None:
                idx.store_tokens(
                    key, op.parent, op.engine_hashes, op.tokens, op.block_size, op.seed
                )
            else:
                assert op.local_hashes is not None  # normalize_event gives one or the other
                idx.store(key, op.parent, op.engine_hashes, op.local_hashes)
        elif op.kind == REMOVED:
            idx.remove(key, op.engine_hashes)
        else:
            idx.clear(key)

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
        every :data:`TRIM_SECS`, freed heap memory back to the system (:func:`trim_heap`)."""
        if self._stopping:
            return
        now = time.monotonic()
        if now - self._last_trim >= TRIM_SECS:
            self._last_trim = now
            trim_heap()
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
                self._drop_index(key)
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

    def _explain_sources(self, instance_id: str, dp_rank: int, now: float) -> list[ExplainSource]:
        """The ZeroMQ subscriptions of (instance, DP), from its registration (ingest thread)."""
        entry = self.registry.get(instance_id)
        ep = entry.endpoints.get(dp_rank) if entry is not None else None
        if ep is None:
            return []
        infos = {
            s["url"]: s
            for s in self.sources()
            if s["instance_id"] == instance_id and s["dp_rank"] == dp_rank
        }
        out = []
        for url, media in ep.sources:
            info = infos.get(url)
            sub = self.subs.get(instance_id, dp_rank, url) if info is not None else None
            last = sub.stats.last_event if sub is not None else None
            out.append(
                ExplainSource(
                    url=url,
                    media=[m.display.lower() for m in media],
                    is_pool=ep.is_pool,
                    state=str(info.get("state", "unknown")) if info is not None else "closed",
                    connected=bool(info.get("connected")) if info is not None else False,
                    events=int(info.get("events") or 0) if info is not None else 0,
                    blocks=int(info.get("blocks") or 0) if info is not None else 0,
                    last_event_age_s=round(max(0.0, now - last), 3) if last else -1.0,
                    **_loss_fields(info),
                )
            )
        return out

    def explain(
        self, model: str, tenant: str, block_size: int, tokens, lora_name: str | None
    ) -> ExplainResponse:
        """``POST /explain`` (ingest thread: a consistent view of the registry, the sources
        and the index): why each (instance, DP) of (model, tenant) matches what it does
        for this query (docs/api.md, POST /explain)."""
        now = time.time()
        key = (model, tenant)
        idx = self.indexes.get(key)
        seed = lora_seed(lora_name) if lora_name else DEFAULT_SEED
        nblocks = (len(tokens) + block_size - 1) // block_size
        sizes = sorted(self.block_sizes.get(key, ()))
        registered: dict[tuple[str, int], int] = {}
        pool_sources: list[ExplainSource] = []
        for iid in sorted(self.registry.instances):
            for dp, ep in sorted(self.registry.instances[iid].endpoints.items()):
                if ep.index_key != key:
                    continue
                if ep.is_pool:
                    pool_sources += self._explain_sources(iid, dp, now)
                else:
                    registered[(iid, dp)] = ep.block_size
        groups = (
            {(g.instance_id, g.dp_rank): g for g in idx.trace(tokens, block_size, seed)}
            if idx
            else {}
        )
        warnings: list[str] = []
        if idx is None:
            warnings.append(
                f"no index for model={model} tenant={tenant}: no registration names this "
                "(model, tenant) and no events were published for it; compare with the "
                "modelname and tenant_id the engines registered (GET /workers)"
            )
        # NOTE: the block size mismatch sentence is /query's, added by the HTTP resource.
        instances: list[ExplainInstance] = []
        hits = False
        for gk in sorted(set(registered) | {k for k, g in groups.items() if sum(g.held)}):
            iid, dp = gk
            g = groups.get(gk)
            if g is None:
                tiers = {t: ExplainTier(0, 0, "no_worker", 0) for t in EXPLAIN_TIERS}
                workers: list[ExplainWorker] = []
                blocks = (0, 0, 0)
            else:
                blocks = g.blocks
                tiers = {
                    t: ExplainTier(g.blocks[i], g.reach[i], g.stops[i], g.held[i])
                    for i, t in enumerate(EXPLAIN_TIERS)
                }
                workers = [
                    ExplainWorker(
                        w.key.medium.display.lower(), w.key.backend_id, w.held, w.reach, w.stop
                    )
                    for w in g.workers
                ]
            hits = hits or sum(blocks) > 0
            sources = self._explain_sources(iid, dp, now)
            if gk not in registered:
                warnings.append(
                    f"instance {iid} DP {dp} holds blocks in this index but no registration "
                    "names that DP of this (model, tenant): its data comes from a publisher "
                    "registered under another DP rank, model or tenant (DP rank r publishes on "
                    "the registered port + r)"
                )
            elif g is None or not sum(g.held):
                quiet = [s.url for s in sources if not s.events]
                why = (
                    f"; no events arrived from {', '.join(quiet)} (check the engine publishes "
                    "there: DP rank r publishes on port + r)"
                    if quiet
                    else ""
                )
                warnings.append(f"instance {iid} DP {dp} holds no blocks in any tier{why}")
            if any(w.stop == STOP_MUTED for w in workers):
                warnings.append(
                    f"instance {iid} DP {dp} is muted: a source of it has been down longer than "
                    "--source-down-secs, so its blocks give no hits until the source is back"
                )
            for s in sources:
                warnings += _source_warnings(s, f"source {s.url} of instance {iid} DP {dp}", now)
            instances.append(
                ExplainInstance(
                    instance_id=iid,
                    dp_rank=dp,
                    registered=gk in registered,
                    block_size=registered.get(gk),
                    npu_blocks=blocks[0],
                    cpu_blocks=blocks[1],
                    disk_blocks=blocks[2],
                    tiers=tiers,
                    workers=workers,
                    sources=sources,
                )
            )
        if idx is not None and nblocks and not hits:
            first = [g for g in groups.values() if g.stops[0] == STOP_NO_FIRST_BLOCK]
            if first:
                warnings.append(
                    "no block of this index starts with the query's first block: check "
                    "block_size, lora_name (LoRA blocks are hashed with the adapter's seed, "
                    "so base-model and adapter blocks never match each other) and that the "
                    "token ids are the engine's (same tokenizer, chat template and BOS token)"
                )
        for s in pool_sources:
            warnings += _source_warnings(s, f"pool source {s.url}", now)
        sizes_now = idx.sizes() if idx is not None else {}
        offload = int(sizes_now.get("offload", 0))
        pending = int(sizes_now.get("pending", 0))
        if offload:
            warnings.append(
                f"{offload} block(s) offloaded by engines to CPU/Disk await a pool's "
                "confirmation: they join the CPU/Disk tiers only when a pool publishes them"
            )
        if pending:
            warnings.append(
                f"{pending} pool confirmation(s) await the engine's offload event of the same block"
            )
        return ExplainResponse(
            model=model,
            tenant=tenant,
            lora_name=lora_name or None,
            index_found=idx is not None,
            block_size=block_size,
            registered_block_sizes=sizes,
            query_blocks=nblocks,
            offload_pending=offload,
            pool_pending=pending,
            warnings=warnings,
            instances=instances,
            pool_sources=pool_sources,
        )
