"""Greedy parity with transformers, under the near-tie rule: shared by the tests and the GPU check.

Our output may leave the reference's greedy output at a numerical near-tie (as vLLM's tests
allow). From there on, each of our tokens is judged teacher-forced: given the reference model and
our own tokens before it, it must be the argmax, or within NEAR_TIE of it. The reference is a
model left on transformers' own attention (the engine patches the model it runs).
"""

from __future__ import annotations

import torch

from engine.models.model_loader import LoadedModel

NEAR_TIE = 1e-3  # log-prob gap to the argmax under which a different greedy token is a tie


def reference_greedy(ref: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers `generate` of one request alone, greedy, EOS ignored (not suppressed:
    min_new_tokens would mask EOS out, ignore_eos only keeps going after it)."""
    ids = torch.tensor([prompt], device=ref.model.device)
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


def next_token_logprobs(ref: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """The reference's next-token log-probs after every prefix of `tokens`, from one forward
    pass: row k is the distribution after tokens[: k + 1]. float32, on the model's device."""
    with torch.inference_mode():
        logits = ref.model(torch.tensor([tokens], device=ref.model.device)).logits[0].float()
    return logits.log_softmax(-1)


def gap_to_argmax(row: torch.Tensor, token: int) -> float:
    return float(row.max() - row[token])


def near_ties(row: torch.Tensor) -> list[int]:
    """The argmax and every token within NEAR_TIE of it, likeliest first."""
    close = (row > row.max() - NEAR_TIE).nonzero().flatten()
    return close[row[close].argsort(descending=True)].tolist()


def teacher_forced_failure(
    ref: LoadedModel, prompt: list[int], got: list[int], start: int = 0
) -> str | None:
    """Why some got[j], j >= start, is neither the reference's argmax after prompt + got[:j]
    nor within NEAR_TIE of it; None when every one is."""
    if start >= len(got):
        return None
    rows = next_token_logprobs(ref, prompt + got[:-1])[len(prompt) - 1 :]
    for j in range(start, len(got)):
        gap = gap_to_argmax(rows[j], got[j])
        if not gap < NEAR_TIE:
            return (
                f"token {j}: got {got[j]}, the reference's argmax is {int(rows[j].argmax())}; "
                f"log-prob gap {gap:.2e} is no near-tie (tolerance {NEAR_TIE:g})"
            )
    return None


def greedy_parity_failure(
    ref: LoadedModel, prompt: list[int], got: list[int], want: list[int]
) -> str | None:
    """None when `got` equals the reference's greedy `want` token for token, or leaves it at a
    near-tie and from there on holds to the near-tie rule teacher-forced (every later token is
    checked, not only the first that differs); otherwise why not."""
    if len(got) != len(want):
        return f"length {len(got)} != {len(want)}"
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    return None if first is None else teacher_forced_failure(ref, prompt, got, first)
