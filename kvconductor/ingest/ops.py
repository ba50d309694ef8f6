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


class Stored:
    """One ``BlockStored``: hashes are u64 (array('Q')), tokens u32 (array('I'))."""

    __slots__ = (
        "block_hashes",
        "parent",
        "tokens",
        "block_size",
        "medium",
        "lora_name",
        "lora_id",
        "group_idx",
        "kind",
        "sliding_window",
        "locality",
        "ownership",
        "session_id",
        "local_hashes",
    )

    def __init__(
        self,
        block_hashes,
        parent,
        tokens,
        block_size,
        medium=None,
        lora_name=None,
        lora_id=None,
        group_idx=None,
        kind=None,
        sliding_window=None,
        locality=None,
        ownership=None,
        session_id=None,
        local_hashes=None,
    ) -> None:
        self.block_hashes = block_hashes
        self.parent = parent
        self.tokens = tokens
        self.block_size = block_size
        self.medium = medium
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.group_idx = group_idx
        self.kind = kind
        self.sliding_window = sliding_window
        self.locality = locality
        self.ownership = ownership
        self.session_id = session_id
        #: Precomputed LocalBlockHashes, one per block (``tokens_hashes`` of TensorRT-LLM's
        #: ZeroMQ tee), when the event carries them instead of token ids; else None.
        self.local_hashes = local_hashes

    def __repr__(self) -> str:
        return (
            f"Stored(hashes={list(self.block_hashes)}, parent={self.parent}, "
            f"tokens={list(self.tokens)}, block_size={self.block_size}, medium={self.medium!r}, "
            f"lora_name={self.lora_name!r}, group_idx={self.group_idx}, kind={self.kind!r})"
        )


class Removed:
    """One ``BlockRemoved``."""

    __slots__ = ("block_hashes", "medium", "group_idx")

    def __init__(self, block_hashes, medium=None, group_idx=None) -> None:
        self.block_hashes = block_hashes
        self.medium = medium
        self.group_idx = group_idx

    def __repr__(self) -> str:
        return f"Removed(hashes={list(self.block_hashes)}, medium={self.medium!r})"


class Cleared:
    """``AllBlocksCleared``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Cleared()"


class Dropped:
    """An event that could not be used; ``reason`` is counted by the caller."""

    __slots__ = ("reason", "detail")

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail

    def __repr__(self) -> str:
        return f"Dropped({self.reason!r}, {self.detail!r})"


class VllmBatch:
    """A decoded batch: ``events`` holds Stored/Removed/Cleared/Dropped in wire order."""

    __slots__ = ("ts", "dp_rank", "events", "layout")

    def __init__(self, ts, dp_rank, events, layout) -> None:
        self.ts = ts
        self.dp_rank = dp_rank
        self.events = events
        self.layout = layout  # "ts,events,dp" | "ts,events" | "ts,dp,events"


#: One decoded vLLM/SGLang event.
VllmEvent = Stored | Removed | Cleared | Dropped


# ---------------------------------------------------------------------------------------
# pool events

STORED, REMOVED, CLEARED, OTHER = "stored", "removed", "cleared", "other"


class PoolEvent:
    """One decoded pool event. ``hashes`` = seq_hashes then block_hashes, de-duplicated."""

    __slots__ = (
        "event_id",
        "kind",
        "type_str",
        "model_name",
        "tenant_id",
        "backend_id",
        "medium",
        "dp_rank",
        "hashes",
        "lora_name",
    )

    def __init__(
        self,
        event_id,
        kind,
        type_str,
        model_name,
        tenant_id,
        backend_id,
        medium,
        dp_rank,
        hashes,
        lora_name=None,
    ) -> None:
        self.lora_name = lora_name
        self.event_id = event_id
        self.kind = kind
        self.type_str = type_str
        self.model_name = model_name
        self.tenant_id = tenant_id
        self.backend_id = backend_id
        self.medium = medium
        self.dp_rank = dp_rank
        self.hashes = hashes

    def __repr__(self) -> str:
        return (
            f"PoolEvent({self.kind}, backend_id={self.backend_id!r}, medium={self.medium!r}, "
            f"dp={self.dp_rank}, hashes={self.hashes}, model={self.model_name!r})"
        )


class PoolBatch:
    __slots__ = ("ts", "dp_rank", "events", "layout")

    def __init__(self, ts, dp_rank, events, layout) -> None:
        self.ts = ts
        self.dp_rank = dp_rank
        self.events = events
        self.layout = layout  # "tuple" | "memcache"
