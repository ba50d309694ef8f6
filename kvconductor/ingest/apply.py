"""Apply one subscription's payloads to the index (docs/events.md, "Applying"), on the
ingest thread (the index's single writer). The route, top to bottom in
:meth:`Applier.apply_payload`: the bounds read from the raw bytes (``--max-message-mb``,
a store-only source's big chunk weighed by
:func:`~kvconductor.ingest.storeonly.claimed_blocks`);
:func:`~kvconductor.ingest.recognize.recognize` names the kind; the decoder of that kind
runs once: the compiled fast path for a vLLM/SGLang batch on an engine's HBM source
(below), else (or for what it declines) :func:`~kvconductor.ingest.recognize.decode`,
into the typed operations of :mod:`~kvconductor.ingest.ops`; then the batch is weighed
(``--max-blocks-per-message``, ``--max-blocks-per-source``), the engine-batch-on-a-pool
guard runs, and :meth:`Applier.apply_vllm` or :meth:`Applier.apply_pool` applies it.

Routing (deviations from the reference are marked FIX):

* vLLM/SGLang ``BlockStored``: dropped when ``block_size`` is neither 0 nor the
  registered one, or when ``kv_cache_spec_kind`` is a non-prefix-cacheable
  attention kind. HBM medium (``GPU``/``NPU``/absent) -> ``Index.store_tokens`` on
  ``WorkerKey(instance, instance, dp, NPU)``; anything else (``CPU``,
  ``STORAGE``, ...) -> ``Index.offload`` (two-phase Phase 1). With ``lora_name``
  the local hashes use ``lora_seed(lora_name)``. FIX: an event without medium
  goes to the HBM worker only (the reference fanned it out to every default
  medium of the URL, storing GPU blocks into the CPU/Disk tiers as well).
* ``BlockRemoved`` -> ``Index.evict`` on ``WorkerKey(.., medium or NPU)``.
* ``AllBlocksCleared`` -> ``Index.clear`` for the subscription's default media.
* The DP is always the subscription's (FIX: also during replay; the reference used
  the batch's rank there).
* Pool events -> ``Index.pool_store`` / ``evict`` / ``clear`` on each of the targets
  :func:`~kvconductor.ingest.pooltargets.pool_targets` finds (which DPs, media and
  index; its FIXes are listed there).

Compiled fast path (``kvconductor._ingest.FastBatch``, engine HBM sources outside a
loss's grace period): a batch whose every event it handles (HBM medium, ASCII LoRA name /
attention kind, int or bin hashes, plain envelope) is parsed, hashed and applied in C
under one write lock, with the same results, counters and ``touched`` keys as the code
below (a DP's live predictions told the same: :mod:`~kvconductor.ingest.predicted`);
anything else returns -1 from ``parse`` before any mutation and goes to the Python vLLM
decoder. ``KVCONDUCTOR_IMPL=py`` (or ``Applier(..., fast=False)``) turns it off.
"""

from __future__ import annotations

import logging
import time
import weakref
from array import array
from collections.abc import Sequence

import kvconductor
from kvconductor._hash import DEFAULT_SEED, hash_blocks, lora_seed, split_chunk_hashes
from kvconductor._index import CoreIndex as _CCore
from kvconductor._ingest import FastBatch
from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound
from kvconductor.index import Index
from kvconductor.ingest.context import SubscriberContext
from kvconductor.ingest.host import IngestHost
from kvconductor.ingest.ops import (
    CLEARED,
    REMOVED,
    STORED,
    Cleared,
    DecodeError,
    Dropped,
    PoolBatch,
    Removed,
    Stored,
    VllmBatch,
)
from kvconductor.ingest.poolguard import ENGINE_BATCH_ON_POOL, engine_batch_on_pool
from kvconductor.ingest.pooltargets import Miss, pool_targets
from kvconductor.ingest.predicted import apply_reported
from kvconductor.ingest.recognize import VLLM, decode, recognize
from kvconductor.ingest.sharedstore import store_shared
from kvconductor.ingest.stats import DEFAULT_WARN, Limits, SourceStats, WarnLimiter
from kvconductor.ingest.storeonly import (
    WEIGH_BYTES,
    StoreOnlyBound,
    batch_blocks,
    chunk_factor,
    claimed_blocks,
    direct_medium,
)
from kvconductor.keys import Medium, WorkerKey, parse_medium

log = logging.getLogger("kvconductor.ingest")

_UNKNOWN = 1 << 62

#: The compiled fast path; off (``None``) when ``KVCONDUCTOR_IMPL=py``.
_FastBatch: type[FastBatch] | None = None if kvconductor.IMPL == "py" else FastBatch

#: kv_cache_spec_kind values (lower-case, underscores removed) that are not a
#: prefix cache a query can hit (docs/engines.md, "Engine settings that matter");
#: anything else is accepted.
REJECTED_KINDS = frozenset(
    (
        "slidingwindow",
        "slidingwindowmla",
        "mamba",
        "chunkedlocalattention",
        "encoderonlyattention",
        "crossattention",
    )
)


def kind_rejected(kind: str | None) -> bool:
    """True for attention kinds whose blocks must not be indexed (see REJECTED_KINDS)."""
    if not kind:
        return False
    return kind.lower().replace("_", "") in REJECTED_KINDS


class Applier:
    """Decode and apply payloads for one subscription."""

    def __init__(
        self,
        ctx: SubscriberContext,
        conductor: IngestHost,
        stats: SourceStats | None = None,
        warn: WarnLimiter | None = None,
        fast: bool = True,
        limits: Limits | None = None,
    ) -> None:
        self.ctx = ctx
        self.conductor = conductor
        self.limits = limits or Limits()
        self.stats = stats or SourceStats()
        self._warn = warn or DEFAULT_WARN
        self.source = f"{ctx.instance_id}/dp{ctx.dp_rank}@{ctx.url}"
        self.hbm_medium = next((m for m in ctx.default_media if Medium(m).tier == 0), Medium.NPU)
        if self.hbm_medium is Medium.UNKNOWN:
            self.hbm_medium = Medium.NPU
        non_hbm = tuple(m for m in ctx.default_media if Medium(m).tier != 0)
        self.pool_media = non_hbm or tuple(ctx.default_media)
        #: (model, tenant) -> WorkerKeys this subscription has written (for resync clears).
        self.touched: dict[tuple[str, str], set[WorkerKey]] = {}
        # Compiled fast path for HBM subscriptions (engine publishers, not pools).
        feeds_hbm = any(Medium(m).tier == 0 for m in ctx.default_media)
        #: An engine's own publisher (HBM worker): the per-source block bound applies.
        self._engine_hbm = feeds_hbm and not ctx.is_pool
        #: Upper bound of the blocks its HBM worker holds (see _within_limits); unknown
        #: (the first message reads the index) until then.
        self._held_bound = _UNKNOWN
        self._fast = (
            _FastBatch(DEFAULT_SEED)
            if fast and _FastBatch is not None and self._engine_hbm
            else None
        )
        self._hbm_key = self._key(self.hbm_medium)
        self._clear_keys = tuple(self._key(Medium(m)) for m in ctx.default_media)
        #: A weak reference to the index _fast_wid belongs to.
        self._fast_index: weakref.ref[Index] | None = None
        self._fast_wid = -1
        #: After a loss: (model, tenant, key) -> engine hashes held then (see begin_suspect).
        self.suspects: dict[tuple[str, str, WorkerKey], array] | None = None
        #: After a loss: key -> engine hashes announced since (stored, or named as parent).
        self.confirmed: dict[WorkerKey, array] = {}
        #: A store-only source: the bound of its CPU/Disk blocks (None otherwise).
        self.store_bound = (
            StoreOnlyBound(*ctx.store_only)
            if ctx.store_only is not None and not ctx.is_pool
            else None
        )
        if self.store_bound is not None:
            self.seed_store_only()

    # -- helpers ------------------------------------------------------------------------
    def _drop(self, reason: str, detail: str = "", payload: bytes | None = None) -> None:
        self.stats.drop(reason)
        self._warn.warn(self.source, reason, detail, payload)

    def _size_warning(self, block_size: int) -> None:
        """A silent 0 % hit rate made loud: the engine hashes with another block size than
        the registration says. Partial prompt tails (vLLM >= 0.24) mismatch too, as
        expected, so this warns (rate-limited) only while the source has had no block
        indexed at all: a misconfigured DP never has one."""
        if self.stats.blocks:
            return
        self._warn.warn(
            self.source,
            "block_size_mismatch",
            f"BlockStored with block_size {block_size}, but this DP was registered with "
            f"block_size {self.ctx.block_size} and none of its blocks is indexed; register "
            "the engine's block size (vLLM --block-size)",
            None,
        )

    def _key(
        self, medium: Medium, instance_id: str | None = None, dp: int | None = None
    ) -> WorkerKey:
        iid = self.ctx.instance_id if instance_id is None else instance_id
        return WorkerKey(iid, iid, self.ctx.dp_rank if dp is None else dp, medium)

    def _touch(self, model: str, tenant: str, key: WorkerKey) -> None:
        s = self.touched.get((model, tenant))
        if s is None:
            s = self.touched[(model, tenant)] = set()
        s.add(key)

    def _lora(self, model: str, tenant: str, seed: int) -> None:
        self.conductor.note_lora(model, tenant, seed)

    def _confirm(self, key: WorkerKey, hashes, parent: int | None = None) -> None:
        """After a loss: ``hashes`` (and ``parent``) of ``key`` were announced again."""
        arr = self.confirmed.get(key)
        if arr is None:
            arr = self.confirmed[key] = array("Q")
        arr.extend(hashes)
        if parent is not None:
            arr.append(parent)

    # -- entry points ---------------------------------------------------------------------
    def apply_payload(self, payload: bytes) -> bool:
        """Recognise, decode once and apply one payload (the route of the module docstring);
        False (counted, warned) if undecodable or over a bound of :class:`Limits`."""
        lim = self.limits
        if self.store_bound is not None and self.store_bound.held:
            self.expire_store_only()
        if len(payload) > lim.max_message_bytes:
            self._drop(
                "message_too_large",
                f"{len(payload)} bytes > {lim.max_message_bytes} (--max-message-mb)",
            )
            return False
        weighed = False
        if self.store_bound is not None and len(payload) >= WEIGH_BYTES:
            # PERF: a store-only source's big chunk is weighed (as the registered blocks it
            # stands for) and refused before anything of it is converted or parsed again
            pre = claimed_blocks(payload, self.ctx.block_size)
            if pre is not None:
                if not self._within_limits(pre):
                    return False
                weighed = True
        try:
            rec = recognize(payload)
        except DecodeError as ex:
            self._drop(ex.reason, ex.detail, payload)
            return False
        index = None
        fb = self._fast
        if rec.kind == VLLM and fb is not None and self.suspects is None:
            # The compiled decoder of this kind; after a loss the general path runs (it
            # records what is re-announced). What it declines goes on below.
            n = fb.parse(payload, self.ctx.block_size)
            if n >= 0:
                if not weighed and not self._within_limits(fb.nhashes):
                    return False
                index = self._apply_fast(fb, n, payload)
                if index is None:
                    return True
                weighed = False  # (the general path weighs it again, as it always did)
        try:
            batch = decode(payload, rec)
        except DecodeError as ex:
            self._drop(ex.reason, ex.detail, payload)
            return False
        except Exception as ex:
            self._drop("decoder_error", repr(ex), payload)
            return False
        nblocks = batch_blocks(batch.events, self.store_bound is not None, self.ctx.block_size)
        if not weighed and not self._within_limits(nblocks, index):
            return False
        why = engine_batch_on_pool(self.ctx, batch)
        if why is not None:
            self._drop(ENGINE_BATCH_ON_POOL, why)
            return False
        self.stats.batches += 1
        if isinstance(batch, VllmBatch):
            self.apply_vllm(batch, payload, index)
        else:
            self.apply_pool(batch, payload)
        return True

    def _within_limits(self, nblocks: int, index=None) -> bool:
        """False (counted, warned) when a message of ``nblocks`` blocks is over a bound. A
        store-only source's chunks count as the registered blocks they stand for, and what
        its bound holds counts against ``--max-blocks-per-source`` too."""
        lim = self.limits
        if nblocks > lim.max_blocks_per_message:
            self._drop(
                "message_too_many_blocks",
                f"{nblocks} blocks > {lim.max_blocks_per_message} (--max-blocks-per-message)",
            )
            return False
        sb = self.store_bound
        if nblocks and (self._engine_hbm or sb is not None):
            lower = 0 if sb is None else sb.blocks
            # PERF: an upper bound of what the HBM worker holds (blocks only ever come from
            # accepted messages) spares the index lookup until the bound is near the limit.
            if self._held_bound + lower + nblocks > lim.max_blocks_per_source:
                try:
                    if index is None:
                        index = self.conductor.get_index(self.ctx.model, self.ctx.tenant)
                    held = index.worker_blocks(self._hbm_key) if index is not None else 0
                except Exception:
                    held = 0
                self._held_bound = held
                if held + lower + nblocks > lim.max_blocks_per_source:
                    self._drop(
                        "source_block_limit",
                        f"{held + lower} held + {nblocks} > "
                        f"{lim.max_blocks_per_source} (--max-blocks-per-source)",
                    )
                    return False
            self._held_bound += nblocks
        return True

    def _apply_fast(self, fb, n: int, payload: bytes) -> Index | None:
        """Apply a batch ``fb.parse`` accepted (``n`` events) exactly as apply_vllm would:
        None. An index instead: the fast path cannot apply it there (a pure-Python core, a
        failure before any mutation), the general path applies it."""
        ctx = self.ctx
        stats = self.stats
        if n == 0:
            stats.batches += 1
            return None
        try:
            index = self.conductor.get_or_create_index(ctx.model, ctx.tenant)
        except Exception as ex:
            stats.batches += 1
            stats.events += 1
            self._drop("apply_error", f"get_or_create_index: {ex!r}", payload)
            return None
        core = index.core
        if type(core) is not _CCore:
            self._fast = None  # pure-Python core: this subscription stays on the general path
            return index
        try:
            wid = -1
            if fb.needs_worker:
                ref = self._fast_index
                if ref is not None and ref() is index:
                    wid = self._fast_wid
                else:
                    wid = index.worker_id(self._hbm_key)
                    self._fast_index = weakref.ref(index)
                    self._fast_wid = wid
            clear: Sequence[int] = ()
            if fb.has_clear:  # Index.clear skips keys it never saw; so do we
                known = set(index.workers_of(ctx.instance_id, ctx.dp_rank))
                clear = [index.worker_id(k) for k in self._clear_keys if k in known]
            blocks, parent_nf, bad_seq, oom = apply_reported(fb, index, wid, clear, self._hbm_key)
        except Exception:
            return index
        if fb.has_clear and self.store_bound is not None:
            self.store_bound.clear(self._clear_keys)
        stats.batches += 1
        stats.events += n
        stats.blocks += blocks
        for seed in fb.lora_seeds:
            self._lora(ctx.model, ctx.tenant, seed)
        if fb.touches:
            self._touch(ctx.model, ctx.tenant, self._hbm_key)
        k = fb.size_mismatch
        if k:
            stats.drop("block_size_mismatch", k)
            self._size_warning(fb.mismatched_block_size)
        k = fb.kind_rejected
        if k:
            stats.drop("attention_kind", k)
        for _ in range(parent_nf):
            self._drop("parent_not_found", str(ParentBlockNotFound()))
        for _ in range(bad_seq):
            self._drop("invalid_block_sequence", str(InvalidBlockSequence()))
        for _ in range(oom):
            self._drop("apply_error", repr(MemoryError()), payload)
        return None

    def _targets(self) -> dict[tuple[str, str], set[WorkerKey]]:
        """Every worker key this subscription feeds, per (model, tenant)."""
        ctx = self.ctx
        targets = {k: set(v) for k, v in self.touched.items()}
        if not ctx.is_pool:
            base = targets.setdefault((ctx.model, ctx.tenant), set())
            base.update(self._key(m) for m in ctx.default_media)
            base.add(self._key(self.hbm_medium))
        return targets

    def clear_all(self) -> int:
        """Drop every block this subscription fed (its workers), return the count."""
        n = 0
        for (model, tenant), keys in self._targets().items():
            try:
                index = self.conductor.get_or_create_index(model, tenant)
                for key in keys:
                    n += index.clear(key)
            except Exception as ex:
                self._drop("apply_error", f"clear: {ex!r}")
        self.touched.clear()
        sb = self.store_bound
        if sb is not None:
            sb.clear({kh[0] for kh in sb.held})
        return n

    # -- after a loss: keep what we have, age out what is never re-announced ---------------
    def begin_suspect(self) -> int:
        """A batch was lost: keep every block, but remember what this subscription's
        workers hold now (the suspects: the lost batch may have removed some of them) and
        record from now on what the stream announces again. Returns the suspects.

        A second loss before :meth:`end_suspect` starts over from the holdings then.
        """
        snap: dict[tuple[str, str, WorkerKey], array] = {}
        n = 0
        for (model, tenant), keys in self._targets().items():
            try:
                index = self.conductor.get_or_create_index(model, tenant)
                for key in keys:
                    hs = index.worker_hashes(key)
                    if len(hs):
                        snap[(model, tenant, key)] = hs
                        n += len(hs)
            except Exception as ex:
                self._drop("apply_error", f"snapshot: {ex!r}")
        self.suspects = snap
        self.confirmed = {}
        return n

    def end_suspect(self) -> int:
        """The grace period after a loss is over: drop the suspects that were neither
        announced again nor are ancestors of a block announced since (a stored block's
        prefix is still cached by the engine). Returns the blocks dropped."""
        snap, self.suspects = self.suspects, None
        confirmed, self.confirmed = self.confirmed, {}
        if not snap:
            return 0
        dropped = 0
        for (model, tenant, key), held in snap.items():
            try:
                index = self.conductor.get_or_create_index(model, tenant)
                alive = set(confirmed.get(key, ()))
                for h in list(alive):
                    while True:
                        try:
                            h = index.parent_of(key, h)
                        except KeyError:
                            break
                        if h is None or h in alive:
                            break
                        alive.add(h)
                stale = array("Q", [h for h in held if h not in alive])
                if stale:
                    dropped += index.remove(key, stale)
                    if self.store_bound is not None and key.medium.tier != 0:
                        self.store_bound.forget(key, stale, removed=False)
            except Exception as ex:
                self._drop("apply_error", f"age out: {ex!r}")
        self.stats.aged_out += dropped
        return dropped

    # -- vLLM / SGLang ----------------------------------------------------------------------
    def apply_vllm(self, batch: VllmBatch, payload: bytes | None = None, index=None) -> None:
        ctx = self.ctx
        stats = self.stats
        for ev in batch.events:
            stats.events += 1
            t = type(ev)
            if t is Dropped:
                self._drop(ev.reason, ev.detail, payload)
                continue
            if index is None:
                try:
                    index = self.conductor.get_or_create_index(ctx.model, ctx.tenant)
                except Exception as ex:
                    self._drop("apply_error", f"get_or_create_index: {ex!r}", payload)
                    return
            try:
                if t is Stored:
                    self._stored(index, ev)
                elif t is Removed:
                    self._removed(index, ev)
                elif t is Cleared:
                    for m in ctx.default_media:
                        key = self._key(Medium(m))
                        index.clear(key)
                    if self.store_bound is not None:
                        self.store_bound.clear(self._clear_keys)
            except ParentBlockNotFound as ex:
                self._drop("parent_not_found", str(ex))
            except InvalidBlockSequence as ex:
                self._drop("invalid_block_sequence", str(ex))
            except Exception as ex:
                self._drop("apply_error", repr(ex), payload)

    def _stored(self, index, ev: Stored) -> None:
        ctx = self.ctx
        bs = ev.block_size
        direct = direct_medium(self.store_bound is not None, ev.medium)
        # (a store-only source's chunks of whole registered blocks are split up)
        if (
            bs
            and ctx.block_size > 0
            and bs != ctx.block_size
            and not (direct and bs % ctx.block_size == 0)
        ):
            self.stats.drop("block_size_mismatch")
            self._size_warning(bs)
            return
        if ev.kind and kind_rejected(ev.kind):
            self.stats.drop("attention_kind")
            return
        hashes = ev.block_hashes
        if not hashes:
            return
        seed = lora_seed(ev.lora_name) if ev.lora_name else DEFAULT_SEED
        tokens = ev.tokens
        given = ev.local_hashes
        if seed != DEFAULT_SEED and ((len(tokens) and bs) or given is not None):
            self._lora(ctx.model, ctx.tenant, seed)
        medium = parse_medium(ev.medium) if ev.medium else self.hbm_medium
        if direct and given is None and (len(tokens) and bs):
            self._store_direct(index, ev, medium, seed)
            return
        if medium is Medium.NPU:
            key = self._key(medium)
            self._touch(ctx.model, ctx.tenant, key)
            if self.suspects is not None:
                self._confirm(key, hashes, ev.parent)
            if given is not None:
                n = index.store(key, ev.parent, hashes, given)
            elif len(tokens) and bs:
                n = index.store_tokens(key, ev.parent, hashes, tokens, bs, seed)
            else:
                n = index.store(key, ev.parent, hashes, hashes)
            self.stats.blocks += n
            return
        if given is None and not (len(tokens) and bs) and medium is not Medium.UNKNOWN:
            # No content (llm-d's storage events, vLLM's placeholder offload events): the
            # publisher confirms it holds these engine hashes, as a pool does, for this
            # subscription's (instance, DP); the engine's offload with tokens joins them.
            key = self._key(medium)
            self._touch(ctx.model, ctx.tenant, key)
            index.pool_store(key, hashes, time.monotonic())
            self.stats.blocks += len(hashes)
            if self.suspects is not None:
                self._confirm(key, hashes)
            return
        # Phase 1 of the two-phase join: the pool's confirmation decides where it lives.
        if given is not None:
            local = given
        elif len(tokens) and bs:
            local = hash_blocks(tokens, bs, seed)
            n = min(len(local), len(hashes))
            if n < len(hashes):
                hashes = hashes[:n]
            elif n < len(local):
                local = local[:n]
        else:
            local = hashes
        index.offload(hashes, local, ev.parent)
        self.stats.blocks += len(hashes)
        if self.suspects is not None:
            # The engine holds these on a lower tier now: its CPU/Disk blocks are confirmed.
            for m in ctx.default_media:
                if Medium(m).tier != 0:
                    self._confirm(self._key(Medium(m)), hashes, ev.parent)

    def _store_direct(self, index, ev: Stored, medium: Medium, seed: int) -> None:
        """A store-only source's CPU/Disk blocks: its own, held at once (no pool join),
        bounded by :class:`StoreOnlyBound`."""
        assert self.store_bound is not None
        ctx = self.ctx
        key = self._key(medium)
        chunks, tokens, bs = ev.block_hashes, ev.tokens, ev.block_size
        reg = ctx.block_size
        hashes, k = chunks, 1
        if bs and reg > 0 and bs != reg:
            if len(tokens) != bs * len(chunks):
                self.stats.drop("block_size_mismatch")
                return
            k = chunk_factor(bs, reg)
            hashes, bs = split_chunk_hashes(chunks, k), reg
        self._touch(ctx.model, ctx.tenant, key)
        if self.suspects is not None:
            self._confirm(key, hashes, ev.parent)
        if len(tokens) and bs:
            n = index.store_tokens(key, ev.parent, hashes, tokens, bs, seed)
        else:
            n = index.store(key, ev.parent, hashes, hashes)
        self.stats.blocks += n
        self.store_bound.note(key, chunks, time.monotonic(), k)
        if self.store_bound.blocks > self.store_bound.capacity:
            self.expire_store_only()

    def seed_store_only(self) -> None:
        """Blocks the DP holds on CPU/Disk when its store-only subscription opens, or when
        a dump restored its index (a warm start), join the bound from now on: none stays
        unbounded."""
        assert self.store_bound is not None
        index = self.conductor.get_index(self.ctx.model, self.ctx.tenant)
        if index is None:
            return
        now = time.monotonic()
        for m in (Medium.CPU, Medium.DISK):
            key = self._key(m)
            held = index.worker_hashes(key)
            if len(held):
                self.store_bound.seed(key, held, now)

    def expire_store_only(self, now: float | None = None) -> int:
        """Evict a store-only source's blocks past their TTL or over its capacity (on
        every batch it sends and at every source check); the number evicted."""
        sb = self.store_bound
        if sb is None or not sb.held:
            return 0
        due = sb.due(time.monotonic() if now is None else now)
        if not due:
            return 0
        index = self.conductor.get_index(self.ctx.model, self.ctx.tenant)
        n = 0
        if index is not None:
            for key, hs in due.items():
                n += index.remove(key, hs)  # its own blocks: no two-phase rule
        return n

    def _removed(self, index, ev: Removed) -> None:
        if not ev.block_hashes:
            return
        medium = parse_medium(ev.medium) if ev.medium else self.hbm_medium
        key = self._key(medium)
        sb = self.store_bound
        if sb is not None and medium.tier != 0:
            # a store-only source's chunk goes whole, and leaves its bound
            index.evict(key, sb.forget(key, ev.block_hashes))
            return
        index.evict(key, ev.block_hashes)

    # -- pools ---------------------------------------------------------------------------------
    def _store_shared(self, targets, hashes, now: float) -> None:
        by_index: dict[tuple[str, str], list[WorkerKey]] = {}
        for model, tenant, key in targets:
            by_index.setdefault((model, tenant), []).append(key)
            self._touch(model, tenant, key)
            if self.suspects is not None:
                self._confirm(key, hashes)
        for (model, tenant), keys in by_index.items():
            index = self.conductor.get_or_create_index(model, tenant)
            store_shared(index, keys, hashes, now)
        self.stats.blocks += len(hashes)

    def _pool_targets(self, ev, infos: dict) -> list[tuple[str, str, WorkerKey]] | None:
        """``ev``'s targets (:func:`~kvconductor.ingest.pooltargets.pool_targets`); None:
        none (the miss counted, and warned unless it says otherwise)."""
        media = (parse_medium(ev.medium),) if ev.medium else self.pool_media
        found = pool_targets(self.conductor, self.ctx, ev, media, infos)
        if isinstance(found, Miss):
            if found.warn:
                self._drop(found.reason, found.detail)
            else:
                self.stats.drop(found.reason)
            return None
        return found

    def apply_pool(self, batch: PoolBatch, payload: bytes | None = None) -> None:
        stats = self.stats
        now = time.monotonic()
        infos: dict = {}  # instance_info per batch
        for ev in batch.events:
            stats.events += 1
            if type(ev) is Dropped:
                self._drop(ev.reason, ev.detail, payload)
                continue
            kind = ev.kind
            if kind not in (STORED, REMOVED, CLEARED):
                stats.drop("unknown_event_type")
                continue
            if kind != CLEARED and not ev.hashes:
                stats.drop("no_hashes")
                continue
            try:
                targets = self._pool_targets(ev, infos)
                if not targets:
                    continue
                hashes = array("Q", ev.hashes)
                if kind == STORED and self.ctx.shared_store:
                    self._store_shared(targets, hashes, now)
                    continue
                indexes: dict = {}
                for model, tenant, key in targets:
                    index = indexes.get((model, tenant))
                    if index is None:
                        index = indexes[(model, tenant)] = self.conductor.get_or_create_index(
                            model, tenant
                        )
                    if kind == STORED:
                        self._touch(model, tenant, key)
                        index.pool_store(key, hashes, now)
                        if self.suspects is not None:
                            self._confirm(key, hashes)
                    elif kind == REMOVED:
                        index.evict(key, hashes)
                    else:
                        index.clear(key)
                if kind == STORED:
                    stats.blocks += len(hashes)
            except Exception as ex:
                self._drop("apply_error", repr(ex), payload)
