"""Where a pool event's blocks land (docs/events.md, "Applying", pool events).

:func:`pool_targets` answers, for one :class:`~kvconductor.ingest.ops.PoolEvent` of a
subscription, the ``(model, tenant, WorkerKey)`` targets it is applied to, or a
:class:`Miss` (the reason it is dropped) that the
:class:`~kvconductor.ingest.apply.Applier` counts:

* a shared store (``ctx.shared_store``): every DP registered in the context
  (:func:`~kvconductor.ingest.sharedstore.shared_targets`);
* IpOnly (Mooncake/Memcache pool publishers, ``ctx.is_pool``):
  ``conductor.hbm_ip_lookup(event.backend_id)`` (else the registration's ``node_ip``)
  -> the (instance, dp)s on that IP of the event's (model, tenant) (a cluster pool's:
  :func:`~kvconductor.ingest.poolroute.cluster_pool_dps`; FIX: every DP of the node was
  credited; a node pool's: the DPs of its own (model, tenant) on its node);
* otherwise the subscription's (instance, dp);

x the target media: ``[event.medium]`` or the subscription's non-HBM default media
(FIX: a pool never holds HBM blocks; the reference also put medium-less pool blocks in
the HBM tree). Index = the event's ``model_name``/``tenant_id`` if present, else (FIX,
IpOnly only) the resolved instance's registered model/tenant via
``conductor.instance_info`` (pools register with ``model_path or "default"``, so with
the reference their confirmations landed in another index), else the subscription's.
Nothing here writes: the index is the applier's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.host import IngestHost
from kvconductor.ingest.ops import PoolEvent
from kvconductor.ingest.poolroute import (
    NO_DP_OF_CONTEXT,
    cluster_pool_dps,
    registered_index,
    registered_lora,
)
from kvconductor.ingest.sharedstore import shared_targets
from kvconductor.keys import Medium, WorkerKey, node_of_backend_id

Targets = list[tuple[str, str, WorkerKey]]


class Miss(NamedTuple):
    """No target: the drop reason, its WARN text, and whether it is warned (else only
    counted)."""

    reason: str
    detail: str = ""
    warn: bool = True


def registered(host: IngestHost, infos: dict, iid: str, dp: int) -> tuple[str | None, str | None]:
    """A DP's registered (model, tenant); ``infos``: instance_info per batch."""
    info = infos.get(iid, infos)
    if info is infos:
        info = infos[iid] = host.instance_info(iid)
    return registered_index(info, dp)


def pool_targets(
    host: IngestHost,
    ctx: SubscriberContext,
    ev: PoolEvent,
    media: Sequence[int],
    infos: dict,
) -> Targets | Miss:
    """The targets of ``ev`` (module docstring), or why there is none."""
    out: Targets = []
    if ctx.shared_store:
        targets, why = shared_targets(host, ctx, ev, media)
        return targets if targets else Miss(NO_DP_OF_CONTEXT, why)
    if ctx.is_pool:
        node = node_of_backend_id(ev.backend_id) if ev.backend_id else ctx.node_ip
        if not node:
            return Miss("no_backend_id", warn=False)
        pairs = host.hbm_ip_lookup(node) or ()
        if not pairs and ctx.node_ip and node != ctx.node_ip:
            # a node pool's backend_id may name the pool daemon, not the engines' node
            node = ctx.node_ip
            pairs = host.hbm_ip_lookup(node) or ()
        if pairs and not ctx.node_pool:
            routed = cluster_pool_dps(
                pairs,
                lambda iid, dp: registered(host, infos, iid, dp),
                ev.model_name,
                ev.tenant_id,
                ctx.model,
                ctx.tenant,
                ev.lora_name,
                ctx.lora_name,
                lambda iid, dp: registered_lora(infos.get(iid), dp),
            )
            if routed.reason:
                return Miss(
                    routed.reason,
                    f"{routed.detail} (event backend_id {ev.backend_id!r}, node {node})",
                )
            for iid, dp, model, tenant in routed.dps:
                for m in media:
                    out.append((model, tenant, WorkerKey(iid, iid, dp, Medium(m))))
            return out
        seen = set()
        for iid, dp in pairs:
            if (iid, dp) in seen:
                continue
            seen.add((iid, dp))
            # a node pool serves the DPs of its own (model, tenant) on its node
            m0, t0 = registered(host, infos, iid, dp)
            want: tuple[str, str] = (
                ctx.model if ev.model_name is None else ev.model_name,
                ctx.tenant if ev.tenant_id is None else ev.tenant_id,
            )
            if (m0, t0) != want:
                continue
            for m in media:
                out.append((want[0], want[1], WorkerKey(iid, iid, dp, Medium(m))))
        if not out:
            if ctx.node_pool:
                return Miss(
                    "no_dp_on_node",
                    f"no DP is registered with an HBM URL on {node} for model="
                    f"{ctx.model} tenant={ctx.tenant} (node pool {ctx.instance_id}, event "
                    f"backend_id {ev.backend_id!r}): its blocks count for the DPs "
                    "registered there when it publishes them",
                )
            return Miss(
                "backend_id_not_in_hbm_ip_index",
                f"no DP is registered with an HBM URL on {node} (event backend_id "
                f"{ev.backend_id!r})",
            )
    else:
        model = ev.model_name if ev.model_name is not None else ctx.model
        tenant = ev.tenant_id if ev.tenant_id is not None else ctx.tenant
        iid = ctx.instance_id
        for m in media:
            out.append((model, tenant, WorkerKey(iid, iid, ctx.dp_rank, Medium(m))))
    return out
