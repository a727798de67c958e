"""Where a decode step's time goes, per op class, through the engine's own forward.

`python -m research.profile_forward [--model smollm2-135m] [--quantization none|gguf]
 [--model-impl auto|jitney|transformers] [--decode-attention ...] [--threads 2] [--batch 1]
 [--prompt-len 134] [--steps 32] [--markdown out.md]`

Prefills `--batch` prompts of `--prompt-len` tokens, then profiles `--steps` decode steps with
torch.profiler (CPU activities) and sums each op's self time into classes: a decode-only step's
layers in one C++ call (the quantized paths; what it runs inside is not split), the linear layers
(dense or quantized matmuls), attention, norms and residual adds, rotary and the KV write, the
MLP's activation, the rest of the elementwise and copy ops, and what no op accounts for (Python,
dispatch, the engine's own step work). The profiler adds a few microseconds per op, so the
classes' total exceeds an unprofiled step: read them as shares, and take step times from
`jitney bench offline`.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation.sampling_params import SamplingParams

# (class, op-name fragments), first match wins; names are the profiler's ("aten::mm", ...).
OP_CLASSES = (
    ("decoder layers in one C++ call", ("llama_decode_layers",)),
    ("linear layers", ("quant_linear", "aten::mm", "aten::addmm", "aten::linear",
                       "aten::matmul", "aten::bmm", "int4pack", "int8pack")),
    ("attention", ("paged_decode", "scaled_dot_product", "flash_attention", "aten::_softmax",
                   "index_select", "masked_fill")),
    ("norms + residual", ("rms_norm", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("rotary + KV write", ("rope_write_kv", "aten::cos", "aten::sin", "index_copy")),
    ("activation", ("silu",)),
    ("embedding + sampling", ("embedding", "argmax", "aten::topk", "aten::sort", "aten::max")),
    ("other elementwise / copies", ("aten::",)),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Profile:
    step_ms: float  # wall time per profiled step (with the profiler's overhead)
    classes: dict[str, float]  # class -> self ms per step
    top_ops: list[tuple[str, float, int]]  # (op, self ms per step, calls per step)


def op_class(name: str) -> str:
    for label, fragments in OP_CLASSES:
        if any(f in name for f in fragments):
            return label
    return "other ops"


def profile_decode(engine: Engine, batch: int, prompt_len: int, steps: int) -> Profile:
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, detokenize=False)
    for i in range(batch):
        prompt = [(17 * i + 31 * j) % 1000 + 10 for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    engine.flush()
    started: set[str] = set()
    while len(started) < batch:  # until every prompt is computed
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    for _ in range(3):  # warm
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        per_op[event.key][0] += event.self_cpu_time_total / 1e3 / steps
        per_op[event.key][1] += event.count / steps
    classes: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_op.items():
        classes[op_class(name)] += ms
    step_ms = wall * 1e3 / steps
    classes["not in any op (Python, dispatch, engine)"] = max(0.0, step_ms - sum(classes.values()))
    top = sorted(((n, ms, int(c)) for n, (ms, c) in per_op.items()), key=lambda t: -t[1])[:12]
    return Profile(step_ms, dict(classes), top)


def markdown(label: str, p: Profile) -> str:
    lines = [f"**{label}**: {p.step_ms:.1f} ms per profiled step", "",
             "| op class | ms per step | share |", "|---|---|---|"]  # fmt: skip
    for name, ms in sorted(p.classes.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {ms:.2f} | {100 * ms / p.step_ms:.0f}% |")
    lines += ["", "| op | ms per step | calls per step |", "|---|---|---|"]
    lines += [f"| `{n}` | {ms:.2f} | {c} |" for n, ms, c in p.top_ops]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--model-impl", default="auto")
    parser.add_argument("--decode-attention", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=134)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--markdown", help="also write the tables here")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.prompt_len < 1 or args.steps < 1:
        parser.error("--batch, --prompt-len and --steps must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        quantization=args.quantization,
        model_impl=args.model_impl,
        decode_attention=args.decode_attention,
        max_num_seqs=max(args.batch, 1),
    )
    engine = Engine(config, loaded=load_model(args.model))
    result = profile_decode(engine, args.batch, args.prompt_len, args.steps)
    label = (
        f"{args.model}, --model-impl {args.model_impl} --quantization {args.quantization} "
        f"--decode-attention {engine.decode_attention}, batch {args.batch}, "
        f"{torch.get_num_threads()} threads"
    )
    text = markdown(label, result)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
