"""Network security of the real server: Origin/CORS rules, /workers protection, TLS.

Every test talks to ``python -m kvconductor`` over loopback HTTP(S).
"""
from __future__ import annotations

import pytest
from test_server import Server

pytestmark = pytest.mark.server

UI = "https://ui.example"
EVIL = "https://evil.example"
REG = {"instance_id": "w1", "type": "vLLM", "modelname": "qwen", "block_size": 4, "dp_rank": 0}
UNREG = dict(REG)
EVENTS = {"instance_id": "w1", "events": []}


@pytest.fixture(scope="module")
def origin_server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("origin"), "--host", "127.0.0.1",
                 "--allow-origin", UI, "--allow-origin", "http://localhost:3000")
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            code, _ = srv.terminate()
            assert code == 0, srv.log()


@pytest.mark.parametrize("path,body", [("/register", REG), ("/unregister", UNREG),
                                       ("/events", EVENTS)])
def test_cross_site_simple_post_is_refused(origin_server, path, body):
    """What a page on another site can send without a preflight: text/plain, any body."""
    import json

    r = origin_server.http.post(path, content=json.dumps(body),
                                headers={"Origin": EVIL, "Content-Type": "text/plain"})
    assert r.status_code == 403, r.text
    assert r.headers["content-type"] == "application/json"
    assert "not allowed" in r.json()["error"] and EVIL in r.json()["error"]
    assert "access-control-allow-origin" not in r.headers
    assert origin_server.http.get("/workers").json()["workers"] == []
    assert f"cross-origin request refused method=POST path={path} origin={EVIL}" in \
        origin_server.log()


def test_null_origin_is_refused(origin_server):
    r = origin_server.http.post("/register", json=REG, headers={"Origin": "null"})
    assert r.status_code == 403


def test_requests_without_origin_work_like_curl(origin_server):
    """curl -d '{...}' sends application/x-www-form-urlencoded and no Origin."""
    import json

    r = origin_server.http.post("/register", content=json.dumps(REG),
                                headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 201, r.text
    assert "access-control-allow-origin" not in r.headers
    r = origin_server.http.post("/events", content=json.dumps(EVENTS),
                                headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    r = origin_server.http.post("/unregister", content=json.dumps(UNREG))
    assert r.status_code == 200


def test_allowed_origin_gets_its_own_cors_headers(origin_server):
    r = origin_server.http.post("/register", json=REG, headers={"Origin": UI})
    assert r.status_code == 201
    assert r.headers["access-control-allow-origin"] == UI
    assert "origin" in r.headers["vary"].lower()
    r = origin_server.http.post("/unregister", json=UNREG,
                                headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_preflight_of_mutating_routes(origin_server):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization"}
    for path in ("/register", "/unregister", "/events"):
        r = origin_server.http.options(path, headers={"Origin": EVIL, **pre})
        assert r.status_code == 403 and r.json()["error"]
        assert not any(k.startswith("access-control-") for k in r.headers), r.headers
        r = origin_server.http.options(path, headers={"Origin": UI, **pre})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == UI
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "content-type, authorization"


def test_read_routes_keep_cors_for_any_origin(origin_server):
    http = origin_server.http
    r = http.get("/health", headers={"Origin": EVIL})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    for path in ("/query", "/query_by_hash"):  # QueryFastPath
        r = http.post(path, json={"model": "m", "block_size": 4, "token_ids": [1],
                                  "block_hashes": [1]}, headers={"Origin": EVIL})
        assert r.status_code == 404 and r.headers["access-control-allow-origin"] == "*"
        r = http.options(path, headers={"Origin": EVIL, "Access-Control-Request-Method": "POST",
                                        "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]


def test_workers_is_not_readable_cross_site(origin_server):
    r = origin_server.http.get("/workers", headers={"Origin": EVIL})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = origin_server.http.get("/workers", headers={"Origin": UI})
    assert r.headers["access-control-allow-origin"] == UI


@pytest.mark.parametrize("open_workers", [False, True])
def test_workers_needs_the_api_key(tmp_path, open_workers):
    args = ["--host", "127.0.0.1", "--api-key", "k"] + (["--open-workers"] if open_workers else [])
    srv = Server(tmp_path, *args)
    try:
        srv.wait_ready()
        r = srv.http.get("/workers")
        if open_workers:
            assert r.status_code == 200
        else:
            assert r.status_code == 401 and r.json()["error"]
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert "unauthorized request method=GET path=/workers" in srv.log()
        r = srv.http.get("/workers", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["workers"] == []
        assert srv.http.get("/health").status_code == 200  # reads stay open
    finally:
        code, _ = srv.terminate()
        assert code == 0, srv.log()
