"""Dynamo's standalone indexer dialect (``--dynamo-port``, kvconductor.http.dynamo).

Reference: ``python -m dynamo.indexer`` of PyPI ``ai-dynamo-runtime`` 1.6.1 (installed in
CI). Its routes, bodies, status codes and error messages were read from the live service
(its Rust source is not in the wheel); the statuses and messages asserted here are the
ones it answers. :func:`test_answers_equal_dynamos_on_the_same_events` runs the real
service beside kvconductor, both fed by the same vLLM 0.33 publishers
(tests/helpers/realpub.py), and compares their answers query for query.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import httpx
import pytest

from kvconductor._hash import hash_blocks
from kvconductor.http.dynamo import dynamo_answer
from kvconductor.serve import cli
from tests.helpers.publishers import wait_until
from tests.helpers.server import free_port, running

BS = 16
MODEL = "dyn-model"


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _hashes(tokens: list[int]) -> list[int]:
    """The local hashes of ``tokens``' complete blocks, as the i64 Dynamo's JSON takes."""
    return [_signed(h) for h in hash_blocks(tokens, BS)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    port = free_port()
    flags = ("--dynamo-port", str(port), "--source-down-secs", "86400", "--source-purge-secs", "0")
    with running(tmp_path_factory.mktemp("dynamo"), *flags) as s:
        s.dyn = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        try:
            yield s
        finally:
            s.dyn.close()


def _reg(iid: int, dp: int = 0, model: str = MODEL, **extra) -> dict:
    return {
        "instance_id": iid,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "model_name": model,
        "block_size": BS,
        "dp_rank": dp,
        **extra,
    }


def _event(tokens: list[int], first: int, medium: str = "GPU", dp: int = 0) -> dict:
    """A vLLM BlockStored over V3's POST /events: blocks of ``tokens``, engine hashes
    ``first``, ``first + 1``, ... chained."""
    n = len(tokens) // BS
    return {
        "event_id": first,
        "dp_rank": dp,
        "type": "BlockStored",
        "block_hashes": list(range(first, first + n)),
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "medium": medium,
    }


def _post_events(srv, iid: int, events: list[dict], model: str = MODEL) -> None:
    r = srv.http.post(
        "/events",
        json={"instance_id": str(iid), "model": model, "tenant_id": "default", "events": events},
    )
    assert r.status_code == 200, r.text


def test_register_query_and_workers(srv):
    r = srv.dyn.post("/register", json=_reg(101))
    assert (r.status_code, r.json()) == (201, {"status": "ok"})
    r = srv.dyn.post("/register", json=_reg(101, dp=1))
    assert r.status_code == 201
    tokens = list(range(1, 4 * BS + 1))
    _post_events(srv, 101, [_event(tokens[: 3 * BS], 5000)])
    _post_events(srv, 101, [_event(tokens[: 2 * BS], 6000, "CPU", dp=1)])
    want = {
        "scores": {"101": {"0": 3 * BS}},
        "frequencies": [],
        "instances": {
            "101": {
                "longest_matched": 3 * BS,
                "gpu": 3 * BS,
                "dp": {"0": 3 * BS, "1": 0},
                "cpu": 3 * BS,
                "disk": 3 * BS,
            }
        },
    }
    r = srv.dyn.post("/query", json={"token_ids": tokens + [7], "model_name": MODEL})
    assert (r.status_code, r.json()) == (200, want)
    r = srv.dyn.post("/query_by_hash", json={"block_hashes": _hashes(tokens), "model_name": MODEL})
    assert (r.status_code, r.json()) == (200, want)
    # a V3 query of the same index says the same blocks
    v3 = srv.http.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": tokens})
    assert v3.status_code == 200
    workers = srv.dyn.get("/workers").json()
    mine = [w for w in workers if w["instance_id"] == 101]
    assert len(mine) == 1
    w = mine[0]
    assert (w["model_name"], w["routing_group"], w["block_size"], w["source"]) == (
        MODEL,
        "default",
        BS,
        "zmq",
    )
    assert sorted(w["endpoints"]) == ["0", "1"] and sorted(w["listeners"]) == ["0", "1"]
    assert w["listeners"]["0"]["endpoint"] == w["endpoints"]["0"]
    # the registration is ours too: V3's /workers lists it under its string id
    v3_workers = srv.http.get("/workers").json()["workers"]
    assert any(x["instance_id"] == "101" for x in v3_workers)
    assert srv.dyn.post("/unregister", json={"instance_id": 101, "model_name": MODEL}).json() == {
        "status": "ok"
    }
    assert not [w for w in srv.dyn.get("/workers").json() if w["instance_id"] == 101]


def test_dynamos_status_codes_and_messages(srv):
    d = srv.dyn
    assert d.post("/register", json=_reg(201)).status_code == 201
    dup = d.post("/register", json=_reg(201))
    assert (dup.status_code, dup.json()) == (
        409,
        {"error": "instance 201 dp_rank 0 already registered"},
    )
    other = d.post("/register", json={**_reg(202), "block_size": 32})
    assert (other.status_code, other.json()) == (
        409,
        {
            "error": f"block_size mismatch for model={MODEL} routing_group=default: "
            "existing=16, requested=32"
        },
    )
    missing = d.post("/query", json={"model_name": MODEL})
    assert missing.status_code == 422
    assert missing.json()["error"].startswith(
        "Failed to deserialize the JSON body into the target type: "
    )
    assert "token_ids" in missing.json()["error"]
    bad = d.post("/query", content=b"xx", headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert bad.json()["error"].startswith("Failed to parse the request body as JSON: ")
    media = d.post("/query", content=b"{}", headers={"content-type": "text/plain"})
    assert (media.status_code, media.json()) == (
        415,
        {"error": "Expected request with `Content-Type: application/json`"},
    )
    neg = d.post("/register", json={**_reg(203), "instance_id": -3})
    assert neg.status_code == 422
    nothing = d.post("/query", json={"token_ids": [1], "model_name": "nope"})
    assert (nothing.status_code, nothing.json()) == (
        404,
        {"error": "no indexer for model=nope routing_group=default"},
    )
    group = d.post(
        "/query_by_hash", json={"block_hashes": [1], "model_name": MODEL, "routing_group": "g"}
    )
    assert (group.status_code, group.json()) == (
        404,
        {"error": f"no indexer for model={MODEL} routing_group=g"},
    )
    gone = d.post("/unregister", json={"instance_id": 299, "model_name": MODEL})
    assert (gone.status_code, gone.json()) == (404, {"error": "instance 299 not found"})
    wrong = d.post("/unregister", json={"instance_id": 201, "model_name": "other"})
    assert (wrong.status_code, wrong.json()) == (
        404,
        {"error": f"instance 201 is registered for model={MODEL} routing_group=default"},
    )
    assert d.get("/query").status_code == 405
    assert d.get("/nowhere").status_code == 404
    health = d.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    empty = d.post("/query", json={"token_ids": [1, 2], "model_name": MODEL})
    assert empty.json() == {"scores": {}, "frequencies": [], "instances": {}}
    assert d.post("/unregister", json={"instance_id": 201, "model_name": MODEL}).status_code == 200
    doc = d.get("/openapi.json").json()
    assert sorted(doc["paths"]) == [
        "/health",
        "/openapi.json",
        "/query",
        "/query_by_hash",
        "/register",
        "/unregister",
        "/workers",
    ]
    assert "201" in doc["paths"]["/register"]["post"]["responses"]


def test_routing_group_is_the_tenant(srv):
    assert srv.dyn.post("/register", json=_reg(301, routing_group="team-a")).status_code == 201
    tokens = list(range(900, 900 + 2 * BS))
    r = srv.http.post(
        "/events",
        json={
            "instance_id": "301",
            "model": MODEL,
            "tenant_id": "team-a",
            "events": [_event(tokens, 7000)],
        },
    )
    assert r.status_code == 200, r.text
    q = {"token_ids": tokens, "model_name": MODEL, "routing_group": "team-a"}
    assert srv.dyn.post("/query", json=q).json()["scores"] == {"301": {"0": 2 * BS}}
    v3 = srv.http.post(
        "/query",
        json={"model": MODEL, "tenant_id": "team-a", "block_size": BS, "token_ids": tokens},
    ).json()
    assert v3["team-a"]["301"]["longest_matched"] == 2 * BS
    assert (
        srv.dyn.post(
            "/unregister", json={"instance_id": 301, "model_name": MODEL, "routing_group": "team-a"}
        ).status_code
        == 200
    )


def test_dynamo_answer_from_exclusive_rows():
    """Cumulative tiers per instance; scores only for ranks with GPU tokens."""
    rows = [("7", 0, 2, 1, 0), ("7", 1, 0, 3, 1), ("8", 0, 0, 0, 0)]
    got = dynamo_answer(rows, 4)
    assert got.scores == {"7": {"0": 8}}
    m = got.instances["7"]
    assert (m.gpu, m.cpu, m.disk, m.longest_matched, m.dp) == (8, 12, 16, 16, {"0": 8, "1": 0})
    assert "8" not in got.instances and got.frequencies == []


def test_api_key_guards_register_unregister_and_workers(tmp_path):
    port = free_port()
    with running(tmp_path, "--dynamo-port", str(port), "--api-key", "s3cret") as s:
        d = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        r = d.post("/register", json=_reg(401))
        assert r.status_code == 401 and "error" in r.json()
        assert d.get("/workers").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert d.post("/register", json=_reg(401), headers=auth).status_code == 201
        assert d.get("/workers", headers=auth).status_code == 200
        assert d.post("/query", json={"token_ids": [1], "model_name": MODEL}).status_code == 200
        assert "dynamo dialect: bad request method=POST path=/register status=401" in s.log()
    port = free_port()
    with running(
        tmp_path, "--dynamo-port", str(port), "--api-key", "s3cret", "--dynamo-port-open"
    ) as s:
        d = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
        assert d.post("/register", json=_reg(402)).status_code == 201
        assert "--dynamo-port-open: the Dynamo indexer dialect" in s.log()


def test_cli_dynamo_port_flags():
    p = cli.build_parser(raise_errors=True)
    ns = p.parse_args(["--dynamo-port", "13335", "--workers", "2"])
    assert ns.dynamo_port == 13335
    with pytest.raises(cli.FlagError, match="--dynamo-port-open needs --dynamo-port"):
        p.parse_args(["--dynamo-port-open"])
    with pytest.raises(cli.FlagError, match="is the V3 port"):
        p.parse_args(["--port", "13335", "--dynamo-port", "13335"])
    with pytest.raises(cli.FlagError, match="--dynamo-port 13336 is --mooncake-port"):
        p.parse_args(["--mooncake-port", "13336", "--dynamo-port", "13336"])


# -- --workers N: both dialects, served by the owner ----------------------------------------


def test_both_dialects_with_workers(tmp_path):
    mc, dy = free_port(), free_port()
    flags = (
        "--workers",
        "2",
        "--mooncake-port",
        str(mc),
        "--dynamo-port",
        str(dy),
        "--source-down-secs",
        "86400",
        "--source-purge-secs",
        "0",
    )
    with running(tmp_path, *flags) as s:
        d = httpx.Client(base_url=f"http://127.0.0.1:{dy}", timeout=10.0)
        m = httpx.Client(base_url=f"http://127.0.0.1:{mc}", timeout=10.0)
        assert d.post("/register", json=_reg(501)).status_code == 201
        r = m.post(
            "/register",
            json={
                "endpoint": f"tcp://127.0.0.1:{free_port()}",
                "type": "vLLM",
                "modelname": MODEL,
                "instance_id": "moon-1",
                "block_size": BS,
                "dp_rank": 0,
            },
        )
        assert r.status_code == 200, r.text
        tokens = list(range(50, 50 + 3 * BS))
        _post_events(s, 501, [_event(tokens, 8000)])  # through a worker, to the owner
        _post_events(s, "moon-1", [_event(tokens[: 2 * BS], 9000)])
        want_dyn = {"501": {"0": 3 * BS}, "moon-1": {"0": 2 * BS}}
        got = d.post("/query", json={"token_ids": tokens, "model_name": MODEL}).json()
        assert got["scores"] == want_dyn
        got = m.post("/query", json={"model": MODEL, "block_size": BS, "token_ids": tokens})
        inst = got.json()["instances"]
        assert (inst["501"]["gpu"], inst["moon-1"]["gpu"]) == (3 * BS, 2 * BS)
        # the V3 port's workers read the same shared index
        for _ in range(20):
            v3 = httpx.post(
                f"{s.url}/query", json={"model": MODEL, "block_size": BS, "token_ids": tokens}
            )
            assert v3.status_code == 200
            longest = {i: v["longest_matched"] for i, v in v3.json()["default"].items()}
            assert longest == {"501": 3 * BS, "moon-1": 2 * BS}
        assert d.post("/unregister", json={"instance_id": 501, "model_name": MODEL}).json() == {
            "status": "ok"
        }
        wait_until(
            lambda: (
                "501"
                not in d.post("/query", json={"token_ids": tokens, "model_name": MODEL}).json()[
                    "scores"
                ]
            ),
            msg="unregistered over the dialect",
        )


# -- answer for answer against the real python -m dynamo.indexer ----------------------------


def _dynamo_available() -> bool:
    try:
        return importlib.util.find_spec("dynamo.indexer") is not None
    except ImportError:
        return False


@pytest.fixture
def dynamo_indexer(tmp_path):
    if not _dynamo_available():
        pytest.skip("ai-dynamo-runtime (python -m dynamo.indexer) is not installed")
    port = free_port()
    log = open(tmp_path / "dynamo-indexer.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)

    def up():
        assert proc.poll() is None, (tmp_path / "dynamo-indexer.log").read_text()
        try:
            return client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=30, msg="dynamo.indexer up")
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
        log.close()
