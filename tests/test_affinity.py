"""KV-affinity scoring and its configuration (docs/client.md, "Affinity scoring", "Configuration").

Every expected value below is computed by hand in the comments.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest

from kvconductor.affinity import (
    DEFAULT_LOAD_GATE_TOPN,
    LEGACY_KEYS,
    Candidate,
    KvAffinityConfig,
    Ranked,
    affinity_matched,
    migrate_legacy_keys,
    needs_query,
    rank,
    score_candidates,
)

BS = 4  # block size
ISL = 16  # prompt length: 4 blocks


def dp(npu=0, cpu=0, disk=0, bs=BS):
    return {
        "matched_tokens": (npu + cpu + disk) * bs,
        "npu_blocks": npu,
        "cpu_blocks": cpu,
        "disk_blocks": disk,
    }


# A V3 answer: instance a holds 2 blocks in HBM on DP 0, b 3 blocks in CPU on
# DP 1, c 1 block on Disk on DP 0; d is not reported (no hit).
RESPONSE = {
    "default": {
        "a": {"longest_matched": 8, "DP": {"0": dp(npu=2)}},
        "b": {"longest_matched": 12, "DP": {"1": dp(cpu=3)}},
        "c": {"longest_matched": 4, "DP": {"0": dp(disk=1)}},
    }
}
CANDS = [
    Candidate("a", 0, 1.0),
    Candidate("b", 1, 10.0),
    Candidate("c", 0, 0.0),
    Candidate("d", 0, 2.0),
]

# Default weights (w_npu 1, w_cpu 1, w_disk 0), block size 4:
#   affinity a = round((2*1) * 4) = 8     b = round((3*1) * 4) = 12
#            c = round((1*0) * 4) = 0     d = 0 (unreported)
#   matched = min(affinity, 16)         -> 8, 12, 0, 0
#   prefill = max(0, 16 - 1*matched)    -> 8, 4, 16, 16
UNIFIED_CASES = [
    # (config kwargs, expected ranking)
    # score = 1*prefill + 1*load: a 8+1=9, b 4+10=14, c 16+0=16, d 16+2=18
    ({}, [("a", 0, 9.0), ("b", 1, 14.0), ("c", 0, 16.0), ("d", 0, 18.0)]),
    # load_weight 0 = pure affinity: a 8, b 4, c 16, d 16 (c before d: input order)
    ({"load_weight": 0}, [("b", 1, 4.0), ("a", 0, 8.0), ("c", 0, 16.0), ("d", 0, 16.0)]),
    # overlap_credit 0: prefill 16 for all -> 16+load: c 16, a 17, d 18, b 26
    ({"overlap_credit": 0}, [("c", 0, 16.0), ("a", 0, 17.0), ("d", 0, 18.0), ("b", 1, 26.0)]),
    # scale 2, load_weight 0.5: a 2*8+0.5*1=16.5, b 2*4+0.5*10=13, c 2*16+0=32, d 2*16+0.5*2=33
    (
        {"prefill_load_scale": 2, "load_weight": 0.5},
        [("b", 1, 13.0), ("a", 0, 16.5), ("c", 0, 32.0), ("d", 0, 33.0)],
    ),
    # w_disk 1: c affinity round(1*1*4)=4 -> prefill 12 -> score 12+0=12
    ({"w_disk": 1}, [("a", 0, 9.0), ("c", 0, 12.0), ("b", 1, 14.0), ("d", 0, 18.0)]),
    # w_cpu 0.5: b affinity round(3*0.5*4)=6 -> prefill 10 -> score 10+10=20
    ({"w_cpu": 0.5}, [("a", 0, 9.0), ("c", 0, 16.0), ("d", 0, 18.0), ("b", 1, 20.0)]),
    # w_npu 0: a affinity 0 -> prefill 16 -> 17; b 14; c 16; d 18
    ({"w_npu": 0}, [("b", 1, 14.0), ("c", 0, 16.0), ("a", 0, 17.0), ("d", 0, 18.0)]),
]


@pytest.mark.parametrize("kwargs,expected", UNIFIED_CASES)
def test_unified_table(kwargs, expected):
    assert rank(RESPONSE, CANDS, ISL, BS, KvAffinityConfig(**kwargs)) == expected


# load_gated: stage 1 keeps the topn lowest loads, stage 2 orders by (-matched, load); score = load.
# loads: c 0, a 1, d 2, b 10; matched: a 8, b 12, c 0, d 0.
GATED_CASES = [
    # topn 0 -> 2: {c, a} -> a (8), c (0)
    (0, [("a", 0, 1.0), ("c", 0, 0.0)]),
    # topn 1: {c}
    (1, [("c", 0, 0.0)]),
    # topn 3: {c, a, d} -> a (8), then c and d tie at 0 matched: lower load c (0) before d (2)
    (3, [("a", 0, 1.0), ("c", 0, 0.0), ("d", 0, 2.0)]),
    # topn 10 (> candidates): all -> b (12), a (8), c (0, load 0), d (0, load 2)
    (10, [("b", 1, 10.0), ("a", 0, 1.0), ("c", 0, 0.0), ("d", 0, 2.0)]),
]


@pytest.mark.parametrize("topn,expected", GATED_CASES)
def test_load_gated_table(topn, expected):
    cfg = KvAffinityConfig(mode="load_gated", load_gate_topn=topn)
    assert rank(RESPONSE, CANDS, ISL, BS, cfg) == expected


def test_load_gated_ignores_unified_scalars():
    # load_weight/prefill_load_scale play no part in load_gated; w_disk does (through matched):
    # w_disk 1 -> c matched 4; topn 2 keeps {c, a}: a (8) before c (4).
    cfg = KvAffinityConfig(mode="load_gated", load_weight=0, prefill_load_scale=7, w_disk=1)
    assert rank(RESPONSE, CANDS, ISL, BS, cfg) == [("a", 0, 1.0), ("c", 0, 0.0)]
    # w_npu 0 -> a matched 0, ties with c (0): lower load c (0) before a (1).
    cfg = KvAffinityConfig(mode="load_gated", w_npu=0)
    assert rank(RESPONSE, CANDS, ISL, BS, cfg) == [("c", 0, 0.0), ("a", 0, 1.0)]


def test_top_k():
    assert rank(RESPONSE, CANDS, ISL, BS, top_k=2) == [("a", 0, 9.0), ("b", 1, 14.0)]
    assert rank(RESPONSE, CANDS, ISL, BS, top_k=0) == [("a", 0, 9.0)]  # < 1 counts as 1
    cfg = KvAffinityConfig(mode="load_gated", load_gate_topn=3)
    assert rank(RESPONSE, CANDS, ISL, BS, cfg, top_k=1) == [("a", 0, 1.0)]


def test_results_are_named_tuples():
    best = rank(RESPONSE, CANDS, ISL, BS)[0]
    assert isinstance(best, Ranked)
    assert (best.instance_id, best.dp_rank, best.score) == ("a", 0, 9.0)


def test_plain_tuples_accepted_as_candidates():
    assert rank(RESPONSE, [("a", 0, 1), ("b", 1, 10)], ISL, BS) == [("a", 0, 9.0), ("b", 1, 14.0)]


def test_dp_rank_selects_the_dp_entry():
    # b is reported only on DP 1; b on DP 0 has no entry -> 0 match -> prefill 16 -> 16+0 = 16.
    resp = {"default": {"b": {"longest_matched": 12, "DP": {"1": dp(cpu=3)}}}}
    assert rank(resp, [("b", 0, 0.0), ("b", 1, 0.0)], ISL, BS) == [("b", 1, 4.0), ("b", 0, 16.0)]


def test_matched_capped_at_prompt_length():
    # 5 blocks reported (20 tokens) for a 10-token prompt: matched = min(20, 10) = 10,
    # prefill = max(0, 10 - 10) = 0, score = 0 + load 3 = 3.
    resp = {"default": {"a": {"DP": {"0": dp(npu=5)}}}}
    assert rank(resp, [("a", 0, 3.0)], 10, BS) == [("a", 0, 3.0)]
    # overlap_credit 2 could make prefill negative: 10 - 2*10 = -10 -> clamped to 0.
    dbg = {}
    rank(resp, [("a", 0, 3.0)], 10, BS, KvAffinityConfig(overlap_credit=2), debug=dbg)
    assert dbg == {("a", 0): (10, 3.0, 0.0)}


def test_half_to_even_rounding():
    cfg = KvAffinityConfig(w_cpu=0.125)
    # 5 * 0.125 * 4 = 2.5 -> round half to even -> 2 (not 3)
    assert affinity_matched(dp(cpu=5), 4, cfg) == 2
    # 7 * 0.125 * 4 = 3.5 -> 4
    assert affinity_matched(dp(cpu=7), 4, cfg) == 4
    # 1 * 0.125 * 4 = 0.5 -> 0
    assert affinity_matched(dp(cpu=1), 4, cfg) == 0
    # through rank: matched 2 -> prefill 16 - 2 = 14 -> score 14 + 0 = 14
    resp = {"default": {"x": {"DP": {"0": dp(cpu=5)}}}}
    assert rank(resp, [("x", 0, 0.0)], ISL, BS, cfg) == [("x", 0, 14.0)]


def test_tier_weights_mixed():
    # npu 2, cpu 1, disk 1 at weights 1, 0.5, 0.25 and block 128:
    # (2*1 + 1*0.5 + 1*0.25) * 128 = 2.75 * 128 = 352
    cfg = KvAffinityConfig(w_npu=1, w_cpu=0.5, w_disk=0.25)
    assert affinity_matched(dp(2, 1, 1, bs=128), 128, cfg) == 352
    # default w_disk 0: (2 + 1 + 0) * 128 = 384, although matched_tokens says 512
    assert affinity_matched(dp(2, 1, 1, bs=128), 128) == 384


def test_affinity_matched_fallbacks():
    # dict without any *_blocks key: matched_tokens
    assert affinity_matched({"matched_tokens": 24}, 4) == 24
    assert affinity_matched({}, 4) == 0
    # block_size 0: the weighted form is skipped, matched_tokens used
    assert affinity_matched(dp(npu=2), 0) == 8
    # only one block key present, the others count 0: 3 * 1 * 4 = 12
    assert affinity_matched({"cpu_blocks": 3}, 4) == 12
    # version skew: old conductors send a plain int per DP
    assert affinity_matched(40, 4) == 40
    assert affinity_matched(None, 4) == 0
    assert affinity_matched("7", 4) == 0


def test_version_skew_int_dp_values():
    # DP values as plain ints (tokens): a 12 -> min(12, 16) = 12 -> prefill 4 -> 4 + 1 = 5
    #                                   b 20 -> min(20, 16) = 16 -> prefill 0 -> 0 + 10 = 10
    resp = {"default": {"a": {"DP": {"0": 12}}, "b": {"DP": {"1": 20}}}}
    assert rank(resp, [("a", 0, 1.0), ("b", 1, 10.0)], ISL, BS) == [("a", 0, 5.0), ("b", 1, 10.0)]


def test_zero_prompt_length_means_zero_match():
    # isl 0 (block_size 0 keeps needs_query true): matched 0, prefill 0, score = load
    resp = {"default": {"a": {"DP": {"0": 99}}}}
    assert rank(resp, [("a", 0, 5.0), ("b", 0, 1.0)], 0, 0) == [("b", 0, 1.0), ("a", 0, 5.0)]


def test_needs_query():
    assert needs_query(4, 4) is True
    assert needs_query(3, 4) is False
    assert needs_query(0, 4) is False
    assert needs_query(0, 0) is True  # block_size 0: fast path off
    assert needs_query(1000, 128) is True


def test_fast_path_ignores_response_and_scores_zero_match():
    # 3 tokens < block 4: no query needed; every candidate matched 0,
    # prefill 3, score 3 + load: c 3, a 4, d 5, b 13
    expected = [("c", 0, 3.0), ("a", 0, 4.0), ("d", 0, 5.0), ("b", 1, 13.0)]
    assert rank(None, CANDS, 3, BS) == expected
    assert rank(RESPONSE, CANDS, 3, BS) == expected
    # even with include_unreported=False every candidate is kept
    assert rank(None, CANDS, 3, BS, include_unreported=False) == expected


@pytest.mark.parametrize("resp", [None, {}, {"other": {}}, {"default": None}, {"default": 3}, "x"])
def test_fallback_none_without_tenant_answer(resp):
    assert rank(resp, CANDS, ISL, BS) is None


def test_tenant_id_selects_the_answer():
    resp = {"t1": RESPONSE["default"]}
    assert rank(resp, CANDS, ISL, BS) is None
    assert rank(resp, CANDS, ISL, BS, tenant_id="t1")[0] == ("a", 0, 9.0)


def test_empty_tenant_ranks_by_load():
    # nothing matched anywhere: prefill 16 for all; score 16 + load -> c, a, d, b
    resp = {"default": {}}
    assert [r[:2] for r in rank(resp, CANDS, ISL, BS)] == [("c", 0), ("a", 0), ("d", 0), ("b", 1)]
    # reference behaviour: unreported candidates are skipped -> nothing left -> fall back
    assert rank(resp, CANDS, ISL, BS, include_unreported=False) is None


def test_include_unreported_false_skips_unreported():
    assert rank(RESPONSE, CANDS, ISL, BS, include_unreported=False) == [
        ("a", 0, 9.0),
        ("b", 1, 14.0),
        ("c", 0, 16.0),
    ]


def test_no_candidates_is_none():
    assert rank(RESPONSE, [], ISL, BS) is None


def test_debug_stash_unified_and_gated():
    dbg = {}
    rank(RESPONSE, CANDS, ISL, BS, top_k=1, debug=dbg)
    # every candidate is stashed, not only the returned one: (matched, load, prefill)
    assert dbg == {
        ("a", 0): (8, 1.0, 8.0),
        ("b", 1): (12, 10.0, 4.0),
        ("c", 0): (0, 0.0, 16.0),
        ("d", 0): (0, 2.0, 16.0),
    }
    dbg = {}
    rank(RESPONSE, CANDS, ISL, BS, KvAffinityConfig(mode="load_gated"), debug=dbg)
    # load_gated: prefill_cost withheld (None), as in the reference
    assert dbg[("a", 0)] == (8, 1.0, None)
    assert len(dbg) == 4


def test_score_candidates():
    scored = score_candidates(RESPONSE["default"], CANDS, ISL, BS)
    assert [(s.instance_id, s.matched, s.prefill_cost) for s in scored] == [
        ("a", 8, 8.0),
        ("b", 12, 4.0),
        ("c", 0, 16.0),
        ("d", 0, 16.0),
    ]


# ---------------------------------------------------------------------------
# Configuration


def test_config_defaults():
    cfg = KvAffinityConfig()
    assert cfg.to_dict() == {
        "mode": "unified",
        "load_weight": 1.0,
        "overlap_credit": 1.0,
        "prefill_load_scale": 1.0,
        "load_gate_topn": 0,
        "w_npu": 1.0,
        "w_cpu": 1.0,
        "w_disk": 0.0,
        "not_live_weight": 1.0,
    }
    assert cfg.effective_topn == DEFAULT_LOAD_GATE_TOPN == 2
    assert KvAffinityConfig(load_gate_topn=5).effective_topn == 5


@pytest.mark.parametrize("mode", ["LOAD_GATED", "Load_Gated", " load_gated "])
def test_mode_case_insensitive(mode):
    assert KvAffinityConfig(mode=mode).mode == "load_gated"


def test_zero_and_integral_values_allowed():
    cfg = KvAffinityConfig(
        load_weight=0,
        overlap_credit=0,
        prefill_load_scale=0,
        w_npu=0,
        w_cpu=0,
        w_disk=0,
        load_gate_topn=3.0,
    )
    assert cfg.load_gate_topn == 3 and isinstance(cfg.load_gate_topn, int)
    assert cfg.load_weight == 0.0 and isinstance(cfg.load_weight, float)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"mode": "round_robin"}, "mode must be one of"),
        ({"mode": 3}, "mode must be a string"),
        ({"load_weight": -1}, "load_weight must be a finite number >= 0"),
        ({"overlap_credit": -0.01}, "overlap_credit"),
        ({"prefill_load_scale": math.inf}, "prefill_load_scale"),
        ({"w_npu": math.nan}, "w_npu"),
        ({"w_cpu": "1.0"}, "w_cpu must be a number"),
        ({"w_disk": True}, "w_disk must be a number"),
        ({"load_gate_topn": -1}, "load_gate_topn"),
        ({"load_gate_topn": 1.5}, "load_gate_topn must be an integer"),
    ],
)
def test_validation_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        KvAffinityConfig(**kwargs)


def test_from_dict_ignores_unknown_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="kvconductor.affinity"):
        cfg = KvAffinityConfig.from_dict({"mode": "load_gated", "hit_rate_threshold": 0.3})
    assert cfg.mode == "load_gated"
    assert "hit_rate_threshold" in caplog.text


def test_from_dict_rejects_non_object():
    with pytest.raises(ValueError, match="must be an object"):
        KvAffinityConfig.from_dict(["unified"])


LEGACY_VALUES = {
    "kv_affinity_mode": "load_gated",
    "kv_affinity_load_weight": 2.0,
    "kv_affinity_overlap_credit": 0.5,
    "kv_affinity_prefill_load_scale": 1.5,
    "kv_affinity_load_gate_topn": 4,
    "kv_affinity_w_npu": 0.9,
    "kv_affinity_w_cpu": 0.6,
    "kv_affinity_w_disk": 0.3,
}


@pytest.mark.parametrize("flat,nested", sorted(LEGACY_KEYS.items()))
def test_legacy_key_migrates(flat, nested, caplog):
    value = LEGACY_VALUES[flat]
    sc = {"scheduler_type": "kv_cache_affinity", flat: value}
    with caplog.at_level(logging.WARNING, logger="kvconductor.affinity"):
        out = migrate_legacy_keys(sc)
    assert out == {"scheduler_type": "kv_cache_affinity", "kv_affinity": {nested: value}}
    assert flat in caplog.text and "deprecated" in caplog.text
    assert getattr(KvAffinityConfig.from_scheduler_config(sc), nested) == value
    assert flat in sc  # the caller's dict is left alone


def test_legacy_all_keys_at_once():
    cfg = KvAffinityConfig.from_scheduler_config(dict(LEGACY_VALUES))
    assert cfg == KvAffinityConfig(
        mode="load_gated",
        load_weight=2.0,
        overlap_credit=0.5,
        prefill_load_scale=1.5,
        load_gate_topn=4,
        w_npu=0.9,
        w_cpu=0.6,
        w_disk=0.3,
    )


def test_nested_wins_over_legacy():
    sc = {
        "kv_affinity_load_weight": 3.0,
        "kv_affinity_mode": "load_gated",
        "kv_affinity": {"load_weight": 2.0, "w_cpu": 0.5},
    }
    before = copy.deepcopy(sc)
    out = migrate_legacy_keys(sc)
    # load_weight: nested 2.0 wins; mode: only legacy -> taken; w_cpu: only nested -> kept
    assert out == {"kv_affinity": {"load_weight": 2.0, "w_cpu": 0.5, "mode": "load_gated"}}
    assert sc == before
    cfg = KvAffinityConfig.from_scheduler_config(sc)
    assert (cfg.load_weight, cfg.mode, cfg.w_cpu) == (2.0, "load_gated", 0.5)


@pytest.mark.parametrize("bad", ["unified", 3, ["x"], True])
def test_non_object_kv_affinity_replaced_by_legacy(bad, caplog):
    sc = {"kv_affinity": bad, "kv_affinity_w_disk": 0.25}
    with caplog.at_level(logging.WARNING, logger="kvconductor.affinity"):
        out = migrate_legacy_keys(sc)
    assert out == {"kv_affinity": {"w_disk": 0.25}}
    assert "not an object" in caplog.text
    assert KvAffinityConfig.from_scheduler_config(sc).w_disk == 0.25


def test_no_legacy_keys_no_warning(caplog):
    sc = {"kv_affinity": {"mode": "unified"}, "scheduler_type": "kv_cache_affinity"}
    with caplog.at_level(logging.WARNING, logger="kvconductor.affinity"):
        assert migrate_legacy_keys(sc) == sc
    assert caplog.text == ""
    assert KvAffinityConfig.from_scheduler_config({}) == KvAffinityConfig()
    assert KvAffinityConfig.from_scheduler_config(None) == KvAffinityConfig()


def test_migrated_invalid_value_fails_validation():
    with pytest.raises(ValueError, match="load_weight"):
        KvAffinityConfig.from_scheduler_config({"kv_affinity_load_weight": -2})


# -- query_options: what to ask the conductor for one ranking --------------------------------
def _cut_answer(answer, instances):
    """The answer a server gives with ``instances`` (docs/api.md, "top_k and instances")."""
    return {t: {i: v for i, v in m.items() if i in instances} for t, m in answer.items()}


def test_query_options_name_the_candidates():
    from kvconductor.affinity import query_options

    # in load order, least loaded first (the server's preference at the top_k cut): an
    # instance at the place of its least-loaded DP
    cands = [("a", 0, 5.0), ("b", 1, 1.0), ("a", 1, 2.0), ("c", 0, 0.5)]
    assert query_options(cands) == {"instances": ["c", "b", "a"]}
    assert query_options(cands, top_k=0) == {"instances": ["c", "b", "a"], "top_k": 1}
    assert query_options([("x", 0, 1.0), ("y", 0, 1.0)])["instances"] == ["x", "y"]  # stable
    gated = KvAffinityConfig(mode="load_gated", load_gate_topn=2)
    # the two least loaded: c (0.5) and b (1.0)
    assert query_options(cands, gated) == {"instances": ["c", "b"]}
    assert query_options([]) == {"instances": []}


@pytest.mark.parametrize("mode", ["unified", "load_gated"])
def test_rank_over_the_filtered_answer_is_the_rank_over_the_whole_answer(mode):
    import random

    from kvconductor.affinity import query_options

    rng = random.Random(5)
    cfg = KvAffinityConfig(mode=mode, load_gate_topn=3)
    for _ in range(200):
        answer = {"default": {}}
        for i in range(rng.randrange(0, 30)):
            dps = {str(d): dp(rng.randrange(0, 4), rng.randrange(0, 2)) for d in range(2)}
            best = max(v["matched_tokens"] for v in dps.values())
            answer["default"][f"i{i}"] = {"longest_matched": best, "DP": dps}
        cands = [
            (f"i{rng.randrange(0, 40)}", rng.randrange(0, 2), float(rng.randrange(0, 9)))
            for _ in range(rng.randrange(1, 8))
        ]
        want = rank(answer, cands, ISL, BS, cfg)
        opts = query_options(cands, cfg)
        assert rank(_cut_answer(answer, set(opts["instances"])), cands, ISL, BS, cfg) == want


def test_top_k_in_load_order_keeps_the_best_candidate():
    # load_gated, one DP per instance: the server's top_k cut (ties by the instances'
    # order, here load order) answers the candidate rank() would pick over the whole answer
    import random

    from kvconductor._hash import hash_blocks
    from kvconductor.affinity import query_options
    from kvconductor.index import Index
    from kvconductor.keys import Medium, WorkerKey

    rng = random.Random(11)
    hashes = list(hash_blocks(list(range(4 * BS)), BS))
    cfg = KvAffinityConfig(mode="load_gated", load_gate_topn=6)
    for _ in range(60):
        ix = Index("m", "default")
        n = rng.randrange(1, 20)
        for i in range(n):
            depth = rng.randrange(0, 4)
            if depth:
                key = WorkerKey(f"i{i}", f"i{i}", 0, Medium.NPU)
                ix.store(key, None, [1000 * i + b for b in range(depth)], hashes[:depth])
        cands = [(f"i{i}", 0, float(rng.randrange(0, 5))) for i in rng.sample(range(n), n)]
        whole = ix.query_by_hash(hashes).to_dict("default", BS)
        want = rank(whole, cands, 4 * BS, BS, cfg, top_k=1)
        for k in (1, 2):
            opts = query_options(cands, cfg, top_k=k)
            cut = ix.query_by_hash(hashes, **opts)
            assert len(cut) <= k
            got = rank(cut.to_dict("default", BS), cands, 4 * BS, BS, cfg, top_k=1)
            assert got == want


# -- not_live_weight: holders whose answer says their sources are not live (freshness) -------
def _fresh(d, state):
    return {**d, "freshness": {"state": state, "last_event_age_ms": 5}}


def test_not_live_weight_is_off_by_default():
    assert KvAffinityConfig().not_live_weight == 1.0
    # a degraded holder of 3 CPU blocks: round(3*1*4) = 12, as without freshness
    assert affinity_matched(_fresh(dp(cpu=3), "degraded"), BS) == 12


@pytest.mark.parametrize(
    "state,expected",
    [
        # not live: round((2*1 + 1*1) * 0.5 * 4) = round(6.0) = 6
        ("degraded", 6),
        ("replaying", 6),
        ("connecting", 6),
        ("muted", 6),
        # live, remote (another replica's live stream), no source: round(3*4) = 12
        ("live", 12),
        ("remote", 12),
        ("no_source", 12),
    ],
)
def test_not_live_weight_discounts_holders_whose_sources_are_not_live(state, expected):
    cfg = KvAffinityConfig(not_live_weight=0.5)
    assert affinity_matched(_fresh(dp(npu=2, cpu=1), state), BS, cfg) == expected
    # the matched_tokens form (no block counts): round(10 * 0.5) = 5 when not live
    raw = {"matched_tokens": 10, "freshness": {"state": state}}
    assert affinity_matched(raw, BS, cfg) == (5 if expected == 6 else 10)


def test_not_live_weight_changes_the_ranking():
    # a: 2 NPU blocks, degraded; b: 1 NPU block, live; load equal, load_weight 0.
    resp = {
        "default": {
            "a": {"longest_matched": 8, "DP": {"0": _fresh(dp(npu=2), "degraded")}},
            "b": {"longest_matched": 4, "DP": {"0": _fresh(dp(npu=1), "live")}},
        }
    }
    cands = [Candidate("a", 0, 1.0), Candidate("b", 0, 1.0)]
    # off: a matched 8 -> prefill 8; b matched 4 -> prefill 12
    off = rank(resp, cands, ISL, BS, KvAffinityConfig(load_weight=0))
    assert [(r.instance_id, r.score) for r in off] == [("a", 8.0), ("b", 12.0)]
    # 0.25: a matched round(2*0.25*4) = 2 -> prefill 14; b unchanged 12
    on = rank(resp, cands, ISL, BS, KvAffinityConfig(load_weight=0, not_live_weight=0.25))
    assert [(r.instance_id, r.score) for r in on] == [("b", 12.0), ("a", 14.0)]


def test_not_live_weight_asks_for_freshness_and_is_validated():
    from kvconductor.affinity import query_options

    cands = [Candidate("a", 0, 1.0)]
    assert "freshness" not in query_options(cands)
    assert query_options(cands, KvAffinityConfig(not_live_weight=0.5)) == {
        "instances": ["a"],
        "freshness": True,
    }
    for bad in (-0.1, math.inf, "0.5", True):
        with pytest.raises(ValueError, match="not_live_weight"):
            KvAffinityConfig(not_live_weight=bad)
    cfg = KvAffinityConfig.from_dict({"not_live_weight": 0})
    assert cfg.not_live_weight == 0.0 and cfg.to_dict()["not_live_weight"] == 0.0


# -- an answer read in process (kvconductor.index.QueryResult): its C-made tuples ------------
def _in_process_answer():
    from kvconductor.index import Index
    from kvconductor.keys import Medium, WorkerKey

    ix = Index("m", "t")
    h = [0x5000 + i for i in range(6)]
    ix.store(WorkerKey("a", "a", 0, Medium.NPU), None, [1, 2, 3], h[:3])
    ix.store(WorkerKey("a", "a", 1, Medium.NPU), None, [1, 2], h[:2])
    ix.store(WorkerKey("b", "b", 0, Medium.CPU), None, [5, 6, 7, 8], h[:4])
    ix.store(WorkerKey("c", "c", 0, Medium.DISK), None, [9], h[:1])
    ix.store(WorkerKey("c", "c", 0, Medium.NPU), None, [11], h[:1])
    return ix.query_by_hash(h)


@pytest.mark.parametrize(
    "cfg",
    [
        KvAffinityConfig(),
        KvAffinityConfig(w_cpu=0.5, w_disk=0.25, load_weight=0.01),
        KvAffinityConfig(mode="load_gated", load_gate_topn=3),
        KvAffinityConfig(overlap_credit=0.5, w_npu=0.3),
    ],
)
@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize("bs", [16, 0])
def test_an_in_process_answer_ranks_as_its_v3_body(cfg, include, bs):
    from kvconductor.coordinator.affinity import InProcessAnswer

    res = _in_process_answer()
    assert isinstance(res, InProcessAnswer) and not isinstance({}, InProcessAnswer)
    want_rows = [("a", 0, 3, 0, 0), ("a", 1, 2, 0, 0), ("b", 0, 0, 4, 0), ("c", 0, 1, 0, 0)]
    assert res.tuples() == want_rows
    body = res.to_dict("default", bs)  # block size 0: every matched_tokens is 0
    cands = [("a", 0, 40.0), ("a", 1, 5.0), ("a", 2, 0.0), ("b", 0, 20.0), ("z", 0, 1.0)]
    for isl in (0, 20, 64, 10_000):
        kw = {"include_unreported": include}
        want_dbg: dict = {}
        got_dbg: dict = {}
        want = rank(body, cands, isl, bs, cfg, debug=want_dbg, **kw)
        assert rank(res, cands, isl, bs, cfg, debug=got_dbg, **kw) == want
        assert got_dbg == want_dbg
