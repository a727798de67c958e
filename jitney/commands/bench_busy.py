"""`jitney bench busy`'s flags and run (bench/busy.py measures)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from bench.provenance import load_average, recorded_command
from jitney.commands.engine_args import (
    GIVEN_FLAGS,
    add_engine_arguments,
    engine_args_to_argv,
    engine_config_from_args,
)
from jitney.commands.flag_types import positive_int

DEFAULT_MIXED = "../shared/traces/mixed-64.json"


def add_busy_arguments(sub: argparse._SubParsersAction) -> None:
    from bench.busy import PATHS, WORKLOADS, BusySetup

    d = BusySetup(threads=1)
    p = sub.add_parser(
        "busy",
        help="quiet vs beside a spinning process: each system's busy/quiet tokens/s",
        description="One user and the mixed trace, offline and through the service (`jitney "
        "up`; llama.cpp's when --llama-bin-dir is given), each measured quiet and beside a "
        'process spinning on a CPU (python -c "while True: pass"), in rounds; prints each '
        "case's median tokens/s and busy/quiet ratio, and writes them as JSON.",
    )
    p.add_argument("--rounds", type=positive_int, default=d.rounds, help="rounds; medians")
    p.add_argument(
        "--spinner-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="pin the spinner to this CPU (default: not pinned, placed by the scheduler)",
    )
    p.add_argument(
        "--workloads",
        type=_choices(WORKLOADS),
        default=",".join(d.workloads),
        help=f"comma list of {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--paths",
        type=_choices(PATHS),
        default=",".join(d.paths),
        help=f"comma list of {', '.join(PATHS)} (the service: `jitney up` with the engine flags)",
    )
    p.add_argument("--mixed-trace", default=DEFAULT_MIXED, help="the mixed workload's trace")
    p.add_argument("--limit", type=positive_int, default=None, help="its first N requests only")
    p.add_argument("--one-user-prompt-len", type=positive_int, default=d.one_user_prompt_len)
    p.add_argument("--one-user-tokens", type=positive_int, default=d.one_user_tokens)
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="cap every request's output tokens (a quick run)",
    )
    p.add_argument(
        "--llama-bin-dir",
        default=None,
        metavar="DIR",
        help="llama.cpp's binaries (llama-batched-bench, llama-server): run it alike",
    )
    p.add_argument(
        "--llama-model",
        default=None,
        metavar="GGUF",
        help="the file llama.cpp runs (default: --model's, a .gguf or the bundled SmolLM2's)",
    )
    p.add_argument(
        "--max-duration",
        type=float,
        default=d.max_duration,
        help="seconds a measurement through a service may take",
    )
    p.add_argument("--output", default="bench-busy.json", help="results JSON")
    add_engine_arguments(p)


def _choices(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(w for w in text.split(",") if w)
        unknown = [w for w in chosen if w not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose from {', '.join(allowed)} (comma-separated)"
            )
        return chosen

    return parse


def run_busy(args: argparse.Namespace) -> int:
    """Checks every flag before torch is imported, then measures."""
    from bench import llama_cpp
    from bench.busy import MIXED, OFFLINE, ONE_USER, SERVICE, BusySetup
    from engine.threads import allowed_cpus, resolve_threads

    workloads, paths = args.workloads, args.paths
    try:
        # Offline, speculation is off unless asked for: the engines' steps against each other.
        given = getattr(args, GIVEN_FLAGS, None) or set()
        asked = given & {"speculative", "speculative_model"} or args.speculative_config
        config = engine_config_from_args(args, **({} if asked else {"speculative": "none"}))
        threads = resolve_threads(args.threads)
    except ValueError as e:
        raise SystemExit(f"bench busy: {e}") from None
    if args.spinner_cpu is not None and args.spinner_cpu not in allowed_cpus():
        raise SystemExit(
            f"bench busy: --spinner-cpu {args.spinner_cpu} is not among the CPUs this process "
            f"may use ({sorted(allowed_cpus())})"
        )
    if MIXED in workloads and not Path(args.mixed_trace).is_file():
        raise SystemExit(f"bench busy: no mixed trace at {args.mixed_trace} (--mixed-trace)")
    if args.llama_bin_dir:
        needed = [llama_cpp.BATCHED_BENCH] if OFFLINE in paths and ONE_USER in workloads else []
        needed += [llama_cpp.SERVER] if SERVICE in paths else []
        missing = llama_cpp.missing_binaries(args.llama_bin_dir, needed)
        if missing:
            raise SystemExit(f"bench busy: no {', '.join(missing)} in {args.llama_bin_dir}")
    if args.llama_model and not Path(args.llama_model).is_file():
        raise SystemExit(f"bench busy: no GGUF file at {args.llama_model}")

    from bench.busy import capped_requests, format_table, one_user_requests, run_busy_bench
    from bench.offline import OfflineBenchError, check_token_ids
    from bench.trace import load_trace
    from engine.models.model_loader import load_model
    from engine.threads import apply_threads

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    apply_threads(threads)
    say(threads.describe())
    llama_gguf = _llama_gguf(args) if args.llama_bin_dir else None
    setup = BusySetup(
        threads=threads.count,
        rounds=args.rounds,
        spinner_cpu=args.spinner_cpu,
        workloads=workloads,
        paths=paths,
        one_user_prompt_len=args.one_user_prompt_len,
        one_user_tokens=args.one_user_tokens,
        max_tokens=args.max_tokens,
        service_flags=tuple(engine_args_to_argv(args)),
        llama_bin_dir=args.llama_bin_dir,
        llama_gguf=llama_gguf,
        max_duration=args.max_duration,
    )
    loaded = load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)
    requests = {}
    if ONE_USER in workloads:
        vocab = loaded.model.get_input_embeddings().num_embeddings
        requests[ONE_USER] = one_user_requests(setup, vocab)
    if MIXED in workloads:
        requests[MIXED] = capped_requests(load_trace(args.mixed_trace, args.limit), setup)
    try:
        for reqs in requests.values():
            check_token_ids(reqs, loaded)
    except OfflineBenchError as e:
        raise SystemExit(f"bench busy: {e}") from None
    before = load_average()
    try:
        report = run_busy_bench(setup, config, loaded, requests, say)
    except RuntimeError as e:  # a part or llama.cpp failed to start, a request failed
        raise SystemExit(f"bench busy: {e}") from None
    report |= {
        "command": recorded_command(),
        "model": args.model,
        "threads_source": threads.source,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": {"before": before, "after": load_average()},
        "mixed_trace": args.mixed_trace if MIXED in workloads else None,
        "llama_model": llama_gguf,
    }
    print(format_table(report))
    Path(args.output).write_text(json.dumps(report, indent=1))
    say(f"wrote {args.output}")
    return 0


def _llama_gguf(args: argparse.Namespace) -> str:
    """The GGUF file llama.cpp runs: --llama-model, else --model's own file."""
    from engine.models.model_loader import SMOLLM2_135M, smollm2_gguf_path

    if args.llama_model:
        path = Path(args.llama_model)
    elif str(args.model).endswith(".gguf"):
        path = Path(args.model)
    elif args.model == SMOLLM2_135M:
        path = smollm2_gguf_path()
    else:
        raise SystemExit("bench busy: llama.cpp runs a GGUF file: give --llama-model FILE")
    if not path.is_file():
        raise SystemExit(f"bench busy: no GGUF file at {path}")
    return str(path)
