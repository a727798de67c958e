"""LoRA adapters made at test time with `peft` (random weights, a fixed seed), and the same
adapter written as llama.cpp's GGUF adapter (what its `convert_lora_to_gguf.py` writes).

    base = write_random_llama(tmp / "base", **SMALL_LLAMA)  # tests/model_dirs.py
    adapter = write_peft_adapter(base, tmp / "a", seed=1)  # adapter_config.json + safetensors
    write_gguf_adapter(adapter, tmp / "a.gguf", num_heads=2, num_kv_heads=1)

PEFT initialises B to zeros (an adapter that changes nothing); these are filled with seeded
normal values, scaled so that the adapter moves the logits visibly without drowning the base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    base: Path,
    out: Path,
    rank: int = 8,
    seed: int = 1,
    targets: tuple[str, ...] = ALL_TARGETS,
    alpha: float = 16.0,
    std: float = 0.05,
    **lora_config: Any,
) -> Path:
    """A PEFT LoRA adapter directory for the transformers model at `base`; `lora_config`:
    further peft.LoraConfig fields (use_rslora, rank_pattern, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.lora import save_random_adapter

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return save_random_adapter(model, out, rank, seed, targets, alpha, std, **lora_config)


def write_gguf_adapter(adapter: Path, out: Path, num_heads: int, num_kv_heads: int) -> Path:
    """The PEFT adapter at `adapter` as a GGUF LoRA adapter, in float32: llama.cpp's names
    (blk.N.attn_q.weight.lora_a ...), `adapter.lora.alpha`, and Q's and K's B rows permuted
    for the rotary layout as the converter permutes them."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for key, value in sorted(tensors.items()):
        # base_model.model.model.layers.{i}.{module}.lora_{A,B}.weight
        parts = key.split(".")
        layer, module, which = int(parts[4]), ".".join(parts[5:7]), parts[7]
        value = np.ascontiguousarray(value, dtype=np.float32)
        if which == "lora_B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = num_heads if module == "self_attn.q_proj" else num_kv_heads
            value = _permute_rows(value, heads)
        suffix = "lora_a" if which == "lora_A" else "lora_b"
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.{suffix}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _permute_rows(rows: Any, num_heads: int) -> Any:
    """llama.cpp's converter's Q/K row order: each head's halves interleaved."""
    out, rest = rows.shape[0], rows.shape[1:]
    return (
        rows.reshape(num_heads, 2, out // num_heads // 2, *rest).swapaxes(1, 2).reshape(rows.shape)
    )
