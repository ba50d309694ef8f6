"""Request parsing and response encoding of ``/query`` and ``/query_by_hash``.

Two implementations with identical results:

* ``kvconductor._wire`` and ``kvconductor._encode`` (compiled, written
  separately): parse token ids straight into a C buffer, never building a Python
  list of ints, and write the response bytes;
* the msgspec oracle in this module (:func:`py_parse_query`,
  :func:`py_encode_result`, :func:`py_encode_error`): the reference the compiled
  ones are diffed against (tests/test_wire.py), not a runtime fallback.

:func:`parse_query`, :func:`encode_result` and :func:`encode_error` are the
compiled ones unless ``KVCONDUCTOR_IMPL=py`` (:data:`kvconductor.IMPL`) selects
the oracle; :func:`parse_query` adds the checks common to both.

Accepted request shapes (docs/api.md: POST /query, its "MessagePack" section, POST /query_by_hash):

* a map ``{"model", "block_size", "token_ids" | "block_hashes", "tenant_id"?,
  "lora_name"?}`` (JSON object or MessagePack map); ``block_size`` may be
  omitted on ``/query_by_hash`` (it is ignored there);
* on MessagePack also the positional array
  ``[model, block_size, token_ids | block_hashes, tenant_id?, lora_name?]``.

``lora_name`` (string or null) selects the LoRA adapter whose blocks the token
ids are hashed for (``lora_seed``); null, absent or ``""`` is the base model.

``token_ids`` items are i64 integers truncated to u32; on
MessagePack they may also be one bin of little-endian u32 (packed tokens).
``block_hashes`` items are u64 (LocalBlockHash values, docs/api.md "Block hashing").
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import msgspec

import kvconductor
from kvconductor import _encode, _wire
from kvconductor.extrakeys import ExtraKeysError, QueryExtras, parse_extras
from kvconductor.index import QueryResult
from kvconductor.schema import (
    DEFAULT_TENANT,
    FRESHNESS_FIELD,
    I64_MAX,
    I64_MIN,
    INSTANCE_MATCH_KEYS,
    JSON_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    NAME_MAX,
    U32,
    U32_MAX,
    is_msgpack_content_type,
    name_too_long,
)

__all__ = [
    "JSON_CONTENT_TYPE",
    "MSGPACK_CONTENT_TYPE",
    "IMPL",
    "WireError",
    "encode_error",
    "encode_fresh",
    "c_encode_result",
    "encode_result",
    "is_msgpack_content_type",
    "parse_query",
    "parse_query_ext",
    "py_encode_error",
    "py_encode_fresh",
    "py_encode_result",
    "py_parse_query",
]

_LITTLE = sys.byteorder == "little"


class WireError(ValueError):
    """A malformed query body; the message is the detail after the encoding prefix."""


# ---------------------------------------------------------------------------------------
# Pure-Python (msgspec) oracle of kvconductor._wire / kvconductor._encode
# ---------------------------------------------------------------------------------------


def _query_struct(
    name: str, values: str, *, array_like: bool = False, block_size: Any = msgspec.NODEFAULT
) -> type[msgspec.Struct]:
    """The Struct of one form of a query body: its fields in the order of the array
    form, ``values`` (``token_ids`` or ``block_hashes``) third; ``block_size``: its
    default (required unless given)."""
    return msgspec.defstruct(
        name,
        [
            ("model", str),
            ("block_size", U32, block_size),
            (values, msgspec.Raw),
            ("tenant_id", str | None, DEFAULT_TENANT),
            ("lora_name", str | None, None),
            # extension fields: any value here, checked by _extension() when asked for
            ("top_k", Any, None),
            ("instances", Any, None),
            ("freshness", Any, None),
            ("cache_salt", Any, None),
            ("mm_inputs", Any, None),
        ],
        kw_only=True,
        array_like=array_like,
        module=__name__,
    )


_TokensMap = _query_struct("_TokensMap", "token_ids")
_TokensArray = _query_struct("_TokensArray", "token_ids", array_like=True)
_HashesMap = _query_struct("_HashesMap", "block_hashes", block_size=0)
_HashesArray = _query_struct("_HashesArray", "block_hashes", array_like=True)

_JSON = {False: msgspec.json.Decoder(_TokensMap), True: msgspec.json.Decoder(_HashesMap)}
_MSGPACK = {
    (False, False): msgspec.msgpack.Decoder(_TokensMap),
    (False, True): msgspec.msgpack.Decoder(_TokensArray),
    (True, False): msgspec.msgpack.Decoder(_HashesMap),
    (True, True): msgspec.msgpack.Decoder(_HashesArray),
}
_JSON_INTS = msgspec.json.Decoder(list[int])
_MSGPACK_INTS = msgspec.msgpack.Decoder(list[int])
_MSGPACK_TOKENS = msgspec.msgpack.Decoder(list[int] | bytes)
_JSON_ENCODE = msgspec.json.Encoder().encode
_MSGPACK_ENCODE = msgspec.msgpack.Encoder().encode


def _is_msgpack_array(body: bytes) -> bool:
    return bool(body) and (0x90 <= body[0] <= 0x9F or body[0] in (0xDC, 0xDD))


def _decode_ints(raw: msgspec.Raw, msgpack: bool, field: str) -> list[int] | bytes:
    decoder: Any = _JSON_INTS
    if msgpack:
        decoder = _MSGPACK_TOKENS if field == "token_ids" else _MSGPACK_INTS
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as ex:
        raise WireError(str(ex).replace("`$", f"`$.{field}")) from None


def _tokens_u32(values: list[int] | bytes) -> array:
    if isinstance(values, bytes):
        if len(values) % 4:
            raise WireError(f"token_ids bin length {len(values)} is not a multiple of 4")
        out = array("I")
        out.frombytes(values)
        if not _LITTLE:
            out.byteswap()
        return out
    if values and (min(values) < I64_MIN or max(values) > I64_MAX):
        raise WireError("token_ids: integer out of range (i64 expected)")
    try:
        return array("I", values)
    except OverflowError:
        # NOTE: negative or > u32 ids keep their low 32 bits (docs/api.md, "Block hashing").
        return array("I", [t & U32_MAX for t in values])


def _hashes_u64(values: list[int]) -> array:
    try:
        return array("Q", values)
    except OverflowError:
        raise WireError("block_hashes: integer out of range (u64 expected)") from None


def _extension(req: Any, msgpack: bool) -> tuple[int | None, list[str] | None, bool]:
    """``(top_k, instances, freshness)`` of a decoded request, checked like the compiled
    parser."""
    null = "nil" if msgpack else "null"
    top_k = req.top_k
    if top_k is not None:
        if type(top_k) is not int:
            raise WireError(f"invalid type for `top_k`: expected an integer or {null}")
        if not 1 <= top_k <= U32_MAX:
            raise WireError(_wire.TOP_K_RANGE)
    instances = req.instances
    if instances is not None and (
        type(instances) is not list or any(type(i) is not str for i in instances)
    ):
        raise WireError(f"invalid type for `instances`: expected an array of strings or {null}")
    freshness = req.freshness
    if freshness is not None and type(freshness) is not bool:
        raise WireError(f"invalid type for `freshness`: expected a boolean or {null}")
    return top_k, instances, bool(freshness)


def py_parse_query(body: bytes, msgpack: bool, by_hash: bool, ext: bool = False) -> tuple:
    """Parse a query body into ``(model, block_size, tenant, values, lora_name)`` with msgspec.

    ``values`` is ``array('I')`` of u32-truncated token ids, or ``array('Q')``
    of hashes when ``by_hash``; ``lora_name`` is ``None`` when absent, null or
    empty. With ``ext`` three more items: ``top_k`` and ``instances`` (the extension
    fields, ``None`` when absent or null), ``freshness`` (False when absent or null) and
    whether ``cache_salt`` or ``mm_inputs`` is there and not null.
    Raises :class:`WireError`.
    """
    decoder: Any = _MSGPACK[by_hash, _is_msgpack_array(body)] if msgpack else _JSON[by_hash]
    try:
        req = decoder.decode(body)
    except msgspec.DecodeError as ex:
        raise WireError(str(ex)) from None
    except RecursionError:
        # NOTE: msgspec recurses; the compiled parser rejects JSON deeper than 1000 levels
        # and skips msgpack of any depth, so the two differ on bodies ~950+ levels deep.
        raise WireError("nesting too deep") from None
    if by_hash:
        values = _hashes_u64(cast(list, _decode_ints(req.block_hashes, msgpack, "block_hashes")))
    else:
        values = _tokens_u32(_decode_ints(req.token_ids, msgpack, "token_ids"))
    tenant = DEFAULT_TENANT if req.tenant_id is None else req.tenant_id
    if ext:
        top_k, instances, fresh = _extension(req, msgpack)
        lora = req.lora_name or None
        extra = req.cache_salt is not None or req.mm_inputs is not None
        return req.model, req.block_size, tenant, values, lora, top_k, instances, fresh, extra
    return req.model, req.block_size, tenant, values, req.lora_name or None


def _result_dict(hits: QueryResult | Sequence, tenant: str, block_size: int) -> dict:
    result = hits if isinstance(hits, QueryResult) else QueryResult(list(hits))
    return result.to_dict(tenant, block_size)


def py_encode_result(
    hits: QueryResult | Sequence, tenant: str, block_size: int, msgpack: bool
) -> bytes:
    """Encode ``QueryResult.to_dict(tenant, block_size)`` as JSON or MessagePack
    (``hits``: a :class:`QueryResult` or a sequence of ``DpHit`` tuples)."""
    doc = _result_dict(hits, tenant, block_size)
    return _MSGPACK_ENCODE(doc) if msgpack else _JSON_ENCODE(doc)


_DP = INSTANCE_MATCH_KEYS[1]


class _LastEvent(Protocol):
    @property
    def last_event(self) -> float: ...


def member(
    entry: tuple[int, Sequence[_LastEvent], float | None] | None, now: float
) -> dict[str, Any]:
    """The ``"freshness"`` member of a DP whose freshness entry is ``entry`` at wall time
    ``now`` (``kvconductor.ingest.freshness``: ``(state code, its sources' counters,
    degraded since)``, None for a DP without a source): the pure-Python twin of the
    compiled encoder's (``_encode._fill_fresh``)."""
    if entry is None:
        return {"state": _encode.FRESH_STATES[-1]}
    code, stats, since = entry
    out: dict[str, Any] = {"state": _encode.FRESH_STATES[code]}
    if stats:
        out["last_event_age_ms"] = _ms(now - max(s.last_event for s in stats))
    if since is not None:
        out["degraded_for_ms"] = _ms(now - since)
    return out


def _ms(age: float) -> int:
    """Milliseconds of ``age`` seconds, rounded, never negative (the encoder's rule)."""
    return int(age * 1000.0 + 0.5) if age > 0.0 else 0


def py_encode_fresh(
    result: QueryResult, tenant: str, block_size: int, msgpack: bool, fresh: tuple
) -> bytes:
    """:func:`py_encode_result` with the freshness (docs/api.md, "freshness"): ``fresh``
    is ``(groups, now, tail)`` as ``_encode.encode_rows`` takes it (``result``: an
    index's answer, with rows and names)."""
    groups, now, tail = fresh
    doc = result.to_dict(tenant, block_size)
    inner = doc[tenant]
    keys = result.names.keys
    for row in result.rows.tolist():
        g = row[0]
        iid, dp = keys[g]
        entry = groups[g] if g < len(groups) else None
        inner[iid][_DP][str(dp)][FRESHNESS_FIELD] = member(entry, now)
    doc[FRESHNESS_FIELD] = msgspec.Raw(tail)
    return _MSGPACK_ENCODE(doc) if msgpack else _JSON_ENCODE(doc)


def py_encode_error(message: str, msgpack: bool) -> bytes:
    """``{"error": message}`` as JSON or MessagePack."""
    doc = {"error": message}
    return _MSGPACK_ENCODE(doc) if msgpack else _JSON_ENCODE(doc)


#: The compiled encoder: a :class:`QueryResult` backed by the core's rows and a compiled
#: name table is rendered straight from the arrays (``_encode.encode_rows``); anything
#: else through its ``DpHit`` rows (``_encode.encode_result``). Same bytes.
c_encode_result = _encode.encode_answer


# ---------------------------------------------------------------------------------------
# Implementation selection
# ---------------------------------------------------------------------------------------

#: ``"c"`` when the compiled parser and encoder serve, ``"py"`` for the oracle.
IMPL = kvconductor.IMPL
encode_result: Callable[[Any, str, int, bool], bytes]
if IMPL == "py":
    _parse_impl = py_parse_query
    encode_result = py_encode_result
    encode_error = py_encode_error
else:
    _parse_impl = _wire.parse_query
    encode_result = c_encode_result
    encode_error = _encode.encode_error


def encode_fresh(
    result: QueryResult, tenant: str, block_size: int, msgpack: bool, fresh: tuple
) -> bytes:
    """The answer with its freshness (:func:`py_encode_fresh`; compiled: the rows'
    encoder, ``_encode.encode_rows``)."""
    if IMPL != "py" and type(result.names) is _encode.GroupNames:
        return c_encode_result(result, tenant, block_size, msgpack, fresh)
    return py_encode_fresh(result, tenant, block_size, msgpack, fresh)


def parse_query(
    body: bytes, msgpack: bool, by_hash: bool
) -> tuple[str, int, str, array, str | None]:
    """Parse a ``/query`` (or ``/query_by_hash``) body; see :func:`py_parse_query`.

    Also enforces ``block_size`` in ``[1, 2**32)`` for ``/query`` and in
    ``[0, 2**32)`` for ``/query_by_hash`` (where it is ignored). The extension
    fields are skipped (:func:`parse_query_ext` reads them).
    """
    model, block_size, tenant, values, lora_name = _parse_checked(body, msgpack, by_hash, False)
    return model, block_size, tenant, values, lora_name


def parse_query_ext(
    body: bytes, msgpack: bool, by_hash: bool
) -> tuple[
    str, int, str, array, str | None, int | None, list[str] | None, bool, QueryExtras | None
]:
    """:func:`parse_query` plus the extension fields: ``(model, block_size, tenant,
    values, lora_name, top_k, instances, freshness, extras)``, ``top_k`` in ``[1, 2**32)``
    or ``None``, ``instances`` a list of names (each at most ``NAME_MAX`` characters) or
    ``None``, ``freshness`` a bool, ``extras`` the ``cache_salt`` and ``mm_inputs`` when
    either is there (read by :func:`~kvconductor.extrakeys.parse_extras` only then) or
    ``None``."""
    out = _parse_checked(body, msgpack, by_hash, True)
    instances = out[6]
    if instances is not None:
        for i, name in enumerate(instances):
            if len(name) > NAME_MAX:
                raise WireError(name_too_long(f"$.instances[{i}]"))
    model, block_size, tenant, values, lora_name, top_k, _, fresh, extra = out
    try:
        extras = parse_extras(body, msgpack) if extra else None
    except ExtraKeysError as ex:
        raise WireError(str(ex)) from None
    return model, block_size, tenant, values, lora_name, top_k, instances, fresh, extras


def _parse_checked(body: bytes, msgpack: bool, by_hash: bool, ext: bool) -> tuple:
    try:
        out = _parse_impl(body, msgpack, by_hash, ext)
    except WireError:
        raise
    except (ValueError, TypeError, OverflowError) as ex:
        raise WireError(str(ex)) from None
    model, block_size, tenant, values, lora_name = out[:5]
    if not 0 <= block_size <= U32_MAX:
        raise WireError(f"block_size {block_size} is out of range (u32 expected)")
    if block_size < 1 and not by_hash:
        raise WireError("block_size must be >= 1")
    if len(model) > NAME_MAX:
        raise WireError(name_too_long("$.model"))
    if len(tenant) > NAME_MAX:
        raise WireError(name_too_long("$.tenant_id"))
    if lora_name is not None and len(lora_name) > NAME_MAX:
        raise WireError(name_too_long("$.lora_name"))
    return out
