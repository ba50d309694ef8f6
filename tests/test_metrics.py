"""``GET /metrics`` (docs/api.md, GET /metrics): every metric moves by exactly what a
scripted sequence of registrations, events (HTTP and a real ZeroMQ publisher) and
queries implies. Values are read with prometheus_client's own parser, as deltas.
"""

from __future__ import annotations

import falcon.testing as ft
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvconductor
from kvconductor.http.api import create_app
from kvconductor.http.metrics import CONTENT_TYPE
from kvconductor.ingest.host import IngestSettings
from kvconductor.ingest.subscriber import SubscriptionManager
from kvconductor.state.conductor import Conductor, ConductorConfig
from tests.helpers.publishers import FakePublisher, free_tcp_port, schema, wait_until

H1, H2 = 14643705804678351452, 16777012769546811212  # tokens 1..4, 5..8 (docs/api.md)
BS = 4


def scrape(client, **kw) -> dict[tuple, float]:
    """``{(sample name, sorted labels): value}`` of one scrape (``_created`` left out)."""
    r = client.simulate_get("/metrics", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(m: dict, name: str, **labels) -> float:
    """A sample's value; 0 when absent (a counter not yet seen)."""
    key = tuple(sorted((k, str(x)) for k, x in labels.items()))
    return m.get((name, key), 0.0)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return v(after, name, **labels) - v(before, name, **labels)


@pytest.fixture
def conductor():
    c = Conductor(ConductorConfig(maintenance_interval=3600))
    c.start()
    yield c
    assert c.stop(5.0)


@pytest.fixture(params=["falcon", "fastpath"])
def client(request, conductor):
    return ft.TestClient(create_app(conductor, fast_query=request.param == "fastpath"))


def register(client, instance_id="http-1", model="tiny", block_size=BS, dp=0, **kw):
    body = {
        "instance_id": instance_id,
        "type": "vLLM",
        "modelname": model,
        "block_size": block_size,
        "dp_rank": dp,
    }
    body.update(kw)
    r = client.simulate_post("/register", json=body)
    assert r.status_code == 201, r.text


def stored(hashes, tokens, dp=0, event_id=1, **kw):
    ev = {
        "event_id": event_id,
        "dp_rank": dp,
        "type": "BlockStored",
        "block_hashes": hashes,
        "token_ids": tokens,
        "block_size": BS,
    }
    ev.update(kw)
    return ev


def query(client, tokens, model="tiny", block_size=BS, by_hash=False):
    path = "/query_by_hash" if by_hash else "/query"
    key = "block_hashes" if by_hash else "token_ids"
    r = client.simulate_post(path, json={"model": model, "block_size": block_size, key: tokens})
    return r.status_code, r.json


def test_build_info_and_content_type(client):
    m = scrape(client)
    assert v(m, "kvconductor_build_info", version=kvconductor.__version__) == 1
    assert v(m, "kvconductor_registrations") == 0


def test_query_metrics_move_exactly(client):
    register(client, "http-1", dp=0)
    register(client, "http-1", dp=1)
    r = client.simulate_post(
        "/events",
        json={
            "instance_id": "http-1",
            "events": [
                stored([100, 200], list(range(1, 9)), dp=0),
                stored([300], [1, 2, 3, 4], dp=1, event_id=2, medium="CPU"),
            ],
        },
    )
    assert r.json == {"status": "ok", "events_applied": 2}
    m0 = scrape(client)
    assert v(m0, "kvconductor_registrations") == 2
    assert v(m0, "kvconductor_events_applied_total", source_kind="http") == 2
    assert v(m0, "kvconductor_index_blocks", model="tiny", tenant="default", tier="npu") == 2
    assert v(m0, "kvconductor_index_blocks", model="tiny", tenant="default", tier="cpu") == 1
    assert v(m0, "kvconductor_index_blocks", model="tiny", tenant="default", tier="disk") == 0
    assert v(m0, "kvconductor_index_bytes", model="tiny", tenant="default") > 0

    # hit: DP 0 holds 2 NPU blocks, DP 1 one CPU block of the same prefix.
    st, body = query(client, list(range(1, 13)))
    assert st == 200
    assert body["default"]["http-1"]["DP"]["0"]["npu_blocks"] == 2
    assert body["default"]["http-1"]["DP"]["1"]["cpu_blocks"] == 1
    assert query(client, [1, 2, 3, 4], model="ghost")[0] == 404  # unknown_index
    assert query(client, list(range(1, 9)), block_size=8) == (200, {"default": {}})  # mismatch
    assert query(client, [9, 9, 9, 9]) == (200, {"default": {}})  # no_match
    st, body = query(client, [H1, H2], by_hash=True)  # hit by hash: 2 NPU + 1 CPU
    assert body["default"]["http-1"]["DP"]["0"]["npu_blocks"] == 2
    assert query(client, [7], by_hash=True) == (200, {"default": {}})  # no_match
    assert client.simulate_post("/query", body=b"{").status_code == 400  # timed, no miss

    m1 = scrape(client)
    assert delta(m1, m0, "kvconductor_query_blocks_total", tier="npu") == 4
    assert delta(m1, m0, "kvconductor_query_blocks_total", tier="cpu") == 2
    assert delta(m1, m0, "kvconductor_query_blocks_total", tier="disk") == 0
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="unknown_index") == 1
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="block_size_mismatch") == 1
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="no_match") == 2
    assert delta(m1, m0, "kvconductor_query_seconds_count", route="/query") == 5
    assert delta(m1, m0, "kvconductor_query_seconds_count", route="/query_by_hash") == 2
    assert v(m1, "kvconductor_query_seconds_bucket", route="/query", le="+Inf") == v(
        m1, "kvconductor_query_seconds_count", route="/query"
    )
    assert delta(m1, m0, "kvconductor_query_seconds_sum", route="/query") > 0
    # Scrapes themselves move nothing.
    assert scrape(client) == m1


def test_block_size_mismatch_needs_a_registration_without_that_size(client):
    register(client, "a", block_size=4)
    register(client, "b", block_size=8)
    m0 = scrape(client)
    assert query(client, list(range(1, 9)), block_size=8) == (200, {"default": {}})
    assert query(client, list(range(1, 17)), block_size=16) == (200, {"default": {}})
    m1 = scrape(client)
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="no_match") == 1
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="block_size_mismatch") == 1
    client.simulate_post(
        "/unregister",
        json={
            "instance_id": "b",
            "type": "vLLM",
            "modelname": "tiny",
            "block_size": 8,
            "dp_rank": 0,
        },
    )
    assert v(scrape(client), "kvconductor_registrations") == 1
    query(client, list(range(1, 9)), block_size=8)
    m2 = scrape(client)
    assert delta(m2, m1, "kvconductor_query_misses_total", reason="block_size_mismatch") == 1


def test_unknown_lora_is_its_own_miss_reason(client):
    register(client, "a")
    r = client.simulate_post(
        "/events",
        json={"instance_id": "a", "events": [stored([100], [1, 2, 3, 4], lora_name="sql")]},
    )
    assert r.status_code == 200
    body = {"model": "tiny", "block_size": BS, "token_ids": [1, 2, 3, 4]}
    m0 = scrape(client)
    for lora, tokens in (("chat", [1, 2, 3, 4]), ("sql", [5, 6, 7, 8]), ("sql", [1, 2, 3, 4])):
        client.simulate_post("/query", json=dict(body, lora_name=lora, token_ids=tokens))
    m1 = scrape(client)
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="unknown_lora") == 1
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="no_match") == 1
    assert delta(m1, m0, "kvconductor_query_blocks_total", tier="npu") == 1


def test_query_errors_count_rejected_requests_but_not_misses(client):
    register(client, "a")
    m0 = scrape(client)
    for path, body in (("/query", b"{"), ("/query_by_hash", b"[1]"), ("/query", b"{}")):
        r = client.simulate_post(path, body=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
    assert query(client, [1, 2, 3, 4], model="nope")[0] == 404  # a miss, not an error
    m1 = scrape(client)
    assert delta(m1, m0, "kvconductor_query_errors_total", route="/query") == 2
    assert delta(m1, m0, "kvconductor_query_errors_total", route="/query_by_hash") == 1
    assert delta(m1, m0, "kvconductor_query_misses_total", reason="unknown_index") == 1


def test_apps_have_their_own_registries(conductor):
    a = ft.TestClient(create_app(conductor))
    b = ft.TestClient(create_app(conductor, fast_query=True))
    query(a, [1, 2, 3, 4], model="ghost")
    assert v(scrape(a), "kvconductor_query_misses_total", reason="unknown_index") == 1
    assert v(scrape(b), "kvconductor_query_misses_total", reason="unknown_index") == 0


def test_metrics_protected_like_workers(conductor):
    auth = {"Authorization": "Bearer s3cret"}
    closed = ft.TestClient(create_app(conductor, api_key="s3cret"))
    r = closed.simulate_get("/metrics")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == 'Bearer realm="kv-conductor"'
    assert v(
        scrape(closed, headers=auth), "kvconductor_build_info", version=kvconductor.__version__
    )
    for kw in ({"open_workers": True}, {"open_metrics": True}):
        opened = ft.TestClient(create_app(conductor, api_key="s3cret", **kw))
        assert opened.simulate_get("/metrics").status_code == 200
    split = ft.TestClient(
        create_app(conductor, api_key="s3cret", open_workers=True, open_metrics=False)
    )
    assert split.simulate_get("/metrics").status_code == 401
    assert split.simulate_get("/workers").status_code == 200


# ---------------------------------------------------------------------------------------
# ZeroMQ sources: a real publisher, the real subscription manager


@pytest.fixture
def zmq_conductor():
    c = Conductor(
        ConductorConfig(maintenance_interval=3600),
        subscriptions=lambda t, cd: SubscriptionManager(
            t, cd, settings=IngestSettings(replay_timeout=0.5)
        ),
    )
    c.start()
    yield c
    assert c.stop(5.0)


V = schema("vllm", "0.33.0")
TOKENS = list(range(100, 124))
HASHES = [0xA000 + i for i in range(6)]


def _connected(client, pub, warm: bytes, iid="eng-1") -> None:
    """Once the subscription reached the PUB, publish ``warm`` and wait until it is
    applied (published earlier, the PUB would drop it: a loss at the first batch)."""
    pub.wait_subscribed()
    pub.publish(warm)

    def applied():
        st, body = query(client, TOKENS[:8], model="qwen")
        return st == 200 and iid in body["default"]

    wait_until(applied, msg="first batch applied")


def _src(m, name, iid="eng-1", dp=0, medium="NPU"):
    return v(m, name, instance_id=iid, dp_rank=dp, medium=medium)


def test_zmq_source_metrics(zmq_conductor):
    client = ft.TestClient(create_app(zmq_conductor, fast_query=True))
    pub = FakePublisher(replay=False)
    try:
        register(client, "eng-1", model="qwen", medium_endpoints={"npu": pub.url})
        m = scrape(client)
        assert v(m, "kvconductor_registrations") == 1
        _connected(client, pub, V.batch([V.stored(HASHES[:2], None, TOKENS[:8], BS)]))
        wait_until(lambda: _src(scrape(client), "kvconductor_source_up") == 1, msg="live")
        m0 = scrape(client)
        assert 0 <= _src(m0, "kvconductor_source_last_event_age_seconds") < 10
        up = [k for k in m0 if k[0] == "kvconductor_source_up"]
        assert up == [
            (
                "kvconductor_source_up",
                (("dp_rank", "0"), ("instance_id", "eng-1"), ("medium", "NPU")),
            )
        ]

        # One batch of 3 events: a store, a store of another block size (dropped), a removal.
        pub.publish(
            V.batch(
                [
                    V.stored(HASHES[2:4], HASHES[1], TOKENS[8:16], BS),
                    V.stored([0xBEEF], None, TOKENS[:8], 8),
                    V.removed([HASHES[3]]),
                ]
            )
        )
        wait_until(
            lambda: (
                delta(scrape(client), m0, "kvconductor_events_applied_total", source_kind="vllm")
                == 3
            ),
            msg="batch applied",
        )
        m1 = scrape(client)
        assert delta(m1, m0, "kvconductor_events_dropped_total", reason="block_size_mismatch") == 1
        assert delta(m1, m0, "kvconductor_events_applied_total", source_kind="http") == 0
        assert delta(m1, m0, "kvconductor_source_gaps_total") == 0
        assert v(m1, "kvconductor_index_blocks", model="qwen", tenant="default", tier="npu") == 3

        # A lost batch without a replay endpoint: a gap, a loss, the source degraded.
        pub.publish(b"lost", drop=True)
        pub.publish(V.batch([V.stored([HASHES[3]], HASHES[2], TOKENS[12:16], BS)]))
        wait_until(lambda: delta(scrape(client), m1, "kvconductor_source_gaps_total") == 1)
        m2 = scrape(client)
        assert _src(m2, "kvconductor_source_up") == 0  # degraded
        assert delta(m2, m1, "kvconductor_events_applied_total", source_kind="vllm") == 1
        assert delta(m2, m1, "kvconductor_replays_total", outcome="ok") == 0
        assert delta(m2, m1, "kvconductor_replays_total", outcome="failed") == 0

        # Unregistering keeps the counters (no reset) and removes the per-source series.
        r = client.simulate_post(
            "/unregister",
            json={
                "instance_id": "eng-1",
                "type": "vLLM",
                "modelname": "qwen",
                "block_size": 4,
                "dp_rank": 0,
            },
        )
        assert r.status_code == 200
        m3 = scrape(client)
        assert v(m3, "kvconductor_registrations") == 0
        for name, labels in (
            ("kvconductor_events_applied_total", {"source_kind": "vllm"}),
            ("kvconductor_events_dropped_total", {"reason": "block_size_mismatch"}),
            ("kvconductor_source_gaps_total", {}),
        ):
            assert delta(m3, m2, name, **labels) == 0, name
        assert not any(k[0].startswith("kvconductor_source_up") for k in m3)
    finally:
        pub.stop()


def test_source_up_drops_when_the_publisher_stops(zmq_conductor):
    client = ft.TestClient(create_app(zmq_conductor))
    pub = FakePublisher(replay=False)
    try:
        register(client, "eng-1", model="qwen", medium_endpoints={"npu": pub.url})
        _connected(client, pub, V.batch([V.stored(HASHES[:2], None, TOKENS[:8], BS)]))
        wait_until(lambda: _src(scrape(client), "kvconductor_source_up") == 1, msg="live")
    finally:
        pub.stop()
    wait_until(lambda: _src(scrape(client), "kvconductor_source_up") == 0, msg="down")


def test_replay_outcomes(zmq_conductor):
    client = ft.TestClient(create_app(zmq_conductor))
    pub = FakePublisher()
    dead = f"tcp://127.0.0.1:{free_tcp_port()}"
    try:
        m0 = scrape(client)
        # The registration's catch-up replay from 0 (nothing published yet) ends ok.
        register(
            client,
            "eng-1",
            model="qwen",
            medium_endpoints={"npu": pub.url},
            replay_endpoint=pub.replay_url,
        )
        wait_until(lambda: delta(scrape(client), m0, "kvconductor_replays_total", outcome="ok"))
        # A registration whose replay ROUTER never answers: failed after the timeout.
        other = FakePublisher(replay=False)
        try:
            register(
                client,
                "eng-2",
                model="qwen",
                medium_endpoints={"npu": other.url},
                replay_endpoint=dead,
            )
            wait_until(
                lambda: delta(scrape(client), m0, "kvconductor_replays_total", outcome="failed")
            )
        finally:
            other.stop()
        m1 = scrape(client)
        assert delta(m1, m0, "kvconductor_replays_total", outcome="ok") == 1
        assert delta(m1, m0, "kvconductor_replays_total", outcome="failed") == 1
        assert delta(m1, m0, "kvconductor_events_dropped_total", reason="replay_failed") == 1
    finally:
        pub.stop()


def test_source_kind():
    from kvconductor.ingest.context import source_kind

    assert source_kind(True, "vLLM") == "pool"
    assert source_kind(False, "vLLM") == "vllm"
    assert source_kind(False, "SGLang") == "sglang"
    assert source_kind(False, "MindIE") == "engine"


@pytest.mark.server
def test_real_server_serves_metrics(tmp_path):
    """``kv-conductor --api-key``: /metrics needs the key; the fast path's queries count."""
    from tests.helpers.server import Server

    s = Server(tmp_path, "--api-key", "k3y")
    try:
        s.wait_ready()
        assert s.http.get("/metrics").status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        assert (
            s.http.post(
                "/query", json={"model": "x", "block_size": 4, "token_ids": [1]}
            ).status_code
            == 404
        )
        r = s.http.get("/metrics", headers=auth)
        assert r.status_code == 200
        assert r.headers["content-type"] == CONTENT_TYPE
        m = {}
        for fam in text_string_to_metric_families(r.text):
            for smp in fam.samples:
                m[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
        assert v(m, "kvconductor_query_misses_total", reason="unknown_index") == 1
        assert v(m, "kvconductor_query_seconds_count", route="/query") == 1
        assert v(m, "kvconductor_build_info", version=kvconductor.__version__) == 1
    finally:
        s.terminate()


# -- the query metrics' own rendering against prometheus_client's ---------------------


def _reference_metrics(registry):
    """prometheus_client's own Histogram and Counters with QueryMetrics' names, help
    texts, labels and buckets: the independent model of what a scrape must show."""
    from prometheus_client import Counter, Histogram

    from kvconductor.http.metrics import MISS_REASONS, QUERY_BUCKETS, ROUTES, TIERS, QueryMetrics

    ours = QueryMetrics()
    docs = {col.name: col.doc for col in ours.collectors()}
    seconds = Histogram(
        "kvconductor_query_seconds",
        docs["kvconductor_query_seconds"],
        ["route"],
        buckets=QUERY_BUCKETS,
        registry=registry,
    )
    counters = {
        name: Counter(name, docs[name], [label], registry=registry)
        for name, label in (
            ("kvconductor_query_blocks", "tier"),
            ("kvconductor_query_misses", "reason"),
            ("kvconductor_query_errors", "route"),
        )
    }
    # bind the label children in QueryMetrics' order (the order they are written in)
    for r in ROUTES:
        seconds.labels(route=r)
    for t in TIERS:
        counters["kvconductor_query_blocks"].labels(tier=t)
    for r in MISS_REASONS:
        counters["kvconductor_query_misses"].labels(reason=r)
    for r in ROUTES:
        counters["kvconductor_query_errors"].labels(route=r)
    return seconds, counters


def _without_created_values(text: str) -> str:
    # the _created lines stay (names and labels compared), their timestamps do not
    return "\n".join(
        line.rsplit(" ", 1)[0] if "_created{" in line else line for line in text.splitlines()
    )


@pytest.mark.parametrize("seed", range(5))
def test_query_metrics_render_exactly_as_prometheus_client(seed):
    """QueryMetrics keeps plain numbers instead of prometheus_client's locked values:
    after the same random observations, its scrape text is byte for byte the one
    prometheus_client's own Histogram and Counters write (bucket edges included)."""
    import random

    from prometheus_client import CollectorRegistry, generate_latest

    from kvconductor.http.metrics import (
        MISS_REASONS,
        QUERY_BUCKETS,
        ROUTES,
        QueryMetrics,
        exposition,
    )

    rnd = random.Random(seed)
    ref_registry, our_registry = CollectorRegistry(), CollectorRegistry()
    seconds, counters = _reference_metrics(ref_registry)
    ours = QueryMetrics(our_registry)
    edges = [*QUERY_BUCKETS, 0.0, 1e-9, 10.0]
    for _ in range(500):
        route = rnd.choice(ROUTES)
        dt = rnd.choice(edges) if rnd.random() < 0.3 else rnd.expovariate(1e3)
        seconds.labels(route=route).observe(dt)
        ours.route_seconds[route].observe(dt)
        n, c, d = (rnd.choice([0, 0, rnd.randrange(1, 10**6)]) for _ in range(3))
        for tier, x in zip(("npu", "cpu", "disk"), (n, c, d), strict=True):
            if x:
                counters["kvconductor_query_blocks"].labels(tier=tier).inc(x)
        ours.count_blocks(n, c, d)
        if rnd.random() < 0.2:
            reason = rnd.choice(MISS_REASONS)
            counters["kvconductor_query_misses"].labels(reason=reason).inc()
            getattr(ours, reason).inc()
        if rnd.random() < 0.1:
            counters["kvconductor_query_errors"].labels(route=route).inc()
            ours.route_errors[route].inc()
    want = _without_created_values(generate_latest(ref_registry).decode())
    got = _without_created_values(exposition(our_registry).decode())
    assert got == want
    assert got.count("_created{") == 2 + 3 + 4 + 2
    # the families' samples (what query_samples sends between processes) say the same
    samples = CollectorRegistry()
    for col in ours.collectors():
        samples.register(col)
    assert _without_created_values(generate_latest(samples).decode()) == want


def test_deferred_metrics_replay_what_an_answer_off_the_loop_counted():
    from kvconductor.http.metrics import DeferredMetrics, QueryMetrics

    qm = QueryMetrics()
    d = DeferredMetrics()
    d.count_blocks(5, 0, 2)
    d.unknown_lora.inc()
    assert qm._npu.value == 0 and qm.unknown_lora.value == 0  # nothing until replayed
    d.replay(qm)
    d2 = DeferredMetrics()
    d2.no_match.inc()
    d2.replay(qm)
    DeferredMetrics().replay(qm)  # an answer that counted nothing
    assert (qm._npu.value, qm._cpu.value, qm._disk.value) == (5, 0, 2)
    assert (qm.unknown_lora.value, qm.no_match.value, qm.unknown_index.value) == (1, 1, 0)
