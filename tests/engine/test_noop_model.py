"""`--model noop`: no model, for load tests. Deterministic tokens that never end a request early,
a forward that takes --noop-step-ms, and everything around it real (scheduler, KV accounting)."""

import time

import pytest

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.noop_model import NOOP
from engine.models.tiny_model import SPECIAL_TOKENS
from generation import SamplingParams


def engine(step_ms: float = 0.0, **config: object) -> Engine:
    return Engine(EngineConfig(model=NOOP, noop_step_ms=step_ms, kv_cache_memory="16MiB", **config))  # type: ignore[arg-type]


def test_tokens_are_deterministic_and_requests_end_at_max_tokens():
    prompts = [[5, 6, 7], [9] * 40, [12, 13]]
    params = SamplingParams(max_tokens=30, temperature=0)
    first = engine().generate(prompts, params)
    again = engine(max_num_seqs=1).generate(prompts, params)  # one at a time: same tokens
    for a, b in zip(first, again, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30
        assert a.finish_reason == "length"
        assert min(a.token_ids) >= len(SPECIAL_TOKENS)  # never an end-of-text token
    assert len({tuple(r.token_ids) for r in first}) == 3


def test_a_step_takes_the_configured_time_and_kv_is_accounted():
    e = engine(step_ms=20)
    e.add_request("r", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0))
    start = time.perf_counter()
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
        if steps == 2:
            assert e.view.kv_used_blocks == 1
    assert steps == 5 and time.perf_counter() - start >= 5 * 0.020
    assert e.view.kv_used_blocks == 0


def test_a_named_stop_token_ends_it_and_a_negative_step_is_refused():
    tokens = engine().generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0))[0]
    stop = tokens.token_ids[3]
    ended = engine().generate(
        [[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop,))
    )[0]
    assert ended.token_ids == tokens.token_ids[:4] and ended.finish_reason == "stop"
    with pytest.raises(ValueError, match="noop_step_ms"):
        EngineConfig(model=NOOP, noop_step_ms=-1)
