"""The batched sampler: greedy, temperature, top-k and top-p rows in one set of tensor ops.

Randomness is counter-based: each draw's uniform number is a hash of (seed, position), computed
on the device for the whole batch at once, so a request samples the same tokens whatever else
shares its batch, after a preemption, and on another worker that took it over (it resumes at its
position). A token is drawn by inverting the row's cumulative distribution at that number: one
hash per row and one scan over the vocabulary (a hash per token, as the Gumbel-max trick needs,
cost 57 ms a step for 64 rows of SmolLM2's 49,152-token vocabulary on this CPU). The pick is the
first token whose cumulative mass exceeds the target, and the target stays below the row's total,
so a token whose probability is 0 (a cut token) is never picked, whatever the rounding. The cuts
and the draw are engine/kernels' sample_rows (its reference in torch ops defines them).

Before any pick, rows that ask for it have their logits adjusted, all rows together in tensor ops
(`adjust_logits`): frequency and presence penalties from counts of the tokens each row generated,
the repetition penalty over the tokens it has seen (prompt and output), logit_bias, and
min_tokens (stop tokens held at -inf). Greedy rows pick the argmax of the adjusted logits.

CPU and CUDA: the hash is integer arithmetic (64-bit, wrapping), so its bits are the same on both
(tests/engine/test_sampler.py checks them against a plain-integer reference, and CPU against
CUDA where there is one); only the float steps (softmax, the cumulative sum) may round
differently, so a pick can differ only where the target falls within rounding of a boundary.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from engine.device_copy import device_tensor
from engine.kernels import ops as _ops  # noqa: F401  (defines torch.ops.jitney.*)
from generation.sampling_params import SamplingParams


def with_seed(params: SamplingParams) -> SamplingParams:
    """`params` with a seed: an unseeded sampled request gets a random one when it starts."""
    if params.seed is not None or params.is_greedy:
        return params
    return replace(params, seed=random.getrandbits(63))


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed (n > 1): a stream of its own, derived from the request's, so a
    seeded request repeats all its choices (None stays None: each choice draws its own)."""
    return None if seed is None else (seed + index * _GOLDEN) % _U64


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a row's logit adjustments read: its prompt, its output so far, the tokens that
    would stop it (held back until min_tokens)."""

    prompt: Sequence[int]
    output: Sequence[int]
    stop_ids: Collection[int] = ()


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> list[int]:
    """One token per row of `logits` ([N, vocab]) for N requests (already adjusted by
    `adjust_logits` where the params ask); `positions[i]` is the number of output tokens
    request i already has (where its draw is in its random stream). Sampled rows need a seed
    (`with_seed`). One device-to-host transfer: the tokens. The scans over the vocabulary are
    jitney::argmax_rows and jitney::sample_rows (engine/kernels: C++ on the CPU, torch ops
    elsewhere)."""
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return torch.ops.jitney.argmax_rows(logits.float()).tolist()
    device = logits.device
    picked = [params[i] for i in rows]
    if any(p.seed is None for p in picked):
        raise ValueError("sampled rows need a seed: pass their params through with_seed()")
    some = len(rows) < len(params)
    index = device_tensor(rows, device) if some else None
    x = (logits.index_select(0, index) if some else logits).float()
    x = x / _column([p.temperature for p in picked], device)
    top_k = device_tensor([p.top_k for p in picked], device, torch.int64)
    top_p = device_tensor([p.top_p for p in picked], device, torch.float32)
    u = uniforms([p.seed for p in picked], [positions[i] for i in rows], device)
    drawn = torch.ops.jitney.sample_rows(x.contiguous(), top_k, top_p, u)
    if index is None:
        return drawn.tolist()
    greedy = torch.ops.jitney.argmax_rows(logits.float())
    return greedy.index_copy_(0, index, drawn).tolist()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-prob and its row's most likely alternatives (id, log-prob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], counts: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """For rows with a count: the log-prob of `tokens[i]` under `logits[i]` (log-softmax, at
    temperature 1) and its `counts[i]` likeliest alternatives; None for the other rows."""
    rows = [i for i, k in enumerate(counts) if k is not None]
    result: list[TokenLogprobs | None] = [None] * len(counts)
    if not rows:
        return result
    device = logits.device
    x = logits.index_select(0, device_tensor(rows, device)).float().log_softmax(dim=-1)
    picked = device_tensor([tokens[i] for i in rows], device).unsqueeze(1)
    chosen = x.gather(1, picked).squeeze(1).tolist()
    k = max(counts[i] or 0 for i in rows)
    values, ids = x.topk(k, dim=-1) if k else (x[:, :0], x[:, :0].long())
    values_list, ids_list = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = counts[i] or 0
        top = tuple(zip(ids_list[j][:n], values_list[j][:n], strict=True))
        result[i] = TokenLogprobs(chosen[j], top)
    return result


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """`logits` [N, vocab] with every row's penalties, bias and min_tokens applied (float32; a
    new tensor when any row adjusts, else `logits` itself)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    device = logits.device
    index = device_tensor(rows, device)
    x = logits.index_select(0, index).float()
    vocab = x.shape[1]
    picked = [params[i] for i in rows]
    seen = [histories[i] for i in rows]
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in picked):
        counts = _counts([h.output for h in seen], vocab, device)
        frequency = _column([p.frequency_penalty for p in picked], device)
        presence = _column([p.presence_penalty for p in picked], device)
        x -= frequency * counts + presence * (counts > 0)
        if any(p.repetition_penalty != 1 for p in picked):
            repeated = (counts > 0) | (_counts([h.prompt for h in seen], vocab, device) > 0)
            penalty = _column([p.repetition_penalty for p in picked], device)
            x = torch.where(repeated, torch.where(x > 0, x / penalty, x * penalty), x)
    bias = [(j, t, b) for j, p in enumerate(picked) for t, b in p.logit_bias if t < vocab]
    if bias:
        r, t, b = zip(*bias, strict=True)
        where = (device_tensor(r, device), device_tensor(t, device))
        x.index_put_(where, device_tensor(b, device, x.dtype), accumulate=True)
    held = [
        (j, t)
        for j, (p, h) in enumerate(zip(picked, seen, strict=True))
        if len(h.output) < p.min_tokens
        for t in h.stop_ids
        if t < vocab
    ]
    if held:
        r, t = zip(*held, strict=True)
        # A tensor made on the device: a Python float here is copied from the host, a sync.
        where = (device_tensor(r, device), device_tensor(t, device))
        x.index_put_(where, x.new_full((), float("-inf")))
    return logits.float().index_copy(0, index, x)


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] float32: how often each token occurs in each list (one scatter for all)."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        # Padding points at an extra column, dropped afterwards.
        padded = [[*tokens, *[vocab] * (width - len(tokens))] for tokens in token_lists]
        ids = device_tensor(padded, device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return device_tensor(values, device, torch.float32).unsqueeze(1)


# ----- counter-based noise -------------------------------------------------------------------
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive counters over the 64-bit space
_MIX1 = 0xBF58476D1CE4E5B9  # splitmix64's finalizer constants
_MIX2 = 0x94D049BB133111EB
_U64 = 1 << 64


def _signed(value: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors: wrapping multiplies, bits as uint64 would hold."""
    x = x ^ _shift_right(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shift_right(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


@lru_cache(maxsize=8)
def _token_offsets(vocab: int, device: torch.device) -> torch.Tensor:
    return torch.arange(vocab, dtype=torch.int64, device=device) * _signed(_GOLDEN)


def random_bits(
    seeds: Sequence[int], positions: Sequence[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """[N, vocab] int64 holding 32 random bits per (seed, position, token)."""
    seed, position = device_tensor(  # one host-to-device copy
        [[_signed(s) for s in seeds], list(positions)], device, torch.int64
    )
    key = mix64(seed ^ mix64(position * _signed(_GOLDEN) + 1))
    return _shift_right(mix64(key.unsqueeze(1) + _token_offsets(vocab, device)), 32)


def uniforms(seeds: Sequence[int], positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """[N] float32 uniform draws in [0, 1), 24 bits each (all a float32 holds), one per
    (seed, position)."""
    bits = random_bits(seeds, positions, 1, device).squeeze(1)
    return _shift_right(bits, 8).float() * 2.0**-24
