"""Would one activation digit on some blocks keep greedy text? The exact mode's dense linears,
their inputs rounded as the VNNI kernel rounds them, against the exact mode itself.

`python -m research.digit_mix --model FILE.gguf --schemes 2,1,max:0.25,max:0.1`

Schemes: `2` and `1` digits everywhere (quant_vnni.cpp's rounding per block of 32: hi, and lo
in 254ths); `max:TAU` two digits only on the blocks whose largest value is above TAU times the
token's largest block, one elsewhere. A block of a tile of 8 tokens that none of them gives a
second digit is a kernel's saving (its lo products skipped, no token's arithmetic changed):
reported as the share of such (tile, block) pairs. Verdicts follow bench.greedy_agreement's
prompts and near-tie rule.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.greedy_agreement import PROMPTS
from bench.parity import greedy_parity_failure
from engine.config import EngineConfig
from engine.layers import dense
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation.sampling_params import SamplingParams

BLOCK = 32
TILE = 8  # the VNNI kernel's tokens a tile (kVnniTile)


@dataclass
class Counts:
    """(token, block) pairs and (tile, block) pairs seen, and those with one digit."""

    blocks: int = 0
    one_digit_blocks: int = 0
    tiles: int = 0
    one_digit_tiles: int = 0


def rounded(x: torch.Tensor, scheme: str, counts: Counts | None = None) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as the kernel's digits give it back, per `scheme`."""
    blocks = x.reshape(-1, x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    dx = amax / 127
    v = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    hi = torch.round(v)
    two, one = dx * (hi + torch.round((v - hi) * 254) / 254), dx * hi
    if scheme in ("1", "2"):
        return (one if scheme == "1" else two).reshape(x.shape)
    kind, _, tau = scheme.partition(":")
    if kind != "max" or not tau:
        raise ValueError(f"scheme {scheme!r}: 1, 2 or max:TAU")
    second = amax > float(tau) * amax.amax(1, keepdim=True)  # [T, NB, 1]
    if counts is not None:
        need = second.squeeze(-1)
        counts.blocks += need.numel()
        counts.one_digit_blocks += int((~need).sum())
        padded = F.pad(need, (0, 0, 0, -need.shape[0] % TILE))
        tiles = padded.view(-1, TILE, need.shape[1]).any(1)
        counts.tiles += tiles.numel()
        counts.one_digit_tiles += int((~tiles).sum())
    return torch.where(second, two, one).reshape(x.shape)


@contextmanager
def rounding_inputs(scheme: str, counts: Counts) -> Iterator[None]:
    """Every dense linear rounds its input per `scheme` while this holds."""
    forward = dense.DenseLinear.forward

    def rounded_forward(self: dense.DenseLinear, x: torch.Tensor) -> torch.Tensor:
        return forward(self, rounded(x, scheme, counts) if x.shape[-1] % BLOCK == 0 else x)

    dense.DenseLinear.forward = rounded_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        dense.DenseLinear.forward = forward  # type: ignore[method-assign]


@dataclass
class Verdict:
    scheme: str
    equal: int
    passed: int
    counts: Counts
    failures: list[str]


def run(model: str, schemes: list[str], max_tokens: int = 32) -> list[Verdict]:
    loaded = load_model(model)
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    config = EngineConfig.from_flat(model=model, quantization="none", speculative="none")

    def greedy() -> list[list[int]]:
        return [r.token_ids for r in Engine(config, loaded).generate(prompts, params)]

    want = greedy()
    verdicts = []
    for scheme in schemes:
        counts = Counts()
        with rounding_inputs(scheme, counts):
            got = greedy()
        failures = [
            greedy_parity_failure(loaded, p, g, w)
            for p, g, w in zip(prompts, got, want, strict=True)
        ]
        verdicts.append(
            Verdict(
                scheme,
                sum(g == w for g, w in zip(got, want, strict=True)),
                sum(f is None for f in failures),
                counts,
                [f for f in failures if f],
            )
        )
    return verdicts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--schemes", default="2,1,max:0.25,max:0.1")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    for v in run(args.model, args.schemes.split(","), args.max_tokens):
        c = v.counts
        share = (
            f"; one digit on {c.one_digit_blocks / c.blocks:.1%} of blocks, "
            f"{c.one_digit_tiles / c.tiles:.1%} of (tile, block) pairs"
            if c.blocks
            else ""
        )
        print(f"{v.scheme}: equal {v.equal}/{len(PROMPTS)}, pass {v.passed}/{len(PROMPTS)}{share}")
        for failure in v.failures:
            print(f"    {failure}")


if __name__ == "__main__":
    main()
