"""A tiny random-weight Llama and its byte-level BPE tokenizer, built in-process.

Tests and CPU demos use it so that nothing is downloaded and every run sees the same weights. It is
shaped like a real chat model: ChatML template, two end-of-turn tokens, grouped-query attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.chat_template import CHATML_TEMPLATE

if TYPE_CHECKING:  # the modeling modules take seconds to import: only where a model is built
    from transformers import LlamaForCausalLM

TINY_SEED = 0

# Ids 0-2, in SmolLM2's order, so code that special-cases them behaves the same on both models.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# A few merges so text is not one token per byte; "Ġ" is the byte-level symbol for a space.
_MERGED_WORDS = ["Ġthe", "Ġand", "Ġof", "Ġto", "Ġis", "Ġin", "ing", "er", "Ġa", "Ġyou", "Ġwhat"]


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over all 256 bytes, so any UTF-8 text round-trips exactly."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in byte_symbols():  # byte b gets id 3 + b
        vocab[symbol] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _MERGED_WORDS:
        prefix = word[0]
        for char in word[1:]:
            if prefix + char not in vocab:
                merges.append((prefix, char))
                vocab[prefix + char] = len(vocab)
            prefix += char

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Random float32 weights on CPU, the same on every call and every machine."""
    from transformers import LlamaConfig  # 2 s and 60 MB to import (random_models.py says why)

    end_ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, so callers' KV code is exercised with kv heads < heads
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_ids,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    # fork_rng: seed for our own init without disturbing the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(config)
    from transformers import GenerationConfig  # seconds to import: only once built

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: the symbol ByteLevel uses for each byte 0-255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: list[str] = []
    num_unprintable = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + num_unprintable))
            num_unprintable += 1
    return symbols
