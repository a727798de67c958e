"""`--quantization auto`: a GGUF model runs on its own blocks where the kernels cover them (a
matrix of a type no kernel covers runs dequantized alone, named in one log line), every other
model stays dense."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.config import EngineConfig
from engine.kernels import BlockWeights, kernel_backend
from engine.kernels.build import DRAFT_ROW_COST, INTEGER_ISAS, ISAS, ONE_PASS_TOKENS
from engine.layers.quantized import COVERED_KINDS, QuantizedLinear, uncovered_kinds
from engine.models.gguf_weights import read_gguf_tensors
from engine.models.llama import LlamaForward
from engine.models.model_loader import LoadedModel, load_model
from engine.models.weight_sources import GGUFWeights
from engine.runner.model_runner import log_dense_fallbacks, resolve_forward, resolve_quantization
from engine.speculative_options import SPEC, SpeculativeOptions
from tests.engine.engine_helpers import make_engine
from tests.engine.speculation_helpers import GREEDY, PROMPTS, both, run


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


def test_auto_keeps_a_gguf_models_blocks_and_a_dense_model_dense(smollm2, loaded) -> None:
    """The bundled SmolLM2 (Q4_1/Q8_0) resolves to its blocks; tiny-random (no file) to none;
    transformers' model (which the kernels do not serve) to none."""
    assert resolve_quantization(smollm2, "auto", None) == "gguf"
    assert resolve_quantization(smollm2, "transformers", None) == "none"
    assert resolve_quantization(loaded, "auto", None) == "none"
    name, forward = resolve_forward(smollm2)
    assert name == "jitney-gguf" and isinstance(forward.layers[0].qkv, QuantizedLinear)
    assert resolve_forward(loaded)[0] == "jitney-none"
    assert resolve_forward(smollm2, quantization="none")[0] == "jitney-none"


def test_the_engine_reports_the_forward_it_resolved(smollm2, loaded) -> None:
    assert make_engine(smollm2, kv_cache_memory="16MiB").view.forward_name == "jitney-gguf"
    assert make_engine(loaded, kv_cache_memory="16MiB").view.forward_name == "jitney-none"
    exact = make_engine(smollm2, kv_cache_memory="16MiB", quantization="none")
    assert exact.view.forward_name == "jitney-none"


def test_auto_kv_cache_is_float16_beside_quantized_blocks_and_the_models_dtype_else(
    smollm2, loaded
) -> None:
    """`--kv-cache-dtype auto`: a quantized forward (not the exact mode already) keeps K/V in
    float16; the exact mode and dense models keep the model's float32; a named dtype wins."""
    pools = {
        (model.name, q, kv): make_engine(
            model, kv_cache_memory="16MiB", quantization=q, kv_cache_dtype=kv
        ).kv_cache.spec.dtype
        for model, q, kv in [
            (smollm2, "auto", "auto"),
            (smollm2, "int8", "auto"),
            (smollm2, "none", "auto"),
            (loaded, "auto", "auto"),
            (smollm2, "auto", "float32"),
            (smollm2, "none", "bfloat16"),
        ]
    }
    assert list(pools.values()) == [
        torch.float16,
        torch.float16,
        torch.float32,
        torch.float32,
        torch.float32,
        torch.bfloat16,
    ]


def test_a_matrix_of_an_uncovered_type_runs_dequantized_alone(smollm2, caplog) -> None:
    """A file with one layer matrix in a type without a kernel (IQ4_XS here): that projection is
    dense, every other stays in its blocks, and one log line names the matrix and its type."""
    _, tensors = read_gguf_tensors(smollm2.gguf_path)
    assert uncovered_kinds(tensors) == []
    name = "model.layers.3.mlp.down_proj.weight"
    t = tensors[name]
    dense = t.dequantize().numpy()
    # The same weights as F32 under an uncovered type's name: GGUFTensor.dequantize reads F32.
    f32 = dataclasses.replace(t, kind="F32", raw=dense, qtype=GGMLQuantizationType.F32)
    changed = {**tensors, name: dataclasses.replace(f32, kind="IQ4_XS")}
    assert uncovered_kinds(changed) == ["IQ4_XS"]
    weights = GGUFWeights(changed, torch.float32, quantized=True)
    with caplog.at_level(logging.WARNING, logger="jitney.engine.runner"):
        forward = LlamaForward(smollm2.model.config, weights, fused_ops=True)
        log_dense_fallbacks(weights.dense_fallbacks)
    assert not isinstance(forward.layers[3].down, QuantizedLinear)
    assert torch.equal(forward.layers[3].down.weight, torch.from_numpy(dense))
    assert isinstance(forward.layers[3].gate_up, QuantizedLinear)
    assert isinstance(forward.layers[2].down, QuantizedLinear)
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 1
        and "1 matrices" in lines[0]
        and "IQ4_XS: layers.3.mlp.down_proj" in lines[0]
    )
    table = "model.embed_tokens.weight"
    other_table = dataclasses.replace(tensors[table], kind="Q6_K")
    assert uncovered_kinds({**tensors, table: other_table}) == []
    assert COVERED_KINDS == ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def test_q4_0_blocks_run_exactly(exact_linears) -> None:
    """Q4_0 (d * (q - 8)): the same weights bit for bit, and the same products as the
    dequantized matrix."""
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((48, 96)) * np.logspace(-3, 1, 48)[:, None]).astype(np.float32)
    blocks = quantize(dense, GGMLQuantizationType.Q4_0)
    w = BlockWeights.from_gguf("Q4_0", blocks, (48, 96))
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_0).copy())
    assert torch.equal(w.dequantize(), want)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    # Float32 rounding of two summation orders, bounded by the size of the terms summed (rows
    # of weights up to 10 cancel: 12% of random inputs missed a flat 1e-5 on an AVX-512 Zen 4;
    # the worst of 2,000 was 2.6e-7 of the terms' sum).
    bound = 1e-6 * (x.abs() @ want.abs().T)
    assert ((w.linear(x) - x @ want.T).abs() <= bound).all()


def test_auto_is_the_default_and_explicit_choices_still_validate() -> None:
    assert EngineConfig().quantization == "auto"
    EngineConfig(quantization="auto", model_impl="transformers")  # resolves to none there
    with pytest.raises(ValueError, match="runs on Jitney's forward"):
        EngineConfig(quantization="gguf", model_impl="transformers")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4")


def test_one_activation_digit_is_the_engine_s_choice_and_keeps_speculation_exact(
    smollm2, restores_activation_digits
) -> None:
    """`--activation-digits 1`: the engine sets the kernels' digits when it starts; SmolLM2's
    greedy tokens with speculation are still plain decoding's (a token's product is the same in
    any step), and its log-probs are no longer two digits' (the setting took)."""
    backend = kernel_backend()
    if backend.isa not in INTEGER_ISAS:
        pytest.skip(f"the kernels' level here ({backend.isa}) rounds no activations")
    requests = [(p, GREEDY) for p in PROMPTS]
    plain, spec, engine = both(smollm2, requests, logprobs=True, activation_digits=1)
    assert backend.activation_digits == 1
    assert spec == plain and engine.stats.num_accepted_tokens_total > 0
    two = run(make_engine(smollm2, kv_cache_memory="16MiB", speculative="none"), requests, True)
    assert backend.activation_digits == 2
    assert two != plain
    with pytest.raises(ValueError, match="activation_digits must be one of"):
        EngineConfig(activation_digits=3)


def test_speculation_drafts_within_one_pass_of_the_kernels_in_use(smollm2, loaded, isa) -> None:
    """The default row cap is the tokens one pass of the quantized kernels serves at the level
    in use (a row more starts a second pass, which costs about a whole one-row step on an AVX2
    CPU); a dense forward keeps SPEC's, and a cap asked for wins."""
    quantized = make_engine(smollm2, kv_cache_memory="16MiB")
    rows = quantized.scheduler_config.speculative.max_step_tokens
    assert rows == (SPEC.max_step_tokens if isa is None else ONE_PASS_TOKENS[isa])
    assert quantized.policy.config.speculative.max_step_tokens == rows  # what the policy obeys
    dense = make_engine(loaded, kv_cache_memory="16MiB")
    assert dense.scheduler_config.speculative.max_step_tokens == SPEC.max_step_tokens
    asked = make_engine(smollm2, kv_cache_memory="16MiB", speculative_max_step_tokens=12)
    assert asked.scheduler_config.speculative.max_step_tokens == 12
    with pytest.raises(ValueError, match="max_step_tokens"):
        SpeculativeOptions(max_step_tokens=1)


def test_a_draft_row_costs_what_the_kernels_in_use_measured(smollm2, loaded, isa) -> None:
    """The break-even of speculation's odds follows the kernel level's measured row cost where
    the forward is quantized, SPEC's elsewhere; a cost asked for wins, and is validated."""
    quantized = make_engine(smollm2, kv_cache_memory="16MiB")
    cost = quantized.policy.config.speculative.draft_row_cost
    assert cost == (SPEC.draft_row_cost if isa is None else DRAFT_ROW_COST[isa])
    dense = make_engine(loaded, kv_cache_memory="16MiB")
    assert dense.policy.config.speculative.draft_row_cost == SPEC.draft_row_cost
    asked = make_engine(smollm2, kv_cache_memory="16MiB", speculative_draft_row_cost=0.0)
    assert asked.policy.config.speculative.draft_row_cost == 0.0
    with pytest.raises(ValueError, match="draft_row_cost"):
        SpeculativeOptions(draft_row_cost=-0.1)


def test_every_kernel_level_has_its_one_pass_width_and_row_cost() -> None:
    assert set(ONE_PASS_TOKENS) == set(ISAS) and all(n >= 2 for n in ONE_PASS_TOKENS.values())
    assert set(DRAFT_ROW_COST) == set(ISAS) and all(0 < c < 1 for c in DRAFT_ROW_COST.values())
