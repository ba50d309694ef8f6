"""``POST /query`` and ``POST /query_by_hash`` as Falcon resources: the parse, match and
encode of a query (:meth:`QueryResource.answer`, which every door calls through
:mod:`kvconductor.http.querydoor`), its metrics, and the warnings of queries that cannot
match (:class:`MissWarnings`, shared with ``/explain``). Falcon's own ``POST``
(:meth:`QueryResource.on_post`) is that door too, over the body Falcon read.

Errors are encoded like the request (MessagePack when the request was); data errors
are 400, an unknown (model, tenant) 404 (docs/api.md, POST /query).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, cast

import falcon.asgi

from kvconductor._hash import DEFAULT_SEED, lora_seed
from kvconductor.extrakeys import ExtraKeysError, extra_local_hashes
from kvconductor.http import querydoor
from kvconductor.http.metrics import DeferredMetrics, QueryMetrics
from kvconductor.http.resource import Resource
from kvconductor.http.responses import content_type
from kvconductor.index import QueryResult
from kvconductor.ingest.freshness import FreshnessUnavailable
from kvconductor.schema import FRESHNESS_FIELD
from kvconductor.state.protocols import QuerySource
from kvconductor.wire import (
    WireError,
    encode_error,
    encode_fresh,
    encode_result,
    is_msgpack_content_type,
    parse_query_ext,
)

__all__ = ["FRESHNESS_TENANT", "FRESHNESS_UNAVAILABLE", "MissWarnings", "QueryResource"]

log = logging.getLogger("kvconductor.http")

#: A ``"freshness"`` query whose tenant is named ``freshness`` (the answer's own
#: ``"freshness"`` member would be a second key of that name).
FRESHNESS_TENANT = (
    "tenant_id 'freshness' cannot be answered with freshness: the answer's "
    '"freshness" member would repeat the tenant\'s key'
)
#: A ``"freshness"`` query where the states of the sources are not known.
FRESHNESS_UNAVAILABLE = "freshness is not available"


class QueryResource(Resource[QuerySource]):
    """``POST /query`` (``by_hash=False``) and ``POST /query_by_hash``, answered from a
    :class:`~kvconductor.state.protocols.QuerySource` (the conductor, or a worker's
    shared view)."""

    def __init__(
        self,
        conductor: QuerySource,
        *,
        by_hash: bool,
        metrics: QueryMetrics | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(conductor, **kw)
        self.by_hash = by_hash
        self.metrics = metrics or QueryMetrics()
        #: ``kvconductor_query_seconds{route}`` of this route.
        self.seconds = self.metrics.route_seconds["/query_by_hash" if by_hash else "/query"]
        #: ``kvconductor_query_errors_total{route}``: answers >= 400 but 404 (a miss).
        self.errors = self.metrics.route_errors["/query_by_hash" if by_hash else "/query"]
        #: Warnings of queries that cannot match (``/query``: block size not registered).
        self.misses = MissWarnings()

    def answer(
        self,
        body: bytes,
        msgpack: bool,
        metrics: QueryMetrics | DeferredMetrics | None = None,
        fresh: bool = False,
    ) -> querydoor.RouteAnswer:
        """Parse, match and encode: ``(status, body, message or None, omitted or
        None)``. With a 4xx the message is what to log; with a 200 it is a warning for the
        ``X-KV-Conductor-Warning`` header (a query that cannot match, logged here);
        ``omitted``, with ``top_k``, the rows tied at the cut it left out (the
        ``X-KV-Conductor-Top-K-Omitted`` header).
        ``metrics``: where the answer's blocks and misses are counted (default: the
        route's; off the event loop a :class:`~kvconductor.http.metrics.DeferredMetrics`).
        ``fresh``: the answer says how fresh it is (``?freshness=true``; the body's
        ``"freshness": true`` too)."""
        try:
            model, block_size, tenant, values, lora_name, top_k, instances, in_body, extras = (
                parse_query_ext(body, msgpack, self.by_hash)
            )
            # LoRA blocks are hashed with the adapter's seed, so base-model queries never see
            # them and the other way round.
            seed = lora_seed(lora_name) if lora_name else DEFAULT_SEED
            if extras is not None:  # the blocks' extra keys mixed in (docs/api.md)
                values = extra_local_hashes(values, block_size, seed, extras, self.by_hash)
        except (WireError, ExtraKeysError) as ex:
            return self._invalid(str(ex), msgpack)
        fresh = fresh or in_body
        if fresh and tenant == FRESHNESS_FIELD:
            return self._invalid(FRESHNESS_TENANT, msgpack)
        m = self.metrics if metrics is None else metrics
        index = self.conductor.get_index(model, tenant)
        if index is None:
            m.unknown_index.inc()
            msg = f"no indexer for model={model} tenant={tenant}"
            return 404, encode_error(msg, msgpack), msg, None
        # PERF: the answer stays in the core's C arrays (QueryResult over MatchRows): the
        # metrics take its C sums and the encoder renders it without a Python object per
        # (instance, DP) row.
        if self.by_hash:
            # NOTE: the request's block_size is ignored (but to place extra keys); counts are
            # in blocks (docs/api.md, POST /query_by_hash).
            result = index.query_by_hash(values, top_k=top_k, instances=instances)
            if len(result):
                m.count_blocks(*result.sums())
            else:
                m.no_match.inc()
            return self._ok(result, model, tenant, 1, msgpack, fresh, None, top_k)
        if extras is None:
            result = index.query(values, block_size, seed, top_k=top_k, instances=instances)
        else:  # ``values``: the blocks' local hashes, their extra keys mixed in
            result = index.query_by_hash(values, top_k=top_k, instances=instances)
        warning = None
        if len(result):
            m.count_blocks(*result.sums())
        else:
            sizes = self.conductor.block_sizes.get((model, tenant))
            if sizes and block_size not in sizes:
                m.block_size_mismatch.inc()
                warning = self.misses.block_size_mismatch(model, tenant, block_size, sizes)
            elif lora_name and seed not in self.conductor.lora_seeds.get((model, tenant), ()):
                m.unknown_lora.inc()
                warning = self.misses.unknown_lora(model, tenant, lora_name)
            else:
                m.no_match.inc()
        return self._ok(result, model, tenant, block_size, msgpack, fresh, warning, top_k)

    def _ok(
        self,
        result: QueryResult,
        model: str,
        tenant: str,
        block_size: int,
        msgpack: bool,
        fresh: bool,
        warning: str | None = None,
        top_k: int | None = None,
    ) -> querydoor.RouteAnswer:
        omitted = None if top_k is None else result.omitted
        if not fresh:
            return 200, encode_result(result, tenant, block_size, msgpack), warning, omitted
        try:
            table = self.conductor.freshness(model, tenant)
        except FreshnessUnavailable as ex:
            msg = f"{FRESHNESS_UNAVAILABLE}: {ex}"
            return 503, encode_error(msg, msgpack), msg, None
        if table is None:
            msg = FRESHNESS_UNAVAILABLE
            return 501, encode_error(msg, msgpack), msg, None
        fr = (table.groups(result.names.keys), time.time(), table.tail[msgpack])
        return 200, encode_fresh(result, tenant, block_size, msgpack, fr), warning, omitted

    @staticmethod
    def _invalid(detail: str, msgpack: bool) -> querydoor.RouteAnswer:
        return (
            400,
            encode_error(
                f"invalid {'msgpack' if msgpack else 'JSON'} request body: {detail}", msgpack
            ),
            detail,
            None,
        )

    async def respond(
        self, body: bytes | bytearray | list[bytes], msgpack: bool, fresh: bool = False
    ) -> querydoor.RouteAnswer:
        """:meth:`answer`, in a worker thread for a large body (the front door's call).
        ``body`` may be the chunks of a large body: they are joined in that thread.
        PERF: a bytearray is parsed as it is (the parsers take any buffer), not copied;
        ``bytes.join`` lets go of the GIL for a large join, so joining 4 MB there does
        not stop the event loop for the ~0.5 ms of the copy."""
        if isinstance(body, list):
            fn: Any = self._answer_chunks
        else:
            fn = self.answer
            if len(body) <= self.large_body_bytes:
                return self.answer(cast(bytes, body), msgpack, None, fresh)
        loop = asyncio.get_running_loop()
        deferred = DeferredMetrics()  # QueryMetrics has one writer: this loop
        out = await loop.run_in_executor(
            self.conductor.executor, fn, body, msgpack, deferred, fresh
        )
        deferred.replay(self.metrics)
        return cast(querydoor.RouteAnswer, out)

    def _answer_chunks(
        self, chunks: list[bytes], msgpack: bool, metrics: DeferredMetrics, fresh: bool = False
    ) -> querydoor.RouteAnswer:
        return self.answer(b"".join(chunks), msgpack, metrics, fresh)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """The app's own ``POST``, when no front door stands before it: the one query
        door (:mod:`kvconductor.http.querydoor`) over the body Falcon read; CORS is the
        app's (:class:`~kvconductor.http.api.OriginPolicy`), ``Date`` its server's."""
        t0 = time.perf_counter()
        msgpack = is_msgpack_content_type(req.content_type)
        body = await self._body(req, resp, msgpack)
        if body is None:  # its 413 or 400, answered and logged: counted here
            querydoor.account(self, req.path, 400, None, t0)
            return
        q: querydoor.Query = (self, req.path, msgpack, None, t0, False)
        query_string = req.query_string.encode("latin-1")
        status, headers, data = await querydoor.answer_target(q, body, query_string)
        resp.status = status
        for name, value in headers:
            if name not in _FRAMED:
                resp.set_header(name.decode("latin-1"), value.decode("latin-1"))
        resp.content_type = content_type(msgpack)
        resp.data = data


#: Headers Falcon's response writes itself (from ``content_type`` and ``data``).
_FRAMED = (b"content-type", b"content-length")


class MissWarnings:
    """Silent misses made loud: the sentence of a query that cannot match, logged at WARN
    at most once per (model, tenant, block size or LoRA name) per ``interval`` seconds.
    Thread-safe (large queries are answered on worker threads)."""

    def __init__(self, interval: float = 60.0, clock=time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def block_size_mismatch(
        self, model: str, tenant: str, block_size: int, registered: frozenset[int]
    ) -> str:
        sizes = ", ".join(str(s) for s in sorted(registered))
        sentence = (
            f"block_size {block_size} matches no registration of model={model} "
            f"tenant={tenant} (registered block sizes: {sizes}); blocks are hashed per "
            "block size, so this query cannot find any"
        )
        return self._warn((model, tenant, block_size), sentence)

    def unknown_lora(self, model: str, tenant: str, lora_name: str) -> str:
        sentence = (
            f"lora_name {lora_name!r} was carried by no event of model={model} "
            f"tenant={tenant}; blocks of a LoRA adapter are hashed with its name, so this "
            "query cannot find any (does the engine publish lora_name? vLLM 0.14+, "
            "SGLang 0.5.22+)"
        )
        return self._warn((model, tenant, "lora:" + lora_name), sentence)

    def _warn(self, key: tuple, sentence: str) -> str:
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            due = last is None or now - last >= self.interval
            if due:
                if len(self._last) > 10_000:  # bounded: forget everything, warn again
                    self._last.clear()
                self._last[key] = now
        if due:
            log.warning("query cannot match: %s", sentence)
        return sentence
