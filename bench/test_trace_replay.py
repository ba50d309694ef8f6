"""``bench/trace_replay.py`` on small slices: every answer of every backend equals the exact
simulator's (no timing is asserted; ``python bench/trace_replay.py`` measures)."""

import pytest

from bench import trace_replay as tr

pytestmark = pytest.mark.benchmark(group="trace")


def test_generator_is_seeded_and_has_the_conversation_shape():
    a = tr.generate("conversation", seed=3, requests=600)
    assert a == tr.generate("conversation", seed=3, requests=600)
    assert a != tr.generate("conversation", seed=4, requests=600)
    s = tr.trace_stats(a)
    assert s["requests"] == 600
    assert s["first_blocks"] == 1  # a system prompt every request starts with
    assert s["first_block_max_share"] == 600
    assert s["two_block_prefix_max_share"] <= tr.SHAPES["conversation"].max_session
    assert s["blocks_max"] <= tr.SHAPES["conversation"].max_blocks
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    for r in a:  # input_length fills the blocks: the last one partly
        assert (len(r.hash_ids) - 1) * tr.BLOCK_TOKENS < r.input_length
        assert r.input_length <= len(r.hash_ids) * tr.BLOCK_TOKENS


def test_generator_synthetic_shape_has_no_common_prefix():
    s = tr.trace_stats(tr.generate("synthetic", seed=0, requests=800))
    assert s["first_blocks"] > 300
    assert s["first_block_max_share"] <= tr.SHAPES["synthetic"].max_session


def test_trace_file_round_trip(tmp_path):
    reqs = tr.generate("synthetic", seed=1, requests=50)
    path = tmp_path / "t.jsonl"
    tr.write_trace(reqs, path)
    assert tr.load_trace(path) == reqs
    assert tr.load_trace(path, limit=7) == reqs[:7]


class Lossy(tr.KvcBackend):
    """A backend that drops every remove event: answers with evicted blocks."""

    name = "lossy"

    def calls(self):
        q, s, _ = super().calls()
        return q, s, lambda key, hashes: 0


def _check(stream, backends):
    assert stream.record_mismatches == 0
    runs = tr.run(stream, backends, repeats=1)
    for b, rs in runs.items():
        assert rs[0]["mismatches"] == 0, (b, rs[0]["first_mismatches"])
        assert rs[0]["ops"] == len(stream.ops)
    return runs


@pytest.mark.parametrize("policy", tr.POLICIES)
def test_replay_equals_the_simulator(policy):
    reqs = tr.generate("conversation", seed=5, requests=400)
    # 16 engines on 8 instances x 2 DP ranks; 48 blocks each: engines evict
    stream = tr.record(reqs, 16, 48, policy, dp=2, label="slice")
    c = stream.counts()
    assert c["queries"] == 400
    assert stream.blocks_removed > 0 and c["removes"] > 0
    assert 0 < stream.blocks_saved < stream.blocks_requested
    runs = _check(stream, tr.default_backends())
    pairs = runs["kvc"][0]["pairs"]
    assert pairs == stream.blocks_stored - stream.blocks_removed  # live (worker, block)
    assert runs["kvc"][0]["bytes_per_pair"] > 0


def test_top_items_cut_ties_at_the_kth_depth():
    # at most k items: the deeper ones, then a run of the tied ones in group order from
    # the seed's start (docs/api.md, "top_k and instances")
    d = tr.DEPTH_BITS
    items = [(0 << d) | 5, (1 << d) | 3, (2 << d) | 3, (3 << d) | 1, (4 << d) | 3]
    order = {0: 0, 1: 3, 2: 1, 3: 2, 4: 4}  # tied at 3 in group order: engines 2, 1, 4
    tied = [items[2], items[1], items[4]]
    for seed in range(12):
        start = tr._mix64(seed) % 3
        want = [items[0], *(tied[(start + j) % 3] for j in range(1))]
        assert tr.top_items(items, 2, order, seed) == want
        assert len(tr.top_items(items, 3, order, seed)) == 3
    assert tr.top_items(items, 1, order, 0) == [items[0]]
    assert tr.top_items(items, 4, order, 0) == [items[0], *tied]
    assert tr.top_items(items, 9, order, 0) == items


def test_top8_and_phases_backends_equal_the_simulator():
    """Round-robin over 32 engines: the first block on every engine, so answers have up to
    32 rows; the top-8 answer has at most 8 (most answers are 32 rows tied at depth 1,
    cut to a run of 8 of them)."""
    reqs = tr.generate("conversation", seed=7, requests=300)
    stream = tr.record(reqs, 32, 64, "round-robin")
    pairs = list(zip(stream.expected, stream.expected_top, strict=True))
    assert all(t.count <= min(a.count, tr.TOP_K) for a, t in pairs)
    assert sum(a != t for a, t in pairs) > 0  # some answers are cut
    names = [f"kvc-top{tr.TOP_K}", "kvc-phases", "kvc-dict", "kvc-hits"]
    if tr.dynamo_radix_tree() is not None:
        names.append(f"dynamo-top{tr.TOP_K}")
    runs = _check(stream, names)
    phases = runs["kvc-phases"][0]
    assert phases["phase_match_s"] > 0 and phases["phase_encode_s"] > 0
    top = runs[f"kvc-top{tr.TOP_K}"][0]
    assert top["rows_max"] == tr.TOP_K and top["rows_mean"] <= tr.TOP_K
    assert runs["kvc-dict"][0]["rows_max"] == runs["kvc-hits"][0]["rows_max"] == 32
    for b in names[3:]:
        assert runs[b][0]["rows_max"] <= (32 if b == "kvc-hits" else tr.TOP_K)


def test_the_top_depths_a_dynamo_top8_answer_must_have():
    d = tr.DEPTH_BITS
    items = [(w << d) | depth for w, depth in enumerate([1, 4, 1, 2, 4, 3, 1, 1, 1, 1, 1])]
    assert tr.top_depths(items, 3) == (4, 4, 3)
    assert tr.top_depths(items) == (4, 4, 3, 2, 1, 1, 1, 1)
    assert tr.top_depths([]) == ()


def test_scores_of_an_old_query_result_is_the_dict_a_router_made():
    from kvconductor.index import DpHit, QueryResult

    class Old:  # a QueryResult from before scores(): its DpHit rows only
        def __init__(self, hits):
            self.hits = hits

    hits = [DpHit("a", 0, 3, 1, 0), DpHit("b", 2, 1, 0, 0)]
    assert tr.scores_of(Old(hits)) == tr.scores_of(QueryResult(hits)) == {("a", 0): 4, ("b", 2): 1}


def test_separate_check_reports_the_checked_replay(monkeypatch):
    """--check separate: the timed runs do not check, the extra replay does, and its
    mismatches are every timed run's (a lossy backend is still caught)."""

    monkeypatch.setitem(tr.BACKENDS, "lossy", Lossy)
    reqs = tr.generate("conversation", seed=5, requests=300)
    stream = tr.record(reqs, 8, 32, "round-robin")
    runs = tr.run(stream, ["kvc", "lossy"], repeats=2, check="separate")
    assert [x["mismatches"] for x in runs["kvc"]] == [0, 0]
    bad = [x["mismatches"] for x in runs["lossy"]]
    assert bad[0] == bad[1] > 0
    assert all(x["checked"] == "separate" for b in runs.values() for x in b)
    assert tr.replay(stream, "lossy", check=False)["mismatches"] == 0  # not checked


def test_kv_aware_routing_saves_more_prefill_than_round_robin():
    reqs = tr.generate("conversation", seed=2, requests=500)
    rr = tr.record(reqs, 32, 4096, "round-robin")
    kv = tr.record(reqs, 32, 4096, "kv-aware")
    assert kv.record_mismatches == 0
    assert kv.hit_ratio > 2 * rr.hit_ratio


@pytest.mark.parametrize("workers", [1, 2])
def test_a_block_is_its_place_in_a_chain(workers):
    """The same id under two parents is two blocks (as for an engine's rolling hash); a
    request that repeats an earlier one's ids hits them all."""
    rows = [
        ([1, 2, 3], 0),
        ([5, 2, 3], 1),  # 2 and 3 again, under another first block
        ([1, 2, 3, 4], 2),
        ([5, 2], 3),
        ([1, 2, 3, 4], 4),
    ]
    reqs = [tr.Request(t * 1000, len(ids) * 512, 8, tuple(ids)) for ids, t in rows]
    stream = tr.record(reqs, workers, 64, "round-robin")
    # one engine gets them all, or engine 0 gets requests 0, 2, 4 and engine 1 gets 1, 3
    assert stream.blocks_saved == 0 + 0 + 3 + 2 + 4
    assert stream.blocks_stored == 3 + 3 + 1 + 0 + 0
    _check(stream, tr.default_backends())


def test_the_checker_sees_a_lost_event(monkeypatch):
    """A backend that drops every remove event answers with evicted blocks: counted."""

    monkeypatch.setitem(tr.BACKENDS, "lossy", Lossy)
    reqs = tr.generate("conversation", seed=5, requests=300)
    stream = tr.record(reqs, 8, 32, "round-robin")
    out = tr.replay(stream, "lossy")
    assert out["mismatches"] > 0
    assert tr.replay(stream, "kvc")["mismatches"] == 0


def test_command_line_on_a_trace_file(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    tr.write_trace(tr.generate("synthetic", seed=7, requests=150), path)
    out = tmp_path / "r.json"
    argv = ["--trace", str(path), "--workers", "4", "12", "--capacity", "64"]
    argv += ["--policy", *tr.POLICIES, "--repeats", "2", "--json", str(out)]
    assert tr.main(argv) == 0
    text = capsys.readouterr().out
    assert "| t | 12 | kv-aware |" in text
    import json

    results = json.loads(out.read_text())
    assert len(results) == 6
    assert all(len(r["runs"]["kvc"]) == 2 for r in results)


def test_server_events_are_vllm_0_33_wire_batches():
    """The server mode's events are byte-identical to vLLM 0.33's (tests/helpers/publishers.py
    holds the reference classes)."""
    import msgspec

    from bench import trace_server as ts
    from tests.helpers.publishers import schema

    v = schema("vllm", "0.33.0")
    enc = msgspec.msgpack.Encoder()
    toks = ts.block_tokens(7) + ts.block_tokens(8)
    ours = enc.encode(
        ts.KVEventBatch(1.5, [ts.BlockStored([11, 12], 10, toks, 16, None, "GPU", None)], 3)
    )
    assert ours == v.batch([v.stored([11, 12], 10, toks, 16, medium="GPU")], dp=3, ts=1.5)
    ours = enc.encode(ts.KVEventBatch(2.0, [ts.BlockRemoved([11], "GPU")], 0))
    assert ours == v.batch([v.removed([11], medium="GPU")], dp=0, ts=2.0)


@pytest.mark.server
def test_server_answers_equal_the_simulator_at_quiescence():
    """The stream played against a real server (ZeroMQ publishers, HTTP clients): every
    batch applied, no loss, every answer equal to the simulator's final state."""
    from bench import trace_server as ts

    reqs = tr.generate("conversation", seed=11, requests=200)
    stream = tr.record(reqs, 8, 48, "round-robin", dp=2)
    out = ts.run_server(stream, reqs, pace=0, publishers=2, clients=1)
    assert out["applied"] == out["batches"] > 0
    assert out["gaps"] == out["losses"] == out["dropped"] == 0
    assert out["queries"] == 200 and out["query_errors"] == 0
    assert out["checked"] == 200 and out["mismatches"] == 0


@pytest.mark.server
def test_server_predictions_are_posted_and_leave_no_trace_at_quiescence():
    """--server-predictions: every query followed by its prediction (200), each one gone by
    quiescence (confirmed, expired or contradicted), every answer exact then."""
    from bench import trace_server as ts

    reqs = tr.generate("conversation", seed=11, requests=200)
    stream = tr.record(reqs, 8, 48, "round-robin", dp=2)
    assert len(stream.routed) == 200
    out = ts.run_server(
        stream,
        reqs,
        pace=0,
        publishers=2,
        clients=1,
        floor=False,
        predictions=True,
        prediction_ttl=0.5,
    )
    assert out["queries"] == out["predicts"] == 200
    assert out["query_errors"] == out["predict_errors"] == 0
    c = out["prediction_outcomes"]
    assert c["added"] == 200 and c["live"] == 0
    assert c["confirmed"] + c["expired"] + c["contradicted"] + c["dropped"] == 200
    assert out["checked"] == 200 and out["mismatches"] == 0
    assert "| 0 of 200 | " in tr.server_row(stream, out)


def test_predictions_mode_saves_more_prefill_blocks_never_fewer():
    # the engines' publish delay modelled, the clock compressed so bursts overlap it
    from bench import trace_predict as tp

    reqs = tr.generate("conversation", seed=2, requests=600)
    runs = tp.compare(reqs, 8, 256, [1.0, 100.0], ttl=2.0)
    assert [(r["clock_scale"], r["predictions"]) for r in runs] == [
        (1.0, False),
        (1.0, True),
        (100.0, False),
        (100.0, True),
    ]
    for off, on in zip(runs[::2], runs[1::2], strict=True):
        assert (
            off["blocks_requested"] == on["blocks_requested"] == sum(len(r.hash_ids) for r in reqs)
        )
        assert on["blocks_saved"] >= off["blocks_saved"], (off, on)
        assert on["added"] == len(reqs)
        assert (
            on["live"] + on["confirmed"] + on["expired"] + on["contradicted"] + on["dropped"]
            == on["added"]
        )
    assert runs[3]["blocks_saved"] > runs[2]["blocks_saved"]
    assert len(tp.rows(runs)) == 2


def test_predictions_mode_from_the_command_line(capsys):
    assert tr.main(["--requests", "200", "--workers", "4", "--predictions", "50"]) == 0
    out = capsys.readouterr().out
    assert "| 4 | 50 |" in out


@pytest.mark.server
def test_server_top_k_answers_are_the_simulators_cut_at_300_workers():
    """``top_k=8`` through the server at 300 round-robin workers: every whole answer equal
    to the simulator's, and every cut answer the simulator's eight deepest with the ties at
    the cut as docs/api.md rotates them (``top_items`` in the whole answer's group order)."""
    from bench import trace_server as ts

    fit = ts.sources_that_fit()
    if fit is not None and fit < 301:
        pytest.skip(f"the hard open-file limit fits {fit} sources")
    reqs = tr.generate("conversation", seed=13, requests=300)
    stream = tr.record(reqs, 300, 32, "round-robin")
    out = ts.run_server(stream, reqs, pace=0, publishers=2, clients=1, top_k=8, floor=False)
    assert out["applied"] == out["batches"] > 0
    assert out["gaps"] == out["losses"] == out["dropped"] == 0
    assert out["queries"] == 300 and out["query_errors"] == 0
    assert out["whole_mismatches"] == out["top_mismatches"] == out["mismatches"] == 0
    # the system prompt is held by every worker that served a request: the cut is real
    assert max(len(tr.simulate_answer(c, stream.final_holders)) for c in stream.chains) > 8


def test_cut_check_catches_a_wrong_tie_and_a_ninth_row():
    """The quiescence check's cut (``_is_cut``): the rotation's ties with one DP per
    instance, a valid cut with several; a row too many or a wrong tie is a mismatch."""
    from array import array

    from xxhash import xxh3_64_intdigest

    from bench import trace_server as ts

    d = tr.DEPTH_BITS
    want = [(w << d) | (3 if w < 2 else 1) for w in range(12)]  # two at depth 3, ten at 1
    whole = list(want)
    hashes = [5, 6, 7]
    order = {w: w for w in range(12)}
    cut = tr.top_items(want, 4, order, xxh3_64_intdigest(array("Q", hashes)))
    assert ts._is_cut(cut, want, whole, 4, hashes, 1)
    wrong = [x for x in want if x not in cut][-1]
    assert not ts._is_cut(cut[:-1] + [wrong], want, whole, 4, hashes, 1)
    assert not ts._is_cut(cut + [wrong], want, whole, 4, hashes, 1)
    assert ts._is_cut(cut[:-1] + [wrong], want, whole, 4, hashes, 2)  # any tie, several DPs
    assert not ts._is_cut([want[0], *want[2:5]], want, whole, 4, hashes, 2)  # a deeper row left out
    assert not ts._is_cut(cut + [wrong], want, whole, 4, hashes, 2)


def test_a_size_the_servers_open_files_cannot_hold_is_refused_before_it_starts(monkeypatch):
    from bench import trace_server as ts

    monkeypatch.setattr(ts, "sources_that_fit", lambda: 7)
    reqs = tr.generate("conversation", seed=1, requests=20)
    stream = tr.record(reqs, 8, 16, "round-robin")
    with pytest.raises(ts.DoesNotFit, match="fits 7"):
        ts.run_server(stream, reqs)


def _dynamo_indexer():
    from bench import trace_dynamo_server as tds

    if not tds.available():
        pytest.skip("ai-dynamo-runtime is not installed")
    return tds


@pytest.mark.server
def test_dynamo_indexer_service_gets_the_same_stream_and_answers_exactly():
    """The same ZeroMQ bytes and queries by hash played against Dynamo's standalone indexer
    service (``python -m dynamo.indexer``): every batch applied, every answer (matched
    tokens per instance and DP) equal to the simulator's at quiescence."""
    tds = _dynamo_indexer()
    from bench import trace_server as ts

    reqs = tr.generate("conversation", seed=11, requests=200)
    stream = tr.record(reqs, 16, 48, "round-robin", dp=2)
    out = ts.run_server(
        stream, reqs, pace=0, publishers=2, clients=1, floor=False, target=tds.DynamoIndexer
    )
    assert out["backend"] == "dynamo-indexer"
    assert out["applied"] == out["batches"] > 0 and out["dropped"] == 0
    assert out["queries"] == 200 and out["query_errors"] == 0
    assert out["checked"] == 200 and out["mismatches"] == 0


def test_dynamo_indexer_hashes_are_signed_and_scores_are_tokens():
    tds = _dynamo_indexer()
    assert tds.signed((1 << 64) - 1) == -1 and tds.signed(5) == 5
    svc = object.__new__(tds.DynamoIndexer)
    svc.dp = 2
    raw = b'{"scores": {"3": {"1": 48}, "0": {"0": 16}}, "frequencies": [], "instances": {}}'
    assert sorted(svc.items(raw)) == [(0 << tr.DEPTH_BITS) | 1, (7 << tr.DEPTH_BITS) | 3]


@pytest.mark.server
def test_command_line_server_modes(tmp_path, capsys):
    """``--server 0 --server-top-k 0 8 [--server-dynamo] --server-floor-ingest
    --server-floor-sources``: one row per service and top_k, all exact; both ingesting
    floors (one SUB, a SUB per engine) received every event batch and answered
    kv-conductor's mean answer size."""
    import json

    argv = ["--requests", "120", "--workers", "24", "--capacity", "32", "--repeats", "0"]
    argv += ["--policy", "round-robin", "--server", "0", "--server-top-k", "0", "8"]
    argv += ["--clients", "1", "--publishers", "2", "--json", str(tmp_path / "r.json")]
    argv += ["--server-floor-ingest", "--server-floor-sources"]
    from bench import trace_dynamo_server as tds

    if tds.available():
        argv.append("--server-dynamo")
    assert tr.main(argv) == 0
    text = capsys.readouterr().out
    assert "| kv-conductor | all | saturation |" in text
    assert "| kv-conductor | 8 | saturation |" in text
    assert ("| dynamo-indexer | all | saturation |" in text) == tds.available()
    rows = {
        (r["backend"], r["top_k"]): r
        for r in json.loads((tmp_path / "r.json").read_text())[0]["server"]
    }
    for k in (None, 8):
        ours = rows["kv-conductor", k]
        for name in ("floor + ingest", "floor + sources"):
            floor = rows[name, k]
            assert floor["applied"] == floor["batches"] == ours["batches"] > 0
            assert floor["answer_bytes_mean"] == ours["answer_bytes_mean"] > 0
            assert floor["queries"] == ours["queries"] and floor["query_errors"] == 0


def test_native_answer_times_both_indexes_on_the_replayed_state(capsys):
    """``bench/native_answer.py`` small: a wide answer has a row per worker, in both."""
    import json

    from bench import native_answer as na

    argv = ["--requests", "200", "--workers", "16", "--calls", "3", "--rounds", "1"]
    assert na.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["backend"] for r in rows][0] == "kvc-core"
    assert len(rows) == (2 if tr.dynamo_radix_tree() is not None else 1)
    for r in rows:
        assert r["rows"] == 16 and r["wide_calls"] >= 1
        assert r["wide_us"] > 0 and r["miss_us"] > 0 and r["replay_store_ns_per_block"] > 0
    assert rows[0]["store_held_us"] > 0


def test_a_run_not_made_names_its_service_and_why():
    """A row that could not run says which service and why (an ingesting floor whose
    kv-conductor run gave no answer size; a size that does not fit)."""
    stream = tr.Stream("t", 8, 1, 32, "round-robin")
    row = {"backend": "floor + ingest", "pace": 0.0, "top_k": 8, "error": "no size"}
    assert tr.server_row(stream, {**row, "mismatches": 0}) == (
        "| t | 8 | round-robin | floor + ingest | 8 | saturation | not run: no size |"
    )
    del row["backend"]
    assert "| kv-conductor | 8 | saturation | not run: no size |" in tr.server_row(stream, row)
