"""Real-size models with seeded random weights (`--model random:<name>`), built in-process.

They have the published architecture of real checkpoints (so a step costs what the real model's
step costs: same layers, heads, KV size and vocabulary) without downloading anything, which is
what GPU bring-up and throughput work need. The weights are allocated directly on the target
device in the target dtype and filled from a seeded generator, so an 8B model is ready in
seconds; transformers' per-module `_init_weights` over the full model would take minutes.

`random:tiny` is the existing `tiny-random` model under the same prefix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from engine.models.families import family_switches

if TYPE_CHECKING:
    from transformers import PreTrainedModel
from engine.models.tiny_model import (
    CHATML_TEMPLATE,
    TINY_SEED,
    build_tiny_model,
    build_tiny_tokenizer,
    byte_symbols,
)

RANDOM_PREFIX = "random:"
TINY = "tiny"
DEFAULT_SEED = 0


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Where the special tokens sit in the vocabulary (the family's real ids where it has them).

    Every family gets the ChatML turn markers, so one chat template (CHATML_TEMPLATE) serves all.
    """

    ids: Mapping[str, int]
    bos: str | None
    eos: str  # end of turn: the tokenizer's eos and the first stop id
    pad: str  # end of text: also a stop id

    @property
    def stop_ids(self) -> list[int]:
        return [self.ids[self.eos], self.ids[self.pad]]


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    # transformers' config and model classes, by name: importing LlamaConfig's module costs 2 s
    # and 60 MB, the modeling modules seconds more, which a process serving a Gemma GGUF file
    # never needs (`config_class`, `_model_class` resolve them when one is built)
    config_class_name: str
    model_class_name: str
    published: Mapping[str, Any]  # the real checkpoint's config.json architecture values
    tokens: SpecialTokens
    num_params: float  # the published size, which count_parameters of the config reproduces

    @property
    def config_class(self) -> type[PretrainedConfig]:
        return getattr(transformers, self.config_class_name)


# Llama 3: BOS/EOT at their real ids; the ChatML markers take the ids of <|start_header_id|> and
# <|eot_id|>, so the end-of-turn id is the real Instruct model's (128009).
_LLAMA3_TOKENS = SpecialTokens(
    ids={
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|im_start|>": 128006,
        "<|im_end|>": 128009,
    },
    bos="<|begin_of_text|>",
    eos="<|im_end|>",
    pad="<|end_of_text|>",
)
# Qwen3 uses ChatML itself, at these ids, and has no BOS token.
_QWEN3_TOKENS = SpecialTokens(
    ids={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
)

# Gemma 3's own specials (<pad> 0, <eos> 1, <bos> 2, <start_of_turn> 105, <end_of_turn> 106)
# fall on the byte ids, so its markers take the last ids of the vocabulary instead.
_GEMMA3_TOKENS = SpecialTokens(
    ids={"<bos>": 262140, "<eos>": 262141, "<|im_start|>": 262142, "<|im_end|>": 262143},
    bos="<bos>",
    eos="<|im_end|>",
    pad="<eos>",
)
# Phi-4-mini: its end-of-turn <|end|> (200020) ends a ChatML turn; <|user|> (200021) opens one.
_PHI4_TOKENS = SpecialTokens(
    ids={"<|endoftext|>": 199999, "<|im_end|>": 200020, "<|im_start|>": 200021},
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
)
# SmolLM3 uses ChatML itself, at these ids (the Llama 3 vocabulary's reserved ones).
_SMOLLM3_TOKENS = SpecialTokens(
    ids={"<|end_of_text|>": 128001, "<|im_start|>": 128011, "<|im_end|>": 128012},
    bos=None,
    eos="<|im_end|>",
    pad="<|end_of_text|>",
)
# microsoft/Phi-4-mini-instruct's LongRoPE factors (one per rotated pair: 96 of 128 dimensions).
PHI4_MINI_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
    32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]  # fmt: skip

_LLAMA3_COMMON = {
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


RANDOM_MODELS: dict[str, RandomModelSpec] = {
    "llama-3.2-1b": RandomModelSpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_LLAMA3_COMMON,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "head_dim": 64,
            "rope_parameters": _llama3_rope(32.0),
            "tie_word_embeddings": True,
        },
        _LLAMA3_TOKENS,
        1.24e9,
    ),
    "llama-3.1-8b": RandomModelSpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_LLAMA3_COMMON,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "head_dim": 128,
            "rope_parameters": _llama3_rope(8.0),
            "tie_word_embeddings": False,
        },
        _LLAMA3_TOKENS,
        8.03e9,
    ),
    "qwen3-8b": RandomModelSpec(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 36,
            "tie_word_embeddings": False,
        },
        _QWEN3_TOKENS,
        8.19e9,
    ),
    # Five sliding layers (window 512, RoPE base 10k) to one global (base 1M); layer_types
    # follows from the config's pattern, so a shrunk model keeps it.
    "gemma3-270m": RandomModelSpec(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "vocab_size": 262144,
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
            "tie_word_embeddings": True,
        },
        _GEMMA3_TOKENS,
        2.68e8,
    ),
    # Q/K/V and gate/up stored fused; 96 of each head's 128 dimensions rotated, by LongRoPE.
    "phi-4-mini": RandomModelSpec(
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "vocab_size": 200064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "initializer_range": 0.02,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "long_factor": PHI4_MINI_LONG_FACTOR,
                "short_factor": [1.0] * 48,
            },
            "sliding_window": 262144,
            "tie_word_embeddings": True,
        },
        _PHI4_TOKENS,
        3.84e9,
    ),
    # Every fourth layer without RoPE (no_rope_layers follows from the interval).
    "smollm3-3b": RandomModelSpec(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "hidden_act": "silu",
            "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
            "no_rope_layer_interval": 4,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_bias": False,
            "tie_word_embeddings": True,
        },
        _SMOLLM3_TOKENS,
        3.08e9,
    ),
}
RANDOM_MODEL_NAMES = (TINY, *RANDOM_MODELS)


def random_model_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The published config of `name` (without the "random:" prefix), with `overrides` applied.

    Overrides shrink a model for tests while keeping its family (attention layout, RoPE type,
    norms, vocabulary); the vocabulary size is fixed because the tokenizer spans all of it.
    """
    spec = _spec(name)
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    unknown = sorted(set(overrides) - fields)
    if unknown:  # the config classes accept any keyword, so a typo would pass silently
        raise ValueError(f"unknown {spec.config_class.__name__} fields: {', '.join(unknown)}")
    if "vocab_size" in overrides:
        raise ValueError("vocab_size is the real model's: the tokenizer covers the whole of it")
    tokens = spec.tokens
    return spec.config_class(
        **{**spec.published, **overrides},
        bos_token_id=tokens.ids[tokens.bos] if tokens.bos else None,
        eos_token_id=tokens.stop_ids,
        pad_token_id=tokens.ids[tokens.pad],
    )


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory);
    tied embeddings count once."""
    with torch.device("meta"):
        model = _model_class(config)(config)
    return sum(p.numel() for p in model.parameters())


def build_random_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer whose vocabulary is the model's whole vocabulary, so every id
    decodes: ids 0-255 are the bytes (any UTF-8 text round-trips), the special tokens sit at the
    family's ids, and every other id is a filler word " w<id>" that encoding never produces."""
    if name == TINY:
        return build_tiny_tokenizer()
    spec = _spec(name)
    tokens = spec.tokens
    by_id = {token_id: token for token, token_id in tokens.ids.items()}
    symbols = byte_symbols()
    vocab: dict[str, int] = {}
    for token_id in range(spec.published["vocab_size"]):
        # "Ġ" is the byte-level symbol for a space.
        default = symbols[token_id] if token_id < 256 else f"Ġw{token_id}"
        vocab[by_id.get(token_id, default)] = token_id

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(tokens.ids))  # already in the vocabulary: ids unchanged
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokens.bos,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=spec.published["max_position_embeddings"],
    )


def init_random_model(
    config: PretrainedConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int = DEFAULT_SEED,
) -> PreTrainedModel:
    """The model of `config`, allocated on `device` in `dtype` and filled from `seed`: the same
    weights for the same seed on the same device type. Eval mode."""
    device = torch.device(device)
    # On meta nothing is allocated or initialized; to_empty then allocates uninitialized storage.
    with torch.device("meta"):
        model = _model_class(config)(config)
    model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor, untying shared ones
    _fill_parameters(model, device, seed)
    _rebuild_rotary_embeddings(model, device)
    _restore_embedding_scale(model)
    from transformers import GenerationConfig  # seconds to import: only once built

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval()


def build_random_model(
    name: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
    **overrides: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Model and tokenizer of `name` (a RANDOM_MODELS name or "tiny"), what
    load_model("random:<name>") serves. `overrides` change config fields (see
    random_model_config); "tiny" is the fixed tiny-random model and takes none."""
    if name == TINY:
        if overrides or seed != TINY_SEED:
            raise ValueError(f"{RANDOM_PREFIX}{TINY} is tiny-random: no seed or overrides")
        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer).to(device=device, dtype=dtype).eval(), tokenizer
    config = random_model_config(name, **overrides)
    return init_random_model(config, device, dtype, seed), build_random_tokenizer(name)


def _spec(name: str) -> RandomModelSpec:
    try:
        return RANDOM_MODELS[name]
    except KeyError:
        known = ", ".join(RANDOM_PREFIX + n for n in RANDOM_MODEL_NAMES)
        raise ValueError(f"unknown random model {RANDOM_PREFIX}{name}: known are {known}") from None


def _model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    import transformers

    for spec in RANDOM_MODELS.values():
        if isinstance(config, spec.config_class):
            return getattr(transformers, spec.model_class_name)
    raise ValueError(f"no random-model family for {type(config).__name__}")


@torch.no_grad()
def _fill_parameters(model: PreTrainedModel, device: torch.device, seed: int) -> None:
    # uniform_ with the config's std rather than normal_: same scale, twice as fast on CPU.
    generator = torch.Generator(device).manual_seed(seed)
    bound = model.config.initializer_range * math.sqrt(3)
    # Norms start as the identity, as in real initialization: 1, or 0 where the norm multiplies
    # by (1 + w) (Gemma).
    identity = 1.0 - family_switches(model.config).norm_offset
    for name, param in model.named_parameters():  # deterministic order, tied weights once
        owner = model.get_submodule(name.rpartition(".")[0])
        if "RMSNorm" in type(owner).__name__:
            param.fill_(identity)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.uniform_(-bound, bound, generator=generator)


def _rebuild_rotary_embeddings(model: PreTrainedModel, device: torch.device) -> None:
    # inv_freq is a buffer, not a parameter: to_empty left it uninitialized. Building the module
    # afresh on the device computes it (and the RoPE scaling) exactly as a normal load does.
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):  # (Gemma 3's: one per layer type)
            parent_name, _, child = name.rpartition(".")
            with torch.device(device):
                fresh = type(module)(model.config)
            setattr(model.get_submodule(parent_name), child, fresh)


@torch.no_grad()
def _restore_embedding_scale(model: PreTrainedModel) -> None:
    # Gemma's scaled embedding keeps sqrt(hidden) in a buffer that to_empty left uninitialized:
    # the float32 value transformers makes of it, in the model's dtype.
    for module in model.modules():
        if isinstance(getattr(module, "embed_scale", None), torch.Tensor):
            module.embed_scale.copy_(torch.tensor(module.scalar_embed_scale))
