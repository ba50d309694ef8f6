"""Validation of the ZeroMQ endpoint URLs that registrations ask the server to use.

A registration makes the conductor open sockets: SUB sockets that connect to
engine and pool publishers, DEALER sockets that connect to vLLM replay
routers. The URLs come from whoever can reach ``POST /register``, so they are
checked before anything is opened:

* ``tcp://HOST:PORT`` with HOST an IPv4 literal, a bracketed IPv6 literal or
  a DNS name, and PORT in 1..65535. This is the only form accepted by default.
* Bind mode (``tcp://*:PORT``, or an unspecified address such as
  ``0.0.0.0``/``[::]``): the conductor would *listen* on all interfaces and
  apply events from any publisher that connects. Only with
  ``--allow-bind-endpoints``, and never for a replay endpoint.
* ``ipc://PATH``: binding or connecting may unlink or touch a file of the
  server's machine. Only with ``--allow-ipc-endpoints``.
* Anything else (``inproc://``, ``udp://``, ``pgm://``, ZeroMQ's
  ``tcp://iface;host:port`` source form, no port, port 0) is rejected.

With ``--endpoint-networks CIDR[,CIDR...]`` a TCP endpoint must be an IP
literal inside one of the networks (DNS names are refused then: what a name
resolves to can change after the check).

:func:`check_url` raises :class:`UrlError` (HTTP 400) with a message naming
the field and the rule.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

__all__ = [
    "HttpTarget",
    "UrlError",
    "UrlPolicy",
    "check_http_url",
    "check_url",
    "is_bind_url",
    "parse_networks",
]

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)


class UrlError(ValueError):
    """An endpoint URL that the server refuses to open (HTTP 400)."""


@dataclass(frozen=True)
class UrlPolicy:
    """What endpoint URLs a registration may name (CLI flags)."""

    allow_bind: bool = False
    allow_ipc: bool = False
    #: Empty: any address. Otherwise TCP endpoints must be IP literals in these networks.
    networks: tuple = field(default=())


def parse_networks(text: str) -> tuple:
    """``"10.0.0.0/8, fd00::/8"`` -> networks; raises ValueError on a bad CIDR."""
    nets = []
    for part in text.split(","):
        part = part.strip()
        if part:
            nets.append(ipaddress.ip_network(part, strict=False))
    return tuple(nets)


def _split_tcp(rest: str) -> tuple[str, str, bool]:
    """``host:port`` -> (host, port, bracketed)."""
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0 or rest[end + 1 : end + 2] != ":":
            raise UrlError("expected tcp://[IPv6]:PORT")
        return rest[1:end], rest[end + 2 :], True
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise UrlError("expected tcp://HOST:PORT (the port is missing)")
    return host, port, False


def check_url(url: str, what: str, policy: UrlPolicy, *, replay: bool = False) -> str:
    """Validate one endpoint URL; returns ``"connect"``, ``"bind"`` or ``"ipc"``.

    ``what`` names the field in the error (``medium_endpoints['npu']``).
    Raises :class:`UrlError`.
    """
    try:
        return _check(url, policy, replay)
    except UrlError as ex:
        raise UrlError(f"{what} {url!r}: {ex}") from None


def _check(url: str, policy: UrlPolicy, replay: bool) -> str:
    if url != url.strip() or any(ord(ch) < 0x21 or ch == "\x7f" for ch in url):
        raise UrlError("whitespace or control characters are not allowed")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise UrlError("expected tcp://HOST:PORT")
    scheme = scheme.lower()
    if scheme == "ipc":
        if not rest:
            raise UrlError("ipc:// needs a path")
        if not policy.allow_ipc:
            raise UrlError(
                "ipc:// endpoints are disabled (start the server with --allow-ipc-endpoints)"
            )
        return "ipc"
    if scheme != "tcp":
        raise UrlError(f"scheme {scheme}:// is not supported (tcp:// only)")
    if ";" in rest:
        raise UrlError("the source-address form tcp://iface;host:port is not supported")
    host, port, bracketed = _split_tcp(rest)
    _check_port(port)
    ip = None
    if host == "*":
        bind = True
    else:
        ip = _host_ip(host, bracketed)
        bind = ip is not None and ip.is_unspecified
    if bind:
        if replay:
            raise UrlError("a replay endpoint is connected to, never bound")
        if not policy.allow_bind:
            raise UrlError(
                "bind-mode endpoints (tcp://*:PORT, unspecified addresses) would make "
                "the server listen on all interfaces; they are disabled (start the "
                "server with --allow-bind-endpoints)"
            )
        return "bind"
    _check_network(ip, policy)
    return "connect"


def _check_port(port: str) -> int:
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UrlError(f"invalid port {port!r} (1..65535)")
    return int(port)


def _host_ip(host: str, bracketed: bool):
    """A URL's host: its address when it is an IP literal, None for a DNS name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if bracketed or not _HOSTNAME.match(host):
            raise UrlError(f"invalid host {host!r}") from None
        return None
    if bracketed != (ip.version == 6):
        raise UrlError("IPv6 addresses must be bracketed, IPv4 ones not")
    return ip


def _check_network(ip, policy: UrlPolicy) -> None:
    """``--endpoint-networks``: ``ip`` (None: a host name) must be inside one of them."""
    if not policy.networks:
        return
    if ip is None:
        raise UrlError(
            "host names are not accepted while --endpoint-networks is set; use an IP address"
        )
    if not any(ip.version == net.version and ip in net for net in policy.networks):
        raise UrlError(
            f"address {ip} is outside --endpoint-networks "
            f"({', '.join(str(n) for n in policy.networks)})"
        )


@dataclass(frozen=True)
class HttpTarget:
    """An engine's HTTP base URL, checked (:func:`check_http_url`)."""

    scheme: str
    #: An IP literal (IPv6 without brackets) or a DNS name.
    host: str
    port: int
    #: The base path, without a trailing ``/`` (``""`` for the root).
    path: str

    @property
    def zmq_host(self) -> str:
        """The host as a ``tcp://`` URL writes it (IPv6 bracketed)."""
        return f"[{self.host}]" if ":" in self.host else self.host


def check_http_url(url: str, what: str, policy: UrlPolicy) -> HttpTarget:
    """Validate an engine's HTTP base URL (``engine_url`` of a registration):
    ``http://`` or ``https://``, a host as a ``tcp://`` endpoint's (an IP literal, IPv6
    bracketed, or a DNS name; not an unspecified address), an optional port, an optional
    base path; no user, query or fragment. ``--endpoint-networks`` applies to the host as
    to an endpoint's. Raises :class:`UrlError`."""
    try:
        return _check_http(url, policy)
    except UrlError as ex:
        raise UrlError(f"{what} {url!r}: {ex}") from None


def _check_http(url: str, policy: UrlPolicy) -> HttpTarget:
    if url != url.strip() or any(ord(ch) < 0x21 or ch == "\x7f" for ch in url):
        raise UrlError("whitespace or control characters are not allowed")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("http", "https"):
        raise UrlError("expected http://HOST[:PORT] or https://HOST[:PORT]")
    authority, slash, path = rest.partition("/")
    if "?" in rest or "#" in rest or "@" in authority:
        raise UrlError("a user, a query or a fragment is not allowed")
    if authority.startswith("["):
        end = authority.find("]")
        tail = authority[end + 1 :] if end > 0 else "?"
        if tail and not tail.startswith(":"):
            raise UrlError("expected http://[IPv6]:PORT")
        host, port, bracketed = authority[1:end], tail[1:] or None, True
    elif authority.count(":") > 1:
        raise UrlError("IPv6 addresses must be bracketed")
    else:
        host, colon, port = authority.partition(":")
        port, bracketed = (port if colon else None), False
    number = (443 if scheme == "https" else 80) if port is None else _check_port(port)
    ip = _host_ip(host, bracketed)
    if ip is not None and ip.is_unspecified:
        raise UrlError("an unspecified address names no engine")
    _check_network(ip, policy)
    return HttpTarget(scheme, host, number, ("/" + path if slash else "").rstrip("/"))


def is_bind_url(url: str) -> bool:
    """True for a URL the subscriber binds instead of connecting (already checked)."""
    try:
        return _check(url, UrlPolicy(allow_bind=True, allow_ipc=True), False) == "bind"
    except UrlError:
        return False
