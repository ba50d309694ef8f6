"""The compiled fast path on a DP with live predictions (``kvconductor.predict``).

The general path reports every event of a predicted DP to its predictions as it applies
it (:meth:`~kvconductor.index.Index.note_write`): a store that succeeded confirms the
predictions its HBM worker then holds whole, the first removal or clear contradicts all
that are left (and none is left for the events after it). :func:`apply_reported` applies
a parsed :class:`~kvconductor._ingest.FastBatch` in C and reports the same: while the DP
has predictions, its stores one at a time (a store may move a block under another parent,
so what a worker holds is checked after each, as the general path does), up to the first
removal or clear; then the rest at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvconductor._ingest import FastBatch
from kvconductor.index import Index
from kvconductor.keys import WorkerKey

__all__ = ["apply_reported"]


def apply_reported(
    fb: FastBatch, index: Index, wid: int, clear: Sequence[int], key: WorkerKey
) -> tuple[int, int, int, int]:
    """``fb.apply`` on ``index`` (``wid``: ``key``'s HBM worker), the predictions of
    ``key``'s DP (if any) told what the general path would tell them; ``fb.apply``'s
    result."""
    core = index.core
    if not index.predicted or (key.instance_id, key.dp_rank) not in index.predicted:
        return fb.apply(core, wid, clear)
    group = (key.instance_id, key.dp_rank)
    got = [0, 0, 0, 0]
    while fb.nrecords:
        if group not in index.predicted:  # none left to tell: the rest at once
            part = fb.apply(core, wid, clear)
        elif fb.leading_stores:  # a store: one at a time (a store may move blocks)
            part = fb.apply(core, wid, clear, 1 if fb.nrecords > 1 else -1)
            if not any(part[1:]):  # it succeeded: what its worker holds now confirms
                index.note_write(key, True)
        else:  # the first removal or clear: every one left goes
            index.note_write(key, False)
            part = fb.apply(core, wid, clear)
        got = [a + b for a, b in zip(got, part, strict=True)]
    return got[0], got[1], got[2], got[3]
