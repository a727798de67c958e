"""Synthetic traces in the shared/traces format, for models whose vocabulary the real traces do
not fit (the tiny random model, the random real-size ones): N requests, seeded random prompt ids,
a fixed output length or ("mixed") mixed-64's: lognormal, median 60, sigma 1, within 8..512.

    python -m bench.synthetic_trace --requests 256 --output-len 128 --vocab-size 281 \\
        --output /tmp/uniform-256x128.json

Torch-free; the ids start above the tiny tokenizer's special tokens so none is an EOS.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

FIRST_ORDINARY_ID = 8  # the tiny tokenizer's special tokens come first
MIXED = "mixed"
# shared/traces/mixed-64.json's output lengths: lognormal(median 60, sigma 1), clipped.
MIXED_MEDIAN, MIXED_SIGMA, MIXED_RANGE = 60.0, 1.0, (8, 512)


def mixed_output_len(rng: random.Random) -> int:
    lo, hi = MIXED_RANGE
    return min(hi, max(lo, round(rng.lognormvariate(math.log(MIXED_MEDIAN), MIXED_SIGMA))))


def synthetic_trace(
    num_requests: int,
    output_len: int | str,
    vocab_size: int,
    prompt_len: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> dict[str, Any]:
    if output_len != MIXED and not (isinstance(output_len, int) and output_len >= 1):
        raise ValueError(f"output_len must be >= 1 or {MIXED!r}, got {output_len!r}")
    if num_requests < 1 or vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError("need >= 1 request and vocab_size > 8")
    lo, hi = prompt_len
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt lengths must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        n = rng.randint(lo, hi)
        ids = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)]
        requests.append(
            {
                "id": i,
                "arrival_s": 0.0,
                "prompt_len": n,
                "output_len": mixed_output_len(rng) if output_len == MIXED else output_len,
                "prompt_ids": ids,
            }
        )
    meta = {
        "seed": seed,
        "n": num_requests,
        "kind": f"synthetic-{MIXED if output_len == MIXED else 'uniform'}",
        "output_len": output_len,
        "vocab_size": vocab_size,
        "prompt_len": [lo, hi],
    }
    return {"meta": meta, "requests": requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, required=True)
    p.add_argument(
        "--output-len",
        type=lambda v: v if v == MIXED else int(v),
        default=128,
        help=f"tokens per request, or {MIXED!r}: mixed-64's length distribution",
    )
    p.add_argument("--vocab-size", type=int, default=281, help="281: the tiny-random model's")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    trace = synthetic_trace(
        args.requests,
        args.output_len,
        args.vocab_size,
        (args.min_prompt_len, args.max_prompt_len),
        args.seed,
    )
    Path(args.output).write_text(json.dumps(trace))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
