"""Network security of the real server: Origin/CORS rules, /workers protection, TLS.

Every test talks to ``python -m kvconductor`` over loopback HTTP(S).
"""

from __future__ import annotations

import signal
import socket
import time

import httpx
import pytest

from tests.helpers.server import Server, run_cli, running, tls_server, trusting

pytestmark = pytest.mark.server

UI = "https://ui.example"
EVIL = "https://evil.example"
REG = {"instance_id": "w1", "type": "vLLM", "modelname": "qwen", "block_size": 4, "dp_rank": 0}
UNREG = dict(REG)
EVENTS = {"instance_id": "w1", "events": []}


@pytest.fixture(scope="module")
def origin_server(tmp_path_factory):
    with running(
        tmp_path_factory.mktemp("origin"),
        "--host",
        "127.0.0.1",
        "--allow-origin",
        UI,
        "--allow-origin",
        "http://localhost:3000",
    ) as srv:
        yield srv


@pytest.mark.parametrize(
    "path,body", [("/register", REG), ("/unregister", UNREG), ("/events", EVENTS)]
)
def test_cross_site_simple_post_is_refused(origin_server, path, body):
    """What a page on another site can send without a preflight: text/plain, any body."""
    import json

    r = origin_server.http.post(
        path, content=json.dumps(body), headers={"Origin": EVIL, "Content-Type": "text/plain"}
    )
    assert r.status_code == 403, r.text
    assert r.headers["content-type"] == "application/json"
    assert "not allowed" in r.json()["error"] and EVIL in r.json()["error"]
    assert "access-control-allow-origin" not in r.headers
    assert origin_server.http.get("/workers").json()["workers"] == []
    assert (
        f"cross-origin request refused method=POST path={path} origin={EVIL}" in origin_server.log()
    )


def test_null_origin_is_refused(origin_server):
    r = origin_server.http.post("/register", json=REG, headers={"Origin": "null"})
    assert r.status_code == 403


def test_requests_without_origin_work_like_curl(origin_server):
    """curl -d '{...}' sends application/x-www-form-urlencoded and no Origin."""
    import json

    r = origin_server.http.post(
        "/register",
        content=json.dumps(REG),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 201, r.text
    assert "access-control-allow-origin" not in r.headers
    r = origin_server.http.post(
        "/events",
        content=json.dumps(EVENTS),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200
    r = origin_server.http.post("/unregister", content=json.dumps(UNREG))
    assert r.status_code == 200


def test_allowed_origin_gets_its_own_cors_headers(origin_server):
    r = origin_server.http.post("/register", json=REG, headers={"Origin": UI})
    assert r.status_code == 201
    assert r.headers["access-control-allow-origin"] == UI
    assert "origin" in r.headers["vary"].lower()
    r = origin_server.http.post(
        "/unregister", json=UNREG, headers={"Origin": "http://localhost:3000"}
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_preflight_of_mutating_routes(origin_server):
    pre = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
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
        r = http.post(
            path,
            json={"model": "m", "block_size": 4, "token_ids": [1], "block_hashes": [1]},
            headers={"Origin": EVIL},
        )
        assert r.status_code == 404 and r.headers["access-control-allow-origin"] == "*"
        r = http.options(
            path,
            headers={
                "Origin": EVIL,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
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


# -- TLS ------------------------------------------------------------------------------------


def test_https(tmp_path, pki):
    srv = tls_server(tmp_path, pki, "--request-timeout-secs", "1")
    try:
        srv.wait_ready()
        r = srv.http.get("/health")
        assert r.status_code == 200 and r.text == "OK"
        assert r.http_version == "HTTP/1.1"
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"{srv.url}/health", timeout=5)
        # A TCP connection that never starts the handshake is closed by the request deadline.
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        t0 = time.monotonic()
        assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3.0
        s.close()
        assert "HTTP limits" in srv.log() and "tls=on client_certs=off" in srv.log()
    finally:
        code, _ = srv.terminate()
        assert code == 0, srv.log()


def test_cert_file_holding_the_key(tmp_path, pki):
    srv = Server(tmp_path, "--host", "127.0.0.1", "--tls-cert", pki["combined"])
    srv.url = f"https://127.0.0.1:{srv.port}"
    srv.http = httpx.Client(base_url=srv.url, timeout=10.0, verify=trusting(pki))
    try:
        srv.wait_ready()
    finally:
        code, _ = srv.terminate()
        assert code == 0, srv.log()


def test_client_certificates(tmp_path, pki):
    srv = tls_server(tmp_path, pki, "--tls-client-ca", pki["client_ca"])
    srv.http = httpx.Client(base_url=srv.url, timeout=10.0, verify=trusting(pki, pki["client"]))
    try:
        srv.wait_ready()
        assert srv.http.get("/health").status_code == 200
        for ctx in (trusting(pki), trusting(pki, pki["other_client"])):
            with pytest.raises(httpx.TransportError), httpx.Client(verify=ctx, timeout=5) as http:
                http.get(f"{srv.url}/health")
        # The Python client passes verify= and cert= through.
        from kvconductor.client import ConductorClient

        with ConductorClient(srv.url, verify=pki["ca"], cert=pki["client"]) as c:
            assert c.health() and c.workers()["workers"] == []
        with ConductorClient(srv.url, verify=pki["ca"]) as c:
            assert not c.health()
        assert "Traceback" not in srv.log()
    finally:
        code, _ = srv.terminate()
        assert code == 0, srv.log()


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--tls-key", "{key}"], "--tls-key needs --tls-cert"),
        (["--tls-client-ca", "{client_ca}"], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", "{cert}", "--tls-key", "/nonexistent/key.pem"], "cannot read"),
        (["--tls-cert", "{cert}"], "cannot load the certificate and key"),  # no key anywhere
        (["--tls-cert", "{cert}", "--tls-key", "{ca}"], "cannot load the certificate and key"),
        (
            ["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{key}"],
            "cannot load CA certificates",
        ),
    ],
)
def test_bad_tls_flags_exit_2_with_one_line(pki, flags, needle):
    r = run_cli(*[f.format(**pki) for f in flags])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kv-conductor: error:"), r.stderr
    assert needle in lines[0], lines[0]


def test_gunicorn_tls(tmp_path, pki):
    """KvConductorWorker serves the --tls-* flags; the stock worker refuses them at load."""
    import os
    import subprocess

    from tests.helpers.server import ROOT, SHUTDOWN_BOUND, free_port, gunicorn_cmd

    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        KV_CONDUCTOR_ARGS=f"--tls-cert {pki['cert']} --tls-key {pki['key']}",
    )
    port = free_port()
    out = subprocess.run(
        gunicorn_cmd(port, "-w", "1", factory_args=""),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 4, out.stdout + out.stderr
    assert "--tls-cert needs gunicorn -k kvconductor.app.KvConductorWorker" in out.stderr

    port = free_port()
    log_path = tmp_path / "gunicorn-tls.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            gunicorn_cmd(
                port, "-w", "1", "-k", "kvconductor.app.KvConductorWorker", factory_args=""
            ),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting(pki), timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SHUTDOWN_BOUND * 2) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "tls=on" in log_path.read_text()
