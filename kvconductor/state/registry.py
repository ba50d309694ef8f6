"""Registered instances, their endpoints and the HBM-IP index (docs/api.md, POST /register).

The registry is plain data mutated by the ingest thread only (through
:class:`kvconductor.state.conductor.Conductor`). :meth:`Registry.register` and
:meth:`Registry.unregister` change the registry and return an outcome that
tells the conductor which side effects to run (subscriptions, index clean-up,
replay); they touch no index and no socket themselves, so they are testable
on their own.

Deviations from the reference (docs/api.md, "Differences from the reference"):

* the HBM-IP index never holds a duplicate ``(instance, dp)`` under one IP,
  and a re-registration first removes the DP's old IPs (a changed IP leaves no
  stale mapping).
* each DP remembers the ``(model, tenant, block_size, backend)`` it was
  registered with; clean-up always targets the index the DP was registered in.
  Re-registration updates the instance's model/tenant/block_size; when the
  backend, model, tenant or block size of a DP changes, its data in the old
  index is dropped (it is stale: the engine re-announces under the new
  identity).
* every backend's HBM registrations enter the HBM-IP index (the reference's
  V3 indexed Mooncake/Memcache only; its newest version all of them), an engine's
  legacy ``endpoint`` (which carries NPU) included.
* an empty endpoint URL (in ``endpoint`` or any ``medium_endpoints``
  value) never becomes a subscription. The real Coordinator's re-registration
  path sends every medium key, unset ones as ``""``; those URLs are dropped
  with one WARN line naming them and the rest are subscribed. A registration
  left with no URL at all is HTTP-only, exactly as when ``medium_endpoints``
  is absent (the reference answered 500 for ``endpoint: ""``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconductor.ingest.context import SubscriberContext
from kvconductor.keys import (
    Medium,
    StoreBackend,
    is_hbm_key,
    is_node_pool_registration,
    parse_medium,
)
from kvconductor.schema import (
    DEFAULT_TENANT,
    STORE_ONLY_CAPACITY,
    STORE_ONLY_TTL_SECS,
    RegisterRequest,
    StoreOnly,
)
from kvconductor.state.protocols import JSONObject
from kvconductor.urls import UrlError, UrlPolicy, check_http_url, check_url

_ALL_MEDIA = (Medium.NPU, Medium.CPU, Medium.DISK)

log = logging.getLogger("kvconductor")


class RegistrationError(ValueError):
    """A registration request that cannot be honoured (HTTP 400)."""


def extract_ip(url: str) -> str | None:
    """The host part of a ``tcp://host:port`` URL (docs/api.md, "HBM-IP index").

    ``tcp://10.0.0.1:5557`` -> ``10.0.0.1``; ``tcp://[::1]:5557`` -> ``::1``;
    ``tcp://kv-conductor:13333`` -> ``kv-conductor`` (hostnames are kept);
    anything without ``tcp://``, a host or a closing bracket -> ``None``.
    """
    if not url.startswith("tcp://"):
        return None
    rest = url[len("tcp://") :]
    if rest.startswith("["):
        end = rest.find("]")
        if end <= 1:
            return None
        return rest[1:end]
    host, sep, _ = rest.rpartition(":")
    if not sep or not host:
        return None
    return host


#: Hosts of bind-mode URLs: they name no node.
_UNSPECIFIED_HOSTS = frozenset(("*", "0.0.0.0", "::"))


def node_of_url(url: str) -> str | None:
    """The node a node pool's URL is on (:func:`extract_ip`), ``None`` for a URL naming
    no host (``ipc://``) or a bind-mode one (``tcp://*:5558``)."""
    host = extract_ip(url)
    return None if host is None or host in _UNSPECIFIED_HOSTS else host


def medium_key(medium: Medium) -> str:
    """The normalised ``medium_endpoints`` key shown by ``/workers`` (``npu``, ``cpu``...)."""
    return medium.display.lower()


def _blank(url: str | None) -> bool:
    return url is None or not url.strip()


def drop_empty_urls(
    medium_endpoints: dict[str, str] | None, endpoint: str | None
) -> tuple[dict[str, str], str | None, list[str]]:
    """``(medium_endpoints, endpoint, dropped)`` without empty or blank URLs.

    ``dropped`` names what was removed (``medium_endpoints['cpu']``,
    ``endpoint``) for the WARN line.
    """
    kept: dict[str, str] = {}
    dropped: list[str] = []
    for key, url in (medium_endpoints or {}).items():
        if _blank(url):
            dropped.append(f"medium_endpoints[{key!r}]")
        else:
            kept[key] = url
    if endpoint is not None and _blank(endpoint):
        dropped.append("endpoint")
        endpoint = None
    return kept, endpoint, dropped


def resolve_endpoints(
    medium_endpoints: dict[str, str] | None, endpoint: str | None
) -> dict[str, tuple[Medium, ...]]:
    """Group the registration's endpoints by URL (docs/api.md, "Endpoint resolution").

    Returns ``{url: media}`` in first-seen order (media de-duplicated), ``{}``
    for an HTTP-only registration. A legacy ``endpoint`` maps to
    ``[NPU, CPU, DISK]``. Empty URLs must have been dropped
    (:func:`drop_empty_urls`).
    """
    groups: dict[str, list[Medium]] = {}
    if medium_endpoints:
        for key, url in medium_endpoints.items():
            media = groups.setdefault(url, [])
            m = parse_medium(key)
            if m not in media:
                media.append(m)
        return {url: tuple(media) for url, media in groups.items()}
    if endpoint:
        return {endpoint: _ALL_MEDIA}
    return {}


def normalize_medium_endpoints(
    medium_endpoints: dict[str, str] | None, endpoint: str | None
) -> dict[str, str]:
    """Medium keys lower-cased display names; a legacy endpoint fills all three."""
    if medium_endpoints:
        return {medium_key(parse_medium(k)): url for k, url in medium_endpoints.items()}
    if endpoint:
        return {medium_key(m): endpoint for m in _ALL_MEDIA}
    return {}


def store_only_bound(v: bool | StoreOnly | None) -> tuple[float, int] | None:
    """``store_only`` of a registration -> ``(ttl_secs, capacity)``, or None."""
    if v is None or v is False:
        return None
    if v is True:
        return (STORE_ONLY_TTL_SECS, STORE_ONLY_CAPACITY)
    return (float(v.ttl_secs), int(v.capacity))


@dataclass
class EndpointInfo:
    """One registered DP of an instance, with the identity its data lives under."""

    dp_rank: int
    engine_type: str
    medium_endpoints: dict[str, str]
    replay_endpoint: str | None
    model_name: str
    tenant_id: str
    block_size: int
    store_backend: str
    is_pool: bool = False
    node_id: str | None = None
    #: ``((url, media), ...)``: the subscriptions this registration asked for.
    sources: tuple = ()
    #: A node pool (``is_pool`` too): the CPU/Disk publisher of the node ``node_ip``.
    node_pool: bool = False
    node_ip: str | None = None
    #: ``(ttl_secs, capacity)`` of a store-only engine publisher (``store_only``).
    store_only: tuple[float, int] | None = None
    #: A cluster pool shared by every DP of its (model, tenant) and block size.
    shared_store: bool = False
    #: The LoRA adapter of the registration (``lora_name``; None: any).
    lora_name: str | None = None
    #: The engine's HTTP base URL its publishers were read from, and how the last read
    #: went (:mod:`kvconductor.state.enginefollow`; not part of the registration).
    engine_url: str | None = None
    engine_url_state: str = field(default="ok", compare=False)
    engine_url_error: str | None = field(default=None, compare=False)

    @property
    def backend(self) -> StoreBackend:
        return StoreBackend.parse(self.store_backend)

    @property
    def index_key(self) -> tuple[str, str]:
        return (self.model_name, self.tenant_id)

    def context(self, instance_id: str, url: str, media: tuple[Medium, ...]) -> SubscriberContext:
        """The context of the subscription to ``url`` (publishing ``media``) that this
        registration of ``instance_id`` asks for: its facts, as the subscriber reads them."""
        return SubscriberContext(
            instance_id=instance_id,
            dp_rank=self.dp_rank,
            url=url,
            model=self.model_name,
            tenant=self.tenant_id,
            block_size=self.block_size,
            default_media=media,
            store_backend=self.backend,
            is_pool=self.is_pool,
            replay_endpoint=self.replay_endpoint,
            engine_type=self.engine_type,
            node_pool=self.node_pool,
            node_ip=self.node_ip,
            store_only=self.store_only,
            shared_store=self.shared_store,
            lora_name=self.lora_name,
            extra={"node_id": self.node_id} if self.node_id else {},
        )

    def to_dict(self, serves: list[tuple[str, int]] | None = None) -> JSONObject:
        """The ``/workers`` shape of one endpoint (docs/api.md, GET /workers); a pool's
        has ``pool``: ``{"kind": "cluster"}``, or for a node pool ``{"kind": "node",
        "node_ip", "serves"}`` with ``serves`` the DPs its blocks go to now."""
        d: JSONObject = {
            "medium_endpoints": dict(self.medium_endpoints),
            "engine_type": self.engine_type,
            "dp_rank": self.dp_rank,
            "replay_endpoint": self.replay_endpoint,
        }
        if self.engine_url is not None:
            d["engine_url"] = self.engine_url
            d["engine_url_state"] = self.engine_url_state
            d["engine_url_error"] = self.engine_url_error
        if self.store_only is not None:
            d["store_only"] = {"ttl_secs": self.store_only[0], "capacity": self.store_only[1]}
        if self.node_pool:
            d["pool"] = {
                "kind": "node",
                "node_ip": self.node_ip,
                "serves": [{"instance_id": i, "dp_rank": r} for i, r in serves or ()],
            }
        elif self.shared_store:
            d["pool"] = {"kind": "shared"}
        elif self.is_pool:
            d["pool"] = {"kind": "cluster"}
        return d


@dataclass
class WorkerEntry:
    """A registered instance: its latest model/tenant/block size/backend and its DPs."""

    instance_id: str
    model_name: str
    tenant_id: str
    block_size: int
    store_backend: str
    endpoints: dict[int, EndpointInfo] = field(default_factory=dict)

    def to_dict(
        self, serves: Callable[[EndpointInfo], list[tuple[str, int]]] | None = None
    ) -> JSONObject:
        """The ``/workers`` shape of one instance (``store_backend`` is not exposed);
        ``serves(ep)``: the DPs a node pool endpoint serves (:meth:`Registry.node_pool_dps`)."""
        return {
            "instance_id": self.instance_id,
            "model_name": self.model_name,
            "tenant_id": self.tenant_id,
            "block_size": self.block_size,
            "endpoints": {
                str(dp): ep.to_dict(serves(ep) if serves is not None and ep.node_pool else None)
                for dp, ep in sorted(self.endpoints.items())
            },
        }

    def info(self) -> dict[str, object]:
        """Registration facts for subscribers (``Conductor.instance_info``; ``endpoints``
        by DP rank)."""
        return {
            "instance_id": self.instance_id,
            "model_name": self.model_name,
            "tenant_id": self.tenant_id,
            "block_size": self.block_size,
            "store_backend": self.store_backend,
            "endpoints": {
                dp: ep.to_dict()
                | {
                    "model_name": ep.model_name,
                    "tenant_id": ep.tenant_id,
                    "block_size": ep.block_size,
                    "store_backend": ep.store_backend,
                    "is_pool": ep.is_pool,
                    "node_pool": ep.node_pool,
                    "node_ip": ep.node_ip,
                    "node_id": ep.node_id,
                    "lora_name": ep.lora_name,
                }
                for dp, ep in self.endpoints.items()
            },
        }


@dataclass
class RegisterOutcome:
    """What :meth:`Registry.register` changed and what the conductor must do next."""

    instance_id: str
    dp_rank: int
    model_name: str
    tenant_id: str
    #: The (instance, DP) existed before: stop its old subscriptions first.
    reregistered: bool
    #: An identical re-registration of a live DP: keep its subscriptions, replay nothing.
    unchanged: bool
    #: Drop the DP's data from this (model, tenant) index (backend/identity change).
    drop_from: tuple[str, str] | None
    #: One subscription per distinct URL.
    contexts: list[SubscriberContext]
    #: Replay to request: a new or changed (instance, DP) registration with a replay endpoint.
    replay: SubscriberContext | None
    ips_added: list[str]
    ips_removed: list[str]
    is_pool: bool


@dataclass
class UnregisterOutcome:
    """What :meth:`Registry.unregister` changed."""

    found: bool
    #: The index holding the DP's data (registered identity, else the instance's).
    index_key: tuple[str, str] | None = None
    instance_removed: bool = False
    ips_removed: list[str] = field(default_factory=list)


class Registry:
    """Instances, endpoints and the HBM-IP index (ingest thread only)."""

    def __init__(self, url_policy: UrlPolicy | None = None) -> None:
        #: Which endpoint URLs registrations may name (see :mod:`kvconductor.urls`).
        self.url_policy = url_policy or UrlPolicy()
        self.instances: dict[str, WorkerEntry] = {}
        #: IP -> [(instance_id, dp_rank)], no duplicates (the reference could hold some).
        self.hbm_ip_index: dict[str, list[tuple[str, int]]] = {}
        #: (instance_id, dp_rank) -> the IPs it is under in :attr:`hbm_ip_index` (the
        #: pair is in an IP's list exactly when the IP is in its own list here).
        self._ips_of: dict[tuple[str, int], list[str]] = {}
        #: Registered DPs, and per (model, tenant) how many of them have each block size:
        #: kept as endpoints come and go, so that no registration recounts them all.
        self._dp_count = 0
        self._sizes: dict[tuple[str, str], dict[int, int]] = {}

    # -- lookups ------------------------------------------------------------------------
    def get(self, instance_id: str) -> WorkerEntry | None:
        return self.instances.get(instance_id)

    def hbm_ip_lookup(self, ip: str) -> list[tuple[str, int]]:
        """(instance_id, dp_rank) pairs registered with HBM endpoints on ``ip``."""
        return list(self.hbm_ip_index.get(ip, ()))

    def protected(self) -> set[tuple[str, str]]:
        """Every (model, tenant) a registration refers to (never reclaimed; docs/api.md,
        POST /unregister)."""
        keys = set()
        for entry in self.instances.values():
            keys.add((entry.model_name, entry.tenant_id))
            for ep in entry.endpoints.values():
                keys.add(ep.index_key)
        return keys

    def index_key_of(self, instance_id: str, dp_rank: int) -> tuple[str, str] | None:
        """The (model, tenant) of a DP's data: registered DP first, else the instance's."""
        entry = self.instances.get(instance_id)
        if entry is None:
            return None
        ep = entry.endpoints.get(dp_rank)
        return ep.index_key if ep is not None else (entry.model_name, entry.tenant_id)

    def context_dps(
        self, model: str, tenant: str, block_size: int, lora_name: str | None = None
    ) -> list[tuple[str, int]]:
        """The engine (instance, DP)s (not pools) registered in (model, tenant) with
        ``block_size`` and of adapter ``lora_name`` (None: the base model) or registered
        without one: a shared store's DPs (O(registered DPs))."""
        out = []
        for iid, entry in self.instances.items():
            for dp, ep in entry.endpoints.items():
                if (
                    not ep.is_pool
                    and ep.block_size == block_size
                    and ep.index_key == (model, tenant)
                    and ep.lora_name in (None, lora_name or "")
                ):
                    out.append((iid, dp))
        return out

    def node_pool_dps(self, ep: EndpointInfo) -> list[tuple[str, int]]:
        """The (instance, DP) pairs a node pool's blocks go to now: those registered with an
        HBM URL on its node in its (model, tenant), in registration order."""
        if ep.node_ip is None:
            return []
        out = []
        for iid, dp in self.hbm_ip_index.get(ep.node_ip, ()):
            if self.index_key_of(iid, dp) == ep.index_key:
                out.append((iid, dp))
        return out

    @property
    def registrations(self) -> int:
        """Registered (instance, DP) pairs."""
        return self._dp_count

    def block_sizes(self) -> dict[tuple[str, str], frozenset[int]]:
        """Per (model, tenant), the block sizes its registered DPs have. O(indexes)."""
        return {k: frozenset(v) for k, v in self._sizes.items()}

    def _set_endpoint(self, entry: WorkerEntry, ep: EndpointInfo) -> None:
        """``entry.endpoints[ep.dp_rank] = ep``, with the counts."""
        old = entry.endpoints.get(ep.dp_rank)
        if old is not None:
            self._count_out(old)
        entry.endpoints[ep.dp_rank] = ep
        self._dp_count += 1
        sizes = self._sizes.setdefault(ep.index_key, {})
        sizes[ep.block_size] = sizes.get(ep.block_size, 0) + 1

    def _pop_endpoint(self, entry: WorkerEntry, dp_rank: int) -> None:
        """``entry.endpoints.pop(dp_rank, None)``, with the counts."""
        ep = entry.endpoints.pop(dp_rank, None)
        if ep is not None:
            self._count_out(ep)

    def _count_out(self, ep: EndpointInfo) -> None:
        self._dp_count -= 1
        sizes = self._sizes[ep.index_key]
        n = sizes[ep.block_size] - 1
        if n:
            sizes[ep.block_size] = n
        else:
            del sizes[ep.block_size]
            if not sizes:
                del self._sizes[ep.index_key]

    def snapshot(self) -> list[JSONObject]:
        """``/workers.workers``: instances sorted by id."""
        return [self.instances[k].to_dict(self.node_pool_dps) for k in sorted(self.instances)]

    # -- HBM-IP index -------------------------------------------------------------------------
    def _add_ip(self, ip: str, instance_id: str, dp_rank: int) -> bool:
        pair = (instance_id, dp_rank)
        ips = self._ips_of.setdefault(pair, [])
        if ip in ips:  # the pair is in the IP's list already (O(its IPs), not O(the IP's))
            return False
        self.hbm_ip_index.setdefault(ip, []).append(pair)
        ips.append(ip)
        return True

    def remove_hbm_ips(self, instance_id: str, dp_rank: int) -> list[str]:
        """Drop every HBM-IP entry of (instance, DP); returns the IPs it was under."""
        pair = (instance_id, dp_rank)
        ips = self._ips_of.pop(pair, [])
        for ip in ips:
            pairs = self.hbm_ip_index.get(ip)
            if pairs is None:
                continue
            try:
                pairs.remove(pair)
            except ValueError:
                pass
            if not pairs:
                del self.hbm_ip_index[ip]
        return ips

    # -- register / unregister --------------------------------------------------------
    def register(self, req: RegisterRequest) -> RegisterOutcome:
        """Apply a registration (docs/api.md, POST /register; deviations: module docstring).

        Raises :class:`RegistrationError` before changing anything.
        """
        if not req.instance_id:
            raise RegistrationError("instance_id must not be empty")
        medium_endpoints, endpoint, dropped = drop_empty_urls(req.medium_endpoints, req.endpoint)
        if dropped:
            log.warning(
                "registration instance_id=%s dp_rank=%d: empty endpoint URLs ignored: %s%s",
                req.instance_id,
                req.dp_rank,
                ", ".join(dropped),
                "" if medium_endpoints or endpoint else " (HTTP-only registration)",
            )
        try:
            for key, url in medium_endpoints.items():
                check_url(url, f"medium_endpoints[{key!r}]", self.url_policy)
            if endpoint and not medium_endpoints:
                check_url(endpoint, "endpoint", self.url_policy)
            if req.replay_endpoint:
                check_url(req.replay_endpoint, "replay_endpoint", self.url_policy, replay=True)
            if req.engine_url:
                check_http_url(req.engine_url, "engine_url", self.url_policy)
        except UrlError as ex:
            raise RegistrationError(str(ex)) from None
        groups = resolve_endpoints(medium_endpoints, endpoint)
        backend_name = req.store_backend or "Mooncake"
        backend = StoreBackend.parse(backend_name)
        tenant = req.tenant_id or DEFAULT_TENANT
        is_pool = backend.is_pool_backend and not medium_endpoints and bool(endpoint)
        # A node pool is judged on the keys as sent (an empty HBM URL still makes a DP).
        node_pool = bool(medium_endpoints) and is_node_pool_registration(
            backend, (req.medium_endpoints or {}).keys()
        )
        node_ip = node_of_url(next(iter(medium_endpoints.values()))) if node_pool else None
        if node_pool and node_ip is None:
            log.warning(
                "node pool instance_id=%s: its URL names no node (ipc:// or bind mode); only "
                "events whose backend_id names the node can be credited",
                req.instance_id,
            )
        is_pool = is_pool or node_pool
        replay_endpoint = req.replay_endpoint or None
        store_only = store_only_bound(req.store_only)
        if store_only is not None and is_pool:
            raise RegistrationError(
                "store_only applies to an engine's publisher, not to a pool registration"
            )
        shared_store = bool(req.shared_store)
        if shared_store and (not is_pool or node_pool):
            raise RegistrationError(
                "shared_store applies to a cluster pool: store_backend Mooncake or Memcache "
                "with its publisher in endpoint and no medium_endpoints"
            )

        entry = self.instances.get(req.instance_id)
        old = entry.endpoints.get(req.dp_rank) if entry is not None else None

        drop_from = None
        ips_removed: list[str] = []
        if old is not None:
            ips_removed = self.remove_hbm_ips(req.instance_id, req.dp_rank)
            changed = (
                old.store_backend.lower() != backend_name.lower()
                or old.index_key != (req.modelname, tenant)
                or old.block_size != req.block_size
            )
            if changed:
                drop_from = old.index_key

        ips_added: list[str] = []
        if backend.indexes_hbm_ip and not is_pool:
            # a legacy endpoint of an engine (not a pool) carries its HBM events too
            for key, url in normalize_medium_endpoints(medium_endpoints, endpoint).items():
                if not is_hbm_key(key):
                    continue
                ip = extract_ip(url)
                if ip is not None and self._add_ip(ip, req.instance_id, req.dp_rank):
                    ips_added.append(ip)

        info = EndpointInfo(
            dp_rank=req.dp_rank,
            engine_type=req.engine_type,
            medium_endpoints=normalize_medium_endpoints(medium_endpoints, endpoint),
            replay_endpoint=replay_endpoint,
            model_name=req.modelname,
            tenant_id=tenant,
            block_size=req.block_size,
            store_backend=backend_name,
            is_pool=is_pool,
            node_id=req.node_id,
            sources=tuple(groups.items()),
            node_pool=node_pool,
            node_ip=node_ip,
            store_only=store_only,
            shared_store=shared_store,
            lora_name=req.lora_name,
            engine_url=req.engine_url or None,
        )
        contexts = [info.context(req.instance_id, url, media) for url, media in groups.items()]
        unchanged = old is not None and old == info

        # Replay runs per (instance, DP): the reference replayed only the first DP of an
        # instance. It pairs with a live subscription: the one carrying NPU (the engine's
        # own publisher), else the first. HTTP-only: nothing to replay into. An identical
        # re-registration keeps its subscription (and its sequence tracking): no replay.
        replay = None
        if replay_endpoint and contexts and not unchanged:
            replay = next((c for c in contexts if Medium.NPU in c.default_media), contexts[0])

        if entry is None:
            entry = self.instances[req.instance_id] = WorkerEntry(
                instance_id=req.instance_id,
                model_name=req.modelname,
                tenant_id=tenant,
                block_size=req.block_size,
                store_backend=backend_name,
            )
        else:
            entry.model_name = req.modelname
            entry.tenant_id = tenant
            entry.block_size = req.block_size
            entry.store_backend = backend_name
        self._set_endpoint(entry, info)

        return RegisterOutcome(
            instance_id=req.instance_id,
            dp_rank=req.dp_rank,
            model_name=req.modelname,
            tenant_id=tenant,
            reregistered=old is not None,
            unchanged=unchanged,
            drop_from=drop_from,
            contexts=contexts,
            replay=replay,
            ips_added=ips_added,
            ips_removed=ips_removed,
            is_pool=is_pool,
        )

    def save_dp(self, instance_id: str, dp_rank: int) -> tuple:
        """What :meth:`restore_dp` needs to undo a registration of (instance, DP)."""
        entry = self.instances.get(instance_id)
        if entry is None:
            return (instance_id, dp_rank, None, None, [])
        fields = (entry.model_name, entry.tenant_id, entry.block_size, entry.store_backend)
        return (
            instance_id,
            dp_rank,
            fields,
            entry.endpoints.get(dp_rank),
            list(self._ips_of.get((instance_id, dp_rank), ())),
        )

    def restore_dp(self, saved: tuple) -> None:
        """Undo the registration made after :meth:`save_dp` returned ``saved``."""
        instance_id, dp_rank, fields, old, ips = saved
        self.remove_hbm_ips(instance_id, dp_rank)
        if fields is None:
            gone = self.instances.pop(instance_id, None)
            if gone is not None:
                for dp in list(gone.endpoints):
                    self._pop_endpoint(gone, dp)
            return
        entry = self.instances[instance_id]
        entry.model_name, entry.tenant_id, entry.block_size, entry.store_backend = fields
        if old is None:
            self._pop_endpoint(entry, dp_rank)
        else:
            self._set_endpoint(entry, old)
        for ip in ips:
            self._add_ip(ip, instance_id, dp_rank)

    def unregister(self, instance_id: str, dp_rank: int) -> UnregisterOutcome:
        """Remove one DP of an instance; the instance goes with its last DP.

        See docs/api.md, POST /unregister.
        """
        entry = self.instances.get(instance_id)
        if entry is None:
            return UnregisterOutcome(found=False)
        ips = self.remove_hbm_ips(instance_id, dp_rank)
        index_key = self.index_key_of(instance_id, dp_rank)
        self._pop_endpoint(entry, dp_rank)
        removed = not entry.endpoints
        if removed:
            del self.instances[instance_id]
        return UnregisterOutcome(
            found=True, index_key=index_key, instance_removed=removed, ips_removed=ips
        )
