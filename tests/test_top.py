"""kv-conductor top: the numbers against hand-computed values, then the whole command
against a real server fed by a real ZeroMQ publisher, drawn on a recording console."""

from __future__ import annotations

import io
import math
import ssl
import sys

import httpx
import pytest
from rich.console import Console

from kvconductor.serve import cli
from kvconductor.tools import top
from kvconductor.tools.top import Poll, histogram_quantile, parse_metrics, query_window, source_rows
from tests.helpers.publishers import FakePublisher, schema, wait_until
from tests.helpers.server import Server, free_port, running

INF = math.inf

# ---------------------------------------------------------------------------------------
# Quantiles, rates, hit ratio
# ---------------------------------------------------------------------------------------

BUCKETS = [(0.1, 2.0), (0.2, 6.0), (0.5, 10.0), (INF, 10.0)]


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        # rank 5 of 10 falls in (0.1, 0.2] holding ranks 3..6: 0.1 + 0.1 * (5 - 2) / 4
        (0.5, 0.175),
        # rank 9.9 in (0.2, 0.5] holding 7..10: 0.2 + 0.3 * (9.9 - 6) / 4
        (0.99, 0.4925),
        # rank 1 in the first bucket, lower bound 0: 0.1 * 1 / 2
        (0.1, 0.05),
        # rank 6 exactly at the top of (0.1, 0.2]
        (0.6, 0.2),
    ],
)
def test_histogram_quantile_interpolates_within_the_bucket(q, expected):
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected, abs=1e-12)


def test_histogram_quantile_edges():
    # Rank 3.96 of 4 lies beyond the last finite bound: that bound, as Prometheus says.
    assert histogram_quantile(0.99, [(0.1, 1.0), (0.25, 1.0), (INF, 4.0)]) == 0.25
    # Empty buckets before the rank are skipped: rank 1 of 2 in (0.25, 0.5] holding 1..2.
    assert histogram_quantile(0.5, [(0.1, 0.0), (0.25, 0.0), (0.5, 2.0), (INF, 2.0)]) == 0.375
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None


def _exposition(buckets: dict[str, dict[str, int]], misses: dict[str, int]) -> str:
    """A /metrics text with per-route query buckets and miss counters."""
    lines = [
        "# HELP kvconductor_query_seconds t",
        "# TYPE kvconductor_query_seconds histogram",
    ]
    for route, counts in buckets.items():
        for le, n in counts.items():
            lines.append(f'kvconductor_query_seconds_bucket{{le="{le}",route="{route}"}} {n}.0')
        lines.append(f'kvconductor_query_seconds_count{{route="{route}"}} {counts["+Inf"]}.0')
        lines.append(f'kvconductor_query_seconds_sum{{route="{route}"}} 0.5')
    lines += ["# HELP kvconductor_query_misses_total m", "# TYPE kvconductor_query_misses counter"]
    for reason, n in misses.items():
        lines.append(f'kvconductor_query_misses_total{{reason="{reason}"}} {n}.0')
    return "\n".join(lines) + "\n"


PREV = _exposition(
    {
        "/query": {"0.001": 10, "0.01": 20, "+Inf": 20},
        "/query_by_hash": {"0.001": 0, "0.01": 4, "+Inf": 4},
    },
    {"unknown_index": 1, "no_match": 3},
)
CUR = _exposition(
    {
        "/query": {"0.001": 30, "0.01": 60, "+Inf": 61},
        "/query_by_hash": {"0.001": 0, "0.01": 24, "+Inf": 24},
    },
    {"unknown_index": 1, "no_match": 13, "block_size_mismatch": 5},
)


def test_query_window_over_an_interval():
    # Buckets summed over both routes: prev 10/24/24, cur 30/84/85; in 2 s: 20/60/61.
    w = query_window(parse_metrics(CUR), parse_metrics(PREV), 2.0)
    assert w.seconds == 2.0 and w.queries == 61 and w.rate == 30.5
    # p50: rank 30.5 in (0.001, 0.01] holding 21..60: 0.001 + 0.009 * 10.5 / 40
    assert w.p50 == pytest.approx(0.0033625)
    # p99: rank 60.39 in +Inf: the last finite bound
    assert w.p99 == 0.01
    # misses in the window: 0 + 10 + 5 of 61 queries
    assert w.misses == {
        "unknown_index": 0,
        "block_size_mismatch": 5,
        "unknown_lora": 0,
        "no_match": 10,
    }
    assert w.hit_ratio == pytest.approx(46 / 61)


def test_query_window_since_start_and_after_a_restart():
    w = query_window(parse_metrics(CUR))
    assert (w.seconds, w.queries, w.rate) == (None, 85, None)
    # rank 42.5 of 85 in (0.001, 0.01] holding 31..84: 0.001 + 0.009 * 12.5 / 54
    assert w.p50 == pytest.approx(0.001 + 0.009 * 12.5 / 54)
    assert w.hit_ratio == pytest.approx(1 - 19 / 85)
    # The server restarted between the polls (counters went down): all of CUR's PREV.
    w = query_window(parse_metrics(PREV), parse_metrics(CUR), 1.0)
    assert w.queries == 24 and w.rate == 24.0
    assert w.misses == {
        "unknown_index": 1,
        "block_size_mismatch": 0,
        "unknown_lora": 0,
        "no_match": 3,
    }
    # No query in the window: no quantile, no ratio, a rate of 0.
    w = query_window(parse_metrics(CUR), parse_metrics(CUR), 1.0)
    assert (w.queries, w.rate, w.p50, w.hit_ratio) == (0, 0.0, None, None)


def test_hit_ratio_leaves_rejected_requests_out():
    text = _exposition({"/query": {"0.001": 10, "+Inf": 10}}, {"no_match": 2})
    text += (
        "# HELP kvconductor_query_errors_total e\n# TYPE kvconductor_query_errors counter\n"
        'kvconductor_query_errors_total{route="/query"} 4.0\n'
    )
    w = query_window(parse_metrics(text))
    # 10 requests, 4 rejected: 6 answered, 2 of them without a match
    assert (w.queries, w.errors, w.hit_ratio) == (10, 4, pytest.approx(4 / 6))


def _workers(events: int) -> dict:
    return {
        "workers": [
            {
                "instance_id": "e1",
                "endpoints": {
                    "0": {"medium_endpoints": {"npu": "tcp://h:1"}},
                    # a legacy endpoint: one URL feeds all three media
                    "1": {"medium_endpoints": {"npu": "tcp://h:2", "cpu": "tcp://h:2"}},
                },
            }
        ],
        "indexer": [],
        "sources": [
            {"instance_id": "e1", "dp_rank": 0, "url": "tcp://h:1", "state": "live",
             "events": events, "losses": 0, "dropped": {"gap": 2, "parent_not_found": 1}},
            {"instance_id": "e1", "dp_rank": 1, "url": "tcp://h:2", "state": "connecting",
             "events": 7, "losses": 1, "dropped": {}},
        ],
    }  # fmt: skip


AGES = """# TYPE kvconductor_source_last_event_age_seconds gauge
kvconductor_source_last_event_age_seconds{dp_rank="0",instance_id="e1",medium="NPU"} 1.5
kvconductor_source_last_event_age_seconds{dp_rank="1",instance_id="e1",medium="NPU"} 9.0
kvconductor_source_last_event_age_seconds{dp_rank="1",instance_id="e1",medium="CPU"} 8.5
"""


def test_source_rows_rate_and_age():
    prev = Poll(100.0, _workers(40), parse_metrics(AGES))
    cur = Poll(102.5, _workers(140), parse_metrics(AGES))
    a, b = source_rows(cur, prev)
    assert (a.instance_id, a.dp_rank, a.state, a.events) == ("e1", 0, "live", 140)
    assert a.event_rate == 40.0  # 100 events in 2.5 s
    assert a.last_event_age == 1.5 and a.dropped == 3 and a.losses == 0
    assert b.event_rate == 0.0 and b.last_event_age == 8.5 and b.losses == 1
    first = source_rows(cur)
    assert first[0].event_rate is None and first[0].last_event_age == 1.5


def test_cell_text():
    assert top.fmt_seconds(0.0000852) == "85 µs"
    assert top.fmt_seconds(0.0025) == "2.50 ms"
    assert top.fmt_seconds(1.2) == "1.20 s"
    assert top.fmt_seconds(None) == "-"
    assert top.fmt_ratio(46 / 61) == "75.4%"
    assert top.fmt_bytes(512) == "512 B"
    assert top.fmt_bytes(1536) == "1.5 KiB"
    assert top.fmt_bytes(3 * 1024**3) == "3.0 GiB"


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


def test_without_rich_one_line_and_exit_2(monkeypatch, capsys):
    for name in ("rich", "rich.console", "rich.live"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    assert top.main(["--url", "http://127.0.0.1:1", "--once"]) == 2
    err = capsys.readouterr().err
    assert err == "kv-conductor top needs the 'top' extra: pip install 'kvconductor[top]'\n"


def test_unreachable_or_bad_url_exit_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["top", "--url", url, "--once", "--interval", "0.1"]) == 1  # the CLI's way
    assert capsys.readouterr().err == f"kv-conductor top: cannot reach {url}: connection refused\n"
    assert top.main(["--url", "localhost:13333", "--once"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kv-conductor top: invalid --url 'localhost:13333': expected http://")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--interval", "0"], "invalid interval '0': must be within 0.1..3600"),
        (["--iterations", "0"], "invalid count 0: must be >= 1"),
        (["--urll", "x"], "unrecognized arguments: --urll x"),
    ],
)
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as ex:
        top.main(argv)
    assert ex.value.code == 2 and message in capsys.readouterr().err


def test_live_mode_keeps_retrying_and_shows_the_error():
    url = f"http://127.0.0.1:{free_port()}"
    console = Console(record=True, width=160, file=io.StringIO())
    assert top.main(["--url", url, "--iterations", "2", "--interval", "0.1"], console) == 1
    text = console.export_text()
    assert f"error: cannot reach {url}: connection refused; retrying" in text
    assert "Sources" in text and "Recent warnings" in text


KEY = "top-secret-key"
BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4 tokens
HASHES = [0xB000 + i for i in range(6)]


def _line(text: str, first_word: str) -> list[str]:
    """The words of the first line of ``text`` whose first word is ``first_word``."""
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == first_word:
            return words
    raise AssertionError(f"no line starting with {first_word!r} in:\n{text}")


@pytest.mark.server
def test_top_against_a_real_server(tmp_path, capsys):
    pub = FakePublisher(replay=False)
    try:
        with running(tmp_path, "--api-key", KEY) as srv:
            srv.http.headers["Authorization"] = f"Bearer {KEY}"
            r = srv.http.post(
                "/register",
                json={
                    "instance_id": "vllm-top-1",
                    "type": "vLLM",
                    "modelname": "qwen",
                    "block_size": BS,
                    "dp_rank": 0,
                    "medium_endpoints": {"npu": pub.url},
                },
            )
            assert r.status_code == 201, r.text
            v = schema("vllm", "0.33.0")
            batch = v.batch([v.stored(HASHES, None, TOKENS, BS, medium="GPU")])

            pub.wait_subscribed()  # the PUB drops what it sends before
            pub.publish(batch)

            def indexed() -> bool:
                doc = srv.http.get("/workers").json()
                return doc["indexer"][0]["hbm_blocks"] == 6 and doc["sources"][0]["state"] == (
                    "live"
                )

            wait_until(indexed, msg="6 blocks indexed, source live")

            def query(tokens, block_size=BS) -> dict:
                body = {"model": "qwen", "block_size": block_size, "token_ids": tokens}
                r = srv.http.post("/query", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            for _ in range(3):  # hits
                assert query(TOKENS)["default"]["vllm-top-1"]["DP"]["0"]["npu_blocks"] == 6
            assert query([1, 2, 3, 4]) == {"default": {}}  # no_match
            assert query(TOKENS, block_size=8) == {"default": {}}  # block_size_mismatch

            # Without the key: 401, one line, exit 1.
            assert top.main(["--url", srv.url, "--once", "--interval", "0.1"]) == 1
            err = capsys.readouterr().err
            assert err == (
                f"kv-conductor top: GET {srv.url}/workers: 401 unauthorized "
                "(give --api-key or set KV_CONDUCTOR_API_KEY)\n"
            )

            console = Console(record=True, width=160, file=io.StringIO())
            argv = ["--url", srv.url, "--api-key", KEY, "--once", "--interval", "0.2"]
            assert top.main(argv, console) == 0
            text = console.export_text()

            events = srv.http.get("/workers").json()["sources"][0]["events"]
            assert events >= 1  # the batch, once per publish that arrived
            row = _line(text, "vllm-top-1")
            assert row[:6] == ["vllm-top-1", "0", pub.url, "qwen", "live", str(events)]
            # The index: 1 worker, 6 NPU blocks, nothing on CPU or disk, 6 in all.
            assert _line(text, "qwen")[:7] == ["qwen", "default", "1", "6", "0", "0", "6"]
            # Nothing queried during the 0.2 s between the two polls.
            assert _line(text, "last")[3:5] == ["0", "0.0/s"]
            since = _line(text, "since")
            assert since[2:4] == ["5", "-"]
            # 3 of 5 answered with a match; misses: unknown index, block size, unknown
            # LoRA, no match.
            assert since[-5:] == ["60.0%", "0", "1", "0", "1"]
            warned = [ln for ln in text.splitlines() if "query cannot match" in ln]
            assert len(warned) == 1 and warned[0].split()[1:5] == [
                "WARN",
                "query",
                "cannot",
                "match:",
            ]
            assert "block_size 8 matches no registration of model=qwen" in warned[0]
            assert "unauthorized request" in text  # the attempt without the key

            # Live mode with the key, two frames: the second has the interval's rates.
            console = Console(record=True, width=160, file=io.StringIO())
            argv = ["--url", srv.url, "--api-key", KEY, "--iterations", "2", "--interval", "0.2"]
            assert top.main(argv, console) == 0
            text = console.export_text()
            assert _line(text, "vllm-top-1")[4:7] == ["live", str(events), "0.0/s"]
            assert _line(text, "since")[2] == "5" and _line(text, "last")[3] == "0"
    finally:
        pub.stop()


@pytest.mark.server
def test_https_checks_the_certificate(tmp_path, capsys, monkeypatch):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert, ca_file = tmp_path / "server.pem", tmp_path / "ca.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(cert)
    ca.cert_pem.write_to_path(ca_file)
    srv = Server(tmp_path, "--host", "127.0.0.1", "--tls-cert", str(cert))
    try:
        url = f"https://127.0.0.1:{srv.port}"
        srv.http.close()
        srv.http = httpx.Client(
            base_url=url, timeout=10.0, verify=ssl.create_default_context(cafile=ca_file)
        )
        srv.wait_ready()
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        argv = ["--url", url, "--once", "--interval", "0.1"]
        assert top.main(argv) == 1
        assert capsys.readouterr().err == (
            f"kv-conductor top: cannot reach {url}: TLS: CERTIFICATE_VERIFY_FAILED "
            "(is the server's CA in SSL_CERT_FILE?)\n"
        )
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        console = Console(record=True, width=160, file=io.StringIO())
        assert top.main(argv, console) == 0
        assert console.export_text().startswith(f"kv-conductor top  {url}  version ")
    finally:
        code, _ = srv.terminate()
        assert code == 0, srv.log()


def test_live_mode_keeps_the_last_good_tables_on_an_error(monkeypatch):
    polls = iter(
        [
            Poll(10.0, _workers(40), parse_metrics(AGES + CUR)),
            top.FetchError("cannot reach http://h:1: connection refused"),
        ]
    )

    def fake_fetch(url, api_key=None, timeout=5.0):
        got = next(polls)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(top, "fetch", fake_fetch)
    console = Console(record=True, width=160, file=io.StringIO())
    assert top.main(["--url", "http://h:1", "--iterations", "2", "--interval", "0.1"], console) == 0
    text = console.export_text()
    assert "error: cannot reach http://h:1: connection refused; retrying; the tables are from" in (
        text
    )
    assert _line(text, "e1")[:6] == ["e1", "0", "tcp://h:1", "live", "40", "-"]  # no model
    assert _line(text, "since")[2] == "85"
