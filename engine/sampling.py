"""Per-request sampling: parameters, a reproducible random stream per request, batched picks.

Greedy rows are one argmax over the batch. Random rows each draw from their own
`torch.Generator`, reseeded before every draw from the request's `seed` and the draw's position,
so a request samples the same tokens whatever else shares its batch, after a preemption, and on
another worker that took it over from a dead one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class SamplerState:
    """One request's sampling parameters and its private random stream."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)
    seed: int = 0
    num_drawn: int = 0  # output position of the next draw

    @classmethod
    def create(
        cls, params: SamplingParams, device: torch.device, num_drawn: int = 0
    ) -> SamplerState:
        if params.is_greedy:
            return cls(params)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return cls(params, torch.Generator(device=device), seed, num_drawn)

    def next_generator(self) -> torch.Generator:
        """The generator for the next draw: a pure function of (seed, position)."""
        assert self.generator is not None
        mixed = (self.seed ^ (self.num_drawn * _GOLDEN)) & _SEED_MASK
        self.num_drawn += 1
        return self.generator.manual_seed(mixed)


_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive positions over the seed space
_SEED_MASK = (1 << 63) - 1


def sample(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """Pick one token per row of `logits` ([N, vocab], fp32 preferred) for the N requests."""
    tokens = logits.argmax(dim=-1).tolist()  # right for every greedy row, cheap for the rest
    for i, state in enumerate(states):
        if state.generator is not None:
            tokens[i] = _sample_row(logits[i], state.params, state.next_generator())
    return tokens


def _sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    row = row.float() / params.temperature
    if params.top_k and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = row.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
