"""RadixTree (HBM tier): the reference's radix-tree tests plus the design.md semantics.

Workers are plain ints, engine hashes ("seq") are opaque u64s (here 100+),
local hashes are LocalBlockHashes (small ints or real hash_blocks values).
Expected values are worked out by hand from docs/design.md "RadixTree (HBM)".
"""

from array import array

import pytest

from kvconductor._hash import hash_blocks
from kvconductor.errors import InvalidBlockSequence, ParentBlockNotFound

W1, W2, W3 = 1, 2, 3


def state(tree):
    return tree.num_nodes, tree.num_pairs


# -- the reference's radix-tree tests -------------------------------------------------------


def test_concurrent_find_matches_empty(RadixTree):
    t = RadixTree()
    # nothing stored: no first node -> []
    assert t.match([1, 2, 3]) == []
    assert t.match([]) == []
    assert state(t) == (0, 0)


def test_store_and_find(RadixTree):
    t = RadixTree()
    assert t.store(W1, None, [100], [1]) == 1
    # one node under the root, W1 member with seq 100
    assert t.match([1]) == [(W1, 1, 100)]
    assert t.worker_blocks(W1) == 1
    assert state(t) == (1, 1)


def test_multi_block_chain_concurrent(RadixTree):
    t = RadixTree()
    # three stores, each chained on the previous one's engine hash
    assert t.store(W1, None, [101], [1]) == 1
    assert t.store(W1, 101, [102], [2]) == 1
    assert t.store(W1, 102, [103], [3]) == 1
    assert t.match([1, 2, 3]) == [(W1, 3, 103)]
    assert t.match([1, 2]) == [(W1, 2, 102)]
    assert state(t) == (3, 3)


def test_remove_blocks(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    assert t.worker_blocks(W1) == 2
    # removing the tail: node 2 loses its only member and is pruned
    assert t.remove(W1, [102]) == 1
    assert t.match([1, 2]) == [(W1, 1, 101)]
    assert t.worker_blocks(W1) == 1
    assert state(t) == (1, 1)


def test_clear_worker(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102, 103], [1, 2, 3])
    assert t.clear(W1) == 3
    assert t.worker_blocks(W1) == 0
    assert t.match([1, 2, 3]) == []
    assert state(t) == (0, 0)
    assert t.clear(W1) == 0


def test_two_workers_share_prefix(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    t.store(W2, None, [101], [1])
    # node 1 holds both, node 2 only W1
    assert t.match([1]) == [(W1, 1, 101), (W2, 1, 101)]
    assert t.match([1, 2]) == [(W1, 2, 102), (W2, 1, 101)]
    assert state(t) == (2, 3)


# -- validation ---------------------------------------------------------------------------


def test_parent_not_found_stores_nothing(RadixTree):
    t = RadixTree()
    with pytest.raises(ParentBlockNotFound):
        t.store(W1, 999, [101, 102], [1, 2])
    assert state(t) == (0, 0)
    assert t.worker_blocks(W1) == 0
    assert t.match([1]) == []


def test_parent_must_be_the_workers_own_block(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101], [1])
    # 101 is W1's block, not W2's
    with pytest.raises(ParentBlockNotFound):
        t.store(W2, 101, [102], [2])
    assert state(t) == (1, 1)
    assert t.worker_blocks(W2) == 0


def test_empty_chain_stores_nothing_even_with_unknown_parent(RadixTree):
    t = RadixTree()
    assert t.store(W1, 999, [], []) == 0
    assert t.store(W1, 999, [101], []) == 0  # n = min(1, 0) = 0
    assert t.store(W1, None, [], [1, 2]) == 0
    assert state(t) == (0, 0)


def test_invalid_block_sequence_repeat_in_chain(RadixTree):
    t = RadixTree()
    with pytest.raises(InvalidBlockSequence):
        t.store(W1, None, [101, 102, 101], [1, 2, 3])
    assert state(t) == (0, 0)
    assert t.worker_blocks(W1) == 0


def test_invalid_block_sequence_repeat_of_parent(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101], [1])
    # chain [101] + [102, 101] repeats 101
    with pytest.raises(InvalidBlockSequence):
        t.store(W1, 101, [102, 101], [2, 3])
    with pytest.raises(InvalidBlockSequence):
        t.store(W1, 101, [101], [2])
    assert state(t) == (1, 1)
    assert t.match([1, 2]) == [(W1, 1, 101)]


@pytest.mark.parametrize("n", [33, 100])
def test_invalid_block_sequence_in_long_chains(RadixTree, n):
    """Chains over 32 blocks are checked through a hash set (the short ones pairwise)."""
    t = RadixTree()
    t.store(W1, None, [7], [7])
    seqs = list(range(1000, 1000 + n))
    locs = list(range(1, n + 1))
    for bad in (seqs[:-1] + [seqs[0]], seqs[:-1] + [7]):  # repeat in chain, of parent
        with pytest.raises(InvalidBlockSequence):
            t.store(W1, 7, bad, locs)
    assert state(t) == (1, 1)
    assert t.store(W1, 7, seqs, locs) == n
    assert t.worker_blocks(W1) == n + 1


def test_repeat_beyond_n_is_not_checked(RadixTree):
    t = RadixTree()
    # n = min(3, 2) = 2: only [101, 102] is the chain, the trailing 101 is ignored
    assert t.store(W1, None, [101, 102, 101], [1, 2]) == 2
    assert t.match([1, 2]) == [(W1, 2, 102)]


def test_parent_not_found_checked_before_repeats(RadixTree):
    t = RadixTree()
    with pytest.raises(ParentBlockNotFound):
        t.store(W1, 999, [101, 101], [1, 2])


# -- store semantics ----------------------------------------------------------------------


def test_idempotent_restore(RadixTree):
    t = RadixTree()
    assert t.store(W1, None, [101, 102, 103], [1, 2, 3]) == 3
    t.store(W2, None, [201], [1])
    before = (state(t), t.match([1, 2, 3]), t.worker_blocks(W1))
    assert t.store(W1, None, [101, 102, 103], [1, 2, 3]) == 3
    assert t.store(W1, 101, [102, 103], [2, 3]) == 2
    assert (state(t), t.match([1, 2, 3]), t.worker_blocks(W1)) == before
    assert before == ((3, 4), [(W1, 3, 103), (W2, 1, 201)], 3)


def test_same_node_new_seq_replaces_member(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101], [1])
    # step 3: W1 is already a member of node 1 with seq 101 -> re-keyed to 111
    assert t.store(W1, None, [111], [1]) == 1
    assert t.worker_blocks(W1) == 1
    assert t.match([1]) == [(W1, 1, 111)]
    assert t.remove(W1, [101]) == 0  # the old seq is gone
    assert t.remove(W1, [111]) == 1
    assert state(t) == (0, 0)


def test_seq_moves_to_new_node_and_old_is_pruned(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101], [1])
    # step 2: seq 101 now names content 2; its old node (content 1) empties and goes
    assert t.store(W1, None, [101], [2]) == 1
    assert t.match([1]) == []
    assert t.match([2]) == [(W1, 1, 101)]
    assert state(t) == (1, 1)


def test_seq_moves_under_a_memberless_ancestor(RadixTree):
    """Step 2 must not prune the node it is moving the block onto.

    W1 holds 1 -> 2 (seqs 101, 102) and drops 101: node 1 is memberless with
    one child. Storing seq 102 as content 1 at the root moves W1's member from
    node 2 (pruned: no members, no children) onto node 1, which must survive.
    """
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    t.remove(W1, [101])
    assert state(t) == (2, 1)
    assert t.store(W1, None, [102], [1]) == 1
    assert t.match([1, 2]) == [(W1, 1, 102)]
    assert t.worker_blocks(W1) == 1
    assert state(t) == (1, 1)
    assert t.remove(W1, [102]) == 1
    assert state(t) == (0, 0)


def test_other_workers_content_with_different_seq_is_shared(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    t.store(W2, None, [201, 202], [1, 2])
    # one path of two nodes, two members each
    assert state(t) == (2, 4)
    # last_seq is each worker's OWN engine hash at its breakpoint
    assert t.match([1, 2]) == [(W1, 2, 102), (W2, 2, 202)]
    assert t.match([1]) == [(W1, 1, 101), (W2, 1, 201)]
    assert t.match([1, 2, 3]) == [(W1, 2, 102), (W2, 2, 202)]


def test_hash_buffers_accepted(RadixTree):
    t = RadixTree()
    locs = hash_blocks(list(range(12)), 4)  # array('Q') of 3 LocalBlockHashes
    assert t.store(W1, None, array("Q", [101, 102, 103]), locs) == 3
    assert t.match(memoryview(locs)) == [(W1, 3, 103)]
    assert t.match(list(locs[:2])) == [(W1, 2, 102)]
    assert t.remove(W1, array("Q", [103])) == 1
    assert t.match(locs) == [(W1, 2, 102)]


# -- remove / prune -----------------------------------------------------------------------


def test_remove_ignores_unknown_and_duplicates(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    # 999 unknown, the second 102 already removed in this call
    assert t.remove(W1, [999, 102, 102]) == 1
    assert t.remove(W2, [101]) == 0  # not W2's block
    assert t.remove(W1, []) == 0
    assert t.match([1, 2]) == [(W1, 1, 101)]


def test_interior_removal_keeps_other_workers_descendants(RadixTree):
    """Removing W1's interior block keeps W2's deeper blocks reachable (the reference
    cleared the children and orphaned them; docs/design.md "RadixTree (HBM)")."""
    t = RadixTree()
    t.store(W1, None, [101, 102, 103], [1, 2, 3])
    t.store(W2, None, [201, 202, 203], [1, 2, 3])
    # W1 drops its middle block: node 2 still has W2
    assert t.remove(W1, [102]) == 1
    assert t.match([1, 2, 3]) == [(W1, 1, 101), (W2, 3, 203)]
    # W1's deeper block 103 stays a member of node 3 but is no longer contiguous for W1
    assert t.worker_blocks(W1) == 2
    assert state(t) == (3, 5)
    # W1 drops its root block too: node 1 keeps W2
    t.remove(W1, [101])
    assert t.match([1, 2, 3]) == [(W2, 3, 203)]


def test_interior_removal_of_only_member_keeps_node_with_children(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    t.store(W2, None, [201], [1])
    t.store(W2, 201, [202, 203], [2, 3])
    # node 2 has W1 and W2; node 3 only W2. W2 removes node 2: node 2 keeps W1.
    t.remove(W2, [202])
    assert t.match([1, 2, 3]) == [(W1, 2, 102), (W2, 1, 201)]
    # W1 removes node 2 too: node 2 is memberless but has child 3 (W2) -> kept
    t.remove(W1, [102])
    assert state(t) == (3, 3)
    assert t.match([1, 2, 3]) == [(W1, 1, 101), (W2, 1, 201)]
    # W2 removes 203: nodes 3 and then 2 become empty leaves and are pruned
    t.remove(W2, [203])
    assert state(t) == (1, 2)


def test_workers_joining_deeper_are_not_candidates(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102, 103], [1, 2, 3])
    t.store(W3, None, [301, 302], [1, 2])
    t.remove(W3, [301])  # W3 now holds only node 2
    assert t.match([1, 2, 3]) == [(W1, 3, 103)]
    assert t.match([2]) == []  # node 2 is not a child of the root


def test_walk_stops_when_no_candidate_left(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    t.store(W2, None, [201], [1])
    t.store(W2, 201, [202, 203], [5, 3])
    # W1 continues with 2, W2 with 5; query 1,2,3: W2 drops at 2, W1 at 3 (no edge)
    assert t.match([1, 2, 3]) == [(W1, 2, 102), (W2, 1, 201)]
    assert t.match([1, 5, 3]) == [(W1, 1, 101), (W2, 3, 203)]
    assert t.match([7, 1]) == []


def test_pruning_back_to_zero(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102, 103], [1, 2, 3])
    t.store(W2, None, [201, 202], [1, 4])
    t.store(W3, None, [301], [9])
    assert state(t) == (5, 6)
    t.remove(W1, [101])  # interior: node 1 keeps W2, nothing pruned
    assert state(t) == (5, 5)
    t.clear(W2)  # node 4 pruned; node 1 memberless but has child 2
    assert state(t) == (4, 3)
    assert t.remove(W1, [103, 102]) == 2  # 3, 2 then 1 pruned
    assert state(t) == (1, 1)
    assert t.clear(W3) == 1
    assert state(t) == (0, 0)
    assert [t.worker_blocks(w) for w in (W1, W2, W3)] == [0, 0, 0]


def test_memberless_node_with_a_child_stays_empty_leaves_go(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [1, 2])
    t.remove(W1, [101])
    # node 1 is memberless but has a child: it stays; the leaf below it is still held
    assert state(t) == (2, 1)
    t.remove(W1, [102])
    # the leaf emptied: pruned, and its memberless parent with it
    assert state(t) == (0, 0)


def test_nbytes_accounts_the_c_arrays():
    """The compiled tree reports at least its node and member records (32 B + 16 B per
    block of a one-worker chain); the twin does not account memory (0)."""
    from kvconductor._py.tree import RadixTree as PyTree
    from kvconductor._tree import RadixTree as CTree

    n = 10_000
    t = CTree()
    empty = t.nbytes
    t.store(W1, None, list(range(1, n + 1)), list(range(1, n + 1)))
    assert t.nbytes >= empty + n * (32 + 16)
    t.store(W2, None, list(range(1, n + 1)), list(range(1, n + 1)))  # members only
    assert t.nbytes >= empty + n * (32 + 2 * 16)
    assert PyTree().nbytes == 0


def test_one_store_sizes_the_reverse_map_as_block_by_block():
    """A store of n blocks reserves its worker's reverse map once, ahead; it reaches the
    capacity (so the bytes) that storing the same chain one block at a time reaches."""
    from kvconductor._tree import RadixTree as CTree

    for n in (1, 7, 8, 9, 23, 100, 1000):
        whole, steps = CTree(), CTree()
        whole.store(W1, None, list(range(1, n + 1)), list(range(1, n + 1)))
        steps.store(W1, None, [1], [1])
        for b in range(2, n + 1):
            steps.store(W1, b - 1, [b], [b])
        assert whole.layout() == steps.layout(), n
        assert whole.nbytes == steps.nbytes, n


def test_large_u64_values(RadixTree):
    t = RadixTree()
    top = 2**64 - 1
    assert t.store(W1, None, [top, 0], [top, 0]) == 2
    assert t.match([top, 0]) == [(W1, 2, 0)]
    assert t.match([top]) == [(W1, 1, top)]


# -- the C invariant checker (compiled tree only) ------------------------------------------------
# check_invariants() walks the C structures; each _corrupt_for_test kind breaks exactly one
# invariant, so these tests fail if the checker stops seeing that kind of damage.


def _c_tree():
    from kvconductor._tree import RadixTree as CTree

    t = CTree()
    t.store(W1, None, [101, 102, 103], [1, 2, 3])
    t.store(W2, None, [201, 202], [1, 2])
    t.store(W2, 202, [203], [9])
    t.check_invariants()
    return t


def test_check_invariants_holds_through_mutations():
    pytest.importorskip("kvconductor._tree")
    t = _c_tree()
    t.store(W1, None, [102], [5])  # an engine hash moves: prune, relink
    t.check_invariants()
    t.remove(W2, [201])  # interior member leaves, node stays for W1
    t.check_invariants()
    t.clear(W1)
    t.check_invariants()
    t.clear(W2)
    t.check_invariants()
    assert state(t) == (0, 0)


@pytest.mark.parametrize("kind", ["live_nodes", "nchildren", "sig", "member_freed", "rev_entry"])
def test_check_invariants_sees_corruption(kind):
    pytest.importorskip("kvconductor._tree")
    t = _c_tree()
    t._corrupt_for_test(kind)
    with pytest.raises(AssertionError):
        t.check_invariants()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("wide_bit", "disagree with its bitmap"),
        ("wide_ehash", "not in the worker's reverse map"),
        ("wide_freed", "wide record"),
        ("wide_bytes", "wide bytes"),
    ],
)
def test_check_invariants_sees_a_broken_wide_node(kind, message):
    """A wide node's bitmap must be exactly its member set (count, fingerprint, each
    member's engine hash found by its reverse map), its record live and its own, and the
    tree's count of wide bytes right."""
    pytest.importorskip("kvconductor._tree")
    t = _c_tree()
    for w in range(10, 30):
        t.store(w, None, [1000 + w], [1])
    assert t.layout()["wide_nodes"] == 1
    t.check_invariants()
    t._corrupt_for_test(kind)
    with pytest.raises(AssertionError, match=message):
        t.check_invariants()


# -- keys read back from the node ---------------------------------------------------------------
# The compiled tree's edge table and reverse maps keep 8-byte slots: a node index and 32 bits
# of the key's hash (the splitmix64 finalizer). Two keys with the same 32 bits share a probe
# run, and only the key read back from the node tells them apart.

U64 = 2**64 - 1


def _mix(x):
    """splitmix64's finalizer, written independently of kvconductor._maps.hm_mix."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


# Found by a birthday search over 1..200,000: the same low 32 bits of _mix. As engine hashes
# of one worker they share a reverse-map fingerprint; as LocalBlockHashes under the root
# (edge key hash = _mix(0 * C ^ local)) they share an edge fingerprint.
FP_A, FP_B = 85078, 177926


def test_fingerprint_twins_collide():
    assert FP_A != FP_B and _mix(FP_A) & 0xFFFFFFFF == _mix(FP_B) & 0xFFFFFFFF


def test_colliding_engine_hashes_stay_apart(RadixTree):
    t = RadixTree()
    t.store(W1, None, [FP_A], [1])
    t.store(W1, None, [FP_B], [2])
    assert t.match([1]) == [(W1, 1, FP_A)]
    assert t.match([2]) == [(W1, 1, FP_B)]
    # the parent lookup picks the right one of the two
    t.store(W1, FP_B, [300], [5])
    assert t.match([2, 5]) == [(W1, 2, 300)]
    assert t.match([1, 5]) == [(W1, 1, FP_A)]
    with pytest.raises(ParentBlockNotFound):
        t.store(W2, FP_A, [400], [6])  # W2 holds neither
    # a shared node: W2 joins FP_A's node, so W1's member is found in a member list
    t.store(W2, None, [FP_B], [1])
    assert t.match([1]) == [(W1, 1, FP_A), (W2, 1, FP_B)]
    assert t.remove(W1, [FP_A]) == 1
    assert t.remove(W1, [FP_A]) == 0
    assert t.match([1]) == [(W2, 1, FP_B)]
    assert t.match([2, 5]) == [(W1, 2, 300)]
    assert t.remove(W2, [FP_B]) == 1
    assert t.match([2, 5]) == [(W1, 2, 300)]
    assert state(t) == (2, 2)


def test_colliding_local_hashes_under_the_root(RadixTree):
    t = RadixTree()
    t.store(W1, None, [101, 102], [FP_A, 1])
    t.store(W2, None, [201], [FP_B])
    assert t.match([FP_A, 1]) == [(W1, 2, 102)]
    assert t.match([FP_B]) == [(W2, 1, 201)]
    assert t.match([FP_B, 1]) == [(W2, 1, 201)]
    # pruning FP_A's node takes its edge out of the shared run; FP_B's stays found
    assert t.remove(W1, [102, 101]) == 2
    assert t.match([FP_A]) == []
    assert t.match([FP_B]) == [(W2, 1, 201)]
    assert state(t) == (1, 1)


def test_members_move_between_the_node_and_records(RadixTree):
    """A block one worker holds keeps its member in the node; a second holder moves both
    into member records, and the last but one leaving moves the survivor back."""
    t = RadixTree()

    def records():
        layout = getattr(t, "layout", None)  # the compiled tree's bookkeeping
        if layout is not None:
            t.check_invariants()
            return layout()["records_live"]
        return None

    t.store(W1, None, [101], [1])
    assert records() in (0, None)
    t.store(W2, None, [201], [1])
    assert records() in (2, None)
    t.store(W3, None, [301], [1])
    assert records() in (3, None)
    assert t.match([1]) == [(W1, 1, 101), (W2, 1, 201), (W3, 1, 301)]
    # W2 announces the same block under a new engine hash: its member is re-keyed
    t.store(W2, None, [202], [1])
    assert t.match([1]) == [(W1, 1, 101), (W2, 1, 202), (W3, 1, 301)]
    assert t.remove(W2, [201]) == 0 and t.worker_blocks(W2) == 1
    assert records() in (3, None)
    assert t.remove(W1, [101]) == 1
    assert records() in (2, None)
    assert t.remove(W3, [301]) == 1
    assert records() in (0, None)
    assert t.match([1]) == [(W2, 1, 202)]
    # and the inline member is re-keyed the same way
    t.store(W2, None, [203], [1])
    assert t.match([1]) == [(W2, 1, 203)]
    assert t.remove(W2, [202]) == 0
    assert t.remove(W2, [203]) == 1
    assert state(t) == (0, 0) and records() in (0, None)


# -- wide nodes: the members of a node many workers hold as a bitmap -----------------------------
# A node whose member list reaches 2 * (bitmap words over every worker id seen) + 8
# members turns wide: a bitmap over worker ids and the engine hashes in worker order;
# below (its own bitmap words) + 4 members it turns back into a list. With fewer than 65
# worker ids the bitmap is one word: wide from 10 members, a list again below 5.


def _wide(t):
    """(wide nodes, live member records) of the compiled tree (checked first); None for
    the twin."""
    layout = getattr(t, "layout", None)
    if layout is None:
        return None
    t.check_invariants()
    lay = layout()
    return lay["wide_nodes"], lay["records_live"]


def test_members_become_a_bitmap_and_back(RadixTree):
    t = RadixTree()
    for w in range(9):
        t.store(w, None, [100 + w], [1])
    assert _wide(t) in ((0, 9), None)
    t.store(9, None, [109], [1])  # the 10th member
    assert _wide(t) in ((1, 0), None)
    for w in range(10, 12):
        t.store(w, None, [100 + w], [1])
    assert t.match([1]) == [(w, 1, 100 + w) for w in range(12)]
    # a member re-keyed in place, and one announced again under the same hash
    t.store(5, None, [205], [1])
    t.store(6, None, [106], [1])
    assert t.remove(5, [105]) == 0 and t.worker_blocks(5) == 1
    want = [(w, 1, 205 if w == 5 else 100 + w) for w in range(12)]
    assert t.match([1]) == want and _wide(t) in ((1, 0), None)
    # members leave from the middle, the ends and in any order; 5 members stay wide
    for w in (11, 0, 6, 3, 8, 1, 10):
        assert t.remove(w, [205 if w == 5 else 100 + w]) == 1
    assert [r[0] for r in t.match([1])] == [2, 4, 5, 7, 9] and _wide(t) in ((1, 0), None)
    assert t.remove(7, [107]) == 1  # 4 left: a member list again
    assert t.match([1]) == [(2, 1, 102), (4, 1, 104), (5, 1, 205), (9, 1, 109)]
    assert _wide(t) in ((0, 4), None)
    for w in range(10, 20):  # wide again, then every member but one leaves at once
        t.store(w, None, [100 + w], [1])
    assert _wide(t) in ((1, 0), None)
    for w in [2, 4, 5] + list(range(10, 20)):
        t.clear(w)
    assert t.match([1]) == [(9, 1, 109)] and _wide(t) in ((0, 0), None)
    assert state(t) == (1, 1)
    # twice wide, twice back (to a list, then to a sole member inline)
    turns = getattr(t, "layout", None)
    assert turns is None or (turns()["widened"], turns()["narrowed"]) == (2, 2)


def test_match_over_many_holders(RadixTree):
    """100 workers hold block 7; worker w also holds 8 when w % 2 == 0, 9 when w % 4 == 0
    and 10 when w % 8 == 0 (under engine hashes of its own): the walk starts with 100
    candidates on a wide node (word-wise), goes through wide nodes of 50, 25 and 13 and
    hands over to the candidate list on the way."""
    t = RadixTree()
    for w in range(100):
        depth = 1 + sum(w % d == 0 for d in (2, 4, 8))
        t.store(w, None, [w * 100 + k for k in range(depth)], [7, 8, 9, 10][:depth])
    t.store(99, 9900, [9955], [55])
    _wide(t)

    def want(limit):
        out = []
        for w in range(100):
            d = min(limit, 1 + sum(w % d == 0 for d in (2, 4, 8)))
            out.append((w, d, w * 100 + d - 1))
        return out

    assert t.match([7, 8, 9, 10, 11]) == want(4)
    assert t.match([7, 8, 9]) == want(3)
    assert t.match([7, 8]) == want(2)
    assert t.match([7]) == want(1)
    assert t.match([7, 55]) == [(w, 2, 9955) if w == 99 else (w, 1, w * 100) for w in range(100)]
    assert t.match([7, 12]) == want(1)
    # holes: the even workers below 50 drop block 8 but keep 9 and 10: they stop at 1
    for w in range(0, 50, 2):
        assert t.remove(w, [w * 100 + 1]) == 1
    full = want(4)
    assert t.match([7, 8, 9, 10]) == [(w, 1, w * 100) if w < 50 else full[w] for w in range(100)]
    _wide(t)


def test_match_count_runs_each_query_in_c():
    """The benchmark aid: the total number of results of several matches, run in C."""
    ctree = pytest.importorskip("kvconductor._tree")
    t = ctree.RadixTree()
    for w in range(40):
        t.store(w, None, [w * 10, w * 10 + 1], [5, 6 + w % 3])
    queries = [[5, 6], [5, 7, 9], [5], [8], [6, 5]]
    hashes = [h for q in queries for h in q]
    ends = [2, 5, 6, 7, 9]
    assert t._match_count(hashes, ends) == sum(len(t.match(q)) for q in queries) == 120
    assert t._match_count(hashes, []) == 0
    with pytest.raises(ValueError):
        t._match_count(hashes, [10])


def test_the_bitmap_follows_new_worker_ids(RadixTree):
    """A worker id past the bitmap's words grows it; one so far past that the bitmap
    would cost more than member records turns the node back into a list."""
    t = RadixTree()
    for w in range(20):
        t.store(w, None, [100 + w], [1])
    assert _wide(t) in ((1, 0), None)
    t.store(130, None, [230], [1])  # 3 words now
    assert _wide(t) in ((1, 0), None)
    t.store(5000, None, [5100], [1])  # 79 words for 22 members: a list
    assert _wide(t) in ((0, 22), None)
    want = [(w, 1, 100 + w) for w in range(20)] + [(130, 1, 230), (5000, 1, 5100)]
    assert t.match([1]) == want
    for w in range(5001, 5200):  # wide again, over 82 words
        t.store(w, None, [100 + w], [1])
    assert _wide(t) in ((1, 0), None)
    assert t.match([1]) == want + [(w, 1, 100 + w) for w in range(5001, 5200)]


def test_layout_of_the_compiled_tree():
    ctree = pytest.importorskip("kvconductor._tree")
    t = ctree.RadixTree()
    lay = t.layout()
    assert (lay["node_bytes"], lay["member_bytes"]) == (32, 16)
    assert lay["nodes"] == 1 and lay["records"] == 0  # the root
    # 64 one-block chains of distinct workers on distinct nodes, then all on one node
    for w in range(64):
        t.store(w, None, [1000 + w], [w + 1])
    lay = t.layout()
    assert lay["nodes"] == 65 and lay["records"] == 0
    assert lay["edge_slots"] * 13 >= 64 * 16 and lay["rev_slots"] >= 64  # load <= 13/16
    for w in range(8):
        t.store(w, None, [5000 + w], [100])
    lay = t.layout()
    assert lay["records_live"] == 8 and lay["records"] == 8 and lay["wide_nodes"] == 0
    # 64 holders: a wide node (a 24 B record, one bitmap word and the 64 engine hashes
    # with at most 1/8 and 4 spare), its member records back on the free list
    for w in range(8, 64):
        t.store(w, None, [5000 + w], [100])
    lay = t.layout()
    assert (lay["records_live"], lay["wide_nodes"], lay["wide_records"]) == (0, 1, 1)
    assert lay["wide_bytes"] == 24
    assert 8 * (1 + 64) <= lay["wide_block_bytes"] <= 8 * (1 + 64 + 64 // 8 + 4)
    # used: the arrays up to their high-water marks, every table slot, the map headers
    assert lay["rev_maps"] >= 64
    assert lay["used_bytes"] == (
        lay["nodes"] * 32
        + lay["records"] * 16
        + lay["wide_records"] * 24
        + lay["wide_block_bytes"]
        + 8 * (lay["edge_slots"] + lay["rev_slots"])
        + 24 * lay["rev_maps"]
    )
    assert lay["nbytes"] >= lay["used_bytes"]
    t.check_invariants()
