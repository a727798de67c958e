"""The engine flags, shared by every command that runs a model (generate, bench, worker, up)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from scheduler import POLICIES
from scheduler.config import SCHEDULER_DEFAULTS as SCHED

if TYPE_CHECKING:
    from engine.config import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m (default), tiny-random, a Hugging Face model directory, a .gguf file, "
        "or real-size random weights: random:llama-3.2-1b, random:llama-3.1-8b, random:qwen3-8b "
        "(random:tiny = tiny-random); noop is NO MODEL (load testing only: meaningless tokens)",
    )
    g.add_argument(
        "--noop-step-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="--model noop only (LOAD TESTING, never production): the fake forward's duration",
    )
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on cuda, float32 on cpu",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="BYTES",
        help="KV cache budget, e.g. 2GiB (default: cpu 1GiB; cuda: free memory × "
        "--gpu-memory-utilization after loading the model)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--batching", choices=sorted(POLICIES), default="continuous")
    # Batching defaults are the scheduler's own (SchedulerConfig), not a copy.
    g.add_argument("--max-num-seqs", type=int, default=SCHED.max_num_seqs, help="batch slots")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SCHED.max_num_batched_tokens,
        help="per-step token budget (decodes + prefill chunks)",
    )
    g.add_argument(
        "--max-queue-delay",
        type=float,
        default=SCHED.max_queue_delay,
        help="dynamic batching: seconds the oldest request may wait for a full batch",
    )
    g.add_argument(
        "--reserve",
        action="store_true",
        help="reserve prompt + max_tokens of KV at admission (never preempt)",
    )
    g.add_argument(
        "--max-preemptions-per-seq",
        type=int,
        default=SCHED.max_preemptions_per_seq,
        metavar="N",
        help="a sequence preempted N times is spared as a victim while others can be preempted",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context window (default: the model's, capped to the KV cache)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: decode-only steps run eagerly like every other step",
    )
    g.add_argument(
        "--decode-attention",
        choices=("auto", "triton", "gather"),
        default="auto",
        help="decode attention: triton reads K/V in place (CUDA), gather copies blocks then "
        "runs SDPA (any device); auto: triton on CUDA where it runs, else gather",
    )
    g.add_argument("--cache-dir", default=None, help="converted-model cache (JITNEY_CACHE_DIR)")


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    from engine.config import EngineConfig  # imported late: torch loads only when needed

    fields = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        batching=args.batching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_delay=args.max_queue_delay,
        reserve_full_length=args.reserve,
        max_preemptions_per_seq=args.max_preemptions_per_seq,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        decode_attention=args.decode_attention,
        cache_dir=args.cache_dir,
        noop_step_ms=args.noop_step_ms,
    )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def engine_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line, to start a worker with the same engine."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if action.nargs != 0:
            argv += [flag, str(value)]
        elif value:
            argv.append(flag)
    return argv
