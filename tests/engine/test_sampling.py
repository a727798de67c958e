"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, parameter validation."""

import pytest
import torch

from engine.sampling import SamplerState, SamplingParams, sample

CPU = torch.device("cpu")


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_picks_the_argmax():
    """temperature 0 is argmax, row by row."""
    logits = logits_rows(4)
    states = [SamplerState.create(SamplingParams(temperature=0), CPU) for _ in range(4)]
    assert sample(logits, states) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    """A seeded request draws the same sequence alone or next to other requests."""
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = logits_rows(1, seed=3)
    alone = SamplerState.create(params, CPU)
    batched = SamplerState.create(params, CPU)
    others = [SamplerState.create(SamplingParams(temperature=0.7), CPU) for _ in range(3)]
    seq_alone = [sample(logits, [alone])[0] for _ in range(20)]
    seq_batched = []
    for step in range(20):
        rows = torch.cat([logits_rows(3, seed=100 + step), logits])
        seq_batched.append(sample(rows, [*others, batched])[-1])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # it really samples


def test_top_k_one_is_greedy_and_top_k_limits_choices():
    """top_k=k only ever picks among the k largest logits."""
    logits = logits_rows(1, seed=5)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    state = SamplerState.create(SamplingParams(temperature=2.0, top_k=3, seed=0), CPU)
    picks = {sample(logits, [state])[0] for _ in range(200)}
    assert picks <= top3 and len(picks) > 1
    greedy = SamplerState.create(SamplingParams(top_k=1), CPU)
    assert sample(logits, [greedy]) == logits.argmax(-1).tolist()


def test_top_p_keeps_the_nucleus_only():
    """With one token holding 90% of the mass, top_p=0.5 always picks it."""
    logits = torch.full((1, 10), -5.0)
    logits[0, 7] = 5.0
    state = SamplerState.create(SamplingParams(temperature=1.0, top_p=0.5, seed=1), CPU)
    assert {sample(logits, [state])[0] for _ in range(100)} == {7}
    flat = torch.zeros((1, 10))
    state = SamplerState.create(SamplingParams(temperature=1.0, top_p=0.35, seed=1), CPU)
    assert len({sample(flat, [state])[0] for _ in range(300)}) == 4  # 4 × 10% reaches 35%


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_parameters_are_refused(kwargs, message):
    """Out-of-range sampling parameters raise ValueError naming the field."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
