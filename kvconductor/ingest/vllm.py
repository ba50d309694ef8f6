"""Decoders for vLLM and SGLang ``KVEventBatch`` payloads (docs/events.md, "vLLM / SGLang events").

A batch is a msgpack array ``[ts, events, dp]`` (vLLM >= 0.9.1, SGLang >= 0.4.7),
``[ts, events]`` (vLLM 0.9.0, SGLang 0.4.6) or ``[ts, dp, events]`` (also
accepted, see docs/events.md, "Payload recognition"). Every event is dispatched
on its own msgpack type:

* array (vLLM <= 0.23, SGLang <= 0.5.19): decoded **by position**
  (0 tag, 1 block_hashes, 2 parent_block_hash, 3 token_ids, 4 block_size,
  5 lora_id, 6 medium, 7 lora_name, 8 extra_keys, 9 group_idx,
  10 kv_cache_spec_kind, 11 kv_cache_spec_sliding_window; 12+ ignored;
  trailing fields may be missing);
* map (vLLM >= 0.24, SGLang >= 0.5.20): decoded by name, unknown keys ignored,
  missing keys take their defaults.

Decoding uses typed :mod:`msgspec` structs, so only the fields we use become
Python objects (``extra_keys`` stays raw bytes, read in C into one digest per block and
mixed into the blocks' local hashes, docs/api.md "Block hashing"; an ``extra_keys`` of
another shape than vLLM's drops its event, ``invalid_extra_keys``). Token
ids end up in an ``array('I')`` and block hashes in an ``array('Q')``, both
handed to the index as C buffers.

A malformed event is dropped alone (reason counted by the caller); a batch
whose envelope cannot be read raises :class:`DecodeError`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import cast

import msgspec

import kvconductor
from kvconductor._hash import DEFAULT_SEED, extra_digest, hash_blocks, lora_seed, mix_extra
from kvconductor._ingest import extra_key_digests
from kvconductor._py.hash import event_extra_digests
from kvconductor._py.hash import extra_digest as py_extra_digest
from kvconductor._wire import WireError as _WireError
from kvconductor._wire import read_u32_array
from kvconductor.ingest.ops import (
    KNOWN_TAGS,
    Cleared,
    DecodeError,
    Dropped,
    Removed,
    Stored,
    VllmBatch,
    VllmEvent,
    int_hash,
    msgpack_kind,
    parse_hash_str,
)

_U32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------
# hash conversion


def engine_hash(h: object) -> int:
    """vLLM/SGLang block hash -> u64 (docs/events.md, "vLLM / SGLang events").

    non-negative int as is; negative int -> two's complement u64 (the reference
    dropped those of vLLM 0.9 ``hash()`` and SGLang's int64); bytes of up to 8
    bytes big-endian, longer (16/32-byte digests) -> last 8 bytes big-endian
    (= vLLM's integer form); strings ``0x..`` hex, decimal, or bare hex.
    Raises ValueError/TypeError otherwise (nil, floats, bools, maps, ...).
    """
    if type(h) is int:
        return int_hash(h)
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not b:
            raise ValueError("empty hash bytes")
        return int.from_bytes(b[-8:], "big")
    if isinstance(h, str):
        return parse_hash_str(h)
    raise TypeError(f"hash of type {type(h).__name__}")


def engine_hashes(hs: list) -> array:
    """A list of wire hashes as ``array('Q')`` (fast path: all non-negative ints)."""
    try:
        return array("Q", hs)
    except (TypeError, OverflowError):
        return array("Q", [engine_hash(h) for h in hs])


def u32_tokens(tokens: list) -> array:
    """Token ids -> ``array('I')``, truncating to the low 32 bits (docs/api.md, "Block hashing")."""
    try:
        return array("I", tokens)
    except OverflowError:
        return array("I", [t & _U32 for t in tokens])


#: The compiled token-array reader; ``None`` (the msgspec path only) when ``KVCONDUCTOR_IMPL=py``.
_read_u32_array: Callable[[memoryview], array] | None = (
    None if kvconductor.IMPL == "py" else read_u32_array
)
_INT_LIST_DEC = msgspec.msgpack.Decoder(list[int])


def raw_tokens(raw: msgspec.Raw) -> array:
    """A raw msgpack int array (or nil) -> ``array('I')`` of u32-truncated token ids.

    :func:`kvconductor._wire.read_u32_array` scans the ints in C straight into the
    array; for ids outside the i64 range it rejects, msgspec decodes a list (and the
    ids are truncated). Raises DecodeError("invalid_event") for anything but an
    array of ints.
    """
    mv = memoryview(raw)
    if not len(mv):
        return array("I")
    k = msgpack_kind(mv[0])
    if k == "nil":
        return array("I")
    if k != "array":
        raise DecodeError("invalid_event", f"token_ids is a msgpack {k}")
    if _read_u32_array is not None:
        try:
            return _read_u32_array(mv)
        except _WireError:
            pass  # e.g. ids >= 2**63: let msgspec decide (and truncate)
    try:
        return u32_tokens(_INT_LIST_DEC.decode(raw))
    except Exception as ex:
        raise DecodeError("invalid_event", f"token_ids: {ex}") from None


# ---------------------------------------------------------------------------------------
# typed wire structs

_RAW_NIL = msgspec.Raw(b"\xc0")
_Str = str | None


class _Stored(msgspec.Struct):
    """The fields of ``BlockStored`` both forms declare first (array positions 1-7)."""

    block_hashes: object = None
    parent_block_hash: object = None
    token_ids: msgspec.Raw = _RAW_NIL
    block_size: int | None = None
    lora_id: object = None
    medium: _Str = None
    lora_name: _Str = None


class _Removed(msgspec.Struct):
    """The fields of ``BlockRemoved`` (array positions 1-3)."""

    block_hashes: object = None
    medium: _Str = None
    group_idx: object = None


class _AStored(_Stored, array_like=True, tag="BlockStored"):
    extra_keys: msgspec.Raw = _RAW_NIL
    group_idx: object = None
    kv_cache_spec_kind: _Str = None
    kv_cache_spec_sliding_window: object = None


class _ARemoved(_Removed, array_like=True, tag="BlockRemoved"):
    pass


class _ACleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _MStored(_Stored, tag_field="type", tag="BlockStored"):
    group_idx: object = None
    kv_cache_spec_kind: _Str = None
    kv_cache_spec_sliding_window: object = None
    locality: object = None
    ownership: object = None
    session_id: object = None
    #: TensorRT-LLM's ZeroMQ tee: one LocalBlockHash per block instead of token ids.
    tokens_hashes: object = None
    extra_keys: msgspec.Raw = _RAW_NIL
    #: SGLang >= 0.5.20: the salt of the request that stored the blocks (a string counts).
    cache_salt: object = None
    # lookahead_token_ids: not declared, skipped by msgspec.
    # Pool-event keys: present only when a pool map was mistaken for an engine event.
    event_type: object = None
    seq_hashes: object = None
    backend_id: object = None


class _MRemoved(_Removed, tag_field="type", tag="BlockRemoved"):
    event_type: object = None  # (pool-event keys, as in _MStored)
    seq_hashes: object = None
    backend_id: object = None


class _MCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


#: A decoded wire event, either form.
_WireEvent = _AStored | _ARemoved | _ACleared | _MStored | _MRemoved | _MCleared

_ARRAY_DEC = msgspec.msgpack.Decoder(_AStored | _ARemoved | _ACleared)
_MAP_DEC = msgspec.msgpack.Decoder(_MStored | _MRemoved | _MCleared)
_RAW_LIST_DEC = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ANY_DEC = msgspec.msgpack.Decoder()


def _first(raw: msgspec.Raw) -> int:
    mv = memoryview(raw)
    return mv[0] if len(mv) else -1


def _hashes_of(v: object, what: str = "block_hashes") -> array:
    if v is None:
        return array("Q")
    if not isinstance(v, list):
        raise DecodeError("invalid_event", f"{what} is {type(v).__name__}")
    try:
        return engine_hashes(v)
    except (TypeError, ValueError) as ex:
        raise DecodeError("bad_hash", str(ex)) from None


def _convert(ev: _WireEvent) -> Stored | Removed | Cleared:
    if isinstance(ev, (_AStored, _MStored)):
        hashes = _hashes_of(ev.block_hashes)
        parent = ev.parent_block_hash
        if parent is not None:
            try:
                parent = engine_hash(parent)
            except (TypeError, ValueError) as ex:
                raise DecodeError("bad_hash", f"parent: {ex}") from None
        tokens = raw_tokens(ev.token_ids)
        bs = ev.block_size or 0
        if bs < 0:
            raise DecodeError("invalid_event", f"block_size {bs}")
        if parent == 0 and not bs and not len(tokens):
            parent = None  # llm-d's storage events: parent 0 stands for "unknown"
        # The array form carries no locality, ownership or session (map form only).
        placement = () if isinstance(ev, _AStored) else (ev.locality, ev.ownership, ev.session_id)
        local = None
        if isinstance(ev, _MStored) and ev.tokens_hashes is not None:
            local = _hashes_of(ev.tokens_hashes, "tokens_hashes")
            if len(local) != len(hashes):
                raise DecodeError(
                    "invalid_event",
                    f"{len(local)} tokens_hashes for {len(hashes)} block_hashes",
                )
        if local is None and _first(ev.extra_keys) not in (-1, 0xC0):
            hashes, local = _with_extra_keys(ev, hashes, tokens, bs, None)
        elif local is None and isinstance(ev, _MStored) and parent is None:
            salt = ev.cache_salt
            if isinstance(salt, str) and salt:  # SGLang: salted chains, from their first block
                digest = array("Q", [_extra_digest([("salt", salt)])])
                hashes, local = _with_extra_keys(ev, hashes, tokens, bs, digest)
        st = Stored(
            hashes,
            parent,
            tokens,
            bs,
            ev.medium,
            ev.lora_name,
            ev.lora_id,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
            *placement,
        )
        st.local_hashes = local
        return st
    if isinstance(ev, (_ARemoved, _MRemoved)):
        return Removed(_hashes_of(ev.block_hashes), ev.medium, ev.group_idx)
    return Cleared()


#: The reader of an event's ``extra_keys`` (its twin when ``KVCONDUCTOR_IMPL=py``).
_extra_digests: Callable[[bytes, str | None, int], array | None] = (
    event_extra_digests if kvconductor.IMPL == "py" else extra_key_digests
)
_extra_digest: Callable[[list[tuple]], int] = (
    py_extra_digest if kvconductor.IMPL == "py" else extra_digest
)


def _with_extra_keys(
    ev: _AStored | _MStored, hashes: array, tokens: array, bs: int, digests: array | None
) -> tuple[array, array | None]:
    """``(block hashes, local hashes or None)`` of a BlockStored with extra keys (its
    ``extra_keys``' digests unless ``digests`` are given): the blocks the token ids cover
    (``CoreIndex.store_tokens``'s count) with each block's digest mixed into its local
    hash; None when no block has extra keys or the event has no token ids (its engine
    hashes are its local hashes). DecodeError ``invalid_extra_keys`` for an
    ``extra_keys`` of a shape that is not vLLM's."""
    if digests is None:
        try:
            digests = _extra_digests(bytes(ev.extra_keys), ev.lora_name, len(hashes))
        except ValueError as ex:
            raise DecodeError("invalid_extra_keys", str(ex)) from None
    if digests is None or not (len(tokens) and bs):
        return hashes, None
    seed = lora_seed(ev.lora_name) if ev.lora_name else DEFAULT_SEED
    local = hash_blocks(tokens, bs, seed)
    n = min(len(local), len(hashes))
    return hashes[:n], mix_extra(local[:n], digests, seed)


def _why_invalid(raw: msgspec.Raw | bytes, kind: str, err: Exception) -> Dropped:
    """Classify a failed typed decode: unknown tag vs wrong field types vs garbage."""
    try:
        obj = _ANY_DEC.decode(raw)
    except Exception as ex:
        return Dropped("undecodable_event", str(ex))
    tag = None
    if kind == "array" and obj:
        tag = obj[0]
    elif kind == "map":
        tag = obj.get("type")
    if not isinstance(tag, str) or tag not in KNOWN_TAGS:
        return Dropped("unknown_event_type", repr(tag)[:64])
    return Dropped("invalid_event", str(err))


_BIN_DEC = msgspec.msgpack.Decoder(bytes)


def decode_event(raw: msgspec.Raw | bytes, wrapped: bool = False) -> VllmEvent:
    """One event (array or map form) -> Stored/Removed/Cleared/Dropped. An event packed
    on its own and sent as a msgpack bin (llm-d's storage publisher) is unwrapped once."""
    b = _first(raw) if isinstance(raw, msgspec.Raw) else (raw[0] if raw else -1)
    kind = msgpack_kind(b) if b >= 0 else "empty"
    if kind == "bin" and not wrapped:
        try:
            inner = _BIN_DEC.decode(raw)
        except Exception as ex:
            return Dropped("undecodable_event", str(ex))
        return decode_event(inner, wrapped=True)
    if kind == "array":
        dec = _ARRAY_DEC
    elif kind == "map":
        dec = _MAP_DEC
    else:
        return Dropped("invalid_event", f"event is a msgpack {kind}")
    try:
        ev = dec.decode(raw)
    except msgspec.ValidationError as ex:
        return _why_invalid(raw, kind, ex)
    except Exception as ex:
        return Dropped("undecodable_event", str(ex))
    try:
        return _convert(ev)
    except DecodeError as ex:
        return Dropped(ex.reason, ex.detail)


def _decode_int_or_nil(raw: msgspec.Raw) -> int | None:
    v = _ANY_DEC.decode(raw)
    if v is None:
        return None
    if type(v) is not int:
        raise DecodeError("invalid_batch", f"dp_rank is {type(v).__name__}")
    return v


def split_batch(payload: bytes) -> tuple[list[msgspec.Raw], int, int | None]:
    """Top-level ``[ts, events, dp]`` / ``[ts, events]`` / ``[ts, dp, events]``.

    Returns ``(elements, events_index, dp_index_or_None)``; raises DecodeError.
    """
    try:
        elems = _RAW_LIST_DEC.decode(payload)
    except msgspec.ValidationError as ex:
        raise DecodeError("not_a_batch", str(ex)) from None
    except Exception as ex:
        raise DecodeError("undecodable", str(ex)) from None
    n = len(elems)
    if n not in (2, 3):
        raise DecodeError("not_a_batch", f"array of {n} elements")
    k1 = msgpack_kind(_first(elems[1]))
    if k1 == "array":
        return elems, 1, (2 if n == 3 else None)
    if n == 3 and k1 in ("int", "nil") and msgpack_kind(_first(elems[2])) == "array":
        return elems, 2, 1
    raise DecodeError("not_a_batch", f"element 1 is a msgpack {k1}")


def decode_vllm_batch(
    payload: bytes,
    parts: tuple | None = None,
    raw_events: list[msgspec.Raw] | None = None,
    *,
    typed: bool = True,
) -> VllmBatch:
    """Decode a vLLM/SGLang batch payload. Raises DecodeError if the envelope is bad.

    ``parts``: :func:`split_batch` of the payload and ``raw_events`` its events
    element decoded as ``list[msgspec.Raw]``, when the caller has them already
    (:func:`kvconductor.ingest.recognize.decode`, after its Python reader recognised
    the payload). The events are decoded in one typed pass when they all have one form,
    known tags and well-typed fields; otherwise (or with ``typed=False``) one by one, so
    that a bad event is dropped alone with its reason. Both give the same events.
    """
    elems, ei, di = parts if parts is not None else split_batch(payload)
    tk = msgpack_kind(_first(elems[0]))
    if tk not in ("float", "int"):
        raise DecodeError("not_a_batch", f"ts is a msgpack {tk}")
    try:
        ts = _ANY_DEC.decode(elems[0])
        if raw_events is None:
            raw_events = _RAW_LIST_DEC.decode(elems[ei])
        dp = _decode_int_or_nil(elems[di]) if di is not None else None
    except DecodeError:
        raise
    except Exception as ex:
        raise DecodeError("invalid_batch", str(ex)) from None
    layout = "ts,events" if di is None else ("ts,events,dp" if ei == 1 else "ts,dp,events")
    events = _typed_events(elems[ei], raw_events) if typed else None
    if events is None:
        events = [decode_event(r) for r in raw_events]
    return VllmBatch(ts, dp, events, layout)


def _typed_events(raw: msgspec.Raw, raw_events: list[msgspec.Raw]) -> list[VllmEvent] | None:
    """The events element in one typed pass (all array-form or all map-form events with
    known tags and well-typed fields), else None."""
    evs = _decode_typed(raw, raw_events)
    return None if evs is None else [_convert_or_drop(e) for e in evs]


def _decode_typed(raw: msgspec.Raw, raw_events: list[msgspec.Raw]) -> list[_TypedEvent] | None:
    """The events element ``raw`` (its elements ``raw_events``) decoded in one typed pass,
    in the form of its first event (array or map), else None."""
    if not raw_events:
        return []
    k = msgpack_kind(_first(raw_events[0]))
    dec = _EVENTS_MAP if k == "map" else (_EVENTS_ARR if k == "array" else None)
    if dec is None:
        return None
    try:
        # either decoder's list is a list of _TypedEvent (no copy: a cast for mypy)
        return cast("list[_TypedEvent]", dec.decode(raw))
    except Exception:
        return None


# ---------------------------------------------------------------------------------------
# fast path: one typed pass over a whole well-formed batch


class _ArrBatch(msgspec.Struct, array_like=True):
    ts: float | int
    events: list[_AStored | _ARemoved | _ACleared]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float | int
    events: list[_MStored | _MRemoved | _MCleared]
    data_parallel_rank: int | None = None


_TypedEvent = _AStored | _ARemoved | _ACleared | _MStored | _MRemoved | _MCleared
_EVENTS_ARR = msgspec.msgpack.Decoder(list[_AStored | _ARemoved | _ACleared])
_EVENTS_MAP = msgspec.msgpack.Decoder(list[_MStored | _MRemoved | _MCleared])


def event_shapes(payload: bytes) -> list[tuple[bool, int, int, str | None]] | None:
    """``(stored, block hashes, block_size, medium)`` of each BlockStored/BlockRemoved of a
    vLLM/SGLang batch, read without converting its token ids (what a message weighs before
    it is decoded); None when the payload is no batch of one typed form (the decoder then
    decides)."""
    try:
        elems, ei, _ = split_batch(payload)
        raw = elems[ei]
        if msgpack_kind(_first(raw)) != "array":
            return None
        evs = _decode_typed(raw, _RAW_LIST_DEC.decode(raw))
    except Exception:
        return None
    if evs is None:
        return None
    out: list[tuple[bool, int, int, str | None]] = []
    for ev in evs:
        if isinstance(ev, (_ACleared, _MCleared)):
            continue
        hs = ev.block_hashes
        n = len(hs) if isinstance(hs, list) else 0
        if isinstance(ev, (_AStored, _MStored)):
            out.append((True, n, ev.block_size or 0, ev.medium))
        else:
            out.append((False, n, 0, ev.medium))
    return out


_FAST_ARR = msgspec.msgpack.Decoder(_ArrBatch)
_FAST_MAP = msgspec.msgpack.Decoder(_MapBatch)


def _convert_or_drop(ev: _WireEvent) -> VllmEvent:
    try:
        return _convert(ev)
    except DecodeError as ex:
        return Dropped(ex.reason, ex.detail)


def decode_vllm_fast(payload: bytes) -> VllmBatch | None:
    """``[float ts, events, dp?]`` whose events are all array-form or all map-form with
    known tags and well-typed fields, decoded in one typed pass; ``None`` means "use
    :func:`decode_vllm_batch`" (mixed forms, unknown tags, bad fields, other layouts)."""
    n = len(payload)
    if n < 12 or payload[0] not in (0x92, 0x93) or payload[1] != 0xCB:
        return None
    h = payload[10]
    if 0x91 <= h <= 0x9F:
        i = 11
    elif h == 0xDC:
        i = 13
    elif h == 0xDD:
        i = 15
    else:
        return None
    if i >= n:
        return None
    k = msgpack_kind(payload[i])
    dec = _FAST_MAP if k == "map" else (_FAST_ARR if k == "array" else None)
    if dec is None:
        return None
    try:
        b = dec.decode(payload)
    except Exception:
        return None
    if dec is _FAST_MAP:
        for e in b.events:
            if isinstance(e, (_MStored, _MRemoved)) and (
                e.event_type is not None or e.seq_hashes is not None or e.backend_id is not None
            ):
                return None  # pool events with a legacy "type": not ours
    layout = "ts,events,dp" if payload[0] == 0x93 else "ts,events"
    return VllmBatch(b.ts, b.data_parallel_rank, [_convert_or_drop(e) for e in b.events], layout)
