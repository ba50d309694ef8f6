"""Block identity with extra keys (docs/api.md, "Block hashing", "Extra keys"), end to end:
vLLM 0.33's own block hashing (``kv_cache_utils``, tests/helpers/realpub.py) is the oracle
of which blocks a request can reuse; vLLM's own publisher sends the events it would send
(``extra_keys`` from ``to_event_extra_keys``) to a real server; ``/query`` with
``mm_inputs`` / ``cache_salt`` / ``lora_name`` must answer exactly the blocks vLLM would
reuse: the longest prefix of the query's vLLM block hashes among the stored ones."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from kvconductor._hash import hash_blocks, lora_seed
from kvconductor.client import ConductorClient
from tests.helpers.http_cases import msgpack_post
from tests.helpers.publishers import free_tcp_port, wait_until
from tests.helpers.realpub import vllm_block_hashing, vllm_kv_events
from tests.helpers.server import register_engine, started

pytestmark = pytest.mark.server

BS = 4
IMG = 9999  # vLLM's image placeholder token: the same for every image
# 8 blocks: text, image 1 at 6 (8 tokens: blocks 1-3), text, image 2 at 18 (5: blocks 4-5)
PROMPT = [*range(100, 106), *[IMG] * 8, *range(200, 204), *[IMG] * 5, *range(300, 309)]
X1, X2, Y1, Y2 = ("mm-x1", 6, 8), ("mm-x2", 18, 5), ("mm-y1", 6, 8), ("mm-y2", 18, 5)


@dataclass
class _Pos:  # vLLM's PlaceholderRange (offset, length)
    offset: int
    length: int


@dataclass
class _Feature:  # vLLM's MultiModalFeatureSpec: what the hashing reads of it
    identifier: str
    mm_position: _Pos


@dataclass
class _Lora:  # vLLM's LoRARequest: lora_name, lora_path (and .name, the event's lora_name)
    lora_name: str
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass
class _Request:  # what vLLM's extra-key functions read of a Request
    all_token_ids: list[int]
    mm_features: list[_Feature] = field(default_factory=list)
    lora_request: _Lora | None = None
    cache_salt: str | None = None
    prompt_embeds: None = None


def _request(mm=(), salt=None, lora=None) -> _Request:
    feats = [_Feature(i, _Pos(o, n)) for i, o, n in mm]
    return _Request(PROMPT, feats, _Lora(lora, f"/adapters/{lora}") if lora else None, salt)


def vllm_blocks(h, req: _Request) -> tuple[list[bytes], list]:
    """vLLM's block hashes of the request's full blocks and the extra keys per block (its
    ``request_block_hasher`` without lookahead)."""
    hashes, keys = [], []
    parent, mm_idx = None, 0
    for start in range(0, len(req.all_token_ids) - BS + 1, BS):
        extra, mm_idx = h.generate_block_hash_extra_keys(req, start, start + BS, mm_idx)
        parent = h.hash_block_tokens(h.sha256, parent, req.all_token_ids[start : start + BS], extra)
        hashes.append(parent)
        keys.append(extra)
    return hashes, keys


def _event(k, h, chain: tuple[list[bytes], list], lora: str | None = None):
    """The ``BlockStored`` vLLM's block pool sends for a request's full blocks
    (``_build_block_stored_event``): its hashes, tokens, LoRA and event extra keys."""
    hashes, keys = chain
    return k.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=PROMPT[: len(hashes) * BS],
        block_size=BS,
        lora_id=1 if lora else None,
        medium=k.MEDIUM_GPU,
        lora_name=lora,
        extra_keys=h.to_event_extra_keys(keys),
    )


def _reuse(query: list[bytes], stored: list[bytes]) -> int:
    """Blocks vLLM's prefix cache reuses: the leading query hashes it holds (chained)."""
    held = set(stored)
    n = 0
    while n < len(query) and query[n] in held:
        n += 1
    return n


#: instance -> what its engine stored (the prompt with ...)
STORED = {
    "eng-x": {"mm": (X1, X2)},
    "eng-salt": {"mm": (X1, X2), "salt": "tenant-a"},
    "eng-lora": {"mm": (X1, X2), "lora": "adapter"},
    "eng-text": {},
}
#: the queries: (mm_inputs, cache_salt, lora_name)
QUERIES = [
    ((X1, X2), None, None),
    ((Y1, Y2), None, None),  # same text, other images
    ((X1, Y2), None, None),  # the first image the same
    ((), None, None),  # the text alone
    ((X1, X2), "tenant-a", None),
    ((X1, X2), "tenant-b", None),
    ((X1, X2), None, "adapter"),
    ((X1, X2), "tenant-a", "adapter"),
]


def _body(mm, salt, lora) -> dict:
    body: dict = {"model": "qwen", "block_size": BS, "token_ids": PROMPT}
    if mm:
        body["mm_inputs"] = [{"identifier": i, "offset": o, "length": n} for i, o, n in mm]
    if salt:
        body["cache_salt"] = salt
    if lora:
        body["lora_name"] = lora
    return body


def _blocks(doc: dict) -> dict[str, int]:
    out = {}
    for iid, inst in doc.get("default", {}).items():
        dp = inst["DP"]["0"]
        out[iid] = dp["npu_blocks"]
        assert inst["longest_matched"] == dp["matched_tokens"] == BS * dp["npu_blocks"]
    return out


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["single", "workers"])
def test_extra_keys_match_what_vllm_reuses(tmp_path, workers):
    """One process, and ``--workers 2`` (the queries answered in the workers from the
    shared index, /explain by the owner)."""
    h = vllm_block_hashing()
    k = vllm_kv_events()
    chains = {iid: vllm_blocks(h, _request(**s)) for iid, s in STORED.items()}
    pubs = {}
    with started(tmp_path, *workers) as server:
        try:
            for iid in STORED:
                port = free_tcp_port()
                pubs[iid] = (
                    k.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}"),
                    port,
                )
                register_engine(
                    server,
                    iid,
                    store_backend="YuanRong",
                    medium_endpoints={"npu": f"tcp://127.0.0.1:{port}"},
                )
            for iid, s in STORED.items():
                ev = _event(k, h, chains[iid], s.get("lora"))
                pub = pubs[iid][0]

                def stored(pub=pub, ev=ev, iid=iid, s=s):
                    pub.publish(k.KVEventBatch(ts=time.time(), events=[ev]))
                    body = _body(s.get("mm", ()), s.get("salt"), s.get("lora"))
                    got = _blocks(server.http.post("/query", json=body).json())
                    return got.get(iid) == len(chains[iid][0])

                wait_until(stored, msg=f"{iid}'s blocks indexed", interval=0.2)
            # the events carried the extra keys (map form, vLLM >= 0.24)
            assert any(e for e in chains["eng-x"][1]) and chains["eng-text"][1] == [None] * 8
            for mm, salt, lora in QUERIES:
                q = vllm_blocks(h, _request(mm, salt, lora))[0]
                want = {iid: n for iid in STORED if (n := _reuse(q, chains[iid][0]))}
                body = _body(mm, salt, lora)
                assert _blocks(server.http.post("/query", json=body).json()) == want, body
                st, _, doc = msgpack_post(server.http, "/query", body)
                assert st == 200 and _blocks(doc) == want, body
                # /query_by_hash: the blocks' plain local hashes, the extra keys beside them
                seed = lora_seed(lora) if lora else 1337
                by_hash = {**body, "block_hashes": list(hash_blocks(PROMPT, BS, seed))}
                del by_hash["token_ids"]
                got = server.http.post("/query_by_hash", json=by_hash).json()
                assert {i: d["DP"]["0"]["npu_blocks"] for i, d in got["default"].items()} == want
                # /explain tells the same blocks
                doc = server.http.post("/explain", json=body).json()
                told = {i["instance_id"]: i["npu_blocks"] for i in doc["instances"]}
                assert {i: n for i, n in told.items() if n} == want, body
                # the client's query call
                with ConductorClient(server.url) as client:
                    doc = client.query(
                        "qwen", PROMPT, BS, lora_name=lora, cache_salt=salt, mm_inputs=mm
                    )
                assert _blocks(doc) == want
        finally:
            for pub, _ in pubs.values():
                pub.shutdown()


def test_plain_query_bytes_unchanged_and_bad_extra_keys_are_400(tmp_path):
    """A query without the fields is answered as before; null fields are no fields; bad
    ones are a 400 with the error in the request's encoding."""
    with started(tmp_path) as server:
        register_engine(server, "eng")
        ev = {"event_id": 1, "type": "BlockStored", "block_hashes": [1, 2]}
        ev |= {"token_ids": PROMPT[:8], "block_size": BS}
        r = server.http.post("/events", json={"instance_id": "eng", "events": [ev]})
        assert r.status_code == 200, r.text
        plain = {"model": "qwen", "block_size": BS, "token_ids": PROMPT[:8]}
        a = server.http.post("/query", json=plain)
        b = server.http.post("/query", json={**plain, "cache_salt": None, "mm_inputs": None})
        c = server.http.post("/query", json={**plain, "cache_salt": "", "mm_inputs": []})
        assert a.status_code == 200 and a.content == b.content == c.content
        assert _blocks(a.json()) == {"eng": 2}
        bad = [
            ({"cache_salt": 5}, "cache_salt"),
            ({"mm_inputs": [{"identifier": "i", "offset": -1, "length": 2}]}, "offset"),
            ({"mm_inputs": [{"identifier": "", "offset": 0, "length": 2}]}, "identifier"),
            ({"mm_inputs": [{"identifier": "i", "offset": 0}]}, "length"),
            (
                {
                    "mm_inputs": [
                        {"identifier": "a", "offset": 0, "length": 4},
                        {"identifier": "b", "offset": 3, "length": 1},
                    ]
                },
                "overlaps",
            ),
        ]
        for extra, word in bad:
            r = server.http.post("/query", json={**plain, **extra})
            assert r.status_code == 400 and word in r.json()["error"], r.text
            st, ctype, doc = msgpack_post(server.http, "/query", {**plain, **extra})
            assert st == 400 and ctype.startswith("application/msgpack") and word in doc["error"]
        r = server.http.post("/explain", json={**plain, "mm_inputs": 5})
        assert r.status_code == 400 and "mm_inputs" in r.json()["error"], r.text
        by_hash = {"model": "qwen", "block_hashes": [1], "cache_salt": "s"}
        r = server.http.post("/query_by_hash", json=by_hash)
        assert r.status_code == 400 and "block_size" in r.json()["error"]


def test_mooncake_dialect_takes_the_salt(tmp_path):
    """The Mooncake dialect's ``cache_salt`` (accepted and ignored before) is the request's
    salt as vLLM hashes it: a salted engine's blocks answer the same salt only."""
    h = vllm_block_hashing()
    k = vllm_kv_events()
    salted = vllm_blocks(h, _request(salt="salt-a"))
    mc_port, port = free_tcp_port(), free_tcp_port()
    pub = k.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
    with started(tmp_path, "--mooncake-port", str(mc_port)):
        mc = httpx.Client(base_url=f"http://127.0.0.1:{mc_port}", timeout=10.0)
        try:
            reg = {"endpoint": f"tcp://127.0.0.1:{port}", "type": "vLLM", "modelname": "qwen"}
            reg |= {"instance_id": "eng", "block_size": BS, "dp_rank": 0}
            reg["hash_profile"] = {"strategy": "vllm_v1", "algorithm": "sha256_cbor"}
            reg["hash_profile"] |= {"python_hash_seed": "0", "index_projection": "low64_be"}
            r = mc.post("/register", json=reg)
            assert r.status_code == 200, r.text
            ev = _event(k, h, salted)
            body = {"model": "qwen", "block_size": BS, "token_ids": PROMPT}

            def gpu(**extra) -> int:
                doc = mc.post("/query", json={**body, **extra}).json()["instances"]
                return doc.get("eng", {}).get("gpu", 0)

            def indexed():
                pub.publish(k.KVEventBatch(ts=time.time(), events=[ev]))
                return gpu(cache_salt="salt-a") == len(PROMPT)

            wait_until(indexed, msg="salted blocks indexed", interval=0.2)
            assert gpu() == 0 and gpu(cache_salt="salt-b") == 0 and gpu(cache_salt=None) == 0
        finally:
            mc.close()
            pub.shutdown()


def _gpu(c: httpx.Client, **extra) -> dict[int, int]:
    """A Dynamo ``/query`` of the prompt: the GPU tokens per instance."""
    r = c.post("/query", json={"token_ids": PROMPT, "model_name": "qwen", **extra})
    assert r.status_code == 200, r.text
    return {int(i): m["gpu"] for i, m in r.json()["instances"].items()}


@contextmanager
def _salted_engines(tmp_path, engines: dict[int, str | None], *others: httpx.Client):
    """A server with ``--dynamo-port`` and vLLM 0.33 publishers, one per instance of
    ``engines`` (its id -> the salt of the request it stored), registered there and on
    ``others`` (the real Dynamo indexer), their blocks indexed by all: yields the dialect's
    client. ``others``: the block hashes sent as ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    which Dynamo needs) instead of vLLM's default bytes."""
    h = vllm_block_hashing()
    k = vllm_kv_events()
    dyn_port = free_tcp_port()
    pubs = {}
    with started(tmp_path, "--dynamo-port", str(dyn_port)):
        ours = httpx.Client(base_url=f"http://127.0.0.1:{dyn_port}", timeout=10.0)
        try:
            for iid in engines:
                port = free_tcp_port()
                pubs[iid] = k.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
                reg = {"instance_id": iid, "endpoint": f"tcp://127.0.0.1:{port}"}
                for c in (ours, *others):
                    r = c.post("/register", json={**reg, "model_name": "qwen", "block_size": BS})
                    assert r.status_code == 201, r.text
            for iid, salt in engines.items():
                hashes, keys = vllm_blocks(h, _request(salt=salt))
                if others:
                    hashes = [int.from_bytes(b, "big") & (2**64 - 1) for b in hashes]
                ev = _event(k, h, (hashes, keys))

                def indexed(iid=iid, salt=salt, ev=ev):
                    pubs[iid].publish(k.KVEventBatch(ts=time.time(), events=[ev]))
                    return iid in _gpu(ours, cache_salt=salt) and all(
                        iid in _gpu(c) for c in others
                    )

                wait_until(indexed, msg=f"engine {iid}'s blocks indexed", interval=0.3)
            yield ours
        finally:
            ours.close()
            for pub in pubs.values():
                pub.shutdown()


def test_dynamo_dialect_takes_the_salt_as_vllm(tmp_path):
    """The Dynamo dialect's ``cache_salt`` on ``/query`` is the request's salt as vLLM
    hashes it: each engine's blocks answer the queries vLLM would reuse them for (a salted
    engine: the same salt only; an unsalted one: no salt, ``""`` or null). Dynamo 1.6.1
    means something else (docs/api.md, "The Dynamo indexer dialect"); its type error and
    its ``/query_by_hash`` refusal are kept."""
    h = vllm_block_hashing()
    engines = {1: "salt-a", 2: None}  # instance id -> the salt of the request it stored
    chains = {iid: vllm_blocks(h, _request(salt=salt))[0] for iid, salt in engines.items()}
    with _salted_engines(tmp_path, engines) as dyn:
        for salt in (None, "", "salt-a", "salt-b"):
            q = vllm_blocks(h, _request(salt=salt or None))[0]
            want = {i: BS * n for i in engines if (n := _reuse(q, chains[i]))}
            assert _gpu(dyn, cache_salt=salt) == want, salt
        full = len(PROMPT)
        assert _gpu(dyn) == {2: full} and _gpu(dyn, cache_salt="salt-a") == {1: full}
        bad = dyn.post("/query", json={"token_ids": PROMPT, "model_name": "qwen", "cache_salt": 5})
        assert bad.status_code == 422 and "cache_salt" in bad.json()["error"], bad.text
        by_hash = {"block_hashes": [1, 2], "model_name": "qwen"}
        for salt, status in (("salt-a", 400), ("", 400), (None, 200)):
            r = dyn.post("/query_by_hash", json={**by_hash, "cache_salt": salt})
            assert r.status_code == status, r.text
        assert r.json() == {"scores": {}, "frequencies": [], "instances": {}}
        assert dyn.post("/query_by_hash", json={**by_hash, "cache_salt": "s"}).json() == {
            "error": "cache_salt is not accepted by /query_by_hash; "
            "block_hashes must already include the intended cache salt"
        }


def test_dynamo_indexer_itself_on_salted_events(tmp_path, dynamo_indexer):
    """What the real ``python -m dynamo.indexer`` 1.6.1 does with salts, fed the same vLLM
    0.33 publishers as ours: it skips the events' ``extra_keys``, so a salted engine's
    blocks answer an unsalted query (blocks vLLM cannot reuse), and it mixes a query's
    ``cache_salt`` into its own hashes, which no event carries, so a salted query matches
    nothing. Ours answers what vLLM reuses (docs/api.md, "where the meanings differ")."""
    full = len(PROMPT)
    with _salted_engines(tmp_path, {11: "salt-a", 12: None}, dynamo_indexer) as ours:
        for salt in (None, ""):
            assert _gpu(dynamo_indexer, cache_salt=salt) == {11: full, 12: full}
            assert _gpu(ours, cache_salt=salt) == {12: full}
        for salt, mine in (("salt-a", {11: full}), ("salt-b", {})):
            assert _gpu(dynamo_indexer, cache_salt=salt) == {}
            assert _gpu(ours, cache_salt=salt) == mine
