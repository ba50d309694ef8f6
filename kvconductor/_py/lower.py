"""CPU / Disk lower tier: the pure-Python twin of ``kvconductor._lower.LowerTier``.

Semantics: ``docs/design.md``, section "LowerTier (CPU, Disk)".

**Threading: exactly one writer thread calls** :meth:`LowerTier.store`,
:meth:`LowerTier.remove` **and** :meth:`LowerTier.clear`; **any number of
threads may call** :meth:`LowerTier.walk`, :meth:`LowerTier.lookup_block`
**and the introspection members concurrently.** Every public method holds one
:class:`threading.Lock` for its whole duration.
"""

from __future__ import annotations

import threading

from kvconductor._py.tree import PerWorkerBlocks, u64_list, u64_or_none

EdgeKey = tuple  # (parent engine hash, LocalBlockHash) or, for root edges, (None, local, child)


class _Edge:
    __slots__ = ("child", "owners")

    def __init__(self, child: int) -> None:
        #: engine hash of the block this edge leads to, fixed by its creator
        self.child = child
        #: workers holding the block
        self.owners: set[int] = set()


class LowerTier(PerWorkerBlocks):
    """Edges ``(parent engine hash, LocalBlockHash) -> (child, owners)``; root edges
    ``(None, LocalBlockHash, child)``: one per distinct first engine hash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._edges: dict[EdgeKey, _Edge] = {}
        #: LocalBlockHash -> children of its root edges, oldest first
        self._roots: dict[int, list[int]] = {}
        #: worker -> {engine hash -> edge key}; the worker owns exactly these edges.
        self._rev: dict[int, dict[int, EdgeKey]] = {}

    # -- internals (caller holds the lock) ---------------------------------------------
    def _drop(self, worker: int, key: EdgeKey) -> None:
        """Drop ``worker``'s ownership of edge ``key``; delete the edge when nobody owns it."""
        edge = self._edges[key]
        edge.owners.discard(worker)
        if not edge.owners:
            del self._edges[key]
            if key[0] is None:
                children = self._roots[key[1]]
                children.remove(key[2])
                if not children:
                    del self._roots[key[1]]

    def _owners(self, parent: int | None, local: int) -> list[int]:
        if parent is None:
            return sorted(
                set().union(
                    *(self._edges[(None, local, c)].owners for c in self._roots.get(local, ()))
                )
            )
        edge = self._edges.get((parent, local))
        return sorted(edge.owners) if edge is not None else []

    def _root_of(self, local: int, worker: int) -> int | None:
        """Child of the oldest root edge of ``local`` that ``worker`` owns."""
        for c in self._roots.get(local, ()):
            if worker in self._edges[(None, local, c)].owners:
                return c
        return None

    # -- mutations (writer thread) -------------------------------------------------------
    def store(self, worker: int, parent: int | None, engine_hashes, local_hashes) -> int:
        """Store a chain; returns the number of blocks accepted. Never raises on content.

        The chain stops at the first block the worker already maps under another
        edge key, or whose (non-root) edge exists with another child. A root block
        with a new engine hash gets a root edge of its own.
        """
        ehashes = u64_list(engine_hashes)
        locs = u64_list(local_hashes)
        p = u64_or_none(parent)
        n = min(len(ehashes), len(locs))
        with self._lock:
            rev = self._rev.get(worker, {})
            accepted = 0
            for ehash, local in zip(ehashes[:n], locs[:n], strict=False):
                key = (p, local) if p is not None else (None, local, ehash)
                mapped = rev.get(ehash)
                if mapped is not None and mapped != key:
                    break
                edge = self._edges.get(key)
                if edge is not None and edge.child != ehash:
                    break
                if edge is None:
                    edge = self._edges[key] = _Edge(ehash)
                    if p is None:
                        self._roots.setdefault(local, []).append(ehash)
                edge.owners.add(worker)
                rev[ehash] = key
                p = ehash
                accepted += 1
            if rev:
                self._rev[worker] = rev
            return accepted

    # -- queries (any thread) ------------------------------------------------------------
    def lookup_block(self, h: int) -> tuple[int | None, int] | None:
        """``(parent, local)`` of block ``h`` as the lowest worker id holding it maps it."""
        (block,) = u64_list([h])
        with self._lock:
            for w in sorted(self._rev):
                key = self._rev[w].get(block)
                if key is not None:
                    return key[0], key[1]
            return None

    def owners(self, parent: int | None, local: int) -> list[int]:
        """Owners of edge ``(parent, local)`` in increasing worker id (twin-only helper)."""
        with self._lock:
            return self._owners(u64_or_none(parent), int(local))

    def walk(
        self, worker: int, local_hashes, start: int, parent: int | None
    ) -> tuple[int, int | None]:
        """``(count, last_ehash)`` of the worker's contiguous run from ``(start, parent)``.

        Steps while edge ``(p, H[pos])`` exists and ``worker`` owns it (with ``p``
        None: the oldest root edge of ``H[pos]`` the worker owns); ``last_ehash`` is
        the last child walked, ``None`` when ``count`` is 0.
        """
        hs = u64_list(local_hashes)
        p = u64_or_none(parent)
        if start < 0:
            raise OverflowError("start must be non-negative")
        with self._lock:
            pos = start
            while pos < len(hs):
                if p is None:
                    child = self._root_of(hs[pos], worker)
                    if child is None:
                        break
                    p = child
                    pos += 1
                    continue
                edge = self._edges.get((p, hs[pos]))
                if edge is None or worker not in edge.owners:
                    break
                p = edge.child
                pos += 1
            count = max(0, pos - start)
            return count, (p if count else None)

    def parent_of(self, worker: int, h: int) -> int | None:
        """Parent engine hash of ``worker``'s block ``h`` (None for a root edge)."""
        with self._lock:
            key = self._rev.get(worker, {})[h]
            return key[0]

    def block_of(self, worker: int, h: int) -> tuple[int | None, int]:
        """(parent engine hash or None, local hash) of ``worker``'s block ``h``."""
        with self._lock:
            key = self._rev.get(worker, {})[h]
            return key[0], key[1]

    @property
    def total_blocks(self) -> int:
        """Sum over workers of the blocks each holds."""
        with self._lock:
            return sum(len(r) for r in self._rev.values())

    @property
    def num_edges(self) -> int:
        """Edges with at least one owner."""
        with self._lock:
            return len(self._edges)

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the twin does not account memory: always 0)."""
        return 0

    # -- dump ----------------------------------------------------------------------------
    def export_rows(self) -> list[tuple[int, int, int, int | None]]:
        """``[(worker, ehash, local, parent or None)]``, one per (edge, owner): the root
        edges first, in creation order per LocalBlockHash, then the others."""
        with self._lock:
            out: list[tuple[int, int, int, int | None]] = []
            for local, children in self._roots.items():
                for c in children:
                    for w in sorted(self._edges[(None, local, c)].owners):
                        out.append((w, c, local, None))
            for key, edge in self._edges.items():
                if key[0] is not None:
                    for w in sorted(edge.owners):
                        out.append((w, edge.child, key[1], key[0]))
            return out

    # -- testing aid ---------------------------------------------------------------------
    def _check_invariants(self) -> None:
        """Assert that ownership and the reverse maps agree (for tests)."""
        with self._lock:
            owned: dict[int, dict[int, EdgeKey]] = {}
            for key, edge in self._edges.items():
                assert edge.owners, "ownerless edge survived"
                for w in edge.owners:
                    assert edge.child not in owned.setdefault(w, {})
                    owned[w][edge.child] = key
            assert owned == {w: r for w, r in self._rev.items() if r}
