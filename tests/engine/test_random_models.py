"""Real-size random-weight models (`random:<name>`): published sizes, seeded on-device init,
correct RoPE buffers, a tokenizer over the whole vocabulary, and the engine on each family.

Full-size models are only ever built on the meta device; everything that runs uses the same
family shrunk through config overrides (SMALL), keeping the real vocabulary.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.attention import paged_attention
from engine.models import random_models
from engine.models.model_loader import LoadedModel, load_model
from engine.models.random_models import (
    PHI4_MINI_LONG_FACTOR,
    RANDOM_MODELS,
    build_random_model,
    build_random_tokenizer,
    count_parameters,
    random_model_config,
)
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import assert_greedy_parity, make_engine, reference_greedy
from tests.engine.graph_emulator import EmulatedGraphCapture, kernel_as_op

FAMILIES = ["llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"]
# The families that are the Llama layer with switches (engine/models/families.py).
SWITCHED = ["gemma3-270m", "phi-4-mini", "smollm3-3b"]
# Two layers of GQA (4 query heads, 2 KV heads) in 64 dimensions; the vocabulary stays real.
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
# What the switched families' two layers keep of their pattern: Gemma a sliding layer (window
# 8) and a global one; Phi LongRoPE over 12 of 16 dimensions, six of the real factors; SmolLM3
# a layer without RoPE. (Phi's and SmolLM3's head size is hidden / heads: 16 too.)
_SMALL_NO_HEAD_DIM = {k: v for k, v in SMALL.items() if k != "head_dim"}
SMALL_OF = {
    "gemma3-270m": {
        **SMALL,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
    },
    "phi-4-mini": {
        **_SMALL_NO_HEAD_DIM,
        "rope_parameters": {
            **RANDOM_MODELS["phi-4-mini"].published["rope_parameters"],
            "long_factor": PHI4_MINI_LONG_FACTOR[::8],
            "short_factor": [1.0] * 6,
        },
    },
    "smollm3-3b": {**_SMALL_NO_HEAD_DIM, "no_rope_layers": [1, 0]},
}


def small(name: str) -> dict:
    return SMALL_OF.get(name, SMALL)


def load_small(name: str) -> LoadedModel:
    """load_model("random:<name>") itself, with the family's config shrunk to SMALL."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(random_models, "random_model_config", _shrunk_config)
        return load_model(f"random:{name}")


def _shrunk_config(name: str, **overrides: object):
    return random_model_config(name, **{**small(name), **overrides})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def expected_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies from the formulas, in float64; Llama 3 scaling slows the long
    wavelengths by `factor`, keeps the short ones and ramps smoothly in between."""
    inv_freq = rope["rope_theta"] ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope["rope_type"] != "llama3":
        return inv_freq
    old_len, low, high = (
        rope["original_max_position_embeddings"],
        rope["low_freq_factor"],
        rope["high_freq_factor"],
    )
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * inv_freq / rope["factor"] + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / rope["factor"], ramp)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


@pytest.mark.parametrize(
    ("name", "published", "tied"),
    [
        ("llama-3.2-1b", 1.24e9, True),
        ("llama-3.1-8b", 8.03e9, False),
        ("qwen3-8b", 8.19e9, False),
        ("gemma3-270m", 2.68e8, True),
        ("phi-4-mini", 3.84e9, True),
        ("smollm3-3b", 3.08e9, True),
    ],
)
def test_full_size_parameter_count_matches_the_published_size(name, published, tied):
    """The full config, counted on the meta device, is the published model within 1%."""
    config = random_model_config(name)
    assert config.tie_word_embeddings is tied
    assert count_parameters(config) == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", FAMILIES + SWITCHED)
def test_load_model_fills_loaded_model_like_a_real_checkpoint(name):
    """Eval mode, float32 on CPU, the shrunk shape, the real context length and vocabulary,
    ChatML end-of-turn plus end-of-text as stop ids, and finite logits."""
    loaded = load_small(name)
    published = RANDOM_MODELS[name].published
    tokenizer = loaded.tokenizer

    assert loaded.name == f"random:{name}"
    assert not loaded.model.training and loaded.model.dtype == torch.float32
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (2, 2, 16)
    assert loaded.max_model_len == published["max_position_embeddings"]
    vocab_size = published["vocab_size"]
    assert len(tokenizer) == loaded.model.get_input_embeddings().num_embeddings == vocab_size
    assert loaded.eos_token_ids == tokenizer.convert_tokens_to_ids(
        [tokenizer.eos_token, tokenizer.pad_token]
    )
    assert tokenizer.eos_token == "<|im_end|>"
    model = loaded.model
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied is published["tie_word_embeddings"]
    assert logits_of(model, [5, 6, 7, 8]).isfinite().all()


@pytest.mark.parametrize("name", FAMILIES + SWITCHED)
def test_weights_are_seeded(name):
    """The same seed gives the same weights; another seed changes every matrix; norms are the
    identity (1; Gemma's, which multiply by 1 + w, 0)."""
    first = build_random_model(name, seed=7, **small(name))[0].state_dict()
    again = build_random_model(name, seed=7, **small(name))[0].state_dict()
    other = build_random_model(name, seed=8, **small(name))[0].state_dict()
    identity = 0.0 if name.startswith("gemma") else 1.0

    assert first.keys() == again.keys() == other.keys()
    for key, weight in first.items():
        assert torch.equal(weight, again[key]), key
        if "norm" in key:
            assert torch.equal(weight, torch.full_like(weight, identity)), key
        else:
            assert not torch.equal(weight, other[key]), key
            assert 0.01 < weight.std() < 0.03, key  # the config's initializer_range, 0.02


@pytest.mark.parametrize("name", FAMILIES)
def test_rotary_buffers_follow_the_rope_formula(name):
    """inv_freq is not left uninitialized by the meta-device build: it equals the formula
    (with Llama 3 scaling where the family has it), and two builds compute equal logits."""
    model, _ = build_random_model(name, **SMALL)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == ("llama3" if name.startswith("llama") else "default")
    want = expected_inv_freq(rope, SMALL["head_dim"]).float()
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rotary.inv_freq, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(rotary.original_inv_freq, want, rtol=1e-6, atol=0)

    ids = [17, 300, 4000, 9, 9, 9, 120000]
    logits = logits_of(model, ids)
    assert logits.isfinite().all()
    torch.testing.assert_close(logits, logits_of(build_random_model(name, **SMALL)[0], ids))


def test_bfloat16_build_keeps_rope_in_float32():
    """Weights in the requested dtype; RoPE frequencies in float32, as a normal load has them."""
    model, _ = build_random_model("qwen3-8b", dtype=torch.bfloat16, **SMALL)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert logits_of(model, [1, 2, 3]).isfinite().all()


@pytest.mark.parametrize("name", FAMILIES + SWITCHED)
def test_engine_greedy_matches_transformers_generate(name):
    """The paged engine on each family (Qwen3 with its q/k norms; Gemma, Phi and SmolLM3 on
    Jitney's forward with their switches) gives generate()'s greedy tokens, or leaves them only
    at a near-tie. Phi-4-mini served within its original 4,096 positions takes LongRoPE's short
    factors, those transformers uses for a call that short."""
    loaded = load_small(name)
    ref = load_small(name)  # a second copy, left on transformers' own attention
    within = {"max_model_len": 4096} if name == "phi-4-mini" else {}
    engine = make_engine(loaded, kv_cache_memory="16MiB", **within)
    assert engine.startup.forward_name == "jitney-none"
    chat = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    rng = random.Random(0)
    prompts = [chat, [rng.randrange(len(loaded.tokenizer)) for _ in range(13)]]
    results = engine.generate(prompts, greedy(8))
    for prompt, res in zip(prompts, results, strict=True):
        assert_greedy_parity(ref, prompt, res.token_ids, reference_greedy(ref, prompt, 8))
    if not RANDOM_MODELS[name].published["tie_word_embeddings"]:
        # (Tied random embeddings make greedy repeat the last token: x · x dominates the logits.)
        assert len(set(results[0].token_ids)) > 1
    assert engine.view.kv_used_blocks == 0


@pytest.mark.parametrize(
    ("name", "decode_attention"),
    # The kernel once: it sees only attention's inputs, and SMALL gives every family the same.
    [*((name, "gather") for name in FAMILIES), ("qwen3-8b", "triton")],
)
def test_each_family_replays_its_decode_steps_as_captured_graphs(
    name, decode_attention, monkeypatch
):
    """Each family's forward (Llama 3 RoPE scaling, Qwen3 q/k norms) captures without a host
    sync and replays the eager tokens, under CUDA-graph semantics emulated on the CPU, with
    either decode attention (the Triton kernel under its interpreter)."""
    if decode_attention == "triton":
        monkeypatch.setattr(paged_attention, "paged_decode_attention", kernel_as_op)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 40, 17)]
    # No speculation: its verification steps are not decode-only, so they never take a graph.
    plain = {"kv_cache_memory": "16MiB", "speculative": "none"}
    eager = make_engine(load_small(name), **plain).generate(prompts, greedy(12))
    graphed = make_engine(load_small(name), **plain, decode_attention=decode_attention)
    capture = EmulatedGraphCapture()
    graphed.runner.enable_decode_graphs(8, graphed.max_model_len, capture)
    results = graphed.generate(prompts, greedy(12))
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.failed is None and capture.graphs
    assert graphs.num_steps >= 10
    # With the kernel, every bucket was captured (and replayed once) at start.
    at_start = len(graphs.buckets) if decode_attention == "triton" else 0
    assert sum(g.replays for g in capture.graphs) == at_start + graphs.num_steps
    ref = load_small(name)
    for prompt, got, want in zip(prompts, results, eager, strict=True):
        assert_greedy_parity(ref, prompt, got.token_ids, want.token_ids)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b"])
def test_tokenizer_decodes_every_id_and_round_trips_text(name):
    """Every id of the real vocabulary decodes: bytes first, fillers, specials at their ids."""
    tokenizer = build_random_tokenizer(name)
    vocab_size = RANDOM_MODELS[name].published["vocab_size"]
    assert len(tokenizer) == vocab_size

    assert tokenizer.decode([0]) == "\x00" and tokenizer.decode([ord("a")]) == "a"
    assert tokenizer.decode([vocab_size - 1]) == f" w{vocab_size - 1}"
    for token, token_id in RANDOM_MODELS[name].tokens.ids.items():
        assert tokenizer.convert_ids_to_tokens(token_id) == token
        assert tokenizer.decode([token_id]) == token
        assert tokenizer.decode([token_id], skip_special_tokens=True) == ""
    rng = random.Random(1)
    for token_id in rng.sample(range(256, vocab_size), 20):
        if token_id not in RANDOM_MODELS[name].tokens.ids.values():
            assert tokenizer.decode([token_id]) == f" w{token_id}"
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
    assert len(texts) == vocab_size and all(texts[256:])

    text = "héllo wörld 日本 🚀\n\ttabs"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_random_tiny_is_tiny_random():
    """random:tiny is the tiny-random model under the random: prefix, and nothing else."""
    alias, tiny = load_model("random:tiny"), load_model("tiny-random")
    assert alias.name == "random:tiny"
    assert alias.tokenizer.get_vocab() == tiny.tokenizer.get_vocab()
    assert alias.eos_token_ids == tiny.eos_token_ids
    want = tiny.model.state_dict()
    got = alias.model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in want)
    with pytest.raises(ValueError, match="no seed or overrides"):
        build_random_model("tiny", seed=3)


def test_unknown_names_and_fields_are_refused():
    """A clear ValueError listing the known names; override typos and vocab changes refused."""
    with pytest.raises(ValueError, match="random:nope") as error:
        load_model("random:nope")
    for known in ["random:tiny", *(f"random:{name}" for name in FAMILIES)]:
        assert known in str(error.value)
    with pytest.raises(ValueError, match="hiden_size"):
        random_model_config("llama-3.2-1b", hiden_size=64)
    with pytest.raises(ValueError, match="vocab_size"):
        random_model_config("qwen3-8b", vocab_size=1000)
