"""Registration and unregistration of one DP of an instance (docs/api.md, POST
/register and POST /unregister), on the conductor's ingest thread.

The registry validates and records; this module opens or closes the DP's ZeroMQ
subscriptions (first, and everything is put back when they cannot be opened: 503), drops
the data a changed registration no longer holds, and tells the conductor its
registrations changed (:class:`RegistrationHost`: what a registration changes of it).
"""

from __future__ import annotations

import errno
import logging
from typing import Protocol

import zmq

from kvconductor.index import Index
from kvconductor.schema import DEFAULT_TENANT, RegisterRequest, UnregisterRequest
from kvconductor.state.protocols import Subscriptions
from kvconductor.state.registry import Registry

log = logging.getLogger("kvconductor")

__all__ = [
    "SKIP_REASONS",
    "RegistrationHost",
    "RegistrationUnavailable",
    "register",
    "unregister",
]


#: Why a registration of a loaded snapshot or dump was skipped
#: (:mod:`kvconductor.state.restore`): the current flags refuse its URLs
#: (``--endpoint-networks``, ``--allow-ipc-endpoints``, ``--allow-bind-endpoints``, or any
#: other validation), ``--max-sources`` is reached, or a subscription cannot be opened now
#: (a bind-mode port in use, no file descriptor).
SKIP_REASONS = ("refused", "max_sources", "unavailable")


class RegistrationUnavailable(RuntimeError):
    """A registration the server cannot take now (HTTP 503); nothing was changed.
    :attr:`reason`: ``max_sources`` (the ``--max-sources`` limit) or ``unavailable``
    (a subscription cannot be opened now: a bind-mode port in use, no file descriptor)."""

    def __init__(self, message: str, reason: str = "unavailable") -> None:
        super().__init__(message)
        self.reason = reason


class RegistrationHost(Protocol):
    """What a registration reads and changes of the conductor (ingest thread)."""

    registry: Registry
    subs: Subscriptions
    #: (model, tenant) -> Index.
    indexes: dict[tuple[str, str], Index]

    def get_or_create_index(self, model: str, tenant: str) -> Index: ...

    def registrations_changed(self) -> None: ...

    def follow(self) -> None: ...

    def reclaim(self, key: tuple[str, str]) -> bool: ...


def register(host: RegistrationHost, req: RegisterRequest, max_sources: int) -> None:
    """Register (or re-register) one DP of an instance (docs/api.md, POST /register).

    Raises :class:`RegistrationError` (HTTP 400) before changing anything.
    """
    log.info(
        "register request instance_id=%s dp_rank=%d type=%s modelname=%s tenant_id=%s "
        "block_size=%d store_backend=%s medium_endpoints=%s endpoint=%s "
        "replay_endpoint=%s engine_url=%s",
        req.instance_id,
        req.dp_rank,
        req.engine_type,
        req.modelname,
        req.tenant_id or DEFAULT_TENANT,
        req.block_size,
        req.store_backend,
        req.medium_endpoints or {},
        req.endpoint,
        req.replay_endpoint,
        req.engine_url,
    )
    saved = host.registry.save_dp(req.instance_id, req.dp_rank)
    out = host.registry.register(req)  # validates before changing anything
    if out.unchanged:
        # The Coordinator's repair path and periodic re-register timer resend what we
        # have: keep the live subscriptions (no batch lost, no replay).
        log.info(
            "re-registration unchanged; subscriptions kept instance_id=%s dp_rank=%d",
            req.instance_id,
            req.dp_rank,
        )
        host.get_or_create_index(out.model_name, out.tenant_id)
        host.registrations_changed()
        return
    # Subscriptions first: the only step that can fail for want of resources. On a
    # failure everything is put back as it was and the request gets a 503.
    opened = _subscribe_or_roll_back(host, req, out, saved, max_sources)
    for ip in out.ips_removed:
        if ip not in out.ips_added:
            log.info(
                "HBM IP removed from index ip=%s instance_id=%s dp_rank=%d",
                ip,
                out.instance_id,
                out.dp_rank,
            )
    if out.drop_from is not None:
        old = host.indexes.get(out.drop_from)
        dropped = old.remove_dp(out.instance_id, out.dp_rank) if old is not None else 0
        log.info(
            "registration changed; dropped old data instance_id=%s dp_rank=%d "
            "model=%s tenant=%s blocks=%d",
            out.instance_id,
            out.dp_rank,
            out.drop_from[0],
            out.drop_from[1],
            dropped,
        )
    for ip in out.ips_added:
        log.info(
            "HBM IP indexed for pool auto-attach ip=%s instance_id=%s dp_rank=%d",
            ip,
            out.instance_id,
            out.dp_rank,
        )
    host.get_or_create_index(out.model_name, out.tenant_id)
    host.registrations_changed()
    host.follow()
    if out.drop_from is not None:
        host.reclaim(out.drop_from)
    if req.engine_url and out.reregistered and opened:
        # The engine's URL named new publishers: the engine restarted on new ports. Its
        # cache is new, as when a sequence goes back (the old blocks age out).
        host.subs.restarted(out.instance_id, out.dp_rank, opened, "found on new endpoints")
    if out.replay is not None and out.replay.url in opened:
        # A new subscription: catch up from the engine's replay buffer. A URL that was
        # already subscribed kept its socket and lost nothing.
        host.subs.request_replay(out.replay)
    log.info(
        "worker registered instance_id=%s dp_rank=%d model=%s tenant=%s subscribers=%d "
        "is_pool=%s replay=%s",
        out.instance_id,
        out.dp_rank,
        out.model_name,
        out.tenant_id,
        len(out.contexts),
        out.is_pool,
        out.replay is not None,
    )
    entry = host.registry.get(out.instance_id)
    ep = entry.endpoints.get(out.dp_rank) if entry is not None else None
    if ep is not None and ep.node_pool:
        log.info(
            "node pool instance_id=%s node_ip=%s model=%s tenant=%s serves %d DP(s) now",
            out.instance_id,
            ep.node_ip,
            out.model_name,
            out.tenant_id,
            len(host.registry.node_pool_dps(ep)),
        )


def _subscribe_or_roll_back(
    host: RegistrationHost, req: RegisterRequest, out, saved: tuple, max_sources: int
) -> set[str]:
    """Replace (instance, DP)'s subscriptions by ``out.contexts`` (returns the URLs
    opened), or undo everything and raise :class:`RegistrationUnavailable`."""
    iid, dp = req.instance_id, req.dp_rank
    current = host.subs.count(iid, dp)
    total = len(host.subs) - current + len(out.contexts)
    if total > max_sources:
        host.registry.restore_dp(saved)
        msg = (
            f"source limit reached: this registration needs {len(out.contexts)} "
            f"ZeroMQ subscription(s) and {len(host.subs) - current} of at most "
            f"{max_sources} are in use (--max-sources)"
        )
        log.warning("registration refused instance_id=%s dp_rank=%d: %s", iid, dp, msg)
        raise RegistrationUnavailable(msg, "max_sources")
    if out.reregistered:
        log.info("re-registering existing worker instance_id=%s dp_rank=%d", iid, dp)
    if not out.contexts and not current:
        return set()  # HTTP-only, and was: no sockets to touch
    try:
        # URLs kept keep their sockets (no batch lost); new ones open first.
        opened = host.subs.replace(iid, dp, out.contexts)
    except (zmq.ZMQError, OSError) as ex:
        host.registry.restore_dp(saved)
        msg = f"cannot open a ZeroMQ subscription now ({ex}); nothing was registered. " + (
            "Raise the process's open-file limit or lower --max-sources"
            if ex.errno in (errno.EMFILE, errno.ENFILE)
            else "Check the endpoint (a bind-mode port may be in use by another process) "
            "and register again"
        )
        log.error("registration rolled back instance_id=%s dp_rank=%d: %s", iid, dp, msg)
        raise RegistrationUnavailable(msg) from None
    return opened


def unregister(host: RegistrationHost, req: UnregisterRequest) -> bool:
    """Unregister one DP; False when the instance is unknown (404).

    See docs/api.md, POST /unregister.
    """
    log.info("unregister request instance_id=%s dp_rank=%d", req.instance_id, req.dp_rank)
    n = host.subs.unsubscribe(req.instance_id, req.dp_rank)
    out = host.registry.unregister(req.instance_id, req.dp_rank)
    if not out.found:
        log.info("unregister: instance not found instance_id=%s", req.instance_id)
        return False
    host.registrations_changed()
    host.follow()
    for ip in out.ips_removed:
        log.info(
            "HBM IP removed from index ip=%s instance_id=%s dp_rank=%d",
            ip,
            req.instance_id,
            req.dp_rank,
        )
    # Every index, not only the registered one: a pool event naming another (model,
    # tenant) credits the DP there (issue 36: it kept appearing in those answers, and
    # registered again its old and new blocks added up).
    per_index = _remove_dp_everywhere(host, req.instance_id, req.dp_rank)
    for key in {*per_index, *(() if out.index_key is None else (out.index_key,))}:
        host.reclaim(key)
    others = {k: v for k, v in per_index.items() if k != out.index_key}
    log.info(
        "worker unregistered instance_id=%s dp_rank=%d subscribers_stopped=%d blocks=%d "
        "instance_removed=%s%s",
        req.instance_id,
        req.dp_rank,
        n,
        sum(per_index.values()),
        out.instance_removed,
        "".join(f" blocks[{m}/{t}]={v}" for (m, t), v in sorted(others.items())),
    )
    return True


def _remove_dp_everywhere(
    host: RegistrationHost, instance_id: str, dp_rank: int
) -> dict[tuple[str, str], int]:
    """Drop (instance, DP)'s blocks and pending waits from every index holding a worker
    of it; the blocks removed per index (O(indexes))."""
    out: dict[tuple[str, str], int] = {}
    for key, idx in list(host.indexes.items()):
        if idx.workers_of(instance_id, dp_rank):
            out[key] = idx.remove_dp(instance_id, dp_rank)
    return out
