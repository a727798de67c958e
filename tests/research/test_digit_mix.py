"""research/digit_mix.py: activations rounded as the VNNI kernel's digits, per scheme."""

from __future__ import annotations

import pytest
import torch

from research.digit_mix import Counts, rounded, run


def test_two_digits_are_finer_than_one_and_mixed_schemes_sit_between() -> None:
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 40  # an outlier channel: the first block of every token
    block_max = x.view(16, 3, 32).abs().amax(-1, keepdim=True)
    err = {
        s: ((rounded(x, s) - x).view(16, 3, 32).abs() / block_max).max().item() for s in ("1", "2")
    }
    assert err["2"] <= 0.5 / 127 / 254 + 1e-6 < err["1"] <= 0.5 / 127 + 1e-6
    counts = Counts()
    mixed = rounded(x, "max:0.5", counts)
    # The outlier's block keeps two digits, the two others get one.
    assert torch.equal(mixed[:, :32], rounded(x, "2")[:, :32])
    assert torch.equal(mixed[:, 32:], rounded(x, "1")[:, 32:])
    assert (counts.blocks, counts.one_digit_blocks) == (48, 32)
    assert (counts.tiles, counts.one_digit_tiles) == (6, 4)  # 2 tiles of 8 x 3 blocks


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="max:TAU"):
        rounded(torch.ones(1, 32), "min:0.5")


def test_two_digits_keep_the_exact_modes_greedy_text() -> None:
    (two,) = run("smollm2-135m", ["2"], max_tokens=4)
    assert (two.equal, two.passed, two.failures) == (8, 8, [])
