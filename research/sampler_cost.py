"""What the sampler's scans cost a step: over N rows of a vocabulary-wide batch of logits, for
greedy and the common sampling settings, in C++ and in the torch reference (engine/kernels).

`python -m research.sampler_cost [--rows 64] [--vocab 49152] [--threads 2] [--repeat 10]`

The logits are a real model's scale (standard normal times 3: after a temperature of 0.2 a
nucleus of top_p 0.9 holds a few tokens, at temperature 1 thousands), one row per request; the
same rows and draws go through both implementations, and the table says whether their tokens
agree.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from engine.kernels import kernel_backend, reference
from engine.sampler import uniforms, with_seed
from generation.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "T 0.2, top_p 0.9 (SmolLM2's defaults)": SamplingParams(temperature=0.2, top_p=0.9),
    "T 0.7, top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "T 1, top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
}


@dataclass
class Row:
    name: str
    native_ms: float
    reference_ms: float
    same_tokens: bool


def best_ms(run, repeat: int) -> tuple[float, list[int]]:
    tokens = run()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, tokens


def measure(rows: int, vocab: int, repeat: int) -> list[Row]:
    """Per setting, the scans `sample()` runs (jitney::argmax_rows for greedy rows,
    jitney::sample_rows for the others) in C++ and in the torch reference, on the same inputs."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    results = []
    for name, params in SETTINGS.items():
        if params.is_greedy:
            ops = (torch.ops.jitney.argmax_rows, reference.argmax_rows)
            args: tuple = (logits,)
        else:
            seeded = [with_seed(params) for _ in range(rows)]
            x = logits / params.temperature
            top_k = torch.full((rows,), params.top_k, dtype=torch.int64)
            top_p = torch.full((rows,), params.top_p)
            u = uniforms([p.seed for p in seeded], range(rows), logits.device)
            ops = (torch.ops.jitney.sample_rows, reference.sample_rows)
            args = (x, top_k, top_p, u)
        native_ms, native = best_ms(lambda f=ops[0], a=args: f(*a).tolist(), repeat)
        ref_ms, ref = best_ms(lambda f=ops[1], a=args: f(*a).tolist(), max(1, repeat // 5))
        results.append(Row(name, native_ms, ref_ms, native == ref))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = kernel_backend()
    print(f"kernels: {backend.name} ({backend.reason}); {args.rows} rows x {args.vocab}")
    print(f"{'setting':>40} {'C++ ms':>9} {'torch ms':>9}  same tokens")
    for r in measure(args.rows, args.vocab, args.repeat):
        print(f"{r.name:>40} {r.native_ms:>9.2f} {r.reference_ms:>9.2f}  {r.same_tokens}")


if __name__ == "__main__":
    main()
