"""The batched sampler: greedy, temperature, top-k, top-p, counter-based seeds, distributions.

The module loads the C++ kernels first, so every test here samples through them where they can
be built; `test_the_cpp_draws_are_the_references` checks them against the torch reference."""

import math
from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest
import torch

from bench.gpu_check import count_sampling_syncs
from engine.kernels import kernel_backend, reference
from engine.sampler import (
    TokenHistory,
    adjust_logits,
    random_bits,
    sample,
    token_logprobs,
    with_seed,
)
from generation import SamplingParams

CPU = torch.device("cpu")
NATIVE = kernel_backend().is_native  # loads the C++ kernels (or says why not)
DRAWS = 20_000  # draws per distribution check: one batched call, one row per position
SIGMAS = 5.0  # a token's frequency may be this many binomial standard deviations off


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


def draws(row: torch.Tensor, params: SamplingParams, n: int = DRAWS) -> list[int]:
    """n draws of one request from one row of logits: positions 0..n-1, in one batch."""
    return sample(row.expand(n, -1), [params] * n, range(n))


def test_greedy_picks_the_argmax():
    """temperature 0 and top_k 1 are argmax, also next to sampled rows."""
    logits = logits_rows(6)
    greedy = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=3)]
    assert sample(logits, greedy * 3, [0] * 6) == logits.argmax(-1).tolist()
    mixed = [greedy[0], SamplingParams(seed=1), greedy[1]] * 2
    tokens = sample(logits, mixed, range(6))
    assert [tokens[i] for i in (0, 2, 3, 5)] == logits.argmax(-1)[[0, 2, 3, 5]].tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    """A seeded request draws the same tokens alone or beside greedy, top-k and top-p rows."""
    params = SamplingParams(temperature=1.0, seed=1234)
    row = logits_rows(1, seed=3)
    alone = [sample(row, [params], [pos])[0] for pos in range(20)]
    others = [
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=0),
        SamplingParams(top_k=4, seed=6),
        SamplingParams(top_p=0.8, seed=7),
    ]
    batched = []
    for pos in range(20):
        rows = torch.cat([logits_rows(2, seed=100 + pos), row, logits_rows(2, seed=200 + pos)])
        mates = others[pos % 4 :] + others[: pos % 4]
        batched.append(sample(rows, [*mates[:2], params, *mates[2:]], [7, 0, pos, 3, 9])[2])
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_the_draw_depends_on_seed_and_position_only():
    """Position p's draw is the same however the stream got there (a takeover resumes at p),
    and another seed gives another stream."""
    row = logits_rows(1, seed=4).expand(40, -1)
    params = [SamplingParams(seed=9)] * 40
    whole = sample(row, params, range(40))
    assert sample(row[:15], params[:15], range(25, 40)) == whole[25:]
    assert sample(row, [SamplingParams(seed=10)] * 40, range(40)) != whole


def test_top_k_never_picks_a_cut_token():
    """top_k=k only ever picks among the k largest logits, and uses all of them."""
    row = logits_rows(1, seed=5)[0]
    top3 = set(torch.topk(row, 3).indices.tolist())
    picks = set(draws(row, SamplingParams(temperature=2.0, top_k=3, seed=0), 2000))
    assert picks == top3


def test_top_k_keeps_ties_with_the_kth_logit():
    """Tokens tied with the k-th largest logit are all kept (the cut is by value)."""
    row = torch.tensor([3.0, 1.0, 1.0, 1.0, -2.0, 0.0])
    picks = set(draws(row, SamplingParams(top_k=2, seed=1), 2000))
    assert picks == {0, 1, 2, 3}


def test_top_p_keeps_the_nucleus_only():
    """With one token holding 90% of the mass, top_p=0.5 always picks it; otherwise the fewest
    tokens, largest first, whose mass reaches top_p."""
    logits = torch.full((10,), -5.0)
    logits[7] = 5.0
    assert set(draws(logits, SamplingParams(top_p=0.5, seed=1), 500)) == {7}
    probs = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])
    # Sorted: 0.3, 0.25, 0.2, then two of 0.1 (tied: both stay or neither), then 0.05.
    for top_p, nucleus in [(0.25, {1}), (0.5, {1, 3}), (0.6, {1, 3, 4}), (0.8, {0, 1, 3, 4, 5})]:
        params = SamplingParams(top_p=top_p, seed=2)
        assert set(draws(probs.log(), params, 3000)) == nucleus, top_p


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    """The cut is a logit threshold: tokens tied with the last token kept all stay, so which of
    them stays never depends on sort order (device, batch)."""
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    assert set(draws(probs.log(), SamplingParams(top_p=0.5, seed=3), 2000)) == {0, 1, 2, 3}
    assert set(draws(probs.log(), SamplingParams(top_p=0.4, seed=3), 500)) == {0}


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """The distribution a request should sample from, in plain Python: softmax(logits / T),
    top-k, then the fewest tokens, largest first, whose mass reaches top_p (ties kept)."""
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if params.top_k:
        kth = scaled[order[min(params.top_k, len(order)) - 1]]
        order = [i for i in order if scaled[i] >= kth]
    weights = {i: math.exp(scaled[i] - scaled[order[0]]) for i in order}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in order:
        if mass >= params.top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    kept = [i for i in order if scaled[i] >= scaled[kept[-1]]]
    norm = sum(weights[i] for i in kept)
    return [weights[i] / norm if i in kept else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.5, seed=12),
        SamplingParams(temperature=1.7, seed=13),
        SamplingParams(temperature=1.0, top_k=4, seed=14),
        SamplingParams(temperature=0.8, top_p=0.7, seed=15),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, seed=16),
    ],
    ids=["t1", "t0.5", "t1.7", "top-k", "top-p", "top-k+top-p"],
)
def test_draws_follow_the_filtered_distribution(params):
    """20,000 seeded draws: each token's frequency is within 5 binomial standard deviations
    of its probability after temperature, top-k and top-p, and cut tokens never appear."""
    logits = [1.5, 0.2, -0.4, 2.0, 0.9, -1.3, 0.0, 1.1]
    expected = reference_probs(logits, params)
    counts = Counter(draws(torch.tensor(logits), params))
    for token, p in enumerate(expected):
        freq = counts[token] / DRAWS
        if p == 0:
            assert counts[token] == 0, f"token {token} was cut but drawn"
        else:
            sigma = math.sqrt(p * (1 - p) / DRAWS)
            assert abs(freq - p) <= SIGMAS * sigma, (token, freq, p)


def test_consecutive_positions_and_seeds_are_independent():
    """Pairs (position i, i+1) of one seed, and (seed s, s+1) at one position, are spread over
    the 4 × 4 outcomes of a flat 4-token distribution as independence predicts: chi-square
    with 15 degrees of freedom below 40 (p ≈ 0.0005)."""
    flat = torch.zeros(4)
    one_seed = draws(flat, SamplingParams(seed=21), DRAWS + 1)
    seeds = [SamplingParams(seed=s) for s in range(DRAWS + 1)]
    one_position = sample(flat.expand(DRAWS + 1, -1), seeds, [5] * (DRAWS + 1))
    for stream in (one_seed, one_position):
        pairs = Counter(pairwise(stream))
        expected = DRAWS / 16
        chi2 = sum((pairs[(a, b)] - expected) ** 2 / expected for a in range(4) for b in range(4))
        assert chi2 < 40, chi2


def _mix64(x: int) -> int:
    """splitmix64's finalizer on plain integers: the reference for the tensor version."""
    m = (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_random_bits_match_a_plain_integer_reference():
    """The tensor hash (int64, wrapping) gives the bits unsigned 64-bit arithmetic gives, for
    seeds anywhere in the 64-bit range: the same on every device."""
    golden, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    seeds, positions, vocab = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -5], [0, 3, 17, 1, 900, 2], 7
    bits = random_bits(seeds, positions, vocab, CPU).tolist()
    for row, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        key = _mix64((seed & m) ^ _mix64((pos * golden + 1) & m))
        expected = [_mix64((key + t * golden) & m) >> 32 for t in range(vocab)]
        assert bits[row] == expected


def test_unseeded_requests_get_a_seed_and_sampled_rows_need_one():
    """with_seed draws a seed for a sampled request (greedy ones need none); sample refuses a
    sampled row without one."""
    seeded = with_seed(SamplingParams(temperature=0.9))
    assert seeded.seed is not None and seeded.temperature == 0.9
    assert with_seed(SamplingParams(seed=4)).seed == 4
    assert with_seed(SamplingParams(temperature=0)).seed is None
    with pytest.raises(ValueError, match="seed"):
        sample(logits_rows(1), [SamplingParams()], [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_draw_the_same_tokens():
    """The same bits on both devices, and the same tokens but where two tokens' scores tie to
    within float rounding (softmax and log1p may round differently): at most 2 rows of 512."""
    logits = logits_rows(512, vocab=4096, seed=8)
    params = [
        SamplingParams(temperature=0.3 + (i % 7) * 0.2, top_k=(i % 3) * 20, top_p=1 - (i % 4) / 8)
        for i in range(512)
    ]
    params = [replace(p, seed=i) for i, p in enumerate(params)]
    positions = list(range(512))
    cuda = torch.device("cuda")
    assert random_bits([1, 2], [3, 4], 4096, CPU).tolist() == (
        random_bits([1, 2], [3, 4], 4096, cuda).tolist()
    )
    on_cpu = sample(logits, params, positions)
    on_cuda = sample(logits.to(cuda), params, positions)
    assert sum(a != b for a, b in zip(on_cpu, on_cuda, strict=True)) <= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_sampled_step_waits_on_the_device_once():
    """Everything the sampler sends to the device goes asynchronously (engine/device_copy.py):
    torch's sync debug mode sees one sync, the sampled ids coming back."""
    assert count_sampling_syncs(torch.device("cuda")) == 1


# ----- logit adjustments: penalties, bias, min_tokens -------------------------------------------
def test_penalties_follow_their_formulas_row_by_row():
    """frequency/presence (OpenAI): logit - f * count - p * (count > 0) over the output;
    repetition (CTRL): seen tokens' positive logits divided, negative ones multiplied; a row
    that asks for nothing is left as it was."""
    logits = logits_rows(3)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
    ]
    histories = [
        TokenHistory(prompt=[9], output=[1, 1, 2]),
        TokenHistory(prompt=[], output=[3]),
        TokenHistory(prompt=[4, 4], output=[5]),
    ]
    got = adjust_logits(logits, params, histories)
    want = logits.clone()
    for token, count in ((1, 2), (2, 1)):
        want[0, token] -= 0.5 * count + 0.3
    for token in (4, 5):
        value = want[2, token]
        want[2, token] = value / 1.5 if value > 0 else value * 1.5
    assert torch.allclose(got, want)


def _adjusted_pick(logits, params, positions, histories) -> list[int]:
    """What the engine does: adjust the logits, then sample from them."""
    return sample(adjust_logits(logits, params, histories), params, positions)


def test_logit_bias_and_min_tokens_decide_greedy_picks():
    logits = logits_rows(2)
    top = int(logits[0].argmax())
    forced = SamplingParams(temperature=0, logit_bias=((7, 100.0),))
    banned = SamplingParams(temperature=0, logit_bias=((top, -100.0),))
    history = [TokenHistory([], [])] * 2
    assert _adjusted_pick(logits[:1].expand(2, -1), [forced, banned], [0, 0], history)[0] == 7
    assert _adjusted_pick(logits[:1], [banned], [0], history[:1])[0] != top
    # The argmax is a stop token: held back until min_tokens output tokens exist.
    held = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    early = TokenHistory([], [11], stop_ids={top})
    assert _adjusted_pick(logits[:1], [held], [1], [early])[0] != top
    done = TokenHistory([], [11, 12], stop_ids={top})
    assert _adjusted_pick(logits[:1], [held], [2], [done])[0] == top


def test_adjustments_of_a_row_do_not_depend_on_its_batch():
    logits = logits_rows(5, seed=3)
    params = [SamplingParams(frequency_penalty=1.0, logit_bias=((i, 2.0),)) for i in range(5)]
    histories = [TokenHistory([i], [i, i + 1]) for i in range(5)]
    together = adjust_logits(logits, params, histories)
    for i in range(5):
        alone = adjust_logits(logits[i : i + 1], params[i : i + 1], histories[i : i + 1])
        assert torch.equal(alone[0], together[i])


def test_sampled_rows_draw_from_the_adjusted_distribution():
    """A token biased to -100 is never drawn; a seeded stream stays reproducible."""
    row = logits_rows(1)[0]
    params = SamplingParams(seed=5, logit_bias=((int(row.argmax()), -100.0),))
    n = 2000
    histories = [TokenHistory([], [])] * n
    picks = _adjusted_pick(row.expand(n, -1), [params] * n, range(n), histories)
    assert int(row.argmax()) not in picks
    assert picks == _adjusted_pick(row.expand(n, -1), [params] * n, range(n), histories)


def test_token_logprobs_are_the_log_softmax_with_the_likeliest_alternatives():
    logits = logits_rows(3)
    tokens = [4, 9, 1]
    found = token_logprobs(logits, tokens, [2, None, 0])
    assert found[1] is None  # that row did not ask
    expected = logits.log_softmax(-1)
    assert found[0] is not None and found[2] is not None
    assert found[0].logprob == pytest.approx(float(expected[0, 4]), abs=1e-6)
    top_ids = expected[0].topk(2).indices.tolist()
    assert [i for i, _ in found[0].top] == top_ids
    assert [v for _, v in found[0].top] == pytest.approx(expected[0].topk(2).values.tolist())
    assert found[2].top == () and found[2].logprob == pytest.approx(float(expected[2, 1]))
    assert token_logprobs(logits, tokens, [None] * 3) == [None] * 3


def test_logprobs_reflect_penalties_and_bias_not_temperature():
    """They come from the adjusted logits at temperature 1 (what the README promises)."""
    logits = logits_rows(1)
    params = [SamplingParams(temperature=0.3, seed=1, logit_bias=((3, 5.0),), logprobs=1)]
    adjusted = adjust_logits(logits, params, [TokenHistory([], [])])
    found = token_logprobs(adjusted, [3], [1])[0]
    assert found is not None
    assert found.logprob == pytest.approx(float(adjusted.log_softmax(-1)[0, 3]), abs=1e-6)
    assert found.logprob > float(logits.log_softmax(-1)[0, 3])


@pytest.mark.skipif(not NATIVE, reason=f"C++ kernels not in use: {kernel_backend().reason}")
def test_the_cpp_draws_are_the_references():
    """jitney::sample_rows in C++ (the nucleus sorted only as far as needed, sums in double)
    draws the token the torch reference does, row by row, across top-k, top-p, both and neither,
    peaked and flat rows, and tied logits; argmax_rows is torch.argmax, NaN and ties included."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(30):
        n, vocab = 64, 3000
        scale = 0.3 + 8 * torch.rand(n, 1, generator=gen)
        x = torch.randn(n, vocab, generator=gen) * scale
        x[:8] = x[:8].round()  # ties, past the k-th too (bf16 logits tie often)
        top_k = torch.randint(0, 80, (n,), generator=gen) * (torch.rand(n, generator=gen) < 0.5)
        top_p = torch.where(
            torch.rand(n, generator=gen) < 0.6, torch.rand(n, generator=gen), torch.ones(n)
        )
        u = torch.rand(n, generator=gen)
        native = torch.ops.jitney.sample_rows(x, top_k, top_p, u)
        assert torch.equal(native, reference.sample_rows(x, top_k, top_p, u))
        assert torch.equal(torch.ops.jitney.argmax_rows(x), x.argmax(dim=-1))
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 5.0, float("nan"), 1.0]])
    ties = torch.cat([ties, torch.zeros(2, 20)], dim=1)  # past one vector of 8
    assert torch.ops.jitney.argmax_rows(ties).tolist() == ties.argmax(dim=-1).tolist() == [1, 0]
    late_nan = torch.zeros(1, 37)
    late_nan[0, 30] = float("nan")
    assert torch.ops.jitney.argmax_rows(late_nan).tolist() == [30]
    with pytest.raises(RuntimeError, match="sample_rows: top_k must be"):
        torch.ops.jitney.sample_rows(x, top_k.int(), top_p, u)


def test_the_gpu_cut_of_every_row_is_the_cpu_cut_of_the_rows_that_ask():
    """Off the CPU, sample_rows cuts every row over a full sort and keeps the cut where a row
    asks (no host read, which a GPU pays with a wait for the whole forward); the CPU cuts only
    the rows that ask, at k's width. Same logits out, across top-k, top-p, both and neither,
    peaked and flat rows, and ties."""
    gen = torch.Generator().manual_seed(9)
    for _ in range(20):
        n, vocab = 48, 700
        x = torch.randn(n, vocab, generator=gen) * (0.3 + 8 * torch.rand(n, 1, generator=gen))
        x[:4] = x[:4].round()  # ties at the cut
        top_k = torch.randint(0, 60, (n,), generator=gen) * (torch.rand(n, generator=gen) < 0.5)
        top_p = torch.where(
            torch.rand(n, generator=gen) < 0.6, torch.rand(n, generator=gen), torch.ones(n)
        )
        want = reference.cut_asking_rows(x, top_k, top_p)
        assert torch.equal(reference.cut_every_row(x, top_k, top_p), want)
