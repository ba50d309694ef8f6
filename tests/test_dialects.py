"""The dialects' ports, as the command line and the processes serve them
(kvconductor.http.dialects, kvconductor.serve.single.dialect_servers): each dialect's own
routes are tested in tests/test_mooncake.py and tests/test_dynamo.py."""

from __future__ import annotations

import socket

import pytest

from kvconductor.serve import cli
from tests.helpers.server import free_port, run_cli, running

FLAGS = ["--mooncake-port", "--dynamo-port"]


@pytest.mark.parametrize("flag", FLAGS)
def test_gunicorn_refuses_a_dialect_port(monkeypatch, flag):
    from gunicorn.errors import AppImportError

    from kvconductor.serve.gunicorn import gunicorn_app

    monkeypatch.delenv("KV_CONDUCTOR_ARGS", raising=False)
    with pytest.raises(AppImportError, match=f"{flag} is not supported under gunicorn"):
        gunicorn_app(flag, "13335", "--no-snapshots")


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("flag", FLAGS)
def test_a_dialect_port_in_use_fails_the_start(flag, workers):
    """One process or the owner of ``--workers 2``: exit status 1 and the port said."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_cli(
            "--host", "127.0.0.1", "--port", str(free_port()), flag, str(port),
            "--workers", workers, "--no-snapshots",
        )  # fmt: skip
    assert r.returncode == 1
    assert f"failed to bind TCP listener on 127.0.0.1 port {port}" in r.stderr


def test_the_dialect_ports_are_their_own():
    p = cli.build_parser(raise_errors=True)
    ns = p.parse_args(["--mooncake-port", "13336", "--dynamo-port", "13337", "--workers", "2"])
    settings = cli.settings_from_args(ns)
    assert (settings.mooncake_port, settings.dynamo_port, settings.workers) == (13336, 13337, 2)
    with pytest.raises(cli.FlagError, match="--dynamo-port 13336 is --mooncake-port"):
        p.parse_args(["--mooncake-port", "13336", "--dynamo-port", "13336"])
    for flag in FLAGS:
        with pytest.raises(cli.FlagError, match=f"{flag}-open needs {flag}"):
            p.parse_args([f"{flag}-open"])
        with pytest.raises(cli.FlagError, match="is the V3 port"):
            p.parse_args(["--port", "13338", flag, "13338"])


def test_a_dialect_port_of_a_workers_server_is_its_own(tmp_path):
    """With --workers N the workers share the dialect's port (SO_REUSEPORT) as the V3
    port: a second such server with the same dialect port refuses to start (the port's
    lock), rather than splitting its connections with the first."""
    port = free_port()
    with running(tmp_path, "--workers", "2", "--dynamo-port", str(port)):
        r = run_cli(
            "--port", str(free_port()), "--workers", "2", "--dynamo-port", str(port),
            "--no-snapshots",
        )  # fmt: skip
    assert r.returncode == 1
    assert f"port {port} is already served by kv-conductor pid" in r.stderr
