"""``POST /explain``'s document: why each (instance, DP) of a (model, tenant) matches
what it does for a query (docs/api.md, POST /explain).

Built on the ingest thread (:meth:`kvconductor.state.conductor.Conductor.explain`), from
a consistent view of the registry, the subscriptions' sources and the index: the
:class:`ExplainState` the conductor hands in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypedDict

from kvconductor._hash import DEFAULT_SEED, hash_blocks, lora_seed
from kvconductor.extrakeys import QueryExtras
from kvconductor.index import Index
from kvconductor.predict import Predictions, is_predicted
from kvconductor.schema import (
    EXPLAIN_TIERS,
    STOP_MUTED,
    STOP_NO_FIRST_BLOCK,
    ExplainInstance,
    ExplainLoss,
    ExplainPrediction,
    ExplainResponse,
    ExplainSource,
    ExplainTier,
    ExplainWorker,
)
from kvconductor.state.protocols import SourceInfo, Subscriptions
from kvconductor.state.registry import Registry

__all__ = ["ExplainState", "explain", "explain_sources"]


class ExplainState(NamedTuple):
    """What the ``/explain`` document is built from (the conductor's, on its ingest
    thread)."""

    registry: Registry
    #: (model, tenant) -> its index.
    indexes: Mapping[tuple[str, str], Index]
    #: (model, tenant) -> the block sizes registered for it.
    block_sizes: Mapping[tuple[str, str], frozenset[int]]
    #: The subscriptions' ``/workers`` ``sources`` entries.
    sources: Callable[[], list[SourceInfo]]
    subs: Subscriptions
    #: The routers' live predictions (``POST /predict``).
    predictions: Predictions | None = None


class _LossFields(TypedDict, total=False):
    losses: int
    degraded_since: float | None
    last_loss: ExplainLoss | None
    dropped: dict[str, int]


def _loss_fields(info: SourceInfo | None) -> _LossFields:
    """The loss and drop fields of an :class:`ExplainSource` from a ``/workers`` source."""
    if info is None:
        return {}
    loss = info.get("last_loss")
    return {
        "losses": int(info.get("losses") or 0),
        "degraded_since": info.get("degraded_since"),
        "last_loss": None if loss is None else ExplainLoss(at=loss["at"], why=loss["why"]),
        "dropped": dict(info.get("dropped") or {}),
    }


def _source_warnings(s: ExplainSource, label: str, now: float) -> list[str]:
    """``/explain`` warnings of one source: not ready, degraded by a loss (and why),
    events dropped (``parent_not_found``: blocks chained to batches it never received)."""
    out = []
    if s.state not in ("live", "degraded"):
        out.append(f"{label} is {s.state}")
    if s.state == "degraded" and s.last_loss is not None:
        out.append(
            f"{label} is degraded: {s.last_loss.why} ({now - s.last_loss.at:.0f}s ago); the "
            "blocks it held then count until they age out unless announced again"
        )
    if s.dropped:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.dropped.items()))
        line = f"{label} dropped events ({reasons})"
        if "parent_not_found" in s.dropped:
            line += (
                ": parent_not_found events store blocks after a parent block this source "
                "never announced (it was lost, or published before the subscription "
                "connected); those blocks are not indexed"
            )
        out.append(line)
    return out


def explain_sources(
    state: ExplainState, instance_id: str, dp_rank: int, now: float
) -> list[ExplainSource]:
    """The ZeroMQ subscriptions of (instance, DP), from its registration (ingest thread)."""
    entry = state.registry.get(instance_id)
    ep = entry.endpoints.get(dp_rank) if entry is not None else None
    if ep is None:
        return []
    infos = {
        s["url"]: s
        for s in state.sources()
        if s["instance_id"] == instance_id and s["dp_rank"] == dp_rank
    }
    out = []
    for url, media in ep.sources:
        info = infos.get(url)
        sub = state.subs.get(instance_id, dp_rank, url) if info is not None else None
        last = sub.stats.last_event if sub is not None else None
        out.append(
            ExplainSource(
                url=url,
                media=[m.display.lower() for m in media],
                is_pool=ep.is_pool,
                state=str(info.get("state", "unknown")) if info is not None else "closed",
                connected=bool(info.get("connected")) if info is not None else False,
                events=int(info.get("events") or 0) if info is not None else 0,
                blocks=int(info.get("blocks") or 0) if info is not None else 0,
                last_event_age_s=round(max(0.0, now - last), 3) if last else -1.0,
                **_loss_fields(info),
            )
        )
    return out


def _predictions(
    state: ExplainState, idx: Index | None, gk: tuple[str, int], tokens, bs: int, seed: int
) -> list[ExplainPrediction]:
    """The live predictions of (instance, DP) ``gk``: how much of the query each covers."""
    if state.predictions is None or idx is None or gk not in idx.predicted:
        return []
    now = state.predictions.clock()
    query = hash_blocks(tokens, bs, seed) if bs else []
    out = []
    for rec in state.predictions.of_group(idx, *gk):
        n = 0
        for a, b in zip(query, rec.locals, strict=False):
            if a != b:
                break
            n += 1
        age, left = round(now - rec.t, 3), round(max(0.0, rec.expires - now), 3)
        out.append(ExplainPrediction(n, len(rec.locals), age, left))
    return out


def explain(
    state: ExplainState,
    model: str,
    tenant: str,
    block_size: int,
    tokens,
    lora_name: str | None,
    extras: QueryExtras | None = None,
) -> ExplainResponse:
    """``POST /explain`` (ingest thread: a consistent view of the registry, the sources
    and the index): why each (instance, DP) of (model, tenant) matches what it does
    for this query (docs/api.md, POST /explain)."""
    now = time.time()
    key = (model, tenant)
    idx = state.indexes.get(key)
    seed = lora_seed(lora_name) if lora_name else DEFAULT_SEED
    nblocks = (len(tokens) + block_size - 1) // block_size
    sizes = sorted(state.block_sizes.get(key, ()))
    registered: dict[tuple[str, int], int] = {}
    unread: dict[tuple[str, int], str] = {}  # engine_url reads that failed, by DP
    followed: dict[tuple[str, int], tuple[str, str, str | None]] = {}  # engine_url, by DP
    pool_sources: list[ExplainSource] = []
    for iid in sorted(state.registry.instances):
        for dp, ep in sorted(state.registry.instances[iid].endpoints.items()):
            if ep.index_key != key:
                continue
            if ep.is_pool:
                pool_sources += explain_sources(state, iid, dp, now)
            else:
                registered[(iid, dp)] = ep.block_size
                if ep.engine_url is not None:
                    followed[(iid, dp)] = (ep.engine_url, ep.engine_url_state, ep.engine_url_error)
                if ep.engine_url is not None and ep.engine_url_state != "ok":
                    unread[(iid, dp)] = (
                        f"instance {iid} DP {dp}: its publishers are read from "
                        f"{ep.engine_url}/kv_event_sources, and the last read failed "
                        f"({ep.engine_url_state}: {ep.engine_url_error}); it is read again "
                        "while its subscriptions stay down"
                    )
    groups = (
        {(g.instance_id, g.dp_rank): g for g in idx.trace(tokens, block_size, seed, extras)}
        if idx
        else {}
    )
    warnings: list[str] = []
    if idx is None:
        warnings.append(
            f"no index for model={model} tenant={tenant}: no registration names this "
            "(model, tenant) and no events were published for it; compare with the "
            "modelname and tenant_id the engines registered (GET /workers)"
        )
    # NOTE: the block size mismatch sentence is /query's, added by the HTTP resource.
    instances: list[ExplainInstance] = []
    hits = False
    for gk in sorted(set(registered) | {k for k, g in groups.items() if sum(g.held)}):
        iid, dp = gk
        g = groups.get(gk)
        if g is None:
            tiers = {t: ExplainTier(0, 0, "no_worker", 0) for t in EXPLAIN_TIERS}
            workers: list[ExplainWorker] = []
            blocks = (0, 0, 0)
        else:
            blocks = g.blocks
            tiers = {
                t: ExplainTier(g.blocks[i], g.reach[i], g.stops[i], g.held[i])
                for i, t in enumerate(EXPLAIN_TIERS)
            }
            workers = [
                ExplainWorker(
                    w.key.medium.display.lower(),
                    "predicted" if is_predicted(w.key) else w.key.backend_id,
                    w.held,
                    w.reach,
                    w.stop,
                )
                for w in g.workers
                if w.held or not is_predicted(w.key)
            ]
        hits = hits or sum(blocks) > 0
        sources = explain_sources(state, iid, dp, now)
        if gk not in registered:
            warnings.append(
                f"instance {iid} DP {dp} holds blocks in this index but no registration "
                "names that DP of this (model, tenant): its data comes from a publisher "
                "registered under another DP rank, model or tenant (DP rank r publishes on "
                "the registered port + r)"
            )
        elif g is None or not sum(g.held):
            quiet = [s.url for s in sources if not s.events]
            why = (
                f"; no events arrived from {', '.join(quiet)} (check the engine publishes "
                "there: DP rank r publishes on port + r)"
                if quiet
                else ""
            )
            warnings.append(f"instance {iid} DP {dp} holds no blocks in any tier{why}")
        if any(w.stop == STOP_MUTED for w in workers):
            warnings.append(
                f"instance {iid} DP {dp} is muted: a source of it has been down longer than "
                "--source-down-secs, so its blocks give no hits until the source is back"
            )
        for s in sources:
            warnings += _source_warnings(s, f"source {s.url} of instance {iid} DP {dp}", now)
        if gk in unread:
            warnings.append(unread[gk])
        preds = _predictions(state, idx, gk, tokens, block_size, seed)
        url, url_state, url_error = followed.get(gk, (None, None, None))
        instances.append(
            ExplainInstance(
                instance_id=iid,
                dp_rank=dp,
                registered=gk in registered,
                block_size=registered.get(gk),
                npu_blocks=blocks[0],
                cpu_blocks=blocks[1],
                disk_blocks=blocks[2],
                tiers=tiers,
                workers=workers,
                sources=sources,
                predictions=preds,
                engine_url=url,
                engine_url_state=url_state,
                engine_url_error=url_error,
            )
        )
    if idx is not None and nblocks and not hits:
        first = [g for g in groups.values() if g.stops[0] == STOP_NO_FIRST_BLOCK]
        if first:
            warnings.append(
                "no block of this index starts with the query's first block: check "
                "block_size, lora_name (LoRA blocks are hashed with the adapter's seed, "
                "so base-model and adapter blocks never match each other) and that the "
                "token ids are the engine's (same tokenizer, chat template and BOS token)"
            )
    for s in pool_sources:
        warnings += _source_warnings(s, f"pool source {s.url}", now)
    sizes_now = idx.sizes() if idx is not None else {}
    offload = int(sizes_now.get("offload", 0))
    pending = int(sizes_now.get("pending", 0))
    if offload:
        warnings.append(
            f"{offload} block(s) offloaded by engines to CPU/Disk await a pool's "
            "confirmation: they join the CPU/Disk tiers only when a pool publishes them"
        )
    if pending:
        warnings.append(
            f"{pending} pool confirmation(s) await the engine's offload event of the same block"
        )
    return ExplainResponse(
        model=model,
        tenant=tenant,
        lora_name=lora_name or None,
        index_found=idx is not None,
        block_size=block_size,
        registered_block_sizes=sizes,
        query_blocks=nblocks,
        offload_pending=offload,
        pool_pending=pending,
        warnings=warnings,
        instances=instances,
        pool_sources=pool_sources,
    )
