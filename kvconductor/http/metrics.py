"""``GET /metrics``: Prometheus text exposition of one app (docs/api.md, GET /metrics).

Two kinds of metrics, in one :class:`~prometheus_client.CollectorRegistry` per app
(never the process-global one, so several apps in one process do not collide):

* **query metrics** (:class:`QueryMetrics`): a histogram and two counters moved by
  the query routes themselves, Falcon's and the front door's
  (:class:`~kvconductor.http.front.FrontDoor`): one ``observe`` and a few ``inc`` per
  request, label children bound once;
* **everything else** (:class:`ConductorCollector`): read at scrape time from what
  the service already counts (the subscriptions' ``SourceStats``, the conductor's
  registration summary and ``/events`` counter, each index's ``stats()`` taken under
  its read lock). The ingest path does no work for them, and a scrape takes no write
  lock and does nothing per block.

The per-source columns read into lines, the pauses of a large scrape and the writing of
the text are :mod:`kvconductor.http.columns`'.

**Threading:** a scrape may run on any thread (the app runs it in a worker thread so
a read lock held up by a large write never stalls the event loop).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvconductor import __version__
from kvconductor.http.columns import Pacer, RenderedFamily, SourceLines, exposition, help_text
from kvconductor.ingest.sourcemetrics import escape_label_value

if TYPE_CHECKING:
    from kvconductor.state.conductor import Conductor
    from kvconductor.state.protocols import Replica, SnapshotCounts

__all__ = [
    "CONTENT_TYPE",
    "ConductorCollector",
    "DeferredMetrics",
    "Metrics",
    "QueryMetrics",
    "QuerySumCollector",
    "merge_query_metrics",
    "query_samples",
]

#: One sample of a :class:`QueryMetrics` state as sent between processes:
#: ``(sample name, labels, value)``.
Sample = tuple[str, dict[str, str], float]

#: The classic text format (what ``generate_latest`` writes for these names, and what
#: every Prometheus reads); newer prometheus_client releases call theirs 1.0.0.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Buckets of ``kvconductor_query_seconds``: a cached query answers in tens of
#: microseconds, a 1M-token body in tens of milliseconds.
QUERY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
TIERS = ("npu", "cpu", "disk")
ROUTES = ("/query", "/query_by_hash")
MISS_REASONS = ("unknown_index", "block_size_mismatch", "unknown_lora", "no_match")


class _CounterChild:
    """One label child of a counter: a plain number (see :class:`QueryMetrics`)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value: float = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _HistogramChild:
    """One label child of a histogram: a count per bucket (not cumulative; the last one
    is ``+Inf``) and the sum (see :class:`QueryMetrics`)."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # ``le``: the first bound >= amount; bounds end with +Inf
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


#: Whether prometheus_client writes ``_created`` samples: its own rule, read from the
#: same environment variable, so the query families follow the same switch.
_USE_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true",
    "1",
    "t",
)


class _Family(Collector):
    """A counter or histogram family with fixed label children, rendered with the very
    samples (names, labels, order) prometheus_client's own ``Counter``/``Histogram``
    write."""

    def __init__(self, name: str, doc: str, kind: str, label: str, values: Iterable[str]):
        self.name = name
        self.doc = doc
        self.kind = kind
        self.label = label
        self.bounds = (*QUERY_BUCKETS, float("inf"))
        self.les = [floatToGoString(b) for b in self.bounds]
        self.children: dict[str, Any] = {
            v: _HistogramChild(self.bounds) if kind == "histogram" else _CounterChild()
            for v in values
        }
        self._prefixes: list[tuple[list[str], str, str, str]] | None = None

    def render(self) -> RenderedFamily:
        """The family as ``generate_latest`` writes it (the ``_created`` samples in a
        gauge family of their own after it, as there), each line's name and labels
        formatted once: only the values are formatted per scrape."""
        pre = self._prefixes
        if pre is None:
            pre = self._prefixes = self._make_prefixes()
        lines: list[str] = []
        created: list[str] = []
        for child, (values, count, total, made) in zip(self.children.values(), pre, strict=True):
            if self.kind == "counter":
                lines += (values[0], floatToGoString(child.value), "\n")
            else:
                acc = 0.0
                for head, n in zip(values, list(child.counts), strict=True):
                    acc += n
                    lines += (head, floatToGoString(acc), "\n")
                lines += (
                    count,
                    floatToGoString(acc),
                    "\n",
                    total,
                    floatToGoString(child.sum),
                    "\n",
                )
            created += (made, floatToGoString(child.created), "\n")
        if _USE_CREATED:
            doc = help_text(self.doc)
            name = self.name + "_created"
            lines += (f"# HELP {name} {doc}\n# TYPE {name} gauge\n", *created)
        return RenderedFamily(self.name, self.doc, self.kind, ["".join(lines).encode()])

    def _make_prefixes(self) -> list[tuple[list[str], str, str, str]]:
        """Per child: the ``name{labels} `` of its value lines (a counter's one, a
        histogram's buckets), of ``_count``, ``_sum`` and ``_created``."""
        out = []
        for value in self.children:
            ls = f'{self.label}="{escape_label_value(value)}"'
            if self.kind == "counter":
                values = [f"{self.name}_total{{{ls}}} "]
            else:  # "le" sorts before the label (generate_latest sorts label names)
                assert self.label > "le"
                values = [f'{self.name}_bucket{{le="{le}",{ls}}} ' for le in self.les]
            out.append(
                (
                    values,
                    f"{self.name}_count{{{ls}}} ",
                    f"{self.name}_sum{{{ls}}} ",
                    f"{self.name}_created{{{ls}}} ",
                )
            )
        return out

    def collect(self) -> Iterator[Metric]:
        created = _USE_CREATED
        fam = Metric(self.name, self.doc, self.kind)
        add = fam.add_sample
        for value, child in self.children.items():
            labels = {self.label: value}
            if self.kind == "counter":
                add(self.name + "_total", labels, child.value)
            else:
                acc = 0.0
                for le, n in zip(self.les, list(child.counts), strict=True):
                    acc += n
                    add(self.name + "_bucket", {**labels, "le": le}, acc)
                add(self.name + "_count", labels, acc)
                add(self.name + "_sum", labels, child.sum)
            if created:
                add(self.name + "_created", labels, child.created)
        yield fam


class _RenderedQueries(Collector):
    """The query families, each one :class:`RenderedFamily` (:meth:`_Family.render`)."""

    def __init__(self, families: Iterable[_Family]) -> None:
        self.families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for fam in self.families:
            yield fam.render()


class QueryMetrics:
    """The query routes' histogram and counters.

    **Threading: one writer, the event loop's thread; readers anywhere.** PERF: a child
    is a plain number (a list of bucket counts for the histogram), moved without a lock:
    ``observe`` is one ``bisect`` and two additions, ``inc`` one addition (~0.1-0.2 µs
    each; prometheus_client's take a lock per value and walk the buckets in Python).
    That is safe because every update runs on the event loop's thread: the front door,
    Falcon's resources and the forwarder run there, and a query answered on a worker
    thread (a large body) records its metrics through a :class:`DeferredMetrics` that
    the loop replays when the answer is back. A scrape on another thread reads each
    number whole; like prometheus_client's, a scrape is not one atomic snapshot of all
    of them. The families and samples written are exactly prometheus_client's
    (``_created`` included, with the same switch).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.seconds = _Family(
            "kvconductor_query_seconds",
            "Server-side time of a query request (body read, parse, hash, match, encode)",
            "histogram",
            "route",
            ROUTES,
        )
        self.blocks = _Family(
            "kvconductor_query_blocks",
            "Matched blocks returned by queries, summed over the answers' DP entries",
            "counter",
            "tier",
            TIERS,
        )
        self.misses = _Family(
            "kvconductor_query_misses",
            "Queries answered without any match, by reason",
            "counter",
            "reason",
            MISS_REASONS,
        )
        self.errors = _Family(
            "kvconductor_query_errors",
            "Query requests answered with an error other than 404 (400 bad body, 413 too "
            "large, 5xx)",
            "counter",
            "route",
            ROUTES,
        )
        if registry is not None:
            # PERF: the families rendered by themselves (_Family.render), not sample by
            # sample by generate_latest
            registry.register(_RenderedQueries(self.collectors()))
        self.route_seconds: dict[str, _HistogramChild] = self.seconds.children
        self.route_errors: dict[str, _CounterChild] = self.errors.children
        self._npu, self._cpu, self._disk = self.blocks.children.values()
        self.unknown_index, self.block_size_mismatch, self.unknown_lora, self.no_match = (
            self.misses.children.values()
        )

    def collectors(self) -> tuple[_Family, ...]:
        """The histogram and counters (each a prometheus_client collector)."""
        return (self.seconds, self.blocks, self.misses, self.errors)

    def count_hits(self, hits: Any) -> None:
        """Add the per-tier blocks of a non-empty answer: a ``QueryResult`` (its C sums,
        O(1) Python work whatever the number of rows) or a list of ``DpHit`` rows."""
        sums = getattr(hits, "sums", None)
        if sums is not None:
            n, c, d = sums()
        elif len(hits) == 1:  # PERF: the common answer, one DP
            _, _, n, c, d = hits[0]
        else:
            # PERF: column sums in C (zip/sum), no Python loop per DP entry.
            _, _, npu, cpu, disk = zip(*hits, strict=True)
            n, c, d = sum(npu), sum(cpu), sum(disk)
        self.count_blocks(n, c, d)

    def count_blocks(self, n: int, c: int, d: int) -> None:
        """Add ``n`` NPU, ``c`` CPU and ``d`` Disk blocks of one answer (its C sums)."""
        if n:
            self._npu.value += n
        if c:
            self._cpu.value += c
        if d:
            self._disk.value += d


class DeferredMetrics:
    """What a query answered off the event loop records, replayed on the loop
    (:meth:`replay`) so that :class:`QueryMetrics` keeps its one writer. It has the
    attributes of :class:`QueryMetrics` the answer moves (``count_blocks`` and the miss
    counters)."""

    def __init__(self) -> None:
        self.blocks: tuple[int, int, int] | None = None
        self.miss: str | None = None
        self.unknown_index = _DeferredMiss(self, "unknown_index")
        self.block_size_mismatch = _DeferredMiss(self, "block_size_mismatch")
        self.unknown_lora = _DeferredMiss(self, "unknown_lora")
        self.no_match = _DeferredMiss(self, "no_match")

    def count_blocks(self, n: int, c: int, d: int) -> None:
        self.blocks = (n, c, d)

    def replay(self, into: QueryMetrics) -> None:
        if self.blocks is not None:
            into.count_blocks(*self.blocks)
        if self.miss is not None:
            getattr(into, self.miss).inc()


class _DeferredMiss:
    __slots__ = ("name", "owner")

    def __init__(self, owner: DeferredMetrics, name: str) -> None:
        self.owner = owner
        self.name = name

    def inc(self, amount: float = 1) -> None:
        self.owner.miss = self.name


def query_samples(qm: QueryMetrics) -> list[Sample]:
    """The state of ``qm`` as plain samples (``_created`` timestamps left out), what a
    worker process of ``kv-conductor --workers N`` hands to the owner's ``/metrics``."""
    return [
        (s.name, dict(s.labels), float(s.value))
        for col in qm.collectors()
        for fam in col.collect()
        for s in fam.samples
        if not s.name.endswith("_created")
    ]


def _key(name: str, labels: dict[str, str]) -> tuple:
    return (name, tuple(sorted(labels.items())))


def merge_query_metrics(local: QueryMetrics, others: Iterable[Iterable[Sample]]) -> list[Metric]:
    """The families of ``local`` with the samples of ``others`` (:func:`query_samples`
    of other processes) added: histogram buckets, sums, counts and counters are summed
    sample by sample; ``_created`` stays ``local``'s. Samples ``local`` does not have
    (every label child of :class:`QueryMetrics` is bound at creation, so only from a
    different version) are ignored."""
    totals: dict[tuple, float] = {}
    for samples in others:
        for name, labels, value in samples:
            key = _key(name, labels)
            totals[key] = totals.get(key, 0.0) + value
    merged: list[Metric] = []
    for col in local.collectors():
        for fam in col.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                extra = 0.0 if s.name.endswith("_created") else totals.get(_key(s.name, s.labels))
                out.add_sample(s.name, s.labels, s.value + (extra or 0.0), s.timestamp)
            merged.append(out)
    return merged


class QuerySumCollector(Collector):
    """The query metrics of this process plus those of other processes, summed at
    scrape time (``kv-conductor --workers N``: the owner's ``/metrics`` shows the
    queries answered by every worker). ``others()`` returns their samples."""

    def __init__(self, local: QueryMetrics, others: Callable[[], Iterable[Iterable[Sample]]]):
        self.local = local
        self.others = others

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from merge_query_metrics(self.local, self.others())


def _counts(name: str, doc: str, label: str, counts: Iterable[tuple[str, float]]) -> Metric:
    """A counter family of one label: a sample per (label value, count) of ``counts``, in
    that order."""
    fam = CounterMetricFamily(name, doc, labels=[label])
    for key, n in counts:
        fam.add_metric([key], n)
    return fam


_UP = "kvconductor_source_up"
_AGE = "kvconductor_source_last_event_age_seconds"
_MUTED = "kvconductor_source_muted"


class ConductorCollector(Collector):
    """Ingest, index, registration and build metrics, read at scrape time."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self._lines = {name: SourceLines(name) for name in (_UP, _AGE, _MUTED)}

    def describe(self) -> Iterable[Metric]:
        # Nothing at registration time: collect() reads live state.
        return []

    def collect(self) -> Iterator[Metric]:
        c = self.conductor
        now = time.time()
        build = GaugeMetricFamily(
            "kvconductor_build_info", "Build of the running service (always 1)", labels=["version"]
        )
        build.add_metric([__version__], 1)
        yield build

        regs = GaugeMetricFamily(
            "kvconductor_registrations", "Registered (instance, DP) pairs", value=c.registrations
        )
        yield regs

        blocks = GaugeMetricFamily(
            "kvconductor_index_blocks",
            "Blocks held per (model, tenant) index and tier (HBM counts (worker, block) pairs)",
            labels=["model", "tenant", "tier"],
        )
        nbytes = GaugeMetricFamily(
            "kvconductor_index_bytes",
            "Structure memory of each (model, tenant) index",
            labels=["model", "tenant"],
        )
        for (model, tenant), idx in sorted(c.indexes.items()):
            s = idx.sizes()  # one read lock, O(1) counters
            blocks.add_metric([model, tenant, "npu"], s["hbm_pairs"])
            blocks.add_metric([model, tenant, "cpu"], s["cpu_blocks"])
            blocks.add_metric([model, tenant, "disk"], s["disk_blocks"])
            nbytes.add_metric([model, tenant], s["nbytes"])
        yield blocks
        yield nbytes
        yield _counts(
            "kvconductor_two_phase_expired",
            "Two-phase entries expired unmatched: engine offloads no pool confirmed "
            "(offload), pool confirmations no engine offload came for (pool_confirmation)",
            "kind",
            sorted(c.expired.items()),
        )
        pc = c.predictions.counts()
        held = pc.pop("live")
        yield _counts(
            "kvconductor_predictions",
            "Routers' predictions (POST /predict) by outcome: added, confirmed (an event "
            "of its DP stored it), expired (TTL), dropped (over a bound), contradicted (a "
            "removal or clear of its DP)",
            "outcome",
            sorted(pc.items()),
        )
        yield GaugeMetricFamily("kvconductor_predictions_live", "Predictions held now", value=held)
        yield _counts(
            "kvconductor_snapshot_skipped_registrations",
            "Registrations of a loaded snapshot or dump skipped, by reason: refused (the "
            "current flags refuse its URLs), max_sources, unavailable (cannot be opened now)",
            "reason",
            sorted(c.skipped_registrations.items()),
        )

        pause = Pacer()
        snap = c.subs.metrics_snapshot(pause)  # O(sources): columns and totals
        applied = dict(snap.applied)
        applied["http"] = applied.get("http", 0) + c.http_events_applied
        yield _counts(
            "kvconductor_events_applied",
            "Events of the batches applied, by source kind (ZeroMQ: the /workers sources' "
            "events; http: POST /events)",
            "source_kind",
            sorted(applied.items()),
        )
        yield _counts(
            "kvconductor_events_dropped",
            "Messages and events dropped by the ZeroMQ ingest, by reason (/workers dropped)",
            "reason",
            sorted(snap.dropped.items()),
        )
        yield CounterMetricFamily(
            "kvconductor_source_gaps", "Sequence gaps seen on the ZeroMQ streams", value=snap.gaps
        )
        yield _counts(
            "kvconductor_replays",
            "Finished replays: ok (end marker arrived) or failed (a loss)",
            "outcome",
            (("ok", snap.replays_ok), ("failed", snap.replays_failed)),
        )
        labels, lines = snap.labels, self._lines
        live, muted, last = snap.live, snap.muted, snap.last_event
        yield RenderedFamily(
            _UP,
            "1 while a subscription is live (connected, not replaying, not degraded), else 0",
            "gauge",
            lines[_UP].flags(labels, live, pause),
        )
        pause()
        yield RenderedFamily(
            _AGE,
            "Seconds since a subscription last received a batch (or since it was opened)",
            "gauge",
            lines[_AGE].ages(labels, now, last, pause),
        )
        pause()
        yield RenderedFamily(
            _MUTED,
            "1 while a subscription's (instance, DP) HBM hits are muted: not ready for "
            "--source-down-secs",
            "gauge",
            lines[_MUTED].flags(labels, muted, pause),
        )
        yield CounterMetricFamily(
            "kvconductor_source_mutes",
            "Times a source's (instance, DP) HBM hits were muted (down past --source-down-secs)",
            value=snap.mutes,
        )
        yield CounterMetricFamily(
            "kvconductor_source_purged_blocks",
            "HBM blocks dropped because their source stayed down past --source-purge-secs",
            value=snap.purged_blocks,
        )
        snapshotter = c.snapshotter
        if snapshotter is not None:
            yield from _snapshot_metrics(snapshotter.stats)
        rep = c.replicator
        if rep is not None:
            yield from _replica_metrics(rep)


#: ``--state-url``: (name, help, kind, field of Replicator.info()).
_REPLICA_METRICS = (
    ("kvconductor_replica_state_store_up", "1 while the state store answers", "gauge", None),
    (
        "kvconductor_replica_lag_seconds",
        "How far this replica's applied log position is behind the newest entry",
        "gauge",
        "lag_s",
    ),
    (
        "kvconductor_replica_log_entries",
        "Entries in the log (trimmed behind snapshots)",
        "gauge",
        "log_length",
    ),
    (
        "kvconductor_replicas",
        "Replicas with a heartbeat in the last two lease periods",
        "gauge",
        "replicas",
    ),
    (
        "kvconductor_replica_sources_consumed",
        "ZeroMQ sources this replica holds the lease of",
        "gauge",
        "sources_consumed",
    ),
    (
        "kvconductor_replica_entries_applied",
        "Log entries this replica applied",
        "counter",
        "entries_applied",
    ),
    (
        "kvconductor_replica_entries_appended",
        "Log entries this replica appended",
        "counter",
        "entries_appended",
    ),
    (
        "kvconductor_replica_append_failures",
        "Source entries that could not be appended (the source was given up)",
        "counter",
        "append_failures",
    ),
    (
        "kvconductor_replica_bootstraps",
        "State loads from the store's snapshot",
        "counter",
        "bootstraps",
    ),
    (
        "kvconductor_replica_snapshots",
        "Snapshots this replica wrote to the store",
        "counter",
        "snapshots_written",
    ),
)


def _replica_metrics(rep: Replica) -> Iterator[Metric]:
    info: Mapping[str, Any] = rep.info()  # read by field name (_REPLICA_METRICS)
    for name, text, kind, field in _REPLICA_METRICS:
        value = (1 if info["state_store"] == "up" else 0) if field is None else info[field]
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        yield family(name, text, value=value)


def _snapshot_metrics(s: SnapshotCounts) -> Iterator[Metric]:
    """``--snapshot-dir``: the snapshots written and how the last one went."""
    yield _counts(
        "kvconductor_snapshots",
        "Snapshots by outcome: written, failed (logged; the service goes on)",
        "outcome",
        (("written", s.written), ("failed", s.failed)),
    )
    yield GaugeMetricFamily(
        "kvconductor_snapshot_last_success_timestamp_seconds",
        "Unix time of the last snapshot written (0: none yet)",
        value=s.last_time,
    )
    yield GaugeMetricFamily(
        "kvconductor_snapshot_last_bytes", "Size of the last snapshot written", value=s.last_bytes
    )
    yield GaugeMetricFamily(
        "kvconductor_snapshot_last_duration_seconds",
        "Seconds the last snapshot took (copy on the ingest thread, encoding, writing)",
        value=s.last_seconds,
    )
    yield GaugeMetricFamily(
        "kvconductor_snapshot_last_pause_seconds",
        "Seconds the ingest thread was held for the last snapshot's copy",
        value=s.last_pause,
    )


class Metrics:
    """One app's registry: the query metrics and the conductor collector.

    ``other_queries``: a callable returning other processes' query samples
    (:func:`query_samples`), summed into the query metrics at scrape time
    (:class:`QuerySumCollector`). ``extra``: more collectors (the worker-process
    metrics of ``kv-conductor --workers N``).
    """

    def __init__(
        self,
        conductor: Conductor,
        other_queries: Callable[[], Iterable[Iterable[Sample]]] | None = None,
        extra: Iterable[Collector] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if other_queries is None:
            self.query = QueryMetrics(self.registry)
        else:
            self.query = QueryMetrics(None)
            self.registry.register(QuerySumCollector(self.query, other_queries))
        self.registry.register(ConductorCollector(conductor))
        for collector in extra:
            self.registry.register(collector)

    def exposition(self) -> bytes:
        """The text exposition (format 0.0.4, :data:`CONTENT_TYPE`) of every metric
        (:func:`kvconductor.http.columns.exposition`)."""
        return exposition(self.registry)
