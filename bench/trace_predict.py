"""The value of the router's predictions (``trace_replay.py --predictions``; docs/api.md,
"POST /predict").

KV-aware routing over the trace, as :func:`bench.trace_replay.record` routes it, but with
the engines' publish delay modelled: a request's remove and store events become visible
to the index only after its prefill, ``uncached tokens / --prefill-tps`` seconds after it
arrived (an engine's batches in order), and the trace's clock is divided by a clock scale
(``--predictions 1 10 100``) so that bursts sharing a new prefix overlap that delay. Run
twice over the same requests: without predictions, and with the router reporting each
decision (:class:`kvconductor.predict.Predictions` on the same
:class:`~kvconductor.index.Index`, TTL ``--prediction-ttl-s`` of the compressed clock;
the events confirm or contradict them as in the service). Reported: the prefill
blocks found cached on the chosen engine (hit ratio) each way, and the cost of a
prediction per request (the time inside ``Predictions.add``) beside a query's.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import trace_replay as tr


@dataclass(frozen=True)
class Model:
    """The predictions' TTL (seconds of the compressed clock) and the engines' rates."""

    ttl: float = 2.0
    prefill_tps: float = 10_000.0
    decode_tps: float = 50.0


def route(
    reqs: Sequence[tr.Request], workers: int, capacity: int, model: Model, scale: float, on: bool
) -> dict[str, Any]:
    """One KV-aware routing run with the publish delay, the clock divided by ``scale``,
    predictions ``on`` or off: its hit ratio and costs."""
    from kvconductor.coordinator.affinity import Candidate, KvAffinityConfig, rank
    from kvconductor.index import Index
    from kvconductor.keys import Medium, WorkerKey
    from kvconductor.predict import PredictionLimits, Predictions

    cfg = KvAffinityConfig()
    ix = Index("trace", "default")
    keys = [WorkerKey(f"e{w}", f"e{w}", 0, Medium.NPU) for w in range(workers)]
    wid_of = {f"e{w}": w for w in range(workers)}
    engines: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    holders: dict[int, set[int]] = {}
    intern: dict[tuple[int, int], int] = {}
    ehash_of: list[int] = []
    loads = tr.Loads(workers)
    preds = Predictions(PredictionLimits(ttl=model.ttl)) if on else None
    pending: list[tuple[float, int, int, Any, Any]] = []  # (visible at, seq, w, removed, store)
    last = [0.0] * workers  # when each engine's latest batch becomes visible
    requested = saved = 0
    predict_s = query_s = 0.0
    for i, req in enumerate(reqs):
        t = req.timestamp / 1000 / scale
        loads.advance(t)
        while pending and pending[0][0] <= t:  # what the engines published by now
            _, _, w, removed, store = heapq.heappop(pending)
            if removed:
                ix.remove(keys[w], removed)
            if store is not None:
                ix.store(keys[w], *store)
        if preds is not None:
            preds.sweep(t)
        chain = tr.chain_of(req, intern, ehash_of)
        locals_ = [tr.local_hash(h) for h in req.hash_ids]
        t0 = time.perf_counter()
        res = ix.query_by_hash(locals_)
        query_s += time.perf_counter() - t0
        reported = {wid_of[h.instance_id] for h in res.hits}
        best = loads.least(reported)
        cands = sorted(reported if best is None else reported | {best})
        ranked = rank(
            res.to_dict("default", tr.BLOCK_TOKENS),
            [Candidate(f"e{w}", 0, float(loads.load[w])) for w in cands],
            req.input_length,
            tr.BLOCK_TOKENS,
            cfg,
            top_k=1,
        )
        w = wid_of[ranked[0].instance_id] if ranked else i % workers
        m, n, evicted, new = tr.engine_step(engines[w], holders, w, chain, capacity)
        if preds is not None and n:
            t0 = time.perf_counter()
            preds.add(ix, f"e{w}", 0, locals_[:n], now=t)
            predict_s += time.perf_counter() - t0
        requested += len(chain)
        saved += m
        uncached = max(0, req.input_length - m * tr.BLOCK_TOKENS)
        prefill = uncached / model.prefill_tps
        removed = [ehash_of[x] for x in evicted]
        store = None
        if new:
            par = ehash_of[chain[m - 1]] if m else None
            store = (par, [ehash_of[x] for x in new], locals_[m:n])
        if removed or store is not None:  # an engine publishes in order
            last[w] = max(last[w], t + prefill)
            heapq.heappush(pending, (last[w], i, w, removed, store))
        loads.assign(w, t, req.input_length, prefill + req.output_length / model.decode_tps)
    out: dict[str, Any] = {
        "clock_scale": scale,
        "predictions": on,
        "blocks_requested": requested,
        "blocks_saved": saved,
        "hit_ratio": round(saved / requested, 4) if requested else 0.0,
        "query_us": round(query_s / max(1, len(reqs)) * 1e6, 1),
    }
    if preds is not None:
        out["predict_us"] = round(predict_s / max(1, len(reqs)) * 1e6, 1)
        out |= preds.counts()
    return out


def compare(
    requests: Sequence[tr.Request], workers: int, capacity: int, scales: Sequence[float], **kw
) -> list[dict[str, Any]]:
    """Per clock scale: the run without predictions, then the one with them (``kw``: the
    fields of :class:`Model`)."""
    model = Model(**kw)
    return [
        {"workers": workers, **route(requests, workers, capacity, model, scale, on)}
        for scale in scales
        for on in (False, True)
    ]


HEADER = (
    "| workers | clock scale | blocks saved without | with predictions | hit ratio without | "
    "with | predict µs/request | query µs (without / with) | confirmed / expired / "
    "contradicted / dropped |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def rows(runs: list[dict[str, Any]]) -> list[str]:
    out = []
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        out.append(
            f"| {off['workers']} | {off['clock_scale']:g} | {off['blocks_saved']:,} | "
            f"{on['blocks_saved']:,} | {off['hit_ratio']:.4f} | {on['hit_ratio']:.4f} | "
            f"{on['predict_us']:.1f} | {off['query_us']:.1f} / {on['query_us']:.1f} | "
            f"{on['confirmed']} / {on['expired']} / {on['contradicted']} / {on['dropped']} |"
        )
    return out
