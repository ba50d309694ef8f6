"""Which kind of payload a ZeroMQ message carries, decided in one pass over its envelope
(docs/events.md, "Payload recognition"), then decoded once by that kind's decoder.

* msgpack **map** at the top: a Memcache MetaService batch ``{"events": [...]}``
  (:func:`~kvconductor.ingest.pool.decode_memcache`);
* msgpack **array**: its elements are split once (``[ts, events, dp]``,
  ``[ts, events]``, ``[ts, dp, events]``, :func:`~kvconductor.ingest.vllm.split_batch`)
  and the first event of the events element names the kind: a map with a pool key
  (``event_type``, ``seq_hashes``, ``backend_id``, ``event_id``), without ``type`` or
  with a ``type`` that is no vLLM tag is a **pool tuple** (Mooncake master, YuanRong
  ports: :func:`~kvconductor.ingest.pool.decode_pool_payload`); anything else is a
  **vLLM/SGLang batch** (:func:`~kvconductor.ingest.vllm.decode_vllm_batch`, handed the
  split envelope so nothing is read twice);
* anything else, or an empty payload: :class:`~kvconductor.ingest.ops.DecodeError`.

The compiled fast path of engine HBM sources (``kvconductor._ingest.FastBatch``, run
by :class:`~kvconductor.ingest.apply.Applier` before this module) is the decoder of one
kind only, vLLM/SGLang batches of HBM blocks in their plain forms; what it does not take
comes here.
"""

from __future__ import annotations

import msgspec

from kvconductor.ingest.ops import KNOWN_TAGS, DecodeError, PoolBatch, VllmBatch, msgpack_kind
from kvconductor.ingest.pool import decode_memcache, decode_pool_payload
from kvconductor.ingest.vllm import decode_vllm_batch, split_batch

#: Keys only a pool event has (``kvconductor._ingest.POOL_KEYS`` is the same set).
_POOL_KEYS = ("event_type", "seq_hashes", "backend_id", "event_id")
_ANY_DEC = msgspec.msgpack.Decoder()
_KEYS_DEC = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_RAW_LIST_DEC = msgspec.msgpack.Decoder(list[msgspec.Raw])


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


def decode_payload(payload: bytes) -> VllmBatch | PoolBatch:
    """Recognise one payload's kind and decode it with that kind's decoder.

    Raises DecodeError (reasons: ``empty_payload``, ``undecodable``, ``not_a_batch``,
    ``invalid_batch``).
    """
    if not payload:
        raise DecodeError("empty_payload")
    top = msgpack_kind(payload[0])
    if top == "map":
        try:
            obj = _ANY_DEC.decode(payload)
        except Exception as ex:
            raise DecodeError("undecodable", str(ex)) from None
        return decode_memcache(obj)
    if top != "array":
        raise DecodeError("not_a_batch", f"payload is a msgpack {top}")
    parts = split_batch(payload)
    try:  # once, for the kind and for the vLLM decoder
        raw_events: list[msgspec.Raw] | None = _RAW_LIST_DEC.decode(parts[0][parts[1]])
    except Exception:
        raw_events = None
    if raw_events is not None and _looks_like_pool(raw_events):
        return decode_pool_payload(payload)
    return decode_vllm_batch(payload, parts, raw_events)
