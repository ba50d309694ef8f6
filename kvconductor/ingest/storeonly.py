"""The bound of a store-only source (docs/api.md, "Store-only sources").

A store-only source (LMCache in multiprocess mode) announces CPU/Disk chunks and never,
or seldom, their removal. :class:`StoreOnlyBound` keeps what it announced, **one entry
per chunk** (a chunk of ``k`` registered blocks is one entry of weight ``k``), with
deadlines, and the number of registered blocks they stand for. It follows what the
source does send: ``BlockRemoved`` (:meth:`StoreOnlyBound.forget`, which names the
registered blocks of the removed chunks) and ``AllBlocksCleared``
(:meth:`StoreOnlyBound.clear`).

:func:`chunk_blocks` is the weight of a ``BlockStored`` before it is split: the bounds
of :class:`~kvconductor.ingest.stats.Limits` count the blocks a chunk stands for, not
its one hash, so an oversized chunk is refused whole before anything is split. The
split itself (``kvconductor._hash.split_chunk_hashes``) runs in C;
``kvconductor._py.hash`` is its oracle.

Everything here runs on the ingest thread (the index's single writer).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvconductor._hash import split_chunk_hashes
from kvconductor.ingest.ops import PoolEvent, Removed, Stored
from kvconductor.ingest.vllm import event_shapes
from kvconductor.keys import WorkerKey, parse_medium


def direct_medium(store_only: bool, medium: str | None) -> bool:
    """A store-only source's ``BlockStored`` with a CPU or Disk medium (held at once)."""
    return store_only and medium is not None and medium != "" and parse_medium(medium).tier != 0


def chunk_factor(block_size: int, registered: int) -> int:
    """The registered blocks one hash of a store-only ``BlockStored`` of ``block_size``
    stands for: ``block_size // registered`` when it is a multiple of the registered
    size, else 1 (a block of the registered size, or one that is dropped anyway)."""
    if block_size and registered > 0 and block_size != registered and block_size % registered == 0:
        return block_size // registered
    return 1


def chunk_blocks(nhashes: int, block_size: int, registered: int) -> int:
    """The registered blocks a store-only ``BlockStored`` of ``nhashes`` chunk hashes
    stands for (what the per-message and per-source bounds count)."""
    return nhashes * chunk_factor(block_size, registered)


#: Payloads from this size on are weighed before they are decoded (their token ids, the
#: bulk of a big chunk, are then converted only for a message within the bounds).
WEIGH_BYTES = 1 << 20


def claimed_blocks(payload: bytes, registered: int) -> int | None:
    """The registered blocks a store-only source's vLLM batch stores or removes (its
    chunks counted as the blocks they stand for), read without its token ids; None when
    it is no batch of one typed form."""
    shapes = event_shapes(payload)
    if shapes is None:
        return None
    n = 0
    for stored, nhashes, bs, medium in shapes:
        if stored and direct_medium(True, medium):
            n += chunk_blocks(nhashes, bs, registered)
        else:
            n += nhashes
    return n


def batch_blocks(events: Iterable[object], store_only: bool, registered: int) -> int:
    """The blocks a decoded batch's events stand for (:func:`claimed_blocks`'s rule,
    for any source: stores and removals by their hashes, a store-only source's chunks by
    the registered blocks they stand for, pool events by their hashes)."""
    n = 0
    for ev in events:
        if isinstance(ev, Stored) and direct_medium(store_only, ev.medium):
            n += chunk_blocks(len(ev.block_hashes), ev.block_size or 0, registered)
        elif isinstance(ev, (Stored, Removed)):
            n += len(ev.block_hashes)
        elif isinstance(ev, PoolEvent):
            n += len(ev.hashes)
    return n


class StoreOnlyBound:
    """The CPU/Disk blocks a store-only source announced: ``(key, chunk hash) ->
    (deadline, k)``, oldest first (a re-announcement moves a chunk to the end; it is
    never a second holding). A chunk leaves when its deadline passes (``ttl_secs`` after
    its last announcement), when the source holds more than ``capacity`` registered
    blocks (oldest first), or when the source removes it (``BlockRemoved`` of its hash,
    ``AllBlocksCleared``)."""

    __slots__ = ("ttl", "capacity", "held", "blocks", "expired", "evicted", "removed", "_fine")

    def __init__(self, ttl: float, capacity: int) -> None:
        self.ttl = ttl
        self.capacity = capacity
        self.held: OrderedDict[tuple[WorkerKey, int], tuple[float, int]] = OrderedDict()
        #: Registered blocks the entries stand for (the sum of their ``k``).
        self.blocks = 0
        #: Blocks that aged out (TTL) / were pushed out (capacity) / the source removed.
        self.expired = 0
        self.evicted = 0
        self.removed = 0
        #: Entries of single blocks that may be part of a chunk (seeded from the index).
        self._fine = False

    def adopt(self, old: StoreOnlyBound) -> None:
        """Take over ``old``'s entries and counts (a re-registration with a new bound)."""
        self.held, self.blocks = old.held, old.blocks
        self.expired, self.evicted, self.removed = old.expired, old.evicted, old.removed
        self._fine = old._fine

    def note(self, key: WorkerKey, hashes: Iterable[int], now: float, k: int = 1) -> None:
        """``hashes`` (chunks of ``k`` registered blocks each) announced now."""
        deadline = now + self.ttl
        held = self.held
        fine = self._fine and k > 1
        for h in hashes:
            kh = (key, h)
            old = held.pop(kh, None)
            if old is not None:
                self.blocks -= old[1]
            if fine:
                # a chunk's blocks seeded one by one (a warm start): one entry now
                for s in split_chunk_hashes((h,), k)[:-1]:
                    o = held.pop((key, s), None)
                    if o is not None:
                        self.blocks -= o[1]
            held[kh] = (deadline, k)
            self.blocks += k

    def seed(self, key: WorkerKey, hashes: Sequence[int], now: float) -> None:
        """Blocks the index holds already (one entry each: their chunks are unknown)."""
        if len(hashes):
            self._fine = True
        self.note(key, hashes, now)

    def due(self, now: float) -> dict[WorkerKey, array]:
        """Take the chunks past their deadline or over the capacity: their registered
        blocks' engine hashes, by key."""
        out: dict[WorkerKey, list[tuple[int, int]]] = {}
        held = self.held
        while held:
            kh, (deadline, k) = next(iter(held.items()))
            if deadline > now and self.blocks <= self.capacity:
                break
            held.popitem(last=False)
            self.blocks -= k
            if deadline <= now:
                self.expired += k
            else:
                self.evicted += k
            out.setdefault(kh[0], []).append((kh[1], k))
        return {key: _expand(chunks) for key, chunks in out.items()}

    def forget(self, key: WorkerKey, hashes: Iterable[int], removed: bool = True) -> array:
        """``BlockRemoved`` of ``hashes`` on ``key``: the engine hashes of the registered
        blocks to remove (a chunk's all; a hash the bound does not hold as itself).
        ``removed=False``: aged out after a loss, not counted as the source's removal."""
        held = self.held
        chunks: list[tuple[int, int]] = []
        for h in hashes:
            old = held.pop((key, h), None)
            if old is None:
                chunks.append((h, 1))
                continue
            self.blocks -= old[1]
            if removed:
                self.removed += old[1]
            chunks.append((h, old[1]))
        return _expand(chunks)

    def clear(self, keys: Iterable[WorkerKey]) -> int:
        """``AllBlocksCleared`` (or the subscription's blocks dropped) for ``keys``: their
        entries go; the blocks they stood for."""
        drop = set(keys)
        if not drop or not self.held:
            return 0
        gone = [kh for kh in self.held if kh[0] in drop]
        n = 0
        for kh in gone:
            n += self.held.pop(kh)[1]
        self.blocks -= n
        self.removed += n
        return n

    def info(self) -> dict[str, object]:
        return {
            "ttl_secs": self.ttl,
            "capacity": self.capacity,
            "blocks": self.blocks,
            "expired_blocks": self.expired,
            "evicted_blocks": self.evicted,
            "removed_blocks": self.removed,
        }


def _expand(chunks: list[tuple[int, int]]) -> array:
    """Engine hashes of the registered blocks of ``(chunk hash, k)`` pairs."""
    out = array("Q")
    ones = [h for h, k in chunks if k == 1]
    if ones:
        out.extend(ones)
    for h, k in chunks:
        if k > 1:
            out.extend(split_chunk_hashes((h,), k))
    return out
