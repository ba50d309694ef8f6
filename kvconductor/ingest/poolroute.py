"""Which DPs a cluster pool's blocks belong to (docs/events.md, "Applying", pool events).

A cluster pool (a Mooncake or Memcache pool publisher, V3 or the Mooncake dialect) names
in ``backend_id`` the node that holds a block. The node may host DPs of several models
and tenants; the block belongs only to those of the event's context:

* the tenant: the event's ``tenant_id``, else the pool registration's;
* the model: the event's ``model_name``, else the pool registration's; a registration
  made with the Coordinator's placeholder model ``default`` (it sends ``model_path or
  "default"``) names no model, and then the model is that of the node's DPs of the
  tenant when they all have one (several: :data:`AMBIGUOUS`, nothing is credited);
* the LoRA adapter: the event's ``lora_name``, else the pool registration's (the Mooncake
  dialect's; ``""`` the base model), else the base model: a DP registered with another
  adapter is left out, one registered with none (V3) serves any.

Before, every DP of the node was credited (in the event's index when it named one):
another tenant's engines appeared in a tenant's answers, another model's in a model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: The model a Coordinator's pool registration carries when it knows none.
PLACEHOLDER_MODEL = "default"
#: Drop reasons.
NO_DP_OF_CONTEXT = "no_dp_of_pool_context"
AMBIGUOUS = "pool_context_ambiguous"


def registered_lora(info: object, dp: int) -> str | None:
    """The ``lora_name`` a DP was registered with (``conductor.instance_info``), or None."""
    if not isinstance(info, dict):
        return None
    eps = info.get("endpoints") or {}
    ep = eps.get(dp) if isinstance(eps, dict) else None
    v = ep.get("lora_name") if isinstance(ep, dict) else None
    return v if isinstance(v, str) else None


def registered_index(info: object, dp: int) -> tuple[str | None, str | None]:
    """(model, tenant) of a registration from ``conductor.instance_info``: a dict
    (``model_name``/``tenant_id``, per-DP values under ``endpoints[dp]`` preferred)
    or an object with ``model``/``tenant`` attributes; (None, None) if unknown."""
    if info is None:
        return None, None
    if isinstance(info, dict):
        eps = info.get("endpoints") or {}
        ep = eps.get(dp) if isinstance(eps, dict) else None
        if ep is None and isinstance(eps, dict):
            ep = eps.get(str(dp))
        src = ep if isinstance(ep, dict) and ep.get("model_name") else info
        return (
            src.get("model_name") or src.get("model"),
            src.get("tenant_id") or src.get("tenant"),
        )
    return (
        getattr(info, "model", None) or getattr(info, "model_name", None),
        getattr(info, "tenant", None) or getattr(info, "tenant_id", None),
    )


class Routed:
    """The DPs of one event: ``dps`` ``[(instance, dp, model, tenant)]``, or ``reason``
    (a drop reason) with ``detail`` (its WARN text)."""

    __slots__ = ("dps", "reason", "detail")

    def __init__(self, dps: list, reason: str = "", detail: str = "") -> None:
        self.dps = dps
        self.reason = reason
        self.detail = detail


def cluster_pool_dps(
    pairs: Sequence[tuple[str, int]],
    registered: Callable[[str, int], tuple[str | None, str | None]],
    event_model: str | None,
    event_tenant: str | None,
    pool_model: str,
    pool_tenant: str,
    event_lora: str | None = None,
    pool_lora: str | None = None,
    lora_of: Callable[[str, int], str | None] | None = None,
) -> Routed:
    """The DPs among ``pairs`` (those with an HBM URL on the event's node) that a cluster
    pool's event belongs to; ``registered(instance, dp)`` is a DP's registered (model,
    tenant). See the module docstring."""
    tenant = pool_tenant if event_tenant is None else event_tenant
    lora = event_lora or pool_lora
    model: str | None = event_model
    if model is None and pool_model != PLACEHOLDER_MODEL:
        model = pool_model
    seen: set[tuple[str, int]] = set()
    out: list[tuple[str, int, str, str]] = []
    others: list[str] = []
    for iid, dp in pairs:
        if (iid, dp) in seen:
            continue
        seen.add((iid, dp))
        m0, t0 = registered(iid, dp)
        if m0 is None or t0 is None:
            continue
        # a DP of a named adapter takes only that adapter's blocks (none named: the base
        # model's, as Mooncake's publisher sends an empty name as nil)
        l0 = None if lora_of is None else lora_of(iid, dp)
        if t0 == tenant and (model is None or m0 == model) and l0 in (None, lora or ""):
            out.append((iid, dp, m0, t0))
        else:
            others.append(f"{iid}/{dp} ({m0}, {t0})")
    where = f"model={model if model is not None else '(any)'} tenant={tenant}"
    if lora is not None:
        where += f" lora_name={lora!r}"
    if model is None and len({m for _, _, m, _ in out}) > 1:
        names = sorted({m for _, _, m, _ in out})
        return Routed(
            [],
            AMBIGUOUS,
            f"the event names no model_name and the pool is registered with model "
            f"{PLACEHOLDER_MODEL!r}, but the node hosts DPs of tenant {tenant} of several "
            f"models ({', '.join(names)}): its blocks are credited to none",
        )
    if not out:
        return Routed(
            [],
            NO_DP_OF_CONTEXT,
            f"no DP of {where} is registered with an HBM URL on the event's node (DPs "
            f"there: {', '.join(others[:8]) or 'none'}): a pool's blocks go only to the "
            "DPs of the event's model_name/tenant_id, else of the pool's registration",
        )
    return Routed(out)
