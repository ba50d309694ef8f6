"""``POST /predict`` and ``POST /predict_by_hash``: a router reports the (instance, DP) it
chose for a prompt (docs/api.md, "POST /predict").

The body is the one of ``/query`` (``/query_by_hash``), JSON or a MessagePack map, read by
the same parser (same fields, limits and hashing: model, tenant, LoRA, block size), plus
``instance_id`` and ``dp_rank``. The prompt's full blocks (a trailing partial block is
not stored by an engine, so not predicted) are hashed here and handed to the journal as a
:class:`~kvconductor.schema.PredictRecord`, like every HTTP mutation: applied on the
ingest thread (``--workers N``: the owner's; ``--state-url``: every replica's).
Bearer token like the other mutations; errors are ``{"error": ...}`` in the request's
encoding.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import falcon
import falcon.asgi
import msgspec

from kvconductor._hash import DEFAULT_SEED, hash_blocks, lora_seed
from kvconductor.http.resource import Resource
from kvconductor.schema import (
    PredictRecord,
    PredictResponse,
    decode_error_message,
    json_encoder,
    msgpack_encoder,
    predict_target_decoders,
)
from kvconductor.state.conductor import Conductor, InstanceNotRegistered, StateUnavailable
from kvconductor.wire import (
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    WireError,
    is_msgpack_content_type,
    parse_query,
)

__all__ = ["PredictResource", "prediction_of"]

log = logging.getLogger("kvconductor.http")


def prediction_of(body: bytes, msgpack: bool, by_hash: bool) -> PredictRecord:
    """The prediction a request body says: its query part read as ``/query``
    (``/query_by_hash``) reads it, the prompt's full blocks hashed with the query's seed
    (the LoRA adapter's when named); :class:`WireError` for a bad body."""
    model, block_size, tenant, values, lora_name = parse_query(body, msgpack, by_hash)
    try:
        target = predict_target_decoders[msgpack].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as ex:
        raise WireError(decode_error_message(ex)) from None
    if by_hash:
        hashes = values
    else:
        full = len(values) - len(values) % block_size
        seed = lora_seed(lora_name) if lora_name else DEFAULT_SEED
        hashes = hash_blocks(values[:full], block_size, seed) if full else array("Q")
    return PredictRecord(model, tenant, target.instance_id, target.dp_rank, hashes.tolist())


class PredictResource(Resource[Conductor]):
    """``POST /predict`` (``by_hash=False``) and ``POST /predict_by_hash``: 200
    ``{"status": "ok", "predicted_blocks": N, "ttl_s": T}``; 400 for a bad body, 401
    without the token, 404 for an instance no registration names, 413 over the body
    limit, 503 while the state cannot be changed."""

    def __init__(self, conductor: Conductor, *, by_hash: bool, **kw: Any) -> None:
        super().__init__(conductor, **kw)
        self.by_hash = by_hash

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        msgpack = is_msgpack_content_type(req.content_type)
        if not self._authorized(req, resp):
            return
        body = await self._body(req, resp, msgpack)
        if body is None:
            return
        try:
            rec = await self._offload(body, prediction_of, body, msgpack, self.by_hash)
        except WireError as ex:
            kind = "msgpack" if msgpack else "JSON"
            return self._bad(req, resp, f"invalid {kind} request body: {ex}", msgpack)
        try:
            n = await self.conductor.mutate("predict", json_encoder.encode(rec), rec)
        except StateUnavailable as ex:
            return self._bad(req, resp, str(ex), msgpack, status=503)
        except InstanceNotRegistered as ex:
            return self._bad(req, resp, str(ex), msgpack, status=404)
        out = PredictResponse("ok", n, self.conductor.predictions.limits.ttl)
        resp.status = falcon.HTTP_200
        resp.content_type = MSGPACK_CONTENT_TYPE if msgpack else JSON_CONTENT_TYPE
        resp.data = (msgpack_encoder if msgpack else json_encoder).encode(out)
