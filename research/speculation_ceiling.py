"""How many tokens a verification step could keep on a trace: prompt lookup replayed over the
model's own greedy outputs, with no cost model and no pause policy (the ceiling a proposer sets).

`python -m research.speculation_ceiling [--trace bench/traces/quoting.json] [--output-len 128]`

Each request's greedy output is computed once (speculation off: the tokens any exact speculation
must give). Then, position by position, the proposer's drafts are compared with the output, a
step keeps the matching prefix and the token after it, and the next step starts there. With
`--candidates C`, up to C distinct continuations (from every earlier match of the tail, longest
n-grams and latest matches first) are verified together and the step keeps the longest match: a
tree of C branches. `--stop-at-eos` cuts each output at its first EOS (what a user is shown).
A step that keeps 2 tokens at the price of one would double tokens/s only if verifying were free;
`--draft-cost C` also gives the best speed-up a proposer could reach with these continuations when
each draft row costs C of a plain step (drafting exactly what each step keeps). `--history N`:
the N longest replies replayed with the engine's own proposer, from their own text and with the
trace's other replies as earlier ones (`--speculative-history-tokens`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Lookup:
    """Prompt lookup's settings: drafts per step, the n-gram sizes, the candidates verified."""

    num_drafts: int = 7
    lookup_min: int = 2
    lookup_max: int = 4
    candidates: int = 1

    def continuations(self, tokens: Sequence[int]) -> list[list[int]]:
        """Up to `candidates` distinct continuations of `tokens`' tail, longest n-gram first,
        then latest match first (the n-gram proposer's own order for its first)."""
        found: list[list[int]] = []
        n_tokens = len(tokens)
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            tail = list(tokens[n_tokens - n :])
            for i in range(n_tokens - n - 1, -1, -1):
                if list(tokens[i : i + n]) == tail:
                    follow = list(tokens[i + n : i + n + self.num_drafts])
                    if follow and follow not in found:
                        found.append(follow)
                        if len(found) == self.candidates:
                            return found
        return found


def kept_per_step(prompt: Sequence[int], output: Sequence[int], lookup: Lookup) -> list[int]:
    """The drafts each verification step keeps while producing `output` after `prompt` (each
    step also gives the token after them)."""
    return [kept for _, kept in replay(prompt, output, lookup.continuations)]


def replay(
    prompt: Sequence[int],
    output: Sequence[int],
    continuations: Callable[[list[int]], list[list[int]]],
) -> list[tuple[int, int]]:
    """(output tokens made, drafts kept) after each verification step producing `output`,
    each step keeping the longest match among `continuations` of the tokens so far."""
    tokens, at, steps = list(prompt), 0, []
    while at < len(output):
        kept = 0
        for drafts in continuations(tokens):
            n = 0
            # The output's last token is the step's own pick, never a kept draft.
            while n < len(drafts) and at + n < len(output) - 1 and drafts[n] == output[at + n]:
                n += 1
            kept = max(kept, n)
        tokens += output[at : at + kept + 1]
        at += kept + 1
        steps.append((at, kept))
    return steps


def with_history(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], num_drafts: int, longest: int
) -> list[str]:
    """The `longest` replies' tokens a step, from their own text (prompt lookup, n-grams 2-4)
    and with every other reply of the trace in the history as well (the engine's proposer,
    scheduler/speculation/ngram.py): all of it, and its last 40% (where an all-at-once trace
    has most of the others finished)."""
    from scheduler.speculation import NgramProposer, OutputHistory

    lines = []
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][1]))[:longest]
    for i in order:
        history = OutputHistory(capacity=10**9)
        for j, (_, other) in enumerate(pairs):
            if j != i:
                history.add(other)
        prompt, output = pairs[i]
        cells = []
        for proposer in (NgramProposer(4, 2), NgramProposer(4, 2, history)):
            steps = replay(prompt, output, lambda t, p=proposer: [p.follow(t, num_drafts).tokens])
            tail = [kept for at, kept in steps if at > 0.6 * len(output)]
            whole = len(output) / len(steps)
            cells.append(f"{whole:5.2f} {sum(k + 1 for k in tail) / max(1, len(tail)):5.2f}")
        lines.append(f"{len(output):>6} " + "  | ".join(cells))
    return lines


def steps_to_decode(prompt: Sequence[int], output: Sequence[int], lookup: Lookup) -> int:
    """Verification steps that produce `output` after `prompt` (one token a step at least)."""
    return len(kept_per_step(prompt, output, lookup))


def tokens_per_step(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], lookup: Lookup) -> float:
    total = sum(len(output) for _, output in pairs)
    return total / max(1, sum(steps_to_decode(p, o, lookup) for p, o in pairs))


def speedup_bound(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], lookup: Lookup, draft_cost: float
) -> float:
    """Tokens/s against plain decoding if each draft row costs `draft_cost` of a plain step and
    the proposer drafted exactly the tokens each step keeps (no policy does better with these
    continuations; a real one pays for drafts that fail too)."""
    tokens = cost = 0.0
    for prompt, output in pairs:
        for kept in kept_per_step(prompt, output, lookup):
            tokens += kept + 1
            cost += 1 + draft_cost * kept
    return tokens / cost if cost else 1.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="bench/traces/quoting.json")
    p.add_argument("--output-len", type=int, default=None, help="default: the trace's")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--stop-at-eos", action="store_true")
    p.add_argument("--drafts", default="3,5,7", help="comma-separated drafts per step")
    p.add_argument("--candidates", default="1,2,4,8", help="comma-separated branch counts")
    p.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="N",
        help="also the N longest replies with the trace's other replies as earlier ones",
    )
    p.add_argument(
        "--draft-cost",
        type=float,
        default=None,
        help="also the speed-up bound when a draft row costs this share of a plain step "
        "(`jitney bench offline --speculative ngram` measures it: steps by drafts verified)",
    )
    args = p.parse_args(argv)
    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from engine.speculative_options import SpeculativeOptions
    from generation.sampling_params import SamplingParams

    requests = json.loads(Path(args.trace).read_text())["requests"]
    engine = Engine(EngineConfig(model=args.model, speculative=SpeculativeOptions("none")))
    prompts = [r["prompt_ids"] for r in requests]
    params = [
        SamplingParams(
            max_tokens=args.output_len or r["output_len"], temperature=0, ignore_eos=True
        )
        for r in requests
    ]
    done = engine.generate(prompts, params)
    eos = set(engine.eos_token_ids) if args.stop_at_eos else set()
    pairs = []
    for prompt, result in zip(prompts, done, strict=True):
        output = result.token_ids
        cut = next((i for i, t in enumerate(output) if t in eos), len(output))
        pairs.append((prompt, output[:cut]))
    print(f"{len(pairs)} requests, {sum(len(o) for _, o in pairs)} output tokens")
    print("tokens a step keeps (n-grams 2-4 | 1-4)")
    print(f"{'candidates':>10} " + " ".join(f"{f'k={k}':>13}" for k in args.drafts.split(",")))
    for c in (int(c) for c in args.candidates.split(",")):
        cells = []
        for k in (int(k) for k in args.drafts.split(",")):
            two = tokens_per_step(pairs, Lookup(k, 2, 4, c))
            one = tokens_per_step(pairs, Lookup(k, 1, 4, c))
            cells.append(f"{two:6.2f} |{one:5.2f}")
        print(f"{c:>10} " + " ".join(f"{cell:>13}" for cell in cells))
    if args.history:
        print("tokens a step, own text | with the other replies (all, last 40%), 7 drafts")
        print(f"{'tokens':>6} {'own':^11}  | {'with others':^11}")
        print("\n".join(with_history(pairs, 7, args.history)))
    if args.draft_cost is not None:
        print(f"speed-up bound at {args.draft_cost} of a step per draft row, one candidate")
        cells = []
        for k in (int(k) for k in args.drafts.split(",")):
            two = speedup_bound(pairs, Lookup(k, 2, 4, 1), args.draft_cost)
            one = speedup_bound(pairs, Lookup(k, 1, 4, 1), args.draft_cost)
            cells.append(f"{two:6.2f} |{one:5.2f}")
        print(f"{'':>10} " + " ".join(f"{cell:>13}" for cell in cells))


if __name__ == "__main__":
    main()
