"""The router's own recent decisions: predictions (docs/api.md, "POST /predict").

An engine publishes ``BlockStored`` only after prefill, so a burst of requests that share
a new prefix would be spread over many engines before the first event arrives. A router
that reports the (instance, DP) it chose for a prompt makes the index answer as if that
DP already held the prompt's full blocks in HBM, for a short time (the TTL).

**How a prediction is held.** Each (instance, DP) with predictions has one more HBM worker
in the index, :func:`predicted_key` (backend id :data:`PREDICTED_BACKEND`, which no
registration can name: it starts with a control character). Its blocks are the predicted
prompts' blocks, stored in the HBM tree under engine hashes of its own
(:func:`chain_hashes`, prefix-dependent, so two prompts that share a prefix share its
nodes). Because the worker belongs to the (instance, DP)'s group, the core's per-group
maximum *is* the merge: with ``p`` the predicted depth on a query's blocks and the
group's event reaches ``e0 <= e1 <= e2`` (HBM, then CPU, then Disk), the answer's reaches
are ``e0' = max(e0, p)``, ``e1' = max(e1, e0')``, ``e2' = max(e2, e1')``, i.e.
``npu = e0'``, ``cpu = e1' - e0'``, ``disk = e2' - e1'``: the row's total depth is
``max(event depth, p)`` and the predicted part counts as HBM ("will be in HBM"). A DP that
holds nothing yet gets a row. Queries pay nothing for this: no prediction, no cost; the
lower tiers never continue from a predicted block (their edges are keyed by the engines'
hashes, which the predicted ones are not).

**Lifetime** (the writer thread only, as every mutation): a prediction lives ``ttl``
seconds (swept at least every ``ttl / 8``); an HBM ``BlockStored`` of that (instance,
DP) whose worker then holds the whole predicted prefix confirms it (it goes: events now
say it), and a prediction such a worker already holds is confirmed at once (never held);
any removal or clear of a worker of that (instance, DP), its unregistration and a source
reset drop all of its predictions (contradicted). A muted DP's (its HBM sources down)
predicted worker is muted with it (:meth:`Predictions.add` mutes a new one; the liveness
policy mutes and unmutes every HBM worker of the DP). Over the bounds (``per_dp``
predictions per (instance, DP), ``total`` in all, ``blocks`` summed) the oldest go
(``dropped``), never an error; a prediction longer than ``blocks`` is not held. A block
several live predictions of one DP share is held until the last goes (reference counts
per predicted engine hash), so a dropped prediction leaves no trace.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvconductor import _hash
from kvconductor.keys import Medium, WorkerKey

__all__ = [
    "PREDICTED_BACKEND",
    "GroupPredictions",
    "Prediction",
    "PredictionLimits",
    "Predictions",
    "chain_hashes",
    "is_predicted",
    "predicted_key",
]

#: The backend id of an (instance, DP)'s predicted worker (never a registered backend:
#: registrations refuse control characters).
PREDICTED_BACKEND = "\x00predicted"
#: What becomes of predictions (``kvconductor_predictions_total{outcome}``): made, then
#: gone because events confirmed them, their TTL passed, a bound was reached, or a removal
#: or clear of their DP contradicted them.
OUTCOMES = ("added", "confirmed", "expired", "dropped", "contradicted")
#: The seed of :func:`chain_hashes` (so the predicted hashes are no engine's).
CHAIN_SEED = 0x9E3779B97F4A7C15


def predicted_key(instance_id: str, dp_rank: int) -> WorkerKey:
    """The HBM worker that holds the predictions of (instance, DP)."""
    return WorkerKey(instance_id, PREDICTED_BACKEND, dp_rank, Medium.NPU)


def is_predicted(key: WorkerKey) -> bool:
    return key.backend_id == PREDICTED_BACKEND


def chain_hashes(local_hashes: Iterable[int]) -> array:
    """The predicted blocks' engine hashes: ``c[i] = XXH3-64(c[i-1] || local[i])`` (u64
    LE, ``c[-1] = 0``, seeded): a block's hash names its whole prefix. Hashed in C
    without the GIL (``_hash.chain_hashes``; PERF: 62,500 blocks on the ingest thread
    took 11 ms in Python)."""
    return _hash.chain_hashes(local_hashes, CHAIN_SEED)


@dataclass(frozen=True)
class PredictionLimits:
    """``--prediction-ttl-s`` (0: predictions off), ``--prediction-max-per-dp``,
    ``--prediction-max``, ``--prediction-max-blocks``."""

    ttl: float = 2.0
    per_dp: int = 64
    total: int = 100_000
    #: the blocks of the live predictions, summed, at most (their memory)
    blocks: int = 4_000_000


class Prediction:
    """One reported decision: ``locals`` (the predicted blocks' local hashes) for the
    group, made at ``t`` (monotonic), live until ``expires``."""

    __slots__ = ("index", "group", "locals", "ehashes", "t", "expires", "live")

    def __init__(self, index, group: tuple[str, int], locals_: array, t: float, ttl: float):
        self.index = index
        self.group = group
        self.locals = locals_
        self.ehashes = chain_hashes(locals_)
        self.t = t
        self.expires = t + ttl
        self.live = True


class GroupPredictions:
    """The live predictions of one (instance, DP) in one index, oldest first, and the
    reference counts of its predicted worker's blocks (engine hash -> predictions)."""

    __slots__ = ("records", "refs")

    def __init__(self) -> None:
        self.records: deque[Prediction] = deque()
        self.refs: Counter[int] = Counter()


class Predictions:
    """Every index's predictions (the conductor's; writer thread only, except the
    counters, which any thread may read)."""

    def __init__(self, limits: PredictionLimits | None = None, clock=time.monotonic) -> None:
        self.limits = limits or PredictionLimits()
        self.clock = clock
        self._order: deque[Prediction] = deque()  # every prediction, oldest first
        self.live = 0
        #: the blocks of the live predictions, summed
        self.blocks = 0
        #: :data:`OUTCOMES` -> how many (``added``: made; the others: gone that way)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)

    @property
    def enabled(self) -> bool:
        return self.limits.ttl > 0

    def counts(self) -> dict[str, int]:
        """The ``kvconductor_predictions_*`` numbers: :attr:`outcomes` and ``live``."""
        return {**self.outcomes, "live": self.live}

    # -- writes ----------------------------------------------------------------------------
    def add(
        self, index, instance_id: str, dp_rank: int, local_hashes: Sequence[int], now=None
    ) -> int:
        """Predict ``local_hashes`` (a prompt's full blocks) for (instance, DP) in
        ``index``; the blocks predicted (0 when predictions are off or none)."""
        if not self.enabled or not len(local_hashes) or len(local_hashes) > self.limits.blocks:
            return 0
        now = self.clock() if now is None else now
        self.sweep(now)
        group = (instance_id, dp_rank)
        hashes = array("Q", local_hashes)
        if self._held(index, group, hashes):  # events already say it: confirmed at once
            self.outcomes["added"] += 1
            self.outcomes["confirmed"] += 1
            return len(hashes)
        rec = Prediction(index, group, hashes, now, self.limits.ttl)
        gp = index.predicted.get(group)
        key = predicted_key(instance_id, dp_rank)
        wid = index.worker_id(key)
        if gp is None:
            gp = index.predicted[group] = GroupPredictions()
            index.on_group_write = self.on_write
            # a muted DP (its source down) gives no hits: neither does its predicted
            # worker (which the liveness policy mutes and unmutes with the DP from now on)
            index.set_muted(key, self._muted(index, group))
        index.core.store(wid, None, rec.ehashes, rec.locals)
        gp.refs.update(rec.ehashes)  # PERF: counted in C
        gp.records.append(rec)
        self._order.append(rec)
        self.outcomes["added"] += 1
        self.live += 1
        self.blocks += len(rec.locals)
        while len(gp.records) > self.limits.per_dp:
            self._drop(gp.records[0], "dropped")
        while self.live > self.limits.total or self.blocks > self.limits.blocks:
            self._drop(self._oldest(), "dropped")
        return len(rec.locals)

    def sweep(self, now=None) -> int:
        """Drop the predictions whose TTL passed; how many."""
        now = self.clock() if now is None else now
        n = 0
        order = self._order
        while order and (not order[0].live or order[0].expires <= now):
            rec = order.popleft()
            if rec.live:
                self._drop(rec, "expired")
                n += 1
        return n

    def on_write(self, index, key: WorkerKey, stored: bool) -> None:
        """An event of ``key`` changed ``index`` (its group has predictions): a store
        confirms the predictions its HBM worker now holds whole; a removal or clear
        contradicts them all (:class:`~kvconductor.index.Index` calls this)."""
        group = (key.instance_id, key.dp_rank)
        gp = index.predicted.get(group)
        if gp is None:
            return
        if not stored:
            for rec in list(gp.records):
                self._drop(rec, "contradicted")
            return
        if is_predicted(key) or Medium(key.medium).tier != 0:
            return
        wid = index.worker_id(key)
        for rec in list(gp.records):
            if index.core.hbm_reach(wid, rec.locals) >= len(rec.locals):
                self._drop(rec, "confirmed")

    def drop_index(self, index) -> None:
        """Forget the predictions of an index the conductor dropped."""
        for gp in list(index.predicted.values()):
            for rec in list(gp.records):
                self._drop(rec, "expired", False)

    # -- reads (writer thread) -------------------------------------------------------------
    def of_group(self, index, instance_id: str, dp_rank: int) -> list[Prediction]:
        gp = index.predicted.get((instance_id, dp_rank))
        return [] if gp is None else list(gp.records)

    # -- internals ----------------------------------------------------------------------
    @staticmethod
    def _held(index, group: tuple[str, int], hashes: array) -> bool:
        """An HBM worker of ``group`` (events', not muted) holds all of ``hashes`` on their
        path."""
        return any(
            Medium(key.medium).tier == 0
            and not is_predicted(key)
            and not index.is_muted(key)
            and index.core.hbm_reach(index.worker_id(key), hashes) >= len(hashes)
            for key in index.workers_of(*group)
        )

    @staticmethod
    def _muted(index, group: tuple[str, int]) -> bool:
        """The DP's HBM workers (events') are muted (a source down or quiet)."""
        return any(
            Medium(key.medium).tier == 0 and not is_predicted(key) and index.is_muted(key)
            for key in index.workers_of(*group)
        )

    def _oldest(self) -> Prediction:
        order = self._order
        while not order[0].live:
            order.popleft()
        return order[0]

    def _drop(self, rec: Prediction, why: str, held: bool = True) -> None:
        """``rec`` goes (counted as ``why``); its blocks no other prediction holds leave
        the index unless the index is gone (not ``held``)."""
        if not rec.live:
            return
        rec.live = False
        self.live -= 1
        self.blocks -= len(rec.locals)
        self.outcomes[why] += 1
        index = rec.index
        gp = index.predicted.get(rec.group)
        if gp is None:
            return
        gp.records.remove(rec)
        refs = gp.refs
        gone = array("Q")
        for h in rec.ehashes:  # PERF: Counter.subtract and its __delitem__ are Python code
            c = refs[h] - 1
            if c:
                refs[h] = c
            else:
                refs.pop(h)
                gone.append(h)
        if not gp.records:
            del index.predicted[rec.group]
        if gone and held:
            index.core.remove(index.worker_id(predicted_key(*rec.group)), gone)
