"""The sans-I/O core of the Coordinator client: requests built, answers judged.

Nothing here opens a socket. Every route is a *plan*: a generator that yields
the :class:`Request` objects it needs sent and receives each answer as a
:class:`Reply` (or a :class:`TransportFailure` thrown in), and returns the
route's result. :mod:`kvconductor.coordinator.clients` drives the plans over
``httpx`` (sync and async); a test can drive them by hand::

    core = ConductorCore("http://conductor:13333", query_encoding="json")
    plan = core.query_plan("qwen", [1, 2, 3], 128)
    req = next(plan)                               # Request("POST", "/query", ...)
    try:
        plan.send(Reply(200, "application/json", b'{"default": {}}'))
    except StopIteration as done:
        answer = done.value                        # {"default": {}}

Error contract (docs/client.md):

* ``query``/``query_by_hash``/``register``/``unregister``/``workers``/
  ``post_events``/``predict`` raise :class:`ConductorError` on any failure: transport
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
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvconductor.coordinator.breaker import (
    BREAKER_COOLDOWN,
    BREAKER_THRESHOLD,
    CircuitBreaker,
    CircuitOpenError,
    ConductorError,
)
from kvconductor.coordinator.exchange import (
    Plan,
    QueryAnswer,
    Reply,
    Request,
    TransportFailure,
    content_type_of,
    decode_reply,
    server_error,
)
from kvconductor.coordinator.tokens import hash_list, pack_tokens, token_list
from kvconductor.schema import (
    CACHE_SALT_FIELD,
    DEFAULT_TENANT,
    FRESHNESS_FIELD,
    INSTANCES_FIELD,
    JSON_CONTENT_TYPE,
    LORA_FIELD,
    MM_INPUTS_FIELD,
    MSGPACK_CONTENT_TYPE,
    TOP_K_FIELD,
    QueryByHashRequest,
    QueryRequest,
    RegisterRequest,
)

__all__ = ["TENANT_ID", "ConductorCore", "ReregisterResult"]

# The logger keeps the name of the module this code lived in (kvconductor.client).
logger = logging.getLogger("kvconductor.client")

TENANT_ID = DEFAULT_TENANT

QUERY_TIMEOUT = 3.0
REGISTER_TIMEOUT = 15.0
HEALTH_TIMEOUT = 3.0

_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_JSON_ENCODER = msgspec.json.Encoder()

#: The fields ``/register`` requires, by their wire names (from :class:`RegisterRequest`).
REGISTER_REQUIRED = tuple(
    f.encode_name for f in msgspec.structs.fields(RegisterRequest) if f.required
)


@dataclasses.dataclass
class ReregisterResult:
    """Outcome of :meth:`ConductorClient.reregister_missing`."""

    present: list[Mapping[str, Any]]
    registered: list[Mapping[str, Any]]
    failed: list[tuple[Mapping[str, Any], ConductorError]]


# ---------------------------------------------------------------------------
# The core: options, request builders, answer handling and the route plans


def _extension_fields(
    top_k: int | None,
    instances: Sequence[str] | None,
    freshness: bool = False,
    predict: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """The extension fields of a query body that are set (docs/api.md, "top_k and
    instances", "freshness"; ``predict``: the (instance, DP) of a ``/predict`` body); a
    ``top_k`` below 1 or a bare string as ``instances`` is a ValueError here rather than a
    400 from the server."""
    out: dict[str, Any] = {}
    if predict is not None:
        out["instance_id"], out["dp_rank"] = str(predict[0]), int(predict[1])
    if top_k is not None:
        if isinstance(top_k, bool) or int(top_k) < 1:
            raise ValueError(f"top_k must be at least 1, not {top_k!r}")
        out[TOP_K_FIELD] = int(top_k)
    if instances is not None:
        if isinstance(instances, str):
            raise ValueError("instances must be a sequence of instance ids, not a str")
        out[INSTANCES_FIELD] = [str(i) for i in instances]
    if freshness:
        out[FRESHNESS_FIELD] = True
    return out


def _extra_keys(cache_salt: str | None, mm_inputs: Sequence[Any] | None) -> dict[str, Any]:
    """A query's extra keys that are set (docs/api.md, "Extra keys"): ``cache_salt`` and
    ``mm_inputs``, each input a mapping with ``identifier``, ``offset`` and ``length`` or
    an ``(identifier, offset, length)`` triple."""
    out: dict[str, Any] = {}
    if cache_salt:
        out[CACHE_SALT_FIELD] = str(cache_salt)
    if mm_inputs:
        items = []
        for m in mm_inputs:
            ident, off, n = (
                (m["identifier"], m["offset"], m["length"]) if isinstance(m, Mapping) else m
            )
            items.append({"identifier": str(ident), "offset": int(off), "length": int(n)})
        out[MM_INPUTS_FIELD] = items
    return out


class ConductorCore:
    """Options and route plans shared by :class:`ConductorClient` and
    :class:`AsyncConductorClient` (which only send the requests)."""

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
        self.default_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, **options: Any) -> Any:
        """Client for a ``kv_conductor_config``; ``None`` when ``conductor_service`` is
        empty (disabled)."""
        from kvconductor.coordinator.registration import KvConductorConfig, conductor_base_url

        cfg = KvConductorConfig.coerce(config)
        if not cfg.conductor_service:
            return None
        options.setdefault("query_encoding", cfg.query_encoding)
        return cls(conductor_base_url(cfg.conductor_service, cfg.http_server_port), **options)

    # -- request builders --------------------------------------------------

    def _query_req(
        self,
        model: str,
        token_ids: Any,
        block_size: int,
        tenant_id: str,
        packed: bool | None,
        lora_name: str | None = None,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
        freshness: bool = False,
        predict: tuple[str, int] | None = None,
        extra_keys: dict[str, Any] | None = None,
    ) -> Request:
        use_packed = self.packed if packed is None else bool(packed)
        if use_packed and self.query_encoding != "msgpack":
            raise ValueError("packed token bodies need query_encoding='msgpack'")
        tokens: Any = pack_tokens(token_ids) if use_packed else token_list(token_ids)
        body: Any = QueryRequest(
            model=model, block_size=int(block_size), token_ids=tokens, tenant_id=tenant_id
        )
        # Only sent when set, so plain queries stay byte-identical for older servers.
        extra = _extension_fields(top_k, instances, freshness, predict)
        if lora_name:
            extra[LORA_FIELD] = lora_name
        extra.update(extra_keys or {})
        if extra:
            body = {**msgspec.structs.asdict(body), **extra}
        return self._encoded("/query" if predict is None else "/predict", body)

    def _query_by_hash_req(
        self,
        model: str,
        block_hashes: Any,
        tenant_id: str,
        block_size: int,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
        freshness: bool = False,
        predict: tuple[str, int] | None = None,
    ) -> Request:
        # Always an array of integers: the server takes no packed form for hashes.
        body: Any = QueryByHashRequest(
            model=model,
            block_size=int(block_size),
            block_hashes=hash_list(block_hashes),
            tenant_id=tenant_id,
        )
        extra = _extension_fields(top_k, instances, freshness, predict)
        if extra:
            body = {**msgspec.structs.asdict(body), **extra}
        return self._encoded("/query_by_hash" if predict is None else "/predict_by_hash", body)

    def _encoded(self, path: str, body: Any) -> Request:
        if self.query_encoding == "msgpack":
            content, ct = _MSGPACK_ENCODER.encode(body), MSGPACK_CONTENT_TYPE
        else:
            content, ct = _JSON_ENCODER.encode(body), JSON_CONTENT_TYPE
        return Request(
            "POST",
            path,
            content,
            {"content-type": ct, "accept": f"{ct}, {JSON_CONTENT_TYPE}"},
            self.query_timeout,
        )

    def _json_req(self, path: str, body: Any, timeout: float) -> Request:
        return Request(
            "POST", path, _JSON_ENCODER.encode(body), {"content-type": JSON_CONTENT_TYPE}, timeout
        )

    def _get_req(self, path: str) -> Request:
        return Request("GET", path, None, {"accept": JSON_CONTENT_TYPE}, self.workers_timeout)

    def _register_req(self, payload: Mapping[str, Any] | None, kwargs: dict) -> Request:
        body = {**(payload or {}), **kwargs}
        missing = [k for k in REGISTER_REQUIRED if k not in body]
        if missing:
            raise ValueError(f"register payload lacks required field(s): {', '.join(missing)}")
        return self._json_req("/register", body, self.register_timeout)

    def _unregister_req(self, payload: Mapping[str, Any] | None, kwargs: dict) -> Request:
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

    # -- one exchange: breaker and answer handling ----------------------------

    def _exchange(self, req: Request) -> Plan[Any]:
        """Send ``req`` (through the breaker) and return its decoded body; raises ConductorError."""
        self._admit(req)
        verdict = False
        try:
            try:
                reply = yield req
            except TransportFailure as failure:
                if req.breaker:
                    self.breaker.record_failure()
                verdict = True
                raise self._transport_error(req, failure) from failure.error
            verdict = True
            return self._finish(req, reply)
        finally:
            if req.breaker and not verdict:
                self.breaker.release()  # the exchange was abandoned (e.g. cancelled)

    def _admit(self, req: Request) -> None:
        if req.breaker and not self.breaker.allow():
            wait = self.breaker.retry_in()
            raise CircuitOpenError(
                f"{req.route} not sent: conductor circuit open after {self.breaker.failures} "
                f"consecutive failures (next try in {wait:.1f} s) [{self.base_url}]",
                route=req.route,
                url=self.base_url,
            )

    def _transport_error(self, req: Request, failure: TransportFailure) -> ConductorError:
        exc = failure.error
        if failure.timed_out:
            what = f"timed out after {req.timeout:g} s ({type(exc).__name__})"
        else:
            what = f"failed: {type(exc).__name__}: {exc}"
        return ConductorError(
            f"{req.route} {what} [{self.base_url}]", route=req.route, url=self.base_url
        )

    def _finish(self, req: Request, reply: Reply) -> Any:
        """Decode a reply; raise ConductorError on a bad status or body. Feeds the breaker."""
        status = reply.status
        if status >= 400:
            if req.breaker:
                if status >= 500:
                    self.breaker.record_failure()
                else:
                    self.breaker.record_success()
            err = server_error(reply)
            raise ConductorError(
                f"{req.route} -> HTTP {status}: {err} [{self.base_url}]",
                route=req.route,
                status_code=status,
                server_error=err,
                url=self.base_url,
            )
        try:
            data = decode_reply(reply)
        except (msgspec.DecodeError, ValueError) as exc:
            if req.breaker:
                self.breaker.record_failure()
            ct = content_type_of(reply) or "no content-type"
            raise ConductorError(
                f"{req.route} -> HTTP {status}: undecodable body ({ct}): {exc} [{self.base_url}]",
                route=req.route,
                status_code=status,
                url=self.base_url,
            ) from None
        if req.breaker:
            self.breaker.record_success()
        if reply.top_k_omitted is not None and isinstance(data, dict):
            return QueryAnswer(data, reply.top_k_omitted)  # a query with top_k
        return data

    def _expect_map(self, req: Request, data: Any, status: int = 200) -> dict:
        if not isinstance(data, dict):
            raise ConductorError(
                f"{req.route}: expected an object, got {type(data).__name__} [{self.base_url}]",
                route=req.route,
                status_code=status,
                url=self.base_url,
            )
        return data

    def _map_exchange(self, req: Request) -> Plan[dict]:
        return self._expect_map(req, (yield from self._exchange(req)))

    def _log_query(self, tenant_id: str, data: dict) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            tenant = data.get(tenant_id) or {}
            logger.debug(
                "conductor query: %d instance(s) hit: %s",
                len(tenant),
                ", ".join(
                    f"{k}={v.get('longest_matched', 0)}"
                    for k, v in tenant.items()
                    if isinstance(v, dict)
                ),
            )

    # -- route plans (the clients expose each as the method without ``_plan``) ----

    def health_plan(self) -> Plan[bool]:
        """``GET /health`` answered 200; never raises, does not touch the breaker."""
        try:
            reply = yield Request("GET", "/health", None, {}, self.health_timeout, breaker=False)
        except TransportFailure as failure:
            logger.debug("conductor health check failed: %s", failure.error)
            return False
        return reply.status == 200

    def register_plan(self, payload: Mapping[str, Any] | None = None, **kwargs: Any) -> Plan[dict]:
        """``POST /register`` (JSON). ``payload`` and ``kwargs`` are merged (kwargs win).
        ``engine_url="http://10.0.0.5:8000"`` (extension) registers every DP rank the
        engine lists on its ``GET /kv_event_sources`` (vLLM 0.33+)."""
        req = self._register_req(payload, kwargs)
        return (yield from self._exchange(req)) or {}

    def unregister_plan(
        self, payload: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Plan[dict]:
        """``POST /unregister`` (JSON). Only ``instance_id`` and ``dp_rank`` are needed;
        ``type``/``modelname``/``block_size`` get placeholders when absent."""
        req = self._unregister_req(payload, kwargs)
        return (yield from self._exchange(req)) or {}

    def query_plan(
        self,
        model: str,
        token_ids: Any,
        block_size: int,
        tenant_id: str = TENANT_ID,
        *,
        packed: bool | None = None,
        lora_name: str | None = None,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
        freshness: bool = False,
        cache_salt: str | None = None,
        mm_inputs: Sequence[Any] | None = None,
    ) -> Plan[dict]:
        """``POST /query``; returns ``{tenant_id: {instance: {...}}}``. Raises ConductorError.

        ``lora_name`` asks for the blocks of that LoRA adapter (engines publish them with
        ``lora_name``); ``None`` or ``""`` asks for the base model's. ``top_k`` and
        ``instances`` (extension, docs/api.md "top_k and instances"): at most ``top_k``
        (instance, DP) rows, the deepest, ties at the cut taken in the order of
        ``instances`` (else a rotation the request seeds), only the named instances; the
        answer is then a :class:`~kvconductor.coordinator.exchange.QueryAnswer` whose
        ``top_k_omitted`` counts the tied rows left out. A server without the extension
        ignores them (the whole V3 answer, a plain dict). ``freshness`` (extension,
        docs/api.md "freshness"): each answered DP also says the state and the age of
        the last event of its sources, and the answer has a ``"freshness"`` summary
        beside the tenant (a server without the extension answers without them).
        ``cache_salt`` and ``mm_inputs`` (extension, docs/api.md "Extra keys"): the
        request's salt and its multimodal inputs (``{"identifier", "offset", "length"}``
        mappings or triples, as vLLM's ``MultiModalFeatureSpec`` places them), which make
        its blocks other blocks than the same tokens without them, as in vLLM; only sent
        when set.
        """
        req = self._query_req(
            model,
            token_ids,
            block_size,
            tenant_id,
            packed,
            lora_name,
            top_k,
            instances,
            freshness,
            extra_keys=_extra_keys(cache_salt, mm_inputs),
        )
        data = yield from self._map_exchange(req)
        self._log_query(tenant_id, data)
        return data

    def query_or_empty_plan(
        self, model: str, token_ids: Any, block_size: int, tenant_id: str = TENANT_ID, **kw: Any
    ) -> Plan[dict]:
        """Like ``query`` but returns ``{}`` on any ConductorError (reference behaviour)."""
        try:
            return (yield from self.query_plan(model, token_ids, block_size, tenant_id, **kw))
        except ConductorError as exc:
            logger.warning("%s", exc)
            return {}

    def query_by_hash_plan(
        self,
        model: str,
        block_hashes: Any,
        tenant_id: str = TENANT_ID,
        *,
        block_size: int = 1,
        top_k: int | None = None,
        instances: Sequence[str] | None = None,
        freshness: bool = False,
    ) -> Plan[dict]:
        """``POST /query_by_hash``: counts are in blocks (the server ignores ``block_size``);
        ``top_k``, ``instances`` and ``freshness`` as in :meth:`query_plan`."""
        return (
            yield from self._map_exchange(
                self._query_by_hash_req(
                    model, block_hashes, tenant_id, block_size, top_k, instances, freshness
                )
            )
        )

    def predict_plan(
        self,
        model: str,
        instance_id: str,
        dp_rank: int = 0,
        *,
        token_ids: Any = None,
        block_hashes: Any = None,
        block_size: int = 1,
        tenant_id: str = TENANT_ID,
        lora_name: str | None = None,
        packed: bool | None = None,
    ) -> Plan[dict]:
        """``POST /predict`` (``token_ids``, hashed by the server with ``block_size`` and
        ``lora_name`` as ``/query`` hashes them) or ``POST /predict_by_hash``
        (``block_hashes``): the router sent this prompt to (``instance_id``, ``dp_rank``);
        the server answers as if that DP held its full blocks in HBM for its
        ``--prediction-ttl-s`` (docs/api.md, "POST /predict"). Returns
        ``{"status": "ok", "predicted_blocks": N, "ttl_s": T}``; raises ConductorError."""
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("predict needs token_ids or block_hashes (one of them)")
        target = (instance_id, dp_rank)
        if token_ids is not None:
            req = self._query_req(
                model, token_ids, block_size, tenant_id, packed, lora_name, predict=target
            )
        else:
            req = self._query_by_hash_req(
                model, block_hashes, tenant_id, block_size, predict=target
            )
        return (yield from self._map_exchange(req))

    def workers_plan(self) -> Plan[dict]:
        """``GET /workers`` (debug view of registrations and indexes)."""
        return (yield from self._map_exchange(self._get_req("/workers")))

    def post_events_plan(self, batch: Mapping[str, Any]) -> Plan[dict]:
        """``POST /events`` (JSON ``KvEventBatch``, docs/api.md, POST /events)."""
        return (
            yield from self._exchange(self._json_req("/events", batch, self.register_timeout))
        ) or {}

    def registered_services_plan(self) -> Plan[list]:
        """Entries of ``GET /workers``, else of a Mooncake master's ``GET /services``,
        else ``[]``."""
        try:
            workers = (yield from self.workers_plan()).get("workers")
            if isinstance(workers, list) and workers:
                return workers
        except ConductorError as exc:
            logger.info("GET /workers failed (%s); trying /services", exc)
        try:
            services = yield from self._exchange(self._get_req("/services"))
            if isinstance(services, dict) and isinstance(services.get("services"), list):
                return services["services"]
        except ConductorError as exc:
            logger.info("GET /services failed: %s", exc)
        return []

    def reregister_missing_plan(self, local: Iterable[Mapping[str, Any]]) -> Plan[ReregisterResult]:
        """Register every payload in ``local`` whose ``(instance_id, dp_rank)`` the conductor lacks.

        Failures are collected, not raised.
        """
        from kvconductor.coordinator.registration import missing_registrations

        local = [p for p in local if p]
        missing = missing_registrations((yield from self.registered_services_plan()), local)
        missing_ids = {id(p) for p in missing}
        result = ReregisterResult([p for p in local if id(p) not in missing_ids], [], [])
        for payload in missing:
            logger.info(
                "re-registering %s dp_rank=%s", payload.get("instance_id"), payload.get("dp_rank")
            )
            try:
                yield from self.register_plan(payload)
                result.registered.append(payload)
            except ConductorError as exc:
                logger.error(
                    "re-registration of %s dp_rank=%s failed: %s",
                    payload.get("instance_id"),
                    payload.get("dp_rank"),
                    exc,
                )
                result.failed.append((payload, exc))
        return result
