"""The zero-overhead baseline: the simulated continuous schedule, the interpolation between
measured batch sizes, and a timeline that adds up, on the tiny model."""

import pytest

from bench.trace import TraceRequest
from bench.zero_overhead import (
    ZERO_OVERHEAD,
    decode_schedule,
    interpolate,
    run_zero_overhead,
    sampled_sizes,
)
from engine.models.model_loader import load_model


def trace(*output_lens: int, prompt_len: int = 5) -> list[TraceRequest]:
    return [
        TraceRequest(f"r{i}", [3 + i + k for k in range(prompt_len + i)], n)
        for i, n in enumerate(output_lens)
    ]


def test_schedule_refills_free_slots_fifo_and_decodes_each_request_output_len_minus_one():
    """Two slots, all at t=0: a prefill yields the first token, then one decode per step."""
    requests = trace(3, 1, 2, 4)
    s = decode_schedule(requests, max_num_seqs=2)
    assert s.prefill_ids == [["r0", "r1"], ["r2"], [], ["r3"], [], [], []]
    assert s.batch_sizes == [0, 1, 2, 0, 1, 1, 1]
    assert s.finished_ids == [["r1"], [], ["r0", "r2"], [], [], [], ["r3"]]
    assert sum(s.batch_sizes) == sum(r.output_len - 1 for r in requests)
    # A decode's context is what its cache holds: the prompt and the tokens decoded before.
    p0, p2, p3 = (len(requests[i].prompt_ids) for i in (0, 2, 3))
    assert s.contexts == [0.0, p0, (p0 + 1 + p2) / 2, 0.0, p3, p3 + 1, p3 + 2]
    assert s.mean_context(1) == (p0 + p3 + p3 + 1 + p3 + 2) / 4


def test_sampled_sizes_keep_both_ends_and_at_most_max_points():
    assert sampled_sizes([3, 1, 2, 3], 8) == [1, 2, 3]
    picked = sampled_sizes(list(range(1, 65)), 5)
    assert picked == [1, 17, 33, 48, 64]
    with pytest.raises(ValueError, match="max_points"):
        sampled_sizes([1, 2], 1)


def test_interpolation_is_exact_at_measured_sizes_and_linear_between():
    points = {1: 10.0, 5: 30.0, 9: 34.0}
    assert [interpolate(points, b) for b in (1, 3, 5, 8, 9)] == [10.0, 20.0, 30.0, 33.0, 34.0]
    with pytest.raises(ValueError, match="outside"):
        interpolate(points, 10)


def test_timeline_adds_up_and_every_request_finishes_after_its_first_token():
    tiny = load_model("tiny-random")
    requests = trace(6, 2, 9, 4, 1)
    result = run_zero_overhead(tiny, requests, max_num_seqs=3, max_points=2)
    extra = result.extra
    assert result.name == ZERO_OVERHEAD
    assert result.num_output_tokens == 22
    assert result.wall_s == pytest.approx(extra["decode_s"] + extra["prefill_s"], abs=2e-3)
    assert set(result.ttft_s) == set(result.latencies_s) == {r.request_id for r in requests}
    for rid, done in result.latencies_s.items():
        assert 0 < result.ttft_s[rid] <= done <= result.wall_s
    assert max(result.latencies_s.values()) == result.wall_s
    # 3 slots: sizes 1..3 decode; max_points=2 measures the ends and interpolates size 2.
    assert sorted(extra["measured"]) == [1, 3] and extra["distinct_batch_sizes"] == 3
    assert all(ms > 0 for _, ms in extra["measured"].values())
