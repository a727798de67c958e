"""`jitney bench offline`: the engine against transformers' baselines on a trace."""

from __future__ import annotations

import argparse
import sys

from jitney.commands.engine_args import add_engine_arguments, engine_config_from_args

DEFAULT_TRACE = "../shared/traces/mixed-64.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    off = sub.add_parser(
        "offline", help="all requests at t=0, exact output lengths", description=__doc__
    )
    off.add_argument("--trace", default=DEFAULT_TRACE, help="trace JSON (shared/traces format)")
    off.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    off.add_argument(
        "--policies",
        default="continuous",
        help="comma list of batching policies to run (static,dynamic,continuous)",
    )
    off.add_argument(
        "--baseline",
        default="hf-generate,hf-cb",
        help="comma list of baselines (hf-generate, hf-cb), or 'none'",
    )
    off.add_argument("--output", default="bench-offline.json", help="results JSON")
    off.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_engine_arguments(off)


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.baselines import load_trace
    from bench.offline import run_offline_bench, write_json
    from worker.model_loader import LoadedModel, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    requests = load_trace(args.trace, args.limit)
    policies = [p for p in args.policies.split(",") if p]
    baselines = [] if args.baseline == "none" else [b for b in args.baseline.split(",") if b]

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def load() -> LoadedModel:
        return load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)

    say(
        f"{len(requests)} requests from {args.trace}, "
        f"{sum(r.output_len for r in requests)} output tokens; torch threads "
        f"{torch.get_num_threads()}"
    )
    report = run_offline_bench(config, requests, policies, baselines, load, say)
    report["command"] = " ".join(sys.argv)
    print(report["table"])
    write_json(report, args.output)
    say(f"wrote {args.output}")
    return 0
