"""Coordinator-side HTTP client of the conductor (routes: docs/api.md; usage: docs/client.md).

Two clients with the same methods: :class:`ConductorClient` (sync, one
``httpx.Client`` and its connection pool) and :class:`AsyncConductorClient`
(``httpx.AsyncClient``). Both are context managers; close them when done.

Error contract (see docs/client.md):

* ``query``/``query_by_hash``/``register``/``unregister``/``workers``/
  ``post_events`` raise :class:`ConductorError` on any failure: transport
  error, timeout, HTTP status >= 400, undecodable body, open circuit
  (:class:`CircuitOpenError`, a subclass).
* ``query_or_empty`` returns ``{}`` instead of raising, like the reference
  client's ``query_conductor``.
* ``health`` returns ``True``/``False`` and never raises.
* ``registered_services`` returns ``[]`` when neither ``/workers`` nor a
  Mooncake master's ``/services`` answers (as the reference does).

Circuit breaker (one per client, shared by all routes except ``/health``):
3 consecutive failures open it for 30 s; calls made while it is open raise
:class:`CircuitOpenError` without touching the network; after the cooldown
exactly one call goes through (half-open); its success closes the breaker, its
failure re-opens it for another cooldown. A failure is a transport error, a
timeout, an HTTP 5xx or an undecodable 2xx body. A 4xx answer proves the server
is up: it resets the failure count (but the call still raises). The reference
counts every exception, including a 404 for an unknown model.

This module imports no Coordinator types; the helpers at the bottom build the
registration payloads (docs/client.md, "Registration helpers") from plain values.
"""
from __future__ import annotations

import array
import dataclasses
import logging
import os
import ssl
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import httpx
import msgspec

__all__ = [
    "DEFAULT_PORT",
    "TENANT_ID",
    "ConductorError",
    "CircuitOpenError",
    "CircuitBreaker",
    "ConductorClient",
    "AsyncConductorClient",
    "KvConductorConfig",
    "ReregisterResult",
    "format_host",
    "conductor_base_url",
    "tls_verify",
    "resolve_endpoint",
    "instance_name",
    "strip_decode_instances",
    "canonical_store_backend",
    "resolve_store_backend",
    "backend_mode",
    "build_medium_endpoints",
    "build_pool_registration",
    "build_dp_registration",
    "build_unregister_payload",
    "normalize_service_key",
    "registered_keys",
    "missing_registrations",
    "pack_tokens",
    "token_list",
]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 13333
TENANT_ID = "default"

QUERY_TIMEOUT = 3.0
REGISTER_TIMEOUT = 15.0
HEALTH_TIMEOUT = 3.0
BREAKER_THRESHOLD = 3
BREAKER_COOLDOWN = 30.0

MSGPACK_CT = "application/msgpack"
JSON_CT = "application/json"

_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_JSON_ENCODER = msgspec.json.Encoder()


# ---------------------------------------------------------------------------
# Errors and the circuit breaker


class ConductorError(Exception):
    """A conductor call failed.

    Attributes: ``route`` (``"POST /query"``), ``status_code`` (``None`` when
    no HTTP answer was received), ``server_error`` (the server's ``error``
    field or body text), ``url`` (base URL of the conductor).
    """

    def __init__(
        self,
        message: str,
        *,
        route: str,
        status_code: int | None = None,
        server_error: str | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.route = route
        self.status_code = status_code
        self.server_error = server_error
        self.url = url


class CircuitOpenError(ConductorError):
    """The call was not attempted: the circuit breaker is open."""


class CircuitBreaker:
    """Consecutive-failure breaker: closed -> open -> half-open -> closed/open.

    ``clock`` returns seconds (monotonic); inject a fake one in tests.
    Thread-safe; the async client uses it from one event loop.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(
        self,
        threshold: int = BREAKER_THRESHOLD,
        cooldown: float = BREAKER_COOLDOWN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError("breaker threshold must be >= 1")
        if cooldown < 0:
            raise ValueError("breaker cooldown must be >= 0")
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._state = self.CLOSED

    @property
    def state(self) -> str:
        """Current state; an open breaker whose cooldown passed still reads ``open``
        until a call takes the half-open slot."""
        return self._state

    @property
    def failures(self) -> int:
        return self._failures

    def retry_in(self) -> float:
        """Seconds until the half-open attempt is allowed (0 when not open)."""
        with self._lock:
            if self._state != self.OPEN:
                return 0.0
            return max(0.0, self._opened_at + self.cooldown - self._clock())

    def allow(self) -> bool:
        """May a call go out now? Takes the single half-open slot when due."""
        with self._lock:
            if self._state == self.CLOSED:
                return True
            if self._state == self.OPEN:
                if self._clock() - self._opened_at >= self.cooldown:
                    self._state = self.HALF_OPEN
                    self._probing = True
                    logger.info("conductor circuit half-open: trying one call")
                    return True
                return False
            # HALF_OPEN: one probe at a time.
            if self._probing:
                return False
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            if self._state != self.CLOSED:
                logger.info("conductor circuit closed")
            self._state = self.CLOSED
            self._failures = 0
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._state == self.HALF_OPEN or self._failures >= self.threshold:
                if self._state != self.OPEN:
                    logger.warning(
                        "conductor circuit OPEN after %d consecutive failures (cooldown %.0f s)",
                        self._failures, self.cooldown,
                    )
                self._state = self.OPEN
                self._opened_at = self._clock()

    def release(self) -> None:
        """The half-open probe ended without a verdict (e.g. cancelled): free the slot."""
        with self._lock:
            self._probing = False


# ---------------------------------------------------------------------------
# Token encodings

_U32 = "I" if array.array("I").itemsize == 4 else "L"
_LITTLE = sys.byteorder == "little"
_MASK32 = 0xFFFFFFFF


def _is_numpy(obj: Any) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "numpy"


def _u32_array(values: Iterable[int]) -> array.array:
    if not isinstance(values, (list, tuple)):
        values = list(values)
    try:
        return array.array(_U32, values)
    except OverflowError:
        return array.array(_U32, [int(v) & _MASK32 for v in values])


def _le_bytes(a: array.array) -> bytes:
    if not _LITTLE:
        a = array.array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _raw_u32(buf: bytes | bytearray | memoryview) -> bytes:
    data = bytes(buf)
    if len(data) % 4:
        raise ValueError(f"packed token buffer of {len(data)} bytes is not a multiple of 4")
    return data


def pack_tokens(tokens: Any) -> bytes:
    """Token ids as little-endian u32 bytes (each value truncated to its low 32 bits).

    Accepts a list/tuple of ints, ``array('I')`` (or any integer ``array``), a
    1-D numpy integer array (numpy is imported only if such an array is
    passed), an integer-format ``memoryview``, or bytes-like data with 1-byte
    items (``bytes``, ``bytearray``, ``memoryview`` of format ``B``), which is
    taken as already-packed u32 LE and must have a length multiple of 4.
    """
    if isinstance(tokens, (bytes, bytearray)):
        return _raw_u32(tokens)
    if isinstance(tokens, memoryview):
        if tokens.itemsize == 1 and tokens.format in ("B", "b", "c"):
            return _raw_u32(tokens)
        if _LITTLE and tokens.itemsize == 4 and tokens.format.lstrip("@=<") in ("I", "L"):
            return tokens.tobytes()
        tokens = tokens.tolist()
    if isinstance(tokens, array.array):
        if tokens.typecode == _U32:
            return _le_bytes(tokens)
        return _le_bytes(_u32_array(tokens.tolist()))
    if _is_numpy(tokens):
        import numpy as np  # optional dependency, only when given a numpy array

        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"token array must be 1-D integer, got shape {arr.shape} dtype {arr.dtype}")
        return arr.astype("<u4", copy=False).tobytes()
    return _le_bytes(_u32_array(tokens))


def token_list(tokens: Any) -> list[int]:
    """Token ids as a list of Python ints, for the unpacked JSON/msgpack array body.

    Same inputs as :func:`pack_tokens`; bytes-like input is read as packed u32 LE.
    Values are passed through unchanged (the server truncates to u32).
    """
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, (bytes, bytearray)) or (
        isinstance(tokens, memoryview) and tokens.itemsize == 1 and tokens.format in ("B", "b", "c")
    ):
        a = array.array(_U32)
        a.frombytes(_raw_u32(tokens))
        if not _LITTLE:
            a.byteswap()
        return a.tolist()
    if isinstance(tokens, (array.array, memoryview)) or _is_numpy(tokens):
        out = tokens.tolist()
        if not isinstance(out, list) or (out and isinstance(out[0], list)):
            raise TypeError("token ids must be one-dimensional")
        return out
    return [int(t) for t in tokens]


def _hash_list(hashes: Any) -> list[int]:
    if isinstance(hashes, list):
        return hashes
    if isinstance(hashes, (array.array, memoryview)) or _is_numpy(hashes):
        return hashes.tolist()
    return [int(h) for h in hashes]


# ---------------------------------------------------------------------------
# Client core (shared by the sync and async clients)


def _content_type(resp: httpx.Response) -> str:
    return resp.headers.get("content-type", "").strip().lower()


def _is_msgpack(ct: str) -> bool:
    return ct.startswith(MSGPACK_CT) or ct.startswith("application/x-msgpack")


def _decode(resp: httpx.Response) -> Any:
    """Body by Content-Type: msgpack when it starts with application/msgpack, else JSON."""
    body = resp.content
    if not body:
        return None
    if _is_msgpack(_content_type(resp)):
        return msgspec.msgpack.decode(body)
    return msgspec.json.decode(body)


def _server_error(resp: httpx.Response) -> str:
    try:
        data = _decode(resp)
    except (msgspec.DecodeError, ValueError):
        data = None
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, str):
            return err
        if "errors" in data:  # /events partial failure
            return f"{data.get('status', 'error')}: {data.get('errors')}"
        return str(data)
    text = resp.text.strip()
    if len(text) > 500:
        text = text[:500] + "..."
    return text or "(empty body)"


@dataclasses.dataclass
class _Req:
    method: str
    path: str
    content: bytes | None
    headers: dict[str, str]
    timeout: float
    breaker: bool = True

    @property
    def route(self) -> str:
        return f"{self.method} {self.path}"


class _Core:
    def __init__(
        self,
        base_url: str,
        *,
        query_encoding: str = "msgpack",
        packed: bool = False,
        query_timeout: float = QUERY_TIMEOUT,
        register_timeout: float = REGISTER_TIMEOUT,
        workers_timeout: float = REGISTER_TIMEOUT,
        health_timeout: float = HEALTH_TIMEOUT,
        breaker: CircuitBreaker | None = None,
        breaker_threshold: int = BREAKER_THRESHOLD,
        breaker_cooldown: float = BREAKER_COOLDOWN,
        clock: Callable[[], float] = time.monotonic,
        api_key: str | None = None,
    ) -> None:
        if "://" not in base_url:
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        enc = (query_encoding or "").strip().lower()
        if enc not in ("msgpack", "json"):
            logger.warning("query_encoding %r is not msgpack|json; using msgpack", query_encoding)
            enc = "msgpack"
        self.query_encoding = enc
        if packed and enc != "msgpack":
            raise ValueError("packed token bodies need query_encoding='msgpack'")
        self.packed = bool(packed)
        for name, value in (
            ("query_timeout", query_timeout),
            ("register_timeout", register_timeout),
            ("workers_timeout", workers_timeout),
            ("health_timeout", health_timeout),
        ):
            if not value or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.query_timeout = float(query_timeout)
        self.register_timeout = float(register_timeout)
        self.workers_timeout = float(workers_timeout)
        self.health_timeout = float(health_timeout)
        self.breaker = breaker or CircuitBreaker(breaker_threshold, breaker_cooldown, clock)
        # Sent on every request; the server checks it on /register, /unregister and /events.
        self._default_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    # -- request builders --------------------------------------------------

    def _query_req(
        self, model: str, token_ids: Any, block_size: int, tenant_id: str, packed: bool | None,
        lora_name: str | None = None,
    ) -> _Req:
        use_packed = self.packed if packed is None else bool(packed)
        if use_packed and self.query_encoding != "msgpack":
            raise ValueError("packed token bodies need query_encoding='msgpack'")
        tokens: Any = pack_tokens(token_ids) if use_packed else token_list(token_ids)
        body = {"model": model, "block_size": int(block_size), "token_ids": tokens, "tenant_id": tenant_id}
        if lora_name:
            # Only sent when set, so base-model queries stay byte-identical for older servers.
            body["lora_name"] = lora_name
        return self._encoded("/query", body)

    def _query_by_hash_req(self, model: str, block_hashes: Any, tenant_id: str, block_size: int) -> _Req:
        # Always an array of integers: the server takes no packed form for hashes.
        body = {
            "model": model,
            "block_size": int(block_size),
            "block_hashes": _hash_list(block_hashes),
            "tenant_id": tenant_id,
        }
        return self._encoded("/query_by_hash", body)

    def _encoded(self, path: str, body: dict) -> _Req:
        if self.query_encoding == "msgpack":
            content, ct = _MSGPACK_ENCODER.encode(body), MSGPACK_CT
        else:
            content, ct = _JSON_ENCODER.encode(body), JSON_CT
        return _Req("POST", path, content, {"content-type": ct, "accept": f"{ct}, {JSON_CT}"}, self.query_timeout)

    def _json_req(self, path: str, body: Any, timeout: float) -> _Req:
        return _Req("POST", path, _JSON_ENCODER.encode(body), {"content-type": JSON_CT}, timeout)

    def _register_req(self, payload: Mapping[str, Any] | None, kwargs: dict) -> _Req:
        body = {**(payload or {}), **kwargs}
        missing = [k for k in ("instance_id", "type", "modelname", "block_size", "dp_rank") if k not in body]
        if missing:
            raise ValueError(f"register payload lacks required field(s): {', '.join(missing)}")
        return self._json_req("/register", body, self.register_timeout)

    def _unregister_req(self, payload: Mapping[str, Any] | None, kwargs: dict) -> _Req:
        body = {**(payload or {}), **kwargs}
        missing = [k for k in ("instance_id", "dp_rank") if k not in body]
        if missing:
            raise ValueError(f"unregister payload lacks required field(s): {', '.join(missing)}")
        # The server requires these although it only uses instance_id/dp_rank (docs/api.md,
        # POST /unregister).
        body.setdefault("type", "vLLM")
        body.setdefault("modelname", "")
        body.setdefault("block_size", 0)
        return self._json_req("/unregister", body, self.register_timeout)

    # -- breaker and response handling --------------------------------------

    def _admit(self, req: _Req) -> None:
        if req.breaker and not self.breaker.allow():
            wait = self.breaker.retry_in()
            raise CircuitOpenError(
                f"{req.route} not sent: conductor circuit open after {self.breaker.failures} "
                f"consecutive failures (next try in {wait:.1f} s) [{self.base_url}]",
                route=req.route,
                url=self.base_url,
            )

    def _transport_error(self, req: _Req, exc: Exception) -> ConductorError:
        if isinstance(exc, httpx.TimeoutException):
            what = f"timed out after {req.timeout:g} s ({type(exc).__name__})"
        else:
            what = f"failed: {type(exc).__name__}: {exc}"
        return ConductorError(f"{req.route} {what} [{self.base_url}]", route=req.route, url=self.base_url)

    def _finish(self, req: _Req, resp: httpx.Response) -> Any:
        """Decode a response; raise ConductorError on a bad status or body. Feeds the breaker."""
        status = resp.status_code
        if status >= 400:
            if req.breaker:
                if status >= 500:
                    self.breaker.record_failure()
                else:
                    self.breaker.record_success()
            err = _server_error(resp)
            raise ConductorError(
                f"{req.route} -> HTTP {status}: {err} [{self.base_url}]",
                route=req.route,
                status_code=status,
                server_error=err,
                url=self.base_url,
            )
        try:
            data = _decode(resp)
        except (msgspec.DecodeError, ValueError) as exc:
            if req.breaker:
                self.breaker.record_failure()
            ct = _content_type(resp) or "no content-type"
            raise ConductorError(
                f"{req.route} -> HTTP {status}: undecodable body ({ct}): {exc} [{self.base_url}]",
                route=req.route,
                status_code=status,
                url=self.base_url,
            ) from None
        if req.breaker:
            self.breaker.record_success()
        return data

    def _expect_map(self, req: _Req, data: Any, status: int = 200) -> dict:
        if not isinstance(data, dict):
            raise ConductorError(
                f"{req.route}: expected an object, got {type(data).__name__} [{self.base_url}]",
                route=req.route,
                status_code=status,
                url=self.base_url,
            )
        return data

    def _log_query(self, tenant_id: str, data: dict) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            tenant = data.get(tenant_id) or {}
            logger.debug(
                "conductor query: %d instance(s) hit: %s",
                len(tenant),
                ", ".join(f"{k}={v.get('longest_matched', 0)}" for k, v in tenant.items() if isinstance(v, dict)),
            )


@dataclasses.dataclass
class ReregisterResult:
    """Outcome of :meth:`ConductorClient.reregister_missing`."""

    present: list[dict]
    registered: list[dict]
    failed: list[tuple[dict, ConductorError]]


def tls_verify(verify: Any = True, cert: Any = None) -> Any:
    """The ``verify=`` for httpx of a ``verify`` and a client ``cert``.

    ``verify``: ``True`` (the default CAs), ``False``, a CA bundle path or an
    ``ssl.SSLContext``. ``cert``: a PEM file holding the client certificate and
    key, or ``(cert_file, key_file)`` / ``(cert_file, key_file, password)``, for
    a server started with ``--tls-client-ca``. httpx 0.28 deprecates its own
    ``cert=`` and string ``verify=``, so both become one ``SSLContext`` here.
    """
    if cert is None and not isinstance(verify, (str, os.PathLike)):
        return verify
    if isinstance(verify, ssl.SSLContext):
        ctx = verify
    elif verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, (str, os.PathLike)):
        path = os.fspath(verify)
        ctx = ssl.create_default_context(capath=path) if os.path.isdir(path) else \
            ssl.create_default_context(cafile=path)
    else:
        try:
            import certifi  # what httpx trusts by default
            ctx = ssl.create_default_context(cafile=certifi.where())
        except ImportError:  # pragma: no cover
            ctx = ssl.create_default_context()
    if cert is not None:
        if isinstance(cert, (str, os.PathLike)):
            ctx.load_cert_chain(cert)
        else:
            ctx.load_cert_chain(*cert)
    return ctx


def _limits(pool_size: int) -> httpx.Limits:
    return httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size, keepalive_expiry=30.0)


class ConductorClient(_Core):
    """Synchronous conductor client over one pooled ``httpx.Client``.

    ``base_url``: ``http://host:13333`` (IPv6: ``http://[::1]:13333``; see
    :func:`conductor_base_url`). ``query_encoding``: ``"msgpack"`` (default)
    or ``"json"``; anything else logs a warning and uses msgpack.
    ``packed``: send ``token_ids`` as a msgpack bin of little-endian u32
    (needs msgpack). ``transport``: an ``httpx`` transport (tests).
    ``trust_env`` is off by default so proxy variables cannot capture
    cluster-internal traffic. ``clock`` drives the breaker (tests).
    ``api_key``: sent as ``Authorization: Bearer <key>`` (a server started
    with ``--api-key`` requires it on ``/register``, ``/unregister``, ``/events``
    and ``/workers``). ``verify`` / ``cert``: for an HTTPS server (``--tls-cert``;
    ``cert`` for ``--tls-client-ca``), see :func:`tls_verify`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        pool_size: int = 32,
        transport: httpx.BaseTransport | None = None,
        trust_env: bool = False,
        verify: Any = True,
        cert: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(base_url, **options)
        self._http = httpx.Client(
            base_url=self.base_url,
            limits=_limits(pool_size),
            timeout=self.register_timeout,
            transport=transport,
            trust_env=trust_env,
            verify=tls_verify(verify, cert),
            headers=self._default_headers,
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | "KvConductorConfig", **options: Any) -> "ConductorClient | None":
        """Client for a ``kv_conductor_config``; ``None`` when ``conductor_service`` is empty (disabled)."""
        cfg = KvConductorConfig.coerce(config)
        if not cfg.conductor_service:
            return None
        options.setdefault("query_encoding", cfg.query_encoding)
        return cls(conductor_base_url(cfg.conductor_service, cfg.http_server_port), **options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ConductorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, req: _Req) -> Any:
        self._admit(req)
        verdict = False
        try:
            try:
                resp = self._http.request(
                    req.method, req.path, content=req.content, headers=req.headers, timeout=req.timeout
                )
            except httpx.HTTPError as exc:
                if req.breaker:
                    self.breaker.record_failure()
                verdict = True
                raise self._transport_error(req, exc) from exc
            verdict = True
            return self._finish(req, resp)
        finally:
            if req.breaker and not verdict:
                self.breaker.release()

    # -- routes --------------------------------------------------------------

    def health(self) -> bool:
        """``GET /health`` answered 200; never raises, does not touch the breaker."""
        try:
            resp = self._http.get("/health", timeout=self.health_timeout)
        except httpx.HTTPError as exc:
            logger.debug("conductor health check failed: %s", exc)
            return False
        return resp.status_code == 200

    def register(self, payload: Mapping[str, Any] | None = None, **kwargs: Any) -> dict:
        """``POST /register`` (JSON). ``payload`` and ``kwargs`` are merged (kwargs win)."""
        req = self._register_req(payload, kwargs)
        return self._send(req) or {}

    def unregister(self, payload: Mapping[str, Any] | None = None, **kwargs: Any) -> dict:
        """``POST /unregister`` (JSON). Only ``instance_id`` and ``dp_rank`` are needed;
        ``type``/``modelname``/``block_size`` get placeholders when absent."""
        req = self._unregister_req(payload, kwargs)
        return self._send(req) or {}

    def query(
        self,
        model: str,
        token_ids: Any,
        block_size: int,
        tenant_id: str = TENANT_ID,
        *,
        packed: bool | None = None,
        lora_name: str | None = None,
    ) -> dict:
        """``POST /query``; returns ``{tenant_id: {instance: {...}}}``. Raises ConductorError.

        ``lora_name`` asks for the blocks of that LoRA adapter (engines publish them with
        ``lora_name``); ``None`` or ``""`` asks for the base model's.
        """
        req = self._query_req(model, token_ids, block_size, tenant_id, packed, lora_name)
        data = self._expect_map(req, self._send(req))
        self._log_query(tenant_id, data)
        return data

    def query_or_empty(self, model: str, token_ids: Any, block_size: int, tenant_id: str = TENANT_ID, **kw: Any) -> dict:
        """Like :meth:`query` but returns ``{}`` on any ConductorError (reference behaviour)."""
        try:
            return self.query(model, token_ids, block_size, tenant_id, **kw)
        except ConductorError as exc:
            logger.warning("%s", exc)
            return {}

    def query_by_hash(
        self, model: str, block_hashes: Any, tenant_id: str = TENANT_ID, *, block_size: int = 1
    ) -> dict:
        """``POST /query_by_hash``: counts are in blocks (the server ignores ``block_size``)."""
        req = self._query_by_hash_req(model, block_hashes, tenant_id, block_size)
        return self._expect_map(req, self._send(req))

    def workers(self) -> dict:
        """``GET /workers`` (debug view of registrations and indexes)."""
        req = _Req("GET", "/workers", None, {"accept": JSON_CT}, self.workers_timeout)
        return self._expect_map(req, self._send(req))

    def post_events(self, batch: Mapping[str, Any]) -> dict:
        """``POST /events`` (JSON ``KvEventBatch``, docs/api.md, POST /events)."""
        req = self._json_req("/events", batch, self.register_timeout)
        return self._send(req) or {}

    def registered_services(self) -> list:
        """Entries of ``GET /workers``, else of a Mooncake master's ``GET /services``, else ``[]``."""
        try:
            workers = self.workers().get("workers")
            if isinstance(workers, list) and workers:
                return workers
        except ConductorError as exc:
            logger.info("GET /workers failed (%s); trying /services", exc)
        try:
            req = _Req("GET", "/services", None, {"accept": JSON_CT}, self.workers_timeout)
            services = self._send(req)
            if isinstance(services, dict) and isinstance(services.get("services"), list):
                return services["services"]
        except ConductorError as exc:
            logger.info("GET /services failed: %s", exc)
        return []

    def reregister_missing(self, local: Iterable[Mapping[str, Any]]) -> ReregisterResult:
        """Register every payload in ``local`` whose ``(instance_id, dp_rank)`` the conductor lacks.

        Failures are collected, not raised.
        """
        local = [p for p in local if p]
        missing = missing_registrations(self.registered_services(), local)
        missing_ids = {id(p) for p in missing}
        result = ReregisterResult([p for p in local if id(p) not in missing_ids], [], [])
        for payload in missing:
            logger.info("re-registering %s dp_rank=%s", payload.get("instance_id"), payload.get("dp_rank"))
            try:
                self.register(payload)
                result.registered.append(payload)
            except ConductorError as exc:
                logger.error("re-registration of %s dp_rank=%s failed: %s",
                             payload.get("instance_id"), payload.get("dp_rank"), exc)
                result.failed.append((payload, exc))
        return result


class AsyncConductorClient(_Core):
    """``asyncio`` twin of :class:`ConductorClient` over one ``httpx.AsyncClient``."""

    def __init__(
        self,
        base_url: str,
        *,
        pool_size: int = 32,
        transport: httpx.AsyncBaseTransport | None = None,
        trust_env: bool = False,
        verify: Any = True,
        cert: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(base_url, **options)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            limits=_limits(pool_size),
            timeout=self.register_timeout,
            transport=transport,
            trust_env=trust_env,
            verify=tls_verify(verify, cert),
            headers=self._default_headers,
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | "KvConductorConfig", **options: Any) -> "AsyncConductorClient | None":
        cfg = KvConductorConfig.coerce(config)
        if not cfg.conductor_service:
            return None
        options.setdefault("query_encoding", cfg.query_encoding)
        return cls(conductor_base_url(cfg.conductor_service, cfg.http_server_port), **options)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncConductorClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _send(self, req: _Req) -> Any:
        self._admit(req)
        verdict = False
        try:
            try:
                resp = await self._http.request(
                    req.method, req.path, content=req.content, headers=req.headers, timeout=req.timeout
                )
            except httpx.HTTPError as exc:
                if req.breaker:
                    self.breaker.record_failure()
                verdict = True
                raise self._transport_error(req, exc) from exc
            verdict = True
            return self._finish(req, resp)
        finally:
            if req.breaker and not verdict:
                self.breaker.release()

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=self.health_timeout)
        except httpx.HTTPError as exc:
            logger.debug("conductor health check failed: %s", exc)
            return False
        return resp.status_code == 200

    async def register(self, payload: Mapping[str, Any] | None = None, **kwargs: Any) -> dict:
        return await self._send(self._register_req(payload, kwargs)) or {}

    async def unregister(self, payload: Mapping[str, Any] | None = None, **kwargs: Any) -> dict:
        return await self._send(self._unregister_req(payload, kwargs)) or {}

    async def query(
        self,
        model: str,
        token_ids: Any,
        block_size: int,
        tenant_id: str = TENANT_ID,
        *,
        packed: bool | None = None,
        lora_name: str | None = None,
    ) -> dict:
        """``POST /query`` (see :meth:`ConductorClient.query`)."""
        req = self._query_req(model, token_ids, block_size, tenant_id, packed, lora_name)
        data = self._expect_map(req, await self._send(req))
        self._log_query(tenant_id, data)
        return data

    async def query_or_empty(
        self, model: str, token_ids: Any, block_size: int, tenant_id: str = TENANT_ID, **kw: Any
    ) -> dict:
        try:
            return await self.query(model, token_ids, block_size, tenant_id, **kw)
        except ConductorError as exc:
            logger.warning("%s", exc)
            return {}

    async def query_by_hash(
        self, model: str, block_hashes: Any, tenant_id: str = TENANT_ID, *, block_size: int = 1
    ) -> dict:
        req = self._query_by_hash_req(model, block_hashes, tenant_id, block_size)
        return self._expect_map(req, await self._send(req))

    async def workers(self) -> dict:
        req = _Req("GET", "/workers", None, {"accept": JSON_CT}, self.workers_timeout)
        return self._expect_map(req, await self._send(req))

    async def post_events(self, batch: Mapping[str, Any]) -> dict:
        return await self._send(self._json_req("/events", batch, self.register_timeout)) or {}

    async def registered_services(self) -> list:
        try:
            workers = (await self.workers()).get("workers")
            if isinstance(workers, list) and workers:
                return workers
        except ConductorError as exc:
            logger.info("GET /workers failed (%s); trying /services", exc)
        try:
            req = _Req("GET", "/services", None, {"accept": JSON_CT}, self.workers_timeout)
            services = await self._send(req)
            if isinstance(services, dict) and isinstance(services.get("services"), list):
                return services["services"]
        except ConductorError as exc:
            logger.info("GET /services failed: %s", exc)
        return []

    async def reregister_missing(self, local: Iterable[Mapping[str, Any]]) -> ReregisterResult:
        local = [p for p in local if p]
        missing = missing_registrations(await self.registered_services(), local)
        missing_ids = {id(p) for p in missing}
        result = ReregisterResult([p for p in local if id(p) not in missing_ids], [], [])
        for payload in missing:
            logger.info("re-registering %s dp_rank=%s", payload.get("instance_id"), payload.get("dp_rank"))
            try:
                await self.register(payload)
                result.registered.append(payload)
            except ConductorError as exc:
                logger.error("re-registration of %s dp_rank=%s failed: %s",
                             payload.get("instance_id"), payload.get("dp_rank"), exc)
                result.failed.append((payload, exc))
        return result


# ---------------------------------------------------------------------------
# Configuration and registration helpers (docs/client.md, "Registration helpers";
# docs/engines.md, "Coordinator configuration")


@dataclasses.dataclass
class KvConductorConfig:
    """``scheduler_config.kv_conductor_config``; unknown keys are ignored.

    The keys are described in docs/engines.md, "Coordinator configuration".
    """

    conductor_service: str = ""
    http_server_port: int = DEFAULT_PORT
    query_encoding: str = "msgpack"
    store_backend: str = ""
    block_size: int = 128
    engine_type: str = "vLLM"
    model_path: str = ""
    pool_endpoint: str = ""
    npu_endpoint: str = ""
    xpu_endpoint: str = ""
    cpu_endpoint: str = ""
    disk_endpoint: str = ""
    endpoint: str = ""
    replay_endpoint: str = ""
    re_register_interval_sec: float = 0

    @classmethod
    def coerce(cls, config: Mapping[str, Any] | "KvConductorConfig" | Any) -> "KvConductorConfig":
        """Accept this dataclass, a mapping, or any object with the same attribute names."""
        if isinstance(config, cls):
            return config
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(config, Mapping):
            values = {k: config[k] for k in names if k in config and config[k] is not None}
        else:
            values = {k: getattr(config, k) for k in names if getattr(config, k, None) is not None}
        return cls(**values)


def format_host(host: str) -> str:
    """Bracket an IPv6 literal (``2001:db8::1`` -> ``[2001:db8::1]``); others unchanged."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def conductor_base_url(service: str, port: int = DEFAULT_PORT, scheme: str = "http") -> str:
    """``http://<host>:<port>`` for a conductor host (IPv6 bracketed). A value that
    already carries a scheme is returned unchanged."""
    if "://" in service:
        return service.rstrip("/")
    return f"{scheme}://{format_host(service)}:{int(port)}"


def resolve_endpoint(pattern: str | None, host: str, dp_rank: int) -> str | None:
    """Resolve an engine bind pattern for one DP: ``tcp://*:5557`` -> ``tcp://<host>:<5557 + dp_rank>``.

    ``None`` when the pattern is empty, does not split into exactly two parts
    on ``"*:"``, or its port is not an integer.
    """
    if not pattern:
        return None
    parts = pattern.split("*:")
    if len(parts) != 2:
        logger.debug("endpoint pattern malformed: %r", pattern)
        return None
    try:
        port = int(parts[1])
    except ValueError:
        logger.debug("endpoint pattern has no integer port: %r", pattern)
        return None
    return f"{parts[0]}{format_host(host)}:{port + int(dp_rank)}"


_ROLE_PREFIX = {
    "P": "vllm-prefill", "PREFILL": "vllm-prefill",
    "E": "vllm-prefill", "ENCODE": "vllm-prefill",
    "U": "vllm-union", "UNION": "vllm-union",
    "D": "vllm-decode", "DECODE": "vllm-decode",
}


def instance_name(role: Any, instance_id: Any) -> str:
    """Conductor instance id: P/E -> ``vllm-prefill-<id>``, U -> ``vllm-union-<id>``,
    D -> ``vllm-decode-<id>``. ``role`` may be a letter, a word, ``ROLE_P`` or an
    enum whose value is one of those. Unknown roles raise ``ValueError``."""
    key = str(getattr(role, "value", role)).strip().upper()
    if key.startswith("ROLE_"):
        key = key[5:]
    prefix = _ROLE_PREFIX.get(key)
    if prefix is None:
        raise ValueError(f"no conductor instance naming for role {role!r}")
    return f"{prefix}-{instance_id}"


DECODE_PREFIX = "vllm-decode-"


def strip_decode_instances(tenant_map: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of one tenant's instance map without ``vllm-decode-*`` entries."""
    return {k: v for k, v in tenant_map.items() if not str(k).startswith(DECODE_PREFIX)}


_BACKENDS = {"mooncake": "Mooncake", "memcache": "Memcache", "yuanrong": "YuanRong"}


def canonical_store_backend(store_backend: str | None) -> str:
    """Case-insensitive canonical spelling (``mooncake`` -> ``Mooncake``); ``""`` stays
    ``""``; unknown names are returned stripped but otherwise unchanged."""
    s = (store_backend or "").strip()
    return _BACKENDS.get(s.lower(), s)


def resolve_store_backend(store_backend: str | None) -> str:
    """The backend the coordinator registers: canonical, with ``""`` meaning ``Mooncake``
    (the reference client's and the server's default)."""
    return canonical_store_backend(store_backend) or "Mooncake"


def backend_mode(store_backend: str | None) -> str:
    """``"pool"`` for Mooncake/Memcache, ``"per_dp"`` for YuanRong or ``""``; unknown
    backends are per-DP with a warning."""
    sb = canonical_store_backend(store_backend)
    if sb in ("Mooncake", "Memcache"):
        return "pool"
    if sb not in ("YuanRong", ""):
        logger.warning("unknown store_backend %r; registering per DP", store_backend)
    return "per_dp"


def build_medium_endpoints(
    config: Mapping[str, Any] | KvConductorConfig, host: str, dp_rank: int, mode: str | None = None
) -> dict[str, str]:
    """``medium_endpoints`` for one DP; ``{}`` when no pattern resolves.

    Pool mode (Mooncake/Memcache): ``{"npu": npu_endpoint or xpu_endpoint or endpoint}``.
    Per-DP mode (YuanRong): the non-empty of ``npu`` (npu/xpu pattern), ``cpu``
    and ``disk``, each falling back to the ``endpoint`` pattern.
    """
    cfg = KvConductorConfig.coerce(config)
    if mode is None:
        mode = backend_mode(resolve_store_backend(cfg.store_backend))
    npu = resolve_endpoint(cfg.npu_endpoint or cfg.xpu_endpoint or cfg.endpoint, host, dp_rank)
    if mode == "pool":
        return {"npu": npu} if npu else {}
    fallback = resolve_endpoint(cfg.endpoint, host, dp_rank)
    out = {
        "npu": npu or fallback,
        "cpu": resolve_endpoint(cfg.cpu_endpoint, host, dp_rank) or fallback,
        "disk": resolve_endpoint(cfg.disk_endpoint, host, dp_rank) or fallback,
    }
    return {k: v for k, v in out.items() if v}


def build_pool_registration(
    config: Mapping[str, Any] | KvConductorConfig,
    *,
    tenant_id: str = TENANT_ID,
    env: Mapping[str, str] | None = None,
) -> dict | None:
    """The once-per-cluster pool registration (Mooncake/Memcache), or ``None``.

    ``None`` when the backend is not a pool backend, ``pool_endpoint`` is
    empty, or it contains ``*`` and ``KVS_MASTER_SERVICE`` is unset (a
    warning is logged). ``modelname`` is ``model_path or "default"``. The
    reference needed it to equal the engines' model name for pool hits to land
    in their index; kvconductor applies a pool event to the index of each
    engine DP it resolves to, so it need not (docs/client.md, "Registration
    helpers").
    """
    cfg = KvConductorConfig.coerce(config)
    backend = resolve_store_backend(cfg.store_backend)
    if backend_mode(backend) != "pool":
        return None
    endpoint = cfg.pool_endpoint
    if not endpoint:
        logger.warning("no pool_endpoint for %s; pool not registered", backend)
        return None
    if "*" in endpoint:
        master = (os.environ if env is None else env).get("KVS_MASTER_SERVICE", "")
        if not master:
            logger.warning("pool_endpoint %r needs KVS_MASTER_SERVICE, which is unset; pool not registered", endpoint)
            return None
        endpoint = endpoint.replace("*", format_host(master))
    payload = {
        "instance_id": f"{backend.lower()}-pool",
        "endpoint": endpoint,
        "type": cfg.engine_type,
        "store_backend": backend,
        "modelname": cfg.model_path or "default",
        "block_size": int(cfg.block_size),
        "dp_rank": 0,
    }
    if tenant_id != TENANT_ID:
        payload["tenant_id"] = tenant_id
    return payload


def build_dp_registration(
    config: Mapping[str, Any] | KvConductorConfig,
    instance_id: str,
    model_name: str,
    dp_rank: int,
    host: str,
    *,
    tenant_id: str = TENANT_ID,
) -> dict:
    """The ``/register`` payload of one engine DP (docs/client.md, "Registration helpers").

    Without any endpoint pattern the payload has no ``medium_endpoints``: an
    "HTTP-only" registration fed by ``/events``. ``replay_endpoint`` is added
    when its pattern resolves.
    """
    cfg = KvConductorConfig.coerce(config)
    backend = resolve_store_backend(cfg.store_backend)
    mode = backend_mode(backend)
    payload: dict[str, Any] = {
        "instance_id": instance_id,
        "type": cfg.engine_type,
        "store_backend": backend,
        "modelname": model_name,
        "block_size": int(cfg.block_size),
        "dp_rank": int(dp_rank),
    }
    media = build_medium_endpoints(cfg, host, dp_rank, mode)
    if media:
        payload["medium_endpoints"] = media
    replay = resolve_endpoint(cfg.replay_endpoint, host, dp_rank)
    if replay:
        payload["replay_endpoint"] = replay
    if tenant_id != TENANT_ID:
        payload["tenant_id"] = tenant_id
    return payload


def build_unregister_payload(
    config: Mapping[str, Any] | KvConductorConfig,
    instance_id: str,
    model_name: str,
    dp_rank: int,
    *,
    tenant_id: str = TENANT_ID,
) -> dict:
    """The ``/unregister`` payload: ``{type, modelname, block_size, instance_id, dp_rank}``."""
    cfg = KvConductorConfig.coerce(config)
    payload = {
        "type": cfg.engine_type,
        "modelname": model_name,
        "block_size": int(cfg.block_size),
        "instance_id": instance_id,
        "dp_rank": int(dp_rank),
    }
    if tenant_id != TENANT_ID:
        payload["tenant_id"] = tenant_id
    return payload


def normalize_service_key(entry: Mapping[str, Any]) -> set[tuple[str, int]]:
    """``(instance_id, dp_rank)`` pairs of one registration entry.

    * conductor ``/workers`` entry: ``{"instance_id": ..., "endpoints": {"0": {...}, ...}}``
      (non-integer keys skipped);
    * Mooncake master ``/services`` entry: ``{"InstanceID": ..., "DPRank": n}``,
      ``DPRank`` missing or not an integer -> ``-1``.
    """
    keys: set[tuple[str, int]] = set()
    if not isinstance(entry, Mapping):
        return keys
    iid = entry.get("instance_id")
    endpoints = entry.get("endpoints")
    if iid and isinstance(endpoints, Mapping):
        for rank in endpoints:
            try:
                keys.add((str(iid), int(rank)))
            except (TypeError, ValueError):
                continue
        if keys:
            return keys
    iid = entry.get("InstanceID")
    if iid:
        raw = entry.get("DPRank", -1)
        try:
            dp = int(raw) if not isinstance(raw, bool) else -1
        except (TypeError, ValueError):
            dp = -1
        keys.add((str(iid), dp))
    return keys


def registered_keys(workers_response: Any) -> set[tuple[str, int]]:
    """All ``(instance_id, dp_rank)`` in a ``/workers`` or ``/services`` answer or entry list."""
    if isinstance(workers_response, Mapping):
        entries = workers_response.get("workers") or workers_response.get("services") or []
    else:
        entries = workers_response or []
    keys: set[tuple[str, int]] = set()
    for entry in entries:
        keys |= normalize_service_key(entry)
    return keys


def missing_registrations(workers_response: Any, local_endpoints: Iterable[Any]) -> list:
    """The items of ``local_endpoints`` the conductor does not have, in input order.

    ``workers_response``: a ``/workers`` answer, a ``/services`` answer, or a
    list of their entries. ``local_endpoints``: registration payloads (with
    ``instance_id`` and ``dp_rank``) or ``(instance_id, dp_rank)`` pairs.
    """
    have = registered_keys(workers_response)
    out = []
    for item in local_endpoints:
        if isinstance(item, Mapping):
            key = (str(item.get("instance_id")), int(item.get("dp_rank", -1)))
        else:
            key = (str(item[0]), int(item[1]))
        if key not in have:
            out.append(item)
    return out
