"""The offline baselines: transformers generate (static batches) and transformers' own CB."""

import json
import math
import re

import pytest
import torch
from transformers import GenerationConfig

from bench.baselines import NO_EOS, RunResult, best_hf_cb, run_hf_cb, run_hf_generate
from bench.trace import TraceRequest, load_trace, percentile
from engine.models.model_loader import LoadedModel, load_model

# Small enough that every candidate run takes well under a second on the tiny model.
SMALL_CB = {"max_batch_tokens": 16, "max_requests_per_batch": 2, "page_size": 8}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def requests() -> list[TraceRequest]:
    # Prompts of 3-19 ids inside the tiny vocabulary (281 ids); ragged output lengths 3-9.
    return [
        TraceRequest(f"r{i}", [1 + (7 * i * j + 5 * j) % 270 for j in range(3 + 4 * i)], n)
        for i, n in enumerate([3, 9, 5, 7, 4])
    ]


def solo_greedy(loaded: LoadedModel, request: TraceRequest) -> list[int]:
    ids = torch.tensor([request.prompt_ids])
    mask = torch.ones_like(ids)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=request.output_len, pad_token_id=0, eos_token_id=NO_EOS
    )
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=mask, generation_config=config)
    return out[0, ids.shape[1] :].tolist()


def assert_plausible(result: RunResult, requests: list[TraceRequest]) -> None:
    assert result.num_output_tokens == sum(r.output_len for r in requests)
    assert {rid: len(t) for rid, t in result.outputs.items()} == {
        r.request_id: r.output_len for r in requests
    }
    assert set(result.latencies_s) == set(result.ttft_s) == {r.request_id for r in requests}
    for rid, latency in result.latencies_s.items():
        assert 0 < result.ttft_s[rid] <= latency <= result.wall_s
    assert result.tokens_per_s == pytest.approx(result.num_output_tokens / result.wall_s)


def test_load_trace_reads_ids_lengths_and_limit(tmp_path):
    rows = [
        {"id": i, "arrival_s": 0.5 * i, "prompt_len": 2, "output_len": 4 + i, "prompt_ids": [1, i]}
        for i in range(3)
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"meta": {}, "requests": rows}))

    assert load_trace(path, limit=2) == [
        TraceRequest("0", [1, 0], 4, 0.0),
        TraceRequest("1", [1, 1], 5, 0.5),
    ]
    assert len(load_trace(path)) == 3


def test_run_result_statistics():
    result = RunResult("x", 2.0, 10, {"a": 1.0, "b": 2.0, "c": 4.0}, {"a": 0.5, "b": 1.5})
    assert result.tokens_per_s == 5.0
    assert result.mean_latency_s == pytest.approx(7 / 3)
    assert result.p50_latency_s == 2.0
    assert result.p99_latency_s == pytest.approx(3.96)
    assert result.mean_ttft_s == 1.0
    assert math.isnan(RunResult("empty", 1.0, 0, {}).mean_ttft_s)
    assert percentile([3.0], 99) == 3.0


def test_hf_generate_counts_only_useful_tokens_and_ends_requests_with_their_batch(tiny, requests):
    result = run_hf_generate(tiny, requests, batch_size=2)

    assert_plausible(result, requests)
    # Batches (r0, r1), (r2, r3), (r4): each runs to its longest request.
    assert result.extra["generated_token_slots"] == 2 * 9 + 2 * 7 + 4
    assert result.latencies_s["r0"] == result.latencies_s["r1"] < result.latencies_s["r2"]
    assert result.ttft_s["r2"] == result.ttft_s["r3"] < result.latencies_s["r2"]


def test_hf_generate_left_padding_keeps_greedy_outputs(tiny, requests):
    """fp32 on the tiny model: a padded batch row generates what the request alone does."""
    result = run_hf_generate(tiny, requests, batch_size=len(requests))

    for r in requests:
        assert result.outputs[r.request_id] == solo_greedy(tiny, r)


def test_hf_cb_generates_exact_lengths_with_eos_ignored(tiny, requests):
    attn_before = tiny.model.config._attn_implementation
    result = run_hf_cb(tiny, requests, **SMALL_CB)

    assert_plausible(result, requests)
    assert result.extra["length_mismatch"] == {}
    assert result.extra["resolved"]["max_batch_tokens"] == 16
    assert tiny.model.config._attn_implementation == attn_before  # CB restores the backend
    # Same greedy tokens as static batching: EOS is ignored the same way (not masked) in both.
    static = run_hf_generate(tiny, requests, batch_size=len(requests))
    assert result.outputs == static.outputs


def test_hf_cb_with_failed_requests_raises_their_error_instead_of_reporting_zero(tiny, requests):
    # One 8-token page cannot hold a 19-id prompt: transformers fails those requests.
    with pytest.raises(RuntimeError, match=r"requests failed .*request r\d+: No requests can be"):
        run_hf_cb(tiny, requests, **{**SMALL_CB, "num_blocks": 1})


def test_best_hf_cb_returns_the_fastest_and_records_every_try(tiny, requests):
    candidates = [SMALL_CB, {"max_batch_tokens": 64, "block_size": 16}]
    best = best_hf_cb(tiny, requests, candidates)

    tried = best.extra["tried"]
    assert [t["settings"] for t in tried] == candidates
    assert best.tokens_per_s == max(t["tokens_per_s"] for t in tried)
    assert best.num_output_tokens == sum(r.output_len for r in requests)
    with pytest.raises(ValueError):
        best_hf_cb(tiny, requests, [])


def test_best_hf_cb_records_a_failing_setting_and_keeps_the_one_that_runs(tiny, requests):
    candidates = [{**SMALL_CB, "num_blocks": 1}, SMALL_CB]
    best = best_hf_cb(tiny, requests, candidates)

    failed, ran = best.extra["tried"]
    assert re.match(r"RuntimeError: \d of 5 requests failed", failed["error"])
    assert ran["settings"] == SMALL_CB and best.tokens_per_s == ran["tokens_per_s"]
