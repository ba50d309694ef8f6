"""The typed operations the decoders produce and the applier consumes, and the
payload vocabulary they share (docs/events.md, "Payload recognition").

A payload's walk: :mod:`~kvconductor.ingest.recognize` reads its envelope once and
names its kind, the decoder of that kind (:mod:`~kvconductor.ingest.vllm`,
:mod:`~kvconductor.ingest.pool`) turns it into a :class:`VllmBatch` or
:class:`PoolBatch` of the classes below, :mod:`~kvconductor.ingest.apply` applies
those to the index. Nothing here imports another ingest module.
"""

from __future__ import annotations

import re
from array import array

import msgspec

MASK64 = 0xFFFFFFFFFFFFFFFF

#: The tags of vLLM/SGLang events (``type`` of the map form, element 0 of the array form).
KNOWN_TAGS = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


class DecodeError(Exception):
    """An undecodable payload or event; ``reason`` is the counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def msgpack_kind(first_byte: int) -> str:
    """The msgpack family of a value from its first byte."""
    b = first_byte
    if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return "int"
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
        return "str"
    if b in (0xC4, 0xC5, 0xC6):
        return "bin"
    if b in (0xCA, 0xCB):
        return "float"
    if b == 0xC0:
        return "nil"
    if b in (0xC2, 0xC3):
        return "bool"
    return "ext"


# ---------------------------------------------------------------------------------------
# hash forms shared by the decoders

_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_DEC = re.compile(r"[0-9]{1,20}")


def parse_hash_str(s: str) -> int:
    """``0x``/``0X`` hex, else decimal u64, else bare hex (the reference's FlexHash forms);
    else ValueError."""
    t = s.strip()
    if t[:2] in ("0x", "0X"):
        if _HEX.fullmatch(t[2:]):
            return int(t[2:], 16)
    else:
        if _DEC.fullmatch(t):
            v = int(t)
            if v <= MASK64:
                return v
        if _HEX.fullmatch(t):
            return int(t, 16)
    raise ValueError(f"invalid hash {s[:40]!r}: expected u64, hex, or 0x-prefixed")


def int_hash(h: int) -> int:
    """An integer hash as u64: negative i64 -> two's complement (the reference rejected them)."""
    if h < 0:
        if h < -(1 << 63):
            raise ValueError(f"hash {h} below int64")
        return h & MASK64
    if h > MASK64:
        raise ValueError(f"hash {h} above u64")
    return h


# ---------------------------------------------------------------------------------------
# vLLM / SGLang events


class Stored(msgspec.Struct, gc=False):
    """One ``BlockStored``: hashes are u64 (array('Q')), tokens u32 (array('I'))."""

    block_hashes: array
    parent: int | None
    tokens: array
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lora_id: object = None
    group_idx: object = None
    kind: str | None = None
    sliding_window: object = None
    locality: object = None
    ownership: object = None
    session_id: object = None
    #: Precomputed LocalBlockHashes, one per block (``tokens_hashes`` of TensorRT-LLM's
    #: ZeroMQ tee), when the event carries them instead of token ids; else None.
    local_hashes: array | None = None

    def __repr__(self) -> str:
        return (
            f"Stored(hashes={list(self.block_hashes)}, parent={self.parent}, "
            f"tokens={list(self.tokens)}, block_size={self.block_size}, medium={self.medium!r}, "
            f"lora_name={self.lora_name!r}, group_idx={self.group_idx}, kind={self.kind!r})"
        )


class Removed(msgspec.Struct, gc=False):
    """One ``BlockRemoved``."""

    block_hashes: array
    medium: str | None = None
    group_idx: object = None

    def __repr__(self) -> str:
        return f"Removed(hashes={list(self.block_hashes)}, medium={self.medium!r})"


class Cleared(msgspec.Struct, gc=False):
    """``AllBlocksCleared``."""


class Dropped(msgspec.Struct, gc=False):
    """An event that could not be used; ``reason`` is counted by the caller."""

    reason: str
    detail: str = ""

    def __repr__(self) -> str:
        return f"Dropped({self.reason!r}, {self.detail!r})"


class VllmBatch(msgspec.Struct):
    """A decoded batch: ``events`` holds Stored/Removed/Cleared/Dropped in wire order."""

    ts: float | int
    dp_rank: int | None
    events: list  # Stored | Removed | Cleared | Dropped (VllmEvent)
    layout: str  # "ts,events,dp" | "ts,events" | "ts,dp,events"


#: One decoded vLLM/SGLang event.
VllmEvent = Stored | Removed | Cleared | Dropped


# ---------------------------------------------------------------------------------------
# pool events

STORED, REMOVED, CLEARED, OTHER = "stored", "removed", "cleared", "other"


class PoolEvent(msgspec.Struct, gc=False):
    """One decoded pool event. ``hashes`` = seq_hashes then block_hashes, de-duplicated."""

    event_id: object
    kind: str
    type_str: str
    model_name: str | None
    tenant_id: str | None
    backend_id: str | None
    medium: str | None
    dp_rank: int | None
    hashes: list[int]
    lora_name: str | None = None

    def __repr__(self) -> str:
        return (
            f"PoolEvent({self.kind}, backend_id={self.backend_id!r}, medium={self.medium!r}, "
            f"dp={self.dp_rank}, hashes={self.hashes}, model={self.model_name!r})"
        )


class PoolBatch(msgspec.Struct):
    ts: object
    dp_rank: int | None
    events: list  # PoolEvent | Dropped
    layout: str  # "tuple" | "memcache"
