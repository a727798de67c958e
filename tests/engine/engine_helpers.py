"""Helpers for engine tests: an engine on a loaded model, and parity checks with the near-tie
rule (bench/parity.py, which the GPU check shares) as assertions.
"""

from __future__ import annotations

from bench.parity import (  # noqa: F401  (re-exported for the tests)
    NEAR_TIE,
    gap_to_argmax,
    greedy_parity_failure,
    near_ties,
    next_token_logprobs,
    reference_greedy,
    teacher_forced_failure,
)
from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel


def chat(loaded: LoadedModel, text: str) -> list[int]:
    """A one-message user turn in the model's chat template, ready for its reply."""
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def make_engine(loaded: LoadedModel, **config: object) -> Engine:
    """An engine on `loaded`; `config`: EngineConfig's fields, the speculative ones flat
    (`speculative="ngram"`: EngineConfig.from_flat)."""
    return Engine(EngineConfig.from_flat(model=loaded.name, **config), loaded=loaded)


def assert_teacher_forced(
    ref: LoadedModel, prompt: list[int], got: list[int], start: int = 0
) -> None:
    """Each got[j], j >= start, is the reference's argmax after prompt + got[:j], or within
    NEAR_TIE of it."""
    failure = teacher_forced_failure(ref, prompt, got, start)
    assert failure is None, failure


def assert_greedy_parity(
    ref: LoadedModel, prompt: list[int], got: list[int], want: list[int]
) -> None:
    """`got` equals the reference's greedy `want` token for token, or leaves it at a near-tie
    and from there on holds to the near-tie rule teacher-forced (every later token is checked,
    not only the first that differs)."""
    failure = greedy_parity_failure(ref, prompt, got, want)
    assert failure is None, failure
