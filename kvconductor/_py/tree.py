"""HBM radix tree: the pure-Python twin of ``kvconductor._tree.RadixTree``.

Semantics: ``docs/design.md``, section "RadixTree (HBM)".

**Threading: exactly one writer thread calls** :meth:`RadixTree.store`,
:meth:`RadixTree.remove` **and** :meth:`RadixTree.clear`;
**any number of threads may call** :meth:`RadixTree.match` **and the
introspection members concurrently.** Every public method holds one
:class:`threading.Lock` for its whole duration (the compiled tree uses a
writer-preferring rwlock instead; this is a reference model, not a fast one).
"""

from __future__ import annotations

import threading

from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound

U64_MAX = 0xFFFFFFFFFFFFFFFF
U32_NIL = 0xFFFFFFFF  # "no row" in the dump tables (the root's parent)


def u64_list(values) -> list[int]:
    """A list of Python ints from a sequence of ints or a u64 buffer.

    Values outside ``[0, 2**64)`` raise :class:`OverflowError`, like the
    compiled modules' conversion to ``uint64_t``.
    """
    out = [int(v) for v in values]
    for v in out:
        if v < 0 or v > U64_MAX:
            raise OverflowError(f"hash {v} is not a u64")
    return out


def u64_or_none(value) -> int | None:
    """``None`` or one u64 value (see :func:`u64_list`)."""
    if value is None:
        return None
    return u64_list([value])[0]


class PerWorkerBlocks:
    """What the tree and a lower tier share: per worker a reverse map ``_rev``
    (engine hash -> the place holding it: tree node or edge key), and removal by
    engine hash through it. Subclasses set ``_lock`` and ``_rev`` and implement
    :meth:`_drop` (caller holds the lock)."""

    _lock: threading.Lock
    _rev: dict

    def _drop(self, worker: int, place) -> None:
        """Release ``worker``'s hold on ``place`` (already popped from its reverse map)."""
        raise NotImplementedError

    def _remove_locked(self, worker: int, hashes) -> int:
        rev = self._rev.get(worker)
        if not rev:
            return 0
        removed = 0
        for h in hashes:
            place = rev.pop(h, None)
            if place is None:
                continue  # unknown (or already removed earlier in this call)
            self._drop(worker, place)
            removed += 1
        if not rev:
            del self._rev[worker]
        return removed

    def remove(self, worker: int, hashes) -> int:
        """Remove the worker's blocks with these engine hashes; unknown ones are ignored.

        Returns the number removed.
        """
        hs = u64_list(hashes)
        with self._lock:
            return self._remove_locked(worker, hs)

    def clear(self, worker: int) -> int:
        """Remove every block of ``worker``; returns how many it held."""
        with self._lock:
            rev = self._rev.get(worker)
            if not rev:
                return 0
            return self._remove_locked(worker, list(rev))

    def hashes_of(self, worker: int) -> list[int]:
        """The engine hashes ``worker`` holds."""
        with self._lock:
            return list(self._rev.get(worker, ()))

    def worker_blocks(self, worker: int) -> int:
        """Number of blocks ``worker`` holds (``len(rev[worker])``)."""
        with self._lock:
            return len(self._rev.get(worker, ()))


class _Node:
    """One tree node: its content hash, its parent, children and members."""

    __slots__ = ("local", "parent", "children", "members")

    def __init__(self, local: int | None, parent: _Node | None) -> None:
        self.local = local
        self.parent = parent
        #: LocalBlockHash -> child node (the edges ``(self, local) -> child``).
        self.children: dict[int, _Node] = {}
        #: worker -> that worker's engine hash ("ehash") of this block.
        self.members: dict[int, int] = {}


class RadixTree(PerWorkerBlocks):
    """Prefix tree of LocalBlockHashes shared by all HBM workers.

    Node 0 (the root) has no content and no members. Every other node has one
    member per worker holding it, with that worker's own engine hash; per
    worker a reverse map ``ehash -> node`` gives O(1) parent lookup and removal.
    Empty nodes (no members, no children) are pruned by the mutation that
    empties them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root = _Node(None, None)
        #: worker -> {engine hash -> node}; invariant: rev[w][s] is n iff n.members[w] == s.
        self._rev: dict[int, dict[int, _Node]] = {}
        self._num_nodes = 0
        self._num_pairs = 0

    # -- internals (caller holds the lock) ---------------------------------------------
    def _prune(self, node: _Node) -> int:
        """Delete ``node`` and then its ancestors while they are empty leaves."""
        pruned = 0
        while node is not self._root and not node.members and not node.children:
            parent = node.parent
            assert parent is not None and node.local is not None  # only the root has neither
            del parent.children[node.local]
            node.parent = None
            self._num_nodes -= 1
            pruned += 1
            node = parent
        return pruned

    def _drop(self, worker: int, node: _Node) -> None:
        """Leave ``node`` (descendants other workers hold stay reachable); prune."""
        del node.members[worker]
        self._num_pairs -= 1
        self._prune(node)

    # -- mutations (writer thread) -------------------------------------------------------
    def store(self, worker: int, parent: int | None, engine_hashes, local_hashes) -> int:
        """Store a chain of blocks for ``worker`` under ``parent`` (or the root).

        Returns the number of blocks stored, ``min(len(engine_hashes),
        len(local_hashes))``. Raises :class:`ParentBlockNotFound` when
        ``parent`` is not a block of this worker and
        :class:`InvalidBlockSequence` when ``[parent] + engine_hashes``
        repeats a value; nothing is changed then.
        """
        ehashes = u64_list(engine_hashes)
        locs = u64_list(local_hashes)
        parent = u64_or_none(parent)
        n = min(len(ehashes), len(locs))
        if n == 0:
            return 0
        ehashes, locs = ehashes[:n], locs[:n]
        with self._lock:
            rev = self._rev.get(worker, {})
            if parent is not None and parent not in rev:
                raise ParentBlockNotFound(f"parent block {parent} not found for worker {worker}")
            chain = ([parent] if parent is not None else []) + ehashes
            if len(set(chain)) != len(chain):
                raise InvalidBlockSequence(f"block chain of worker {worker} repeats an engine hash")
            self._rev[worker] = rev
            node = rev[parent] if parent is not None else self._root
            for ehash, local in zip(ehashes, locs, strict=False):
                # 1. the edge (node, local), created empty when absent
                child = node.children.get(local)
                if child is None:
                    child = _Node(local, node)
                    node.children[local] = child
                    self._num_nodes += 1
                old = rev.get(ehash)
                # 3. membership of the child, with this block's engine hash
                cur = child.members.get(worker)
                if cur is None:
                    child.members[worker] = ehash
                    self._num_pairs += 1
                elif cur != ehash:
                    del rev[cur]
                    child.members[worker] = ehash
                # 4.
                rev[ehash] = child
                # 2. the worker held ``ehash`` on another node: leave it, prune from it.
                # Done after step 3 so that the prune can never delete ``child``:
                # ``child`` may be a memberless interior node whose only
                # descendant is ``old`` (see the report on design.md).
                if old is not None and old is not child:
                    self._drop(worker, old)
                node = child
            return n

    # -- queries (any thread) ------------------------------------------------------------
    def match(self, local_hashes) -> list[tuple[int, int, int]]:
        """``[(worker, depth, last_ehash)]`` sorted by worker.

        The candidates are the members of the node ``edge(root, H[0])``; a
        worker's depth counts the consecutive nodes from there on which it is a
        member, ``last_ehash`` is its own engine hash on the deepest of them.
        """
        hs = u64_list(local_hashes)
        with self._lock:
            if not hs:
                return []
            node = self._root.children.get(hs[0])
            if node is None:
                return []
            depth = dict.fromkeys(node.members, 1)
            last = dict(node.members)
            active = set(node.members)
            for h in hs[1:]:
                node = node.children.get(h)
                if node is None:
                    break
                active = {w for w in active if w in node.members}
                if not active:
                    break
                for w in active:
                    depth[w] += 1
                    last[w] = node.members[w]
            return [(w, depth[w], last[w]) for w in sorted(depth)]

    def parent_of(self, worker: int, h: int) -> int | None:
        """Engine hash of the parent of ``worker``'s ``h``; None at the root or when the
        worker no longer holds the parent. KeyError when it does not hold ``h``."""
        with self._lock:
            node = self._rev.get(worker, {})[h]
            parent = node.parent
            if parent is None or parent is self._root:
                return None
            return parent.members.get(worker)

    def block_of(self, worker: int, h: int) -> tuple[int | None, int]:
        """(:meth:`parent_of`, the local hash) of ``worker``'s ``h``; KeyError if not held."""
        with self._lock:
            node = self._rev.get(worker, {})[h]
            parent = node.parent
            p = None if parent is None or parent is self._root else parent.members.get(worker)
            assert node.local is not None  # a held block is never the root
            return p, node.local

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, root excluded."""
        with self._lock:
            return self._num_nodes

    @property
    def num_pairs(self) -> int:
        """Total (worker, block) memberships."""
        with self._lock:
            return self._num_pairs

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the twin does not account memory: always 0)."""
        return 0

    # -- dump and restore --------------------------------------------------------------
    def export_table(self) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """``(parents, locals, node, worker, ehash)``: the node table (parent row, U32_NIL
        under the root) with every parent before its children, and the member table."""
        parents: list[int] = []
        locs: list[int] = []
        mnode: list[int] = []
        mworker: list[int] = []
        mehash: list[int] = []
        with self._lock:
            stack: list[tuple[_Node, int]] = [(self._root, U32_NIL)]
            while stack:
                node, row = stack.pop()
                for local, child in node.children.items():
                    crow = len(parents)
                    parents.append(row)
                    locs.append(local)
                    for w, s in child.members.items():
                        mnode.append(crow)
                        mworker.append(w)
                        mehash.append(s)
                    stack.append((child, crow))
        return parents, locs, mnode, mworker, mehash

    def restore_table(self, parents, local_hashes, node, worker, ehash) -> int:
        """Add an :meth:`export_table` table; returns the members added. ValueError
        for a malformed table (see ``CoreIndex.restore_hbm``)."""
        pv, lv = [int(p) for p in parents], u64_list(local_hashes)
        nv, wv, ev = [int(n) for n in node], [int(w) for w in worker], u64_list(ehash)
        if len(lv) != len(pv) or len(wv) != len(nv) or len(ev) != len(nv):
            raise ValueError("HBM table: column lengths differ")
        with self._lock:
            rows: list[_Node] = []
            for i, (p, local) in enumerate(zip(pv, lv, strict=True)):
                if p == U32_NIL:
                    parent = self._root
                elif p < i:
                    parent = rows[p]
                else:
                    raise ValueError("HBM table: a parent row follows its child")
                child = parent.children.get(local)
                if child is None:
                    child = parent.children[local] = _Node(local, parent)
                    self._num_nodes += 1
                rows.append(child)
            for n, w, s in zip(nv, wv, ev, strict=True):
                if n >= len(rows):
                    raise ValueError("HBM table: a member's node row is out of range")
                rev = self._rev.setdefault(w, {})
                if s in rev or w in rows[n].members:
                    raise ValueError("HBM table: a worker holds a block twice")
                rows[n].members[w] = s
                rev[s] = rows[n]
                self._num_pairs += 1
            return len(nv)

    # -- testing aid ---------------------------------------------------------------------
    def _check_invariants(self) -> None:
        """Assert the structural invariants of design.md (for tests)."""
        with self._lock:
            nodes = 0
            pairs = 0
            stack = [self._root]
            seen: dict[int, dict[int, _Node]] = {}
            while stack:
                node = stack.pop()
                for local, child in node.children.items():
                    assert child.parent is node and child.local == local
                    assert child.members or child.children, "empty node survived"
                    nodes += 1
                    pairs += len(child.members)
                    for w, s in child.members.items():
                        assert s not in seen.setdefault(w, {}), "ehash on two nodes"
                        seen[w][s] = child
                    stack.append(child)
            assert not self._root.members
            assert nodes == self._num_nodes and pairs == self._num_pairs
            assert {w: r for w, r in self._rev.items() if r} == seen
            for w, r in self._rev.items():
                for s, node in r.items():
                    assert node.members.get(w) == s
