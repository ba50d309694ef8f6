"""The OpenAPI 3.1 description of the HTTP API, served as ``GET /openapi.json``.

Bodies and answers come from the msgspec declarations of :mod:`kvconductor.schema`
(``msgspec.json.schema_components``); this module only says which route takes and
answers which shape, with which status codes. Two things msgspec cannot see are added
here: the query bodies' optional ``lora_name`` (:data:`~kvconductor.schema.LORA_FIELD`,
not a Struct field), the extension fields ``top_k``, ``instances`` and ``freshness``
(:data:`~kvconductor.schema.EXTENSION_FIELDS`, marked ``x-kvconductor-extension``), what
``freshness`` adds to an answer, and
``tenant_id: null`` meaning the default tenant. The query routes
take and answer the same shapes as JSON and as MessagePack; MessagePack also takes the
positional form and packed u32 tokens (docs/api.md), which JSON Schema cannot describe.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvconductor import __version__, schema, schema_dynamo, schema_mooncake
from kvconductor.extrakeys import MM_INPUTS_MAX, MmInput
from kvconductor.wire import JSON_CONTENT_TYPE, MSGPACK_CONTENT_TYPE

_REF = "#/components/schemas/{name}"
_STRUCTS = (
    schema.RegisterRequest,
    schema.UnregisterRequest,
    schema.StatusResponse,
    schema.ErrorResponse,
    schema.QueryRequest,
    schema.QueryByHashRequest,
    MmInput,
    schema.KvEventBatch,
    schema.EventsResponse,
    schema.ReadyResponse,
    schema.NotReadyResponse,
    schema.ExplainResponse,
    schema.RecentWarning,
    schema.DpFreshness,
    schema.FreshnessSummary,
    schema.FreshnessDocument,
    schema.PredictTarget,
    schema.PredictResponse,
)
_ERRORS = {
    "400": "malformed body, wrong type, missing field or out-of-range number",
    "401": "missing or wrong bearer token (only with --api-key)",
    "403": "browser Origin not allowed (--allow-origin)",
    "404": "unknown instance, or no index for (model, tenant)",
    "413": "body over --max-body-mb",
    "422": "engine_url: the engine's GET /kv_event_sources failed or cannot be used "
    "(not served, not JSON, unknown shape, redirect, over 1 MiB, no answer in time, "
    "endpoints the URL rules refuse)",
    "500": "unexpected failure",
    "503": "the change cannot be taken now: --max-sources or a socket (registration), or "
    "the state store is unreachable (--state-url)",
}


def _self_route() -> dict[str, Any]:
    """``GET /openapi.json`` of a document (each port serves its own)."""
    return {
        "get": {
            "summary": "this document",
            "responses": {
                "200": {
                    "description": "OpenAPI 3.1",
                    "content": {JSON_CONTENT_TYPE: {"schema": {"type": "object"}}},
                }
            },
        }
    }


def _ref(cls: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=cls.__name__)}


def _content(body: dict[str, Any], *, both: bool) -> dict[str, Any]:
    types = (JSON_CONTENT_TYPE, MSGPACK_CONTENT_TYPE) if both else (JSON_CONTENT_TYPE,)
    return {t: {"schema": body} for t in types}


def _errors(codes: str, *, both: bool = False) -> dict[str, Any]:
    err = _content(_ref(schema.ErrorResponse), both=both)
    return {c: {"description": _ERRORS[c], "content": err} for c in codes.split()}


def _post(summary: str, request: type, ok: str, answer: dict, errors: str, both=False):
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _content(_ref(request), both=both)},
            "responses": {
                ok: {"description": "done", "content": _content(answer, both=both)},
                **_errors(errors, both=both),
            },
        }
    }


def _predict(summary: str, query: type) -> dict[str, Any]:
    """``POST /predict`` (``/predict_by_hash``): the query's body and the chosen DP."""
    body = {"allOf": [_ref(query), _ref(schema.PredictTarget)]}
    route = _post(summary, query, "200", _ref(schema.PredictResponse), "400 401 403 404 413 503")
    route["post"]["requestBody"]["content"] = _content(body, both=True)
    return route


def _query_request(doc: dict[str, Any]) -> None:
    """What the Struct cannot say: ``tenant_id`` may be null, ``lora_name`` optional."""
    props = doc["properties"]
    props["tenant_id"] = {"anyOf": [props["tenant_id"], {"type": "null"}], "default": "default"}
    props[schema.LORA_FIELD] = {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": None,
        "description": "LoRA adapter; null, absent or empty mean the base model",
    }
    props[schema.TOP_K_FIELD] = _extension(
        {"type": "integer", "minimum": 1, "maximum": 2**32 - 1},
        "answer at most top_k (instance, DP) rows, the "
        "deepest by npu+cpu+disk blocks: every row deeper than the top_k-th largest depth, "
        "and of the rows tied at that depth the first by the order of instances when it is "
        "given, else a run of them chosen by the request (the same request, the same "
        "rows); header X-KV-Conductor-Top-K-Omitted: the tied rows left out; null or "
        "absent: every row",
    )
    props[schema.INSTANCES_FIELD] = _extension(
        {"type": "array", "items": {"type": "string"}},
        "answer only these instances (unknown names "
        "are ignored; applied before top_k); null or absent: every instance",
    )
    props[schema.FRESHNESS_FIELD] = _extension(
        {"type": "boolean"},
        "true adds to each answered (instance, DP) "
        "the state and last-event age of its sources (DpMatch.freshness) and to the answer "
        "a summary of the (model, tenant)'s sources (FreshnessSummary, key freshness "
        "beside the tenant); also ?freshness=true on the route",
    )
    props[schema.CACHE_SALT_FIELD] = _extension(
        {"type": "string"},
        "the request's cache_salt, as vLLM mixes it into the first block's hash (docs/api.md, "
        "Block hashing, Extra keys); null, absent or empty: none",
    )
    props[schema.MM_INPUTS_FIELD] = _extension(
        {"type": "array", "maxItems": MM_INPUTS_MAX, "items": _ref(MmInput)},
        "the multimodal inputs (vLLM's MultiModalFeatureSpec: identifier, the mm hash, and "
        "its placeholder tokens from offset, length tokens; none overlapping), mixed into the "
        "hash of each block they overlap as vLLM does (docs/api.md, Block hashing, Extra "
        "keys); null, absent or []: none",
    )


def _extension(value: dict[str, Any], description: str) -> dict[str, Any]:
    """An extension field of the query bodies (not V3): ``value`` or null, null by default."""
    return {
        "anyOf": [value, {"type": "null"}],
        "default": None,
        "description": "Extension (not V3): " + description,
        "x-kvconductor-extension": True,
    }


def _freshness_answer(response: dict[str, Any], components: dict[str, Any]) -> None:
    """What a ``freshness`` query adds to the answer (docs/api.md, "freshness"), and
    ``GET /freshness``'s rows: 5-element arrays, described without ``prefixItems`` (which
    schemathesis, the CI's conformance check, does not take inside ``items``)."""
    response["properties"] = {schema.FRESHNESS_FIELD: _ref(schema.FreshnessSummary)}
    components["DpMatch"]["properties"][schema.FRESHNESS_FIELD] = _ref(schema.DpFreshness)
    components["FreshnessDocument"]["properties"]["dps"]["items"] = {
        "type": "array",
        "minItems": 5,
        "maxItems": 5,
        "description": "[instance_id (string), dp_rank (integer), state (string), newest "
        "event (Unix time) or null, degraded since (Unix time) or null]",
    }


def document() -> dict[str, Any]:
    """The OpenAPI document (a fresh dict each call)."""
    (*_, response), components = msgspec.json.schema_components(
        (*_STRUCTS, schema.QueryResponse), ref_template=_REF
    )
    for cls in (schema.QueryRequest, schema.QueryByHashRequest):
        _query_request(components[cls.__name__])
    _freshness_answer(response, components)
    components["RegisterRequest"]["properties"]["engine_url"]["description"] = (
        "the engine's HTTP base URL (http or https): its GET /kv_event_sources names the "
        "publisher of every DP rank, each registered (docs/engines.md)"
    )
    status = _ref(schema.StatusResponse)
    workers = {
        "type": "object",
        "required": ["workers", "indexer", "sources", "recent_warnings"],
        "properties": {
            **{k: {"type": "array"} for k in ("workers", "indexer", "sources")},
            "recent_warnings": {"type": "array", "items": _ref(schema.RecentWarning)},
            # only with --workers N (docs/api.md, GET /workers)
            "processes": {"type": "object"},
        },
    }
    paths = {
        "/health": {
            "get": {
                "summary": "liveness",
                "responses": {
                    "200": {
                        "description": "the process serves",
                        "content": {"text/plain": {"schema": {"const": "OK"}}},
                    }
                },
            }
        },
        "/register": _post(
            "register one DP rank of an engine or KV pool",
            schema.RegisterRequest,
            "201",
            status,
            "400 401 403 413 422 503",
        ),
        "/unregister": _post(
            "unregister one DP rank",
            schema.UnregisterRequest,
            "200",
            status,
            "400 401 403 404 413 503",
        ),
        "/query": _post(
            "leading blocks held per instance, DP and tier, for token ids",
            schema.QueryRequest,
            "200",
            response,
            "400 404 413",
            both=True,
        ),
        "/query_by_hash": _post(
            "leading blocks held per instance, DP and tier, for local block hashes",
            schema.QueryByHashRequest,
            "200",
            response,
            "400 404 413",
            both=True,
        ),
        "/explain": _post(
            "why each instance and DP did or did not match a /query body",
            schema.QueryRequest,
            "200",
            _ref(schema.ExplainResponse),
            "400 401 413",
            both=True,
        ),
        "/events": _post(
            "apply a batch of KV-cache events (HTTP ingest)",
            schema.KvEventBatch,
            "200",
            _ref(schema.EventsResponse),
            "400 401 403 404 413 500 503",
        ),
        "/predict": _predict(
            "a router's decision: this prompt goes to (instance_id, dp_rank); answered as "
            "held in HBM there for --prediction-ttl-s",
            schema.QueryRequest,
        ),
        "/predict_by_hash": _predict(
            "a router's decision, the prompt as local block hashes", schema.QueryByHashRequest
        ),
        "/workers": {
            "get": {
                "summary": "registrations, indexes and ingest sources",
                "responses": {
                    "200": {"description": "the view", "content": _content(workers, both=False)},
                    **_errors("401"),
                },
            }
        },
        "/freshness": {
            "get": {
                "summary": "the states behind a (model, tenant)'s answers (docs/api.md, freshness)",
                "parameters": [
                    {
                        "name": "model",
                        "in": "query",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1},
                    },
                    {
                        "name": "tenant",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "default": "default"},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "per (instance, DP) with sources of its own: "
                        "[instance_id, dp_rank, state, newest event (wall time) or null, "
                        "degraded since (wall time) or null]; and FreshnessSummary's fields",
                        "content": _content(_ref(schema.FreshnessDocument), both=False),
                    },
                    **_errors("400"),
                },
            }
        },
        "/debug/dump": {
            "get": {
                "summary": "the index and registry as a streamed msgpack dump (docs/dump.md)",
                "responses": {
                    "200": {
                        "description": "the dump: msgpack bin objects, one record each",
                        "content": {
                            MSGPACK_CONTENT_TYPE: {
                                "schema": {"type": "string", "contentEncoding": "binary"}
                            }
                        },
                    },
                    **_errors("401"),
                },
            }
        },
        "/ready": {
            "get": {
                "summary": "readiness: every registered ZeroMQ source connected, none replaying",
                "responses": {
                    "200": {
                        "description": "ready",
                        "content": _content(_ref(schema.ReadyResponse), both=False),
                    },
                    "503": {
                        "description": "sources still connecting or replaying",
                        "content": _content(_ref(schema.NotReadyResponse), both=False),
                    },
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text format 0.0.4)",
                "responses": {
                    "200": {
                        "description": "the exposition",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors("401"),
                },
            }
        },
        "/openapi.json": _self_route(),
    }
    omitted = {
        "description": "only with top_k (extension): the (instance, DP) rows tied at the "
        "cut depth that the answer leaves out",
        "schema": {"type": "integer", "minimum": 0},
        "x-kvconductor-extension": True,
    }
    paths["/query"]["post"]["responses"]["200"]["headers"] = {
        "X-KV-Conductor-Warning": {
            "description": "why this query cannot match (its block size is none of the "
            "(model, tenant)'s registrations); the body is the usual answer",
            "schema": {"type": "string"},
        },
        schema.TOP_K_OMITTED_HEADER: omitted,
    }
    paths["/query_by_hash"]["post"]["responses"]["200"]["headers"] = {
        schema.TOP_K_OMITTED_HEADER: omitted
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kv-conductor",
            "version": __version__,
            "description": "KV-cache index of an LLM inference cluster (docs/api.md)",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


_MOONCAKE_STRUCTS = (
    schema_mooncake.MooncakeRegisterRequest,
    schema_mooncake.MooncakeUnregisterRequest,
    schema_mooncake.MooncakeQueryRequest,
    schema_mooncake.MooncakeRegisterResponse,
    schema_mooncake.MooncakeUnregisterResponse,
    schema_mooncake.MooncakeQueryResponse,
    schema_mooncake.MooncakeError,
)
_MOONCAKE_ERRORS = {
    "400": "malformed body, wrong type, missing field or value Mooncake's conductor refuses "
    "(reason: invalid_json, invalid_value, unsupported, invalid_registration)",
    "401": "missing or wrong bearer token (only with --api-key, unless --mooncake-port-open; "
    "reason: unauthorized)",
    "404": "no such service (instance_id, tenant_id, dp_rank)",
    "405": "wrong method",
    "413": "body over --max-body-mb",
    "500": "a subscription cannot be opened, or an unexpected failure",
}


def _dialect_post(
    summary: str, request: type, answer: type, errors: str, *, dynamo: bool = False
) -> dict[str, Any]:
    """A dialect's ``POST`` route: Mooncake's (JSON or MessagePack, 200) or Dynamo's
    (JSON, its ``ok`` status: 201 for ``/register``)."""
    error: type = schema_mooncake.MooncakeError
    table, both = _MOONCAKE_ERRORS, True
    if dynamo:
        table, error, both = _DYNAMO_ERRORS, schema_dynamo.DynamoError, False
    ok = "201" if dynamo and request is schema_dynamo.DynamoRegisterRequest else "200"
    err = _content(_ref(error), both=both)
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _content(_ref(request), both=both)},
            "responses": {
                ok: {"description": "done", "content": _content(_ref(answer), both=both)},
                **{c: {"description": table[c], "content": err} for c in errors.split()},
            },
        }
    }


def _dialect_document(
    title: str, description: str, structs: tuple, paths: dict[str, Any]
) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__, "description": description},
        "paths": {**paths, "/openapi.json": _self_route()},
        "components": {"schemas": components},
    }


def _listing(summary: str, body: dict[str, Any], refused: str, error: type) -> dict[str, Any]:
    """A dialect's ``GET`` of its registrations (401 without the key, unless
    ``--open-workers``)."""
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "done", "content": _content(body, both=False)},
                "401": {
                    "description": refused + "; --open-workers opens it",
                    "content": _content(_ref(error), both=False),
                },
            },
        }
    }


def _health(body: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": "liveness",
            "responses": {
                "200": {
                    "description": body or "empty",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        }
    }


def mooncake_document() -> dict[str, Any]:
    """The OpenAPI document of the Mooncake conductor dialect, served as ``GET
    /openapi.json`` on ``--mooncake-port`` (docs/api.md, "The Mooncake conductor
    dialect"). MessagePack bodies take the JSON shapes; a query's ``token_ids`` may also
    be one bin of little-endian int32."""
    services = {
        "type": "object",
        "required": ["count", "services"],
        "properties": {
            "count": {"type": "integer"},
            "services": {"type": "array", "items": {"type": "object"}},
        },
    }
    paths: dict[str, Any] = {
        "/register": _dialect_post(
            "register one DP rank of an engine (or a Mooncake pool publisher)",
            schema_mooncake.MooncakeRegisterRequest,
            schema_mooncake.MooncakeRegisterResponse,
            "400 401 413 500",
        ),
        "/unregister": _dialect_post(
            "unregister the service (instance_id, tenant_id, dp_rank)",
            schema_mooncake.MooncakeUnregisterRequest,
            schema_mooncake.MooncakeUnregisterResponse,
            "400 401 404 413 500",
        ),
        "/query": _dialect_post(
            "cumulative matched tokens per instance and rank (gpu <= cpu <= disk)",
            schema_mooncake.MooncakeQueryRequest,
            schema_mooncake.MooncakeQueryResponse,
            "400 413",
        ),
        "/services": _listing(
            "the services registered over this dialect",
            services,
            _MOONCAKE_ERRORS["401"],
            schema_mooncake.MooncakeError,
        ),
        "/health": _health("OK"),
    }
    return _dialect_document(
        "kv-conductor: Mooncake conductor dialect",
        "kvcache-ai/Mooncake mooncake-conductor's HTTP API, served on --mooncake-port "
        "(docs/api.md)",
        _MOONCAKE_STRUCTS,
        paths,
    )


_DYNAMO_STRUCTS = (
    schema_dynamo.DynamoRegisterRequest,
    schema_dynamo.DynamoUnregisterRequest,
    schema_dynamo.DynamoQueryRequest,
    schema_dynamo.DynamoHashQueryRequest,
    schema_dynamo.DynamoStatus,
    schema_dynamo.DynamoQueryResponse,
    schema_dynamo.DynamoWorker,
    schema_dynamo.DynamoError,
)
_DYNAMO_ERRORS = {
    "400": "malformed JSON, or a registration kvconductor refuses (its endpoint)",
    "401": "missing or wrong bearer token (only with --api-key, unless --dynamo-port-open)",
    "404": "no engine registered for (model_name, routing_group), or no such instance",
    "409": "the (instance, DP) is registered, or the group has another block size",
    "413": "body over --max-body-mb",
    "415": "not Content-Type: application/json",
    "422": "a body of another shape (a missing field, a wrong type or range)",
    "500": "a subscription cannot be opened, or an unexpected failure",
}


def dynamo_document() -> dict[str, Any]:
    """The OpenAPI document of Dynamo's standalone indexer dialect, served as ``GET
    /openapi.json`` on ``--dynamo-port`` (docs/api.md, "The Dynamo indexer dialect")."""
    sd = schema_dynamo
    workers = {"type": "array", "items": _ref(sd.DynamoWorker)}
    queries = "400 404 413 415 422"
    paths: dict[str, Any] = {
        "/register": _dialect_post(
            "register one DP of a vLLM engine",
            sd.DynamoRegisterRequest,
            sd.DynamoStatus,
            "400 401 409 413 415 422 500",
            dynamo=True,
        ),
        "/unregister": _dialect_post(
            "unregister one DP, or the instance",
            sd.DynamoUnregisterRequest,
            sd.DynamoStatus,
            "401 404 413 415 422 500",
            dynamo=True,
        ),
        "/query": _dialect_post(
            "matched tokens per instance and rank, by token ids",
            sd.DynamoQueryRequest,
            sd.DynamoQueryResponse,
            queries,
            dynamo=True,
        ),
        "/query_by_hash": _dialect_post(
            "matched tokens per instance and rank, by local block hashes (i64)",
            sd.DynamoHashQueryRequest,
            sd.DynamoQueryResponse,
            queries,
            dynamo=True,
        ),
        "/workers": _listing(
            "the engines registered (instances with a u64 id)",
            workers,
            _DYNAMO_ERRORS["401"],
            sd.DynamoError,
        ),
        "/health": _health(""),
    }
    return _dialect_document(
        "kv-conductor: Dynamo indexer dialect",
        "NVIDIA Dynamo's standalone KV indexer API (python -m dynamo.indexer), served on "
        "--dynamo-port (docs/api.md)",
        _DYNAMO_STRUCTS,
        paths,
    )
