"""Registrations of a snapshot or dump restored one by one: what the current flags refuse,
or what cannot be reopened now, is skipped and everything else is loaded
(docs/operations.md, "Warm restart: the snapshot directory").

A snapshot was written under the flags of the process that wrote it. A restart with a
lower ``--max-sources``, a tightened ``--endpoint-networks``, without
``--allow-ipc-endpoints`` / ``--allow-bind-endpoints``, with a bind-mode port taken by
another process meanwhile, or a version that validates a field more strictly, cannot take
some of its registrations again. Each such
registration is skipped with one WARN naming it and the reason, and counted in
``kvconductor_snapshot_skipped_registrations_total{reason}`` (:data:`REASONS`); the
other registrations, their cursors and their blocks are loaded.

A skipped (instance, DP)'s blocks are dropped from the indexes once they are loaded
(:func:`drop_skipped`): no subscription keeps them current and no unregistration could
ever remove them, so they must not count as hits. The engine's registration (the
Coordinator's re-register) brings them back from its events and replay.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from kvconductor.schema import RegisterRequest
from kvconductor.state.registration import SKIP_REASONS as REASONS
from kvconductor.state.registration import RegistrationUnavailable
from kvconductor.state.registry import RegistrationError

if TYPE_CHECKING:
    from kvconductor.state.conductor import Conductor

log = logging.getLogger("kvconductor.snapshot")

__all__ = ["REASONS", "Skipped", "drop_skipped", "register"]

#: A skipped registration: (instance_id, dp_rank).
Skipped = tuple[str, int]


def register(conductor: Conductor, doc: object, skipped: list[Skipped]) -> bool:
    """Register the ``POST /register`` body ``doc`` of a registration record (ingest
    thread); False, with one WARN and a count, when this version or the current flags
    refuse it (``refused``: the body no longer validates, a URL the flags exclude) or it
    cannot be opened now (then it is appended to ``skipped``)."""
    req: RegisterRequest | None = None
    try:
        req = msgspec.convert(doc, RegisterRequest)
        conductor.register(req)
        return True
    except (msgspec.ValidationError, RegistrationError) as ex:
        reason, why = "refused", str(ex)
    except RegistrationUnavailable as ex:
        reason, why = ex.reason, str(ex)
    conductor.skipped_registrations[reason] = conductor.skipped_registrations.get(reason, 0) + 1
    if req is not None:
        iid, dp, model = req.instance_id, req.dp_rank, req.modelname
    else:  # as the record names them, for the log and for dropping its blocks
        raw = doc if isinstance(doc, dict) else {}
        iid, model = str(raw.get("instance_id")), str(raw.get("modelname"))
        dp_raw = raw.get("dp_rank")
        dp = dp_raw if isinstance(dp_raw, int) else 0
    skipped.append((iid, dp))
    log.warning(
        "snapshot registration skipped instance_id=%s dp_rank=%d model=%s reason=%s: %s; "
        "every other registration is loaded; its blocks are dropped until it registers again",
        iid,
        dp,
        model,
        reason,
        why,
    )
    return False


def drop_skipped(conductor: Conductor, skipped: list[Skipped]) -> int:
    """Drop the blocks every index holds of each skipped (instance, DP) that is not
    registered (ingest thread, after the indexes are loaded); an index left empty with no
    registration is removed. Returns the blocks dropped."""
    dropped = 0
    for iid, dp in skipped:
        entry = conductor.registry.get(iid)
        if entry is not None and dp in entry.endpoints:
            continue  # registered after all (a later record of the same DP)
        for key, idx in list(conductor.indexes.items()):
            n = idx.remove_dp(iid, dp)
            dropped += n
            if n:
                log.info(
                    "snapshot blocks of a skipped registration dropped instance_id=%s "
                    "dp_rank=%d model=%s tenant=%s blocks=%d",
                    iid,
                    dp,
                    key[0],
                    key[1],
                    n,
                )
            conductor.reclaim(key)
    return dropped
