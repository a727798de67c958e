"""What a verification row costs the forward: one sequence's R rows at a context, R = 1..N.

`python -m research.row_price [--contexts 300,1000] [--rows 8] [--repeat 15] [--digits 2,1]
 [--threads 2]`

The bundled SmolLM2 on its GGUF blocks (the default forward), a float16 KV pool, one sequence
prefilled to each context; then, for R = 1..N, the forward of R decode rows of that sequence at
positions context .. context + R - 1 (a verification of R - 1 drafts, as the engine packs it:
each row attends its own prefix in place). The median of `--repeat` timings per R, the R values
interleaved; the price of a row is the slope from R = 1 to N, also as a share of R = 1's step
(what speculation's odds weigh a draft against). Per `--digits`, the CPU kernels' int8 digits
per activation (`--activation-digits`). Only the forward is timed: no sampling, no scheduling.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from engine.attention.step_inputs import AttentionMetadata
from engine.kernels import kernel_backend
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.models.model_loader import load_model
from engine.runner.model_runner import model_forward_for

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class RowPrice:
    context: int
    digits: int
    ms_by_rows: dict[int, float]  # R -> median ms of the forward

    @property
    def per_row_ms(self) -> float:
        most = max(self.ms_by_rows)
        return (self.ms_by_rows[most] - self.ms_by_rows[1]) / (most - 1)

    @property
    def share(self) -> float:
        return self.per_row_ms / self.ms_by_rows[1]


def measure(contexts: list[int], rows: int, repeat: int, digits: list[int]) -> list[RowPrice]:
    loaded = load_model("smollm2-135m", dtype=torch.float32)
    forward = model_forward_for(loaded, "auto", "gguf")
    spec = KVCacheSpec(
        loaded.num_layers,
        loaded.num_kv_heads,
        loaded.head_dim,
        torch.float16,
        BLOCK_SIZE,
        compute_dtype=torch.float32,
    )
    backend = kernel_backend()
    prices = []
    try:
        for context in contexts:
            num_blocks = -(-(context + rows) // BLOCK_SIZE)
            cache = PagedKVCache(spec, num_blocks, decode_kernel="native")
            blocks = list(range(num_blocks))
            ids = [100 + i % 1000 for i in range(context)]
            meta = AttentionMetadata.build([(0, context, blocks)], cache, input_ids=ids)
            with torch.inference_mode():
                forward(meta.input_ids, None, meta, cache)

            def step(r: int, context: int = context, cache=cache, blocks=blocks) -> float:
                layout = [(context + j, 1, blocks) for j in range(r)]
                meta = AttentionMetadata.build(layout, cache, keys=["s"] * r, input_ids=[7] * r)
                with torch.inference_mode():
                    start = time.perf_counter()
                    forward(meta.input_ids, None, meta, cache)
                    return (time.perf_counter() - start) * 1e3

            for d in digits:
                backend.set_activation_digits(d)
                times: dict[int, list[float]] = {r: [] for r in range(1, rows + 1)}
                step(rows)  # warm-up
                for _ in range(repeat):
                    for r in times:
                        times[r].append(step(r))
                medians = {r: statistics.median(t) for r, t in times.items()}
                prices.append(RowPrice(context, d, medians))
    finally:
        backend.set_activation_digits(2)
    return prices


def markdown(prices: list[RowPrice]) -> str:
    rows = sorted(prices[0].ms_by_rows)
    head = " | ".join(f"R={r}" for r in rows)
    lines = [
        f"| context | digits | {head} | a row, ms | share of R=1 |",
        "|---" * (len(rows) + 4) + "|",
    ]
    for p in prices:
        cells = " | ".join(f"{p.ms_by_rows[r]:.2f}" for r in rows)
        lines.append(f"| {p.context} | {p.digits} | {cells} | {p.per_row_ms:.3f} | {p.share:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="300,1000")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--digits", default="2,1")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    digits = [int(d) for d in args.digits.split(",")]
    if args.rows < 2 or args.repeat < 1 or min(contexts) < 1:
        parser.error("--rows must be at least 2, --repeat and every context at least 1")
    if any(d not in (1, 2) for d in digits):
        parser.error("--digits: 1 and/or 2")
    torch.set_num_threads(args.threads)
    print(markdown(measure(contexts, args.rows, args.repeat, digits)))


if __name__ == "__main__":
    main()
