"""Pure-Python twins of ``kvconductor._hash.split_chunk_hashes`` (a test oracle): the engine
hashes kvconductor gives the registered blocks of a store-only source's chunk
(docs/api.md, "Store-only sources"), and of ``kvconductor._hash.chain_hashes``: a chain's
prefix hashes (a router's predicted blocks, ``kvconductor.predict``)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable

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


def chain_hashes(local_hashes: Iterable[int], seed: int) -> array:
    """``c[i] = XXH3-64(c[i-1] || local[i], seed)`` (u64 LE, ``c[-1] = 0``)."""
    out = array("Q")
    prev = 0
    pack = _PAIR.pack
    for h in local_hashes:
        prev = xxh3_64_intdigest(pack(prev, h), seed)
        out.append(prev)
    return out
