"""The workers' metrics in the owner's ``/metrics`` (``kv-conductor --workers N``).

Each worker counts its queries in a :class:`~kvconductor.http.metrics.QueryMetrics` and
serves them on a UNIX socket in the owner's private directory
(:func:`serve_query_metrics`, one JSON document per connection); the owner fetches them
at each scrape (:func:`fetch_query_samples`, from :meth:`kvconductor.serve.owner.Owner.
worker_query_samples`) and sums them with its own. :class:`WorkerCollector` adds the
process and shared-lock families.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvconductor.http.metrics import QueryMetrics, Sample, query_samples

#: Seconds a worker has to hand its query metrics to the owner's ``/metrics``.
METRICS_TIMEOUT = 0.5
_CHUNK = 1 << 16


class Supervisor(Protocol):
    """What :class:`WorkerCollector` reads of the owner's supervision."""

    restarts: int
    #: The shared index (:class:`~kvconductor.state.shared.SharedIndexes`), or None.
    shared: Any

    def live_workers(self) -> int: ...

    @property
    def heartbeat_kills(self) -> int: ...


#: The shared index's metrics: (family, name, help, key of SharedIndexes.stats()).
_SHARED_METRICS = (
    (
        GaugeMetricFamily,
        "kvconductor_shared_arena_bytes",
        "Bytes of index structures in the shared arena (blocks in use, headers included)",
        "bytes_in_use",
    ),
    (
        GaugeMetricFamily,
        "kvconductor_shared_arena_committed_bytes",
        "Size of the shared arena's file (its pages are only counted once touched)",
        "committed",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_directory_publishes",
        "Directories (indexes, group names, block sizes, LoRA seeds) published to workers",
        "generation",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_reader_slots_reclaimed",
        "Reader slots of the shared lock cleared after their worker died",
        "reclaimed_reader_slots",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_writer_waits",
        "Waits of the ingest thread for worker queries inside a read section",
        "writer_waits",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_stalled_readers",
        "Worker reads of the shared index still running --reader-stall-ms after the ingest "
        "thread started waiting for them (stopped, frozen or swapping processes)",
        "stalled_readers",
    ),
    (
        CounterMetricFamily,
        "kvconductor_shared_readers_killed",
        "Worker processes killed (SIGKILL) for stalling a read of the shared index",
        "readers_killed",
    ),
)


class WorkerCollector(Collector):
    """``kvconductor_worker_processes``, ``kvconductor_worker_restarts_total``,
    ``kvconductor_worker_heartbeat_kills_total`` and the
    shared index's ``kvconductor_shared_*``."""

    def __init__(self, owner: Supervisor) -> None:
        self.owner = owner

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvconductor_worker_processes",
            "HTTP worker processes running and listening (kv-conductor --workers N)",
            value=self.owner.live_workers(),
        )
        yield CounterMetricFamily(
            "kvconductor_worker_restarts",
            "Worker processes started again after one exited",
            value=self.owner.restarts,
        )
        yield CounterMetricFamily(
            "kvconductor_worker_heartbeat_kills",
            "Worker processes killed (SIGKILL) for not answering the owner's heartbeat "
            "(stopped or frozen outside a read of the shared index)",
            value=self.owner.heartbeat_kills,
        )
        shared = self.owner.shared
        if shared is None:
            return
        st = shared.stats()
        for family, name, doc, key in _SHARED_METRICS:
            yield family(name, doc, value=st[key])
        hist = shared.wait_histogram()
        buckets = []
        total = 0
        for bound, count in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
            total += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
        yield HistogramMetricFamily(
            "kvconductor_shared_writer_wait_seconds",
            "How long each write section of the ingest thread waited for worker queries "
            "inside a read section of the shared index",
            buckets=buckets,
            sum_value=hist["sum"],
        )


def fetch_query_samples(path: str, timeout: float = METRICS_TIMEOUT) -> list[Sample]:
    """The query samples a worker serves on its metrics socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        chunks = []
        while True:
            data = sock.recv(_CHUNK)
            if not data:
                break
            chunks.append(data)
    rows = msgspec.json.decode(b"".join(chunks))
    return [(str(n), {str(k): str(x) for k, x in lab.items()}, float(v)) for n, lab, v in rows]


def serve_query_metrics(path: str, qm: QueryMetrics) -> None:
    """Serve :func:`~kvconductor.http.metrics.query_samples` of ``qm`` on the UNIX socket
    ``path`` (one JSON document per connection), in a daemon thread."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(METRICS_TIMEOUT)
                with contextlib.suppress(OSError):
                    conn.sendall(msgspec.json.encode(query_samples(qm)))

    threading.Thread(target=loop, name="query-metrics", daemon=True).start()
