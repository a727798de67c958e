"""GGUF files written by the tests with the `gguf` package, as llama.cpp's converter
(convert_hf_to_gguf.py) writes a transformers model: its metadata keys, its tensor names (the
`gguf` package's own name map), and its changes to the weights (a Llama's Q/K rows permuted for
its rotary layout, Gemma's norms stored as 1 + w). The vocabulary is the tiny byte-level one
(engine/models/tiny_model.py), written as a "gpt2" tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "starcoder2": gguf.MODEL_ARCH.STARCODER2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
}
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BASE_SPECIALS = ("<unk>", "<s>", "</s>")  # a base model's: nothing says ChatML


def tiny_vocabulary(
    specials: tuple[str, ...] = CHATML_SPECIALS, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The tiny tokenizer's tokens (its three special ones renamed to `specials`, control
    tokens `extra` added last), merges and token types, as a GGUF's tokenizer.ggml.* arrays."""
    from engine.models.tiny_model import build_tiny_tokenizer

    backend = json.loads(build_tiny_tokenizer().backend_tokenizer.to_str())
    vocab: dict[str, int] = backend["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens[: len(specials)] = specials
    tokens += extra
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    control = {*range(len(specials)), *range(len(tokens) - len(extra), len(tokens))}
    types = [3 if i in control else 1 for i in range(len(tokens))]  # 3: control
    return {"tokens": tokens, "merges": merges, "types": types}


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str,
    *,
    matrices: Q | dict[str, Q] = Q.F32,
    chat_template: str | None = None,
    specials: tuple[str, ...] = CHATML_SPECIALS,
    extra_tokens: tuple[str, ...] = (),
    add_bos: bool = False,
    omit: tuple[str, ...] = (),
) -> Path:
    """`model` (a transformers causal LM of `arch`) as llama.cpp's converter writes it. Each
    2-D weight is stored as `matrices` (one type, or by the ggml name's part after `blk.N.`,
    "token_embd" and "output"; the rest F32); norms and biases are F32. `omit`: metadata keys
    left out (as an older converter would); `extra_tokens`: control tokens after the tiny
    vocabulary (the model's vocabulary must count them)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCHS[arch]])
    writer.add_name(f"test {arch}")
    _write_config(writer, config, arch, model)
    vocabulary = tiny_vocabulary(specials, extra_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    writer.add_token_merges(vocabulary["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(ARCHS[arch], config.num_hidden_layers)
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        data = _converted(value.float().numpy(), hf_name, arch, config)
        kind = _kind(matrices, name) if data.ndim == 2 else Q.F32
        stored = data if kind == Q.F32 else quantize(data, kind)
        writer.add_tensor(name, stored, raw_dtype=None if kind == Q.F32 else kind)
    if arch == "llama" and config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(config))
    if arch == "phi3" and (rope := config.rope_parameters).get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    for key in omit:
        del writer.kv_data[0][key]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_config(writer: gguf.GGUFWriter, config: Any, arch: str, model: Any) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = config.rope_parameters
    full = rope.get("full_attention", rope)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if arch == "starcoder2":  # LayerNorm, not RMSNorm
        writer.add_layer_norm_eps(config.norm_epsilon)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in ("llama", "smollm3"):
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3" and "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        writer.add_rope_dimension_count(int(full.get("partial_rotary_factor", 1.0) * head_dim))
        writer.add_sliding_window(config.sliding_window or 0)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)


def _converted(data: np.ndarray, hf_name: str, arch: str, config: Any) -> np.ndarray:
    """What the converter does to a tensor on its way into the file."""
    if arch in ("llama", "smollm3") and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads
        if ".k_proj." in hf_name:
            heads = config.num_key_value_heads
        rows = data.shape[0]
        return (
            data.reshape(heads, 2, rows // heads // 2, *data.shape[1:])
            .swapaxes(1, 2)
            .reshape(data.shape)
        )
    if arch == "gemma3" and hf_name.endswith("norm.weight"):
        return data + 1
    return data


def _llama3_divisors(config: Any) -> np.ndarray:
    """What the converter writes for a llama3 RoPE: each frequency's divisor, here from
    transformers' own llama3 frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    return (plain / llama3.double()).numpy().astype(np.float32)


def _kind(matrices: Q | dict[str, Q], name: str) -> Q:
    if isinstance(matrices, Q):
        return matrices
    part = name.rsplit(".", 1)[0].split(".", 2)[-1] if name.startswith("blk.") else name
    return matrices.get(part.removesuffix(".weight"), Q.F32)
