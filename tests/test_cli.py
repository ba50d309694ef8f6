"""Flag parsing of ``kv-conductor`` (docs/operations.md, "Starting it"), in process."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from kvconductor import logs
from kvconductor.serve import cli


def parse(*argv):
    return cli.settings_from_args(cli.build_parser().parse_args(list(argv)))


def test_defaults_follow_the_contract(monkeypatch):
    monkeypatch.delenv("KV_CONDUCTOR_LOG", raising=False)
    monkeypatch.delenv("KV_CONDUCTOR_API_KEY", raising=False)
    s = parse()
    assert (s.host, s.port) == ("::", 13333)
    assert (
        s.maintenance_interval_secs,
        s.pending_ttl_secs,
        s.content_ttl_secs,
        s.offload_ttl_secs,
    ) == (30, 60, 300, 600)
    assert s.log_level == "info" and s.api_key is None
    assert s.max_body_bytes == 64 * 1024 * 1024


def test_every_flag_is_taken():
    s = parse(
        "--host",
        "127.0.0.1",
        "-p",
        "0",
        "--maintenance-interval-secs",
        "5",
        "--pending-ttl-secs",
        "1",
        "--content-ttl-secs",
        "2",
        "--offload-ttl-secs",
        "3",
        "--log-level",
        "DEBUG",
        "--max-body-mb",
        "0.5",
        "--api-key",
        "k",
    )
    assert (s.host, s.port, s.maintenance_interval_secs) == ("127.0.0.1", 0, 5)
    assert (s.pending_ttl_secs, s.content_ttl_secs, s.offload_ttl_secs) == (1, 2, 3)
    assert (s.log_level, s.api_key) == ("debug", "k")
    assert s.max_body_bytes == 512 * 1024


def test_maintenance_interval_is_at_least_one_second():
    cfg = parse("--maintenance-interval-secs", "0").conductor_config()
    assert cfg.maintenance_interval == 1
    cfg = parse("--pending-ttl-secs", "7").conductor_config()
    assert (cfg.maintenance_interval, cfg.pending_ttl, cfg.content_ttl, cfg.offload_ttl) == (
        30,
        7.0,
        300.0,
        600.0,
    )


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("KV_CONDUCTOR_LOG", "warning,kv_event=trace")
    monkeypatch.setenv("KV_CONDUCTOR_API_KEY", "secret")
    s = parse()
    assert (s.log_level, s.api_key) == ("warning", "secret")
    # the flag wins over the environment
    assert parse("--log-level", "error").log_level == "error"


def test_invalid_log_env_falls_back_to_info(monkeypatch):
    monkeypatch.setenv("KV_CONDUCTOR_LOG", "loud")
    assert parse().log_level == "info"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--host", "localhost"], "invalid host address"),
        (["--port", "70000"], "must be within 0..65535"),
        (["--port", "x"], "invalid port"),
        (["--pending-ttl-secs", "-1"], "must be >= 0"),
        (["--content-ttl-secs", "1.5"], "whole number of seconds"),
        (["--max-body-mb", "0"], "must be > 0"),
        (["--log-level", "chatty"], "invalid log level"),
        (["--log-format", "xml"], "invalid choice: 'xml'"),
        (["--bogus"], "unrecognized arguments"),
        (["--pending-ttl-sec", "5"], "unrecognized arguments"),  # no abbreviations
        (["--endpoint-networks", "10.0.0.0/33"], "invalid network list"),
        (["--endpoint-networks", ","], "at least one CIDR"),
        (["--snapshot-interval-secs", "-5"], "must be >= 0"),
        (["--snapshot-dir", "d", "--load-dump", "README.md"], "exclude each other"),
        (["--state-url", "redis://h/0", "--snapshot-dir", "d"], "--state-url and --snapshot-dir"),
        (
            ["--state-url", "http://u:s3cret@h/0"],
            "invalid --state-url 'http://u:***@h/0': redis://HOST:PORT/DB",
        ),
        (["--lease-secs", "0.1"], "0.3 .. 3600 seconds"),
        (["--no-snapshots", "--snapshot-dir", "d"], "--no-snapshots and --snapshot-dir"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as ex:
        cli.build_parser().parse_args(argv)
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_snapshot_and_replica_flags():
    s = parse("--snapshot-dir", "snaps", "--snapshot-interval-secs", "0")
    assert (s.snapshot_dir, s.snapshot_interval_secs, s.state_url) == ("snaps", 0, None)
    assert "snapshots=snaps@0s" in s.describe()
    s = parse("--state-url", "unix:///run/valkey.sock?db=2", "--replica-id", "r1")
    assert (s.state_url, s.replica_id, s.lease_secs) == ("unix:///run/valkey.sock?db=2", "r1", 5.0)
    assert "snapshots=state-store@60s lease=5s" in s.describe()


def test_warm_restart_is_the_default(monkeypatch, tmp_path):
    """Without a snapshot flag the directory is $XDG_STATE_HOME (else ~/.local/state)
    /kvconductor/<port>; choosing it creates nothing."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = parse("--port", "14000").with_snapshot_default(14000)
    assert (s.snapshot_dir, s.snapshot_default) == (str(tmp_path / "xdg/kvconductor/14000"), True)
    assert f"snapshots={tmp_path}/xdg/kvconductor/14000@60s" in s.describe()
    home = str(tmp_path / "home/.local/state/kvconductor/13333")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # not absolute: ignored (XDG spec)
    assert parse().with_snapshot_default(13333).snapshot_dir == home
    monkeypatch.delenv("XDG_STATE_HOME")
    assert parse().with_snapshot_default(13333).snapshot_dir == home
    assert not (tmp_path / "home").exists() and not (tmp_path / "xdg").exists()
    # an explicit directory is kept as given
    s = parse("--snapshot-dir", "snaps").with_snapshot_default(13333)
    assert (s.snapshot_dir, s.snapshot_default) == ("snaps", False)
    # no default directory: --no-snapshots, --port 0 (a new port each start), --load-dump
    # (the dump is the start state), --state-url (the state store keeps the snapshots)
    for argv, port, rule in (
        (["--no-snapshots"], 13333, "snapshots=off"),
        (["--port", "0"], 0, "snapshots=off"),
        (["--load-dump", "README.md"], 13333, "snapshots=off"),
        (["--state-url", "redis://h/0"], 13333, "snapshots=state-store@60s"),
        (["--state-url", "redis://h/0", "--no-snapshots"], 13333, "snapshots=state-store@60s"),
    ):
        s = parse(*argv).with_snapshot_default(port)
        assert s.snapshot_dir is None and rule in s.describe(), argv
    # gunicorn binds a UNIX socket only: no port, no default directory
    assert parse().with_snapshot_default(None).snapshot_dir is None
    # no absolute state home at all: none, and the start says so (a WARN)
    from kvconductor.serve import settings

    monkeypatch.setenv("HOME", "relative/home")
    monkeypatch.setattr(settings, "_passwd_home", lambda: None)
    s = parse().with_snapshot_default(13333)
    assert s.snapshot_dir is None and "snapshots=off" in s.describe()
    assert s.snapshot_warning is not None and s.snapshot_warning.startswith(
        "no default snapshot directory: neither XDG_STATE_HOME nor HOME is an absolute path"
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as ex:
        cli.build_parser().parse_args(["--version"])
    assert ex.value.code == 0
    assert capsys.readouterr().out.strip() == "kv-conductor 0.1.0"


def test_endpoint_policy_flags():
    from kvconductor.serve.cli import build_parser, settings_from_args
    from kvconductor.urls import UrlPolicy, parse_networks

    s = settings_from_args(build_parser().parse_args([]))
    assert s.conductor_config().url_policy == UrlPolicy()
    s = settings_from_args(
        build_parser().parse_args(
            [
                "--allow-bind-endpoints",
                "--allow-ipc-endpoints",
                "--endpoint-networks",
                "10.0.0.0/8,fd00::/8",
            ]
        )
    )
    assert s.conductor_config().url_policy == UrlPolicy(
        allow_bind=True, allow_ipc=True, networks=parse_networks("10.0.0.0/8,fd00::/8")
    )
    assert "endpoints=tcp-connect+bind+ipc@10.0.0.0/8,fd00::/8" in s.describe()


def test_http_limit_flags():
    s = parse()
    assert (s.max_header_kb, s.request_timeout_secs, s.keep_alive_secs, s.max_connections) == (
        64,
        30.0,
        5.0,
        1000,
    )
    limits = s.http_limits()
    assert (
        limits.max_head_bytes,
        limits.request_timeout,
        limits.keep_alive,
        limits.max_connections,
    ) == (65536, 30.0, 5.0, 1000)
    s = parse(
        "--max-header-kb",
        "8",
        "--request-timeout-secs",
        "1.5",
        "--keep-alive-secs",
        "2",
        "--max-connections",
        "50",
    )
    assert (
        s.http_limits().max_head_bytes,
        s.request_timeout_secs,
        s.keep_alive_secs,
        s.max_connections,
    ) == (8192, 1.5, 2.0, 50)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--max-header-kb", "0"], "must be >= 1"),
        (["--max-connections", "x"], "an integer is required"),
        (["--request-timeout-secs", "0"], "must be > 0"),
        (["--keep-alive-secs", "nan"], "must be > 0"),
    ],
)
def test_bad_http_limit_values(argv, needle, capsys):
    with pytest.raises(SystemExit) as ex:
        cli.build_parser().parse_args(argv)
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_allow_origin_and_open_workers_flags():
    assert parse().allow_origins == () and parse().open_workers is False
    assert parse("--open-workers").open_workers is True
    s = parse("--allow-origin", "https://UI.example", "--allow-origin", "http://localhost:3000")
    assert s.allow_origins == ("https://ui.example", "http://localhost:3000")


@pytest.mark.parametrize(
    "value,needle",
    [
        ("*", "never allow all"),
        ("ui.example", "scheme://host[:port] is required"),
        ("https://ui.example/", "no path"),
        ("ftp://ui.example", "scheme://host[:port] is required"),
    ],
)
def test_bad_allow_origin(value, needle, capsys):
    with pytest.raises(SystemExit) as ex:
        cli.build_parser().parse_args(["--allow-origin", value])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_tls_flags(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    chain, key, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    chain.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(key)
    ca.cert_pem.write_to_path(cafile)
    s = parse()
    assert (s.tls_cert, s.tls_key, s.tls_client_ca) == (None, None, None)
    s = parse("--tls-cert", str(chain), "--tls-key", str(key), "--tls-client-ca", str(cafile))
    assert (s.tls_cert, s.tls_key, s.tls_client_ca) == (str(chain), str(key), str(cafile))
    assert "tls=on client_certs=on" in s.describe_http()
    with pytest.raises(cli.FlagError, match="--tls-key needs --tls-cert"):
        cli.build_parser(raise_errors=True).parse_args(["--tls-key", str(key)])


def test_log_format_flag():
    assert parse().log_format == "text"
    assert parse("--log-format", "json").log_format == "json"


def _record(msg, *args, exc_info=None):
    rec = logging.LogRecord("kvconductor", logging.WARNING, __file__, 1, msg, args, exc_info)
    rec.created = 1796061000.25  # 2026-11-30T17:50:00.25Z
    return rec


def test_text_log_lines_carry_utc_time():
    line = logs._Formatter().format(_record("bad request path=%s", "/query"))
    assert line == "2026-11-30T17:50:00.250000Z  WARN bad request path=/query"


def test_json_log_lines_have_the_text_fields():
    doc = json.loads(logs._JsonFormatter().format(_record("bad request path=%s", "/query")))
    assert doc == {
        "ts": "2026-11-30T17:50:00.250000Z",
        "level": "WARN",
        "message": "bad request path=/query",
    }
    try:
        raise ValueError("boom")
    except ValueError:
        rec = _record("crash", exc_info=sys.exc_info())
    doc = json.loads(logs._JsonFormatter().format(rec))
    assert doc["message"] == "crash" and doc["level"] == "WARN"
    assert doc["exception"].startswith("Traceback") and "ValueError: boom" in doc["exception"]


def test_configure_logging_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="unknown log format"):
        logs.configure_logging("info", "xml")


def test_query_path_flag_reaches_the_settings_and_the_workers():
    from kvconductor.serve import worker

    assert parse().query_path == "protocol"
    s = parse("--query-path", "asgi")
    assert s.query_path == "asgi" and "query_path=asgi" in s.describe()
    assert worker.settings_from_json(worker.settings_json(s)).query_path == "asgi"
    with pytest.raises(cli.FlagError, match="--query-path"):
        cli.build_parser(raise_errors=True).parse_args(["--query-path", "fast"])
