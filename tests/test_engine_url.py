"""Registration from an engine's URL (``engine_url``; kvconductor/state/engineroute.py and
enginefollow.py): through a real server, with vLLM 0.33.0's own publishers
(``ZmqEventPublisher``, binding port 0 as an engine with ``tcp://*:0`` does) and the body
its API server answers on ``GET /kv_event_sources`` made by vLLM's own route function
and ``KVEventsConfig`` (tests/helpers/realpub.py). The engine's HTTP side is a plain HTTP
server serving that body (vLLM's API server needs torch).
"""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvconductor.coordinator import ConductorClient, ConductorError
from kvconductor.state.engineroute import (
    MAX_BYTES,
    READ_SECS,
    EngineRouteError,
    RankSource,
    parse_sources,
)
from kvconductor.tools.explain import report as explain_report
from kvconductor.urls import UrlError, UrlPolicy, check_url
from tests.helpers.enginehttp import BS, SLOW_MODES, Engine, EngineHttp, hits, until_hits
from tests.helpers.jsonvalues import json_values
from tests.helpers.publishers import free_tcp_port, wait_until
from tests.helpers.realpub import vllm_route
from tests.helpers.server import Server, registration, replica, running, workers

IID = "vllm-a"


@pytest.fixture
def engine(request):
    e = EngineHttp()
    request.addfinalizer(e.close)
    return e


def _endpoints(srv: Server) -> dict:
    return srv.http.get("/workers").json()["workers"][0]["endpoints"]


TOK_A = list(range(100, 108))
TOK_B = list(range(200, 208))
TOK_C = list(range(300, 308))


def test_registered_from_the_engine_url_and_followed_to_new_ports(tmp_path, engine):
    fixed = free_tcp_port()  # vLLM adds the DP rank to a configured port
    eng = Engine(engine, {0: "tcp://*:0", 1: f"tcp://*:{fixed - 1}"})
    try:
        with running(tmp_path) as srv:
            r = srv.http.post("/register", json=registration(IID, engine_url=engine.url))
            assert r.status_code == 201, r.text
            assert r.json() == {"status": "ok"}
            eps = _endpoints(srv)
            cfg0 = eng.pubs[0].get_publisher_config()
            assert eps["0"]["medium_endpoints"] == {"npu": cfg0.endpoint}
            assert eps["0"]["replay_endpoint"] == cfg0.replay_endpoint
            # DP 1 binds the wildcard: the host is the engine URL's
            assert eps["1"]["medium_endpoints"] == {"npu": f"tcp://127.0.0.1:{fixed}"}
            for dp in ("0", "1"):
                assert eps[dp]["engine_url"] == engine.url
                assert eps[dp]["engine_url_state"] == "ok"
                assert eps[dp]["engine_url_error"] is None
            until_hits(srv.http, IID, eng, 0, [1, 2], TOK_A)
            until_hits(srv.http, IID, eng, 1, [3, 4], TOK_B)

            # The engine restarts on new ports (its publishers bind port 0 again); for a
            # while its API server does not answer the route.
            eng.pubs[0].shutdown()
            engine.status, engine.body = 503, b"{}"

            def errored() -> bool:
                return _endpoints(srv)["0"]["engine_url_state"] == "error"

            wait_until(errored, timeout=20, interval=0.2, msg="the failed read shown")
            assert "answered HTTP 503" in _endpoints(srv)["0"]["engine_url_error"]
            ex = srv.http.post(
                "/explain",
                json={"model": "qwen", "token_ids": TOK_A, "block_size": BS},
            )
            assert ex.status_code == 200, ex.text
            said = [w for w in ex.json()["warnings"] if "kv_event_sources" in w]
            err = _endpoints(srv)["0"]["engine_url_error"]
            assert said == [
                f"instance {IID} DP 0: its publishers are read from {engine.url}"
                f"/kv_event_sources, and the last read failed (error: {err}); it is read "
                "again while its subscriptions stay down"
            ]
            # each DP's row says how its engine URL was read, as /workers does
            rows = {i["dp_rank"]: i for i in ex.json()["instances"]}
            assert (
                rows[0]["engine_url"],
                rows[0]["engine_url_state"],
                rows[0]["engine_url_error"],
            ) == (engine.url, "error", err)
            assert (rows[1]["engine_url"], rows[1]["engine_url_state"]) == (engine.url, "ok")
            assert "engine_url_error" not in rows[1]  # omitted when none
            assert (
                f"    engine URL {engine.url}/kv_event_sources: last read error: {err}"
                in explain_report(ex.json())
            )
            t0 = time.monotonic()
            new = eng.up(0)
            assert new != cfg0.endpoint
            until_hits(srv.http, IID, eng, 0, [5, 6], TOK_C)
            took = time.monotonic() - t0
            print(f"engine restarted on new ports: its new blocks answered after {took:.2f}s")
            eps = _endpoints(srv)
            assert eps["0"]["medium_endpoints"] == {"npu": new}
            assert eps["0"]["engine_url_state"] == "ok"
            assert eps["0"]["engine_url_error"] is None
            # the move is a restart of the publisher, as a sequence going back is
            src = next(s for s in srv.http.get("/workers").json()["sources"] if s["url"] == new)
            assert src["restarts"] == 1
            assert "found on new endpoints" in srv.log()
            # DP 1 was not touched
            assert hits(srv.http, IID, TOK_B, 1) == 2
    finally:
        eng.shutdown()


def _refused(srv: Server, engine_url: str, status: int, *words: str) -> None:
    r = srv.http.post("/register", json=registration(IID, engine_url=engine_url))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for w in words:
        assert w in err, err
    assert srv.http.get("/workers").json()["workers"] == []


def test_engines_that_do_not_serve_the_route(tmp_path, engine):
    with running(tmp_path) as srv:
        engine.status = 404
        _refused(srv, engine.url, 422, "answered HTTP 404", "vLLM serves it from 0.33")
        engine.status = 200
        for body, error in [
            (b"<html>", "/kv_event_sources is not JSON"),
            (b"[]", "expected an object of DP ranks, got list"),
            (b'{"0": {"topic": ""}}', "DP rank 0: expected a KVEventsConfig with an endpoint"),
            (b'{"rank0": {"endpoint": "tcp://*:5557"}}', "key 'rank0' is not a DP rank"),
            (b"{}", "lists no KV-event publisher"),
            (b'{"0": {"endpoint": "tcp://*:5557", "publisher": "null"}}', "publishes no events"),
            (
                b'{"1": {"endpoint": "tcp://*:5557"}}',
                "lists DP rank(s) [1], not the registration's",
            ),
        ]:
            engine.body = body
            _refused(srv, engine.url, 422, error)
        engine.status, engine.headers = 302, {"Location": "http://10.9.9.9/kv_event_sources"}
        _refused(srv, engine.url, 422, "answered 302", "redirects are not followed")
        engine.status, engine.headers = 200, {}
        engine.body = json.dumps({"0": {"endpoint": "tcp://*:5557", "pad": "x" * MAX_BYTES}})
        engine.body = engine.body.encode()
        _refused(srv, engine.url, 422, f"over {MAX_BYTES} bytes")
        engine.body, engine.delay = b'{"0": {"endpoint": "tcp://*:5557"}}', READ_SECS + 1
        t0 = time.monotonic()
        _refused(srv, engine.url, 422, "no answer within")
        assert time.monotonic() - t0 < READ_SECS + 1
        engine.delay = 0.0
        closed = f"http://127.0.0.1:{free_tcp_port()}"
        _refused(srv, closed, 422, "the engine cannot be reached")
        _refused(srv, "tcp://127.0.0.1:5557", 400, "expected http://HOST")
        assert "path=/register status=422" in srv.log()
        doc = srv.http.get("/openapi.json").json()
        assert "422" in doc["paths"]["/register"]["post"]["responses"]
        assert "engine_url" in doc["components"]["schemas"]["RegisterRequest"]["properties"]


def test_slow_engines_are_a_422_within_the_time_limit(tmp_path, engine):
    """A slow-loris engine (its headers a byte at a time; its body a byte at a time; its
    body without Content-Length and the connection never closed) is a 422 within the
    documented limits: the whole answer within READ_SECS, however the bytes trickle."""
    engine.body = b'{"0": {"endpoint": "tcp://*:5557"}}'
    with running(tmp_path) as srv:
        for mode in SLOW_MODES:
            engine.slow = mode
            t0 = time.monotonic()
            _refused(srv, engine.url, 422, "no answer within 2s to connect and 3s to read it")
            took = time.monotonic() - t0
            assert READ_SECS - 0.5 < took < READ_SECS + 1.5, (mode, took)
        engine.slow = None
        r = srv.http.post("/register", json=registration(IID, engine_url=engine.url))
        assert r.status_code == 201, r.text


def _answered_then_down(srv: Server, engine: EngineHttp, eng: Engine) -> None:
    """DP 0 registered from the engine's URL, its first blocks answered, then its
    publisher down."""
    r = srv.http.post("/register", json=registration(IID, engine_url=engine.url))
    assert r.status_code == 201, r.text
    until_hits(srv.http, IID, eng, 0, [1, 2], TOK_A)
    eng.pubs[0].shutdown()


def test_the_follower_survives_every_bad_answer(tmp_path, engine):
    """A registered engine restarts; while it comes back its route answers slowly, in
    another shape, not at all or with a 500: each is the DP's ``error`` state, never the
    end of the follower, which finds the engine on its new ports once it answers well."""
    eng = Engine(engine, {0: "tcp://*:0"})
    try:
        with running(tmp_path) as srv:
            _answered_then_down(srv, engine, eng)
            bad = [
                ("slow", "body", b'{"0": {"endpoint": "tcp://*:5557"}}', "no answer within"),
                ("slow", "open", b'{"0": {"endpoint": "tcp://*:5557"}}', "no answer within"),
                ("body", None, b'{"0": {"endpoint": 5}}', "expected a KVEventsConfig"),
                ("body", None, b"\xff[", "is not JSON"),
                ("status", None, b"{}", "answered HTTP 500"),
            ]
            for kind, slow, body, said in bad:
                engine.slow, engine.body = slow, body
                engine.status = 500 if kind == "status" else 200
                gets = engine.gets

                def shown(said=said, gets=gets) -> bool:
                    ep = _endpoints(srv)["0"]
                    return engine.gets > gets and said in (ep["engine_url_error"] or "")

                wait_until(shown, timeout=30, interval=0.2, msg=f"the error {said!r} shown")
                assert _endpoints(srv)["0"]["engine_url_state"] == "error"
            engine.slow, engine.status = None, 200
            new = eng.up(0)
            until_hits(srv.http, IID, eng, 0, [5, 6], TOK_C)
            ep = _endpoints(srv)["0"]
            assert (ep["medium_endpoints"], ep["engine_url_state"]) == ({"npu": new}, "ok")
            assert "engine URL follower: look failed" not in srv.log()
    finally:
        eng.shutdown()


def test_back_on_the_same_port_is_ok_again(tmp_path, engine):
    """An engine on a fixed port goes down and its route fails meanwhile (``error``); it
    comes back on the same port: its sources connect again and the state is ``ok``, the
    warning gone from explain, with no registration again."""
    fixed, replay = free_tcp_port(), free_tcp_port()
    eng = Engine(engine, {0: f"tcp://*:{fixed}"}, {0: f"tcp://*:{replay}"})
    try:
        with running(tmp_path) as srv:
            _answered_then_down(srv, engine, eng)
            engine.status, engine.body = 503, b"{}"
            wait_until(
                lambda: _endpoints(srv)["0"]["engine_url_state"] == "error",
                timeout=20,
                interval=0.2,
                msg="the failed read shown",
            )
            back = eng.up(0, f"tcp://*:{fixed}", f"tcp://*:{replay}")
            assert back.endswith(f":{fixed}")
            until_hits(srv.http, IID, eng, 0, [5, 6], TOK_C)
            wait_until(
                lambda: _endpoints(srv)["0"]["engine_url_state"] == "ok",
                timeout=10,
                interval=0.2,
                msg="ok again once its sources connected",
            )
            assert _endpoints(srv)["0"]["engine_url_error"] is None
            ex = srv.http.post(
                "/explain", json={"model": "qwen", "token_ids": TOK_A, "block_size": BS}
            )
            assert [w for w in ex.json()["warnings"] if "kv_event_sources" in w] == []
            (row,) = ex.json()["instances"]
            assert (row["engine_url"], row["engine_url_state"]) == (engine.url, "ok")
            assert "engine found again" not in srv.log()  # the same endpoints: no move
    finally:
        eng.shutdown()


def test_the_url_rules_apply_to_the_engine_and_its_endpoints(tmp_path, engine):
    with running(tmp_path, "--endpoint-networks", "10.0.0.0/8") as srv:
        engine.body = b'{"0": {"endpoint": "tcp://10.1.2.3:5557"}}'
        _refused(srv, engine.url, 400, "127.0.0.1 is outside --endpoint-networks")
        _refused(srv, "http://engine.example:8000", 400, "host names are not accepted")
    with running(tmp_path, "--endpoint-networks", "127.0.0.0/8") as srv:
        engine.body = b'{"0": {"endpoint": "tcp://10.1.2.3:5557"}}'
        _refused(srv, engine.url, 422, "DP rank 0 endpoint", "10.1.2.3 is outside")
        engine.body = b'{"0": {"endpoint": "ipc:///tmp/kv"}}'
        _refused(srv, engine.url, 422, "ipc:// endpoints are disabled")
        engine.body = b'{"0": {"endpoint": "tcp://*:5557"}}'
        r = srv.http.post("/register", json=registration(IID, engine_url=engine.url))
        assert r.status_code == 201, r.text
        assert _endpoints(srv)["0"]["medium_endpoints"] == {"npu": "tcp://127.0.0.1:5557"}


def test_with_workers_and_across_a_warm_restart(tmp_path, engine):
    """``--workers 2``: the registration (made by the owner, to which a worker hands it)
    and the answers from the workers; the snapshot keeps ``engine_url``, and the restarted
    server reads it again: the engine, restarted meanwhile on new ports, is followed."""
    snap = tmp_path / "snap"
    eng = Engine(engine, {0: "tcp://*:0"})
    try:
        with running(tmp_path, "--workers", "2", "--snapshot-dir", str(snap)) as srv:
            r = srv.http.post("/register", json=registration(IID, engine_url=engine.url))
            assert r.status_code == 201, r.text
            until_hits(srv.http, IID, eng, 0, [1, 2], TOK_A)
        eng.shutdown()
        eng = Engine(engine, {0: "tcp://*:0"})  # new ports while the server was down
        new = eng.pubs[0].get_publisher_config()
        with running(tmp_path, "--snapshot-dir", str(snap)) as srv:
            until_hits(srv.http, IID, eng, 0, [5, 6], TOK_C)
            eps = _endpoints(srv)
            assert eps["0"]["medium_endpoints"] == {"npu": new.endpoint}
            assert eps["0"]["engine_url"] == engine.url
            assert eps["0"]["engine_url_state"] == "ok"
    finally:
        eng.shutdown()


def test_the_client_registers_an_engine_url(tmp_path, engine):
    eng = Engine(engine, {0: "tcp://*:0"})
    try:
        with running(tmp_path) as srv, ConductorClient(srv.url) as c:
            fields = {"instance_id": IID, "type": "vLLM", "modelname": "qwen", "block_size": BS}
            assert c.register(**fields, dp_rank=0, engine_url=engine.url) == {"status": "ok"}
            until_hits(srv.http, IID, eng, 0, [1, 2], TOK_A)
            engine.status = 404
            with pytest.raises(ConductorError) as ex:
                c.register(**fields, dp_rank=0, engine_url=engine.url)
            assert ex.value.status_code == 422
            assert "answered HTTP 404" in str(ex.value)
    finally:
        eng.shutdown()


def test_wildcard_hosts_are_the_engines():
    """vLLM's rendering of publishers binding every interface (DP rank offsets applied
    by vLLM's publisher, so given here as they are listed): the host is the engine's."""
    cfg, render = vllm_route()
    body = render(
        {
            0: cfg(
                enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:6667"
            ),
            1: cfg(enable_kv_cache_events=True, endpoint="tcp://0.0.0.0:5558"),
            2: cfg(enable_kv_cache_events=True, endpoint="tcp://[::]:5559", topic="kv"),
            3: cfg(enable_kv_cache_events=True, endpoint="tcp://10.0.0.9:41001"),
        }
    )
    got = parse_sources(body, "[fd00::5]", UrlPolicy())
    assert got == {
        0: RankSource("tcp://[fd00::5]:5557", "tcp://[fd00::5]:6667"),
        1: RankSource("tcp://[fd00::5]:5558", None),
        2: RankSource("tcp://[fd00::5]:5559", None),
        3: RankSource("tcp://10.0.0.9:41001", None),  # port 0 bound on the node's IP
    }


def test_replicas_apply_the_endpoints_read_and_follow_alike(tmp_path, engine, valkey_server):
    """``--state-url``: the replica that took the registration read the engine; the log
    carries the endpoints read, so the other applies the same; both follow the engine to
    its new ports (their re-registrations are identical)."""
    eng = Engine(engine, {0: "tcp://*:0"})
    try:
        with (
            replica(tmp_path, valkey_server, "a") as a,
            replica(tmp_path, valkey_server, "b") as b,
        ):
            r = a.http.post("/register", json=registration(IID, engine_url=engine.url))
            assert r.status_code == 201, r.text
            want = {"npu": eng.pubs[0].get_publisher_config().endpoint}
            wait_until(lambda: workers(b)["workers"] != [], msg="the registration on b")
            assert _endpoints(b)["0"]["medium_endpoints"] == want
            assert _endpoints(b)["0"]["engine_url"] == engine.url
            until_hits(a.http, IID, eng, 0, [1, 2], TOK_A)
            wait_until(lambda: hits(b.http, IID, TOK_A, 0) == 2, msg="the blocks on b")
            eng.pubs[0].shutdown()
            new = eng.up(0)
            until_hits(b.http, IID, eng, 0, [5, 6], TOK_C)
            wait_until(lambda: hits(a.http, IID, TOK_C, 0) == 2, msg="the new blocks on a")
            for s in (a, b):
                assert _endpoints(s)["0"]["medium_endpoints"] == {"npu": new}
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "body,error",
    [
        (b"[" * 100_000, "is not JSON"),
        (b'{"' + b"1" * 5000 + b'": {"endpoint": "tcp://*:1"}}', "is not a DP rank"),
        (b'{"4294967296": {"endpoint": "tcp://*:1"}}', "is not a DP rank"),
        (b'{"0": {"endpoint": "tcp://*:1", "enable_kv_cache_events": false}}', "no events"),
        (b'{"0": {"endpoint": "tcp://*:1", "replay_endpoint": 5}}', "replay_endpoint is int"),
        (b'{"0": {"endpoint": 5557}}', "expected a KVEventsConfig with an endpoint"),
        (b'{"0": "tcp://*:1"}', "expected a KVEventsConfig with an endpoint"),
        (b"\xff\xfe", "is not JSON"),
    ],
)
def test_what_an_engine_sends_is_an_error_never_a_crash(body, error):
    with pytest.raises(EngineRouteError) as ex:
        parse_sources(body, "10.0.0.5", UrlPolicy())
    assert ex.value.status == 422 and error in str(ex.value)


#: JSON values near what an engine answers: DP-rank-like keys, KVEventsConfig-like
#: entries whose fields hold any JSON value, endpoints the URL rules take and refuse.
_values = json_values(
    ["tcp://*:5557", "tcp://0.0.0.0:1", "tcp://[::]:2", "tcp://10.0.0.9:41001",
     "tcp://[::1", "tcp://*:99999", "tcp://*:", "ipc:///tmp/kv", "tcp://\x00:1",
     "tcp://[fe80::1%eth0]:5", "zmq", "null", "", "http://10.0.0.5:8000"],
    nan=True,
    max_size=4,
    max_leaves=12,
)  # fmt: skip
_fields = st.sampled_from(
    ["endpoint", "replay_endpoint", "publisher", "enable_kv_cache_events", "topic"]
)
_keys = (
    st.integers(min_value=0, max_value=2**40).map(str)
    | st.sampled_from(["0", "00", "-1", "1_0", " 1", "\u0663", "4294967295"])
    | st.text(max_size=12)
)
_answers = _values | st.dictionaries(
    _keys, st.dictionaries(_fields, _values, max_size=5) | _values, max_size=4
)


@settings(max_examples=int(os.environ.get("KVC_DIFFERENTIAL_EXAMPLES", "200")) * 2)
@given(doc=_answers, host=st.sampled_from(["10.0.0.5", "[fd00::5]", "127.0.0.1"]))
@example(
    doc={"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}}, host="10.0.0.5"
)
def test_any_json_an_engine_sends_is_its_sources_or_a_422(doc, host):
    """Whatever JSON the route answers: the DP ranks and their publishers, every endpoint
    one the URL rules take and a wildcard host the engine's, or an EngineRouteError 422;
    never another exception (which would end a registration in a 500)."""
    policy = UrlPolicy()
    body = json.dumps(doc).encode()
    try:
        got = parse_sources(body, host, policy)
    except EngineRouteError as ex:
        assert ex.status == 422 and str(ex).startswith("engine_url 'the engine': ")
        return
    assert isinstance(doc, dict) and got and set(got) == {int(k) for k in doc}
    for rank, src in got.items():
        cfg = [v for k, v in doc.items() if int(k) == rank][-1]  # the last of "0", "00"
        for url in (src.endpoint, src.replay_endpoint):
            if url is None:
                continue
            try:
                check_url(url, "endpoint", policy)
            except UrlError as ex:  # only a replay endpoint may be refused as a data one
                assert url == src.replay_endpoint, ex
            assert "*" not in url and "0.0.0.0" not in url and "[::]" not in url
        assert src.endpoint.split(":")[-1] == cfg["endpoint"].split(":")[-1]


def test_a_rank_the_engine_no_longer_lists_stays_registered_in_error(tmp_path, engine):
    """The engine comes back with fewer DP ranks. The rank it no longer lists stays
    registered (a registration is the Coordinator's to end: ``POST /unregister``), in
    ``error`` naming the ranks listed; its sources are down, so its HBM hits are muted
    after ``--source-down-secs`` as any down engine's; the rank still listed is untouched.
    Listed again, on a new port, the rank is found there and answered again."""
    eng = Engine(engine, {0: "tcp://*:0", 1: "tcp://*:0"})
    try:
        with running(tmp_path, "--source-down-secs", "1") as srv:
            r = srv.http.post("/register", json=registration(IID, engine_url=engine.url))
            assert r.status_code == 201, r.text
            until_hits(srv.http, IID, eng, 0, [1, 2], TOK_A)
            until_hits(srv.http, IID, eng, 1, [3, 4], TOK_B)
            eng.pubs.pop(1).shutdown()
            engine.serve({0: eng.pubs[0].get_publisher_config()})
            wait_until(
                lambda: _endpoints(srv)["1"]["engine_url_state"] == "error",
                timeout=20,
                interval=0.2,
                msg="the unlisted rank's error shown",
            )
            said = _endpoints(srv)["1"]["engine_url_error"]
            assert "lists DP rank(s) [0], not the registration's dp_rank 1" in said
            wait_until(
                lambda: hits(srv.http, IID, TOK_B, 1) == 0,
                timeout=20,
                interval=0.2,
                msg="the down rank's hits muted",
            )
            assert hits(srv.http, IID, TOK_A, 0) == 2
            assert _endpoints(srv)["0"]["engine_url_state"] == "ok"
            assert sorted(_endpoints(srv)) == ["0", "1"]  # still registered
            new = eng.up(1)
            until_hits(srv.http, IID, eng, 1, [5, 6], TOK_C)
            ep = _endpoints(srv)["1"]
            assert (ep["medium_endpoints"], ep["engine_url_state"]) == ({"npu": new}, "ok")
            assert ep["engine_url_error"] is None
    finally:
        eng.shutdown()
