"""Thousands of ZeroMQ sources, the --max-sources cap and open-file exhaustion: a
registration either fully applies or leaves nothing behind (503)."""

from __future__ import annotations

import os
import resource
import time

import pytest

from tests.helpers.server import Server, started


def body(i: int, dp: int = 0, urls: dict | None = None, **kw) -> dict:
    return {
        "instance_id": f"vllm-prefill-{i}",
        "type": "vLLM",
        "modelname": "qwen",
        "block_size": 16,
        "dp_rank": dp,
        "store_backend": "YuanRong",
        "medium_endpoints": urls or {"npu": f"tcp://127.0.0.1:{20000 + i % 40000}"},
        **kw,
    }


def consistent(srv) -> tuple[int, int]:
    """(registered DPs, sources), checking every registered URL has its subscription."""
    doc = srv.http.get("/workers").json()
    want = set()
    for w in doc["workers"]:
        for dp, ep in w["endpoints"].items():
            for url in set(ep["medium_endpoints"].values()):
                want.add((w["instance_id"], int(dp), url))
    have = {(s["instance_id"], s["dp_rank"], s["url"]) for s in doc["sources"]}
    assert want == have
    return sum(len(w["endpoints"]) for w in doc["workers"]), len(have)


@pytest.fixture
def server(tmp_path, request):
    with started(tmp_path, *getattr(request, "param", ())) as srv:
        yield srv


# KVC_FAULT_SOURCES changes the count (it must stay past libzmq's default of 1023
# sockets). A registration no longer costs O(sources): the 2,000 take ~7 s on 2 cores
# (docs/performance.md, "Registering thousands of engines").
SOURCES = int(os.environ.get("KVC_FAULT_SOURCES", "2000"))


def test_two_thousand_sources(server):
    """The reference (and we, before) stopped at 341: libzmq's default of 1023 sockets."""
    assert SOURCES > 1023
    for i in range(SOURCES):
        r = server.http.post("/register", json=body(i))
        assert r.status_code == 201, (i, r.text)
    assert consistent(server) == (SOURCES, SOURCES)
    assert server.http.get("/health").text == "OK"
    assert server.http.post(
        "/query", json={"model": "qwen", "block_size": 16, "token_ids": list(range(64))}
    ).json() == {"default": {}}


@pytest.mark.parametrize("server", [("--max-sources", "5")], indirect=True)
def test_source_cap_refuses_with_503_and_changes_nothing(server):
    for i in range(5):
        assert server.http.post("/register", json=body(i)).status_code == 201
    r = server.http.post("/register", json=body(5))
    assert r.status_code == 503
    assert r.json()["error"] == (
        "source limit reached: this registration needs 1 ZeroMQ "
        "subscription(s) and 5 of at most 5 are in use (--max-sources)"
    )
    assert consistent(server) == (5, 5)
    # A re-registration that replaces a DP's subscription fits; one that adds a URL does not.
    assert (
        server.http.post(
            "/register", json=body(0, urls={"npu": "tcp://127.0.0.1:31000"})
        ).status_code
        == 201
    )
    r = server.http.post(
        "/register",
        json=body(1, urls={"npu": "tcp://127.0.0.1:31001", "cpu": "tcp://127.0.0.1:31002"}),
    )
    assert r.status_code == 503
    doc = server.http.get("/workers").json()
    kept = [w for w in doc["workers"] if w["instance_id"] == "vllm-prefill-1"][0]
    assert kept["endpoints"]["0"]["medium_endpoints"] == {"npu": "tcp://127.0.0.1:20001"}
    assert consistent(server) == (5, 5)
    # Room again after an unregistration.
    assert (
        server.http.post(
            "/unregister",
            json={
                "instance_id": "vllm-prefill-4",
                "type": "vLLM",
                "modelname": "qwen",
                "block_size": 16,
                "dp_rank": 0,
            },
        ).status_code
        == 200
    )
    assert server.http.post("/register", json=body(5)).status_code == 201
    assert consistent(server) == (5, 5)


# A source takes about three files (the SUB, its monitor and the monitor's PAIR): four
# consecutive limits run out of files at each step of opening one.
@pytest.mark.parametrize("limit", [158, 159, 160, 161])
def test_open_file_exhaustion_rolls_back(tmp_path, limit):
    """Past the process's open-file limit a registration is undone and answered 503; the
    server keeps serving, and registers again once files are free, whichever step of
    opening the source ran out of files."""
    srv = Server(
        tmp_path,
        "--max-sources",
        "1000",
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
    )
    try:
        srv.wait_ready()
        codes = []
        for i in range(200):
            r = srv.http.post("/register", json=body(i))
            codes.append(r.status_code)
            if r.status_code != 201:
                assert r.status_code == 503, r.text
                assert "nothing was registered" in r.json()["error"]
                break
        assert codes[-1] == 503 and codes.count(201) == len(codes) - 1 > 10
        n = len(codes) - 1
        assert consistent(srv) == (n, n)
        assert srv.http.get("/health").text == "OK"
        for i in range(3):
            assert (
                srv.http.post(
                    "/unregister",
                    json={
                        "instance_id": f"vllm-prefill-{i}",
                        "type": "vLLM",
                        "modelname": "qwen",
                        "block_size": 16,
                        "dp_rank": 0,
                    },
                ).status_code
                == 200
            )
        # ZeroMQ closes sockets on its reaper thread: the files come back shortly after.
        deadline = time.monotonic() + 10
        while (r := srv.http.post("/register", json=body(n))).status_code == 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.status_code == 201
        assert consistent(srv) == (n - 2, n - 2)
        assert "Traceback" not in srv.log()
    finally:
        srv.terminate()
