"""LowerTier (CPU / Disk): the reference's lower-tier tests plus the design.md semantics.

Edges are keyed by (parent engine hash | None, LocalBlockHash); expected values
are worked out by hand from docs/design.md "LowerTier (CPU, Disk)".
"""

from array import array

import pytest

from kvconductor._hash import hash_blocks

A, B, C = 1, 2, 3


def counters(lt):
    return lt.total_blocks, lt.num_edges


# -- the reference's lower-tier tests -------------------------------------------------------


def test_root_chain_full_match(LowerTier):
    lt = LowerTier()
    assert lt.store(A, None, [101, 102], [1, 2]) == 2
    # (None,1)->101, (101,2)->102, both owned by A
    assert lt.walk(A, [1, 2], 0, None) == (2, 102)


def test_mid_chain_continuation_from_parent(LowerTier):
    lt = LowerTier()
    # a tail chained after engine hash 999 that this tier does not hold
    assert lt.store(A, 999, [201, 202], [3, 4]) == 2
    count, last = lt.walk(A, [1, 2, 3, 4], 2, 999)
    assert (count, last) == (2, 202)
    assert 2 + count == 4  # end
    # from the root there is nothing
    assert lt.walk(A, [1, 2, 3, 4], 0, None) == (0, None)


def test_remove_breaks_contiguous_walk(LowerTier):
    lt = LowerTier()
    lt.store(A, None, [101, 102, 103], [1, 2, 3])
    assert lt.remove(A, [102]) == 1
    # edge (101,2) is gone: the walk stops after the first block
    assert lt.walk(A, [1, 2, 3], 0, None) == (1, 101)
    assert counters(lt) == (2, 2)


def test_shared_edge_remove_preserves_other_owner(LowerTier):
    lt = LowerTier()
    lt.store(A, None, [101, 102], [1, 2])
    lt.store(B, None, [101, 102], [1, 2])
    assert counters(lt) == (4, 2)  # two edges, two owners each
    assert lt.remove(A, [101, 102]) == 2
    assert lt.walk(A, [1, 2], 0, None) == (0, None)
    assert lt.walk(B, [1, 2], 0, None) == (2, 102)
    assert counters(lt) == (2, 2)


# -- store chain-stop rules -----------------------------------------------------------------


def test_root_blocks_with_other_engine_hashes_get_their_own_root_edge(LowerTier):
    """Engines seeded differently give the same first block different engine hashes
    (vLLM 0.10.2-0.28 draw NONE_HASH at random). Each keeps its own root chain: the
    reference's first-writer-wins root edge hid B's CPU copy entirely."""
    lt = LowerTier()
    lt.store(A, None, [101, 102], [1, 2])
    assert lt.store(B, None, [201, 202], [1, 2]) == 2
    assert lt.worker_blocks(B) == 2
    # 4 edges: root (1)->101 and (1)->201, then (101,2) and (201,2); 4 (worker, block) pairs
    assert counters(lt) == (4, 4)
    assert lt.walk(A, [1, 2, 3], 0, None) == (2, 102)
    assert lt.walk(B, [1, 2, 3], 0, None) == (2, 202)
    assert lt.lookup_block(201) == (None, 1)
    # B drops its root block: A's root edge and B's now-orphaned tail are unaffected
    assert lt.remove(B, [201]) == 1
    assert lt.walk(A, [1, 2], 0, None) == (2, 102)
    assert lt.walk(B, [1, 2], 0, None) == (0, None)
    assert counters(lt) == (3, 3)


def test_store_stops_on_edge_with_other_child(LowerTier):
    lt = LowerTier()
    lt.store(A, 100, [101], [1])
    # B's first block wants edge (100,1) with child 201, but its child is 101: nothing accepted
    assert lt.store(B, 100, [201, 202], [1, 2]) == 0
    assert lt.worker_blocks(B) == 0
    assert counters(lt) == (1, 1)


def test_store_stops_midway_on_edge_with_other_child(LowerTier):
    lt = LowerTier()
    lt.store(A, 101, [102], [2])
    # B: (None,1)->101 accepted, then (101,2) exists with child 102 != 202: stop
    assert lt.store(B, None, [101, 202, 203], [1, 2, 3]) == 1
    assert lt.worker_blocks(B) == 1
    assert lt.walk(B, [1, 2, 3], 0, None) == (1, 101)


def test_store_stops_when_seq_mapped_under_other_key(LowerTier):
    lt = LowerTier()
    lt.store(A, None, [101, 102], [1, 2])
    # A maps 102 to (101,2); the same seq under (None,5) stops the chain at once
    assert lt.store(A, None, [102], [5]) == 0
    # (None,7) new -> accepted; then key (301,1) but A maps 101 to (None,1): stop
    assert lt.store(A, None, [301, 101], [7, 1]) == 1
    assert lt.worker_blocks(A) == 3
    assert counters(lt) == (3, 3)
    assert lt.walk(A, [1, 2], 0, None) == (2, 102)
    assert lt.walk(A, [7, 1], 0, None) == (1, 301)


def test_store_repeated_seq_in_chain_stops_without_raising(LowerTier):
    lt = LowerTier()
    # block 0: (None,1)->5; block 1: key (5,1) but A maps 5 to (None,1): stop
    assert lt.store(A, None, [5, 5], [1, 1]) == 1
    assert counters(lt) == (1, 1)


def test_store_unknown_parent_is_fine(LowerTier):
    lt = LowerTier()
    # no parent validation in lower tiers
    assert lt.store(A, 424242, [1001], [1]) == 1
    assert lt.walk(A, [1], 0, 424242) == (1, 1001)


def test_store_is_idempotent(LowerTier):
    lt = LowerTier()
    assert lt.store(A, None, [101, 102], [1, 2]) == 2
    # the same chain again: every block maps to its own key and child -> accepted again
    assert lt.store(A, None, [101, 102], [1, 2]) == 2
    assert lt.store(A, 101, [102], [2]) == 1
    assert counters(lt) == (2, 2)
    assert lt.worker_blocks(A) == 2


def test_store_lengths_and_buffers(LowerTier):
    lt = LowerTier()
    locs = hash_blocks(list(range(12)), 4)
    assert lt.store(A, None, array("Q", [101, 102, 103, 104]), locs) == 3  # n = min(4, 3)
    assert lt.store(A, None, [], locs) == 0
    assert lt.walk(A, locs, 0, None) == (3, 103)
    assert lt.walk(A, memoryview(locs), 1, 101) == (2, 103)


# -- walk -----------------------------------------------------------------------------------


def test_walk_requires_ownership(LowerTier):
    lt = LowerTier()
    lt.store(A, None, [101], [1])
    lt.store(B, None, [101, 102], [1, 2])
    # A owns (None,1) only; edge (101,2) belongs to B
    assert lt.walk(A, [1, 2], 0, None) == (1, 101)
    assert lt.walk(B, [1, 2], 0, None) == (2, 102)
    assert lt.walk(C, [1, 2], 0, None) == (0, None)


def test_walk_bounds(LowerTier):
    lt = LowerTier()
    lt.store(A, None, [101, 102], [1, 2])
    assert lt.walk(A, [1, 2], 2, 102) == (0, None)  # start == len
    assert lt.walk(A, [1, 2], 5, None) == (0, None)  # start past the end
    assert lt.walk(A, [], 0, None) == (0, None)
    assert lt.walk(A, [1, 2], 1, 101) == (1, 102)
    assert lt.walk(A, [1, 2], 1, None) == (0, None)  # (None,2) does not exist


# -- lookup_block / counters ----------------------------------------------------------------


def test_lookup_block(LowerTier):
    lt = LowerTier()
    assert lt.lookup_block(500) is None
    # worker 3 maps 500 to (None,9); worker 1 maps it to (10,8)
    lt.store(C, None, [500], [9])
    assert lt.lookup_block(500) == (None, 9)
    lt.store(A, 10, [500], [8])
    assert lt.lookup_block(500) == (10, 8)  # lowest worker id wins
    lt.remove(A, [500])
    assert lt.lookup_block(500) == (None, 9)
    lt.clear(C)
    assert lt.lookup_block(500) is None


def test_counters_remove_and_clear(LowerTier):
    lt = LowerTier()
    lt.store(A, None, [101, 102, 103], [1, 2, 3])
    lt.store(B, None, [101], [1])
    lt.store(B, 7, [702], [2])
    # edges: (None,1){A,B}, (101,2){A}, (102,3){A}, (7,2){B}
    assert counters(lt) == (5, 4)
    assert (lt.worker_blocks(A), lt.worker_blocks(B), lt.worker_blocks(C)) == (3, 2, 0)
    assert lt.remove(A, [999, 101, 101]) == 1  # unknown and repeated ignored
    assert counters(lt) == (4, 4)  # (None,1) still owned by B
    assert lt.clear(B) == 2
    assert counters(lt) == (2, 2)
    assert lt.clear(B) == 0
    assert lt.clear(A) == 2
    assert counters(lt) == (0, 0)
    assert isinstance(lt.nbytes, int) and lt.nbytes >= 0


# -- the C invariant checker (compiled tier only) ------------------------------------------------
# check_invariants() walks the C structures; each _corrupt_for_test kind breaks exactly one
# invariant, so these tests fail if the checker stops seeing that kind of damage.


def _c_tier():
    lower = pytest.importorskip("kvconductor._lower")
    t = lower.LowerTier()
    t.store(1, None, [101, 102, 103], [1, 2, 3])
    t.store(2, None, [101, 102], [1, 2])
    t.store(2, None, [201], [1])  # a second root edge of local 1
    t.check_invariants()
    return t


def test_check_invariants_holds_through_mutations():
    t = _c_tier()
    t.remove(1, [101])
    t.check_invariants()
    t.clear(2)
    t.check_invariants()
    t.clear(1)
    t.check_invariants()
    assert (t.total_blocks, t.num_edges) == (0, 0)


def test_check_invariants_sees_corruption():
    for kind in ("total", "owners", "owner_freed", "rev_entry"):
        t = _c_tier()
        t._corrupt_for_test(kind)
        with pytest.raises(AssertionError):
            t.check_invariants()


# -- keys read back from the edge ---------------------------------------------------------------
# The compiled tier's edge table and reverse maps keep 8-byte slots: an edge index and 32 bits
# of the key's hash; keys that share those bits share a probe run and only the key read back
# from the edge tells them apart. FP_A/FP_B share the low 32 bits of splitmix64's finalizer
# (tests/test_tree.py checks it independently).
FP_A, FP_B = 85078, 177926
U64 = 2**64 - 1


def test_colliding_engine_hashes_stay_apart(LowerTier):
    t = LowerTier()
    t.store(A, None, [FP_A], [1])
    t.store(A, None, [FP_B], [2])
    assert t.walk(A, [1], 0, None) == (1, FP_A)
    assert t.walk(A, [2], 0, None) == (1, FP_B)
    assert t.lookup_block(FP_A) == (None, 1)
    assert t.lookup_block(FP_B) == (None, 2)
    assert t.remove(A, [FP_A]) == 1
    assert t.remove(A, [FP_A]) == 0
    assert t.lookup_block(FP_A) is None
    assert t.lookup_block(FP_B) == (None, 2)
    assert counters(t) == (1, 1)


def test_colliding_edge_keys_stay_apart(LowerTier):
    # (parent, local) hashes to mix(parent * 0x9E3779B97F4A7C15 ^ local): under parent P
    # these two locals give the mix inputs FP_A and FP_B
    P = 101
    c = (P * 0x9E3779B97F4A7C15) & U64
    la, lb = FP_A ^ c, FP_B ^ c
    t = LowerTier()
    t.store(A, None, [P, 201], [7, la])
    t.store(B, None, [P, 202], [7, lb])  # B joins the root edge, then its own child
    assert t.walk(A, [7, la], 0, None) == (2, 201)
    assert t.walk(B, [7, lb], 0, None) == (2, 202)
    assert t.walk(A, [7, lb], 0, None) == (1, P)
    assert t.remove(A, [201]) == 1
    assert t.walk(B, [7, lb], 0, None) == (2, 202)
    assert t.walk(A, [7, la], 0, None) == (1, P)
    assert counters(t) == (3, 2)
