"""Pure-Python twins of ``kvconductor._hash`` (test oracles): ``split_chunk_hashes``, the
engine hashes kvconductor gives the registered blocks of a store-only source's chunk
(docs/api.md, "Store-only sources"); ``chain_hashes``, a chain's prefix hashes (a
router's predicted blocks, ``kvconductor.predict``); the extra keys of a block
(``extra_digest``, ``mix_extra``, ``query_extra_digests``; docs/api.md, "Block hashing")
and of a vLLM event (``event_extra_digests``, the twin of
``kvconductor._ingest.extra_key_digests``)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from xxhash import xxh3_64_intdigest

_M64 = 0xFFFFFFFFFFFFFFFF
_PAIR = struct.Struct("<QQ")


def sub_block_hash(h: int, j: int) -> int:
    """The engine hash of block ``j`` (not the last) of a chunk announced under the one
    hash ``h``: splitmix64 of ``h + (j + 1) * golden``. The chunk's last block keeps ``h``
    itself, so that the next chunk, whose parent is ``h``, links on."""
    x = (h + (j + 1) * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def split_chunk_hashes(hashes: Iterable[int], k: int) -> array:
    """Per chunk hash ``h``: ``sub_block_hash(h, 0 .. k-2)``, then ``h``."""
    out = array("Q")
    if k <= 0:
        return out
    for h in hashes:
        out.extend(sub_block_hash(h, j) for j in range(k - 1))
        out.append(h)
    return out


# -- extra keys -----------------------------------------------------------------------------

_MM, _SALT, _EMBEDS = 0x6D, 0x73, 0x65


def pair_hash(a: int, b: int, seed: int) -> int:
    """XXH3-64 of ``a`` and ``b`` as 16 little-endian bytes."""
    return xxh3_64_intdigest(_PAIR.pack(a & _M64, b & _M64), seed)


def _item(kind: str, value: str | bytes, offset: int = 0) -> int:
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if kind == "mm":
        return pair_hash(xxh3_64_intdigest(data, _MM), offset, _MM)
    return xxh3_64_intdigest(data, _SALT if kind == "salt" else _EMBEDS)


def extra_digest(items: Iterable[tuple]) -> int:
    """A block's digest: its items folded in order, ``d = pair_hash(d, item, 0)`` from 0
    (a fold that gives 0 gives 1); 0 for no items."""
    d = 0
    for it in items:
        if it[0] not in ("mm", "salt", "embeds"):
            raise ValueError(f"unknown extra key kind {it[0]!r}")
        d = pair_hash(d, _item(it[0], it[1], it[2] if it[0] == "mm" else 0), 0) or 1
    return d


def mix_extra(local_hashes: Iterable[int], digests: Sequence[int], seed: int = 1337) -> array:
    """Each hash with its block's digest mixed in: ``pair_hash(local, digest, seed)``."""
    out = array("Q", local_hashes)
    for i in range(min(len(out), len(digests))):
        if digests[i]:
            out[i] = pair_hash(out[i], digests[i], seed)
    return out


def query_extra_digests(
    n_tokens: int, block_size: int, cache_salt: str | None = None, mm_inputs: Iterable = ()
) -> array:
    """Per block of a query: vLLM's ``generate_block_hash_extra_keys`` (without the LoRA
    key), written as "every input overlapping the block, in offset order", then the salt
    on block 0."""
    nb = 0 if block_size <= 0 else -(-n_tokens // block_size)
    feats = sorted(mm_inputs, key=lambda f: f[1])
    out = array("Q")
    for b in range(nb):
        start, end = b * block_size, (b + 1) * block_size
        items: list[tuple] = [
            ("mm", ident, off - start) for ident, off, n in feats if off < end and start < off + n
        ]
        if b == 0 and cache_salt:
            items.append(("salt", cache_salt))
        out.append(extra_digest(items))
    return out


_ENTRY = msgspec.msgpack.Decoder(list[Any] | None)


def event_extra_digests(raw: bytes, lora_name: str | None, nblocks: int) -> array | None:
    """The digests of a vLLM ``BlockStored``'s ``extra_keys`` (msgpack bytes), one per
    block; None when it carries none. ``ValueError`` for a shape that is not vLLM's: not
    nil nor an array of ``nblocks`` entries, an entry not nil nor an array, an item not a
    string (cache_salt; the LoRA name when it is the first item and equals ``lora_name``),
    an ``[identifier, offset]`` pair or a bin (prompt-embeds digest)."""
    try:
        value = _ENTRY.decode(raw)
    except (msgspec.DecodeError, RecursionError) as ex:
        raise ValueError(f"extra_keys: {ex}") from None
    if value is None:
        return None
    if len(value) != nblocks:
        raise ValueError(f"extra_keys has {len(value)} entries for {nblocks} blocks")
    out = array("Q")
    for entry in value:
        if entry is None:
            out.append(0)
            continue
        if not isinstance(entry, list):
            raise ValueError(f"an extra_keys entry is {type(entry).__name__}")
        items: list[tuple] = []
        for k, it in enumerate(entry):
            if isinstance(it, str):
                if k == 0 and lora_name and it == lora_name:
                    continue
                items.append(("salt", it))
            elif isinstance(it, bytes):
                items.append(("embeds", it))
            elif (
                isinstance(it, list)
                and len(it) == 2
                and isinstance(it[0], str)
                and type(it[1]) is int
                and -(2**63) <= it[1] < 2**64
            ):
                items.append(("mm", it[0], it[1]))
            else:
                raise ValueError(f"an extra key of unknown shape: {it!r}"[:120])
        out.append(extra_digest(items))
    return out if any(out) else None


def chain_hashes(local_hashes: Iterable[int], seed: int) -> array:
    """``c[i] = XXH3-64(c[i-1] || local[i], seed)`` (u64 LE, ``c[-1] = 0``)."""
    out = array("Q")
    prev = 0
    for h in local_hashes:
        prev = pair_hash(prev, h, seed)
        out.append(prev)
    return out
