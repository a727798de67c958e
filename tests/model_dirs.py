"""Seeded random Llama models with the tiny byte-level tokenizer, written as Hugging Face
directories: a worker loads one with `--model DIR` and serves it under the directory's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Shapes small enough for a worker to start and answer in moments: a model directory of a test's
# own (a chat template of its own, a second model).
SMALL_LLAMA: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
}


# Two layers, four query heads over two KV heads: the smallest shape that still has every part a
# real Llama has (grouped queries, more than one layer), for parity tests.
TWO_LAYER_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def write_random_llama(path: Path, seed: int = 0, **config: Any) -> Path:
    """`config`: LlamaConfig fields (sizes); the vocabulary and special ids are the tokenizer's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
