"""What a ZeroMQ payload carries, recognised first and cheaply, then decoded once by the
decoder of that kind (docs/events.md, "Payload recognition").

:func:`recognize` reads the top byte, the envelope and the first event's kind:

* msgpack **map** at the top: a Memcache MetaService batch ``{"events": [...]}``
  (:data:`MEMCACHE`, :func:`~kvconductor.ingest.pool.decode_memcache`);
* msgpack **array**: its envelope (``[ts, events, dp]``, ``[ts, events]``,
  ``[ts, dp, events]``, :func:`~kvconductor.ingest.vllm.split_batch`) and the first event
  of the events element name the kind: a map with a pool key (``event_type``,
  ``seq_hashes``, ``backend_id``, ``event_id``), without ``type`` or with a ``type``
  that is no vLLM tag is a **pool tuple** (:data:`POOL`: Mooncake master, YuanRong ports);
  anything else is a **vLLM/SGLang batch** (:data:`VLLM`), and so is an array whose
  envelope is bad (its decoder reports why);
* anything else, or an empty payload: :class:`~kvconductor.ingest.ops.DecodeError`.

The compiled reader (``kvconductor._ingest.array_payload_kind``) tells the array kinds
without decoding anything, and stops at the first event's vLLM tag (the first key of a
map event as vLLM writes it: :attr:`Recognized.by_tag`; the fast path refuses the pool
keys and repeated keys the rest could hold, and :func:`decode` reads the rest before it
picks a decoder); :func:`_python_kind`, its twin, decides when it cannot (ext values,
deep nesting, a pool verdict hanging on a non-ASCII key) and when
``KVCONDUCTOR_IMPL=py``, keeping the envelope it split and the events it read for the
decoder. :func:`decode` then runs the one decoder of the kind, handed what recognition
already read: :func:`~kvconductor.ingest.vllm.decode_vllm_batch` (the split envelope and
the raw events), :func:`~kvconductor.ingest.pool.decode_pool_events` (the raw events) or
:func:`~kvconductor.ingest.pool.decode_pool_tuple` (the payload, decoded once). On an
engine's HBM source the compiled fast path (``kvconductor._ingest.FastBatch``) is the
vLLM decoder of :class:`~kvconductor.ingest.apply.Applier`; what it declines comes to
:func:`decode` with its kind already known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

import kvconductor
from kvconductor._ingest import (
    PAYLOAD_POOL,
    PAYLOAD_UNSURE,
    PAYLOAD_VLLM,
    PAYLOAD_VLLM_TAG,
    array_payload_kind,
)
from kvconductor.ingest.ops import KNOWN_TAGS, DecodeError, PoolBatch, VllmBatch, msgpack_kind
from kvconductor.ingest.pool import decode_memcache, decode_pool_events, decode_pool_tuple
from kvconductor.ingest.vllm import decode_vllm_batch, split_batch

#: The kinds :func:`recognize` names (the compiled reader's codes, and one of its own).
VLLM, POOL, MEMCACHE = PAYLOAD_VLLM, PAYLOAD_POOL, 3

#: Keys only a pool event has (``kvconductor._ingest.POOL_KEYS`` is the same set).
_POOL_KEYS = ("event_type", "seq_hashes", "backend_id", "event_id")
_ANY_DEC = msgspec.msgpack.Decoder()
_KEYS_DEC = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_RAW_LIST_DEC = msgspec.msgpack.Decoder(list[msgspec.Raw])

#: The compiled array reader; ``None`` (the Python reader only) when ``KVCONDUCTOR_IMPL=py``.
_array_kind: Callable[[bytes, bool], int] | None = (
    None if kvconductor.IMPL == "py" else array_payload_kind
)


@dataclass(slots=True, frozen=True)
class Recognized:
    """A payload's kind, and what the Python reader already read of it (the split
    envelope of :func:`~kvconductor.ingest.vllm.split_batch` and the raw events), for
    the decoder; ``None`` where nothing was read in Python."""

    kind: int
    parts: tuple[list[msgspec.Raw], int, int | None] | None = None
    raw_events: list[msgspec.Raw] | None = None
    #: VLLM read from the first event's tag, the rest of that event unread: what the
    #: compiled fast path takes is a vLLM batch (it refuses pool keys and repeated
    #: keys); for anything else :func:`decode` reads the first event to its end.
    by_tag: bool = False


_BY_C = {
    VLLM: Recognized(VLLM),
    POOL: Recognized(POOL),
    PAYLOAD_VLLM_TAG: Recognized(VLLM, by_tag=True),
}
_MAP = Recognized(MEMCACHE)


def _looks_like_pool(events: list[msgspec.Raw]) -> bool:
    """The first event of an array payload names a pool tuple (module docstring)."""
    if not events:
        return False
    first = events[0]
    if msgpack_kind(memoryview(first)[0]) != "map":
        return False
    try:
        keys = _KEYS_DEC.decode(first)
    except Exception:
        return False
    if any(k in keys for k in _POOL_KEYS):
        return True
    t = keys.get("type")
    if t is None:
        return True
    try:
        return _ANY_DEC.decode(t) not in KNOWN_TAGS
    except Exception:
        return True


def _python_kind(payload: bytes) -> Recognized:
    """The array payload's kind read in Python (the compiled reader's twin)."""
    try:
        parts = split_batch(payload)
    except DecodeError:
        return _BY_C[VLLM]  # the vLLM decoder splits again and says why
    try:
        raw_events: list[msgspec.Raw] | None = _RAW_LIST_DEC.decode(parts[0][parts[1]])
    except Exception:
        raw_events = None
    if raw_events is not None and _looks_like_pool(raw_events):
        return Recognized(POOL, parts, raw_events)
    return Recognized(VLLM, parts, raw_events)


def _array(payload: bytes, whole: bool) -> Recognized:
    if _array_kind is not None:
        k = _array_kind(payload, whole)
        if k != PAYLOAD_UNSURE:
            return _BY_C[k]
    return _python_kind(payload)


def recognize(payload: bytes) -> Recognized:
    """The payload's kind (module docstring). Raises DecodeError (``empty_payload``,
    ``not_a_batch``)."""
    if not payload:
        raise DecodeError("empty_payload")
    top = msgpack_kind(payload[0])
    if top == "array":
        return _array(payload, False)
    if top == "map":
        return _MAP
    raise DecodeError("not_a_batch", f"payload is a msgpack {top}")


def _decode_whole(payload: bytes) -> object:
    try:
        return _ANY_DEC.decode(payload)
    except Exception as ex:
        raise DecodeError("undecodable", str(ex)) from None


def decode(payload: bytes, rec: Recognized) -> VllmBatch | PoolBatch:
    """Decode ``payload`` with the decoder of its kind ``rec``, once. Raises DecodeError
    (reasons: ``undecodable``, ``not_a_batch``, ``invalid_batch``)."""
    if rec.by_tag:
        rec = _array(payload, True)
    if rec.kind == VLLM:
        return decode_vllm_batch(payload, rec.parts, rec.raw_events)
    if rec.kind == MEMCACHE:
        return decode_memcache(_decode_whole(payload))
    if rec.parts is not None and rec.raw_events is not None:
        return decode_pool_events(payload, rec.parts, rec.raw_events)
    try:  # recognised by the compiled reader: decoded here, whole
        obj = _ANY_DEC.decode(payload)
    except Exception as ex:
        split_batch(payload)  # a bad envelope keeps its own reason
        raise DecodeError("undecodable", str(ex)) from None
    return decode_pool_tuple(obj)


def decode_payload(payload: bytes) -> VllmBatch | PoolBatch:
    """Recognise one payload's kind and decode it with that kind's decoder.

    Raises DecodeError (reasons: ``empty_payload``, ``undecodable``, ``not_a_batch``,
    ``invalid_batch``).
    """
    return decode(payload, recognize(payload))
