"""The real default model end to end: SmolLM2-135M-Instruct through the paged engine."""

import pytest

from engine.models.model_loader import load_model
from generation import SamplingParams
from tests.engine.engine_helpers import (
    assert_greedy_parity,
    chat,
    make_engine,
    reference_greedy,
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_chat_prompt_gets_a_sensible_answer(smollm2):
    """A capital-city question, batched with two others, is answered correctly and ends at EOS,
    on the default forward: the bundled GGUF's own 4-bit blocks (`--quantization auto`)."""
    engine = make_engine(smollm2, kv_cache_memory="256MiB")
    assert engine.view.forward_name == "jitney-gguf"
    prompts = [
        chat(smollm2, q)
        for q in (
            "What is the capital of France?",
            "What is 2+2?",
            "Name three colors.",
        )
    ]
    results = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    assert "Paris" in results[0].text
    assert results[0].finish_reason == "stop"  # the model ended its turn by itself
    assert "4" in results[1].text
    assert engine.view.kv_used_blocks == 0


def test_greedy_matches_transformers_generate(smollm2):
    """The exact mode (`--quantization none`): token-for-token parity with generate() on the
    real model (or a near-tie)."""
    ref = load_model("smollm2-135m")
    engine = make_engine(
        smollm2,
        kv_cache_memory="256MiB",
        block_size=16,
        max_num_batched_tokens=32,
        quantization="none",
    )  # chunked prefill on a real model
    prompts = [
        chat(smollm2, "Tell me a short story about a robot."),
        chat(smollm2, "Why is the sky blue?"),
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt, res in zip(prompts, engine.generate(prompts, params), strict=True):
        assert_greedy_parity(ref, prompt, res.token_ids, reference_greedy(ref, prompt, 24))
