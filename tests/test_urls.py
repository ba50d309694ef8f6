"""Endpoint URL validation: what a registration may make the server open."""

from __future__ import annotations

import ipaddress

import pytest

from kvconductor.urls import (
    HttpTarget,
    UrlError,
    UrlPolicy,
    check_http_url,
    check_url,
    is_bind_url,
    parse_networks,
)

DEFAULT = UrlPolicy()
OPEN = UrlPolicy(allow_bind=True, allow_ipc=True)


@pytest.mark.parametrize(
    "url",
    [
        "tcp://10.0.0.1:5557",
        "tcp://127.0.0.1:1",
        "tcp://[::1]:65535",
        "tcp://[2001:db8::1]:15557",
        "tcp://vllm-prefill-0.engines.svc.cluster.local:5557",
        "tcp://kv-conductor:13333",
        "TCP://10.0.0.1:5557",
    ],
)
def test_connect_urls_accepted(url):
    assert check_url(url, "endpoint", DEFAULT) == "connect"
    assert not is_bind_url(url)


@pytest.mark.parametrize(
    "url,why",
    [
        ("", "expected tcp://HOST:PORT"),
        ("10.0.0.1:5557", "expected tcp://HOST:PORT"),
        ("tcp://10.0.0.1", "the port is missing"),
        ("tcp://10.0.0.1:", "invalid port ''"),
        ("tcp://10.0.0.1:0", "invalid port '0'"),
        ("tcp://10.0.0.1:65536", "invalid port '65536'"),
        ("tcp://10.0.0.1:55x", "invalid port '55x'"),
        ("tcp://10.0.0.1:５５５", "invalid port"),
        ("tcp://:5557", "invalid host ''"),
        ("tcp://bad_host:5557", "invalid host 'bad_host'"),
        ("tcp://[10.0.0.1]:5557", "must be bracketed"),
        ("tcp://::1:5557", "must be bracketed"),
        ("tcp://[::1:5557", "expected tcp://[IPv6]:PORT"),
        ("tcp://eth0;10.0.0.1:5557", "source-address form"),
        (" tcp://10.0.0.1:5557", "whitespace"),
        ("tcp://10.0.0.1:5557\n", "whitespace"),
        ("inproc://x", "scheme inproc:// is not supported"),
        ("udp://10.0.0.1:5557", "scheme udp:// is not supported"),
        ("epgm://eth0;239.0.0.1:5555", "scheme epgm://"),
        ("ipc://", "ipc:// needs a path"),
    ],
)
def test_malformed_urls_rejected(url, why):
    with pytest.raises(UrlError, match="^medium_endpoints\\['npu'\\] ") as ex:
        check_url(url, "medium_endpoints['npu']", OPEN)
    assert why in str(ex.value)


@pytest.mark.parametrize("url", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"])
def test_bind_mode_only_behind_the_flag(url):
    with pytest.raises(UrlError, match="--allow-bind-endpoints"):
        check_url(url, "endpoint", DEFAULT)
    assert check_url(url, "endpoint", UrlPolicy(allow_bind=True)) == "bind"
    assert is_bind_url(url)
    with pytest.raises(UrlError, match="never bound"):
        check_url(url, "replay_endpoint", OPEN, replay=True)


def test_ipc_only_behind_the_flag():
    with pytest.raises(UrlError, match="--allow-ipc-endpoints"):
        check_url("ipc:///var/run/engine.sock", "endpoint", DEFAULT)
    assert check_url("ipc:///var/run/engine.sock", "endpoint", UrlPolicy(allow_ipc=True)) == "ipc"


def test_network_allow_list():
    policy = UrlPolicy(networks=parse_networks("10.0.0.0/8, fd00::/8"))
    assert check_url("tcp://10.1.2.3:5557", "endpoint", policy) == "connect"
    assert check_url("tcp://[fd00::5]:5557", "endpoint", policy) == "connect"
    for url, why in (
        ("tcp://192.168.0.1:5557", "outside --endpoint-networks"),
        ("tcp://[2001:db8::1]:5557", "outside --endpoint-networks"),
        ("tcp://engine-0:5557", "host names are not accepted"),
    ):
        with pytest.raises(UrlError, match=why):
            check_url(url, "endpoint", policy)


def test_parse_networks():
    assert parse_networks("10.0.0.0/8,127.0.0.1") == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("127.0.0.1/32"),
    )
    assert parse_networks(" ") == ()
    with pytest.raises(ValueError):
        parse_networks("10.0.0.0/33")


# -- engine_url (an engine's HTTP base URL) ---------------------------------------------------


@pytest.mark.parametrize(
    "url,target",
    [
        ("http://10.0.0.5:8000", HttpTarget("http", "10.0.0.5", 8000, "")),
        ("HTTPS://[fd00::5]/", HttpTarget("https", "fd00::5", 443, "")),
        (
            "http://vllm-0.engines.svc:8000/v1/",
            HttpTarget("http", "vllm-0.engines.svc", 8000, "/v1"),
        ),
        ("http://[::1]", HttpTarget("http", "::1", 80, "")),
    ],
)
def test_engine_urls_accepted(url, target):
    assert check_http_url(url, "engine_url", DEFAULT) == target


@pytest.mark.parametrize(
    "url,error",
    [
        ("tcp://10.0.0.5:5557", "expected http://HOST[:PORT] or https://HOST[:PORT]"),
        ("http://::1:8000", "IPv6 addresses must be bracketed"),
        ("http://[10.0.0.5]:8000", "IPv6 addresses must be bracketed, IPv4 ones not"),
        ("http://[::1:8000", "expected http://[IPv6]:PORT"),
        ("http://0.0.0.0:8000", "an unspecified address names no engine"),
        ("http://10.0.0.5:", "invalid port ''"),
        ("http://10.0.0.5:0", "invalid port '0'"),
        ("http://user@10.0.0.5", "a user, a query or a fragment is not allowed"),
        ("http://10.0.0.5/?a=1", "a user, a query or a fragment is not allowed"),
        ("http://bad_host:80", "invalid host 'bad_host'"),
        ("http://10.0.0.5 ", "whitespace or control characters"),
    ],
)
def test_engine_urls_refused(url, error):
    with pytest.raises(UrlError) as ex:
        check_http_url(url, "engine_url", DEFAULT)
    assert str(ex.value).startswith(f"engine_url {url!r}: ")
    assert error in str(ex.value)


def test_engine_urls_and_the_networks():
    nets = UrlPolicy(networks=parse_networks("10.0.0.0/8"))
    assert check_http_url("http://10.0.0.5:8000", "engine_url", nets).host == "10.0.0.5"
    with pytest.raises(UrlError, match="outside --endpoint-networks"):
        check_http_url("http://192.168.0.5:8000", "engine_url", nets)
    with pytest.raises(UrlError, match="host names are not accepted"):
        check_http_url("http://vllm-0:8000", "engine_url", nets)
