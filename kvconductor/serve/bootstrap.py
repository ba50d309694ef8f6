"""The one composition root: :func:`build_service` builds what a kv-conductor process
serves from its settings and its role.

Four processes serve kv-conductor, and each starts with the same steps, done here once:

* ``single``: ``kv-conductor`` (:func:`kvconductor.serve.single.serve`): the conductor
  and the whole app in one process;
* ``owner``: ``kv-conductor --workers N`` (:func:`kvconductor.serve.owner.serve_owner`):
  the conductor, the shared index the workers read, the whole app on the owner's
  private socket, and the supervision of the workers;
* ``worker``: a worker of the owner (:func:`kvconductor.serve.worker.worker_main`): no
  conductor, the owner's index attached read-only, the front door over a forwarder;
* ``gunicorn``: ``kvconductor.app:gunicorn_app()``
  (:func:`kvconductor.serve.gunicorn.gunicorn_app`): as ``single``, the conductor
  started and stopped by the ASGI lifespan.

The steps: the process tuning (:func:`tune_process`: GIL switch interval, open-file
limit, glibc malloc), the :class:`~kvconductor.state.conductor.Conductor` and the
objects it is handed (the shared index, the snapshotter, the replicator: created here
and nowhere else), the metrics and the app, the start line of the log, and the start
and stop of the service (:meth:`Service.start`: warm start from ``--load-dump`` or the
snapshot directory, snapshots, replication; :meth:`Service.stop`). Binding sockets,
signals and the server loops stay with each process.

A start that fails raises :class:`StartFailed` after its ERROR line and its
``kv-conductor: error: ...`` line on stderr; the process exits with status 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, Protocol

from kvconductor import __version__
from kvconductor._shlock import SLOTS
from kvconductor.http.api import create_app, query_routes
from kvconductor.http.front import ASGIApp, FrontDoor
from kvconductor.http.metrics import Metrics, QueryMetrics, Sample
from kvconductor.ingest.replay import warn_slow_receive
from kvconductor.ingest.thread import IngestThread
from kvconductor.serve.proxy import Forwarder, OwnerClient, OwnerFreshness
from kvconductor.serve.settings import Settings
from kvconductor.serve.tuning import (
    INGEST_NICE,
    HeapTrim,
    raise_fd_limit,
    tune_malloc,
    zmq_context,
)
from kvconductor.serve.workermetrics import WorkerCollector
from kvconductor.state.conductor import Conductor
from kvconductor.state.enginefollow import EngineFollower
from kvconductor.state.journal import Journal
from kvconductor.state.protocols import QuerySource

log = logging.getLogger("kvconductor")

Role = Literal["single", "owner", "worker", "gunicorn"]

#: GIL switch interval of the serving process (seconds; Python's default is 0.005).
SWITCH_INTERVAL = 0.0005
#: Seconds the conductor gets to close subscriptions and stop the ingest thread.
STOP_SECS = 3.0
#: Threads of a worker answering large queries (the event loop answers the others).
WORKER_QUERY_THREADS = 2


class StartFailed(Exception):
    """The service cannot start; the reason was logged (ERROR) and printed on stderr."""


class Supervisor(Protocol):
    """The owner's supervision of its workers, as the service sees it
    (:class:`kvconductor.serve.owner.Owner`)."""

    restarts: int
    shared: Any

    @property
    def heartbeat_kills(self) -> int: ...

    def live_workers(self) -> int: ...

    def info(self) -> dict[str, Any]: ...

    def worker_query_samples(self) -> Iterable[Iterable[Sample]]: ...


def _fail(message: str) -> StartFailed:
    log.error("%s", message)
    print(f"kv-conductor: error: {message}", file=sys.stderr)
    return StartFailed(message)


def tune_process(settings: Settings, role: Role) -> None:
    """The GIL switch interval, the open-file limit and glibc's malloc of a process of
    ``role``."""
    # PERF: large queries hash and match in worker threads without the GIL, but hand it
    # back between steps; a short switch interval keeps the event loop's small queries
    # from waiting the default 5 ms for it.
    sys.setswitchinterval(SWITCH_INTERVAL)
    if role == "worker":
        raise_fd_limit(1, settings.max_connections)
    elif role == "owner":
        raise_fd_limit(settings.max_sources, settings.max_connections * settings.workers)
    else:
        raise_fd_limit(settings.max_sources, settings.max_connections)
    if role != "owner":
        tune_malloc()  # large answers reuse heap pages (kvconductor.serve.tuning.tune_malloc)


def new_conductor(settings: Settings, **features: Any) -> Conductor:
    """The service's conductor, with the process tuning it needs handed in: its ingest
    thread's ZeroMQ context sized for ``--max-sources``, the thread's lower priority in one
    process (:data:`~kvconductor.serve.tuning.INGEST_NICE`) and the periodic heap trim
    (:mod:`kvconductor.serve.tuning`); with ``--state-url``, the replicated journal
    (:func:`valkey_journal`: the HTTP mutations' and the ZeroMQ sources' journal).
    ``features``: the shared index and the owner's view of its workers
    (``--workers N``)."""
    config = settings.conductor_config()
    if settings.state_url:
        features["journal"] = valkey_journal(settings)
    # one process: the event loop gets the CPU first (never under --workers N's write sections)
    nice = 0 if features.get("shared") is not None else INGEST_NICE
    return Conductor(
        config,
        thread=IngestThread(context=zmq_context(config.max_sources), nice=nice),
        heap_trim=HeapTrim(),
        **features,
    )


def valkey_journal(settings: Settings) -> Callable[[Conductor], Journal]:
    """``--state-url``: builds the conductor's :class:`~kvconductor.state.replica.
    ValkeyJournal` (no I/O: its client connects on first use; :meth:`Service.start`
    starts it once the conductor runs)."""
    from kvconductor.state.replica import ReplicaSettings, ValkeyJournal

    assert settings.state_url is not None
    replication = ReplicaSettings(
        settings.state_url,
        password=settings.state_password,
        replica_id=settings.replica_id,
        lease_secs=settings.lease_secs,
        snapshot_interval=settings.snapshot_interval_secs,
    )
    return lambda conductor: ValkeyJournal(conductor, replication)


@dataclass(eq=False)
class Service:
    """What :func:`build_service` built: the app to serve and, but in a worker, the
    conductor with its start and stop."""

    settings: Settings
    role: Role
    app: Any
    conductor: Conductor | None = None
    _: KW_ONLY
    #: ``owner``: the supervision of the workers.
    supervisor: Supervisor | None = None
    #: ``worker``: the way to the owner (its pool is closed at the end).
    forwarder: Forwarder | None = None
    #: ``worker``: the queries it answered, which the owner's ``/metrics`` sums.
    query_metrics: QueryMetrics | None = None
    #: ``worker``: its view of the shared index (None: the queries are forwarded too).
    view: QuerySource | None = None
    #: The registrations with an ``engine_url`` followed (started with the conductor).
    follower: EngineFollower | None = None

    def log_start(self, address: str | None = None, gunicorn_workers: int | None = None) -> None:
        """The start line: ``KV conductor starting on <address> ...`` (under gunicorn:
        ``... under gunicorn pid=<pid> workers=<gunicorn_workers>``)."""
        s = self.settings
        if self.role != "worker":
            warn_slow_receive()
        if self.role == "owner":
            log.info(
                "KV conductor starting on %s workers=%d reader_stall=%dms version=%s %s "
                "switch_interval=%s",
                address,
                s.workers,
                s.reader_stall_ms,
                __version__,
                s.describe(),
                sys.getswitchinterval(),
            )
        elif self.role == "gunicorn":
            log.info(
                "KV conductor starting under gunicorn pid=%d workers=%s version=%s %s "
                "switch_interval=%s",
                os.getpid(),
                gunicorn_workers,
                __version__,
                s.describe(),
                sys.getswitchinterval(),
            )
        elif self.role == "single":
            log.info(
                "KV conductor starting on %s version=%s %s switch_interval=%s",
                address,
                __version__,
                s.describe(),
                sys.getswitchinterval(),
            )

    def start(self) -> bool:
        """Start the conductor, load ``--load-dump`` or the newest snapshot of the
        snapshot directory (locked first: one server per directory), start the snapshot
        thread and the replication; False (logged, conductor stopped again) when the dump
        cannot be loaded, the directory is another server's, or a ``--snapshot-dir``
        cannot be used (the default directory that cannot be used is a WARN: the service
        runs without snapshots). A worker has nothing to start."""
        conductor = self.conductor
        if conductor is None:
            return True
        settings = self.settings
        conductor.start()
        if settings.load_dump:
            try:
                _warm_start(conductor, settings.load_dump)
            except Exception as ex:  # one line, never a traceback
                why = ex if isinstance(ex, OSError | ValueError) else f"{type(ex).__name__}: {ex}"
                log.error(
                    "cannot load dump %s: %s (fix or remove --load-dump to start)",
                    settings.load_dump,
                    why,
                )
                conductor.stop(STOP_SECS)
                return False
        if settings.snapshot_warning:
            log.warning("%s", settings.snapshot_warning)
        elif not (settings.snapshot_dir or settings.state_url or settings.load_dump):
            log.info(
                "no snapshots (snapshots=off): registrations and indexes are kept in memory "
                "only; after a restart they are gone until the Coordinator registers again, "
                "and cluster pools (Mooncake/Memcache), which it does not register again, "
                "until it restarts"
            )
        if settings.snapshot_dir and not self._start_snapshots(conductor):
            conductor.stop(STOP_SECS)
            return False
        # --state-url: the ValkeyJournal handed in at construction bootstraps the started
        # conductor and starts its threads (a LocalJournal has nothing to start)
        conductor.journal.start()
        self.follower = EngineFollower(conductor)
        self.follower.start()
        return True

    def _start_snapshots(self, conductor: Conductor) -> bool:
        from kvconductor.state import snapshot

        settings = self.settings
        assert settings.snapshot_dir is not None
        store = snapshot.SnapshotStore(settings.snapshot_dir)
        try:
            store.prepare(wait=settings.snapshot_lock_wait)
        except snapshot.DirectoryInUse as ex:
            msg = (
                f"{ex}: give this server its own directory (--snapshot-dir DIR) or run it "
                "without snapshots (--no-snapshots)"
            )
            log.error("%s", msg)
            print(f"kv-conductor: error: {msg}", file=sys.stderr)
            return False
        except OSError as ex:
            if not settings.snapshot_default:
                log.error("cannot use snapshot directory %s: %s", settings.snapshot_dir, ex)
                return False
            log.warning(
                "cannot use the default snapshot directory %s: %s; running without "
                "snapshots: a restart starts cold (give --snapshot-dir DIR, or "
                "--no-snapshots to run without them on purpose)",
                settings.snapshot_dir,
                ex,
            )
            return True
        if snapshot.warm_start(conductor, store) is None:
            log.info("no usable snapshot in %s: starting empty", settings.snapshot_dir)
        # Attached once the directory is locked and loaded.
        snapshotter = snapshot.Snapshotter(conductor, store, settings.snapshot_interval_secs)
        conductor.attach_snapshotter(snapshotter)
        snapshotter.start()
        return True

    def run(
        self,
        serve: Callable[[], object],
        release: Callable[[], object],
        stopped: str,
        logger: logging.Logger = log,
    ) -> int:
        """Serves HTTP (``serve``: the server's run) until it ends; then lets go of what
        the entry point holds (``release``: its listening sockets, the owner's workers),
        stops the service (:meth:`stop`) and logs ``stopped`` on ``logger``. Returns 0,
        the exit status."""
        try:
            serve()
        finally:
            release()
            self.stop()
            logger.info(stopped)
        return 0

    def stop(self) -> None:
        """After the HTTP server stopped: the last snapshot (and the snapshot directory's
        lock let go), the replication, then the conductor; a worker's pool of
        connections to the owner."""
        if self.forwarder is not None:
            self.forwarder.owner.close()
        conductor = self.conductor
        if conductor is None:
            return
        if self.follower is not None:
            self.follower.stop()
        if conductor.snapshotter is not None:
            conductor.snapshotter.stop(final=True)
        conductor.journal.stop()
        if not conductor.stop(STOP_SECS):
            log.warning("ingest thread did not stop within %ss", STOP_SECS)


def serving_app(conductor: Conductor, settings: Settings, **extra: Any) -> Any:
    """The app kv-conductor serves over ``conductor`` with ``settings``' HTTP flags
    (``extra``: more :func:`~kvconductor.http.api.create_app` arguments)."""
    return create_app(
        conductor,
        max_body_bytes=settings.max_body_bytes,
        api_key=settings.api_key,
        fast_query=True,
        allow_origins=settings.allow_origins,
        open_workers=settings.open_workers,
        **extra,
    )


def create_worker_app(
    owner_socket: str,
    *,
    max_body_bytes: int,
    allow_origins: Iterable[str] = (),
    query_handler: ASGIApp | None = None,
    query_metrics: QueryMetrics | None = None,
    routes: dict | None = None,
) -> FrontDoor:
    """The ASGI app of a worker: the front door over a forwarder to the owner at
    ``owner_socket`` (:class:`~kvconductor.serve.proxy.Forwarder`: body limit, 413 and
    503 as there). ``GET /health`` is answered here (``OK``).

    ``routes``: the query routes answered here (:func:`kvconductor.http.api.query_routes`
    over the shared view; default none: the queries are forwarded too).
    ``query_handler``: an ASGI callable for the query routes instead (a test seam).
    ``query_metrics``: counts a chunked query body past the limit refused here (the
    routes count the rest).
    """
    rest = Forwarder(
        OwnerClient(owner_socket),
        max_body_bytes=max_body_bytes,
        allow_origins=allow_origins,
        query_metrics=query_metrics,
    )
    # date: the worker's uvicorn adds no Date (the owner's answers carry theirs)
    return FrontDoor(
        rest, routes, max_body_bytes, query_handler=query_handler, health=True, date=True
    )


def build_service(
    settings: Settings,
    role: Role,
    *,
    supervise: Callable[[Any], Supervisor] | None = None,
    owner_socket: str | None = None,
    shared_fds: tuple[int, ...] = (),
) -> Service:
    """Build the service of a process of ``role`` from ``settings`` (module doc).

    ``owner``: ``supervise(shared)`` makes the supervision of the workers once the shared
    index exists (:class:`kvconductor.serve.owner.Owner`). ``worker``: the owner's socket
    and the shared index's descriptors (``--shared-fds``; fewer than two: the queries are
    forwarded too). Raises :class:`StartFailed`.
    """
    tune_process(settings, role)
    if role == "worker":
        assert owner_socket is not None
        return _build_worker(settings, owner_socket, shared_fds)
    if role == "owner":
        assert supervise is not None
        return _build_owner(settings, supervise)
    conductor = new_conductor(settings)
    if role == "gunicorn":
        service = Service(settings, role, None, conductor)
        service.app = serving_app(
            conductor, settings, manage_lifecycle=True, lifecycle=(service.start, service.stop)
        )
        return service
    return Service(settings, role, serving_app(conductor, settings), conductor)


def _build_owner(settings: Settings, supervise: Callable[[Any], Supervisor]) -> Service:
    readers = settings.workers * (1 + WORKER_QUERY_THREADS)
    if readers > SLOTS:
        raise _fail(
            f"--workers {settings.workers} needs {readers} reader slots of the shared index "
            f"(1 + {WORKER_QUERY_THREADS} query threads per worker); at most {SLOTS} exist: "
            f"use --workers {SLOTS // (1 + WORKER_QUERY_THREADS)} or fewer"
        )
    from kvconductor.state.shared import SharedIndexes

    try:
        shared = SharedIndexes()
    except OSError as ex:
        log.error("cannot create the shared index arena: %s", ex)
        print(f"kv-conductor: error: cannot create the shared index arena: {ex}", file=sys.stderr)
        raise StartFailed(str(ex)) from None
    shared.set_stall_policy(settings.reader_stall_ms, kill=True)
    supervisor = supervise(shared)
    # Handed in at construction: the shared index and the workers' view of /workers.
    conductor = new_conductor(settings, shared=shared, processes=supervisor.info)
    metrics = Metrics(
        conductor,
        other_queries=supervisor.worker_query_samples,
        extra=[WorkerCollector(supervisor)],
    )
    app = serving_app(conductor, settings, metrics=metrics)
    # Its clients are the workers: a worker closes the connection itself after an answer
    # given before the body (the owner closing while it still writes could reset it).
    app.close_early = False
    return Service(settings, "owner", app, conductor, supervisor=supervisor)


def _build_worker(settings: Settings, owner_socket: str, shared_fds: tuple[int, ...]) -> Service:
    query_metrics = QueryMetrics()
    routes, view = None, None
    if len(shared_fds) >= 2:
        # /query and /query_by_hash answered here, from the owner's index in shared memory
        from kvconductor.state.shared import SharedView

        try:
            view = SharedView.attach(
                shared_fds[0], shared_fds[1], query_threads=WORKER_QUERY_THREADS
            )
        except (OSError, RuntimeError, ValueError) as ex:
            log.error("cannot attach the shared index: %s", ex)
            raise StartFailed(str(ex)) from None
        view.freshness_source = OwnerFreshness(owner_socket)
        routes = query_routes(view, max_body_bytes=settings.max_body_bytes, metrics=query_metrics)
        log.info(
            "shared index attached at %#x (directory generation %d)",
            view.arena.address,
            view.generation,
        )
    app = create_worker_app(
        owner_socket,
        max_body_bytes=settings.max_body_bytes,
        allow_origins=settings.allow_origins,
        query_metrics=query_metrics,
        routes=routes,
    )
    forwarder = app.rest
    assert isinstance(forwarder, Forwarder)
    return Service(
        settings, "worker", app, forwarder=forwarder, query_metrics=query_metrics, view=view
    )


def _warm_start(conductor: Conductor, path: str) -> None:
    """``--load-dump``: load ``path`` on the ingest thread before serving."""
    from kvconductor.state import dump

    t0 = time.monotonic()
    dump.verify(dump.file_chunks(path))  # a damaged file changes nothing
    loaded = conductor.call(dump.load_dump, conductor, dump.file_chunks(path), timeout=None)
    for s in conductor.call(conductor.workers)["indexer"]:
        log.info(
            "dump loaded model=%s tenant=%s hbm_blocks=%d cpu_blocks=%d disk_blocks=%d "
            "offload=%d pending_pool=%d content=%d",
            s["model_name"],
            s["tenant_id"],
            s["hbm_blocks"],
            s["cpu_blocks"],
            s["disk_blocks"],
            s["offload"],
            s["pending_pool"],
            s["content"],
        )
    log.info(
        "warm start from %s: registrations=%d indexes=%d skipped=%d in %.3fs",
        path,
        loaded["registrations"] - loaded["skipped"],
        loaded["indexes"],
        loaded["skipped"],
        time.monotonic() - t0,
    )
