"""Replay a Mooncake-format request trace over simulated engines against the index.

``python bench/trace_replay.py --shape conversation --workers 1024 --policy round-robin``
``python bench/trace_replay.py --trace synthetic_trace.jsonl --workers 64 1024 7000``

The method (NVIDIA Dynamo's indexer benchmark, made reproducible):

1. **Requests.** A trace in the Mooncake FAST'25 JSONL format (one object per line:
   ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``: one id per
   512-token block, equal ids across requests being the same prefix block), or one of
   the built-in :data:`SHAPES` (:func:`generate`, seeded and deterministic).
2. **Engines.** ``--workers`` mock engines, each an LRU cache of ``--capacity`` blocks.
   A request routed to an engine reuses the leading blocks the engine holds, evicts
   least recently used blocks to make room (one *remove* event) and stores its missing
   blocks as one chain under the matched prefix (one *store* event). Recency is kept so
   that a block is never older than a block cached under it: evictions take leaves
   first, as vLLM's free queue does.
3. **Routing** (``--policy``): ``round-robin``; ``least-loaded`` (fewest active tokens:
   a request is active for ``uncached / --prefill-tps + output / --decode-tps`` seconds;
   ties go to the least recently chosen engine); ``kv-aware``: the index's own answer
   ranked by :func:`kvconductor.coordinator.affinity.rank` (``unified`` mode, the
   active tokens as ``load_cost``).
4. **One stream.** Each request gives a query (its local hashes) followed by its
   engine's remove and store events, in trace order. The stream is recorded once, with
   the expected answer of every query from an exact simulator (the engines' own caches,
   plain Python sets: per engine the number of leading blocks it holds), then replayed
   unchanged through every backend, alternating backends between repeats:

   * ``kvc``: the public :class:`kvconductor.index.Index` (``store``, ``remove``,
     ``query_by_hash``: a :class:`~kvconductor.index.QueryResult`, not read);
   * ``kvc-dict``: ``kvc`` taking every holder as a router does, the answer's
     ``{(instance_id, dp_rank): depth}`` dict (``QueryResult.scores()``); ``kvc-hits``:
     its ``DpHit`` rows (``.hits``); ``kvc-top8``: ``top_k=8``, taken as that dict;
   * ``kvc-core``: the compiled ``CoreIndex`` alone (``match_rows``: its native
     ``MatchRows``, no Python object per row);
   * ``dynamo``: NVIDIA Dynamo's ``RadixTree`` (PyPI ``ai-dynamo-runtime``), when it is
     installed: ``apply_event`` with its JSON ``KvCacheEvent`` bytes, ``find_matches``
     and its ``scores`` map; ``dynamo-native``: ``find_matches`` alone; ``dynamo-top8``:
     the ``scores`` map's 8 best (``heapq.nlargest``).

   Every answer is compared with the simulator's (outside the timed calls): a mismatch
   is a per-(instance, DP) ``npu_blocks`` that differs, or a holder too many or missing.

   ``--server [PACE ...]`` also plays the stream against a real ``kv-conductor``
   (:mod:`bench.trace_server`: vLLM 0.33 batches over ZeroMQ from publisher processes,
   ``/query_by_hash`` MessagePack queries from client processes, at the trace's pace times
   PACE or, with 0, as fast as possible; every answer checked again at quiescence);
   ``--server-top-k 0 8`` once whole and once with ``top_k=8`` (the cut answers checked
   against :func:`top_items`); ``--server-dynamo`` the same stream (the same ZeroMQ bytes)
   and queries by hash against NVIDIA Dynamo's standalone indexer service
   (:mod:`bench.trace_dynamo_server`, ``python -m dynamo.indexer``) in the same run;
   ``--server-predictions`` kv-conductor once more, each query followed by the router's
   prediction (``POST /predict_by_hash``), timed apart; ``--server-args "--workers 2"``
   more flags for every kv-conductor started; ``--server-floor-ingest`` the floor of a
   service that ingests (:class:`bench.trace_services.IngestFloor`: a bare ASGI app on
   the same uvicorn receiving the same stream and load, answering kv-conductor's mean
   answer size); ``--server-floor-sources`` that floor with a SUB per engine on
   kv-conductor's own ingest loop, which only counts. Each row has the service's CPU per
   op (event batch or query).

Block identity: a trace id names a prefix block, so a block is identified by its place in
a chain (its parent's identity and its id). The index keys blocks the same way: a tree
edge is ``(parent node, local hash)``, and ``local hash = mix64(hash id)`` (a bijection of
u64, so equal ids give equal local hashes and the hash maps see well-spread keys). The
engine hash of a block is ``mix64`` of its chain identity (what vLLM's rolling block hash
is), the same on every engine; so a trace whose ids repeated under different parents
would still be indexed position by position, as an engine would.

Measured per backend: ops/s over the time spent inside the backend's calls (queries +
store events + remove events; the Python loop and the checks are outside), p50/p99 of
queries and stores, bytes per live (worker, block) (``Index.sizes()["nbytes"]``, the
index's allocated bytes; not available for Dynamo), mismatches. Per stream: the hit
ratio of the routing policy (prefill blocks found cached on the chosen engine / blocks
requested).

Traces: kvcache-ai/Mooncake on GitHub, folder ``FAST25-release/traces/``:
``conversation_trace.jsonl``, ``synthetic_trace.jsonl``, ``toolagent_trace.jsonl``.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import heapq
import itertools
import json
import math
import random
import shlex
import statistics
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from xxhash import xxh3_64_intdigest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK_TOKENS = 512
MASK64 = (1 << 64) - 1
DEPTH_BITS = 20  # answer items are (worker << DEPTH_BITS) | depth
TOP_K = 8  # the kvc-top8 backend's top_k

Q, STORE, REMOVE = 0, 1, 2


class Request(NamedTuple):
    """One trace row."""

    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of u64 (distinct ids stay distinct)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def local_hash(hash_id: int) -> int:
    """The local hash (LocalBlockHash) standing for trace id ``hash_id``."""
    return mix64(hash_id)


def engine_hash(node: int) -> int:
    """The engine hash of chain identity ``node`` (distinct nodes, distinct hashes)."""
    return mix64(node ^ 0x5BD1E9955BD1E995)


# ---------------------------------------------------------------------------------------
# traces


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSONL trace (sorted by timestamp, stable)."""
    out: list[Request] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            out.append(
                Request(
                    int(row["timestamp"]),
                    int(row["input_length"]),
                    int(row.get("output_length", 0)),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp)
    return out


def write_trace(requests: Iterable[Request], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(
                json.dumps(
                    {
                        "timestamp": r.timestamp,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


@dataclass(frozen=True)
class Shape:
    """Parameters of :func:`generate`.

    Requests come in sessions. ``chain`` sessions are conversations: each turn's prompt
    is the previous prompt, its answer and a new message, so it shares the previous
    prompt's full blocks. ``branch`` sessions ask several questions about one document:
    each prompt is the document's full blocks and a new question. Every prompt starts
    with ``system_blocks`` blocks shared by all requests.
    """

    name: str
    requests: int
    duration_s: float
    mode: str  # "chain" | "branch"
    system_blocks: int
    max_session: int  # requests per session at most
    p_single: float  # a session of one request
    size_alpha: float  # a longer session has k >= 2 requests with probability ~ k ** -alpha
    first_mu: float  # ln(tokens) of a session's first prompt: lognormal
    first_sigma: float
    multi_mu: float  # the same for sessions of several requests
    multi_sigma: float
    p_tiny: float  # a one-request session whose prompt fits in one block
    turn_mu: float  # ln(tokens) a turn adds (chain) / of a question (branch)
    turn_sigma: float
    p_repeat: float  # a request repeats its predecessor exactly
    max_blocks: int
    out_mu: float  # ln(output tokens)
    out_sigma: float
    gap_s: float  # mean time between a session's requests


SHAPES: dict[str, Shape] = {
    # kvcache-ai/Mooncake conversation_trace.jsonl: 12,031 requests over 59 minutes,
    # 288,500 block references, 182,790 distinct blocks, 24 blocks per request on average,
    # up to 247; the first block is shared by every request, other prefixes by at most 43.
    "conversation": Shape(
        name="conversation",
        requests=12_031,
        duration_s=3_540.0,
        mode="chain",
        system_blocks=1,
        max_session=43,
        p_single=0.77,
        size_alpha=2.5,
        first_mu=math.log(9_400),
        first_sigma=0.9,
        multi_mu=math.log(3_500),
        multi_sigma=0.9,
        p_tiny=0.0,
        turn_mu=math.log(500),
        turn_sigma=0.8,
        p_repeat=0.0,
        max_blocks=247,
        out_mu=math.log(300),
        out_sigma=0.8,
        gap_s=60.0,
    ),
    # kvcache-ai/Mooncake synthetic_trace.jsonl: 3,993 requests over 17 minutes, 121,877
    # block references, 43,924 distinct blocks, 30.5 blocks per request, up to 374;
    # 2,211 first blocks, 1,803 of them used once; other prefixes shared by at most 24.
    "synthetic": Shape(
        name="synthetic",
        requests=3_993,
        duration_s=1_022.0,
        mode="branch",
        system_blocks=0,
        max_session=24,
        p_single=0.815,
        size_alpha=1.8,
        first_mu=math.log(13_000),
        first_sigma=0.5,
        multi_mu=math.log(16_000),
        multi_sigma=0.9,
        p_tiny=0.65,
        turn_mu=math.log(300),
        turn_sigma=0.9,
        p_repeat=0.12,
        max_blocks=374,
        out_mu=math.log(60),
        out_sigma=1.3,
        gap_s=60.0,
    ),
}


def generate(shape: Shape | str, seed: int = 0, requests: int | None = None) -> list[Request]:
    """A trace of ``shape``'s statistics (seeded, deterministic). ``requests`` scales the
    trace down (or up): the duration scales with it, so the request rate is kept."""
    sh = SHAPES[shape] if isinstance(shape, str) else shape
    n_target = sh.requests if requests is None else requests
    duration = sh.duration_s * n_target / sh.requests
    rnd = random.Random(seed)
    max_tokens = sh.max_blocks * BLOCK_TOKENS
    body_cap = max_tokens - sh.system_blocks * BLOCK_TOKENS
    counter = [0]

    def fresh(k: int) -> list[int]:
        start = counter[0]
        counter[0] += k
        return list(range(start, start + k))

    system = fresh(sh.system_blocks)
    sizes_cdf = list(itertools.accumulate(k**-sh.size_alpha for k in range(2, sh.max_session + 1)))

    def lognormal(mu: float, sigma: float, cap: int) -> int:
        return max(1, min(cap, int(rnd.lognormvariate(mu, sigma))))

    rows: list[tuple[float, int, int, int, list[int]]] = []  # (t, seq, tokens, out, ids)
    while len(rows) < n_target:
        if rnd.random() < sh.p_single:
            size = 1
        else:
            size = 2 + bisect.bisect_left(sizes_cdf, rnd.random() * sizes_cdf[-1])
        size = min(size, n_target - len(rows))
        t = rnd.uniform(0, duration)
        if size == 1:
            if rnd.random() < sh.p_tiny:
                tokens = rnd.randint(1, BLOCK_TOKENS)
            else:
                tokens = lognormal(sh.first_mu, sh.first_sigma, body_cap)
        else:
            tokens = lognormal(sh.multi_mu, sh.multi_sigma, body_cap)
        if sh.mode == "chain":
            ids = fresh(-(-tokens // BLOCK_TOKENS))
            for k in range(size):
                out = lognormal(sh.out_mu, sh.out_sigma, 1 << 16)
                rows.append((t, len(rows), tokens, out, system + ids))
                if k + 1 == size:
                    break
                grown = tokens + out + lognormal(sh.turn_mu, sh.turn_sigma, body_cap)
                if grown > body_cap:
                    break
                full = tokens // BLOCK_TOKENS
                ids = ids[:full] + fresh(-(-grown // BLOCK_TOKENS) - full)
                tokens = grown
                t += rnd.expovariate(1 / sh.gap_s)
        else:
            doc_tokens = tokens
            doc = fresh(doc_tokens // BLOCK_TOKENS)
            prev: tuple[int, list[int]] | None = None
            for _ in range(size):
                out = lognormal(sh.out_mu, sh.out_sigma, 1 << 16)
                if prev is not None and rnd.random() < sh.p_repeat:
                    tokens, ids = prev
                else:
                    q = lognormal(sh.turn_mu, sh.turn_sigma, BLOCK_TOKENS * 4)
                    tokens = min(body_cap, doc_tokens + q)
                    ids = doc + fresh(-(-tokens // BLOCK_TOKENS) - len(doc))
                rows.append((t, len(rows), tokens, out, system + ids))
                prev = (tokens, ids)
                t += rnd.expovariate(1 / sh.gap_s)
    rows.sort(key=lambda r: (r[0], r[1]))
    last = rows[-1][0] if rows else 0.0
    scale = duration / last if last > duration else 1.0
    renum: dict[int, int] = {}
    out_rows = []
    for t, _, tokens, out, ids in rows:
        hid = tuple(renum.setdefault(i, len(renum)) for i in ids)
        body = tokens + sh.system_blocks * BLOCK_TOKENS
        out_rows.append(Request(int(t * scale * 1000), body, out, hid))
    return out_rows


def trace_stats(requests: Sequence[Request]) -> dict[str, Any]:
    """Requests, duration, block references, distinct blocks, blocks per request, and the
    most requests sharing a first block and a (longer) prefix."""
    refs = sum(len(r.hash_ids) for r in requests)
    distinct: set[int] = set()
    first: dict[int, int] = {}
    second: dict[tuple[int, int], int] = {}
    for r in requests:
        distinct.update(r.hash_ids)
        if r.hash_ids:
            first[r.hash_ids[0]] = first.get(r.hash_ids[0], 0) + 1
        if len(r.hash_ids) > 1:
            k = (r.hash_ids[0], r.hash_ids[1])
            second[k] = second.get(k, 0) + 1
    lens = [len(r.hash_ids) for r in requests]
    dur = (requests[-1].timestamp - requests[0].timestamp) / 1000 if requests else 0.0
    return {
        "requests": len(requests),
        "duration_s": round(dur, 1),
        "block_refs": refs,
        "distinct_blocks": len(distinct),
        "blocks_mean": round(refs / len(requests), 2) if requests else 0,
        "blocks_max": max(lens, default=0),
        "first_blocks": len(first),
        "first_block_max_share": max(first.values(), default=0),
        "two_block_prefix_max_share": max(second.values(), default=0),
    }


# ---------------------------------------------------------------------------------------
# the engines, the simulator and the routing


class Loads:
    """Active tokens per engine: a request is active from its arrival for its service time.
    ``least()`` is the engine with the fewest active tokens, ties to the least recently
    chosen (then the lowest id)."""

    def __init__(self, n: int) -> None:
        self.load = [0] * n
        self.last = list(range(-n, 0))
        self.heap = [(0, self.last[w], w) for w in range(n)]
        heapq.heapify(self.heap)
        self.expiry: list[tuple[float, int, int]] = []
        self.seq = 0

    def advance(self, t: float) -> None:
        ex = self.expiry
        while ex and ex[0][0] <= t:
            _, w, tokens = heapq.heappop(ex)
            self.load[w] -= tokens
            heapq.heappush(self.heap, (self.load[w], self.last[w], w))

    def _valid(self, item: tuple[int, int, int]) -> bool:
        load, last, w = item
        return self.load[w] == load and self.last[w] == last

    def least(self, exclude: set[int] | frozenset[int] = frozenset()) -> int | None:
        heap = self.heap
        if len(exclude) * 2 > len(self.load):
            free = [w for w in range(len(self.load)) if w not in exclude]
            if not free:
                return None
            return min(free, key=lambda w: (self.load[w], self.last[w], w))
        held = []
        found = None
        while heap:
            item = heap[0]
            if not self._valid(item):
                heapq.heappop(heap)
                continue
            if item[2] in exclude:
                held.append(heapq.heappop(heap))
                continue
            found = item[2]
            break
        for item in held:
            heapq.heappush(heap, item)
        return found

    def assign(self, w: int, t: float, tokens: int, busy_s: float) -> None:
        self.seq += 1
        self.load[w] += tokens
        self.last[w] = self.seq
        heapq.heappush(self.heap, (self.load[w], self.last[w], w))
        heapq.heappush(self.expiry, (t + busy_s, w, tokens))


class Answer(NamedTuple):
    """A query's answer reduced for comparison: its holder count and a digest of the
    ``(worker << DEPTH_BITS) | depth`` items (order-free)."""

    count: int
    digest: int


def digest(items: Iterable[int]) -> Answer:
    fs = frozenset(items)
    return Answer(len(fs), hash(fs))


def _mix64(x: int) -> int:
    """SplitMix64's finaliser (docs/api.md, "top_k and instances": the rotation's start)."""
    m = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def top_items(items: list[int], k: int, order: dict[int, int], seed: int) -> list[int]:
    """The answer items of a ``top_k=k`` query without ``instances`` (docs/api.md, "top_k
    and instances"): every item deeper than the k-th depth and, of those tied there in
    group order (``order``: engine -> its group id in the index, the order of first
    stores), a run from ``_mix64(seed) % tied``, ``seed`` the XXH3-64 of the query's
    hashes as u64."""
    if len(items) <= k:
        return items
    mask = (1 << DEPTH_BITS) - 1
    kth = sorted((x & mask for x in items), reverse=True)[k - 1]
    deeper = [x for x in items if x & mask > kth]
    tied = sorted((x for x in items if x & mask == kth), key=lambda x: order[x >> DEPTH_BITS])
    start = _mix64(seed) % len(tied)
    return deeper + [tied[(start + j) % len(tied)] for j in range(k - len(deeper))]


def top_depths(items: Iterable[int], k: int = TOP_K) -> tuple[int, ...]:
    """The depths of the ``k`` deepest answer items, deepest first."""
    mask = (1 << DEPTH_BITS) - 1
    return tuple(heapq.nlargest(k, (x & mask for x in items)))


def simulate_answer(chain: Sequence[int], holders: dict[int, set[int]]) -> list[int]:
    """Per engine holding the first block, the number of leading blocks of ``chain`` it
    holds, as ``(engine << DEPTH_BITS) | depth`` items."""
    if not chain:
        return []
    active = holders.get(chain[0])
    if not active:
        return []
    items: list[int] = []
    depth = 1
    for node in chain[1:]:
        h = holders.get(node)
        if not h:
            break
        nxt = active & h
        if len(nxt) != len(active):
            items.extend([(w << DEPTH_BITS) | depth for w in active - nxt])
            if not nxt:
                return items
        active = nxt
        depth += 1
    items.extend([(w << DEPTH_BITS) | depth for w in active])
    return items


@dataclass
class Stream:
    """The op stream of one (trace, workers, capacity, policy), recorded once."""

    label: str
    workers: int
    dp: int
    capacity: int
    policy: str
    #: (Q, query index) | (STORE, w, parent ehash or None, ehashes, locals) | (REMOVE, w, ehashes)
    ops: list[tuple] = field(default_factory=list)
    queries: list[list[int]] = field(default_factory=list)  # local hashes per query
    chains: list[list[int]] = field(default_factory=list)  # chain identities per query
    #: the engines' caches at the end: chain identity -> engines holding it
    final_holders: dict[int, set[int]] = field(default_factory=dict)
    expected: list[Answer] = field(default_factory=list)
    #: the expected answers of ``top_k=TOP_K`` queries (the TOP_K deepest rows, the ties
    #: at the cut by the rotation of docs/api.md)
    expected_top: list[Answer] = field(default_factory=list)
    #: the engine each query's request was routed to (the router's prediction)
    routed: list[int] = field(default_factory=list)
    #: the depths of the TOP_K deepest holders, deepest first (what any top-TOP_K answer
    #: has, whatever its rule among ties: ``dynamo-top8``'s check)
    expected_top_depths: list[tuple[int, ...]] = field(default_factory=list)
    blocks_requested: int = 0
    blocks_saved: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    record_s: float = 0.0
    #: mismatches between the simulator and the index that kv-aware routing asked
    record_mismatches: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.blocks_saved / self.blocks_requested if self.blocks_requested else 0.0

    def counts(self) -> dict[str, int]:
        c = [0, 0, 0]
        for op in self.ops:
            c[op[0]] += 1
        return {"queries": c[Q], "stores": c[STORE], "removes": c[REMOVE], "ops": len(self.ops)}


POLICIES = ("round-robin", "least-loaded", "kv-aware")


def instance_of(w: int, dp: int) -> tuple[str, int]:
    return f"e{w // dp}", w % dp


def chain_of(req: Request, intern: dict[tuple[int, int], int], ehash_of: list[int]) -> list[int]:
    """The chain identities of ``req``'s blocks (new ones interned, their engine hashes
    appended to ``ehash_of``)."""
    chain = []
    parent = -1
    for h in req.hash_ids:
        node = intern.get((parent, h))
        if node is None:
            node = len(ehash_of)
            intern[(parent, h)] = node
            ehash_of.append(engine_hash(node))
        chain.append(node)
        parent = node
    return chain


def engine_step(
    cache: OrderedDict[int, None],
    holders: dict[int, set[int]],
    w: int,
    chain: list[int],
    capacity: int,
) -> tuple[int, int, list[int], list[int]]:
    """Engine ``w`` (its LRU ``cache``) serves ``chain``: reuse, evict, store. Returns
    ``(m, n, evicted, new)``: the leading blocks it held, the blocks it keeps (at most
    ``capacity``), the chain identities it evicted and those it stored."""
    n = min(len(chain), capacity)
    m = 0
    while m < n and chain[m] in cache:
        m += 1
    for j in range(m - 1, -1, -1):
        cache.move_to_end(chain[j])
    need = len(cache) + (n - m) - capacity
    evicted = []
    while need > 0:
        node, _ = cache.popitem(last=False)
        evicted.append(node)
        hs = holders[node]
        hs.discard(w)
        if not hs:
            del holders[node]
        need -= 1
    new = chain[m:n]
    for node in reversed(new):
        cache[node] = None
        holders.setdefault(node, set()).add(w)
    for j in range(m - 1, -1, -1):
        cache.move_to_end(chain[j])
    return m, n, evicted, new


def record(
    requests: Sequence[Request],
    workers: int,
    capacity: int,
    policy: str,
    *,
    dp: int = 1,
    prefill_tps: float = 10_000.0,
    decode_tps: float = 50.0,
    speedup: float = 1.0,
    label: str = "",
    affinity_config: Any = None,
) -> Stream:
    """Route ``requests`` over ``workers`` LRU engines and record the op stream with the
    simulator's expected answers. ``kv-aware`` asks a real :class:`Index` fed with the same
    events (its answers are checked against the simulator as they are used).
    ``speedup`` divides the trace's clock for the load model only (more requests active
    at once); the recorded stream has no clock: it is replayed back to back."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    if workers % dp:
        raise ValueError("--workers must be a multiple of --dp")
    t_start = time.perf_counter()
    st = Stream(label, workers, dp, capacity, policy)
    engines: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    holders: dict[int, set[int]] = {}
    intern: dict[tuple[int, int], int] = {}
    ehash_of: list[int] = []
    group_of: dict[int, int] = {}  # engine -> its group id in an index fed this stream
    loads = Loads(workers)
    ix = rank = keys = cands_of = None
    if policy == "kv-aware":
        from kvconductor.coordinator.affinity import Candidate, KvAffinityConfig, rank
        from kvconductor.index import Index
        from kvconductor.keys import Medium, WorkerKey

        cfg = affinity_config or KvAffinityConfig()
        ix = Index("trace", "default")
        keys = []
        for w in range(workers):
            iid, d = instance_of(w, dp)
            keys.append(WorkerKey(iid, iid, d, Medium.NPU))
        wid_of = {instance_of(w, dp): w for w in range(workers)}

        def cands_of(reported: set[int], t: float) -> list:
            best = loads.least(reported)
            ws = sorted(reported if best is None else reported | {best})
            return [Candidate(*instance_of(w, dp), float(loads.load[w])) for w in ws]

    for i, req in enumerate(requests):
        t = req.timestamp / 1000 / speedup
        loads.advance(t)
        chain = chain_of(req, intern, ehash_of)
        locals_ = [local_hash(h) for h in req.hash_ids]
        # the query and its expected answer
        items = simulate_answer(chain, holders)
        qi = len(st.queries)
        st.queries.append(locals_)
        st.chains.append(chain)
        st.expected.append(digest(items))
        seed = xxh3_64_intdigest(array("Q", locals_))
        st.expected_top.append(digest(top_items(items, TOP_K, group_of, seed)))
        st.expected_top_depths.append(top_depths(items))
        st.ops.append((Q, qi))
        # routing
        if policy == "round-robin":
            w = i % workers
        elif policy == "least-loaded":
            w = loads.least()  # type: ignore[assignment]
        else:
            assert ix is not None and rank is not None and cands_of is not None
            res = ix.query_by_hash(locals_)
            rows = res.tuples()
            got = digest((wid_of[(r[0], r[1])] << DEPTH_BITS) | r[2] for r in rows)
            if got != st.expected[qi]:
                st.record_mismatches += 1
            reported = {wid_of[(r[0], r[1])] for r in rows}
            ranked = rank(
                res,  # read in process: its C-made tuples, no V3 body
                cands_of(reported, t),
                req.input_length,
                BLOCK_TOKENS,
                cfg,
                top_k=1,
            )
            w = wid_of[(ranked[0].instance_id, ranked[0].dp_rank)] if ranked else i % workers
        st.routed.append(w)
        m, n, evicted, new = engine_step(engines[w], holders, w, chain, capacity)
        st.blocks_requested += len(chain)
        st.blocks_saved += m
        if evicted:
            ev = [ehash_of[x] for x in evicted]
            st.ops.append((REMOVE, w, ev))
            st.blocks_removed += len(ev)
            if ix is not None:
                ix.remove(keys[w], ev)  # type: ignore[index]
        if new:
            par = ehash_of[chain[m - 1]] if m else None
            eh = [ehash_of[x] for x in new]
            lh = locals_[m:n]
            st.ops.append((STORE, w, par, eh, lh))
            group_of.setdefault(w, len(group_of))
            st.blocks_stored += len(eh)
            if ix is not None:
                ix.store(keys[w], par, eh, lh)  # type: ignore[index]
        uncached = max(0, req.input_length - m * BLOCK_TOKENS)
        loads.assign(
            w, t, req.input_length, uncached / prefill_tps + req.output_length / decode_tps
        )
    st.final_holders = holders
    st.record_s = time.perf_counter() - t_start
    return st


# ---------------------------------------------------------------------------------------
# backends


class Backend:
    """One index under test: ``prepare`` turns the stream into the backend's own call
    arguments (outside the timing); ``replay`` times every call."""

    name = ""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def prepare(self) -> list[tuple]:
        raise NotImplementedError

    def calls(self) -> tuple[Callable, Callable, Callable]:
        """(query, store, remove) callables taking the prepared arguments."""
        raise NotImplementedError

    def answer(self, result: Any) -> Answer:
        raise NotImplementedError

    def rows(self, result: Any) -> int:
        """The rows (holders) of an answer."""
        return len(result)

    def expected(self) -> list[Answer]:
        """The simulator's answers this backend's queries must give."""
        return self.stream.expected

    def nbytes(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        pass


class KvcBackend(Backend):
    """The public ``Index`` API: ``store``/``remove``/``query_by_hash``."""

    name = "kvc"

    def __init__(self, stream: Stream) -> None:
        super().__init__(stream)
        from kvconductor.index import Index
        from kvconductor.keys import Medium, WorkerKey

        self.ix = Index("trace", "default")
        self.keys = []
        self.base: dict[str, int] = {}
        for w in range(stream.workers):
            iid, d = instance_of(w, stream.dp)
            self.keys.append(WorkerKey(iid, iid, d, Medium.NPU))
            self.base.setdefault(iid, w - d)

    def prepare(self) -> list[tuple]:
        keys = self.keys
        out: list[tuple] = []
        qs = [array("Q", q) for q in self.stream.queries]
        for op in self.stream.ops:
            if op[0] == Q:
                out.append((Q, op[1], (qs[op[1]],)))
            elif op[0] == STORE:
                out.append((STORE, 0, (keys[op[1]], op[2], array("Q", op[3]), array("Q", op[4]))))
            else:
                out.append((REMOVE, 0, (keys[op[1]], array("Q", op[2]))))
        return out

    def calls(self) -> tuple[Callable, Callable, Callable]:
        return self.ix.query_by_hash, self.ix.store, self.ix.remove

    def answer(self, result: Any) -> Answer:
        base = self.base
        return digest(
            ((base[h.instance_id] + h.dp_rank) << DEPTH_BITS)
            | (h.npu_blocks + (h.cpu_blocks << 10) + (h.disk_blocks << 10))
            for h in result.hits
        )

    def nbytes(self) -> dict[str, int] | None:
        s = self.ix.sizes()
        return {"nbytes": s["nbytes"], "pairs": s["hbm_pairs"], "nodes": s["nodes"]}

    def close(self) -> None:
        self.ix.close()


class KvcCoreBackend(Backend):
    """The compiled ``CoreIndex`` alone: ``match_rows``, its native answer (the rows
    ``(group, npu, cpu, disk)`` in a C buffer, a ``MatchRows``), no Python object per row
    (group = worker here)."""

    name = "kvc-core"

    def __init__(self, stream: Stream) -> None:
        super().__init__(stream)
        from kvconductor._index import CoreIndex

        self.core = CoreIndex()
        for w in range(stream.workers):
            self.core.set_worker(w, w, 0)

    def prepare(self) -> list[tuple]:
        out: list[tuple] = []
        qs = [array("Q", q) for q in self.stream.queries]
        for op in self.stream.ops:
            if op[0] == Q:
                out.append((Q, op[1], (qs[op[1]],)))
            elif op[0] == STORE:
                out.append((STORE, 0, (op[1], op[2], array("Q", op[3]), array("Q", op[4]))))
            else:
                out.append((REMOVE, 0, (op[1], array("Q", op[2]))))
        return out

    def calls(self) -> tuple[Callable, Callable, Callable]:
        return self.core.match_rows, self.core.store, self.core.remove

    def answer(self, result: Any) -> Answer:
        return digest(
            (g << DEPTH_BITS) | (n + (c << 10) + (d << 10)) for g, n, c, d in result.tolist()
        )

    def nbytes(self) -> dict[str, int] | None:
        s = self.core.stats()
        return {"nbytes": s["nbytes"], "pairs": s["hbm_pairs"], "nodes": s["nodes"]}

    def close(self) -> None:
        self.core.close()


def scores_of(res: Any) -> dict:
    """The router's ``{(instance_id, dp_rank): depth}`` of a ``QueryResult``: its
    ``scores()`` (built in C), or on a tree from before it (the before/after runs of
    docs/performance.md) the same dict made from its ``DpHit`` rows, as a router did."""
    scores = getattr(res, "scores", None)
    if scores is not None:
        return scores()
    return {
        (h.instance_id, h.dp_rank): h.npu_blocks + h.cpu_blocks + h.disk_blocks for h in res.hits
    }


class KvcDictBackend(KvcBackend):
    """``kvc`` with every holder taken as a router takes Dynamo's ``.scores``: the
    ``{(instance_id, dp_rank): depth}`` dict of the answer, inside the timed call."""

    name = "kvc-dict"

    def calls(self) -> tuple[Callable, Callable, Callable]:
        q = self.ix.query_by_hash

        def query(hashes: Any) -> Any:
            return scores_of(q(hashes))

        return query, self.ix.store, self.ix.remove

    def answer(self, result: Any) -> Answer:
        base = self.base
        return digest(((base[i] + d) << DEPTH_BITS) | s for (i, d), s in result.items())


class KvcHitsBackend(KvcBackend):
    """``kvc`` with the answer's ``DpHit`` rows (``QueryResult.hits``) made in the timed
    call."""

    name = "kvc-hits"

    def calls(self) -> tuple[Callable, Callable, Callable]:
        q = self.ix.query_by_hash

        def query(hashes: Any) -> Any:
            res = q(hashes)
            res.hits  # noqa: B018 (made here, timed)
            return res

        return query, self.ix.store, self.ix.remove


class KvcTopBackend(KvcDictBackend):
    """``kvc`` asking ``query_by_hash(..., top_k=TOP_K)``: at most the TOP_K deepest
    (instance, DP) rows (ties at the cut by the request's rotation), what a router that
    ranks a few candidates asks, taken as its ``{(instance_id, dp_rank): depth}`` dict
    inside the timed call."""

    name = f"kvc-top{TOP_K}"

    def calls(self) -> tuple[Callable, Callable, Callable]:
        q = self.ix.query_by_hash

        def query(hashes: Any) -> Any:
            return scores_of(q(hashes, top_k=TOP_K))

        return query, self.ix.store, self.ix.remove

    def expected(self) -> list[Answer]:
        return self.stream.expected_top


class KvcPhasesBackend(KvcBackend):
    """``kvc`` with its queries cut in three timed phases: ``CoreIndex.match_rows`` (the
    walk, under the read lock, into the core's arrays), the ``QueryResult`` over those
    arrays, and the MessagePack V3 answer the server sends (``encode_answer``). Its query
    time is the sum of the three (so it includes the encoding, which ``kvc`` does not)."""

    name = "kvc-phases"

    def __init__(self, stream: Stream) -> None:
        super().__init__(stream)
        self.phases = {"match_s": 0.0, "result_s": 0.0, "encode_s": 0.0}

    def calls(self) -> tuple[Callable, Callable, Callable]:
        from kvconductor._encode import encode_answer
        from kvconductor.index import QueryResult

        match = self.ix.core.match_rows
        names = self.ix.names
        clock = time.perf_counter_ns
        acc = [0, 0, 0]
        self._acc = acc

        def query(hashes: Any) -> Any:
            t0 = clock()
            rows = match(hashes)
            t1 = clock()
            res = QueryResult(None, rows, names)
            t2 = clock()
            encode_answer(res, "default", BLOCK_TOKENS, True)
            t3 = clock()
            acc[0] += t1 - t0
            acc[1] += t2 - t1
            acc[2] += t3 - t2
            return res

        return query, self.ix.store, self.ix.remove

    def nbytes(self) -> dict[str, int] | None:
        a = self._acc
        self.phases = {"match_s": a[0] / 1e9, "result_s": a[1] / 1e9, "encode_s": a[2] / 1e9}
        return super().nbytes()


def dynamo_radix_tree() -> Any:
    """Dynamo's ``RadixTree`` class, or None when ``ai-dynamo-runtime`` is not installed."""
    try:
        from dynamo.llm import RadixTree
    except Exception:
        return None
    return RadixTree


class DynamoBackend(Backend):
    """NVIDIA Dynamo's ``RadixTree`` (PyPI ``ai-dynamo-runtime``): ``apply_event(worker_id,
    KvCacheEvent JSON bytes)`` and ``find_matches(local hashes).scores``, a
    ``{(worker_id, dp_rank): depth}`` map."""

    name = "dynamo"

    def __init__(self, stream: Stream) -> None:
        super().__init__(stream)
        cls = dynamo_radix_tree()
        if cls is None:
            raise RuntimeError("ai-dynamo-runtime is not installed")
        self.tree = cls()

    def prepare(self) -> list[tuple]:
        dp = self.stream.dp
        out: list[tuple] = []
        eid = 0
        for op in self.stream.ops:
            if op[0] == Q:
                out.append((Q, op[1], (self.stream.queries[op[1]],)))
                continue
            eid += 1
            w = op[1]
            if op[0] == STORE:
                data: dict[str, Any] = {
                    "stored": {
                        "parent_hash": op[2],
                        "blocks": [
                            {"block_hash": e, "tokens_hash": h}
                            for e, h in zip(op[3], op[4], strict=True)
                        ],
                    }
                }
            else:
                data = {"removed": {"block_hashes": op[2]}}
            ev = json.dumps({"event_id": eid, "data": data, "dp_rank": w % dp}).encode()
            out.append((op[0], 0, (w // dp, ev)))
        return out

    def calls(self) -> tuple[Callable, Callable, Callable]:
        find = self.tree.find_matches

        def query(seq: list[int]) -> dict:
            return find(seq).scores

        return query, self.tree.apply_event, self.tree.apply_event

    def answer(self, result: Any) -> Answer:
        dp = self.stream.dp
        return digest(((wid * dp + d) << DEPTH_BITS) | s for (wid, d), s in result.items())


class DynamoNativeBackend(DynamoBackend):
    """``dynamo``'s native answer: ``find_matches`` alone (its ``OverlapScores``, the
    ``.scores`` map not asked for in the timed call), beside ``kvc-core``."""

    name = "dynamo-native"

    def calls(self) -> tuple[Callable, Callable, Callable]:
        return self.tree.find_matches, self.tree.apply_event, self.tree.apply_event

    def answer(self, result: Any) -> Answer:
        return super().answer(result.scores)

    def rows(self, result: Any) -> int:
        return len(result.scores)


class DynamoTopBackend(DynamoBackend):
    """``dynamo`` taken as a router takes its TOP_K best: ``.scores`` then
    ``heapq.nlargest(TOP_K)`` by depth (Dynamo's answer is whole). Checked by the depths
    of the TOP_K deepest holders (its ties are its own)."""

    name = f"dynamo-top{TOP_K}"

    def calls(self) -> tuple[Callable, Callable, Callable]:
        find = self.tree.find_matches
        nlargest = heapq.nlargest
        depth = itemgetter(1)

        def query(seq: list[int]) -> list:
            return nlargest(TOP_K, find(seq).scores.items(), key=depth)

        return query, self.tree.apply_event, self.tree.apply_event

    def answer(self, result: Any) -> Any:
        return tuple(s for _, s in result)

    def expected(self) -> list[Any]:
        return self.stream.expected_top_depths


BACKENDS: dict[str, type[Backend]] = {
    "kvc": KvcBackend,
    "kvc-core": KvcCoreBackend,
    "kvc-dict": KvcDictBackend,
    "kvc-hits": KvcHitsBackend,
    "kvc-phases": KvcPhasesBackend,
    KvcTopBackend.name: KvcTopBackend,
    "dynamo": DynamoBackend,
    "dynamo-native": DynamoNativeBackend,
    DynamoTopBackend.name: DynamoTopBackend,
}


def default_backends() -> list[str]:
    names = ["kvc", "kvc-dict", KvcTopBackend.name, "kvc-core"]
    if dynamo_radix_tree() is not None:
        names += ["dynamo", "dynamo-native", DynamoTopBackend.name]
    return names


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def replay(stream: Stream, backend_name: str, check: bool = True) -> dict[str, Any]:
    """Replay ``stream`` through a fresh backend; every call timed, every answer checked
    (``check``) between the calls, outside their timing."""
    be = BACKENDS[backend_name](stream)
    prepared = be.prepare()
    query, store, remove = be.calls()
    fns = (query, store, remove)
    times: tuple[list[int], list[int], list[int]] = ([], [], [])
    expected = be.expected()
    answer = be.answer
    mismatches = 0
    first_bad: list[int] = []
    nrows: list[int] = []
    clock = time.perf_counter_ns
    wall0 = time.perf_counter()
    for kind, qi, args in prepared:
        fn = fns[kind]
        t0 = clock()
        result = fn(*args)
        t1 = clock()
        times[kind].append(t1 - t0)
        if kind == Q:
            nrows.append(be.rows(result))
        if check and kind == Q and answer(result) != expected[qi]:
            mismatches += 1
            if len(first_bad) < 5:
                first_bad.append(qi)
    wall = time.perf_counter() - wall0
    mem = be.nbytes()
    phases = getattr(be, "phases", None)
    be.close()
    busy = sum(map(sum, times)) / 1e9
    n_ops = sum(map(len, times))
    out: dict[str, Any] = {
        "backend": backend_name,
        "ops": n_ops,
        "busy_s": round(busy, 4),
        "wall_s": round(wall, 3),
        "ops_per_s": n_ops / busy if busy else 0.0,
        "query_p50_us": quantile(times[Q], 0.5) / 1e3,
        "query_p99_us": quantile(times[Q], 0.99) / 1e3,
        "store_p50_us": quantile(times[STORE], 0.5) / 1e3,
        "store_p99_us": quantile(times[STORE], 0.99) / 1e3,
        "remove_p50_us": quantile(times[REMOVE], 0.5) / 1e3,
        "remove_p99_us": quantile(times[REMOVE], 0.99) / 1e3,
        "query_s": sum(times[Q]) / 1e9,
        "event_s": (sum(times[STORE]) + sum(times[REMOVE])) / 1e9,
        "mismatches": mismatches,
        "first_mismatches": first_bad,
        "rows_mean": sum(nrows) / len(nrows) if nrows else 0.0,
        "rows_max": max(nrows, default=0),
        "checked": check,
    }
    if phases is not None:
        out.update({f"phase_{k}": round(v, 4) for k, v in phases.items()})
    if mem is not None:
        out.update(mem)
        out["bytes_per_pair"] = mem["nbytes"] / mem["pairs"] if mem["pairs"] else 0.0
    return out


def run(
    stream: Stream, backends: Sequence[str], repeats: int = 1, check: str = "inline"
) -> dict[str, list[dict[str, Any]]]:
    """Replay ``stream`` ``repeats`` times through each backend, alternating (the order
    rotates each round); returns every run per backend.

    ``check="inline"``: every timed run checks every answer between its calls.
    ``check="separate"``: the timed runs do not check; each backend replays the stream
    once more, checking every answer, and every timed run reports that replay's
    mismatches. Checking a wide answer is Python work per row (a 7,000-row answer: 7,000
    objects) that evicts the index from the caches before the next timed call (a store
    after it: 49 µs instead of 9 µs on the development machine), so the separate mode
    times the backends as a router would see them; the stream and the backends are
    deterministic, so the checked replay gives the timed runs' answers."""
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    order = list(backends)
    for r in range(repeats):
        rot = order[r % len(order) :] + order[: r % len(order)]
        for b in rot:
            gc.collect()
            runs[b].append(replay(stream, b, check=check == "inline"))
    if check == "separate":
        for b in order:
            gc.collect()
            chk = replay(stream, b)
            for x in runs[b]:
                x["mismatches"] = chk["mismatches"]
                x["first_mismatches"] = chk["first_mismatches"]
                x["checked"] = "separate"
    return runs


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in runs)
    out["mismatches"] = max(r["mismatches"] for r in runs)
    out["runs"] = len(runs)
    return out


# ---------------------------------------------------------------------------------------
# command line


def _fmt_rate(x: float) -> str:
    return f"{x / 1000:.2f}k" if x >= 1000 else f"{x:.0f}"


def _fmt_us(x: float) -> str:
    return f"{x / 1000:.2f} ms" if x >= 1000 else f"{x:.0f} µs"


def report_rows(stream: Stream, meds: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    c = stream.counts()
    for b, m in meds.items():
        # a top-k backend against Dynamo's top-k (.scores + nlargest), the native result
        # against Dynamo's (find_matches alone), the others against Dynamo's .scores
        peer = PEERS.get(b, "dynamo")
        ref = meds.get(peer) or meds.get("dynamo")
        ratio = f"{m['ops_per_s'] / ref['ops_per_s']:.2f}x" if ref and ref is not m else ""
        rows = f"{m['rows_mean']:.1f} / {m['rows_max']}" if m.get("rows_max") is not None else "-"
        bpp = f"{m['bytes_per_pair']:.1f}" if "bytes_per_pair" in m else "-"
        lines.append(
            f"| {stream.label} | {stream.workers:,} | {stream.policy} | "
            f"{stream.hit_ratio:.3f} | {c['ops']:,} | {b} | {_fmt_rate(m['ops_per_s'])} | "
            f"{ratio} | {_fmt_us(m['query_p50_us'])} / {_fmt_us(m['query_p99_us'])} | "
            f"{_fmt_us(m['store_p50_us'])} / {_fmt_us(m['store_p99_us'])} | {rows} | {bpp} | "
            f"{m['mismatches']} |"
        )
    return lines


#: The Dynamo backend each backend's "vs Dynamo" ratio is taken against (else ``dynamo``).
PEERS = {"kvc-core": "dynamo-native", f"kvc-top{TOP_K}": f"dynamo-top{TOP_K}"}

HEADER = (
    "| trace | workers | policy | hit ratio | ops | backend | ops/s | vs Dynamo | "
    "query p50 / p99 | store p50 / p99 | rows per answer (mean / max) | "
    "B per (worker, block) | mismatches |\n"
    "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | --- | --- | ---: | ---: | ---: |"
)


SERVER_HEADER = (
    "| trace | workers | policy | service | top_k | pace | ops/s | event batches/s | "
    "drain after the last publish | queries/s | query p50 / p99 (round trip) | "
    "floor p50 / p99, queries/s (bare ASGI app) | server p50 / p99 | "
    "service CPU per op (event batch or query) | answer bytes | "
    "event-to-visible p50 / p99 | losses | mismatches at quiescence | "
    "/predict p50 / p99 (confirmed, expired, contradicted) |\n"
    "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | "
    "---: | ---: | --- | ---: | ---: | --- |"
)


def _pair_us(r: dict[str, Any], key: str) -> str:
    p50, p99 = r.get(f"{key}_p50_us"), r.get(f"{key}_p99_us")
    return "-" if p50 is None else f"{_fmt_us(p50)} / {_fmt_us(p99)}"


def server_row(stream: Stream, r: dict[str, Any]) -> str:
    pace = "saturation" if not r["pace"] else f"x{r['pace']:g}"
    if "error" in r:
        svc = r.get("backend", "kv-conductor")
        return f"| {stream.label} | {stream.workers:,} | {stream.policy} | {svc} | " + (
            f"{r.get('top_k') or 'all'} | {pace} | not run: {r['error']} |"
        )
    lag = "-"
    if r.get("lag_p50_ms") is not None:
        lag = f"{r['lag_p50_ms']:.1f} / {r['lag_p99_ms']:.1f} ms"
    checked = f"{r['mismatches']} of {r['checked']:,}" if r.get("checked") else "-"
    floor = _pair_us(r, "floor")
    if r.get("floor_queries_per_s"):
        floor += f", {_fmt_rate(r['floor_queries_per_s'])} q/s"
    return (
        f"| {stream.label} | {stream.workers:,} | {stream.policy} | {r['backend']} | "
        f"{r.get('top_k') or 'all'} | {pace} | {_fmt_rate(r['ops_per_s'])} | "
        f"{_fmt_rate(r['events_per_s'])} | {r['drain_after_last_publish_s']:.2f} s | "
        f"{_fmt_rate(r['queries_per_s'])} | {_pair_us(r, 'query')} | {floor} | "
        f"{_pair_us(r, 'server')} | {_fmt_us(r.get('server_cpu_us_per_op') or 0)} | "
        f"{r.get('answer_bytes_mean', 0):,} | {lag} | "
        f"{r['gaps'] + r['losses'] + r['dropped']} | {checked} | "
        f"{_predict_cell(r)} |"
    )


def _predict_cell(r: dict[str, Any]) -> str:
    """``--server-predictions``: the /predict round trips and what became of them."""
    if not r.get("predicts"):
        return "-"
    c = r["prediction_outcomes"]
    return (
        f"{_pair_us(r, 'predict')} "
        f"({c.get('confirmed', 0):,}, {c.get('expired', 0):,}, {c.get('contradicted', 0):,})"
    )


def server_runs_of(stream: Stream, requests: Sequence[Request], args: Any) -> Iterable[dict]:
    """``--server``'s runs of one stream: per round, per PACE, kv-conductor once per
    ``--server-top-k`` and Dynamo's indexer service once (``--server-dynamo``), the order
    of the services rotating each round; a size that does not fit the machine is a row
    with its reason."""
    from bench.trace_server import DoesNotFit, run_server

    targets: list[tuple[Any, int | None]] = [(None, k or None) for k in args.server_top_k]
    if args.server_predictions:
        targets.append(("predictions", None))
    if args.server_dynamo:
        from bench.trace_dynamo_server import DynamoIndexer, available

        if not available():
            raise SystemExit("--server-dynamo: ai-dynamo-runtime is not installed")
        targets.append((DynamoIndexer, None))
    if args.server_floor_ingest:
        targets.extend(("floor", k or None) for k in args.server_top_k)
    if args.server_floor_sources:
        targets.extend(("floor-sources", k or None) for k in args.server_top_k)
    sizes: dict[tuple[float, int | None], int] = {}  # kv-conductor's mean answer bytes
    for r in range(args.server_rounds):
        for pace in args.server or [10.0, 0.0]:
            for target, top_k in targets[r % len(targets) :] + targets[: r % len(targets)]:
                kw: dict[str, Any] = {} if target is None else {"target": target}
                if target == "predictions":
                    kw = {"predictions": True, "prediction_ttl": args.prediction_ttl_s}
                elif target in ("floor", "floor-sources"):  # kv-conductor's last mean size
                    if (pace, top_k) not in sizes:  # its kv-conductor run did not answer
                        why = "no kv-conductor answer size to mirror (its run did not answer)"
                        yield {
                            "backend": "floor + ingest" if target == "floor" else "floor + sources",
                            "pace": pace,
                            "top_k": top_k,
                            "error": why,
                            "mismatches": 0,
                        }
                        continue
                    floor = _ingest_floor(sizes[pace, top_k], target == "floor-sources")
                    kw = {"target": floor, "floor": False}
                try:
                    row = run_server(
                        stream,
                        requests,
                        pace=pace,
                        publishers=args.publishers,
                        clients=args.clients,
                        top_k=top_k,
                        **kw,
                    )
                except DoesNotFit as ex:
                    row = {"pace": pace, "top_k": top_k, "error": str(ex), "mismatches": 0}
                if target is None and "answer_bytes_mean" in row:
                    sizes[pace, top_k] = row["answer_bytes_mean"]
                yield row


def _ingest_floor(size: int, sources: bool) -> Callable[..., Any]:
    """:class:`bench.trace_services.IngestFloor` answering ``size`` bytes, as a target
    (``sources``: a SUB per engine)."""
    from bench.trace_services import IngestFloor

    return lambda workers, logdir, dp: IngestFloor(workers, logdir, dp, size, sources)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="a Mooncake JSONL trace")
    src.add_argument("--shape", choices=sorted(SHAPES), default="conversation")
    ap.add_argument("--requests", type=int, help="first N requests (trace) / N generated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, nargs="+", default=[64])
    ap.add_argument("--dp", type=int, default=1, help="DP ranks per engine instance")
    ap.add_argument("--capacity", type=int, default=2048, help="LRU blocks per worker")
    ap.add_argument("--policy", nargs="+", default=["round-robin", "kv-aware"], choices=POLICIES)
    ap.add_argument(
        "--backends",
        help="comma-separated, of: "
        + ",".join(BACKENDS)
        + " (default: "
        + ",".join(default_backends())
        + ")",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="in-process replays per backend (0: none)"
    )
    ap.add_argument("--prefill-tps", type=float, default=10_000.0)
    ap.add_argument("--decode-tps", type=float, default=50.0)
    ap.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="compress the trace's clock for the load model (more requests in flight)",
    )
    ap.add_argument(
        "--server",
        type=float,
        nargs="*",
        metavar="PACE",
        help="also play each stream against a real kv-conductor server, once per PACE: the "
        "trace's pace times PACE, 0 = as fast as possible (default: 10 0)",
    )
    ap.add_argument(
        "--predictions",
        type=float,
        nargs="*",
        metavar="CLOCK_SCALE",
        help="only measure KV-aware routing with and without the router's predictions, the "
        "engines' publish delay modelled (bench/trace_predict.py), the trace's clock divided "
        "by each CLOCK_SCALE (default: 1 10 100)",
    )
    ap.add_argument(
        "--prediction-ttl-s",
        type=float,
        default=2.0,
        help="--predictions, --server-predictions: their TTL",
    )
    ap.add_argument(
        "--server-top-k",
        type=int,
        nargs="+",
        default=[0],
        metavar="K",
        help="--server: the queries ask top_k=K, once per K (0: the whole answer)",
    )
    ap.add_argument(
        "--server-dynamo",
        action="store_true",
        help="--server: also play each PACE against Dynamo's indexer service "
        "(python -m dynamo.indexer, bench/trace_dynamo_server.py), whole answers",
    )
    ap.add_argument(
        "--server-floor-ingest",
        action="store_true",
        help="--server: also play each PACE and top_k against the floor of a service "
        "that ingests (bench/floor_app.py's ingest_app: the same uvicorn receiving every "
        "event and answering kv-conductor's mean answer size), after kv-conductor",
    )
    ap.add_argument(
        "--server-floor-sources",
        action="store_true",
        help="--server: as --server-floor-ingest, with a SUB per engine on kv-conductor's "
        "own ingest loop that only counts each message (the floor of a service that knows "
        "which engine sent it)",
    )
    ap.add_argument(
        "--server-predictions",
        action="store_true",
        help="--server: also play each PACE with the router's prediction posted after each "
        "query (POST /predict_by_hash, for the engine the request went to), timed apart",
    )
    ap.add_argument(
        "--server-rounds", type=int, default=1, help="--server: rounds, the order rotating"
    )
    ap.add_argument(
        "--server-args",
        default="",
        help='--server: more kv-conductor flags, one string (e.g. "--workers 2")',
    )
    ap.add_argument("--publishers", type=int, default=4, help="--server: publisher processes")
    ap.add_argument("--clients", type=int, default=2, help="--server: query client processes")
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--stats", action="store_true", help="print the trace statistics only")
    ap.add_argument("--write-trace", help="write the (generated) trace as JSONL and exit")
    ap.add_argument(
        "--check",
        choices=("inline", "separate"),
        default="inline",
        help="inline: the timed runs check every answer between calls; separate: one "
        "more replay per backend checks them, the timed runs do not (see run())",
    )
    ap.add_argument(
        "--server-malloc",
        action="store_true",
        help="in process, tune glibc's malloc as kv-conductor does at start "
        "(kvconductor.serve.tuning.tune_malloc: freed answer buffers reused, not trimmed)",
    )
    args = ap.parse_args(argv)
    if args.server_args:
        from bench import trace_services

        trace_services.SERVER_ARGS[:] = shlex.split(args.server_args)
    if args.server_malloc:
        from kvconductor.serve.tuning import tune_malloc

        print(json.dumps({"server_malloc": tune_malloc()}), flush=True)

    if args.trace:
        requests = load_trace(args.trace, args.requests)
        label = Path(args.trace).stem
    else:
        requests = generate(args.shape, args.seed, args.requests)
        label = f"{args.shape} (generated)"
    print(json.dumps({"trace": label, **trace_stats(requests)}), flush=True)
    if args.write_trace:
        write_trace(requests, args.write_trace)
        return 0
    if args.stats:
        return 0
    if args.predictions is not None:
        from bench.trace_predict import HEADER as PHEADER
        from bench.trace_predict import compare, rows

        ptable = []
        for workers in args.workers:
            runs = compare(
                requests,
                workers,
                args.capacity,
                args.predictions or [1.0, 10.0, 100.0],
                ttl=args.prediction_ttl_s,
                prefill_tps=args.prefill_tps,
                decode_tps=args.decode_tps,
            )
            for r in runs:
                print(json.dumps(r), flush=True)
            ptable += rows(runs)
        print()
        print(PHEADER)
        print("\n".join(ptable))
        return 0
    backends = args.backends.split(",") if args.backends else default_backends()
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b!r}")
    for b in backends:
        if b.startswith("dynamo") and dynamo_radix_tree() is None:
            ap.error(f"backend {b}: ai-dynamo-runtime is not installed")
    results = []
    table: list[str] = []
    server_table: list[str] = []
    for workers in args.workers:
        for policy in args.policy:
            stream = record(
                requests,
                workers,
                args.capacity,
                policy,
                dp=args.dp,
                prefill_tps=args.prefill_tps,
                decode_tps=args.decode_tps,
                speedup=args.speedup,
                label=label,
            )
            info = {
                "trace": label,
                "workers": workers,
                "capacity": args.capacity,
                "policy": policy,
                "speedup": args.speedup,
                "hit_ratio": round(stream.hit_ratio, 4),
                "blocks_stored": stream.blocks_stored,
                "blocks_removed": stream.blocks_removed,
                "record_s": round(stream.record_s, 1),
                "record_mismatches": stream.record_mismatches,
                **stream.counts(),
            }
            print(json.dumps(info), flush=True)
            gc.freeze()  # the recorded stream stays out of the collector's scans
            runs = run(stream, backends, args.repeats, args.check) if args.repeats > 0 else {}
            meds = {b: median_of(r) for b, r in runs.items()}
            for b, m in meds.items():
                print(json.dumps({"backend": b, **{k: v for k, v in m.items() if k != "backend"}}))
            rows = report_rows(stream, meds)
            table.extend(rows)
            print("\n".join(rows), flush=True)
            server_runs = []
            if args.server is not None:
                for sr in server_runs_of(stream, requests, args):
                    print(json.dumps(sr), flush=True)
                    server_runs.append(sr)
                    row = server_row(stream, sr)
                    server_table.append(row)
                    print(row, flush=True)
            results.append({**info, "runs": runs, "server": server_runs})
            del stream, runs
            gc.unfreeze()
            gc.collect()
    print()
    print(HEADER)
    print("\n".join(table))
    if server_table:
        print()
        print(SERVER_HEADER)
        print("\n".join(server_table))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = sum(
        r["record_mismatches"]
        + sum(x["mismatches"] for v in r["runs"].values() for x in v)
        + sum(x["mismatches"] for x in r["server"])
        for r in results
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
