"""The persistent block table: rows follow allocations, are recycled and grow (CPU)."""

from __future__ import annotations

from engine.models.model_loader import load_model
from engine.runner.input_batch import InputBatch
from generation import SamplingParams
from tests.engine.engine_helpers import assert_greedy_parity, make_engine, reference_greedy


def step(batch: InputBatch, tables: dict[str, list[int]]) -> dict[str, int]:
    """One step over `tables` (key -> live block list); checks every row's device copy."""
    batch.begin_step()
    rows = {key: batch.row(key, blocks) for key, blocks in tables.items()}
    (echo,) = batch.upload([7, 8, 9])
    assert echo.tolist() == [7, 8, 9]
    for key, blocks in tables.items():
        assert batch.block_table[rows[key], : len(blocks)].tolist() == blocks, key
    return rows


def test_a_row_is_written_once_then_only_appended_to() -> None:
    batch = InputBatch("cpu", rows=4, cols=2)
    a = [5, 3]
    row = step(batch, {"a": a})["a"]
    a += [9, 1, 4]  # grows past the table's width: the table widens
    assert step(batch, {"a": a})["a"] == row
    assert batch.block_table.shape[1] >= 5
    # Only the new block is uploaded: overwrite the device row behind the batch's back and
    # see that the entries it already wrote are not written again.
    batch.block_table[row, 0] = 42
    a.append(6)
    batch.begin_step()
    batch.row("a", a)
    batch.upload()
    assert batch.block_table[row, :6].tolist() == [42, 3, 9, 1, 4, 6]


def test_a_new_allocation_under_the_same_key_rewrites_its_row() -> None:
    """A preempted (freed and re-allocated) sequence, or a finished id that comes back, brings
    a new block list object: the row is rewritten from its first entry."""
    batch = InputBatch("cpu", rows=2, cols=4)
    step(batch, {"a": [1, 2, 3]})
    rows = step(batch, {"a": [7]})  # same key, same length or shorter, new allocation
    assert batch.block_table[rows["a"], 0].item() == 7


def test_rows_unused_for_two_steps_are_recycled_else_the_table_grows() -> None:
    batch = InputBatch("cpu", rows=2, cols=2)
    first = step(batch, {"a": [1], "b": [2]})
    step(batch, {"c": [3], "d": [4]})  # a and b may only sit out a step: the table grows
    assert batch.block_table.shape[0] == 4
    rows = step(batch, {"e": [5], "f": [6, 7, 8]})  # now a's and b's rows are reused
    assert batch.block_table.shape[0] == 4 and set(rows.values()) == set(first.values())


def test_engine_with_a_one_row_table_matches_generate(loaded) -> None:
    """A table of one row and one column must grow and recycle rows nearly every step while
    requests join, finish and are preempted: the outputs still equal generate() alone."""
    ref = load_model("tiny-random")
    # tiny-random: 2 KiB per block of 4 tokens -> 14 blocks = 56 tokens for four requests.
    engine = make_engine(loaded, max_num_seqs=4, block_size=4, kv_cache_memory=str(14 * 2048))
    engine.runner.batch = InputBatch(engine.device, rows=1, cols=1)
    prompts = [[3 + (i * 37 + j * 11) % 250 for j in range(5 + 4 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert engine.stats.num_preemptions_total > 0  # the pool is too small for all four
    for prompt, result in zip(prompts, results, strict=True):
        want = reference_greedy(ref, prompt, 14)
        assert_greedy_parity(ref, prompt, result.token_ids, want)
    assert engine.runner.batch.block_table.shape[0] >= 2
