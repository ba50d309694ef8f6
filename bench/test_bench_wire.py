"""Benchmarks of the compiled query-path wire code (kvconductor._wire, kvconductor._encode).

Run: python -m pytest bench/test_bench_wire.py --benchmark-enable -q
(pyproject's addopts disables benchmarks by default; nothing here asserts on time.)
The msgspec rows are the baseline that the pure-Python twin would pay.
"""

from __future__ import annotations

import random
import struct

import msgspec
import pytest

from kvconductor import _encode, _wire
from kvconductor.index import DpHit

SIZES = [1_000, 16_000, 128_000, 1_000_000]


def _tokens(n: int) -> list[int]:
    rnd = random.Random(n)
    return [rnd.randrange(0, 152_000) for _ in range(n)]


def _body(fmt: str, n: int) -> bytes:
    toks = _tokens(n)
    d = {"model": "qwen2.5-72b", "block_size": 128, "token_ids": toks, "tenant_id": "default"}
    if fmt == "json":
        return msgspec.json.encode(d)
    if fmt == "msgpack":
        return msgspec.msgpack.encode(d)
    d["token_ids"] = struct.pack(f"<{n}I", *toks)
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", ["json", "msgpack", "packed"])
def test_parse_query(benchmark, fmt, n):
    body = _body(fmt, n)
    benchmark.extra_info["body_bytes"] = len(body)
    model, bs, tenant, values, lora = benchmark(_wire.parse_query, body, fmt != "json", False)
    assert len(values) == n


@pytest.mark.parametrize("n", [1_000_000])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_parse_query_by_hash(benchmark, fmt, n):
    rnd = random.Random(n)
    d = {"model": "m", "block_hashes": [rnd.randrange(0, 2**64) for _ in range(n // 128)]}
    body = msgspec.json.encode(d) if fmt == "json" else msgspec.msgpack.encode(d)
    model, bs, tenant, values, lora = benchmark(_wire.parse_query, body, fmt != "json", True)
    assert len(values) == n // 128


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_msgspec_baseline_1m(benchmark, fmt):
    class Query(msgspec.Struct):
        model: str
        block_size: int
        token_ids: list[int]
        tenant_id: str | None = None

    body = _body(fmt, 1_000_000)
    dec = msgspec.json.Decoder(Query) if fmt == "json" else msgspec.msgpack.Decoder(Query)
    q = benchmark(dec.decode, body)
    assert len(q.token_ids) == 1_000_000


def _hits(n_inst: int = 64) -> list[DpHit]:
    rnd = random.Random(1)
    hits = []
    for i in range(n_inst):
        for dp in range(rnd.choice([1, 1, 2, 4])):
            hits.append(
                DpHit(
                    f"vllm-prefill-{i}",
                    dp,
                    rnd.randrange(0, 4000),
                    rnd.randrange(0, 2000),
                    rnd.randrange(0, 500),
                )
            )
    return hits


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_encode_result_64_instances(benchmark, fmt):
    hits = _hits()
    out = benchmark(_encode.encode_result, hits, "default", 128, fmt == "msgpack")
    assert out


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_encode_baseline_to_dict_msgspec(benchmark, fmt):
    from kvconductor.index import QueryResult

    hits = _hits()
    enc = msgspec.json.encode if fmt == "json" else msgspec.msgpack.encode
    out = benchmark(lambda: enc(QueryResult(hits).to_dict("default", 128)))
    assert out
