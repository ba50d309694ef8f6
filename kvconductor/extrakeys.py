"""The extra keys of a query (docs/api.md, "Block hashing", "Extra keys"): ``cache_salt``
and ``mm_inputs`` of a ``/query``, ``/query_by_hash`` or Mooncake ``/query`` body, read
only when the parser saw one of them not null (:func:`parse_extras`), and the blocks'
local hashes with them mixed in as the index's events mixed vLLM's ``extra_keys``
(:func:`extra_local_hashes`). A query without them never comes here: its answer is
today's, byte for byte.
"""

from __future__ import annotations

from array import array
from typing import Annotated, NamedTuple

import msgspec
from msgspec import Meta

from kvconductor._hash import hash_blocks, mix_extra, query_extra_digests

__all__ = ["MM_INPUTS_MAX", "ExtraKeysError", "MmInput", "QueryExtras", "extra_local_hashes"]
__all__ += ["parse_extras", "salted_local_hashes"]

#: At most this many ``mm_inputs`` in one query.
MM_INPUTS_MAX = 4096


class MmInput(msgspec.Struct, forbid_unknown_fields=True):
    """One multimodal input of a query (``mm_inputs``; its field ``mm_inputs`` in
    ``kvconductor.schema``): its content hash ``identifier`` (vLLM's
    ``MultiModalFeatureSpec.identifier``, the mm hash) and its placeholder tokens,
    ``length`` tokens from token ``offset`` (``mm_position``)."""

    identifier: Annotated[str, Meta(min_length=1, max_length=1024)]
    offset: Annotated[int, Meta(ge=0, le=2**32 - 1)]
    length: Annotated[int, Meta(ge=1, le=2**32 - 1)]


class ExtraKeysError(ValueError):
    """Extra keys that cannot be read or used (a 400: the detail of the answer)."""


class QueryExtras(NamedTuple):
    """A query's extra keys: its salt (None: none) and its multimodal inputs as
    ``(identifier, offset, length)`` in offset order (never overlapping)."""

    cache_salt: str | None
    mm_inputs: tuple[tuple[str, int, int], ...]


class _Map(msgspec.Struct):
    cache_salt: str | None = None
    mm_inputs: list[MmInput] | None = None


_JSON = msgspec.json.Decoder(_Map)
_MSGPACK = msgspec.msgpack.Decoder(_Map)
_RAWS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_SALT = msgspec.msgpack.Decoder(str | None)
_MM = msgspec.msgpack.Decoder(list[MmInput] | None)
#: Positions of ``cache_salt`` and ``mm_inputs`` in the positional MessagePack form.
_SALT_AT, _MM_AT = 8, 9


def _decode(body: bytes, msgpack: bool) -> tuple[str | None, list[MmInput] | None]:
    if not msgpack:
        m = _JSON.decode(body)
        return m.cache_salt, m.mm_inputs
    if body[:1] and (0x90 <= body[0] <= 0x9F or body[0] in (0xDC, 0xDD)):
        raws = _RAWS.decode(body)
        salt = _SALT.decode(raws[_SALT_AT]) if len(raws) > _SALT_AT else None
        mm = _MM.decode(raws[_MM_AT]) if len(raws) > _MM_AT else None
        return salt, mm
    m = _MSGPACK.decode(body)
    return m.cache_salt, m.mm_inputs


def parse_extras(body: bytes | bytearray | memoryview, msgpack: bool) -> QueryExtras | None:
    """The ``cache_salt`` (a string or null) and ``mm_inputs`` (null or an array of
    ``{identifier, offset, length}``, at most :data:`MM_INPUTS_MAX`, no two overlapping) of
    a query body the parser has read already; None when neither carries anything (an
    empty salt, an empty array: what vLLM does not hash either). :class:`ExtraKeysError`."""
    try:
        salt, mm = _decode(bytes(body), msgpack)
    except msgspec.DecodeError as ex:
        raise ExtraKeysError(str(ex)) from None
    except RecursionError:
        raise ExtraKeysError("nesting too deep") from None
    inputs = sorted(((m.identifier, m.offset, m.length) for m in mm or ()), key=lambda t: t[1])
    if len(inputs) > MM_INPUTS_MAX:
        raise ExtraKeysError(f"mm_inputs: at most {MM_INPUTS_MAX} inputs")
    for a, b in zip(inputs, inputs[1:], strict=False):
        if b[1] < a[1] + a[2]:
            raise ExtraKeysError(
                f"mm_inputs: {a[0]!r} at {a[1]} (length {a[2]}) overlaps {b[0]!r} at {b[1]}"
            )
    if not salt and not inputs:
        return None
    return QueryExtras(salt or None, tuple(inputs))


def extra_local_hashes(
    values: array, block_size: int, seed: int, extras: QueryExtras, by_hash: bool
) -> array:
    """The query's local hashes with each block's extra keys mixed in: ``values`` are its
    token ids (hashed with ``block_size`` and ``seed``) or, ``by_hash``, its blocks'
    LocalBlockHashes, each ``block_size`` tokens (needed then: :class:`ExtraKeysError`)."""
    if block_size < 1:
        raise ExtraKeysError("block_size must be >= 1 with cache_salt or mm_inputs")
    if by_hash:
        local, n_tokens = values, len(values) * block_size
    else:
        local, n_tokens = hash_blocks(values, block_size, seed), len(values)
    digests = query_extra_digests(n_tokens, block_size, extras.cache_salt, extras.mm_inputs)
    return mix_extra(local, digests, seed)


def salted_local_hashes(tokens: array, block_size: int, seed: int, salt: str) -> array:
    """The local hashes of ``tokens`` (hashed with ``block_size`` and ``seed``) with
    ``salt`` mixed into the first block's, as vLLM mixes a request's ``cache_salt``: the
    ``cache_salt`` of the Mooncake and Dynamo dialects' ``/query`` (no ``mm_inputs``)."""
    return extra_local_hashes(tokens, block_size, seed, QueryExtras(salt, ()), False)
