"""``GET /metrics`` rendered fast (docs/performance.md, "/metrics at 4,096 sources") is
byte for byte what prometheus_client's ``generate_latest`` writes for the same state.

The reference below is the straightforward rendering kept independent of the service's:
one prometheus_client ``Metric`` per family, one sample per (source, medium), every row
read from the subscriptions themselves, written by ``generate_latest``. Both run over the
same hand-built subscriptions (labels needing escaping, several media, pools, every
state, counters of every kind, retired totals) at the same wall-clock time.
"""

from __future__ import annotations

import math
import random
import struct
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvconductor import __version__
from kvconductor.http import columns as columns_mod
from kvconductor.http import metrics as metrics_mod
from kvconductor.http.metrics import Metrics
from kvconductor.ingest.context import source_kind
from kvconductor.ingest.tracker import SequenceTracker
from kvconductor.keys import Medium
from kvconductor.state.conductor import Conductor, ConductorConfig
from kvconductor.state.protocols import NoSubscriptions
from tests.helpers.sources import manager

NOW = 1_700_000_100.0


def _rows(subs) -> tuple[list[tuple], object]:
    """(instance_id, dp_rank, media, kind, events, dropped, gaps, ok, failed, live,
    last_event, muted, mutes, purged) of every subscription, and the retired totals."""
    mgr = subs
    rows = []
    for sub in getattr(mgr, "_subs", {}).values():
        s, ctx = sub.stats, sub.ctx
        live = not sub.manager.journal.replicated or sub.replica.owned
        live = live and sub.tracker.state(sub.connected) == "live"
        rows.append(
            (
                ctx.instance_id,
                ctx.dp_rank,
                ctx.default_media,
                source_kind(ctx.is_pool, ctx.engine_type),
                s.events,
                dict(s.dropped),
                s.gaps,
                s.replays_ok,
                s.dropped.get("replay_failed", 0),
                live,
                s.last_event,
                sub.muted,
                s.mutes,
                s.purged_blocks,
            )
        )
    return rows, getattr(mgr, "retired", None)


def _by_key(name: str, doc: str, labels: list[str], values: dict[str, int]) -> Metric:
    """A plain counter family: one sample per key of ``values``, keys sorted."""
    fam = CounterMetricFamily(name, doc, labels=labels)
    for key in sorted(values):
        fam.add_metric([key], values[key])
    return fam


class ReferenceCollector(Collector):
    """The conductor's families as plain prometheus_client metrics."""

    def __init__(self, c: Conductor) -> None:
        self.c = c

    def collect(self) -> Iterator[Metric]:
        c = self.c
        now = time.time()
        build = GaugeMetricFamily(
            "kvconductor_build_info", "Build of the running service (always 1)", labels=["version"]
        )
        build.add_metric([__version__], 1)
        yield build
        yield GaugeMetricFamily(
            "kvconductor_registrations", "Registered (instance, DP) pairs", value=c.registrations
        )
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
            s = idx.sizes()
            blocks.add_metric([model, tenant, "npu"], s["hbm_pairs"])
            blocks.add_metric([model, tenant, "cpu"], s["cpu_blocks"])
            blocks.add_metric([model, tenant, "disk"], s["disk_blocks"])
            nbytes.add_metric([model, tenant], s["nbytes"])
        yield blocks
        yield nbytes
        yield _by_key(
            "kvconductor_two_phase_expired",
            "Two-phase entries expired unmatched: engine offloads no pool confirmed "
            "(offload), pool confirmations no engine offload came for (pool_confirmation)",
            ["kind"],
            c.expired,
        )
        yield _by_key(
            "kvconductor_predictions",
            "Routers' predictions (POST /predict) by outcome: added, confirmed (an event "
            "of its DP stored it), expired (TTL), dropped (over a bound), contradicted (a "
            "removal or clear of its DP)",
            ["outcome"],
            c.predictions.outcomes,
        )
        yield GaugeMetricFamily(
            "kvconductor_predictions_live", "Predictions held now", value=c.predictions.live
        )
        yield _by_key(
            "kvconductor_snapshot_skipped_registrations",
            "Registrations of a loaded snapshot or dump skipped, by reason: refused (the "
            "current flags refuse its URLs), max_sources, unavailable (cannot be opened now)",
            ["reason"],
            c.skipped_registrations,
        )
        rows, retired = _rows(c.subs)
        applied: dict[str, int] = {"http": c.http_events_applied}
        dropped: dict[str, int] = {}
        gaps = ok = failed = mutes = purged = 0
        if retired is not None:
            for kind, n in retired.events.items():
                applied[kind] = applied.get(kind, 0) + n
            for reason, n in retired.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
            gaps += retired.gaps
            ok += retired.replays_ok
            failed += retired.replays_failed
            mutes, purged = retired.mutes, retired.purged_blocks
        labels = ["instance_id", "dp_rank", "medium"]
        up = GaugeMetricFamily(
            "kvconductor_source_up",
            "1 while a subscription is live (connected, not replaying, not degraded), else 0",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "kvconductor_source_last_event_age_seconds",
            "Seconds since a subscription last received a batch (or since it was opened)",
            labels=labels,
        )
        muted = GaugeMetricFamily(
            "kvconductor_source_muted",
            "1 while a subscription's (instance, DP) HBM hits are muted: not ready for "
            "--source-down-secs",
            labels=labels,
        )
        for iid, dp, media, kind, ev, drop, g, o, f, live, last, mu, ms, pb in rows:
            mutes += ms
            purged += pb
            applied[kind] = applied.get(kind, 0) + ev
            for reason, n in drop.items():
                dropped[reason] = dropped.get(reason, 0) + n
            gaps += g
            ok += o
            failed += f
            for m in media:
                lv = [iid, str(dp), Medium(m).name]
                up.add_metric(lv, 1 if live else 0)
                age.add_metric(lv, max(0.0, now - last))
                muted.add_metric(lv, 1 if mu else 0)
        yield _by_key(
            "kvconductor_events_applied",
            "Events of the batches applied, by source kind (ZeroMQ: the /workers sources' "
            "events; http: POST /events)",
            ["source_kind"],
            applied,
        )
        yield _by_key(
            "kvconductor_events_dropped",
            "Messages and events dropped by the ZeroMQ ingest, by reason (/workers dropped)",
            ["reason"],
            dropped,
        )
        yield CounterMetricFamily(
            "kvconductor_source_gaps", "Sequence gaps seen on the ZeroMQ streams", value=gaps
        )
        rp = CounterMetricFamily(
            "kvconductor_replays",
            "Finished replays: ok (end marker arrived) or failed (a loss)",
            labels=["outcome"],
        )
        rp.add_metric(["ok"], ok)
        rp.add_metric(["failed"], failed)
        yield rp
        yield up
        yield age
        yield muted
        yield CounterMetricFamily(
            "kvconductor_source_mutes",
            "Times a source's (instance, DP) HBM hits were muted (down past --source-down-secs)",
            value=mutes,
        )
        yield CounterMetricFamily(
            "kvconductor_source_purged_blocks",
            "HBM blocks dropped because their source stayed down past --source-purge-secs",
            value=purged,
        )
        if c.snapshotter is not None:
            yield from metrics_mod._snapshot_metrics(c.snapshotter.stats)
        if c.replicator is not None:
            yield from metrics_mod._replica_metrics(c.replicator)


def _reference(m: Metrics, c: Conductor) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    for col in m.query.collectors():
        reg.register(col)
    reg.register(ReferenceCollector(c))
    return generate_latest(reg)


@pytest.fixture
def fixed_time(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOW)


def _conductor(subs) -> Conductor:
    c = Conductor(ConductorConfig(maintenance_interval=3600), subscriptions=NoSubscriptions)
    c.subs = subs
    c.http_events_applied = 17
    c.expired["offload"] = 2
    return c


def _with_queries(m: Metrics) -> None:
    q = m.query
    for secs in (0.00005, 0.0003, 0.02, 3.0):
        q.route_seconds["/query"].observe(secs)
    q.count_blocks(5, 0, 2)
    q.no_match.inc()
    q.route_errors["/query_by_hash"].inc()


@pytest.mark.parametrize(
    ("n", "odd", "replicated"),
    [
        (0, True, False),
        (1, False, False),
        (600, True, False),
        (600, True, True),
        (64, False, False),
    ],
)
def test_exposition_matches_the_reference(fixed_time, n, odd, replicated):
    c = _conductor(manager(n, odd=odd, replicated=replicated))
    try:
        m = Metrics(c)
        _with_queries(m)
        got, want = m.exposition(), _reference(m, c)
        assert got.decode() == want.decode()
        assert got == want
        if n and odd:  # the rows that matter were there to compare
            assert b'instance_id="a\\"b-0"' in got
            assert b"\\n" in got and "ünï".encode() in got and b"e+06" in got
    finally:
        c.stop()


def test_small_slices_match_the_reference(fixed_time, monkeypatch):
    """A scrape read and formatted a few sources at a time (pauses between slices), the
    slices' edges inside a run of sources of several media."""
    import kvconductor.ingest.subscriber as subscriber

    pauses = []
    monkeypatch.setattr(subscriber, "METRICS_CHUNK", 5)
    monkeypatch.setattr(columns_mod, "CHUNK", 7)
    monkeypatch.setattr(columns_mod, "PAUSE", 0.0)
    monkeypatch.setattr(columns_mod, "SLICE", 0.0)  # pause at every chance
    c = _conductor(manager(300, odd=True))
    try:
        m = Metrics(c)
        monkeypatch.setattr(columns_mod.time, "sleep", lambda s: pauses.append(s))
        got = m.exposition()
        monkeypatch.undo()
        monkeypatch.setattr(time, "time", lambda: NOW)
        assert got == _reference(m, c)
        assert len(pauses) > 100
    finally:
        c.stop()


def test_no_subscriptions_matches_the_reference(fixed_time):
    c = Conductor(ConductorConfig(maintenance_interval=3600), subscriptions=NoSubscriptions)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
    finally:
        c.stop()


def test_a_retargeted_subscription_is_scraped_under_its_new_labels(fixed_time):
    """A registration changed on the same URL (``Subscription.retarget``): the next
    scrape shows the new media, not labels kept from before."""
    import dataclasses

    mgr = manager(3, odd=False)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        sub = next(iter(mgr._subs.values()))
        sub.ctx = dataclasses.replace(sub.ctx, default_media=(Medium.NPU, Medium.CPU))
        got = m.exposition()
        assert got == _reference(m, c)
        assert b'kvconductor_source_up{dp_rank="0",instance_id="inst-0",medium="CPU"} 1.0' in got
    finally:
        c.stop()


def test_a_changed_table_is_scraped_as_it_is_now(fixed_time, monkeypatch):
    """What a scrape keeps of the table's columns (stats, kinds, label sets) is not
    reused once a subscription is gone or another is there, in any slice."""
    import kvconductor.ingest.subscriber as subscriber

    monkeypatch.setattr(subscriber, "METRICS_CHUNK", 4)
    mgr = manager(20, odd=True)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        keys = list(mgr._subs)
        moved = mgr._subs.pop(keys[5])  # gone from the second slice
        assert m.exposition() == _reference(m, c)
        mgr._subs[keys[5]] = moved  # back, at the end
        del mgr._subs[keys[0]]
        got = m.exposition()
        assert got == _reference(m, c)
        assert got.count(b"\nkvconductor_source_up{") == len(_rows(mgr)[0]) + sum(
            len(r[2]) - 1 for r in _rows(mgr)[0]
        )
    finally:
        c.stop()


def test_a_changed_source_state_is_scraped_as_it_is_now(fixed_time):
    """The 0/1 families' text is kept between scrapes while the flags stay the same:
    a source that goes down, is muted, comes back, is not shown in its old state."""
    mgr = manager(40, odd=False)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        subs = list(mgr._subs.values())
        subs[3].connected = False
        subs[7].muted = True
        got = m.exposition()
        assert got == _reference(m, c)
        assert b'kvconductor_source_up{dp_rank="3",instance_id="inst-0",medium="NPU"} 0.0' in got
        assert b'kvconductor_source_muted{dp_rank="7",instance_id="inst-0",medium="NPU"} 1.0' in got
        subs[3].connected = True
        subs[7].muted = False
        subs[9].tracker.replaying = True
        assert m.exposition() == _reference(m, c)
        subs[9].tracker.replaying = False
        subs[11].tracker.degraded_since = 5.0
        assert m.exposition() == _reference(m, c)
        subs[11].tracker.degraded_since = None
        t = SequenceTracker(subs[12], subs[12].stats, replay=False)
        t.replaying = True
        assert m.exposition() == _reference(m, c)  # (t is no source's tracker yet)
        subs[12].tracker = t  # a resync's new tracker
        got = m.exposition()
        assert got == _reference(m, c)
        assert b'kvconductor_source_up{dp_rank="4",instance_id="inst-1",medium="NPU"} 0.0' in got
    finally:
        c.stop()


def test_ownership_is_read_at_every_scrape(fixed_time):
    """--state-url: a source whose lease moves to or from this replica is live or
    remote at the next scrape."""
    mgr = manager(50, odd=True, replicated=True)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        for sub in list(mgr._subs.values())[::3]:
            sub.replica.owned = not sub.replica.owned
        assert m.exposition() == _reference(m, c)
    finally:
        c.stop()


def test_the_ages_move_between_scrapes(monkeypatch):
    """The ages are formatted at every scrape (``now`` moves; a batch moves a source's
    last event), never kept."""
    t = [NOW]
    monkeypatch.setattr(time, "time", lambda: t[0])
    mgr = manager(5, odd=False)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        t[0] = NOW + 2.5
        assert m.exposition() == _reference(m, c)
        next(iter(mgr._subs.values())).stats.last_event = NOW + 2.0
        got = m.exposition()
        assert got == _reference(m, c)
        assert b'medium="NPU"} 0.5\n' in got
    finally:
        c.stop()


#: Ages a scrape may meet: exponent forms (>= 1e6 s, < 1e-4 s), clamped (negative),
#: the bounds of the fast path and their neighbours, NaN and infinities.
EDGE_AGES = (
    0.0,
    -0.0,
    -1.5,
    5e-324,
    1e-5,
    math.nextafter(1e-4, 0.0),
    1e-4,
    math.nextafter(1e-4, 1.0),
    0.1,
    0.3,
    2 / 3,
    1.0,
    100.0,
    123456.789,
    math.nextafter(1e6, 0.0),
    1e6,
    3e6 + 0.25,
    1e16,
    1.7e9,
    math.inf,
    -math.inf,
    math.nan,
)


@pytest.mark.parametrize("fast", [True, False], ids=["msgspec", "repr"])
def test_ages_are_what_float_to_go_string_writes(monkeypatch, fast):
    """``_ages`` (msgspec's float writer where it agrees with ``repr``, the general one
    elsewhere) against prometheus_client's ``floatToGoString`` of ``max(0, now - t)``:
    the edges, and many ages of the shape a scrape computes (now - a wall-clock time of
    about 1.7e9: 17 significant digits) over every decade of the fast path."""
    assert columns_mod._FAST_AGES  # the installed msgspec writes these as repr does
    monkeypatch.setattr(columns_mod, "_FAST_AGES", fast)
    rnd = random.Random(27)
    now = 1_700_000_000.0 + rnd.random() * 1e6
    last = [now - a for a in EDGE_AGES]
    last += [now - rnd.random() * 10 ** rnd.uniform(-5, 7) for _ in range(20_000)]
    last += [rnd.uniform(1e-4, 1e6) for _ in range(5_000)]  # now - t: near now
    got = columns_mod._ages(now, last)
    assert got == [floatToGoString(max(0.0, now - t)).encode() for t in last]
    # the edges themselves, exactly (``now - (now - a)`` rounds)
    want = [floatToGoString(max(0.0, a)).encode() for a in EDGE_AGES]
    assert {b"0.0", b"1e-05", b"0.0001", b"1e+06", b"3.00000025e+06", b"+Inf"} <= set(want)
    fmt = columns_mod._ages_msgspec if fast else columns_mod._ages_repr
    assert fmt(list(EDGE_AGES)) == want
    for k in range(len(EDGE_AGES)):  # each alone: the checks of a whole chunk
        assert fmt([EDGE_AGES[k]]) == [want[k]]


def test_random_floats_are_written_as_repr_by_msgspec():
    """The fast path's claim, by bit patterns: every float of ``[1e-4, 1e6)`` that msgspec
    writes is ``repr``'s text (uniform over the floats' bits, so every decade and
    every mantissa shape)."""
    rnd = random.Random(11)
    lo, hi = (struct.unpack("<q", struct.pack("<d", x))[0] for x in (1e-4, 1e6))
    vals = [struct.unpack("<d", struct.pack("<q", rnd.randrange(lo, hi)))[0] for _ in range(50_000)]
    assert columns_mod._ages_msgspec(vals) == [repr(v).encode() for v in vals]


def test_the_repr_path_matches_the_reference(fixed_time, monkeypatch):
    """Without the msgspec path (an msgspec that writes floats otherwise)."""
    monkeypatch.setattr(columns_mod, "_FAST_AGES", False)
    c = _conductor(manager(300, odd=True))
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
    finally:
        c.stop()


def _bump_drop(st) -> None:
    st.drop("parent_not_found", 3)


def _bump_failed(st) -> None:
    st.drop("replay_failed")


def _bump_gaps(st) -> None:
    st.gaps += 1


def _bump_ok(st) -> None:
    st.replays_ok += 2


def _bump_mutes(st) -> None:
    st.mutes += 1


def _bump_purged(st) -> None:
    st.purged_blocks += 40


@pytest.mark.parametrize(
    "bump", [_bump_drop, _bump_failed, _bump_gaps, _bump_ok, _bump_mutes, _bump_purged]
)
@pytest.mark.parametrize("odd", [False, True], ids=["plain", "mixed"])
def test_a_moved_rare_counter_is_scraped_as_it_is_now(fixed_time, monkeypatch, bump, odd):
    """The sums of the rarely moving counters (drops, gaps, replays, mutes, purges) are
    kept between scrapes while nothing moved them: one that moves, in any slice, is
    counted at the next scrape."""
    import kvconductor.ingest.subscriber as subscriber

    monkeypatch.setattr(subscriber, "METRICS_CHUNK", 8)
    mgr = manager(30, odd=odd)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        first = m.exposition()
        assert first == _reference(m, c)
        assert m.exposition() == first  # kept: the same text
        for sub in list(mgr._subs.values())[::7]:
            bump(sub.stats)
        got = m.exposition()
        assert got == _reference(m, c)
        assert got != first
    finally:
        c.stop()


def test_a_retargeted_kind_is_counted_under_its_new_kind(fixed_time):
    """A retarget to another engine type (same labels): its events count under the new
    source kind at the next scrape."""
    import dataclasses

    mgr = manager(12, odd=False)
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        sub = list(mgr._subs.values())[4]
        sub.ctx = dataclasses.replace(sub.ctx, engine_type="SGLang")
        got = m.exposition()
        assert got == _reference(m, c)
        assert b'kvconductor_events_applied_total{source_kind="sglang"} 1004.0' in got
    finally:
        c.stop()


@pytest.mark.parametrize("media", [(), (Medium.CPU,), (Medium.NPU, Medium.CPU, Medium.DISK)])
def test_a_slice_of_uneven_media_matches_the_reference(fixed_time, media):
    """A source of no medium, one or three next to sources of one: each column repeated
    per medium (the repetition of a slice is built once, for any count)."""
    import dataclasses

    mgr = manager(3, odd=False)
    c = _conductor(mgr)
    try:
        sub = list(mgr._subs.values())[1]
        sub.ctx = dataclasses.replace(sub.ctx, default_media=media)
        m = Metrics(c)
        assert m.exposition() == _reference(m, c)
        assert m.exposition() == _reference(m, c)  # the kept columns
    finally:
        c.stop()


@pytest.mark.parametrize("created", [True, False])
def test_the_query_families_match_the_reference(fixed_time, monkeypatch, created):
    """The query families render themselves (their label strings once): the same text
    as generate_latest over their samples, with or without the ``_created`` series
    (``PROMETHEUS_DISABLE_CREATED_SERIES``)."""
    monkeypatch.setattr(metrics_mod, "_USE_CREATED", created)
    c = _conductor(manager(3, odd=False))
    try:
        m = Metrics(c)
        for _ in range(2):  # the second time with the label strings kept
            _with_queries(m)
            got = m.exposition()
            assert got == _reference(m, c)
        assert (b"kvconductor_query_seconds_created{" in got) is created
        assert b'kvconductor_query_seconds_bucket{le="0.0005",route="/query"} 4.0\n' in got
    finally:
        c.stop()


@pytest.mark.parametrize("reasons", [2, 40], ids=["few-reasons", "many-reasons"])
def test_drops_are_summed_by_reason(fixed_time, reasons):
    """The drops of a slice are summed per reason in C when the reasons are few for the
    sources with drops, by a loop over the sources otherwise: both as the reference."""
    mgr = manager(60, odd=False)
    for i, sub in enumerate(mgr._subs.values()):
        if i % 3:
            sub.stats.drop(f"reason_{i % reasons}", i)
            sub.stats.drop("replay_failed")
    c = _conductor(mgr)
    try:
        m = Metrics(c)
        got = m.exposition()
        assert got == _reference(m, c)
        assert b'kvconductor_replays_total{outcome="failed"} 40.0' in got
    finally:
        c.stop()


def test_drops_are_written_only_through_drop():
    """A scrape keeps the drops' sums while ``COUNTS_STAMP`` holds; ``SourceStats.drop``
    moves it. Any other write of a ``dropped`` dict in the package (an item set, an
    update) would go unseen: only ``drop()`` itself and the retired totals (read under
    the table lock at every scrape, never kept) write one."""
    import ast
    import pathlib

    import kvconductor

    allowed = {("stats.py", "self"), ("subscriber.py", "r")}
    writers = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__"}
    found = []
    for path in pathlib.Path(kvconductor.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                targets = (
                    node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                )
                targets = [t.value for t in targets if isinstance(t, ast.Subscript)]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in writers
            ):
                targets = [node.func.value]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "dropped":
                    owner = ast.unparse(t.value)
                    if (path.name, owner) not in allowed:
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []
