"""A prompt's prefix-cache hashes are computed once per sequence, however long it waits."""

from __future__ import annotations

import pytest

from generation.block_hash import hash_block
from scheduler import KVBlockManager
from tests.factories import make_seq, run_step


def test_a_waiting_prompt_is_hashed_once_across_steps(make_scheduler) -> None:
    """The head of the queue is looked up every step it does not fit; the chained hashes of
    its first lookup are the ones every later lookup and its admission use."""
    sched = make_scheduler(num_blocks=5, block_size=4)
    sched.add_request(make_seq("run", prompt_len=12, max_tokens=3))  # 4 of the 5 blocks
    waiting = make_seq("wait", prompt_len=9, max_tokens=2)  # needs 3 blocks
    sched.add_request(waiting)
    run_step(sched)
    assert waiting.prompt_block_hashes is not None
    block_size, hashes = waiting.prompt_block_hashes
    p = waiting.prompt_token_ids
    first = hash_block(None, p[:4])
    assert block_size == 4 and hashes == [first, hash_block(first, p[4:8])]
    run_step(sched)  # still waiting: looked up again
    assert waiting.prompt_block_hashes[1] is hashes
    for _ in range(10):  # "run" finishes after its third token; then "wait" gets in
        run_step(sched)
        if waiting.num_computed_tokens:
            break
    assert waiting.num_computed_tokens and waiting.prompt_block_hashes[1] is hashes


def test_hashes_of_another_block_size_are_refused() -> None:
    seq = make_seq("a", prompt_len=8)
    KVBlockManager(8, block_size=4).num_cached_tokens(seq)
    with pytest.raises(ValueError, match="blocks of 4, not 2"):
        KVBlockManager(8, block_size=2).num_cached_tokens(seq)
