"""What a registration (and every id or name) may carry, through the real server.

* An id or a name with a control character (NUL, newline, ESC, DEL, C1) used to be
  registered and written raw into the text log, where a newline followed by a time and
  ``ERROR`` forged a line. It is now a 400 naming the field, on V3 and on the Mooncake
  dialect (``--mooncake-port``), and nothing changes; a pool event over ZeroMQ carrying
  one is dropped and counted (``invalid_event``); and the log writes every message's
  control characters escaped, whatever put them there.
* A registration field the service does not know (``store_onyl``) used to be ignored
  silently on V3: it is still accepted (clients send extra fields) and named in one WARN
  per (instance, field). ``store_only`` is our own object: a key it does not know
  (``{"ttl": 5}``, which used to leave the 600 s default in place) is a 400.
"""

from __future__ import annotations

import re

import httpx
import msgspec
import pytest

from tests.helpers.publishers import PoolPublisher, mooncake_tuple, wait_until
from tests.helpers.server import Server, free_port

BS = 4
#: A value that, written raw, starts a log line of its own at level ERROR.
FORGED = "x\n2026-12-07T00:00:00.000000Z ERROR forged"
BAD = ["a\nb", "nul\x00", "esc\x1b[31m", "del\x7f", "c1\x85"]
WORDS = "Expected `str` without control characters (U+0000-U+001F, U+007F-U+009F)"
#: A log line as the text format writes it, from its start.
LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z +(DEBUG|INFO|WARN|ERROR) ", re.M)


def refused(path: str, kind: str = "JSON") -> str:
    return f"invalid {kind} request body: {WORDS} - at {path}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = Server(tmp_path_factory.mktemp("reginput"), "--mooncake-port", str(port))
    srv.mc = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
    srv.wait_ready()
    yield srv
    srv.mc.close()
    srv.terminate()


def registration(**kw) -> dict:
    return {
        "instance_id": "vllm-prefill-1",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": BS,
        "dp_rank": 0,
        **kw,
    }


def events(event: dict | None = None, **kw) -> dict:
    ev = {
        "event_id": 1,
        "event_type": "stored",
        "blocks": [{"block_hash": 1, "tokens_hash": 2}],
        **(event or {}),
    }
    return {"instance_id": "vllm-prefill-1", "events": [ev], **kw}


def mooncake_registration(**kw) -> dict:
    return {
        "endpoint": "tcp://127.0.0.1:5557",
        "type": "vLLM",
        "modelname": "qwen",
        "instance_id": "mc-prefill-1",
        "block_size": BS,
        "dp_rank": 0,
        "hash_profile": {
            "strategy": "s",
            "algorithm": "a",
            "python_hash_seed": "0",
            "index_projection": "p",
        },
        **kw,
    }


def lines_of(log: str, text: str) -> list[str]:
    return [ln for ln in log.splitlines() if text in ln]


def forged_lines(log: str) -> list[str]:
    """Lines that start where :data:`FORGED`'s newline would start one."""
    return [ln for ln in log.splitlines() if ln.startswith("2026-12-07T00:00:00")]


V3_CASES = [
    ("/register", lambda v: registration(instance_id=v), "`$.instance_id`"),
    ("/register", lambda v: registration(type=v), "`$.type`"),
    ("/register", lambda v: registration(modelname=v), "`$.modelname`"),
    ("/register", lambda v: registration(tenant_id=v), "`$.tenant_id`"),
    ("/register", lambda v: registration(node_id=v), "`$.node_id`"),
    ("/register", lambda v: registration(store_backend=v), "`$.store_backend`"),
    (
        "/register",
        lambda v: registration(medium_endpoints={v: "tcp://127.0.0.1:5557"}),
        "`key` in `$.medium_endpoints`",
    ),
    ("/unregister", lambda v: registration(instance_id=v), "`$.instance_id`"),
    ("/events", lambda v: events(instance_id=v), "`$.instance_id`"),
    ("/events", lambda v: events(model_name=v), "`$.model_name`"),
    ("/events", lambda v: events({"backend_id": v}), "`$.events[0].backend_id`"),
    ("/events", lambda v: events({"medium": v}), "`$.events[0].medium`"),
    ("/events", lambda v: events({"lora_name": v}), "`$.events[0].lora_name`"),
    ("/events", lambda v: events({"event_type": v}), "`$.events[0].event_type`"),
    ("/events", lambda v: events({"type": v}), "`$.events[0].type`"),
    (
        "/events",
        lambda v: events({"data": {"backend_id": v}}),
        "`$.events[0].data.backend_id`",
    ),
    (
        "/events",
        lambda v: {
            "instance_id": "vllm-prefill-1",
            "events": [events()["events"][0], {**events()["events"][0], "medium": v}],
        },
        "`$.events[1].medium`",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=["newline", "nul", "esc", "del", "c1"])
@pytest.mark.parametrize(
    ("route", "make", "path"), V3_CASES, ids=[f"{r} {p}" for r, _, p in V3_CASES]
)
def test_a_control_character_in_an_id_or_name_is_a_v3_400(server, route, make, path, bad):
    r = server.http.post(route, json=make(bad))
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"error": refused(path)}


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("field", ["instance_id", "modelname", "tenant_id", "type"])
def test_a_control_character_is_a_dialect_400_in_the_request_encoding(server, field, msgpack):
    body = mooncake_registration(**{field: FORGED})
    if msgpack:
        r = server.mc.post(
            "/register",
            content=msgspec.msgpack.encode(body),
            headers={"Content-Type": "application/msgpack"},
        )
        assert r.headers["content-type"].startswith("application/msgpack")
        doc = msgspec.msgpack.decode(r.content)
    else:
        r = server.mc.post("/register", json=body)
        assert r.headers["content-type"].startswith("application/json")
        doc = r.json()
    assert r.status_code == 400, r.content
    assert doc == {
        "error": f"invalid registration: {WORDS} - at `$.{field}`",
        "reason": "invalid_value",
    }


@pytest.mark.parametrize("field", ["model", "tenant_id", "lora_name", "instance_id"])
def test_a_control_character_in_a_dialect_query_is_a_400(server, field):
    body = {"model": "qwen", "block_size": BS, "token_ids": [1, 2, 3, 4], field: FORGED}
    r = server.mc.post("/query", json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": f"invalid query: {WORDS} - at `$.{field}`",
        "reason": "invalid_value",
    }


def test_after_the_refusals_nothing_is_registered_and_no_line_is_forged(server):
    for route, make, _ in V3_CASES:
        server.http.post(route, json=make(FORGED))
    for field in ("instance_id", "modelname"):
        server.mc.post("/register", json=mooncake_registration(**{field: FORGED}))
    doc = server.http.get("/workers").json()
    assert doc["workers"] == [] and doc["indexer"] == []
    assert server.mc.get("/services").json()["services"] == []
    log = server.log()
    assert lines_of(log, "forged") == [] and forged_lines(log) == []
    # each refusal has its one WARN line, naming the field and not the value
    bad = lines_of(log, "WARN bad request method=POST path=/register status=400")
    assert any(ln.endswith(f"{WORDS} - at `$.instance_id`") for ln in bad)
    assert server.http.get("/health").text == "OK"


def test_the_log_escapes_control_characters_whatever_wrote_them(server):
    """A field name is not an id: the dialect accepts it and names it in a WARN (as it
    always did), and that line stays one line, its control characters escaped."""
    body = mooncake_registration(instance_id="mc-escape", **{FORGED: 1})
    r = server.mc.post("/register", json=body)
    assert r.status_code == 200, r.text
    wait_until(lambda: lines_of(server.log(), "fields ignored: x"), msg="the WARN line")
    log = server.log()
    (line,) = lines_of(log, "fields ignored: x")
    assert "fields ignored: x\\x0a2026-12-07T00:00:00.000000Z ERROR forged" in line
    assert LINE.match(line)
    assert forged_lines(log) == []


@pytest.mark.parametrize("field", ["model", "tenant_id"])
def test_a_query_naming_no_index_logs_its_names_escaped(server, field):
    """V3's query routes do not look for control characters (the compiled parser reads
    the names; nothing changes): the 404 is logged, its names escaped."""
    body = {"model": "qwen", "block_size": BS, "token_ids": [1, 2, 3, 4], field: FORGED}
    r = server.http.post("/query", json=body)
    assert r.status_code == 404
    tenant = body.get("tenant_id", "default")
    assert r.json() == {"error": f"no indexer for model={body['model']} tenant={tenant}"}
    want = "query for unknown indexer path=/query error=no indexer for model="
    wait_until(lambda: len(lines_of(server.log(), want)) >= 1, msg="the INFO line")
    log = server.log()
    assert any("x\\x0a2026-12-07T00:00:00.000000Z ERROR forged" in ln for ln in lines_of(log, want))
    assert forged_lines(log) == []


def test_a_pool_event_with_a_control_character_is_dropped_and_counted(server):
    pool = PoolPublisher()
    try:
        r = server.http.post(
            "/register",
            json=registration(
                instance_id="yuanrong-pool-127.0.0.1-qwen",
                store_backend="YuanRong",
                medium_endpoints={"cpu": pool.url},
            ),
        )
        assert r.status_code == 201, r.text
        pool.wait_subscribed()
        ev = {"event_id": 1, "event_type": "stored", "medium": "cpu", "seq_hashes": [7]}

        def src() -> dict:
            (s,) = [
                s
                for s in server.http.get("/workers").json()["sources"]
                if s["instance_id"] == "yuanrong-pool-127.0.0.1-qwen"
            ]
            return s

        def dropped() -> bool:
            pool.publish(mooncake_tuple([{**ev, "backend_id": "127.0.0.1" + FORGED}]))
            return src()["dropped"].get("invalid_event", 0) >= 1

        wait_until(dropped, timeout=10, msg="the pool event dropped as invalid_event")
        assert set(src()["dropped"]) == {"invalid_event"}
        assert forged_lines(server.log()) == []
    finally:
        server.http.post(
            "/unregister",
            json=registration(instance_id="yuanrong-pool-127.0.0.1-qwen"),
        )
        pool.stop()


# -- unknown and wrong-shaped registration fields ------------------------------------------


def test_an_unknown_v3_field_is_accepted_and_named_once_per_instance(server):
    body = registration(instance_id="typo-1", store_onyl=True)
    assert server.http.post("/register", json=body).status_code == 201
    warned = "registration: fields ignored: store_onyl (instance_id=typo-1;"
    assert len(lines_of(server.log(), warned)) == 1
    # again: accepted, no new WARN; another instance's field is named for it
    assert server.http.post("/register", json=body).status_code == 201
    body2 = registration(instance_id="typo-2", store_onyl=True, ttl=5)
    assert server.http.post("/register", json=body2).status_code == 201
    log = server.log()
    assert len(lines_of(log, warned)) == 1
    assert len(lines_of(log, "fields ignored: store_onyl, ttl (instance_id=typo-2;")) == 1
    # the default applies: a registration without store_only
    ws = {w["instance_id"]: w for w in server.http.get("/workers").json()["workers"]}
    assert "store_only" not in ws["typo-1"]["endpoints"]["0"]
    for iid in ("typo-1", "typo-2"):
        assert (
            server.http.post("/unregister", json=registration(instance_id=iid)).status_code == 200
        )


def test_an_unknown_dialect_field_is_named_once_per_instance(server):
    body = mooncake_registration(instance_id="mc-typo", lora_idd=3)
    for _ in range(2):
        assert server.mc.post("/register", json=body).status_code == 200
    warned = "mooncake dialect: register: fields ignored: lora_idd (instance_id=mc-typo;"
    assert len(lines_of(server.log(), warned)) == 1


WRONG_SHAPES = [
    (
        registration(store_only={"ttl": 5}),
        "invalid JSON request body: Object contains unknown field `ttl` - at `$.store_only`",
    ),
    (
        registration(store_only={"ttl_secs": "5"}),
        "invalid JSON request body: Expected `float`, got `str` - at `$.store_only.ttl_secs`",
    ),
    (
        registration(store_only="yes"),
        "invalid JSON request body: Expected `bool | object | null`, got `str` - at `$.store_only`",
    ),
    (
        registration(dp_rank="0"),
        "invalid JSON request body: Expected `int`, got `str` - at `$.dp_rank`",
    ),
    (
        registration(medium_endpoints={"npu": 5557}),
        "invalid JSON request body: Expected `str`, got `int` - at `$.medium_endpoints[...]`",
    ),
]


@pytest.mark.parametrize(
    ("n", "body", "error"),
    [(n, b, e) for n, (b, e) in enumerate(WRONG_SHAPES)],
    ids=[e[-40:] for _, e in WRONG_SHAPES],
)
def test_a_known_field_of_the_wrong_shape_is_a_400(server, n, body, error):
    """The first case is new (store_only's unknown key); the others were 400s already and
    stay so."""
    iid = f"shape-{n}"
    r = server.http.post("/register", json={**body, "instance_id": iid})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": error}
    ws = server.http.get("/workers").json()["workers"]
    assert iid not in [w["instance_id"] for w in ws]


def test_store_only_with_its_own_keys_still_registers(server):
    body = registration(instance_id="so-1", store_only={"ttl_secs": 5, "capacity": 10})
    r = server.http.post("/register", json=body)
    assert r.status_code == 201, r.text
    ws = {w["instance_id"]: w for w in server.http.get("/workers").json()["workers"]}
    assert ws["so-1"]["endpoints"]["0"]["store_only"] == {"ttl_secs": 5.0, "capacity": 10}
    assert server.http.post("/unregister", json=registration(instance_id="so-1")).status_code == 200


def test_with_workers_the_owner_refuses_warns_once_and_every_process_escapes(tmp_path):
    """``--workers 2``: a worker hands /register to the owner (its 400, its one WARN) and
    answers the query itself (its log line escaped)."""
    srv = Server(tmp_path, "--workers", "2")
    try:
        srv.wait_ready()
        r = srv.http.post("/register", json=registration(instance_id=FORGED))
        assert r.status_code == 400
        assert r.json() == {"error": refused("`$.instance_id`")}
        body = registration(instance_id="w1", store_onyl=True)
        assert [srv.http.post("/register", json=body).status_code for _ in range(3)] == [201] * 3
        q = {"model": FORGED, "block_size": BS, "token_ids": [1, 2, 3, 4]}
        assert srv.http.post("/query", json=q).status_code == 404
        assert srv.http.get("/workers").json()["workers"][0]["instance_id"] == "w1"
    finally:
        srv.terminate()
    log = srv.log()
    (warned,) = lines_of(log, "fields ignored: store_onyl")
    assert "WARN [owner pid=" in warned and "(instance_id=w1;" in warned
    (query,) = lines_of(log, "query for unknown indexer")
    assert "[worker-" in query and "model=x\\x0a2026-12-07T00:00:00.000000Z ERROR forged" in query
    assert forged_lines(log) == []
