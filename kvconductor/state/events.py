"""``POST /events``: a validated batch applied to the indexes, per DP rank group
(docs/api.md, "Validation and answers").

:meth:`kvconductor.state.conductor.Conductor.apply_events` runs it on the ingest thread,
handing in its registry, its index of a (model, tenant) (created on first use) and its
record of the LoRA seeds events stored blocks of.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from kvconductor._hash import DEFAULT_SEED
from kvconductor.errors import IndexUpdateError, InvalidBlockSequence, ParentBlockNotFound
from kvconductor.index import Index
from kvconductor.ingest.http_events import REMOVED, STORED, EventOp
from kvconductor.keys import WorkerKey
from kvconductor.schema import DEFAULT_TENANT, KvEventBatch
from kvconductor.state.registry import Registry

log = logging.getLogger("kvconductor")

__all__ = [
    "DpNotRegistered",
    "EventsOutcome",
    "InstanceNotRegistered",
    "apply_events",
    "apply_op",
    "error_text",
]


class InstanceNotRegistered(LookupError):
    """An /events batch for an instance that is not registered (HTTP 404, nothing applied).

    The reference created a (model, tenant) index for it from ``model_name``:
    an index no unregistration could ever remove.
    """

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"instance {instance_id} not found")


class DpNotRegistered(InstanceNotRegistered):
    """A ``POST /predict`` for a dp_rank its instance does not register (HTTP 404, nothing
    held): a prediction there would name a DP no event can confirm or contradict."""

    def __init__(self, instance_id: str, dp_rank: int, registered) -> None:
        LookupError.__init__(
            self,
            f"dp_rank {dp_rank} of instance {instance_id} not found "
            f"(registered: {', '.join(map(str, sorted(registered)))})",
        )


def error_text(ex: IndexUpdateError) -> str:
    """The reference's message of an index error (docs/api.md, "Validation and answers");
    details go to the log."""
    if isinstance(ex, ParentBlockNotFound):
        return "parent block not found"
    if isinstance(ex, InvalidBlockSequence):
        return "invalid block sequence"
    return str(ex)


class EventsOutcome(NamedTuple):
    applied: int
    errors: list[str]


def apply_events(
    registry: Registry,
    index_for: Callable[[str, str], Index],
    note_lora: Callable[[str, str, int], None],
    batch: KvEventBatch,
    ops: list[EventOp],
) -> EventsOutcome:
    """Apply validated events per dp_rank group (docs/api.md, "Validation and answers").

    A failing group stops at its first error and contributes 0 to the
    applied count; other groups still apply. Raises
    :class:`InstanceNotRegistered` (nothing applied) for an unknown instance.
    """
    if batch.shutdown:
        log.info("shutdown flag set in events batch instance_id=%s", batch.instance_id)
    entry = registry.get(batch.instance_id)
    if entry is None:
        raise InstanceNotRegistered(batch.instance_id)
    applied = 0
    errors: list[str] = []
    i = 0
    while i < len(ops):
        dp = ops[i].dp_rank
        j = i
        while j < len(ops) and ops[j].dp_rank == dp:
            j += 1
        group = ops[i:j]
        i = j
        ep = entry.endpoints.get(dp)
        model = batch.model_name or (ep.model_name if ep else entry.model_name)
        tenant = batch.tenant_id or (ep.tenant_id if ep else entry.tenant_id)
        idx = index_for(model, tenant or DEFAULT_TENANT)
        try:
            for op in group:
                if op.seed != DEFAULT_SEED and op.tokens is not None:
                    note_lora(idx.model, idx.tenant, op.seed)
                apply_op(idx, batch.instance_id, op)
        except IndexUpdateError as ex:
            log.debug(
                "event group failed instance_id=%s dp_rank=%d detail=%s",
                batch.instance_id,
                dp,
                ex,
            )
            errors.append(f"dp_rank={dp}: {error_text(ex)}")
            continue
        except Exception as ex:  # reported, never fatal to the thread
            log.exception("failed to apply events instance_id=%s dp_rank=%d", batch.instance_id, dp)
            errors.append(f"dp_rank={dp}: internal error: {ex}")
            continue
        applied += len(group)
    if errors:
        log.warning(
            "failed to apply events instance_id=%s applied=%d errors=%s",
            batch.instance_id,
            applied,
            errors,
        )
    return EventsOutcome(applied, errors)


def apply_op(idx: Index, instance_id: str, op: EventOp) -> None:
    key = WorkerKey(instance_id, op.backend_id or instance_id, op.dp_rank, op.medium)
    if op.kind == STORED:
        if op.tokens is not None:
            idx.store_tokens(key, op.parent, op.engine_hashes, op.tokens, op.block_size, op.seed)
        else:
            assert op.local_hashes is not None  # normalize_event gives one or the other
            idx.store(key, op.parent, op.engine_hashes, op.local_hashes)
    elif op.kind == REMOVED:
        idx.remove(key, op.engine_hashes)
    else:
        idx.clear(key)
