"""The values of ``kv-conductor``'s flags, read and checked one by one (each an
argparse ``type=``), and the flags wrong together (each ``*_problem`` returns the error
line or ``None``): the checks :mod:`kvconductor.serve.cli`'s parser runs. A bad value is an
``argparse.ArgumentTypeError``, one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
from collections.abc import Callable

from kvconductor.logs import LEVELS
from kvconductor.tools.flags import decimal, number

LOG_ENV = "KV_CONDUCTOR_LOG"
API_KEY_ENV = "KV_CONDUCTOR_API_KEY"
#: The environment variables ``--state-url`` and the state store's password are read from
#: (a password on the command line is visible to every user in ``ps``).
STATE_URL_ENV = "KV_CONDUCTOR_STATE_URL"
STATE_PASSWORD_ENV = "KV_CONDUCTOR_STATE_PASSWORD"
#: Upper bound of ``--workers``.
MAX_WORKERS = 1024


def _host(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid host address {value!r}: an IP literal is required "
            "(e.g. :: or 0.0.0.0); hostnames are not accepted"
        ) from None
    return value


def _port(value: str) -> int:
    return number(
        value,
        decimal,
        "port",
        "an integer is required",
        lambda n: 0 <= n <= 65535,
        "must be within 0..65535",
    )


def _secs(value: str) -> int:
    return number(
        value,
        decimal,
        "value",
        "a whole number of seconds is required",
        lambda n: 0 <= n < 2**64,
        "must be >= 0",
    )


def _int_in(lo: int, hi: int | None = None):
    """A flag type: an integer ``>= lo`` (and ``<= hi`` when given)."""

    rule = f"must be >= {lo}" if hi is None else f"must be within {lo}..{hi}"

    def parse(value: str) -> int:
        return number(
            value,
            decimal,
            "value",
            "an integer is required",
            lambda n: n >= lo and (hi is None or n <= hi),
            rule,
        )

    return parse


def _workers(value: str) -> int:
    if value.strip().lower() == "auto":
        return max(1, os.cpu_count() or 1)
    return number(
        value,
        decimal,
        "value",
        "an integer or 'auto' is required",
        lambda n: 1 <= n <= MAX_WORKERS,
        f"must be within 1..{MAX_WORKERS}",
    )


def _megabytes(value: str) -> float:
    return number(
        value,
        float,
        "size",
        "a number of MiB is required",
        lambda mb: 0 < mb < math.inf,
        "must be > 0",
    )


def _networks(value: str) -> tuple:
    from kvconductor.urls import parse_networks

    try:
        nets = parse_networks(value)
    except ValueError as ex:
        raise argparse.ArgumentTypeError(f"invalid network list {value!r}: {ex}") from None
    if not nets:
        raise argparse.ArgumentTypeError("expected at least one CIDR, e.g. 10.0.0.0/8")
    return nets


def _seconds_if(ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """A flag type: a number of seconds (fractions allowed) that ``ok`` accepts."""

    def parse(value: str) -> float:
        return number(value, float, "value", "a number of seconds is required", ok, rule)

    return parse


_timeout = _seconds_if(lambda secs: 0 < secs < 86400 * 365, "must be > 0")
#: ``--prediction-ttl-s``: 0 (off) up to an hour.
_ttl = _seconds_if(lambda secs: 0 <= secs <= 3600, "must be within 0..3600")


def _origin(value: str) -> str:
    scheme, sep, rest = value.partition("://")
    if value == "*":
        raise argparse.ArgumentTypeError(
            "invalid origin '*': list each allowed origin (mutating routes never allow all)"
        )
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        raise argparse.ArgumentTypeError(
            f"invalid origin {value!r}: scheme://host[:port] is required, e.g. "
            "https://ui.example.com (no path, no trailing slash)"
        )
    return value.lower()  # browsers send scheme and host in lower case


def _readable(value: str) -> str:
    try:
        with open(value, "rb"):
            pass
    except OSError as ex:
        raise argparse.ArgumentTypeError(f"cannot read {value}: {ex.strerror or ex}") from None
    return value


def _level(value: str) -> str:
    low = value.strip().lower()
    if low not in LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {value!r}: one of {', '.join(sorted(LEVELS))}"
        )
    return low


def _env_level() -> tuple[str, str | None]:
    """Default log level from ``KV_CONDUCTOR_LOG`` (first plain directive of ``info,x=y``)."""
    raw = os.environ.get(LOG_ENV, "").strip()
    if not raw:
        return "info", None
    for part in raw.split(","):
        part = part.strip().lower()
        if part and "=" not in part:
            if part in LEVELS:
                return part, None
            break
    return "info", f"ignoring invalid {LOG_ENV}={raw!r}; using info"


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    raise _EncryptedKey


def _snapshot_problem(args: argparse.Namespace) -> str | None:
    if args.snapshot_dir and args.no_snapshots:
        return "--no-snapshots and --snapshot-dir exclude each other"
    if args.snapshot_dir and args.load_dump:
        return (
            "--load-dump and --snapshot-dir exclude each other (a snapshot directory "
            "warm-starts from its own newest snapshot)"
        )
    url = args.state_url
    if url:
        for flag in ("snapshot_dir", "load_dump"):
            if vars(args)[flag]:
                return (
                    f"--state-url and --{flag.replace('_', '-')} exclude each other (the "
                    "state store keeps the snapshots)"
                )
        from kvconductor.state.replica import SENTINEL_SCHEMES, parse_sentinel_url, safe_url

        schemes = ("redis", "valkey", "unix", "rediss", "valkeys", *SENTINEL_SCHEMES)
        scheme = url.partition("://")[0]
        if scheme not in schemes or "://" not in url:
            return (
                f"invalid --state-url {safe_url(url)!r}: redis://HOST:PORT/DB, "
                "unix:///PATH?db=N or redis+sentinel://HOST:PORT[,...]/SERVICE/DB is required"
            )
        if scheme in SENTINEL_SCHEMES:
            try:
                parse_sentinel_url(url)
            except ValueError as ex:
                return f"invalid --state-url {safe_url(url)!r}: {ex}"
    return None


def _lease(value: str) -> float:
    return number(
        value,
        float,
        "value",
        "seconds are required",
        lambda secs: 0.3 <= secs <= 3600,
        "0.3 .. 3600 seconds",
    )


def _dialect_problem(args: argparse.Namespace) -> str | None:
    """The dialects' ports (``--mooncake-port``, ``--dynamo-port``): each its own."""
    taken = {args.port: "the V3 port (--port)"}
    for name in ("mooncake", "dynamo"):
        port = getattr(args, f"{name}_port")
        if port is None:
            if getattr(args, f"{name}_port_open"):
                return f"--{name}-port-open needs --{name}-port"
            continue
        if port and port in taken:
            return f"--{name}-port {port} is {taken[port]}: give another one"
        taken[port] = f"--{name}-port"
    return None


def _source_problem(args: argparse.Namespace) -> str | None:
    purge, down = args.source_purge_secs, args.source_down_secs
    if purge and purge < down:
        return (
            f"--source-purge-secs {purge} is shorter than --source-down-secs {down} "
            "(0 never purges)"
        )
    return None


def _tls_problem(args: argparse.Namespace) -> str | None:
    """Why the ``--tls-*`` flags cannot work together, or ``None``.

    Loads the certificate, key and client CAs the way the server will, so a
    wrong file stops the process at startup (exit 2), not at the first client.
    """
    import ssl

    cert, key, ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if key and not cert:
        return "--tls-key needs --tls-cert"
    if ca and not cert:
        return "--tls-client-ca needs --tls-cert (client certificates are checked over TLS only)"
    if not cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except _EncryptedKey:
        return (
            f"the private key in {key or cert} is encrypted; give an unencrypted key "
            "(protect it with file permissions)"
        )
    except (ssl.SSLError, OSError, ValueError) as ex:
        return (
            f"--tls-cert/--tls-key: cannot load the certificate and key ({cert}, "
            f"{key or 'no --tls-key: key expected in the same file'}): {_ssl_reason(ex)}"
        )
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError, ValueError) as ex:
            return f"--tls-client-ca {ca}: cannot load CA certificates: {_ssl_reason(ex)}"
    return None


def _ssl_reason(ex: Exception) -> str:
    reason = getattr(ex, "reason", None) or str(ex)
    if reason == "PEM lib":
        reason = "not a PEM certificate/key, or the key is missing"
    return str(reason).replace("_", " ").lower()
