"""Differential tests: the compiled core against its pure-Python twins.

Hypothesis rule-based machines drive one compiled and one pure-Python object
with the same random interleaving of mutations and queries, over small
alphabets of engine hashes, local hashes and token blocks so that prefixes are
shared, engine hashes move between nodes and edges collide. Every step compares
the answers (return values or exception types); after every step the
introspection (stats without nbytes, worker_blocks of every worker, a few fixed
matches) must agree and both the twin's structural invariants and the C checker
(``check_invariants``: recounts, links, free lists, maps) must hold.

Some rules draw from the twin's current state (blocks a worker holds, hashes in
the two-phase maps) so that removals hit, chains extend held blocks and engine
hashes get re-announced elsewhere; uniform random hashes alone rarely do.
"""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys
import time
from array import array

import pytest

pytest.importorskip("kvconductor._index")
pytest.importorskip("kvconductor._tree")
pytest.importorskip("kvconductor._lower")
pytest.importorskip("kvconductor._shlock")

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvconductor import _arena, _encode, _index, _lower, _shlock, _tree
from kvconductor._hash import hash_blocks
from kvconductor._py import arena as py_arena
from kvconductor._py import index as py_index
from kvconductor._py import lower as py_lower
from kvconductor._py import rows as py_rows
from kvconductor._py import shlock as py_shlock
from kvconductor._py import tree as py_tree
from kvconductor._py.rows import v3_body
from kvconductor.index import DpHit, tier_walks, walk_counts

U64_MAX = 2**64 - 1

#: Examples per state machine; the CI sanitizer pass sets fewer (its build runs ~5x
#: slower, and what it looks for, memory errors, shows up in the first examples).
SETTINGS = settings(
    max_examples=int(os.environ.get("KVC_DIFFERENTIAL_EXAMPLES", "200")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Two u64s whose splitmix64 mixes share the low 32 bits (tests/test_tree.py): the compiled
# tree's tables give them the same fingerprint, as engine hashes and as LocalBlockHashes
# under the root, so only the key read back from the node tells them apart.
FP_TWINS = [85078, 177926]

# Engine hashes include 0 and 2**64-1 (sentinel-prone values in C hash maps).
SEQ_VALUES = [0, 1, 2, 3, 4, 5, 6, 7, U64_MAX] + FP_TWINS
SEQ = st.sampled_from(SEQ_VALUES)
PARENT = st.one_of(st.none(), SEQ)
SEQS = st.lists(SEQ, max_size=4)

# Token blocks of block size 2 over the tokens {0, 1}: 4 full blocks; their hashes
# (plus 0) are the local-hash alphabet, so token and hash paths land on the same edges.
BS = 2
TOKEN_BLOCK_HASHES = list(hash_blocks([0, 0, 0, 1, 1, 0, 1, 1], BS))
LOCAL = st.sampled_from(TOKEN_BLOCK_HASHES + [0] + FP_TWINS)
LOCALS = st.lists(LOCAL, max_size=4)
CHAIN = st.lists(st.tuples(SEQ, LOCAL), min_size=1, max_size=4)  # (seq, local) per block
QUERY = st.lists(LOCAL, max_size=6)
TOKENS = st.lists(st.sampled_from([0, 1]), max_size=9)  # odd lengths: partial blocks
BUF = st.booleans()  # pass a u64 buffer instead of a list

# Fixed queries checked after every step.
A_, B_, C_, D_ = TOKEN_BLOCK_HASHES
FIXED_QUERIES = [
    [A_, B_, C_, D_],
    [A_, A_, A_, A_],
    [B_, A_, B_, A_],
    [A_, B_, 0, D_, C_],
    [0, A_, B_],
    [D_, C_, B_, A_],
    [C_, D_, A_, B_],
]


# Long chains: past the C code's size thresholds, so that those branches are diffed
# too: _has_repeat switches from the pairwise scan to a hash set above 32 blocks, the
# HBM match and the lower-tier walks prefetch 32 blocks ahead, the lazy token cursor
# hashes in chunks of 16 and more. One fixed 80-block token pattern (over the same 4
# block hashes) whose prefixes are stored and queried, so long chains share prefixes.
LONG_BLOCKS = 80
LONG_TOKENS = [(i * 7 + i // 3) % 2 for i in range(BS * LONG_BLOCKS)]
LONG_LOCALS = list(hash_blocks(LONG_TOKENS, BS))
LONG_N = st.integers(33, LONG_BLOCKS)
LONG_BASE = st.sampled_from([1000, 5000])  # engine hashes base, base + 1, ...
FIXED_QUERIES.append(LONG_LOCALS)
# Many workers: more than 64 (the C offload applies pool waiters in batches of 64).
MANY = 70

#: What the compiled tree's wide-node paths saw during the machines' steps:
#: ``widened`` / ``narrowed`` (steps after which the tree had turned a member list wide /
#: a wide node back), ``word_walk`` (fixed matches whose first node many workers hold:
#: the match walks the bitmap word-wise). test_the_machines_take_the_wide_paths checks
#: that the rules reach them.
WIDE_SEEN: collections.Counter[str] = collections.Counter()
# tree_match walks a wide first node word-wise above this many members (_tree.pyx)
WORD_WALK_MEMBERS = 32


def note_wide(layout, first_holders):
    """Count what the tree (``layout``: its layout dict) went through, and check that a
    node of more than WORD_WALK_MEMBERS holders (``first_holders``, from the twin) is
    wide: with worker ids below 128 any node past 12 members is."""
    WIDE_SEEN["widened"] += layout["widened"] > 0
    WIDE_SEEN["narrowed"] += layout["narrowed"] > 0
    if first_holders > WORD_WALK_MEMBERS:
        assert layout["wide_nodes"] >= 1, (first_holders, layout)
        WIDE_SEEN["word_walk"] += 1


def long_chain(data, n, base):
    """Engine hashes base..base+n-1; sometimes one repeats an earlier one (InvalidBlockSequence
    on the HBM tree, found by the hash-set path above 32 blocks)."""
    seqs = [base + i for i in range(n)]
    if data.draw(st.booleans(), label="repeat"):
        j = data.draw(st.integers(1, n - 1), label="at")
        seqs[j] = seqs[data.draw(st.integers(0, j - 1), label="copy of")]
    return seqs


def long_query(data, n):
    """A prefix of LONG_LOCALS, sometimes with one block changed (workers drop off there)."""
    q = LONG_LOCALS[:n]
    if data.draw(st.booleans(), label="perturb"):
        q[data.draw(st.integers(0, n - 1), label="at")] = data.draw(LOCAL, label="local")
    return q


def buf(values, as_buffer: bool):
    return array("Q", values) if as_buffer else list(values)


def split(chain):
    return [s for s, _ in chain], [t for _, t in chain]


def outcome(fn, *args):
    """("ok", normalised result) or ("err", exception type name)."""
    try:
        r = fn(*args)
    except Exception as ex:
        return ("err", type(ex).__name__)
    if isinstance(r, list):
        r = [tuple(x) for x in r]
    elif isinstance(r, tuple):
        r = tuple(r)
    return ("ok", r)


def check_cut(cand, sel, omitted, k, rank):
    """``sel`` is the ``top_k`` cut of ``cand`` by its definition (docs/api.md, "top_k and
    instances"): all of them without ``k`` or with ``k`` at least their number; else
    exactly ``k`` in order, every row deeper than the k-th depth, the ones tied there left
    out counted by ``omitted`` and, with ``rank``, none of them before a kept tied row."""
    if k is None or k >= len(cand):
        assert sel == cand and omitted == 0
        return
    depth = {r: sum(r[1:]) for r in cand}
    kth = sorted(depth.values(), reverse=True)[k - 1]
    assert len(sel) == k and [r for r in cand if r in set(sel)] == sel
    assert all(depth[r] >= kth for r in sel)
    assert all(r in sel for r in cand if depth[r] > kth)
    left = [i for i, r in enumerate(cand) if depth[r] == kth and r not in sel]
    assert omitted == len(left)
    if rank is not None:
        kept = [i for i, r in enumerate(cand) if depth[r] == kth and r in sel]
        key = [(rank[r[0]], i) for i, r in enumerate(cand)]
        assert max(key[i] for i in kept) < min((key[i] for i in left), default=(9, 0))


class _Pair(RuleBasedStateMachine):
    """Calls the same method on ``self.c`` and ``self.py`` and compares.

    NOTE: Hypothesis orders rules by name and favours the first one while
    generating; destructive rules (clear) get names that do not sort first.
    """

    c = py = None

    def both(self, name, *args):
        got_c = outcome(getattr(self.c, name), *args)
        got_py = outcome(getattr(self.py, name), *args)
        assert got_c == got_py, f"{name}{args}: C {got_c} != py {got_py}"
        return got_py

    def held(self, w) -> list[int]:
        """Engine hashes ``w`` holds, from the twin."""
        return sorted(self.py._rev.get(w, {}))


# -- RadixTree -----------------------------------------------------------------------------------

TREE_NW = 4
TREE_WORKERS = st.integers(0, TREE_NW - 1)


class TreeMachine(_Pair):
    def __init__(self):
        super().__init__()
        self.c = _tree.RadixTree()
        self.py = py_tree.RadixTree()

    @rule(w=TREE_WORKERS, parent=PARENT, chain=CHAIN, b=BUF)
    def store(self, w, parent, chain, b):
        seqs, locs = split(chain)
        self.both("store", w, parent, buf(seqs, b), buf(locs, b))

    @rule(w=TREE_WORKERS, parent=PARENT, seqs=SEQS, locs=LOCALS)
    def store_ragged(self, w, parent, seqs, locs):
        self.both("store", w, parent, seqs, locs)

    @rule(w=TREE_WORKERS, data=st.data(), chain=CHAIN)
    def store_under_held(self, w, data, chain):
        held = self.held(w)
        parent = data.draw(st.sampled_from(held)) if held else None
        self.both("store", w, parent, *split(chain))

    @rule(w=TREE_WORKERS, data=st.data())
    def store_moving_held(self, w, data):
        # re-announce held engine hashes at other places: members move, nodes prune
        held = self.held(w)
        if not held:
            return
        seqs = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3, unique=True))
        locs = data.draw(st.lists(LOCAL, min_size=len(seqs), max_size=len(seqs)))
        parent = data.draw(st.one_of(st.none(), st.sampled_from(held)))
        self.both("store", w, parent, seqs, locs)

    @rule(w=TREE_WORKERS, data=st.data())
    def store_at_existing_node(self, w, data):
        # a chain through an existing node X (often memberless, or another worker's),
        # from a parent the worker holds on X's parent, reusing held engine hashes
        nodes = []
        stack = [self.py._root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            nodes.append(n)
        nodes = sorted(nodes[1:], key=lambda n: (n.local, sorted(n.members.items())))
        if not nodes:
            return
        x = nodes[data.draw(st.integers(0, len(nodes) - 1), label="node")]
        if x.parent is self.py._root:
            parent = None
        elif w in x.parent.members:
            parent = x.parent.members[w]
        else:
            return
        seq_pool = st.sampled_from(self.held(w) + SEQ_VALUES)
        seqs = data.draw(st.lists(seq_pool, min_size=1, max_size=3, unique=True))
        locs = [x.local] + data.draw(
            st.lists(LOCAL, min_size=len(seqs) - 1, max_size=len(seqs) - 1)
        )
        self.both("store", w, parent, seqs, locs)

    @rule(w=TREE_WORKERS, data=st.data())
    def move_held_to_ancestor(self, w, data):
        # re-announce a held block at the position of one of its ancestors (shorter
        # prefix); with interior removals the ancestor is often memberless
        rev = self.py._rev.get(w, {})
        held = [s for s in sorted(rev) if rev[s].parent is not self.py._root]
        if not held:
            return
        s = data.draw(st.sampled_from(held))
        ancestors = []
        a = rev[s].parent
        while a is not self.py._root:
            ancestors.append(a)
            a = a.parent
        x = ancestors[data.draw(st.integers(0, len(ancestors) - 1), label="ancestor")]
        if x.parent is self.py._root:
            parent = None
        elif w in x.parent.members:
            parent = x.parent.members[w]
        else:
            return
        self.both("store", w, parent, [s], [x.local])

    @rule(w=TREE_WORKERS, hashes=SEQS, b=BUF)
    def remove(self, w, hashes, b):
        self.both("remove", w, buf(hashes, b))

    @rule(w=TREE_WORKERS, data=st.data())
    def remove_held(self, w, data):
        held = self.held(w)
        if held:
            self.both(
                "remove", w, data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3))
            )

    @rule(w=TREE_WORKERS)
    def worker_cleared(self, w):
        self.both("clear", w)

    @rule(q=QUERY, b=BUF)
    def match(self, q, b):
        self.both("match", buf(q, b))

    @rule(
        w=st.one_of(TREE_WORKERS, st.integers(TREE_NW, MANY)),
        n=LONG_N,
        base=LONG_BASE,
        under=st.booleans(),
        data=st.data(),
    )
    def store_long_chain(self, w, n, base, under, data):
        # a long chain (from the root, or continuing one the worker holds) by one of
        # up to MANY workers: long shared paths with many members per node
        held = self.held(w)
        parent = data.draw(st.sampled_from(held)) if under and held else None
        self.both("store", w, parent, long_chain(data, n, base), LONG_LOCALS[:n])

    @rule(n=LONG_N, data=st.data(), b=BUF)
    def match_long(self, n, data, b):
        self.both("match", buf(long_query(data, n), b))

    @rule(
        k=st.integers(2, MANY),
        first=st.integers(0, MANY),
        n=st.integers(1, 4),
        own=st.booleans(),
        data=st.data(),
    )
    def many_hold_prefix(self, k, first, n, own, data):
        # k workers store the same prefix of [A, B, C, D] (own engine hashes or all the
        # same ones), and each a block of its own choosing after it: past a few dozen
        # holders a node's members become a bitmap (wide), and the match walks words
        locs = FIXED_QUERIES[0][:n]
        for i in range(k):
            w = (first + i) % (MANY + 1)
            base = 20_000 + (w * 10 if own else 0)
            seqs = [base + j for j in range(n)]
            self.both("store", w, None, seqs, locs)
            if data.draw(st.booleans(), label="continues"):
                self.both("store", w, seqs[-1], [base + 9], [data.draw(LOCAL, label="next")])

    @rule(data=st.data(), op=st.sampled_from(["first", "last", "clear"]))
    def many_leave(self, data, op):
        # a random set of the holders of many-holder prefixes leaves (their first or
        # last block removed, or everything cleared): wide nodes shrink, turn back
        # into member lists or a sole member
        ws = sorted(w for w in self.py._rev if self.py._rev[w])
        if not ws:
            return
        for w in data.draw(st.lists(st.sampled_from(ws), min_size=1, unique=True)):
            held = self.held(w)
            if op == "clear" or not held:
                self.both("clear", w)
            else:
                self.both("remove", w, [held[0] if op == "first" else held[-1]])

    @rule(k=st.integers(13, MANY), keep=st.integers(0, 7), data=st.data())
    def many_come_and_go(self, k, keep, data):
        # a node turns wide and back in one step: k workers store the first block of
        # [A, B, C, D], then all its holders but ``keep`` leave
        own = data.draw(st.booleans(), label="own")
        self.many_hold_prefix(k, data.draw(st.integers(0, MANY), label="first"), 1, own, data)
        self.many_leave_but(keep, data)

    @rule(keep=st.integers(0, 7), data=st.data())
    def many_leave_but(self, keep, data):
        # every holder of the first block of [A, B, C, D] but ``keep`` drops it: a wide
        # node turns back into a member list (a few kept) or a sole member (one kept)
        rows = self.py.match(FIXED_QUERIES[0][:1])
        if len(rows) <= keep:
            return
        stay = set(data.draw(st.permutations(rows), label="order")[:keep])
        for w, _, ehash in rows:
            if (w, 1, ehash) not in stay:
                self.both("remove", w, [ehash])

    @invariant()
    def agree(self):
        assert (self.c.num_nodes, self.c.num_pairs) == (self.py.num_nodes, self.py.num_pairs)
        for w in list(range(TREE_NW + 1)) + [64, MANY]:
            assert self.c.worker_blocks(w) == self.py.worker_blocks(w), w
        for q in FIXED_QUERIES:
            assert [tuple(r) for r in self.c.match(q)] == self.py.match(q), q
        note_wide(self.c.layout(), len(self.py.match(FIXED_QUERIES[0][:1])))
        self.py._check_invariants()
        self.c.check_invariants()


TestTreeDifferential = TreeMachine.TestCase
TestTreeDifferential.settings = SETTINGS


# -- LowerTier -----------------------------------------------------------------------------------

LOWER_NW = 4
LOWER_WORKERS = st.integers(0, LOWER_NW - 1)


class LowerMachine(_Pair):
    def __init__(self):
        super().__init__()
        self.c = _lower.LowerTier()
        self.py = py_lower.LowerTier()

    @rule(w=LOWER_WORKERS, parent=PARENT, chain=CHAIN, b=BUF)
    def store(self, w, parent, chain, b):
        seqs, locs = split(chain)
        self.both("store", w, parent, buf(seqs, b), buf(locs, b))

    @rule(w=LOWER_WORKERS, parent=PARENT, seqs=SEQS, locs=LOCALS)
    def store_ragged(self, w, parent, seqs, locs):
        self.both("store", w, parent, seqs, locs)

    @rule(w=LOWER_WORKERS, data=st.data(), chain=CHAIN)
    def store_under_held(self, w, data, chain):
        held = self.held(data.draw(LOWER_WORKERS))  # anyone's block as the parent
        parent = data.draw(st.sampled_from(held)) if held else None
        self.both("store", w, parent, *split(chain))

    @rule(w=LOWER_WORKERS, data=st.data())
    def store_moving_held(self, w, data):
        # a held engine hash under another key: the chain-stop rule
        held = self.held(w)
        if not held:
            return
        seqs = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3))
        locs = data.draw(st.lists(LOCAL, min_size=len(seqs), max_size=len(seqs)))
        self.both("store", w, data.draw(PARENT), seqs, locs)

    @rule(w=LOWER_WORKERS, hashes=SEQS, b=BUF)
    def remove(self, w, hashes, b):
        self.both("remove", w, buf(hashes, b))

    @rule(w=LOWER_WORKERS, data=st.data())
    def remove_held(self, w, data):
        held = self.held(w)
        if held:
            self.both(
                "remove", w, data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3))
            )

    @rule(w=LOWER_WORKERS)
    def worker_cleared(self, w):
        self.both("clear", w)

    @rule(w=LOWER_WORKERS, q=QUERY, start=st.integers(0, 4), parent=PARENT, b=BUF)
    def walk(self, w, q, start, parent, b):
        self.both("walk", w, buf(q, b), start, parent)

    @rule(h=SEQ)
    def lookup_block(self, h):
        self.both("lookup_block", h)

    @rule(
        w=st.one_of(LOWER_WORKERS, st.integers(LOWER_NW, MANY)),
        n=LONG_N,
        base=LONG_BASE,
        data=st.data(),
    )
    def store_long_chain(self, w, n, base, data):
        self.both("store", w, None, long_chain(data, n, base), LONG_LOCALS[:n])

    @rule(
        w=st.one_of(LOWER_WORKERS, st.just(MANY)),
        n=LONG_N,
        data=st.data(),
        start=st.sampled_from([0, 1, 40]),
        base=LONG_BASE,
    )
    def walk_long(self, w, n, data, start, base):
        # from the root, or from inside a long chain (parent = its engine hash there)
        parent = None if start == 0 else base + start - 1
        self.both("walk", w, long_query(data, n), start, parent)

    @invariant()
    def agree(self):
        assert (self.c.total_blocks, self.c.num_edges) == (self.py.total_blocks, self.py.num_edges)
        for w in range(LOWER_NW + 1):
            assert self.c.worker_blocks(w) == self.py.worker_blocks(w), w
            for q in FIXED_QUERIES:
                for start, parent in ((0, None), (1, 1), (2, 0)):
                    got = tuple(self.c.walk(w, q, start, parent))
                    assert got == self.py.walk(w, q, start, parent), (w, q, start, parent)
        for h in SEQ_VALUES:
            c = self.c.lookup_block(h)
            assert (None if c is None else tuple(c)) == self.py.lookup_block(h), h
        self.py._check_invariants()
        self.c.check_invariants()


TestLowerDifferential = LowerMachine.TestCase
TestLowerDifferential.settings = SETTINGS


# -- CoreIndex -----------------------------------------------------------------------------------

# 8 workers, 4 groups, all three tiers: (group, tier)
CORE_WORKERS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 1), (2, 2), (3, 0)]
CORE_W = st.integers(0, len(CORE_WORKERS) - 1)
# each TTL is long half the time so that one kind expires while the others survive
TTL = st.one_of(st.just(1000.0), st.sampled_from([0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))


# MANY more CPU/Disk workers (ids 8.., groups 4..6) that only wait for pool confirmations
# in bulk: the per-worker checks of ``agree`` stay on CORE_WORKERS, ``stats`` and the C
# checker cover these.
EXTRA_WORKERS = [(4 + k % 3, 1 + k % 2) for k in range(MANY)]
# and MANY_HBM HBM workers, each its own group, that hold the same prefixes in bulk: the
# tree's nodes many workers hold keep their members as a bitmap (wide nodes)
MANY_HBM = 40
HBM_WORKERS = [(7 + k, 0) for k in range(MANY_HBM)]
ALL_WORKERS = CORE_WORKERS + EXTRA_WORKERS + HBM_WORKERS
FIRST_HBM = len(CORE_WORKERS) + len(EXTRA_WORKERS)


def core_export(core):
    """Everything a dump holds of one core (``kvconductor.state.dump``)."""
    return (core.export_hbm(), core.export_tier(1), core.export_tier(2), core.export_twophase())


def canonical_export(exp):
    """An export as sorted lists: HBM members by their node's path of local hashes, tier
    rows, two-phase records and waits (row order may differ between the cores)."""
    (parents, locs, node, worker, ehash), cpu, disk, (records, waits) = exp
    paths: list[tuple[int, ...]] = []
    for p, loc in zip(parents, locs, strict=True):
        paths.append((paths[p] if p != 0xFFFFFFFF else ()) + (loc,))
    hbm = sorted((paths[n], w, e) for n, w, e in zip(node, worker, ehash, strict=True))
    tiers = [sorted(zip(*(list(c) for c in t), strict=True)) for t in (cpu, disk)]
    return hbm, tiers, sorted(records, key=repr), sorted(waits)


def core_restore(core, exp):
    hbm, cpu, disk, (records, waits) = exp
    core.restore_hbm(*hbm)
    core.restore_tier(1, *cpu)
    core.restore_tier(2, *disk)
    core.restore_twophase(records, waits)


def _answer_names():
    """The group names the answer forms are read through: every group of ALL_WORKERS, an
    instance's DP ranks not adjacent (group g: instance ``i{g % 3}``, DP g), in the
    compiled table and its twin."""
    out = (_encode.GroupNames(), py_rows.PyGroupNames())
    for g in range(max(gr for gr, _ in ALL_WORKERS) + 1):
        for names in out:
            names.add(f"i{g % 3}", g)
    return out


ANSWER_NAMES = _answer_names()


class CoreMachine(_Pair):
    def __init__(self):
        super().__init__()
        self.c = _index.CoreIndex()
        self.py = py_index.CoreIndex()
        for w, (g, tier) in enumerate(ALL_WORKERS):
            self.c.set_worker(w, g, tier)
            self.py.set_worker(w, g, tier)
        self.now = 0.0

    @rule(k=st.integers(60, MANY), chain=CHAIN, parent=PARENT, first=st.booleans())
    def many_waiters_then_offload(self, k, chain, parent, first):
        # > 64 pool workers wait for the same blocks, then the engine offload applies
        # them all (in C: in batches of 64); sometimes the offload came first
        seqs, locs = split(chain)
        if first:
            self.both("offload", seqs, locs, parent, self.now)
        for w in range(len(CORE_WORKERS), len(CORE_WORKERS) + k):
            self.both("pool_store", w, seqs, self.now)
        self.both("offload", seqs, locs, parent, self.now)

    @rule(w=CORE_W, n=LONG_N, base=LONG_BASE, data=st.data(), tokens=st.booleans())
    def store_long_chain(self, w, n, base, data, tokens):
        seqs = long_chain(data, n, base)
        if tokens:
            self.both("store_tokens", w, None, seqs, LONG_TOKENS[: BS * n], BS)
        else:
            self.both("store", w, None, seqs, LONG_LOCALS[:n])

    @rule(k=st.integers(2, MANY_HBM), n=st.integers(1, 4), own=st.booleans(), data=st.data())
    def many_hbm_hold_prefix(self, k, n, own, data):
        # k of the bulk HBM workers store the same prefix of [A, B, C, D], most with a
        # block of their own after it (the shape round-robin routing gives)
        locs = FIXED_QUERIES[0][:n]
        for w in range(FIRST_HBM, FIRST_HBM + k):
            base = 30_000 + (w * 10 if own else 0)
            seqs = [base + j for j in range(n)]
            self.both("store", w, None, seqs, locs)
            if data.draw(st.booleans(), label="continues"):
                self.both("store", w, seqs[-1], [base + 9], [data.draw(LOCAL, label="next")])

    @rule(data=st.data(), op=st.sampled_from(["remove", "evict", "clear"]))
    def many_hbm_leave(self, data, op):
        ws = [w for w in range(FIRST_HBM, len(ALL_WORKERS)) if self.py._tree._rev.get(w)]
        if not ws:
            return
        for w in data.draw(st.lists(st.sampled_from(ws), min_size=1, unique=True)):
            held = sorted(self.py._tree._rev[w])
            if op == "clear":
                self.both("clear", w)
            else:
                self.both(op, w, [held[data.draw(st.integers(0, len(held) - 1))]])

    @rule(k=st.integers(WORD_WALK_MEMBERS + 1, MANY_HBM), data=st.data())
    def many_hbm_match_wide(self, k, data):
        # more than WORD_WALK_MEMBERS workers hold the first block of [A, B, C, D], then
        # both cores answer it: a match walked word-wise whenever this rule runs, whatever
        # the other rules drew before it (test_the_machines_take_the_wide_paths)
        self.many_hbm_hold_prefix(k, data.draw(st.integers(1, 4), label="n"), True, data)
        for q in (FIXED_QUERIES[0][:1], FIXED_QUERIES[0]):
            assert [tuple(r) for r in self.c.match(q)] == self.py.match(q), q
        note_wide(self.c.hbm_layout(), len(self.py._tree.match(FIXED_QUERIES[0][:1])))

    @rule(k=st.integers(13, MANY_HBM), keep=st.integers(0, 7), data=st.data())
    def many_hbm_come_and_go(self, k, keep, data):
        # a node turns wide and back in one step: k bulk HBM workers store the first
        # block of [A, B, C, D], then all its holders but ``keep`` leave
        self.many_hbm_hold_prefix(k, 1, data.draw(st.booleans(), label="own"), data)
        self.many_hbm_leave_but(keep, data)

    @rule(keep=st.integers(0, 7), data=st.data())
    def many_hbm_leave_but(self, keep, data):
        # every holder of the first block of [A, B, C, D] but ``keep`` drops it (bulk and
        # core HBM workers alike): a wide node turns back into a list or a sole member
        rows = self.py._tree.match(FIXED_QUERIES[0][:1])
        if len(rows) <= keep:
            return
        stay = set(data.draw(st.permutations(rows), label="order")[:keep])
        for w, _, ehash in rows:
            if (w, 1, ehash) not in stay:
                self.both("remove", w, [ehash])

    @rule(data=st.data(), muted=st.booleans())
    def many_hbm_muted(self, data, muted):
        # some bulk HBM workers' sources go down (or come back): members of a wide node
        # that give no hits
        ws = st.lists(st.integers(FIRST_HBM, len(ALL_WORKERS) - 1), min_size=1, unique=True)
        for w in data.draw(ws, label="workers"):
            self.both("set_muted", w, muted)

    @rule(n=LONG_N, base=LONG_BASE)
    def offload_long_chain(self, n, base):
        self.both("offload", [base + i for i in range(n)], LONG_LOCALS[:n], None, self.now)

    @rule(n=LONG_N, data=st.data(), odd=st.booleans())
    def match_long(self, n, data, odd):
        self.both("match", long_query(data, n))
        self.both("match_tokens", LONG_TOKENS[: BS * n - odd], BS)

    def held(self, w):
        tier = CORE_WORKERS[w][1]
        t = self.py._tree if tier == 0 else self.py._tiers[tier]
        return sorted(t._rev.get(w, {}))

    def in_flight(self):
        return sorted(set(self.py._offload) | set(self.py._content) | set(self.py._pending))

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, dt):
        self.now += dt

    @rule(w=CORE_W, muted=st.booleans())
    def set_muted(self, w, muted):
        # a down source's workers: blocks kept and updated, no hits until unmuted
        self.both("set_muted", w, muted)
        self.both("is_muted", w)

    # direct stores / removals
    @rule(w=CORE_W, parent=PARENT, chain=CHAIN, b=BUF)
    def store(self, w, parent, chain, b):
        seqs, locs = split(chain)
        self.both("store", w, parent, buf(seqs, b), buf(locs, b))

    @rule(w=CORE_W, parent=PARENT, seqs=SEQS, locs=LOCALS)
    def store_ragged(self, w, parent, seqs, locs):
        self.both("store", w, parent, seqs, locs)

    @rule(w=CORE_W, data=st.data(), chain=CHAIN)
    def store_under_held(self, w, data, chain):
        held = self.held(data.draw(CORE_W))  # often another tier's block
        parent = data.draw(st.sampled_from(held)) if held else None
        self.both("store", w, parent, *split(chain))

    @rule(
        w=CORE_W, data=st.data(), seqs=st.lists(SEQ, min_size=1, max_size=4), tokens=TOKENS, tb=BUF
    )
    def store_tokens(self, w, data, seqs, tokens, tb):
        held = self.held(w)
        parent = data.draw(st.one_of(st.none(), st.sampled_from(held))) if held else None
        toks = array("I", tokens) if tb else tokens
        self.both("store_tokens", w, parent, seqs, toks, BS)

    @rule(w=CORE_W, hashes=SEQS, b=BUF, op=st.sampled_from(["remove", "evict"]))
    def remove_or_evict(self, w, hashes, b, op):
        self.both(op, w, buf(hashes, b))

    @rule(w=CORE_W, data=st.data(), op=st.sampled_from(["remove", "evict"]))
    def remove_or_evict_held(self, w, data, op):
        held = self.held(w)
        if held:
            self.both(op, w, data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3)))

    @rule(w=CORE_W, data=st.data(), a_waiter=st.booleans())
    def worker_cleared(self, w, data, a_waiter):
        pairs = self.waiters()
        if a_waiter and pairs:
            w = data.draw(st.sampled_from(pairs))[1]
        self.both("clear", w)

    # two-phase
    @rule(chain=CHAIN, parent=PARENT, b=BUF)
    def offload(self, chain, parent, b):
        seqs, locs = split(chain)
        self.both("offload", buf(seqs, b), buf(locs, b), parent, self.now)

    @rule(w=CORE_W, hashes=SEQS, b=BUF)
    def pool_store(self, w, hashes, b):
        self.both("pool_store", w, buf(hashes, b), self.now)

    @rule(w=CORE_W, chain=CHAIN, parent=PARENT)
    def offload_then_pool(self, w, chain, parent):
        seqs, locs = split(chain)
        self.both("offload", seqs, locs, parent, self.now)
        self.both("pool_store", w, seqs, self.now)

    @rule(ws=st.lists(CORE_W, min_size=1, max_size=3), chain=CHAIN, parent=PARENT)
    def pool_then_offload(self, ws, chain, parent):
        seqs, locs = split(chain)
        for w in ws:
            self.both("pool_store", w, seqs, self.now)
        self.both("offload", seqs, locs, parent, self.now)

    @rule(w=CORE_W, data=st.data(), op=st.sampled_from(["pool_store", "evict"]))
    def two_phase_key_in_flight(self, w, data, op):
        # confirm or remove hashes that sit in offload / content / pending
        keys = self.in_flight()
        if keys:
            hashes = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3))
            if op == "pool_store":
                self.both(op, w, hashes, self.now)
            else:
                self.both(op, w, hashes)

    @rule(w=CORE_W, data=st.data())
    def pool_store_held_elsewhere(self, w, data):
        # promotion: confirm a hash some tier holds (lookup_block / content paths)
        held = self.held(data.draw(CORE_W))
        if held:
            self.both(
                "pool_store",
                w,
                data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3)),
                self.now,
            )

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0]), pending=TTL, content=TTL, offload=TTL)
    def maintenance(self, dt, pending, content, offload):
        self.now += dt
        self.both("sweep", self.now, pending, content, offload)

    @rule(
        data=st.data(),
        kind=st.sampled_from(["pending", "content", "offload"]),
        d=st.sampled_from([-0.25, 0.0, 0.25]),
    )
    def sweep_at_an_age(self, data, kind, d):
        # a TTL at (or just around) the age of an existing entry of one kind
        if kind == "pending":
            times = [t for waiters in self.py._pending.values() for t in waiters.values()]
        else:
            times = [t for _, _, t in getattr(self.py, "_" + kind).values()]
        if not times:
            return
        ttl = self.now - data.draw(st.sampled_from(sorted(times))) + d
        ttls = {"pending": 1000.0, "content": 1000.0, "offload": 1000.0, kind: ttl}
        self.both("sweep", self.now, ttls["pending"], ttls["content"], ttls["offload"])

    def waiters(self):
        return sorted((h, w) for h, ws in self.py._pending.items() for w in ws)

    @rule(data=st.data(), w=st.one_of(st.none(), CORE_W), local=LOCAL)
    def store_pending_hash(self, data, w, local):
        # a hash somebody waits for shows up in a tier through a direct store
        # (of the waiter itself when w is None)
        pairs = self.waiters()
        if pairs:
            h, waiter = data.draw(st.sampled_from(pairs))
            self.both("store", waiter if w is None else w, None, [h], [local])

    @rule(data=st.data())
    def evict_by_waiter(self, data):
        # the waiter's own removal of a hash it waits for
        pairs = self.waiters()
        if pairs:
            h, w = data.draw(st.sampled_from(pairs))
            self.both("evict", w, [h])

    # queries
    @rule(q=QUERY, b=BUF)
    def match(self, q, b):
        self.both("match", buf(q, b))

    @rule(tokens=TOKENS, tb=BUF)
    def match_tokens(self, tokens, tb):
        toks = array("I", tokens) if tb else tokens
        self.both("match_tokens", toks, BS)

    @rule(q=QUERY, b=BUF)
    def hbm_reach(self, q, b):
        # one worker's depth on the query's path (the predictions' confirmation): each
        # worker's, equal in both cores and to its match depth (0 off HBM)
        for w in range(len(CORE_WORKERS)):
            got = self.both("hbm_reach", w, buf(q, b))
            hits = {hw: d for hw, d, _ in self.py._tree.match(list(q))}
            assert got == ("ok", hits.get(w, 0) if self.py._tier_of(w) == 0 else 0), (w, q)

    # answers: the compact rows of both cores, and their selection (an instances filter as a
    # group mask or as ranks, then top_k), also against the definition: at most k rows,
    # every row deeper than the k-th depth, and the rows tied there chosen by rank (then
    # order) with ranks, else a run of them from the seed's start
    @rule(
        q=QUERY,
        b=BUF,
        tokens=TOKENS,
        k=st.one_of(st.none(), st.integers(1, 5)),
        keep=st.one_of(st.none(), st.sets(st.integers(0, 7))),
        seed=st.integers(0, 2**64 - 1),
        rank=st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=7)),
    )
    def answer_rows(self, q, b, tokens, k, keep, seed, rank):
        mask = None if keep is None else bytes(int(g in keep) for g in range(6))
        ranks = None if rank is None else array("I", rank)
        for name, args in (("match_rows", (buf(q, b),)), ("match_tokens_rows", (tokens, BS))):
            rc, rp = (getattr(core, name)(*args) for core in (self.c, self.py))
            assert rc.tolist() == rp.tolist() == getattr(self.py, name[:-5])(*args), args
            assert rc.sums() == rp.sums() and rc.last_group() == rp.last_group()
            got = rc.select(k, mask, seed, ranks)
            sel = got.tolist()
            twin = rp.select(k, mask, seed, rank)
            assert (sel, got.omitted) == (twin.tolist(), twin.omitted), (args, k, keep)
            cand = [
                r
                for r in rc.tolist()
                if (mask is None or (r[0] < len(mask) and mask[r[0]]))
                and (rank is None or (r[0] < len(rank) and rank[r[0]]))
            ]
            check_cut(cand, sel, got.omitted, k, rank)
            # the answer read in Python (docs/api.md, "Reading an answer in Python"): the
            # C-made forms, the twin's, and the definition from the selected rows
            keys = ANSWER_NAMES[0].keys
            want = (
                {keys[g]: n + c + d for g, n, c, d in sel},
                [(*keys[g], n, c, d) for g, n, c, d in sel],
            )
            for rows in (got, twin):
                for names in ANSWER_NAMES:
                    assert (rows.scores(names), rows.tuples(names)) == want
                    assert rows.hits(names, DpHit) == want[1]
                    assert rows.v3(names, "t", BS) == v3_body(
                        ((i, str(d), n, c, k_) for i, d, n, c, k_ in want[1]), "t", BS
                    )

    # explain: the trace of both cores agrees, and its per-group counts are match's
    def traced(self, q):
        got = self.both("trace", q)
        assert got[0] == "ok"
        placement = dict(enumerate(ALL_WORKERS))
        counts = {g: walk_counts(w) for g, w in tier_walks(got[1], placement).items()}
        assert [(g, *c) for g, c in sorted(counts.items()) if sum(c)] == self.py.match(q), q

    @rule(q=QUERY, b=BUF)
    def trace(self, q, b):
        self.traced(buf(q, b))

    @rule(n=LONG_N, data=st.data(), odd=st.booleans())
    def trace_long(self, n, data, odd):
        self.traced(long_query(data, n))
        self.both("trace_tokens", LONG_TOKENS[: BS * n - odd], BS)

    @rule(tokens=TOKENS, tb=BUF)
    def trace_tokens(self, tokens, tb):
        self.both("trace_tokens", array("I", tokens) if tb else tokens, BS)

    # dump and restore (kvconductor.state.dump): the exports agree; an export restored into a
    # fresh core (compiled or twin, from either side) answers and counts like the original
    @rule(data=st.data())
    def export_then_restore(self, data):
        ec, ep = core_export(self.c), core_export(self.py)
        assert canonical_export(ec) == canonical_export(ep)
        queries = FIXED_QUERIES + [data.draw(QUERY) for _ in range(3)]
        want_stats = dict(self.py.stats(), nbytes=None)
        for exp, fresh in (
            (ec, py_index.CoreIndex()),
            (ep, _index.CoreIndex()),
            (ec, _index.CoreIndex()),
        ):
            for w, (g, tier) in enumerate(ALL_WORKERS):
                fresh.set_worker(w, g, tier)
                # mutes are runtime state, not in a dump: the service derives them again
                # from its sources (SubscriptionManager.check_sources)
                fresh.set_muted(w, self.py.is_muted(w))
            core_restore(fresh, exp)
            assert dict(fresh.stats(), nbytes=None) == want_stats
            for q in queries:
                assert [tuple(r) for r in fresh.match(q)] == self.py.match(q), q
            assert canonical_export(core_export(fresh)) == canonical_export(ep)
            getattr(fresh, "check_invariants", getattr(fresh, "_check_invariants", None))()
            if isinstance(fresh, _index.CoreIndex):
                fresh.close()  # shared mode (SharedCoreMachine): its arena blocks go back

    @invariant()
    def agree(self):
        sc, sp = dict(self.c.stats()), dict(self.py.stats())
        sc.pop("nbytes")
        sp.pop("nbytes")
        assert sc == sp
        for w in range(len(CORE_WORKERS)):
            assert self.c.worker_blocks(w) == self.py.worker_blocks(w), w
            held = sorted(self.c.worker_hashes(w))
            assert held == sorted(self.py.worker_hashes(w)) == self.held(w), w
            for h in held:
                assert self.c.parent_of(w, h) == self.py.parent_of(w, h), (w, h)
                assert self.c.block_of(w, h) == self.py.block_of(w, h), (w, h)
                assert self.c.block_of(w, h)[0] == self.c.parent_of(w, h)
            for h in (0, 1 << 63):
                if h not in held:
                    assert outcome(self.c.parent_of, w, h) == outcome(self.py.parent_of, w, h)
                    assert outcome(self.c.block_of, w, h) == outcome(self.py.block_of, w, h)
        for q in FIXED_QUERIES:
            assert [tuple(r) for r in self.c.match(q)] == self.py.match(q), q
            self.traced(q)
        note_wide(self.c.hbm_layout(), len(self.py._tree.match(FIXED_QUERIES[0][:1])))
        self.py._check_invariants()
        self.c.check_invariants()


TestCoreDifferential = CoreMachine.TestCase
TestCoreDifferential.settings = SETTINGS


@pytest.mark.parametrize("machine", [TreeMachine, CoreMachine])
def test_the_machines_take_the_wide_paths(machine):
    """The rules reach the compiled tree's wide nodes: lists turning wide and back, and
    matches whose first node is walked word-wise (a fixed, derandomized run)."""
    WIDE_SEEN.clear()
    run_state_machine_as_test(
        machine,
        settings=settings(SETTINGS, max_examples=min(SETTINGS.max_examples, 40), derandomize=True),
    )
    assert WIDE_SEEN["widened"] and WIDE_SEEN["narrowed"] and WIDE_SEEN["word_walk"], WIDE_SEEN


class SharedCoreMachine(CoreMachine):
    """``CoreMachine`` with the compiled core in shared mode (``--workers N``): every
    structure block comes from an arena (grown, shrunk and reused by the same rules),
    every write takes the shared lock too, and a read-only handle attached to the same
    state (what a worker process builds) answers every fixed query like the twin. At
    the end the core is closed and the arena holds no block: nothing leaked."""

    def __init__(self):
        address = 0x2C0000000000 + (next(_arena_slots) % 1024) * (1 << 30)
        self.arena = _arena.Arena(reserve=1 << 30, address=address)
        self.lock = _shlock.SharedLock()
        _index.install_shared(self.arena, self.lock)
        super().__init__()
        gen = self.arena.address + _arena.OPAQUE_OFFSET
        self.view = _index.attach_core(self.c.address(), self.lock, gen, 0)

    def teardown(self):
        try:
            self.c.close()
            self.arena.check_invariants()
            assert self.arena.stats()["live_blocks"] == 0, "arena blocks left after close"
            assert _index._arena_leaks() == 0
        finally:
            _index.install_shared(None, None)
            self.arena.close()

    @invariant()
    def attached_view_agrees(self):
        assert self.c.address() == self.view.address()
        for q in FIXED_QUERIES:
            assert [tuple(r) for r in self.view.match(q)] == self.py.match(q), q
        assert dict(self.view.stats()) == dict(self.c.stats())


TestSharedCoreDifferential = SharedCoreMachine.TestCase
TestSharedCoreDifferential.settings = SETTINGS


# -- Arena allocator -----------------------------------------------------------------------------

ARENA_RESERVE = 16 << 20  # small: exhaustion (malloc returning 0) is reached too
ARENA_SIZES = st.one_of(
    st.integers(0, 200),
    st.integers(0, 70_000),
    st.integers((1 << 20) - 100, 5 << 20),  # runs, around the largest class too
)
_arena_slots = itertools.count()


def _pattern(tag: int, n: int) -> bytes:
    return (tag.to_bytes(8, "little") * 4)[:n]


class ArenaMachine(RuleBasedStateMachine):
    """``_arena.Arena`` against ``_py.arena.ArenaModel``: the same offsets and stats
    after every call; data written into each live block (a tagged pattern at its head
    and tail) survives every other call."""

    def __init__(self):
        super().__init__()
        address = 0x280000000000 + (next(_arena_slots) % 1024) * (1 << 30)
        self.c = _arena.Arena(reserve=ARENA_RESERVE, address=address)
        self.py = py_arena.ArenaModel(ARENA_RESERVE)
        self.live: dict[int, tuple[int, int]] = {}  # offset -> (requested size, tag)
        self.tags = itertools.count(1)

    def teardown(self):
        self.c.close()

    def _fill(self, o: int, n: int) -> None:
        tag = next(self.tags)
        self.live[o] = (n, tag)
        head = _pattern(tag, n)
        self.c.write(self.c.address + o, head)
        if n >= 2 * len(head):
            self.c.write(self.c.address + o + n - len(head), head)

    def _verify(self, o: int, n: int, tail: bool = True) -> None:
        tag = self.live[o][1]
        head = _pattern(tag, n)
        assert self.c.read(self.c.address + o, len(head)) == head, hex(o)
        if tail and n >= 2 * len(head):
            assert self.c.read(self.c.address + o + n - len(head), len(head)) == head, hex(o)

    def _off(self, addr: int) -> int:
        return addr - self.c.address if addr else 0

    @rule(n=ARENA_SIZES)
    def malloc(self, n):
        got = self._off(self.c.malloc(n))
        assert got == self.py.malloc(n), n
        if got:
            assert got not in self.live
            self._fill(got, n)

    @rule(data=st.data())
    def free(self, data):
        if not self.live:
            return
        o = data.draw(st.sampled_from(sorted(self.live)))
        self._verify(o, self.live[o][0])
        self.c.free(self.c.address + o)
        self.py.free(o)
        del self.live[o]

    @rule(data=st.data(), n=ARENA_SIZES)
    def realloc(self, data, n):
        if not self.live:
            return
        self._realloc(data.draw(st.sampled_from(sorted(self.live))), n)

    def _realloc(self, o, n):
        old_n = self.live[o][0]
        got = self._off(self.c.realloc(self.c.address + o, n))
        assert got == self.py.realloc(o, n), (o, n)
        if not got:
            self._verify(o, old_n)  # a failed realloc leaves the block as it was
            return
        tag = self.live.pop(o)[1]
        self.live[got] = (min(old_n, n), tag)
        self._verify(got, min(old_n, n), tail=False)  # the contents moved with the block
        del self.live[got]
        self._fill(got, n)

    @rule(data=st.data(), more=st.integers(1, 300_000))
    def grow(self, data, more):
        # a block grown a little (what grow_array does): a run grows in place when the
        # free run above it has room or it ends at top, else it moves
        if self.live:
            o = data.draw(st.sampled_from(sorted(self.live)))
            self._realloc(o, self.live[o][0] + more)

    @invariant()
    def agree(self):
        sc = self.c.stats()
        sc.pop("punched")
        assert sc == self.py.stats()
        self.c.check_invariants()
        for o, (n, _) in self.live.items():
            self._verify(o, n)


TestArenaDifferential = ArenaMachine.TestCase
TestArenaDifferential.settings = SETTINGS


# -- SharedLock (the cross-process lock's slot table) --------------------------------------------

# Slot owners: this process (alive), this pid with another start time (a reused pid:
# dead), a pid beyond pid_max (dead). Both sides judge liveness for themselves.
_ME = os.getpid()
OWNERS = st.sampled_from(
    [(_ME, py_shlock.proc_stamp(_ME)), (_ME, py_shlock.proc_stamp(_ME) + 1), (2**30, 1), (0, 0)]
)
LOCK_SLOTS = st.integers(-1, 6)


class SharedLockMachine(RuleBasedStateMachine):
    """Single-threaded steps of the compiled lock and its twin; after each, the slot
    table, writer flag and counters agree."""

    def __init__(self):
        super().__init__()
        self.c = _shlock.SharedLock()
        self.py = py_shlock.SharedLockModel()

    def both(self, c_name, py_name, *args):
        got_c = getattr(self.c, c_name)(*args)
        got_py = getattr(self.py, py_name)(*args)
        assert got_c == got_py, f"{py_name}{args}: C {got_c} != py {got_py}"

    @rule(owner=OWNERS)
    def acquire(self, owner):
        self.both("_acquire_for_test", "acquire", *owner)

    @rule(slot=LOCK_SLOTS)
    def release(self, slot):
        self.both("_release_for_test", "release", slot)

    @rule(slot=LOCK_SLOTS)
    def read_try(self, slot):
        self.both("_read_try_for_test", "read_try", slot)

    @rule(slot=LOCK_SLOTS)
    def read_exit(self, slot):
        self.both("_read_exit_for_test", "read_exit", slot)

    @rule()
    def write_begin(self):
        self.both("_write_begin_for_test", "write_begin")

    @rule()
    def write_pending(self):
        self.both("_write_pending_for_test", "write_pending")

    @rule()
    def write_yield(self):
        self.both("_write_yield_for_test", "write_yield")

    @rule()
    def write_prefer(self):
        self.both("_write_prefer_for_test", "write_prefer")

    @rule()
    def write_exit(self):
        self.both("_write_exit_for_test", "write_exit")

    @rule()
    def reclaim_dead(self):
        self.both("reclaim_dead", "reclaim_dead")

    @invariant()
    def same_state(self):
        assert self.c.stats() == self.py.stats()
        for i in range(_shlock.SLOTS):
            assert self.c._slot_for_test(i) == self.py.slot(i), i


def test_shlock_codes_and_stamp_match_the_twin():
    assert (_shlock.OK, _shlock.EBUSY, _shlock.EINVAL, _shlock.EAGAIN, _shlock.SLOTS) == (
        py_shlock.OK,
        py_shlock.EBUSY,
        py_shlock.EINVAL,
        py_shlock.EAGAIN,
        py_shlock.SLOTS,
    )
    assert _shlock.proc_stamp(_ME) == py_shlock.proc_stamp(_ME) > 0
    assert _shlock.proc_stamp(2**30) == py_shlock.proc_stamp(2**30) == 0
    for pid, stamp in [(_ME, 0), (_ME, py_shlock.proc_stamp(_ME)), (_ME, 1), (2**30, 0)]:
        assert _shlock.owner_alive(pid, stamp) == py_shlock.owner_alive(pid, stamp)


def test_shlock_zombie_is_dead_for_both():
    """A child killed and not reaped: both sides call it dead once its threads exited."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stamp = py_shlock.proc_stamp(child.pid)
        assert _shlock.owner_alive(child.pid, stamp) and py_shlock.owner_alive(child.pid, stamp)
        child.kill()
        deadline = time.monotonic() + 10
        while _shlock.owner_alive(child.pid, stamp):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert not py_shlock.owner_alive(child.pid, stamp)
    finally:
        child.kill()
        child.wait()


TestSharedLockDifferential = SharedLockMachine.TestCase
TestSharedLockDifferential.settings = SETTINGS
