"""`--model noop`: no model at all, for load-testing the queue, the workers' loop and the gateways.

LOAD TESTING ONLY: it generates meaningless tokens. Everything around the forward is real (the
worker loop, the scheduler, the KV block accounting, the sampler, the protocol and publishing);
the forward itself sleeps `--noop-step-ms` and puts all the probability on one token per row,
a function of the row's input token and position, so runs are deterministic. It never emits an
end-of-text token: requests end at max_tokens (or a stop token id the client names). Its KV cache
takes 512 bytes per token (one layer, one head of width 64: a block pool of ordinary size for a
given budget; `--kv-cache-memory 64MiB` holds 131,072 tokens), never read. It announces itself:
its model name is `noop`.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

from engine.models.tiny_model import SPECIAL_TOKENS, build_tiny_tokenizer
from protocol import NOOP_MODEL

NOOP = NOOP_MODEL
NOOP_CONTEXT = 32_768  # tokens per sequence it accepts (there is no model to bound it)
HEAD_DIM = 64


class NoopModel(torch.nn.Module):
    """Looks like a causal LM to the engine: config, generation config, embeddings, forward."""

    def __init__(self, vocab_size: int, eos_token_id: int, step_s: float):
        super().__init__()
        from transformers import LlamaConfig  # 2 s and 60 MB to import: only for a noop model

        self.config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=HEAD_DIM,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            num_hidden_layers=1,
            max_position_embeddings=NOOP_CONTEXT,
        )
        from transformers import GenerationConfig  # seconds to import: only once built

        self.generation_config = GenerationConfig(eos_token_id=eos_token_id)
        # One weight, so the engine can read the vocabulary size, device and dtype as usual.
        self.embed = torch.nn.Embedding(vocab_size, 1)
        self.step_s = step_s
        self._first_normal = len(SPECIAL_TOKENS)  # never an end-of-text token

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def set_attn_implementation(self, name: str) -> None:
        """No attention to switch: the paged KV cache is allocated but never read."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor | None = None,
        **_: Any,
    ) -> SimpleNamespace:
        if self.step_s > 0:
            time.sleep(self.step_s)
        ids, positions = input_ids[0], position_ids[0]
        if logits_to_keep is not None:
            ids, positions = ids[logits_to_keep], positions[logits_to_keep]
        span = self.config.vocab_size - self._first_normal
        tokens = self._first_normal + (ids * 31 + positions * 7) % span
        logits = torch.zeros(
            len(tokens), self.config.vocab_size, dtype=self.dtype, device=tokens.device
        )
        logits[torch.arange(len(tokens)), tokens] = 1.0
        return SimpleNamespace(logits=logits.unsqueeze(0))


def build_noop_model(step_ms: float) -> tuple[NoopModel, Any]:
    """The noop model and the tiny byte-level tokenizer it speaks."""
    tokenizer = build_tiny_tokenizer()
    model = NoopModel(len(tokenizer), tokenizer.eos_token_id, step_ms / 1000)
    return model, tokenizer
