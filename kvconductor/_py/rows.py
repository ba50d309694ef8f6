"""The answer of one query and the index's group names: pure-Python twins of
``kvconductor._index.MatchRows`` and ``kvconductor._encode.GroupNames`` (the test oracle).

``MatchRows``'s answer forms (``scores``, ``tuples``, ``hits``, ``v3``; docs/api.md,
"Reading an answer in Python") are written here from their definition, one row at a time;
the compiled ones (``_index_answers.pxi``) build the same objects in C.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from operator import index
from typing import Any

from kvconductor.schema import DP_MATCH_KEYS, INSTANCE_MATCH_KEYS

_LONGEST, _DP = INSTANCE_MATCH_KEYS
_MATCHED, _NPU, _CPU, _DISK = DP_MATCH_KEYS

U32_MAX = 2**32 - 1
U64_MASK = 2**64 - 1


class MatchRows:
    """Twin of ``kvconductor._index.MatchRows``: the rows ``(group, npu, cpu, disk)`` of one
    answer by increasing group, here a plain list of tuples."""

    __slots__ = ("_rows", "omitted")

    def __init__(self, rows=()) -> None:
        out = []
        prev = -1
        for row in rows:
            g, a, b, c = (int(v) for v in row)
            for v in (g, a, b, c):
                if not 0 <= v <= U32_MAX:
                    raise OverflowError(f"MatchRows: {v} is not a u32")
            if g <= prev:
                raise ValueError("MatchRows: group ids must strictly increase")
            prev = g
            out.append((g, a, b, c))
        self._rows = out
        #: rows tied at the cut depth of ``select(top_k=...)`` that it left out
        self.omitted = 0

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"MatchRows({self._rows!r})"

    def tolist(self) -> list[tuple[int, int, int, int]]:
        return list(self._rows)

    def sums(self) -> tuple[int, int, int]:
        return (
            sum(r[1] for r in self._rows),
            sum(r[2] for r in self._rows),
            sum(r[3] for r in self._rows),
        )

    def last_group(self) -> int:
        return self._rows[-1][0] if self._rows else -1

    def select(
        self,
        top_k: int | None = None,
        groups: bytes | None = None,
        seed: int = 0,
        ranks: Sequence[int] | None = None,
    ) -> MatchRows:
        """Same rule as the compiled one, by sorting: the masks first, then every row
        deeper than the ``top_k``-th largest total, and of the rows tied at that depth
        the first by (rank, order) with ``ranks``, else a rotation from ``mix64(seed)``."""
        rows = self._rows
        omitted = 0
        if groups is not None:
            rows = [r for r in rows if r[0] < len(groups) and groups[r[0]]]
        if ranks is not None:
            rows = [r for r in rows if r[0] < len(ranks) and ranks[r[0]]]
        if top_k is not None:
            if top_k < 1:
                raise ValueError(f"top_k must be at least 1, not {top_k}")
            if top_k < len(rows):
                depth = [r[1] + r[2] + r[3] for r in rows]
                kth = sorted(depth, reverse=True)[top_k - 1]
                tied = [i for i, d in enumerate(depth) if d == kth]
                need = top_k - sum(d > kth for d in depth)
                if ranks is not None:
                    keep = sorted(tied, key=lambda i: (ranks[rows[i][0]], i))[:need]
                else:
                    start = mix64(seed & U64_MASK) % len(tied)
                    keep = (tied + tied)[start : start + need]
                omitted = len(tied) - need
                kept = set(keep)
                rows = [r for i, r in enumerate(rows) if depth[i] > kth or i in kept]
        out = MatchRows()
        out._rows = list(rows)
        out.omitted = omitted
        return out

    # -- the answer as Python objects; ``names``: ``keys`` (group id -> (instance_id,
    # dp_rank)) and ``dp_keys`` (group id -> str(dp_rank)), as ``PyGroupNames`` has them
    def scores(self, names: Any) -> dict[tuple[str, int], int]:
        """``{(instance_id, dp_rank): npu + cpu + disk}``."""
        keys = _named(self._rows, names.keys)
        return {keys[g]: n + c + d for g, n, c, d in self._rows}

    def tuples(self, names: Any) -> list[tuple[Any, ...]]:
        """``[(instance_id, dp_rank, npu, cpu, disk)]`` in row order."""
        keys = _named(self._rows, names.keys)
        return [(keys[g][0], keys[g][1], n, c, d) for g, n, c, d in self._rows]

    def hits(self, names: Any, cls: type) -> list[Any]:
        """:meth:`tuples` as ``cls`` instances (a tuple subclass adding no field)."""
        if cls is not tuple and not (
            isinstance(cls, type)
            and issubclass(cls, tuple)
            and cls.__basicsize__ == tuple.__basicsize__
            and cls.__itemsize__ == tuple.__itemsize__
            and cls.__dictoffset__ == 0
        ):
            raise TypeError(f"{cls!r} is not a tuple subclass of the tuple's own layout")
        return [tuple.__new__(cls, row) for row in self.tuples(names)]

    def v3(self, names: Any, tenant: str, block_size: int) -> dict[str, Any]:
        """The V3 body (:func:`v3_body`) of the rows named by ``names``."""
        bs = index(block_size)
        if bs < 0:
            raise ValueError(f"block_size must be at least 0, not {bs}")
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
        keys = _named(self._rows, names.keys)
        dp_keys = _named(self._rows, names.dp_keys)
        return v3_body(((keys[g][0], dp_keys[g], n, c, d) for g, n, c, d in self._rows), tenant, bs)


def mix64(x: int) -> int:
    """SplitMix64's finaliser (the compiled ``_mix64``): where the rotation of ties starts."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64_MASK
    return x ^ (x >> 31)


class PyGroupNames:
    """Twin of ``kvconductor._encode.GroupNames`` for the pure-Python path: the names
    only (the msgspec encoder needs no pre-encoded bytes)."""

    __slots__ = ("keys", "dp_keys", "_inst")

    def __init__(self) -> None:
        self.keys: list[tuple[str, int]] = []
        #: group id -> ``str(dp_rank)``, the DP key of the V3 answer
        self.dp_keys: list[str] = []
        self._inst: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return 0

    def add(self, instance_id: str, dp_rank: int) -> int:
        if not isinstance(instance_id, str):
            raise TypeError(f"instance_id must be a str, not {type(instance_id).__name__}")
        g = len(self.keys)
        self.keys.append((instance_id, dp_rank))
        self.dp_keys.append(str(index(dp_rank)))
        self._inst.setdefault(instance_id, []).append(g)
        return g

    def instances_mask(self, instance_ids) -> bytes:
        out = bytearray(len(self.keys))
        for name in instance_ids:
            for g in self._inst.get(name, ()):
                out[g] = 1
        return bytes(out)

    def instances_rank(self, instance_ids) -> array:
        out = array("I", bytes(4 * len(self.keys)))
        for pos, name in reversed(list(enumerate(instance_ids))):
            for g in self._inst.get(name, ()):
                out[g] = pos + 1
        return out


def _named(rows: list[tuple[int, int, int, int]], table: Sequence[Any]) -> Sequence[Any]:
    """``table`` (by group id), checked to name every group of ``rows``."""
    if rows and rows[-1][0] >= len(table):
        raise IndexError(f"group {rows[-1][0]} has no name ({len(table)} named)")
    return table


def v3_body(
    rows: Iterable[tuple[str, str, int, int, int]], tenant: str, block_size: int
) -> dict[str, Any]:
    """The V3 response body ``{tenant: {instance: {...}}}`` of ``(instance_id, DP key,
    npu, cpu, disk)`` rows: instances in the order of their first row, DPs in row order,
    ``matched_tokens`` ``min(blocks * block_size, 2^32 - 1)``, ``longest_matched`` the
    largest of an instance's; keys of :mod:`kvconductor.schema`'s ``InstanceMatch`` and
    ``DpMatch``."""
    out: dict[str, Any] = {}
    for iid, dp, npu, cpu, disk in rows:
        matched = min((npu + cpu + disk) * block_size, U32_MAX)
        inst = out.get(iid)
        if inst is None:
            inst = out[iid] = {_LONGEST: 0, _DP: {}}
        inst[_DP][dp] = {
            _MATCHED: matched,
            _NPU: min(npu, U32_MAX),
            _CPU: min(cpu, U32_MAX),
            _DISK: min(disk, U32_MAX),
        }
        if matched > inst[_LONGEST]:
            inst[_LONGEST] = matched
    return {tenant: out}
