"""Two ``kv-conductor --workers N`` servers on one port, through the real processes: the
second refuses to start (the first holds the port's lock), so no connection reaches a
server with another state."""

from __future__ import annotations

import collections
import http.client
import re
import subprocess

import msgspec

from tests.helpers.server import STARTUP_BOUND, Server, register_engine, running, wait_workers


def _queries(port: int, n: int) -> collections.Counter:
    """``n`` queries of model qwen, each on a new connection: status -> count."""
    body = msgspec.json.encode({"model": "qwen", "block_size": 4, "token_ids": list(range(16))})
    seen: collections.Counter = collections.Counter()
    for _ in range(n):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            c.request("POST", "/query", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            seen[(r.status, r.read())] += 1
        finally:
            c.close()
    return seen


def test_a_second_workers_server_on_the_same_port_refuses_to_start(tmp_path):
    """The first server (--workers 2, no snapshots) knows engine ``eng``; a second one on
    the same port with its own snapshot directory exits 1 naming the first one's pid,
    and every one of 200 new connections is answered by the first (200, never the
    second's 404 ``no indexer``). Once the first stopped, the port is free again."""
    with running(tmp_path, "--workers", "2") as first:
        wait_workers(first, 2)
        register_engine(first, "eng")
        second = Server(
            tmp_path, "--workers", "2", "--snapshot-dir", str(tmp_path / "b"), port=first.port
        )
        try:
            code = second.proc.wait(STARTUP_BOUND)
        except subprocess.TimeoutExpired:
            second.proc.kill()
            second.proc.wait(10)
            raise AssertionError(f"the second server started:\n{second.log()}") from None
        finally:
            second.http.close()
            second._log.close()
        out = second.log()
        assert code == 1, out
        want = (
            f"kv-conductor: error: port {first.port} is already served by kv-conductor pid "
            f"{first.proc.pid} with --workers (lock @kv-conductor-port-{first.port})"
        )
        assert want in out, out
        assert "ERROR [owner" in out and "ready (listening" not in out, out
        seen = _queries(first.port, 200)
        assert seen == {(200, b'{"default":{}}'): 200}, seen
    # the lock went with the first server: a server on the port starts again (and,
    # empty, answers the model's queries 404)
    with running(tmp_path, "--workers", "2", port=first.port) as again:
        wait_workers(again, 2)
        (((status, _), n),) = _queries(again.port, 5).items()
        assert (status, n) == (404, 5)


def _refused(tmp_path, port: int, *args: str) -> str:
    """Start a server on ``port`` that must exit 1 at start; its output."""
    srv = Server(tmp_path, *args, port=port)
    try:
        code = srv.proc.wait(STARTUP_BOUND)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait(10)
        raise AssertionError(f"it started:\n{srv.log()}") from None
    finally:
        srv.http.close()
        srv._log.close()
    assert code == 1, srv.log()
    return srv.log()


def test_one_process_and_a_workers_server_never_share_a_port(tmp_path):
    """One process binds without SO_REUSEPORT: it cannot join a --workers server's port,
    and a --workers server cannot join its port (the kernel refuses either bind)."""
    with running(tmp_path, "--workers", "2") as owner:
        wait_workers(owner, 2)
        out = _refused(tmp_path, owner.port)
        assert re.search(rf"failed to bind TCP listener on \S+ port {owner.port}:", out), out
    with running(tmp_path) as single:
        out = _refused(tmp_path, single.port, "--workers", "2")
        assert re.search(rf"error: failed to bind TCP listener on \S+ port {single.port}:", out), (
            out
        )
