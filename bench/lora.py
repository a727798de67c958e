"""`python -m bench.lora`: what serving LoRA adapters costs beside the base model, in one run.

    python -m bench.lora [--model smollm2-135m] [--trace ../shared/traces/mixed-64.json]
                         [--adapters 4] [--rank 16] [--targets all|qv] [--rounds 3]

Adapters are made here with `peft` for the model's shapes (seeded random weights; what a
fine-tune's weights are does not change what they cost) and served by one engine beside the
base model, speculation off. Rounds alternate which runs first, so a drift of the machine falls
on both alike; each ratio is the median of the rounds'.

- one user: a trace prompt, `--one-user-tokens` tokens, under adapter 0 against the base model;
- mixed trace: every request of the trace at once (bench/offline.py's TraceRun), spread round
  robin over the adapters, against the same trace on the base model;
- load: reading and laying out one adapter (`Engine.add_adapter`), the median of five;
- memory: each resident adapter's bytes against its file's, and the process's RSS growth
  with every adapter resident.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.provenance import SHARED_TRACES, cpu_name, recorded_command

TARGETS = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qv": ("q_proj", "v_proj"),  # PEFT's default for the Llama family
}


def save_random_adapter(
    model: Any,
    out: Path,
    rank: int = 16,
    seed: int = 0,
    targets: tuple[str, ...] = TARGETS["all"],
    alpha: float = 32.0,
    std: float = 0.02,
    **lora_config: Any,
) -> Path:
    """A PEFT LoRA adapter of transformers model `model` at `out`, its A and B seeded normal
    values times `std` (PEFT starts B at zero: an adapter that changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora_config
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out)
    return out


def _adapters_for(config: Any, root: Path, count: int, rank: int, targets: str) -> list[Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    # The architecture's own config class (a GGUF's config is gguf_config's FamilyConfig).
    config = AutoConfig.for_model(**config.to_dict())
    paths = []
    for i in range(count):
        model = AutoModelForCausalLM.from_config(config)  # random: only its shapes matter
        paths.append(save_random_adapter(model, root / f"a{i}", rank, i, TARGETS[targets]))
    return paths


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _rss_growth(model: str, paths: list[Path]) -> int:
    """The RSS a fresh process gains when `paths` are made resident in an engine already
    started (a process's own earlier frees would hide it here)."""
    probe = [sys.executable, "-m", "bench.lora", "--model", model, "--rss-probe", *map(str, paths)]
    out = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


def _probe_rss(model: str, paths: list[str]) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import Engine

    config = EngineConfig.from_flat(model=model, speculative="none", max_loras=len(paths))
    engine = Engine(config)
    before = _rss_bytes()
    for i, path in enumerate(paths):
        engine.add_adapter(f"a{i}", path)
    return _rss_bytes() - before


def _tokens_per_s(run: Callable[[], int]) -> float:
    start = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - start)


def run_lora_bench(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    from bench.offline import TraceRun
    from bench.trace import load_trace
    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from engine.models.model_loader import load_model
    from generation.sampling_params import SamplingParams

    base = EngineConfig.from_flat(model=args.model, speculative="none")
    loaded = load_model(args.model, base.torch_device, base.torch_dtype)
    requests = load_trace(args.trace)
    with tempfile.TemporaryDirectory() as tmp:
        say(f"making {args.adapters} rank-{args.rank} adapters ({args.targets}) ...")
        paths = _adapters_for(loaded.config, Path(tmp), args.adapters, args.rank, args.targets)
        names = [f"a{i}" for i in range(args.adapters)]
        config = replace(base, lora_modules=tuple(zip(names, map(str, paths), strict=True)))
        config = replace(config, max_loras=args.adapters)
        rss_growth = _rss_growth(args.model, paths)
        engine = Engine(replace(base, max_loras=args.adapters), loaded=loaded)
        for name, path in zip(names, paths, strict=True):
            engine.add_adapter(name, str(path))
        adapter = engine.adapters.resident(names[0])
        file_bytes = (paths[0] / "adapter_model.safetensors").stat().st_size
        loads = []
        for _ in range(5):
            start = time.perf_counter()
            engine.add_adapter("probe", str(paths[0]))
            loads.append(time.perf_counter() - start)
            engine.remove_adapter("probe")
        one = requests[0].prompt_ids
        params = SamplingParams(max_tokens=args.one_user_tokens, temperature=0, ignore_eos=True)
        engine.generate([one], params)  # warm-up
        spread = [names[i % len(names)] for i in range(len(requests))]
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            row: dict[str, float] = {}
            for lora in (None, names[0]) if r % 2 == 0 else (names[0], None):

                def one_user(lora: str | None = lora) -> int:
                    return len(engine.generate([one], params, lora=lora)[0].token_ids)

                row["one_adapter" if lora else "one_base"] = _tokens_per_s(one_user)
            for loras in (None, spread) if r % 2 == 0 else (spread, None):
                result = TraceRun(
                    config, loaded, requests, detokenize=False, loras=loras
                ).run_to_end()
                row["mixed_adapters" if loras else "mixed_base"] = result.tokens_per_s
            figures = ", ".join(f"{k} {v:.1f}" for k, v in row.items())
            say(f"  round {r + 1}: {figures}")
            rounds.append(row)
    one_ratio = statistics.median(r["one_adapter"] / r["one_base"] for r in rounds)
    mixed_ratio = statistics.median(r["mixed_adapters"] / r["mixed_base"] for r in rounds)
    report = {
        "command": recorded_command(),
        "cpu": cpu_name(),
        "model": args.model,
        "adapters": args.adapters,
        "rank": args.rank,
        "targets": args.targets,
        "rounds": rounds,
        "one_user_ratio": one_ratio,
        "mixed_ratio": mixed_ratio,
        "load_ms": statistics.median(loads) * 1000,
        "adapter_resident_bytes": adapter.nbytes,
        "adapter_file_bytes": file_bytes,
        "rss_growth_bytes": rss_growth,
    }
    report["table"] = format_table(report)
    return report


def format_table(report: dict[str, Any]) -> str:
    def tps(key: str) -> str:
        values = [r[key] for r in report["rounds"]]
        return f"{min(values):.1f}-{max(values):.1f}"

    mb = 1024 * 1024
    return "\n".join(
        [
            f"{report['model']}, {report['adapters']} rank-{report['rank']} adapters "
            f"({report['targets']}), speculation off, {report['cpu']}",
            "| case | base tok/s | adapters tok/s | ratio (median) |",
            "|---|---|---|---|",
            f"| one user | {tps('one_base')} | {tps('one_adapter')} | "
            f"{report['one_user_ratio']:.2f} |",
            f"| mixed trace, spread over the adapters | {tps('mixed_base')} | "
            f"{tps('mixed_adapters')} | {report['mixed_ratio']:.2f} |",
            f"load one adapter: {report['load_ms']:.0f} ms; resident "
            f"{report['adapter_resident_bytes'] / mb:.1f} MiB each (file "
            f"{report['adapter_file_bytes'] / mb:.1f} MiB); RSS growth with all "
            f"{report['adapters']} resident: {report['rss_growth_bytes'] / mb:.1f} MiB",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trace", default=str(SHARED_TRACES / "mixed-64.json"))
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one-user-tokens", type=int, default=128)
    parser.add_argument("--output", help="results JSON")
    parser.add_argument("--rss-probe", nargs="+", help=argparse.SUPPRESS)  # _rss_growth's child
    args = parser.parse_args(argv)
    if args.rss_probe:
        print(_probe_rss(args.model, args.rss_probe))
        return 0
    report = run_lora_bench(args)
    print(report["table"])
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
