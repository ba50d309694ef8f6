"""The Dynamo dialect's ``/query`` and ``/query_by_hash`` bodies decoded
(kvconductor.http.dynamo): ``typed`` is the decode the routes made before their token ids
were kept in C buffers (msgspec into a Python list of ints, then ``array``), ``c-buffer``
the routes' decode now (:func:`~kvconductor.http.dynamo.decode_tokens`: the names by
msgspec, the ids by V3's parser).

Run: python -m pytest bench/test_bench_dynamo.py --benchmark-enable -q
(nothing here asserts on time).
"""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest

from kvconductor.http.dynamo import decode, decode_tokens, i64_as_u64
from kvconductor.schema_dynamo import DynamoHashQueryRequest, DynamoQueryRequest

SIZES = [1_024, 32_768, 262_144]


class _Req:
    """What the decoders read of a Falcon request."""

    content_type = "application/json"


def _typed(body: bytes) -> array:
    q = decode(_Req, body, DynamoQueryRequest)
    return array("I", q.token_ids)


def _c_buffer(body: bytes) -> array:
    return decode_tokens(_Req, body)[1]  # type: ignore[arg-type]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("how", ["typed", "c-buffer"])
def test_query_decode(benchmark, how, n):
    rnd = random.Random(n)
    tokens = [rnd.randrange(0, 152_000) for _ in range(n)]
    body = msgspec.json.encode({"token_ids": tokens, "model_name": "qwen"})
    fn = _typed if how == "typed" else _c_buffer
    assert fn(body) == array("I", tokens)
    benchmark(fn, body)


@pytest.mark.parametrize("n", [64, 2_048])
@pytest.mark.parametrize("how", ["per-item", "c-cast"])
def test_hash_query_decode(benchmark, how, n):
    rnd = random.Random(n)
    hashes = [rnd.randrange(-(2**63), 2**63) for _ in range(n)]
    body = msgspec.json.encode({"block_hashes": hashes, "model_name": "qwen"})

    def per_item() -> array:
        q = decode(_Req, body, DynamoHashQueryRequest)
        return array("Q", [h & (2**64 - 1) for h in q.block_hashes])

    def c_cast() -> array:
        return i64_as_u64(decode(_Req, body, DynamoHashQueryRequest).block_hashes)

    fn = per_item if how == "per-item" else c_cast
    assert fn() == array("Q", [h & (2**64 - 1) for h in hashes])
    benchmark(fn)
