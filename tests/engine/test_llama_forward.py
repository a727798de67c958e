"""Jitney's own Llama-family forward against the transformers model on the same weights (CPU, fp32),
and GGUF tensors read as the file stores them against transformers' conversion of the file."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from engine.attention.step_inputs import AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.layers.quantized import QuantizedEmbedding, QuantizedLinear
from engine.models.forward import TransformersForward
from engine.models.gguf_weights import read_gguf_tensors, rotary_row_order
from engine.models.llama import (
    LlamaForward,
    UnsupportedArchitectureError,
    unsupported_because,
)
from engine.models.model_loader import LoadedModel, load_model, smollm2_gguf_path
from engine.models.weight_sources import GGUFWeights, StateDictWeights
from engine.runner.model_runner import model_forward_for
from generation import SamplingParams
from tests.engine.engine_helpers import assert_teacher_forced, chat, make_engine
from tests.engine.test_paged_attention import (
    FAMILIES,
    TINY,
    BlockPool,
    make_cache,
    make_models,
    rand_tokens,
    run_step,
)

# The fused projections add in another order than three separate ones may: float32 rounding.
TOL = 1e-5
WINDOWED = {
    "mistral": {"sliding_window": 6},
    "qwen2": {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 1},
    "qwen3": {"sliding_window": 6, "use_sliding_window": True, "max_window_layers": 1},
}
CASES = [(f, {}) for f in FAMILIES] + list(WINDOWED.items())


def both_steps(
    jitney: LlamaForward,
    paged: torch.nn.Module,
    entries: list[tuple[list[int], int, int, list[int]]],
    caches: tuple[PagedKVCache, PagedKVCache],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed step through each model (each on its own pool), logits of every new token."""
    meta = AttentionMetadata.build([(s, n, t) for _, s, n, t in entries], caches[0])
    meta.logits_indices = torch.arange(meta.num_tokens)
    ids = torch.tensor([tok for toks, s, n, _ in entries for tok in toks[s : s + n]])
    return jitney(ids, None, meta, caches[0]), torch.cat(run_step(paged, caches[1], entries))


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=lambda c: str(c))
def test_chunks_then_decodes_match_transformers(family: str, overrides: dict) -> None:
    """Prefill chunks of 5, 7 and 8, then four decodes: every token's logits are the transformers
    model's on the same paged pool (windows included)."""
    ref, paged = make_models(family, **overrides)
    jitney = LlamaForward.from_transformers(ref)
    caches = (make_cache(ref.config), make_cache(ref.config))
    toks, table = rand_tokens(24, seed=1), BlockPool(64).take(6)
    done = 0
    for n in (5, 7, 8, 1, 1, 1, 1):
        got, want = both_steps(jitney, paged, [(toks, done, n, table)], caches)
        assert (got - want).abs().max().item() < TOL
        done += n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_step_matches_transformers(family: str) -> None:
    """Two decodes, a new prefill and a continuing chunk in one packed step over shuffled blocks."""
    ref, paged = make_models(family)
    jitney = LlamaForward.from_transformers(ref)
    caches = (make_cache(ref.config), make_cache(ref.config))
    pool = BlockPool(64, seed=3)
    seqs = [rand_tokens(n, seed=n) for n in (9, 13, 6, 21)]
    tables = [pool.take(6) for _ in seqs]
    # Steps 1: prefill what comes before; step 2: decodes, a fresh prefill, a continuing chunk.
    first = [(seqs[0], 0, 8, tables[0]), (seqs[1], 0, 12, tables[1]), (seqs[3], 0, 10, tables[3])]
    both_steps(jitney, paged, first, caches)
    second = [
        (seqs[0], 8, 1, tables[0]),
        (seqs[2], 0, 6, tables[2]),
        (seqs[1], 12, 1, tables[1]),
        (seqs[3], 10, 11, tables[3]),
    ]
    got, want = both_steps(jitney, paged, second, caches)
    assert got.shape == want.shape == (19, TINY["vocab_size"])
    assert (got - want).abs().max().item() < TOL


def test_logits_come_only_for_the_metadata_rows() -> None:
    """Only `logits_indices` rows reach the head: one row per sampling sequence."""
    ref, _ = make_models("llama")
    jitney = LlamaForward.from_transformers(ref)
    cache = make_cache(ref.config)
    meta = AttentionMetadata.build([(0, 5, [0, 1]), (0, 3, [2])], cache)
    logits = jitney(torch.tensor(rand_tokens(8, seed=2)), None, meta, cache)
    assert logits.shape == (2, TINY["vocab_size"])


def test_tied_head_shares_the_embedding_table() -> None:
    """A tied LM head multiplies by the embedding's own tensor (no second copy)."""
    ref, _ = make_models("llama", tie_word_embeddings=True)
    jitney = LlamaForward.from_transformers(ref)
    assert jitney.lm_head.weight.data_ptr() == jitney.embed.weight.data_ptr()


def test_uncovered_architectures_are_refused_by_name() -> None:
    """A family or RoPE variant the forward does not cover is refused, saying which."""
    assert "gpt2" in str(unsupported_because(GPT2Config()))
    dynamic = LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic" in str(unsupported_because(dynamic))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        LlamaForward(GPT2Config(), StateDictWeights({}))


def test_rotary_row_order_undoes_llama_cpp_permutation() -> None:
    """llama.cpp's converter interleaves each head's halves; the row order restores them."""
    num_heads, head_dim = 3, 8
    hf = torch.arange(num_heads * head_dim)
    # The converter's permutation: per head [2, d/2] -> [d/2, 2].
    gguf = hf.reshape(num_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf[rotary_row_order(num_heads * head_dim, num_heads)], hf)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_gguf() -> tuple[str, dict]:
    return read_gguf_tensors(smollm2_gguf_path())


def test_gguf_tensors_dequantize_to_transformers_conversion(smollm2_gguf, smollm2) -> None:
    """Every tensor of the bundled GGUF, read block by block and un-permuted, equals what
    transformers' GGUF conversion made of it (the safetensors the transformers path loads)."""
    arch, tensors = smollm2_gguf
    state = smollm2.model.state_dict()
    assert arch == "llama"
    assert {"Q4_1", "Q8_0", "F32"} == {t.kind for t in tensors.values()}
    assert set(tensors) == set(state) - {"lm_head.weight"}  # tied: no head in the file
    for name, tensor in tensors.items():
        assert torch.equal(tensor.dequantize(), state[name]), name


def test_smollm2_from_gguf_matches_transformers(smollm2_gguf, smollm2) -> None:
    """SmolLM2 built from the GGUF's tensors gives the transformers model's logits."""
    _, tensors = smollm2_gguf
    model = smollm2.model
    jitney = LlamaForward(model.config, GGUFWeights(tensors, torch.float32, False))
    cache = make_cache(model.config, block_size=16, num_blocks=8)
    toks = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build([(0, 40, [3, 1, 5])], cache)
    meta.logits_indices = torch.arange(40)
    with torch.no_grad():
        want = model(input_ids=toks[None]).logits[0]
    assert (jitney(toks, None, meta, cache) - want).abs().max().item() < TOL


def test_model_impl_picks_the_forward(loaded: LoadedModel) -> None:
    """auto: Jitney's forward for a covered family, transformers' elsewhere (noop); jitney on an
    uncovered model is refused by name; the forward is built once per loaded model."""
    assert isinstance(model_forward_for(loaded, "auto"), LlamaForward)
    assert model_forward_for(loaded, "jitney") is model_forward_for(loaded, "auto")
    assert isinstance(model_forward_for(loaded, "transformers"), TransformersForward)
    noop = load_model("noop")
    assert isinstance(model_forward_for(noop, "auto"), TransformersForward)
    with pytest.raises(UnsupportedArchitectureError, match="noop"):
        model_forward_for(noop, "jitney")


def test_both_impls_generate_the_same_tokens(loaded: LoadedModel) -> None:
    """The engine gives the same greedy and seeded tokens through either forward, over mixed
    steps of several requests (the two share the loaded model's weights)."""
    texts = ["hi", "the quick brown fox jumps", "a longer prompt " * 5, "paged"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7),
    ]
    results = {}
    for impl in ("jitney", "transformers"):
        engine = make_engine(loaded, model_impl=impl, max_num_batched_tokens=32)
        results[impl] = [[r.token_ids for r in engine.generate(prompts, p)] for p in params]
    assert results["jitney"] == results["transformers"]


def resident_weight_bytes(forward: LlamaForward) -> int:
    """Bytes the forward keeps for its weights: packed blocks plus dense tensors."""
    packed = {}
    for m in forward.modules():
        parts = (m.weights,) if isinstance(m, QuantizedEmbedding) else getattr(m, "parts", ())
        packed |= {id(w): w for w in parts}
    dense = {id(p): p for p in forward.parameters()}  # a tied table counts once
    return sum(w.nbytes for w in packed.values()) + sum(
        p.numel() * p.element_size() for p in dense.values()
    )


def test_smollm2_on_its_own_blocks(smollm2_gguf, smollm2, exact_linears) -> None:
    """Kept in the file's Q4_1/Q8_0 blocks, SmolLM2 gives the dequantized model's logits (the
    same weights: only the order of float32 sums differs), within 1.3x the file's bytes."""
    _, tensors = smollm2_gguf
    config = smollm2.model.config
    packed = LlamaForward(config, GGUFWeights(tensors, torch.float32, quantized=True))
    dense = LlamaForward(config, GGUFWeights(tensors, torch.float32, quantized=False))
    assert isinstance(packed.layers[0].qkv, QuantizedLinear)
    assert isinstance(packed.embed, QuantizedEmbedding)
    toks = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0))
    got, want = [], []
    for forward, out in ((packed, got), (dense, want)):
        cache = make_cache(config, block_size=16, num_blocks=8)
        meta = AttentionMetadata.build([(0, 40, [3, 1, 5])], cache)
        meta.logits_indices = torch.arange(40)
        out.append(forward(toks, None, meta, cache))
    assert (got[0] - want[0]).abs().max().item() < 2e-3
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
    file_bytes = smollm2_gguf_path().stat().st_size
    assert resident_weight_bytes(packed) <= 1.3 * file_bytes


def test_engine_on_gguf_blocks_follows_transformers_greedy(smollm2) -> None:
    """`--quantization gguf`: greedy tokens are the transformers model's argmax, teacher-forced,
    up to near-ties (the near-tie rule)."""
    engine = make_engine(smollm2, quantization="gguf", kv_cache_memory="64MiB")
    prompt = chat(smollm2, "What is the capital of France?")
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert len(result.token_ids) > 4
    assert_teacher_forced(smollm2, prompt, result.token_ids)


def test_gguf_quantization_needs_a_gguf_model(loaded: LoadedModel) -> None:
    """Asking for the file's blocks of a model that has no file is refused, saying why."""
    with pytest.raises(ValueError, match="needs a GGUF model"):
        model_forward_for(loaded, "auto", "gguf")
