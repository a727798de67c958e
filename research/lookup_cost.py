"""What prompt lookup costs a speculating sequence per step, by context length: the index
(`NgramProposer.propose`, the engine's way) against a scan back through the text
(`NgramProposer.follow` over the whole text, the engine's way before the index).

`python -m research.lookup_cost [--contexts 1000,8000,32000] [--steps 200] [--vocab 49152]`

Each context: a prompt of random tokens (a vocabulary the bundled model's size: tails found
nowhere, the common case outside a quote), then `--steps` steps that each append one token and
propose 7 drafts, timed per step; the two ways run on the same text in the same process and give
the same drafts (checked). Also the index's first proposal, which indexes the whole prompt once;
the ratio is the scan's time a step over the index's.
"""

from __future__ import annotations

import argparse
import random
import time

from scheduler import Sequence
from scheduler.speculation import NgramProposer

DRAFTS = 7


def per_step_ms(context: int, steps: int, vocab: int, seed: int = 0) -> tuple[float, float, float]:
    """(index's first proposal, index per step, scan per step), milliseconds."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(context)]
    added = [rng.randrange(vocab) for _ in range(steps)]
    proposer = NgramProposer()
    seq = Sequence.create("s", prompt, max_tokens=steps + 1)
    started = time.perf_counter()
    proposer.propose(seq, DRAFTS)
    first = time.perf_counter() - started
    indexed = scanned = 0.0
    for token in added:
        seq.append_token(token)
        started = time.perf_counter()
        by_index = proposer.propose(seq, DRAFTS)
        indexed += time.perf_counter() - started
        started = time.perf_counter()
        by_scan = proposer.follow(seq.token_ids(0, seq.num_tokens), DRAFTS)
        scanned += time.perf_counter() - started
        assert by_index == by_scan
    return 1e3 * first, 1e3 * indexed / steps, 1e3 * scanned / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1000,8000,32000")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args(argv)
    print("| context | index's first proposal, ms | index, ms a step | scan, ms a step | ratio |")
    print("|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        first, indexed, scanned = per_step_ms(context, args.steps, args.vocab)
        ratio = scanned / indexed
        print(f"| {context} | {first:.1f} | {indexed:.4f} | {scanned:.3f} | {ratio:.0f}x |")


if __name__ == "__main__":
    main()
