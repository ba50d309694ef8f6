"""Coordinator configuration and the registration payloads it sends (docs/client.md,
"Registration helpers"; docs/engines.md, "Coordinator configuration").

Plain values in, plain dicts out: no HTTP here and no Coordinator types.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from kvconductor.schema import DEFAULT_PORT
from kvconductor.schema import DEFAULT_TENANT as TENANT_ID

__all__ = [
    "KvConductorConfig",
    "format_host",
    "conductor_base_url",
    "resolve_endpoint",
    "instance_name",
    "strip_decode_instances",
    "canonical_store_backend",
    "resolve_store_backend",
    "backend_mode",
    "build_medium_endpoints",
    "build_pool_registration",
    "node_pool_instance_id",
    "build_node_pool_registration",
    "build_dp_registration",
    "build_unregister_payload",
    "normalize_service_key",
    "registered_keys",
    "missing_registrations",
]

# The logger keeps the name of the module this code lived in (kvconductor.client).
logger = logging.getLogger("kvconductor.client")


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
    def coerce(cls, config: Mapping[str, Any] | KvConductorConfig | Any) -> KvConductorConfig:
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
    """Resolve an engine bind pattern for one DP: ``tcp://*:5557`` ->
    ``tcp://<host>:<5557 + dp_rank>``.

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
    "P": "vllm-prefill",
    "PREFILL": "vllm-prefill",
    "E": "vllm-prefill",
    "ENCODE": "vllm-prefill",
    "U": "vllm-union",
    "UNION": "vllm-union",
    "D": "vllm-decode",
    "DECODE": "vllm-decode",
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


def _with_tenant(payload: dict, tenant_id: str) -> dict:
    """``payload`` with ``tenant_id`` added unless it is the default tenant (sent only when set)."""
    if tenant_id != TENANT_ID:
        payload["tenant_id"] = tenant_id
    return payload


def _registration(
    cfg: KvConductorConfig,
    backend: str,
    instance_id: str,
    model_name: str,
    dp_rank: int,
    tenant_id: str,
    **more: Any,
) -> dict:
    """A ``/register`` payload: the registration's identity, then those of ``more`` that
    are set (in their order), then ``tenant_id`` unless it is the default tenant."""
    payload = {
        "instance_id": instance_id,
        "type": cfg.engine_type,
        "store_backend": backend,
        "modelname": model_name,
        "block_size": int(cfg.block_size),
        "dp_rank": int(dp_rank),
    }
    payload.update((k, v) for k, v in more.items() if v)
    return _with_tenant(payload, tenant_id)


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
            logger.warning(
                "pool_endpoint %r needs KVS_MASTER_SERVICE, which is unset; pool not registered",
                endpoint,
            )
            return None
        endpoint = endpoint.replace("*", format_host(master))
    return _registration(
        cfg,
        backend,
        f"{backend.lower()}-pool",
        cfg.model_path or "default",
        0,
        tenant_id,
        endpoint=endpoint,
    )


def node_pool_instance_id(store_backend: str, host: str, model_name: str) -> str:
    """The instance id of a node pool: ``<backend lower>-pool-<host>-<model>``
    (``yuanrong-pool-10.0.0.1-qwen``). The model is part of it: a registration is one
    ``(instance_id, dp_rank)``, so two models on one node need two ids."""
    return f"{resolve_store_backend(store_backend).lower()}-pool-{host}-{model_name}"


def build_node_pool_registration(
    config: Mapping[str, Any] | KvConductorConfig,
    model_name: str,
    host: str,
    *,
    tenant_id: str = TENANT_ID,
) -> dict | None:
    """The once-per-(node, model) CPU/Disk registration of per-DP backends (YuanRong), as
    the newest Coordinator sends it beside HBM-only DP registrations
    (``build_dp_registration(..., node_pool=True)``), or ``None``.

    ``medium_endpoints`` = the non-empty of ``cpu`` and ``disk`` resolved for DP rank 0
    (one publisher per node, no port offset), each falling back to the ``endpoint``
    pattern; ``dp_rank`` 0, no ``replay_endpoint``. ``None`` for Mooncake/Memcache (their
    pool is the cluster's, :func:`build_pool_registration`) or when neither resolves.
    The server credits the pool's blocks to every DP of ``model_name`` registered with an
    HBM URL on ``host`` (docs/api.md, "Node pools").
    """
    cfg = KvConductorConfig.coerce(config)
    backend = resolve_store_backend(cfg.store_backend)
    if backend_mode(backend) != "per_dp":
        return None
    fallback = resolve_endpoint(cfg.endpoint, host, 0)
    media = {
        "cpu": resolve_endpoint(cfg.cpu_endpoint, host, 0) or fallback,
        "disk": resolve_endpoint(cfg.disk_endpoint, host, 0) or fallback,
    }
    media = {k: v for k, v in media.items() if v}
    if not media:
        return None
    instance_id = node_pool_instance_id(backend, host, model_name)
    return _registration(
        cfg, backend, instance_id, model_name, 0, tenant_id, medium_endpoints=media
    )


def build_dp_registration(
    config: Mapping[str, Any] | KvConductorConfig,
    instance_id: str,
    model_name: str,
    dp_rank: int,
    host: str,
    *,
    tenant_id: str = TENANT_ID,
    node_pool: bool = False,
) -> dict:
    """The ``/register`` payload of one engine DP (docs/client.md, "Registration helpers").

    Without any endpoint pattern the payload has no ``medium_endpoints``: an
    "HTTP-only" registration fed by ``/events``. ``replay_endpoint`` is added
    when its pattern resolves. ``node_pool``: the node's CPU/Disk are registered once
    per node (:func:`build_node_pool_registration`), so the DP's ``medium_endpoints``
    keep only ``npu``, as the newest Coordinator sends them.
    """
    cfg = KvConductorConfig.coerce(config)
    backend = resolve_store_backend(cfg.store_backend)
    mode = backend_mode(backend)
    media = build_medium_endpoints(cfg, host, dp_rank, mode)
    if node_pool:
        media = {k: v for k, v in media.items() if k == "npu"}
    return _registration(
        cfg,
        backend,
        instance_id,
        model_name,
        dp_rank,
        tenant_id,
        medium_endpoints=media,
        replay_endpoint=resolve_endpoint(cfg.replay_endpoint, host, dp_rank),
    )


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
    return _with_tenant(payload, tenant_id)


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
