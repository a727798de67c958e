"""Gemma 3 (text), Phi-3 / Phi-4-mini and SmolLM3 through Jitney's forward against their
transformers models on the same random weights (tiny shapes, CPU, float32): the plain path
against the transformers model on the paged attention and against its own one-shot forward, the
fused path (int8 blocks, jitney:: ops, the one-call decode op) against the plain path on the
same blocks, and LongRoPE's factors as picked at start. The norms' weights are randomized (a
real checkpoint's are not the identity), so Gemma's (1 + w) is exercised."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from engine.attention.paged_attention import use_paged_attention
from engine.kernels import BlockWeights
from engine.models.families import family_switches, unsupported_because
from engine.models.llama import LlamaForward
from engine.models.rotary import longrope_uses_long_factors, rotary_tables
from engine.models.weight_sources import Int8Weights, StateDictWeights
from tests.engine.test_fused_forward import _pool, _step
from tests.engine.test_llama_forward import both_steps
from tests.engine.test_paged_attention import (
    TINY,
    BlockPool,
    make_cache,
    rand_tokens,
    reference_logits,
)

TOL = 1e-5  # the plain path against transformers on the paged attention (test_llama_forward's)
ONE_SHOT_TOL = 1e-4  # against its own one-shot forward (test_paged_attention's)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,  # 12 of 16 dimensions rotated: six factors each
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
    "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5],
}
SPECIAL_IDS = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
CASES = {
    # Three layers: sliding (window 6, base 10k), global (linear scaling), sliding; Q/K norms,
    # query_pre_attn_scalar, a final softcap.
    "gemma3": lambda: (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3},
            head_dim=32,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            },
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
        ),
    ),
    # Phi-3-mini-4k's shape of switches: fused QKV and gate/up, a window on every layer; here
    # also half of each head rotated.
    "phi3": lambda: (
        Phi3ForCausalLM,
        Phi3Config(
            **TINY,
            **SPECIAL_IDS,
            sliding_window=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Phi-4-mini's: LongRoPE on 3/4 of each head, trained to 16 positions, extended to 64.
    "phi3-longrope": lambda: (
        Phi3ForCausalLM,
        Phi3Config(
            **{**TINY, "max_position_embeddings": 64},
            **SPECIAL_IDS,
            original_max_position_embeddings=16,
            rope_parameters=dict(LONGROPE),
        ),
    ),
    # Its second layer without RoPE.
    "smollm3": lambda: (
        SmolLM3ForCausalLM,
        SmolLM3Config(**{**TINY, "num_hidden_layers": 3}, **SPECIAL_IDS, no_rope_layers=[1, 0, 1]),
    ),
}


def make_models(case: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference on eager attention, the same weights on jitney_paged), norms randomized."""
    model_cls, config = CASES[case]()
    torch.manual_seed(0)
    ref = model_cls(copy.deepcopy(config)).eval()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "norm" in name:  # identity +- 0.5 (Gemma: 0 +- 0.5, the norms multiply by 1 + w)
                param.add_(torch.rand_like(param) - 0.5)
    ref.set_attn_implementation("eager")
    paged = model_cls(copy.deepcopy(config)).eval()
    paged.load_state_dict(ref.state_dict())
    use_paged_attention(paged)
    return ref, paged


def chunks_then_decodes(
    jitney: LlamaForward, paged: PreTrainedModel | None, ref: PreTrainedModel, length: int
) -> None:
    """Prefill chunks, then four decodes, of one sequence of `length` tokens: each step's logits
    are the paged transformers model's (where given) and every token's are the one-shot
    forward's on the whole sequence."""
    config = ref.config
    caches = (make_cache(config), make_cache(config))
    toks, table = rand_tokens(length, seed=1), BlockPool(64).take(-(-length // 4))
    sizes = [n for n in (5, 7, length - 16) if n] + [1, 1, 1, 1]
    got, done = [], 0
    for n in sizes:
        ours, theirs = both_steps(jitney, paged or ref, [(toks, done, n, table)], caches)
        if paged is not None:
            assert (ours - theirs).abs().max().item() < TOL
        got.append(ours)
        done += n
    want = reference_logits(ref, toks)
    assert (torch.cat(got) - want).abs().max().item() < ONE_SHOT_TOL


@pytest.mark.parametrize("case", ["gemma3", "phi3", "smollm3"])
def test_plain_path_matches_transformers(case: str) -> None:
    """Chunks then decodes, 24 tokens: windows of 6 and 8 slide past the start."""
    ref, paged = make_models(case)
    chunks_then_decodes(LlamaForward.from_transformers(ref), paged, ref, 24)


def test_longrope_long_factors_match_a_long_transformers_call() -> None:
    """Serving past the original 16 positions, every position is rotated by the long factors:
    the one-shot transformers forward over 24 tokens (longer than 16) rotates them so too."""
    ref, _ = make_models("phi3-longrope")
    jitney = LlamaForward.from_transformers(ref)  # max_model_len: the model's 64
    assert longrope_uses_long_factors(ref.config, None) is True
    chunks_then_decodes(jitney, None, ref, 24)


def test_longrope_short_factors_when_served_within_the_original_length() -> None:
    """--max-model-len 16: the short factors, as transformers uses them for every call that
    stays within the original length (chunked or one shot)."""
    ref, paged = make_models("phi3-longrope")
    jitney = LlamaForward.from_transformers(ref, max_model_len=16)
    assert longrope_uses_long_factors(ref.config, 16) is False
    chunks_then_decodes(jitney, paged, ref, 16)


def test_rope_tables_per_layer() -> None:
    """Gemma: a table per layer type; SmolLM3: an empty one for its layer without RoPE; Phi:
    the rotated part of a head; LongRoPE's long wavelengths are the short ones times the
    factors' ratio."""
    gemma = CASES["gemma3"]()[1]
    tables, index = rotary_tables(gemma)
    assert index == (1, 0, 1)  # sorted layer types: full_attention, sliding_attention
    assert [t.width for t in tables] == [32, 32]
    smol = CASES["smollm3"]()[1]
    tables, index = rotary_tables(smol)
    assert [tables[i].width for i in index] == [16, 0, 16]
    phi = CASES["phi3-longrope"]()[1]
    (short,), _ = rotary_tables(phi, 16)
    (long,), _ = rotary_tables(phi, 17)
    assert short.width == long.width == 12 and short.factor == long.factor > 1
    ratio = torch.tensor(LONGROPE["long_factor"]) / torch.tensor(LONGROPE["short_factor"])
    torch.testing.assert_close(short.inv_freq / long.inv_freq, ratio)


@pytest.mark.parametrize("case", ["gemma3", "phi3-longrope", "smollm3"])
def test_fused_layers_and_one_call_decodes_match_the_plain_ops(case: str, exact_linears) -> None:
    """Two sequences, prefill chunks then decodes side by side, on int8 blocks: the fused
    forward (jitney:: ops; every all-decode step one llama_decode_layers_ call, with the
    family's switches) gives the plain forward's logits and K/V on the same blocks."""
    ref, _ = make_models(case)
    dense = StateDictWeights(dict(ref.named_parameters()))
    plain = LlamaForward(ref.config, Int8Weights(dense))
    fused = LlamaForward(ref.config, Int8Weights(dense), fused_ops=True)
    assert fused._decode_layers is not None
    caches = {"plain": _pool(ref.config, None), "fused": _pool(ref.config, "native")}
    pool = BlockPool(64, seed=2)
    seqs = [(rand_tokens(30, seed=5), pool.take(8)), (rand_tokens(30, seed=6), pool.take(8))]
    steps = [[(0, 7), (0, 5)], [(7, 6), (5, 9)], *[[(13 + i, 1), (14 + i, 1)] for i in range(8)]]
    one_call = 0
    for step in steps:
        entries = [(toks, s, n, table) for (toks, table), (s, n) in zip(seqs, step, strict=True)]
        want, _ = _step(plain, caches["plain"], entries)
        got, decode_only = _step(fused, caches["fused"], entries)
        one_call += decode_only
        assert (got - want).abs().max().item() < 1e-4
    assert one_call == 8
    torch.testing.assert_close(caches["fused"].pool, caches["plain"].pool, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["gemma3", "phi3", "smollm3"])
def test_int8_is_the_dense_model_on_its_rounded_weights(case: str, exact_linears) -> None:
    """Int8 blocks of each family's weights (Phi's fused projections as stored, Gemma's scaled
    table and tied head) through the fused ops give the dense forward's logits on the same
    weights rounded to Q8_0 (float32 sums aside): the family's switches are all that differs
    from a Llama, and quantizing changes only the weights."""
    ref, _ = make_models(case)
    rounded = {
        name: BlockWeights.quantize_q8_0(p.detach()).dequantize() if p.dim() == 2 else p
        for name, p in ref.named_parameters()
    }
    dense = LlamaForward(ref.config, StateDictWeights(rounded))
    weights = Int8Weights(StateDictWeights(dict(ref.named_parameters())))
    int8 = LlamaForward(ref.config, weights, fused_ops=True)
    toks, table = rand_tokens(20, seed=3), BlockPool(64).take(5)
    got, _ = _step(int8, _pool(ref.config, "native"), [(toks, 0, 20, table)])
    want, _ = _step(dense, _pool(ref.config, None), [(toks, 0, 20, table)])
    assert (got - want).abs().max().item() < 5e-4


def test_family_switches_and_what_stays_refused() -> None:
    """Gemma 3's switches come from its config; a Gemma with bidirectional attention, another
    activation, dynamic RoPE or a partial rotation where the family ignores it is refused."""
    gemma = CASES["gemma3"]()[1]
    assert unsupported_because(gemma) is None
    switches = family_switches(gemma)
    assert switches.norm_offset == 1.0 and switches.output_norms
    assert switches.activation == "gelu_tanh" and switches.embed_scale == 64**0.5
    assert switches.attention_scale == 24**-0.5 and switches.final_softcap == 30.0
    assert family_switches(CASES["phi3"]()[1]).attention_scale == 16**-0.5
    assert "bidirectional" in str(
        unsupported_because(Gemma3TextConfig(use_bidirectional_attention=True))
    )
    assert "gelu" in str(unsupported_because(Gemma3TextConfig(hidden_activation="gelu")))
    dynamic = LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in str(unsupported_because(dynamic))
    partial = LlamaConfig(
        **TINY,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    assert "partial_rotary_factor" in str(unsupported_because(partial))
