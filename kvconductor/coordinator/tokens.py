"""Token-id and block-hash encodings of the Coordinator client's query bodies."""

from __future__ import annotations

import array
import importlib
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["pack_tokens", "token_list", "hash_list"]

_U32 = "I" if array.array("I").itemsize == 4 else "L"
_LITTLE = sys.byteorder == "little"
_MASK32 = 0xFFFFFFFF


def _is_numpy(obj: Any) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "numpy"


def _u32_array(values: Iterable[int]) -> array.array:
    if not isinstance(values, (list, tuple)):
        values = list(values)
    try:
        return array.array(_U32, values)
    except OverflowError:
        return array.array(_U32, [int(v) & _MASK32 for v in values])


def _le_bytes(a: array.array) -> bytes:
    if not _LITTLE:
        a = array.array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _raw_u32(buf: bytes | bytearray | memoryview) -> bytes:
    data = bytes(buf)
    if len(data) % 4:
        raise ValueError(f"packed token buffer of {len(data)} bytes is not a multiple of 4")
    return data


def pack_tokens(tokens: Any) -> bytes:
    """Token ids as little-endian u32 bytes (each value truncated to its low 32 bits).

    Accepts a list/tuple of ints, ``array('I')`` (or any integer ``array``), a
    1-D numpy integer array (numpy is imported only if such an array is
    passed), an integer-format ``memoryview``, or bytes-like data with 1-byte
    items (``bytes``, ``bytearray``, ``memoryview`` of format ``B``), which is
    taken as already-packed u32 LE and must have a length multiple of 4.
    """
    if isinstance(tokens, (bytes, bytearray)):
        return _raw_u32(tokens)
    if isinstance(tokens, memoryview):
        if tokens.itemsize == 1 and tokens.format in ("B", "b", "c"):
            return _raw_u32(tokens)
        if _LITTLE and tokens.itemsize == 4 and tokens.format.lstrip("@=<") in ("I", "L"):
            return tokens.tobytes()
        tokens = tokens.tolist()
    if isinstance(tokens, array.array):
        if tokens.typecode == _U32:
            return _le_bytes(tokens)
        return _le_bytes(_u32_array(tokens.tolist()))
    if _is_numpy(tokens):
        np = importlib.import_module("numpy")  # optional dependency, only when given a numpy array
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(
                f"token array must be 1-D integer, got shape {arr.shape} dtype {arr.dtype}"
            )
        return arr.astype("<u4", copy=False).tobytes()
    return _le_bytes(_u32_array(tokens))


def token_list(tokens: Any) -> list[int]:
    """Token ids as a list of Python ints, for the unpacked JSON/msgpack array body.

    Same inputs as :func:`pack_tokens`; bytes-like input is read as packed u32 LE.
    Values are passed through unchanged (the server truncates to u32).
    """
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, (bytes, bytearray)) or (
        isinstance(tokens, memoryview) and tokens.itemsize == 1 and tokens.format in ("B", "b", "c")
    ):
        a = array.array(_U32)
        a.frombytes(_raw_u32(tokens))
        if not _LITTLE:
            a.byteswap()
        return a.tolist()
    if isinstance(tokens, (array.array, memoryview)) or _is_numpy(tokens):
        out = tokens.tolist()
        if not isinstance(out, list) or (out and isinstance(out[0], list)):
            raise TypeError("token ids must be one-dimensional")
        return out
    return [int(t) for t in tokens]


def hash_list(hashes: Any) -> list[int]:
    """Block hashes as a list of ints (the server takes no packed form for hashes)."""
    if isinstance(hashes, list):
        return hashes
    if isinstance(hashes, (array.array, memoryview)) or _is_numpy(hashes):
        return hashes.tolist()
    return [int(h) for h in hashes]
