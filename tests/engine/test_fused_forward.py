"""Jitney's fused CPU forward (quantized layers through the jitney:: layer ops; a decode-only step
as one llama_decode_layers_ call) against the same weights through plain torch ops, for every
covered family; and `--quantization int8`, Q8_0 blocks made from a model's dense weights."""

from __future__ import annotations

import pytest
import torch

from engine.attention.step_inputs import AttentionMetadata
from engine.config import EngineConfig
from engine.kernels import BlockWeights
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.layers.quantized import QuantizedEmbedding, QuantizedLinear, fused_bias
from engine.models.llama import LlamaForward, _decode_only
from engine.models.model_loader import load_model
from engine.models.weight_sources import Int8Weights, StateDictWeights
from engine.runner.model_runner import model_forward_for
from tests.engine.test_llama_forward import WINDOWED
from tests.engine.test_paged_attention import FAMILIES, BlockPool, make_models, rand_tokens

CASES = [(f, {}) for f in FAMILIES] + [("mistral", WINDOWED["mistral"])]


def _pool(config, decode_kernel: str | None) -> PagedKVCache:
    spec = KVCacheSpec.from_model_config(config, torch.float32, 4)
    return PagedKVCache(spec, 64, decode_kernel=decode_kernel)


def _step(forward, cache, entries) -> tuple[torch.Tensor, bool]:
    """One packed step, logits of every new token; and whether it was decode-only."""
    meta = AttentionMetadata.build([(s, n, t) for _, s, n, t in entries], cache)
    meta.logits_indices = torch.arange(meta.num_tokens)
    ids = torch.tensor([tok for toks, s, n, _ in entries for tok in toks[s : s + n]])
    return forward(ids, None, meta, cache), _decode_only(meta, cache, meta.num_tokens)


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=lambda c: str(c))
def test_fused_layers_and_one_call_decodes_match_the_plain_ops(family, overrides, exact_linears):
    """Two sequences: prefill chunks, then decodes side by side (each step's decodes in one C++
    call), on int8 blocks of the family's weights: the fused forward's logits and K/V are the
    plain-torch forward's on the same blocks (Qwen2's biases, Qwen3's q/k norms, Mistral's
    window included)."""
    ref, _ = make_models(family, **overrides)
    dense = StateDictWeights(dict(ref.named_parameters()))
    plain = LlamaForward(ref.config, Int8Weights(dense))
    fused = LlamaForward(ref.config, Int8Weights(dense), fused_ops=True)
    assert fused._decode_layers is not None and plain._decode_layers is None
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
    assert one_call == 8  # every all-decode step took the one call
    torch.testing.assert_close(caches["fused"].pool, caches["plain"].pool, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int8_logits_stay_close_to_the_dense_model(family):
    """Q8_0 blocks (one float32 scale per 32 weights) move a random model's logits by well under
    1% of their range, and every layer is quantized (the head shares the table's blocks)."""
    ref, _ = make_models(family)
    dense_weights = StateDictWeights(dict(ref.named_parameters()))
    dense = LlamaForward(ref.config, dense_weights)
    int8 = LlamaForward(ref.config, Int8Weights(dense_weights), fused_ops=True)
    assert isinstance(int8.embed, QuantizedEmbedding)
    assert all(isinstance(m, QuantizedLinear) for m in (int8.lm_head, int8.layers[0].gate_up))
    if ref.config.tie_word_embeddings:
        assert int8.lm_head.parts == (int8.embed.weights,)
    toks, table = rand_tokens(20, seed=3), BlockPool(64).take(5)
    got, _ = _step(int8, _pool(ref.config, "native"), [(toks, 0, 20, table)])
    want, _ = _step(dense, _pool(ref.config, None), [(toks, 0, 20, table)])
    assert (got - want).abs().max().item() < 0.01 * (want.max() - want.min()).item()


def test_q8_0_quantize_rounds_each_block_to_its_own_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-3, 1, 6)[:, None]
    w[2, 32:64] = 0  # an all-zero block: scale 0, no division by zero
    q = BlockWeights.quantize_q8_0(w)
    quants, scales = q.fields().q, q.fields().scales
    assert quants.dtype == torch.int8 and scales.shape == (6, 3) and scales[2, 1] == 0
    error = (q.dequantize() - w).abs().view(6, 3, 32)
    assert (error <= scales.float()[..., None] / 2 * (1 + 1e-6) + 1e-12).all()
    assert (quants.view(6, 3, 32).abs().amax(-1)[scales > 0] == 127).all()  # each block's largest
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockWeights.quantize_q8_0(torch.zeros(2, 40))


def test_int8_needs_a_cpu_float32_model_and_jitneys_forward():
    bf16 = load_model("tiny-random", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int8 runs on the CPU in float32"):
        model_forward_for(bf16, "auto", "int8")
    with pytest.raises(ValueError, match="quantization int8 runs on Jitney's forward"):
        EngineConfig(quantization="int8", model_impl="transformers")


def test_a_fused_projection_takes_a_bias_on_every_part_or_on_none():
    assert fused_bias([None, None]) is None
    torch.testing.assert_close(
        fused_bias([torch.ones(2), torch.zeros(3)]), torch.tensor([1.0, 1, 0, 0, 0])
    )
    with pytest.raises(ValueError, match="a bias on every part or on none"):
        fused_bias([torch.ones(2), None])
