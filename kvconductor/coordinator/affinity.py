"""KV-affinity scoring: rank prefill candidates by cached prefix and load.

This is the Coordinator-side policy (docs/client.md, "Affinity scoring"), without the
Coordinator's object model: candidates are plain ``(instance_id, dp_rank,
load_cost)`` triples and the conductor answer is the decoded ``/query`` body.

Two modes (docs/client.md, "Affinity scoring" and "Configuration"):

* ``unified`` (default): ``score = prefill_load_scale * prefill_cost +
  load_weight * load_cost``, ascending, where ``prefill_cost = max(0, isl -
  overlap_credit * matched)``. All terms are in tokens.
* ``load_gated``: keep the ``load_gate_topn`` (<= 0 means 2) least-loaded
  candidates, then order them by ``(-matched, load_cost)``; ``score = load_cost``.

Ties keep the order of the ``candidates`` argument (Python's sort is stable),
as in the reference.

Differences from the reference, all deliberate:

* An instance the conductor did not report (the server lists only instances
  with a hit) is scored as a zero match instead of being dropped; pass
  ``include_unreported=False`` for the reference behaviour (unreported
  candidates are skipped, and ``None`` is returned when none is reported).
* An empty tenant map (nothing matched anywhere) is therefore ranked by load
  like any other answer rather than returning ``None``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "MODE_UNIFIED",
    "MODE_LOAD_GATED",
    "DEFAULT_LOAD_GATE_TOPN",
    "LEGACY_KEYS",
    "KvAffinityConfig",
    "NOT_LIVE_STATES",
    "Candidate",
    "InProcessAnswer",
    "Ranked",
    "Scored",
    "affinity_matched",
    "needs_query",
    "migrate_legacy_keys",
    "query_options",
    "score_candidates",
    "rank",
]

# The logger keeps the name of the module this code lived in (kvconductor.affinity).
logger = logging.getLogger("kvconductor.affinity")

MODE_UNIFIED = "unified"
MODE_LOAD_GATED = "load_gated"
_MODES = (MODE_UNIFIED, MODE_LOAD_GATED)

#: What ``load_gate_topn <= 0`` means.
DEFAULT_LOAD_GATE_TOPN = 2

#: Legacy flat ``scheduler_config`` keys -> nested ``kv_affinity`` keys
#: (docs/client.md, "Configuration").
LEGACY_KEYS: dict[str, str] = {
    "kv_affinity_mode": "mode",
    "kv_affinity_load_weight": "load_weight",
    "kv_affinity_overlap_credit": "overlap_credit",
    "kv_affinity_prefill_load_scale": "prefill_load_scale",
    "kv_affinity_load_gate_topn": "load_gate_topn",
    "kv_affinity_w_npu": "w_npu",
    "kv_affinity_w_cpu": "w_cpu",
    "kv_affinity_w_disk": "w_disk",
}

_FLOAT_FIELDS = (
    "load_weight",
    "overlap_credit",
    "prefill_load_scale",
    "w_npu",
    "w_cpu",
    "w_disk",
    "not_live_weight",
)
#: ``"freshness"`` states of an answered DP whose match :attr:`KvAffinityConfig.
#: not_live_weight` discounts: its sources' view may be missing what they lost or have
#: not replayed yet (docs/api.md, "freshness").
NOT_LIVE_STATES = frozenset(("connecting", "replaying", "degraded", "muted"))


def _check_number(name: str, value: Any) -> float:
    # bool is an int subclass; ``true`` as a weight is a config mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"kv_affinity.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"kv_affinity.{name} must be a finite number >= 0, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class KvAffinityConfig:
    """``scheduler_config.kv_affinity``, validated on construction (docs/client.md).

    ``mode`` is case-insensitive and stored lower-case; every number must be
    finite and >= 0 (zero allowed); ``load_gate_topn`` must be an integer
    (``0`` means :data:`DEFAULT_LOAD_GATE_TOPN`). Invalid values raise
    ``ValueError``.
    """

    mode: str = MODE_UNIFIED
    load_weight: float = 1.0
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    load_gate_topn: int = 0
    w_npu: float = 1.0
    w_cpu: float = 1.0
    w_disk: float = 0.0
    #: Factor on the match of a DP whose answer says its sources are not live
    #: (:data:`NOT_LIVE_STATES`; needs answers with ``freshness``, which
    #: :func:`query_options` then asks for). 1.0: off (the default).
    not_live_weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            raise ValueError(f"kv_affinity.mode must be a string, got {self.mode!r}")
        mode = self.mode.strip().lower()
        if mode not in _MODES:
            raise ValueError(
                f"kv_affinity.mode must be one of {', '.join(_MODES)}, got {self.mode!r}"
            )
        object.__setattr__(self, "mode", mode)
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, float(_check_number(name, getattr(self, name))))
        topn = _check_number("load_gate_topn", self.load_gate_topn)
        if isinstance(topn, float):
            if not topn.is_integer():
                raise ValueError(f"kv_affinity.load_gate_topn must be an integer, got {topn!r}")
            topn = int(topn)
        object.__setattr__(self, "load_gate_topn", topn)

    @property
    def effective_topn(self) -> int:
        """``load_gate_topn``, with ``0`` replaced by :data:`DEFAULT_LOAD_GATE_TOPN`."""
        return self.load_gate_topn if self.load_gate_topn > 0 else DEFAULT_LOAD_GATE_TOPN

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> KvAffinityConfig:
        """Build from a nested ``kv_affinity`` object; unknown keys are ignored with a warning."""
        if not data:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"kv_affinity must be an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in names)
        if unknown:
            logger.warning("kv_affinity: ignoring unknown keys %s", ", ".join(map(str, unknown)))
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_scheduler_config(cls, scheduler_config: Mapping[str, Any] | None) -> KvAffinityConfig:
        """Build from a whole ``scheduler_config``, migrating legacy flat keys first.

        The argument is not modified; see :func:`migrate_legacy_keys`.
        """
        migrated = migrate_legacy_keys(scheduler_config or {})
        return cls.from_dict(migrated.get("kv_affinity"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def migrate_legacy_keys(scheduler_config: Mapping[str, Any]) -> dict[str, Any]:
    """Move legacy flat ``kv_affinity_*`` keys into the nested ``kv_affinity`` object.

    Returns a new ``scheduler_config`` dict (the argument and its nested
    ``kv_affinity`` are not modified) with the flat keys removed. A value that
    is already set in the nested object wins (``setdefault``). A ``kv_affinity``
    that exists but is not an object is replaced by the legacy values. When any
    flat key is present, a deprecation warning naming them is logged.
    """
    out = dict(scheduler_config)
    legacy = {LEGACY_KEYS[k]: out.pop(k) for k in list(out) if k in LEGACY_KEYS}
    if not legacy:
        return out
    logger.warning(
        "scheduler_config: flat keys %s are deprecated; use scheduler_config.kv_affinity.{%s}",
        ", ".join(sorted(k for k, v in LEGACY_KEYS.items() if v in legacy)),
        ", ".join(sorted(legacy)),
    )
    nested = out.get("kv_affinity")
    if nested is not None and not isinstance(nested, Mapping):
        logger.warning(
            "scheduler_config.kv_affinity is not an object (%r); replaced by the legacy keys",
            nested,
        )
        nested = None
    merged = dict(nested or {})
    for key, value in legacy.items():
        merged.setdefault(key, value)
    out["kv_affinity"] = merged
    return out


class Candidate(NamedTuple):
    """One prefill endpoint: ``load_cost`` is its live workload score (token units)."""

    instance_id: str
    dp_rank: int
    load_cost: float


class Ranked(NamedTuple):
    """One ranked result; compares equal to the plain tuple ``(instance_id, dp_rank, score)``."""

    instance_id: str
    dp_rank: int
    score: float


class Scored(NamedTuple):
    """Per-candidate intermediate values (what the reference stashes for debugging)."""

    instance_id: str
    dp_rank: int
    matched: int
    load_cost: float
    prefill_cost: float


def needs_query(prompt_len: int, block_size: int) -> bool:
    """False when the prompt is shorter than one block: it cannot hit, skip the HTTP call."""
    return not (block_size > 0 and prompt_len < block_size)


_BLOCK_KEYS = ("npu_blocks", "cpu_blocks", "disk_blocks")


def affinity_matched(raw: Any, block_size: int, config: KvAffinityConfig | None = None) -> int:
    """Affinity-weighted matched tokens of one ``DP`` value of a query answer.

    * a dict with any of ``npu_blocks``/``cpu_blocks``/``disk_blocks`` and
      ``block_size > 0``: ``round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size)``
      (Python ``round``: half to even);
    * another dict: its ``matched_tokens`` (0 when absent);
    * an int (old conductors, version skew): the int itself;
    * anything else: 0.

    A dict whose ``freshness`` state is not live (:data:`NOT_LIVE_STATES`) counts
    ``not_live_weight`` times that (rounded the same way).
    """
    cfg = config or _DEFAULT_CONFIG
    if isinstance(raw, Mapping):
        factor = 1.0
        if cfg.not_live_weight != 1.0:
            fresh = raw.get("freshness")
            if isinstance(fresh, Mapping) and fresh.get("state") in NOT_LIVE_STATES:
                factor = cfg.not_live_weight
        if block_size > 0 and any(k in raw for k in _BLOCK_KEYS):
            return _weighted(
                _num(raw.get("npu_blocks", 0)),
                _num(raw.get("cpu_blocks", 0)),
                _num(raw.get("disk_blocks", 0)),
                block_size,
                cfg,
                factor,
            )
        matched = _num(raw.get("matched_tokens", 0))
        return int(matched) if factor == 1.0 else int(round(matched * factor))
    if isinstance(raw, bool):
        return 0
    if isinstance(raw, (int, float)):
        return int(raw)
    return 0


def _weighted(
    npu: float, cpu: float, disk: float, block_size: int, cfg: KvAffinityConfig, factor: float
) -> int:
    """``round((npu*w_npu + cpu*w_cpu + disk*w_disk) * factor * block_size)``."""
    weighted = npu * cfg.w_npu + cpu * cfg.w_cpu + disk * cfg.w_disk
    return int(round(weighted * factor * block_size))


@runtime_checkable
class InProcessAnswer(Protocol):
    """An answer read in process (``kvconductor.index.QueryResult``, from ``Index.query``
    or ``query_by_hash``): its rows as ``(instance_id, dp_rank, npu_blocks, cpu_blocks,
    disk_blocks)`` tuples, made in C (docs/api.md, "Reading an answer in Python"). Ranked
    as its decoded V3 body ranks (without ``freshness``: every row counts as live)."""

    def tuples(self) -> list[tuple[str, int, int, int, int]]: ...


def _num(v: Any) -> float:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


_DEFAULT_CONFIG = KvAffinityConfig()


def _tenant_map(query_response: Any, tenant_id: str) -> Mapping[str, Any] | None:
    if not isinstance(query_response, Mapping):
        return None
    tenant = query_response.get(tenant_id)
    return tenant if isinstance(tenant, Mapping) else None


def score_candidates(
    tenant: Mapping[str, Any] | InProcessAnswer,
    candidates: Iterable[Candidate | Sequence[Any]],
    prompt_len: int,
    block_size: int,
    config: KvAffinityConfig | None = None,
    *,
    include_unreported: bool = True,
) -> list[Scored]:
    """Per-candidate ``(matched, load_cost, prefill_cost)`` against one tenant map (or an
    :class:`InProcessAnswer`, its rows per tier: what the map's blocks say).

    ``matched = min(affinity_matched, isl)`` when ``isl > 0`` else 0, and
    ``prefill_cost = max(0, isl - overlap_credit * matched)`` with ``isl = prompt_len``.
    """
    cfg = config or _DEFAULT_CONFIG
    isl = max(0, int(prompt_len))
    matched_of = _matched_lookup(tenant, block_size, cfg)
    out: list[Scored] = []
    for cand in candidates:
        iid, dp, load = cand[0], int(cand[1]), float(cand[2])
        aff = matched_of(iid, dp)
        if aff is None:  # the instance is not in the answer
            if not include_unreported:
                continue
            aff = 0
        matched = min(aff, isl) if isl > 0 else 0
        prefill = max(0.0, isl - cfg.overlap_credit * matched)
        out.append(Scored(iid, dp, matched, load, prefill))
    return out


def _matched_lookup(
    tenant: Mapping[str, Any] | InProcessAnswer, block_size: int, cfg: KvAffinityConfig
) -> Callable[[str, int], int | None]:
    """``(instance_id, dp_rank) -> affinity-weighted matched tokens`` of an answer, None
    when the instance is not in it."""
    if isinstance(tenant, Mapping):

        def from_map(iid: str, dp: int) -> int | None:
            inst = tenant.get(iid)
            if inst is None:
                return None
            dp_map = inst.get("DP", {}) if isinstance(inst, Mapping) else {}
            raw = dp_map.get(str(dp), 0) if isinstance(dp_map, Mapping) else 0
            return affinity_matched(raw, block_size, cfg)

        return from_map
    rows = {(r[0], r[1]): r for r in tenant.tuples()}
    insts = {iid for iid, _ in rows}

    def from_rows(iid: str, dp: int) -> int | None:
        r = rows.get((iid, dp))
        if r is None:
            return 0 if iid in insts else None
        # block_size <= 0: the V3 body's matched_tokens (blocks x block_size) says 0
        return _weighted(r[2], r[3], r[4], block_size, cfg, 1.0) if block_size > 0 else 0

    return from_rows


def query_options(
    candidates: Iterable[Candidate | Sequence[Any]],
    config: KvAffinityConfig | None = None,
    *,
    top_k: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``ConductorClient.query`` / ``query_by_hash`` so that the
    conductor answers only what :func:`rank` of these ``candidates`` reads (extension
    fields, docs/api.md "top_k and instances"): ``instances``, the candidates' instance
    ids in load order, least loaded first (an instance at the place of its least-loaded
    DP; equal loads in first-seen order; in ``load_gated`` mode those of the
    ``load_gate_topn`` least-loaded candidates only, the only ones ranked). With a prefix
    held by thousands of engines the answer then lists the candidates, not every holder;
    the ranking is the same as over the whole answer.

    ``top_k`` (optional) also asks for at most ``top_k`` (instance, DP) rows among them,
    the deepest: the server breaks ties at the cut depth by the order of ``instances``, so
    of the candidates tied there it keeps the least loaded, those the ranking prefers
    among equals. In ``load_gated`` mode with one DP per instance the best candidate is
    then the same as over the whole answer; otherwise a candidate shallower than the cut
    ranks as an unreported one (a zero match), so only use it when matched depth decides.

    With a ``not_live_weight`` other than 1 it asks for ``freshness`` too (the states
    that weight reads).
    """
    cfg = config or _DEFAULT_CONFIG
    # a stable sort by load: the gate of rank() and the server's preference at the cut
    cands = sorted(((c[0], float(c[2])) for c in candidates), key=lambda c: c[1])
    if cfg.mode == MODE_LOAD_GATED:
        cands = cands[: cfg.effective_topn]
    out: dict[str, Any] = {"instances": list(dict.fromkeys(iid for iid, _ in cands))}
    if top_k is not None:
        out["top_k"] = max(1, int(top_k))
    if cfg.not_live_weight != 1.0:
        out["freshness"] = True
    return out


def rank(
    query_response: Mapping[str, Any] | InProcessAnswer | None,
    candidates: Iterable[Candidate | Sequence[Any]],
    prompt_len: int,
    block_size: int,
    config: KvAffinityConfig | None = None,
    top_k: int | None = None,
    *,
    tenant_id: str = "default",  # schema.DEFAULT_TENANT (this module imports no msgspec)
    include_unreported: bool = True,
    debug: dict | None = None,
) -> list[Ranked] | None:
    """Rank ``candidates`` best first; ``None`` means "fall back to load balance".

    ``query_response`` is the decoded ``/query`` answer (``{tenant: {instance:
    {"longest_matched", "DP": {...}}}}``), or an answer read in process (an
    :class:`InProcessAnswer`: ``Index.query``'s ``QueryResult``, the tenant's already,
    read through its C-made tuples, with no V3 body built). When :func:`needs_query` is false
    (prompt shorter than one block) it is not looked at and every candidate
    gets a zero match. Otherwise ``None`` is returned when the response is
    ``None`` (no answer) or lacks ``tenant_id``. ``None`` is also returned when
    no candidate is left (none given, or none reported with
    ``include_unreported=False``).

    ``top_k``: at most that many results (``None``: all; values < 1 count as 1).

    ``debug``: if given, filled with ``{(instance_id, dp_rank): (matched,
    load_cost, prefill_cost)}`` for every scored candidate (not only the
    returned ones). As in the reference, ``prefill_cost`` is ``None`` in
    ``load_gated`` mode so a consumer cannot turn the hard load bound back into
    a soft unified score.
    """
    cfg = config or _DEFAULT_CONFIG
    tenant: Mapping[str, Any] | InProcessAnswer
    if not needs_query(prompt_len, block_size):
        tenant = {}
        include_unreported = True
    elif isinstance(query_response, InProcessAnswer):
        tenant = query_response
    else:
        found = _tenant_map(query_response, tenant_id)
        if found is None:
            logger.warning(
                "kv_affinity: conductor returned no data for tenant %r; falling back", tenant_id
            )
            return None
        tenant = found
    scored = score_candidates(
        tenant, candidates, prompt_len, block_size, cfg, include_unreported=include_unreported
    )
    if not scored:
        logger.warning("kv_affinity: no candidate to rank; falling back")
        return None

    limit = len(scored) if top_k is None else max(1, int(top_k))
    if cfg.mode == MODE_LOAD_GATED:
        gated = sorted(scored, key=lambda s: s.load_cost)[: cfg.effective_topn]
        ordered = sorted(gated, key=lambda s: (-s.matched, s.load_cost))[:limit]
        result = [Ranked(s.instance_id, s.dp_rank, s.load_cost) for s in ordered]
    else:
        keyed = [
            (cfg.prefill_load_scale * s.prefill_cost + cfg.load_weight * s.load_cost, s)
            for s in scored
        ]
        keyed.sort(key=lambda t: t[0])
        result = [Ranked(s.instance_id, s.dp_rank, score) for score, s in keyed[:limit]]

    if debug is not None:
        gated_mode = cfg.mode == MODE_LOAD_GATED
        for s in scored:
            debug[(s.instance_id, s.dp_rank)] = (
                s.matched,
                s.load_cost,
                None if gated_mode else s.prefill_cost,
            )
    if logger.isEnabledFor(logging.DEBUG):
        best = result[0]
        logger.debug(
            "kv_affinity(%s): best %s dp=%d score=%.2f (%d ranked of %d)",
            cfg.mode,
            best.instance_id,
            best.dp_rank,
            best.score,
            len(result),
            len(scored),
        )
    return result
