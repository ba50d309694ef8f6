"""``--api-key`` on the Mooncake dialect's port (``--mooncake-port``), against the real
server with real ZeroMQ publishers: the routes that change state need the same bearer
token as V3's (docs/security.md, "API key").

Before: anyone who reached the dialect's port could re-point a registered engine at a
publisher of their own (whose blocks were then credited to that engine in ``/query``)
or remove any registration, with only an INFO line to show for it.
"""

from __future__ import annotations

import socket
import time

import httpx
import msgspec

from tests.helpers.faults import BS, V33
from tests.helpers.publishers import FakePublisher, wait_until
from tests.helpers.server import Server, free_port

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = list(range(1, 3 * BS + 1))  # three blocks
EVIL_TOKENS = list(range(500, 500 + 3 * BS))


def _start(tmp_path, *extra):
    port = free_port()
    srv = Server(tmp_path, "--api-key", KEY, "--mooncake-port", str(port), *extra)
    srv.wait_ready()
    srv.http.headers.update(AUTH)  # the V3 side of the test is the operator's
    mc = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
    return srv, mc


def _registration(pub: FakePublisher) -> dict:
    return {
        "endpoint": pub.url,
        "type": "vLLM",
        "modelname": "qwen",
        "instance_id": "prefill-a",
        "block_size": BS,
        "dp_rank": 0,
        "tenant_id": "default",
    }


def _npu(srv, tokens) -> int:
    r = srv.http.post("/query", json={"model": "qwen", "block_size": BS, "token_ids": tokens})
    assert r.status_code == 200, r.text
    dp = r.json().get("default", {}).get("prefill-a", {}).get("DP", {}).get("0", {})
    return dp.get("npu_blocks", 0)


def _stored(tokens, first_hash) -> bytes:
    hashes = [first_hash + i for i in range(len(tokens) // BS)]
    return V33.batch([V33.stored(hashes, None, tokens, BS, medium="GPU")])


def _endpoints(srv) -> list[str]:
    r = srv.http.get("/workers")
    assert r.status_code == 200, r.text
    return [s["url"] for s in r.json()["sources"]]


def _assert_401(r: httpx.Response, msgpack: bool = False) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == 'Bearer realm="kv-conductor"'
    if msgpack:
        assert r.headers["content-type"] == "application/msgpack"
        doc = msgspec.msgpack.decode(r.content)
    else:
        assert r.headers["content-type"] == "application/json"
        doc = r.json()
    assert doc == {
        "error": "missing or invalid bearer token (Authorization: Bearer <api key>)",
        "reason": "unauthorized",
    }


def test_the_dialect_port_needs_the_api_key_to_change_state(tmp_path):
    pub, evil = FakePublisher(replay=False), FakePublisher(replay=False)
    srv, mc = _start(tmp_path)
    try:
        # A Mooncake client given the key registers its engine; its blocks are credited.
        r = mc.post("/register", json=_registration(pub), headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "registered successfully", "instance_id": "prefill-a"}
        pub.wait_subscribed(1)
        pub.publish(_stored(TOKENS, 0x100))
        wait_until(lambda: _npu(srv, TOKENS) == 3, timeout=10, msg="engine's blocks")
        assert _endpoints(srv) == [pub.url]

        # Without the key, with a wrong one, or another scheme: 401, nothing changed.
        hijack = _registration(evil)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            _assert_401(mc.post("/register", json=hijack, headers=headers))
        _assert_401(
            mc.post(
                "/register",
                content=msgspec.msgpack.encode(hijack),
                headers={"Content-Type": "application/msgpack"},
            ),
            msgpack=True,
        )
        unreg = {"instance_id": "prefill-a", "tenant_id": "default", "dp_rank": 0}
        _assert_401(mc.post("/unregister", json=unreg))
        # from the head, the body not sent (not the request timeout's 408)
        port = int(str(mc.base_url).rsplit(":", 1)[1].rstrip("/"))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n")
            first = s.recv(65536)
            assert first.startswith(b"HTTP/1.1 401 "), first
            assert time.monotonic() - t0 < 2.0
        _assert_401(mc.get("/services"))  # it lists every engine's publisher URL
        # /query stays open, as V3's queries do
        q = {"model": "qwen", "block_size": BS, "token_ids": TOKENS}
        r = mc.post("/query", json=q)
        assert r.status_code == 200, r.text
        assert r.json()["instances"]["prefill-a"]["gpu"] == 3 * BS

        # The attacker's publisher was never subscribed; what it publishes is credited to
        # nobody; the engine's registration and blocks are intact.
        time.sleep(1.0)
        evil.publish(_stored(EVIL_TOKENS, 0x900))
        time.sleep(0.5)
        assert evil.subscribers == 0
        assert _endpoints(srv) == [pub.url]
        assert _npu(srv, TOKENS) == 3
        assert _npu(srv, EVIL_TOKENS) == 0
        r = mc.get("/services", headers=AUTH)
        assert r.status_code == 200, r.text
        assert [s["Endpoint"] for s in r.json()["services"]] == [pub.url]

        # With the key the client unregisters.
        r = mc.post("/unregister", json=unreg, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["removed_instances"] == ["prefill-a|default|0"]
        assert _endpoints(srv) == []

        log = srv.log()
        assert log.count("mooncake dialect: bad request method=POST path=/register status=401") == 5
        assert "mooncake dialect: bad request method=POST path=/unregister status=401" in log
        assert "mooncake dialect: bad request method=GET path=/services status=401" in log
        assert "auth=token" in log
    finally:
        mc.close()
        srv.terminate()
        pub.stop()
        evil.stop()


def test_mooncake_port_open_takes_registrations_without_the_key_and_says_so(tmp_path):
    pub = FakePublisher(replay=False)
    srv, mc = _start(tmp_path, "--mooncake-port-open")
    try:
        r = mc.post("/register", json=_registration(pub))
        assert r.status_code == 200, r.text
        pub.wait_subscribed(1)
        assert _endpoints(srv) == [pub.url]
        assert mc.get("/services").status_code == 200
        # the V3 port still needs the key
        r = httpx.post(f"{srv.url}/unregister", json={"instance_id": "prefill-a"}, timeout=10)
        assert r.status_code == 401
        log = srv.log()
        assert "auth=off" in log
        assert " WARN --mooncake-port-open: the Mooncake conductor dialect on" in log
    finally:
        mc.close()
        srv.terminate()
        pub.stop()
