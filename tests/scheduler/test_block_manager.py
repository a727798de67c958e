"""The KV block manager: the all-or-nothing gate, ref counts and the prefix cache."""

import pytest

from scheduler import BlockIntegrityError, KVBlockManager, Sequence
from tests.factories import make_seq


def test_allocate_covers_tokens_and_free_returns_everything():
    """Blocks cover exactly ceil(tokens / block_size); free gives all of them back."""
    kv = KVBlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", prompt_len=9)
    assert kv.allocate_slots(seq, 9)
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 5
    seq.num_computed_tokens = 9
    assert kv.allocate_slots(seq, 3)  # positions 9..11 still fit in block 3
    assert len(kv.block_table("a")) == 3
    seq.num_computed_tokens = 12
    assert kv.allocate_slots(seq, 1)  # position 12 needs a 4th block
    assert len(kv.block_table("a")) == 4
    kv.free(seq)
    assert kv.num_free_blocks == 8 and kv.block_table("a") == []
    kv.check_integrity()


def test_allocation_is_all_or_nothing():
    """A request for more than is free changes nothing."""
    kv = KVBlockManager(num_blocks=4, block_size=4)
    a, b = make_seq("a", prompt_len=8), make_seq("b", prompt_len=12)
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 12)
    assert kv.num_free_blocks == 2 and kv.block_table("b") == []
    assert kv.allocate_slots(b, 8)  # what fits does fit
    kv.check_integrity()


def test_reservation_allocates_full_length_up_front():
    """reserve_tokens takes blocks for the whole future length at once."""
    kv = KVBlockManager(num_blocks=10, block_size=4)
    seq = make_seq("a", prompt_len=5, max_tokens=8)  # 12 tokens of KV at most
    assert kv.allocate_slots(seq, 5, reserve_tokens=seq.max_total_tokens)
    assert len(kv.block_table("a")) == 3
    seq.num_computed_tokens = 11
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(seq, 1)
    assert kv.num_free_blocks == free_before  # nothing new needed
    kv.free(seq)
    kv.check_integrity()


def _run_prefill(kv: KVBlockManager, seq: Sequence) -> None:
    assert kv.allocate_slots(seq, seq.num_tokens - kv.num_cached_tokens(seq))
    seq.num_computed_tokens = seq.num_tokens
    kv.commit_computed(seq)


def test_shared_prefix_blocks_are_shared_and_ref_counted():
    """A second prompt with the same first two full blocks reuses them (ref count 2)."""
    kv = KVBlockManager(num_blocks=16, block_size=4)
    a = Sequence.create("a", list(range(10)), max_tokens=4)
    b = Sequence.create("b", [*range(8), 50, 51, 52], max_tokens=4)
    _run_prefill(kv, a)
    assert kv.num_cached_tokens(b) == 8
    assert kv.allocate_slots(b, 3)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    assert [kv.blocks[x].ref_count for x in kv.block_table("a")] == [2, 2, 1]
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (21, 8)
    kv.free(a)
    assert [kv.blocks[x].ref_count for x in kv.block_table("b")[:2]] == [1, 1]
    kv.check_integrity()


def test_uncomputed_blocks_are_never_hits():
    """Blocks only become cacheable once a step computed them (commit_computed)."""
    kv = KVBlockManager(num_blocks=16, block_size=4)
    a = Sequence.create("a", list(range(12)), max_tokens=4)
    assert kv.allocate_slots(a, 12)  # scheduled, not yet computed
    b = Sequence.create("b", list(range(12)), max_tokens=4)
    assert kv.num_cached_tokens(b) == 0
    a.num_computed_tokens = 5
    kv.commit_computed(a)  # one full block computed
    assert kv.num_cached_tokens(b) == 4


def test_freed_block_keeps_hash_until_reused():
    """After free, the prefix is still a hit; handing the block out fresh evicts it."""
    kv = KVBlockManager(num_blocks=3, block_size=4)
    a = Sequence.create("a", list(range(9)), max_tokens=1)
    _run_prefill(kv, a)
    kv.free(a)
    b = Sequence.create("b", list(range(9)), max_tokens=1)
    assert kv.num_cached_tokens(b) == 8  # revived from the free list
    _run_prefill(kv, b)
    assert kv.num_free_blocks == 0
    kv.free(b)
    c = Sequence.create("c", [100 + i for i in range(12)], max_tokens=1)
    assert kv.allocate_slots(c, 12)  # takes every block, evicting the cached ones
    d = Sequence.create("d", list(range(9)), max_tokens=1)
    assert kv.num_cached_tokens(d) == 0
    kv.free(c)
    kv.check_integrity()


def test_free_order_evicts_tails_before_shared_prefixes():
    """Freed tail blocks go first in eviction order, so prefix blocks survive longer."""
    kv = KVBlockManager(num_blocks=4, block_size=4)
    a = Sequence.create("a", list(range(16)), max_tokens=1)
    _run_prefill(kv, a)
    kv.free(a)
    x = Sequence.create("x", [500, 501, 502], max_tokens=1)
    assert kv.allocate_slots(x, 3)  # one fresh block: the evicted one is a's last
    b = Sequence.create("b", [*range(16), 99], max_tokens=1)  # could hit all 4 blocks
    assert kv.num_cached_tokens(b) == 12
    kv.free(x)


def test_full_prompt_hit_leaves_one_token_to_compute():
    """Even a fully cached prompt recomputes its last token, which yields the logits."""
    kv = KVBlockManager(num_blocks=8, block_size=4)
    a = Sequence.create("a", list(range(8)), max_tokens=2)
    _run_prefill(kv, a)
    b = Sequence.create("b", list(range(8)), max_tokens=2)
    assert kv.num_cached_tokens(b) == 4
    assert kv.allocate_slots(b, 4)
    assert b.num_computed_tokens == 4


def test_hit_counts_against_free_when_block_is_in_free_list():
    """Reviving a cached free block uses capacity: a hit is not free memory."""
    kv = KVBlockManager(num_blocks=2, block_size=4)
    a = Sequence.create("a", list(range(5)), max_tokens=1)
    _run_prefill(kv, a)
    kv.free(a)
    b = Sequence.create("b", [*range(4), 9, 9, 9, 9, 9], max_tokens=1)
    # 1 hit block (revived) + 2 new blocks > 2 blocks in the pool
    assert not kv.allocate_slots(b, 5)
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_prefix_caching_can_be_disabled():
    """With prefix caching off, identical prompts get separate blocks."""
    kv = KVBlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = Sequence.create("a", list(range(8)), max_tokens=1)
    _run_prefill(kv, a)
    b = Sequence.create("b", list(range(8)), max_tokens=1)
    assert kv.num_cached_tokens(b) == 0


def test_check_integrity_catches_a_corrupted_ref_count():
    """The invariant check is not a rubber stamp."""
    kv = KVBlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", prompt_len=4)
    assert kv.allocate_slots(a, 4)
    kv.blocks[kv.block_table("a")[0]].ref_count = 2
    with pytest.raises(BlockIntegrityError, match="ref_count"):
        kv.check_integrity()


def test_bad_pool_sizes_are_refused():
    """A pool needs at least one block of at least one token."""
    with pytest.raises(ValueError):
        KVBlockManager(0, 16)
    with pytest.raises(ValueError):
        KVBlockManager(4, 0)
