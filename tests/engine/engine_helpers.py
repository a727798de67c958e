"""Helpers for engine tests: a reference model, parity checks with the near-tie rule."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.model_loader import LoadedModel

NEAR_TIE = 1e-3  # top-2 log-prob gap under which a differing greedy token is a numerical tie


def make_engine(loaded: LoadedModel, **config: object) -> Engine:
    return Engine(EngineConfig(model=loaded.name, **config), loaded=loaded)  # type: ignore[arg-type]


def reference_greedy(ref: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers `generate` of one request alone, greedy, EOS ignored (not suppressed:
    min_new_tokens would mask EOS out, ignore_eos only keeps going after it)."""
    ids = torch.tensor([prompt])
    # NOTE: a GenerationConfig object with eos_token_id=None is merged with the model's own EOS
    # ids in transformers 5.24; the keyword override really disables EOS stopping.
    out = ref.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def top2_gap(ref: LoadedModel, prefix: list[int]) -> float:
    """Log-prob gap between the two likeliest next tokens after `prefix` (reference model)."""
    with torch.inference_mode():
        logits = ref.model(torch.tensor([prefix])).logits[0, -1].float()
    top = torch.topk(logits.log_softmax(-1), 2).values
    return float(top[0] - top[1])


def assert_greedy_parity(ref: LoadedModel, prompt: list[int], got: list[int], want: list[int]):
    """Equal token for token, or the first difference is a near-tie (as vLLM's tests allow)."""
    assert len(got) == len(want), f"length {len(got)} != {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            gap = top2_gap(ref, prompt + want[:i])
            assert gap < NEAR_TIE, f"token {i}: got {a}, want {b}; top-2 gap {gap:.2e} is no tie"
            return
