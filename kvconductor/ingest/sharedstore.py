"""A shared store's blocks (docs/events.md, "Applying", pool events; issue 36).

Mooncake's store, as Mooncake's conductor reads it, is shared by every engine of one
context (model, tenant, block size): any rank continues onto its blocks. Its events
name the store in ``backend_id`` (a configured name, not a node) and key a block by the
engine's block hash only: no parent, no token ids. A registration with ``shared_store``
(the Mooncake dialect's ``type: Mooncake``) has its blocks credited to every DP
registered in the context (the applier's targets), and a block's place in the chains
(its local hash and parent) is taken from the engine that holds it in HBM:

1. an HBM worker of one of those DPs holds the engine hash: its ``(parent, local)``
   (:meth:`~kvconductor.index.Index.block_of`), stored at once on each target's tier;
2. none does: the two-phase join (:meth:`~kvconductor.index.Index.pool_store`), which
   applies it when the block's content is known (an engine's CPU offload, a block on a
   lower tier) and otherwise waits ``--pending-ttl-secs`` for an engine's offload.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvconductor.keys import Medium, WorkerKey


def shared_targets(host, ctx, ev, media) -> tuple[list[tuple[str, str, WorkerKey]], str]:
    """A shared store's targets ``[(model, tenant, key)]``: every DP registered in the
    event's (model, tenant) (else the registration's) with the registration's block
    size, on each of ``media``; none: ``([], the WARN text)``. ``host``: the
    :class:`~kvconductor.ingest.host.IngestHost`, ``ctx`` the store's subscription."""
    model = ctx.model if ev.model_name is None else ev.model_name
    tenant = ctx.tenant if ev.tenant_id is None else ev.tenant_id
    lora = ev.lora_name or ctx.lora_name
    dps = host.context_dps(model, tenant, ctx.block_size, lora)
    out = [(model, tenant, WorkerKey(i, i, d, Medium(m))) for i, d in dps for m in media]
    why = (
        f"shared store: no DP is registered in model={model} tenant={tenant} "
        f"lora_name={lora!r} with block_size {ctx.block_size} (event backend_id "
        f"{ev.backend_id!r}): its blocks count for the DPs registered there when it "
        "publishes them"
    )
    return out, "" if out else why


def hbm_keys(targets: Sequence[WorkerKey]) -> list[WorkerKey]:
    """The HBM workers of the DPs of ``targets`` (where a block's place is looked up)."""
    seen: dict[tuple[str, int], WorkerKey] = {}
    for k in targets:
        if (k.instance_id, k.dp_rank) not in seen:
            seen[(k.instance_id, k.dp_rank)] = WorkerKey(
                k.instance_id, k.backend_id, k.dp_rank, Medium.NPU
            )
    return list(seen.values())


def store_shared(
    index, targets: Sequence[WorkerKey], hashes: Sequence[int], now: float
) -> tuple[int, int, int]:
    """Credit ``hashes`` to every key of ``targets`` in ``index``; returns ``(placed,
    joined, waiting)``: blocks placed from an HBM holder, applied by the two-phase join,
    and left waiting for an engine's offload (per target)."""
    holders = hbm_keys(targets)
    placed = joined = waiting = 0
    for h in hashes:
        found = None
        for hk in holders:
            try:
                found = index.block_of(hk, h)
            except KeyError:
                continue
            break
        for key in targets:
            if found is not None:
                placed += index.store(key, found[0], (h,), (found[1],))
            else:
                applied, queued = index.pool_store(key, (h,), now)
                joined += applied
                waiting += queued
    return placed, joined, waiting
