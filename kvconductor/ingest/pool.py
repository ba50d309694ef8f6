"""Decoders for KV-pool events: Mooncake / Memcache / YuanRong.

Formats: docs/engines.md, "Pool event format".

Containers:

* tuple ``[ts_ms, [PoolEvent...], dp_rank]`` (Mooncake master, YuanRong ports,
  anything using the tuple form; ``dp_rank`` may be missing or nil);
* map ``{"events": [PoolEvent...]}`` (Memcache MetaService; missing ``events`` = empty).

A PoolEvent is a msgpack map with the keys of :class:`PoolEvent`; unknown keys
are ignored. Hashes go through :func:`flex_hash`. Unlike the reference, a bad
hash (or a field of the wrong type) drops **that event** with a counted reason,
not the whole batch, and negative integers are read as two's-complement u64
(the reference failed the whole batch on them; docs/events.md, "Applying"). A string
field longer than ``NAME_MAX`` characters, or holding a control character (NUL, newline,
ESC...: what an id or a name may not hold on the HTTP routes either), drops its event too
(``invalid_event``).
"""

from __future__ import annotations

import msgspec

from kvconductor.ingest.ops import (
    CLEARED,
    OTHER,
    REMOVED,
    STORED,
    DecodeError,
    Dropped,
    PoolBatch,
    PoolEvent,
    int_hash,
    parse_hash_str,
)
from kvconductor.schema import NAME_MAX, has_control_character

_ANY_DEC = msgspec.msgpack.Decoder()


def flex_hash(h: object) -> int:
    """The reference's FlexHash, fixed: u64; negative i64 -> two's complement (not an error);
    string ``0x`` hex / decimal / bare hex; bytes up to 8, big-endian left-padded.

    Raises ValueError ("hash bytes too long", "invalid hash ...") or TypeError.
    """
    if type(h) is int:
        return int_hash(h)
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if len(b) > 8:
            raise ValueError("hash bytes too long")
        return int.from_bytes(b, "big")
    if isinstance(h, str):
        return parse_hash_str(h)
    raise TypeError(f"hash of type {type(h).__name__}")


def classify(type_str: str) -> str:
    """stored / removed / cleared / other, by substring (docs/engines.md, "Pool event format")."""
    if "stored" in type_str or "Stored" in type_str:
        return STORED
    if "removed" in type_str or "Removed" in type_str:
        return REMOVED
    if "cleared" in type_str or "Cleared" in type_str:
        return CLEARED
    return OTHER


def _opt_str(m: dict, key: str) -> str | None:
    v = m.get(key)
    if v is None:
        return v
    if not isinstance(v, str):
        raise DecodeError("invalid_event", f"{key} is {type(v).__name__}")
    if len(v) > NAME_MAX:
        raise DecodeError("invalid_event", f"{key} is longer than {NAME_MAX} characters")
    if has_control_character(v):
        raise DecodeError("invalid_event", f"{key} holds a control character")
    return v


def decode_pool_event(m: object) -> PoolEvent | Dropped:
    """A PoolEvent map (already decoded) -> PoolEvent, or Dropped with the reason."""
    if not isinstance(m, dict):
        return Dropped("invalid_event", f"pool event is {type(m).__name__}")
    try:
        et = _opt_str(m, "event_type")
        legacy = _opt_str(m, "type")
        type_str = et if et is not None else (legacy if legacy is not None else "unknown")
        dp = m.get("dp_rank")
        if dp is not None and (type(dp) is not int or not 0 <= dp <= 0xFFFFFFFF):
            raise DecodeError("invalid_event", f"dp_rank {dp!r}"[:80])
        eid = m.get("event_id", 0)
        hashes: list[int] = []
        for key in ("seq_hashes", "block_hashes"):
            v = m.get(key)
            if v is None:
                continue
            if not isinstance(v, list):
                raise DecodeError("invalid_event", f"{key} is {type(v).__name__}")
            for h in v:
                try:
                    hashes.append(flex_hash(h))
                except (TypeError, ValueError) as ex:
                    raise DecodeError("bad_hash", str(ex)) from None
        if len(hashes) > 1:
            hashes = list(dict.fromkeys(hashes))
        return PoolEvent(
            eid,
            classify(type_str),
            type_str,
            _opt_str(m, "model_name"),
            _opt_str(m, "tenant_id"),
            _opt_str(m, "backend_id"),
            _opt_str(m, "medium"),
            dp,
            hashes,
            _opt_str(m, "lora_name") or None,
        )
    except DecodeError as ex:
        return Dropped(ex.reason, ex.detail)


def decode_pool_tuple(obj: object) -> PoolBatch:
    """``[ts_ms, [events], dp_rank]`` (already decoded) -> PoolBatch."""
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise DecodeError("not_a_batch", "pool tuple is not an array of 2 or 3")
    return _pool_tuple(obj[0], obj[1], obj[2] if len(obj) == 3 else None)


def _pool_tuple(ts: object, events: object, dp: object) -> PoolBatch:
    if type(ts) not in (int, float) or not isinstance(events, list):
        raise DecodeError("not_a_batch", "pool tuple is not [ts_ms, [events], dp]")
    if dp is not None and type(dp) is not int:
        raise DecodeError("invalid_batch", f"dp_rank is {type(dp).__name__}")
    return PoolBatch(ts, dp, [decode_pool_event(e) for e in events], "tuple")


def decode_pool_events(
    payload: bytes, parts: tuple[list[msgspec.Raw], int, int | None], raw_events: list[msgspec.Raw]
) -> PoolBatch:
    """A pool tuple from what recognition read of it (``parts``: the envelope split by
    :func:`~kvconductor.ingest.vllm.split_batch`, ``raw_events``: its events element's
    elements): each element decoded once, with the result of
    :func:`decode_pool_payload`. A payload that does not decode element by element (or
    has its events third) is decoded whole, for the reason and detail of the whole."""
    elems, ei, _ = parts
    if ei == 1:
        try:
            ts = _ANY_DEC.decode(elems[0])
            dp = _ANY_DEC.decode(elems[2]) if len(elems) == 3 else None
            events = [_ANY_DEC.decode(r) for r in raw_events]
        except Exception:
            pass
        else:
            return _pool_tuple(ts, events, dp)
    return decode_pool_payload(payload)


def decode_memcache(obj: object) -> PoolBatch:
    """``{"events": [...]}`` (already decoded) -> PoolBatch."""
    if not isinstance(obj, dict):
        raise DecodeError("not_a_batch", "memcache batch is not a map")
    events = obj.get("events")
    if events is None:
        events = []
    if not isinstance(events, list):
        raise DecodeError("invalid_batch", "memcache 'events' is not an array")
    return PoolBatch(None, None, [decode_pool_event(e) for e in events], "memcache")


def decode_pool_payload(payload: bytes) -> PoolBatch:
    """Either container, from the raw payload."""
    try:
        obj = _ANY_DEC.decode(payload)
    except Exception as ex:
        raise DecodeError("undecodable", str(ex)) from None
    if isinstance(obj, dict):
        return decode_memcache(obj)
    return decode_pool_tuple(obj)
