"""An engine's own list of its KV-event publishers: ``GET <engine_url>/kv_event_sources``
(vLLM 0.33+; docs/engines.md, "Registration from the engine's URL").

vLLM's API server answers its engine client's ``get_kv_event_sources()``: per DP rank
(the JSON object's keys), the publisher's ``KVEventsConfig`` as the publisher resolved it
(``endpoint`` with the DP offset applied, the bound port when it bound port 0,
``replay_endpoint``, ``topic``, the queue settings). :func:`read_sources` reads it with
the limits below (never from the ingest thread or an event loop: the caller's thread),
:func:`parse_sources` checks its shape and :func:`engine_registrations` makes one V3
registration per DP rank listed, the endpoints' wildcard host (``tcp://*:5557``,
``0.0.0.0``, ``[::]``) replaced by the engine URL's host.

Rules: the engine URL is checked as an endpoint's host is (:func:`kvconductor.urls.
check_http_url`, ``--endpoint-networks`` included) and so is every endpoint it hands
back (:func:`kvconductor.urls.check_url`); no redirect is followed; at most
:data:`MAX_BYTES` are read, within :data:`CONNECT_SECS` to connect and
:data:`READ_SECS` for the whole answer. A failure is an :class:`EngineRouteError`:
``status`` 400 for an engine URL the flags refuse, 422 for everything the engine did or
did not answer (docs/api.md, POST /register).
"""

from __future__ import annotations

import http.client
import json
import re
import ssl
import time
from dataclasses import dataclass

import msgspec

from kvconductor.keys import is_hbm_key
from kvconductor.schema import RegisterRequest
from kvconductor.urls import HttpTarget, UrlError, UrlPolicy, check_http_url, check_url

__all__ = [
    "CONNECT_SECS",
    "MAX_BYTES",
    "READ_SECS",
    "ROUTE",
    "EngineRouteError",
    "RankSource",
    "engine_registrations",
    "parse_sources",
    "read_sources",
    "registrations_from",
]

#: The route vLLM 0.33's API server serves its publishers on.
ROUTE = "/kv_event_sources"
#: Bytes of an answer read at most (a DP rank's entry is about 250 bytes).
MAX_BYTES = 1 << 20
#: Seconds to connect (TLS handshake included), and for the whole answer.
CONNECT_SECS = 2.0
READ_SECS = 3.0

#: ``tcp://`` endpoints a publisher binds on every interface: the host is the engine's.
_WILDCARD = re.compile(r"^tcp://(\*|0\.0\.0\.0|\[::\]|\[0:0:0:0:0:0:0:0\]):(\d+)$")
_REDIRECTS = frozenset((301, 302, 303, 307, 308))


class EngineRouteError(Exception):
    """The engine's list of publishers cannot be had or used; ``status``: the HTTP answer
    of a registration that meets it (400: the URL is refused; 422: the engine's answer or
    its silence: a 4xx, so a Coordinator's circuit breaker keeps the conductor alive)."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RankSource:
    """One DP rank's publisher as the engine lists it, its host resolved."""

    endpoint: str
    replay_endpoint: str | None


def read_sources(engine_url: str, policy: UrlPolicy) -> dict[int, RankSource]:
    """``GET <engine_url>/kv_event_sources``, checked: DP rank -> its publisher (blocking:
    a thread of its own, never the ingest thread or an event loop)."""
    try:
        target = check_http_url(engine_url, "engine_url", policy)
    except UrlError as ex:
        raise EngineRouteError(str(ex), 400) from None
    body = _get(target, engine_url)
    return parse_sources(body, target.zmq_host, policy, engine_url)


def _get(t: HttpTarget, engine_url: str) -> bytes:
    where = f"engine_url {engine_url!r}: GET {ROUTE}"
    conn: http.client.HTTPConnection
    if t.scheme == "https":
        ctx = ssl.create_default_context()
        conn = http.client.HTTPSConnection(t.host, t.port, timeout=CONNECT_SECS, context=ctx)
    else:
        conn = http.client.HTTPConnection(t.host, t.port, timeout=CONNECT_SECS)
    deadline = time.monotonic() + READ_SECS
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(READ_SECS)
        conn.request("GET", t.path + ROUTE, headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if resp.status in _REDIRECTS:
            raise EngineRouteError(
                f"{where} answered {resp.status} (to {resp.getheader('Location')!r}); "
                "redirects are not followed: register the URL the engine serves on"
            )
        if resp.status != 200:
            hint = " (vLLM serves it from 0.33; SGLang not yet)" if resp.status == 404 else ""
            raise EngineRouteError(f"{where} answered HTTP {resp.status}{hint}")
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BYTES:
            raise EngineRouteError(f"{where}: the answer is over {MAX_BYTES} bytes")
        chunks: list[bytes] = []
        n = 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError
            chunk = resp.read1(65536)
            if not chunk:
                break
            n += len(chunk)
            if n > MAX_BYTES:
                raise EngineRouteError(f"{where}: the answer is over {MAX_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    except TimeoutError:
        raise EngineRouteError(
            f"{where}: no answer within {CONNECT_SECS:g}s to connect and {READ_SECS:g}s to read it"
        ) from None
    except (OSError, ValueError, http.client.HTTPException) as ex:
        raise EngineRouteError(f"{where}: the engine cannot be reached ({ex})") from None
    finally:
        conn.close()


def parse_sources(
    body: bytes, host: str, policy: UrlPolicy, engine_url: str = "the engine"
) -> dict[int, RankSource]:
    """The answer's DP ranks and their publishers, wildcard hosts replaced by ``host``
    (a ``tcp://`` host: IPv6 bracketed), every endpoint checked by ``policy``."""
    where = f"engine_url {engine_url!r}: {ROUTE}"
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # a nesting too deep too
        raise EngineRouteError(f"{where} is not JSON") from None
    if not isinstance(doc, dict):
        raise EngineRouteError(f"{where}: expected an object of DP ranks, got {_kind(doc)}")
    if not doc:
        raise EngineRouteError(
            f"{where} lists no KV-event publisher (KV events off: start the engine with "
            "--kv-events-config, publisher zmq)"
        )
    out: dict[int, RankSource] = {}
    for key, cfg in doc.items():
        if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > 0xFFFFFFFF:
            raise EngineRouteError(f"{where}: key {key!r} is not a DP rank")
        rank = int(key)
        what = f"{where} DP rank {rank}"
        if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
            raise EngineRouteError(f"{what}: expected a KVEventsConfig with an endpoint")
        if cfg.get("publisher", "zmq") != "zmq" or cfg.get("enable_kv_cache_events") is False:
            raise EngineRouteError(
                f"{what}: publishes no events (publisher {cfg.get('publisher')!r}, "
                f"enable_kv_cache_events {cfg.get('enable_kv_cache_events')!r})"
            )
        replay = cfg.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise EngineRouteError(f"{what}: replay_endpoint is {_kind(replay)}")
        src = RankSource(
            _resolve(cfg["endpoint"], host), _resolve(replay, host) if replay else None
        )
        try:
            check_url(src.endpoint, f"{what} endpoint", policy)
            if src.replay_endpoint:
                check_url(src.replay_endpoint, f"{what} replay_endpoint", policy, replay=True)
        except UrlError as ex:
            raise EngineRouteError(str(ex)) from None
        out[rank] = src
    return out


def _kind(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _resolve(url: str, host: str) -> str:
    """``tcp://*:5557`` (or ``0.0.0.0``, ``[::]``) -> ``tcp://<host>:5557``."""
    m = _WILDCARD.match(url)
    return f"tcp://{host}:{m.group(2)}" if m else url


def registrations_from(req: RegisterRequest, sources: dict[int, RankSource]) -> list:
    """One registration per DP rank listed: ``req`` with that ``dp_rank``, the rank's
    publisher as ``medium_endpoints``' ``npu`` (``endpoint`` and any HBM key or URL of
    ``req`` replaced; its other keys kept: an LMCache publisher's ``cpu``, say) and its
    ``replay_endpoint``; ``req``'s own DP rank first."""
    if req.dp_rank not in sources:
        raise EngineRouteError(
            f"engine_url {req.engine_url!r} lists DP rank(s) {sorted(sources)}, not the "
            f"registration's dp_rank {req.dp_rank}"
        )
    meds = req.medium_endpoints or {}
    old = next((v for k, v in meds.items() if is_hbm_key(k)), None)
    others = {k: v for k, v in meds.items() if not is_hbm_key(k) and v != old}
    out = []
    for rank in sorted(sources, key=lambda r: (r != req.dp_rank, r)):
        src = sources[rank]
        r = msgspec.structs.replace(
            req,
            dp_rank=rank,
            endpoint=None,
            medium_endpoints={"npu": src.endpoint, **others},
            replay_endpoint=src.replay_endpoint,
        )
        out.append((msgspec.json.encode(r), r))
    return out


def engine_registrations(req: RegisterRequest, policy: UrlPolicy) -> list:
    """``[(body, request), ...]``: the registrations a request with ``engine_url`` stands
    for, read from the engine (blocking; :class:`EngineRouteError`)."""
    assert req.engine_url is not None
    return registrations_from(req, read_sources(req.engine_url, policy))
