"""``POST /events`` bodies turned into index operations (docs/api.md, "POST /events").

:func:`normalize_events` validates a decoded :class:`~kvconductor.schema.KvEventBatch`
all or nothing (:class:`EventError`: HTTP 400, nothing applied) and returns
:class:`EventOp` records, stably sorted by ``dp_rank``, that the conductor applies
on the ingest thread. It runs off that thread (in the HTTP handler).

Unlike the reference, an unknown type or a nested ``data`` event is never applied
as a Clear, and hashes take the full u64 range.
"""

from __future__ import annotations

from array import array
from operator import attrgetter
from typing import NamedTuple

import msgspec

from kvconductor._hash import DEFAULT_SEED, lora_seed
from kvconductor.keys import Medium, parse_medium
from kvconductor.schema import (
    CONTROL_WORDS,
    EVENT_NAME_FIELDS,
    U32_MAX,
    EventPayload,
    KvCacheEvent,
    KvEventBatch,
    WireValueError,
    has_control_character,
    to_u64,
)

__all__ = [
    "CLEARED",
    "REMOVED",
    "STORED",
    "EventError",
    "EventOp",
    "normalize_event",
    "normalize_events",
]


class EventError(ValueError):
    """An /events batch that cannot be applied at all (HTTP 400, nothing applied)."""


STORED, REMOVED, CLEARED = 0, 1, 2
_PAYLOAD_FIELDS = EventPayload.__struct_fields__
# NOTE: every payload field has a default, so defaults align with fields one to one.
assert len(EventPayload.__struct_defaults__) == len(_PAYLOAD_FIELDS)
_PAYLOAD_DEFAULTS = dict(zip(_PAYLOAD_FIELDS, EventPayload.__struct_defaults__, strict=True))
_DYNAMO_KINDS = {"stored", "removed", "cleared", "blockstored", "blockremoved", "allblockscleared"}


class EventOp(NamedTuple):
    """One validated event, ready for the index (built off the ingest thread)."""

    kind: int
    event_id: int
    dp_rank: int
    backend_id: str | None
    medium: Medium
    parent: int | None
    engine_hashes: array  # array('Q')
    local_hashes: array | None  # array('Q'); None when ``tokens`` is set
    tokens: array | None  # array('I') hashed with ``block_size`` by the index
    block_size: int
    seed: int  # hash seed of ``tokens`` (LoRA adapters have their own)


def _u64_array(values: list[int] | None, what: str) -> array:
    if not values:
        return array("Q")
    try:
        return array("Q", values)
    except OverflowError:
        return array("Q", [to_u64(v, what) for v in values])


def _u32_tokens(values: list[int]) -> array:
    try:
        return array("I", values)
    except OverflowError:
        for v in values:
            to_u64(v, "token id")  # range check: [-2**63, 2**64)
        return array("I", [v & U32_MAX for v in values])


_EVENT_NAMES = attrgetter(*(attr for attr, _ in EVENT_NAME_FIELDS))


def _check_names(payload: EventPayload, at: int, where: str = "") -> None:
    """Refuse an id or name of event ``at`` holding a control character (schema.EventName):
    ``isprintable`` (C) per value, the field found and the regex run only on a hit."""
    for v in _EVENT_NAMES(payload):
        if v is not None and not v.isprintable():
            for attr, wire in EVENT_NAME_FIELDS:
                value = getattr(payload, attr)
                if value is not None and has_control_character(value):
                    raise EventError(
                        f"invalid JSON request body: {CONTROL_WORDS} - at "
                        f"`$.events[{at}]{where}.{wire}`"
                    )
            return


def _merged_payload(ev: KvCacheEvent, at: int = 0) -> EventPayload:
    """The event's payload: the flat fields, overridden by a nested ``data`` object.

    ``data`` may be a flat payload object, a Dynamo-style one-key object
    (``{"stored": {...}}``, ``{"removed": {...}}``) or a type string
    (``"cleared"``).
    """
    data = ev.data
    if data is None:
        return ev
    kind_hint = None
    if isinstance(data, str):
        kind_hint, body = data, {}
    elif isinstance(data, dict):
        body = data
        if len(data) == 1:
            ((key, value),) = data.items()
            if (
                isinstance(key, str)
                and key.lower() in _DYNAMO_KINDS
                and (value is None or isinstance(value, dict))
            ):
                kind_hint, body = key, value or {}
    else:
        raise EventError(f"event_id={ev.event_id}: data must be an object or a string")
    try:
        inner = msgspec.convert(body, EventPayload)
    except msgspec.ValidationError as ex:
        raise EventError(
            f"event_id={ev.event_id}: invalid data: {str(ex).replace('`$', '`$.data')}"
        ) from None
    _check_names(inner, at, ".data")
    merged = {}
    for name in _PAYLOAD_FIELDS:
        value = getattr(inner, name)
        merged[name] = value if value != _PAYLOAD_DEFAULTS[name] else getattr(ev, name)
    payload = EventPayload(**merged)
    if kind_hint and not payload.kind_name():
        payload.event_type = kind_hint
    return payload


def _event_kind(ev: KvCacheEvent, payload: EventPayload) -> int:
    name = payload.kind_name()
    low = name.lower()
    if "removed" in low:
        return REMOVED
    if "stored" in low:
        return STORED
    if "cleared" in low:
        return CLEARED
    if not name:
        raise EventError(
            f"event_id={ev.event_id}: missing event type "
            "(event_type/type: BlockStored, BlockRemoved or AllBlocksCleared)"
        )
    # NOTE: an unrecognised type is rejected, never applied as a Clear (the reference cleared
    # the worker).
    raise EventError(
        f"event_id={ev.event_id}: unknown event type {name!r} "
        "(expected BlockStored, BlockRemoved or AllBlocksCleared)"
    )


def normalize_event(ev: KvCacheEvent, at: int = 0) -> EventOp:
    """Validate one event (number ``at`` of its batch, for the errors) and turn it into an
    :class:`EventOp`. Raises :class:`EventError`."""
    if ev.event_id > 0xFFFFFFFFFFFFFFFF:
        raise EventError(f"event_id {ev.event_id} is out of range (u64 expected)")
    _check_names(ev, at)
    payload = _merged_payload(ev, at)
    kind = _event_kind(ev, payload)
    try:
        parent = payload.parent()
        blocks = payload.blocks or []
        tokens = None
        local = None
        if kind == STORED:
            if blocks:
                engine = _u64_array([b.block_hash for b in blocks], "block_hash")
                local = _u64_array([b.tokens_hash for b in blocks], "tokens_hash")
            elif payload.token_ids and payload.block_size > 0:
                engine = _u64_array(payload.block_hashes, "block_hashes")
                tokens = _u32_tokens(payload.token_ids)
            else:
                # NOTE: pool-style fallback of the reference: tokens_hash = block_hash.
                engine = _u64_array(
                    (payload.seq_hashes or []) + (payload.block_hashes or []), "block_hashes"
                )
                local = engine
        elif kind == REMOVED:
            engine = _u64_array(
                (payload.seq_hashes or [])
                + (payload.block_hashes or [])
                + [b.block_hash for b in blocks],
                "block_hashes",
            )
        else:
            engine = array("Q")
    except WireValueError as ex:
        raise EventError(f"event_id={ev.event_id}: {ex}") from None
    seed = lora_seed(payload.lora_name) if payload.lora_name else DEFAULT_SEED
    return EventOp(
        kind,
        ev.event_id,
        ev.dp_rank,
        payload.backend_id or None,
        parse_medium(payload.medium),
        parent,
        engine,
        local,
        tokens,
        payload.block_size,
        seed,
    )


def normalize_events(batch: KvEventBatch) -> list[EventOp]:
    """Validate every event of a batch (all or nothing), stably sorted by dp_rank."""
    ops = [normalize_event(ev, i) for i, ev in enumerate(batch.events or ())]
    ops.sort(key=lambda op: op.dp_rank)
    return ops
