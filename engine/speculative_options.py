"""The engine's speculative decoding settings as given: one object, `EngineConfig.speculative`.

What is left open here (`auto`, a row cap or row cost of None) the engine resolves at start,
once it knows its forward and kernels, into the scheduler's SpeculativeConfig (`resolve`).
The flags stay flat for users (`--speculative`, `--num-speculative-tokens`, ...), as do
`--speculative-config`'s keys and bench variants: FLAT_FIELDS names each setting's field, and
`EngineConfig.from_flat` builds a config from those names. Pure: no torch, read with the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from scheduler import SPECULATIVE_METHODS, SpeculativeConfig
from scheduler.config import SCHEDULER_DEFAULTS

_Number = TypeVar("_Number", int, float)

SPEC = SCHEDULER_DEFAULTS.speculative
SPECULATIVE_CHOICES = ("auto", *SPECULATIVE_METHODS)

# The flat names (the engine flags' and --speculative-config's) -> SpeculativeOptions' fields.
FLAT_FIELDS = {
    "speculative": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_resume": "prompt_lookup_resume",
    "speculative_history_tokens": "history_tokens",
    "speculative_max_step_tokens": "max_step_tokens",
    "speculative_draft_row_cost": "draft_row_cost",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "speculative_model": "model",
    "speculative_kv_cache_memory": "kv_cache_memory",
}


@dataclass(frozen=True, slots=True)
class SpeculativeOptions:
    """The settings the scheduler's SpeculativeConfig shares keep its names and defaults."""

    # "ngram" verifies prompt-lookup drafts, "draft" a draft model's (`model`, which implies
    # it), "none" is off; "auto": a draft model's when one is named, else ngram under
    # continuous batching (measured: 1.4-2.4x one user's tokens/s, a 64-request trace
    # 1.0-1.04x; docs/performance.md), else none.
    method: str = "auto"
    num_speculative_tokens: int = SPEC.num_speculative_tokens
    prompt_lookup_max: int = SPEC.prompt_lookup_max
    prompt_lookup_min: int = SPEC.prompt_lookup_min
    # Prompt lookup also resumes a copy after a token an edit replaced (scheduler/speculation/
    # ngram.py); False: the tail's own n-grams only.
    prompt_lookup_resume: bool = SPEC.prompt_lookup_resume
    # Finished replies' tokens whose n-grams prompt lookup also proposes from (0: none).
    history_tokens: int = SPEC.history_tokens
    # Drafts only while a step's rows stay within this; None: the rows one pass of the CPU
    # kernels serves where the forward is quantized (4-8 by ISA: speculative_step_rows in
    # engine/startup.py), else SPEC.max_step_tokens.
    max_step_tokens: int | None = None
    # What one more row costs as a share of a one-row step: drafts are verified only while
    # their measured odds of being kept pay for it (scheduler/speculation/odds.py); None:
    # measured by the engine from its own decode steps (scheduler/speculation/row_cost.py),
    # starting from the CPU kernels' level's figure where the forward is quantized
    # (draft_row_cost in engine/startup.py), else SPEC.draft_row_cost; a number fixes it (0:
    # every draft the other limits allow).
    draft_row_cost: float | None = None
    # No drafts while more sequences than this run (vLLM's disable_by_batch_size); None: only
    # the row cap above stops them.
    disable_by_batch_size: int | None = SPEC.disable_by_batch_size
    # A draft model proposes instead (vLLM's --speculative-model): a small model with the
    # target's tokenizer, greedy on its own KV pool (engine/draft_model.py); implies "draft".
    model: str | None = None
    # The draft model's KV pool, taken out of the KV budget ("64MiB"); None: DRAFT_KV_SHARE of it.
    kv_cache_memory: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_CHOICES:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_CHOICES}, got {self.method!r}"
            )
        if self.model is not None and self.method not in ("auto", "none", "draft"):
            raise ValueError(
                f"--speculative-model proposes drafts itself; it cannot go with --speculative "
                f"{self.method}"
            )
        if self.method == "draft" and self.model is None:
            raise ValueError("speculative method draft needs a draft model (--speculative-model)")
        self.resolve("continuous")  # the numbers, checked as the scheduler's settings check them

    def method_for(self, batching: str) -> str:
        """`method` resolved: "draft" when a draft model is named; auto's choice."""
        if self.model is not None:
            return "draft"
        if self.method == "auto":
            return "ngram" if batching == "continuous" else "none"
        return self.method

    def resolve(
        self,
        batching: str,
        max_step_tokens: int | None = None,
        draft_row_cost: float | None = None,
    ) -> SpeculativeConfig:
        """The scheduler's settings under `batching`; `max_step_tokens` and `draft_row_cost`:
        the row cap and row cost as start-up resolved them (None: the configured ones, else the
        defaults). Raises ValueError for a setting out of range."""
        return SpeculativeConfig(
            self.method_for(batching),
            self.num_speculative_tokens,
            self.prompt_lookup_max,
            self.prompt_lookup_min,
            _first_set(max_step_tokens, self.max_step_tokens, SPEC.max_step_tokens),
            _first_set(draft_row_cost, self.draft_row_cost, SPEC.draft_row_cost),
            # Unless configured, the engine measures it from its steps (that start is a guess).
            measure_row_cost=self.draft_row_cost is None,
            history_tokens=self.history_tokens,
            prompt_lookup_resume=self.prompt_lookup_resume,
            disable_by_batch_size=self.disable_by_batch_size,
        )


def _first_set(*values: _Number | None) -> _Number:
    return next(v for v in values if v is not None)
