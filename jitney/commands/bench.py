"""`jitney bench offline`: the engine against transformers' baselines on a trace.
`jitney bench serve`: load against a live service over the OpenAI streaming API.
`jitney bench report`: the key series from Prometheus over a time range, as PNG + JSON.
`jitney bench placement`: a multi-turn trace over one worker and N workers, placement off and on.
`jitney bench busy`: each system's tokens/s quiet and beside a spinning process, as a ratio.
`jitney bench queue`: what one Redis and one gateway carry, with noop workers.
The modules are bench/'s (bench/README.md); research probes are research/'s, not installed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.prom_report import add_report_arguments, run_report
from bench.provenance import recorded_command
from jitney.commands.bench_busy import add_busy_arguments, run_busy
from jitney.commands.engine_args import add_engine_arguments, engine_config_from_args

if TYPE_CHECKING:
    from bench.offline import StructuredRun

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
        help="comma list of baselines (hf-generate, hf-cb, zero-overhead: forwards only, "
        "timed on the trace's continuous schedule), or 'none'",
    )
    off.add_argument("--output", default="bench-offline.json", help="results JSON")
    off.add_argument(
        "--no-detokenize",
        dest="detokenize",
        action="store_false",
        help="token ids only, as a worker runs (the gateway makes the text): the served step",
    )
    off.add_argument(
        "--response-format",
        default=None,
        metavar="FORMAT",
        help="also run every policy with each request constrained (structured outputs): "
        "json_object, json_schema:FILE (a JSON schema), or regex:PATTERN",
    )
    add_engine_arguments(off)
    _add_serve_arguments(sub)
    _add_queue_arguments(sub)
    _add_placement_arguments(sub)
    add_busy_arguments(sub)
    add_report_arguments(sub)


def _add_serve_arguments(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser(
        "serve",
        help="load a live service (open or closed loop) over the OpenAI streaming API",
        description="Send a trace's requests to a running gateway (POST /v1/completions, "
        "streamed, token-id prompts, exact output lengths) and report TTFT, ITL, TPOT, e2e and "
        "throughput. With --compare, print and chart several result files side by side.",
    )
    srv.add_argument("--url", default="http://localhost:8000", help="the gateway's base URL")
    srv.add_argument("--trace", default=DEFAULT_TRACE, help="trace JSON (shared/traces format)")
    srv.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    srv.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    loop = srv.add_mutually_exclusive_group()
    loop.add_argument(
        "--rate", type=float, default=None, help="open loop: Poisson arrivals, req/s (inf: all)"
    )
    loop.add_argument(
        "--concurrency", type=int, default=None, help="closed loop: requests in flight"
    )
    srv.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        default="poisson",
        help="open loop: Poisson at --rate, or replay the trace's arrival_s",
    )
    srv.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    srv.add_argument(
        "--max-duration",
        type=float,
        default=600.0,
        help="seconds; then what is left is cancelled and counted failed",
    )
    srv.add_argument(
        "--batch-backlog",
        type=int,
        default=0,
        metavar="N",
        help="mixed-class mode: N batch lines (the trace's requests, cycled) go in through the "
        "Batch API first and run behind the interactive requests; the batch is cancelled at "
        "the end",
    )
    srv.add_argument(
        "--backlog-warmup",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds the backlog runs alone before the interactive requests start",
    )
    srv.add_argument(
        "--conversations",
        default=None,
        metavar="TRACE_JSON",
        help="replay a multi-turn trace (bench/traces/multi_turn.json) instead of --trace: each "
        "conversation's turns in order, each after the previous reply; reports the prefix hit "
        "rate and prefill tokens too",
    )
    srv.add_argument("--label", default=None, help="this run's name in --compare tables")
    srv.add_argument("--output", default="bench-serve.json", help="results JSON")
    srv.add_argument(
        "--plot",
        default=None,
        help="chart PNG (default bench-serve.png, bench-compare.png with --compare; '' for none)",
    )
    srv.add_argument(
        "--compare",
        nargs="+",
        metavar="RESULT_JSON",
        default=None,
        help="no load: compare these result files in one table and one chart",
    )


def _add_queue_arguments(sub: argparse._SubParsersAction) -> None:
    from bench.queue import QueueSetup

    d = QueueSetup()
    q = sub.add_parser(
        "queue",
        help="model-free: what one Redis and one gateway carry (noop workers)",
        description="N `--model noop` workers and M gateways on one private redis-server, "
        "streamed closed loop at N × slots in flight: tokens/s, CPU per million tokens of "
        "each component, Redis commands and bytes per token, extrapolated ceilings.",
    )
    q.add_argument("--workers", type=int, default=d.workers, help="noop workers")
    q.add_argument("--slots", type=int, default=d.slots, help="--max-num-seqs per worker")
    q.add_argument("--gateways", type=int, default=d.gateways, help="gateway processes")
    q.add_argument("--step-ms", type=float, default=d.step_ms, help="the noop forward's time")
    q.add_argument("--requests", type=int, default=d.requests)
    q.add_argument("--prompt-len", type=int, default=d.prompt_len)
    q.add_argument("--output-len", type=int, default=d.output_len)
    q.add_argument(
        "--prefix-placement",
        action=argparse.BooleanOptionalAction,
        default=d.placement,
        help="prefix-aware placement on the gateways and workers",
    )
    q.add_argument(
        "--prefixes",
        type=int,
        default=d.prefixes,
        metavar="K",
        help="each prompt starts with one of K shared prefixes (3/4 of it), so placement hits",
    )
    q.add_argument("--output", default="bench-queue.json", help="results JSON")
    q.add_argument(
        "--compare",
        nargs="+",
        metavar="LABEL=RESULT_JSON",
        default=None,
        help="no load: chart these results' CPU per million tokens side by side (--plot)",
    )
    q.add_argument("--plot", default="bench-queue.png", help="the --compare chart (PNG)")


def run_queue(args: argparse.Namespace) -> int:
    from bench.queue import QueueSetup, format_report, plot_compare, run_queue_bench, write_json

    if args.compare:
        pairs = [item.partition("=") for item in args.compare]
        if any(not sep for _, sep, _ in pairs):
            raise SystemExit("bench queue --compare: give LABEL=RESULT_JSON pairs")
        reports = [json.loads(Path(path).read_text()) for _, _, path in pairs]
        for (label, _, _), report in zip(pairs, reports, strict=True):
            print(f"== {label}\n{format_report(report)}\n")
        plot_compare(reports, [label for label, _, _ in pairs], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
        return 0

    setup = QueueSetup(
        args.workers,
        args.slots,
        args.gateways,
        args.step_ms,
        args.requests,
        args.prompt_len,
        args.output_len,
        args.prefix_placement,
        args.prefixes,
    )
    try:
        report = run_queue_bench(setup, lambda m: print(m, file=sys.stderr, flush=True))
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    report["command"] = recorded_command()
    print(format_report(report))
    write_json(report, args.output)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    import aiohttp

    from bench.serve import run_serve, write_json
    from bench.serve_report import (
        format_compare,
        format_table,
        load_reports,
        plot_compare,
        plot_run,
    )
    from bench.trace import load_trace

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.compare:
        reports = load_reports(args.compare)
        print(format_compare(reports))
        plot = "bench-compare.png" if args.plot is None else args.plot
        if plot:
            plot_compare(reports, plot)
            say(f"wrote {plot}")
        return 0
    if args.conversations:
        return _run_conversations(args, say)
    if args.arrivals == "trace" and args.rate is not None:
        raise SystemExit("--arrivals trace replays the trace's times: drop --rate")
    if args.rate is None and args.concurrency is None and args.arrivals != "trace":
        raise SystemExit("give --rate R, --concurrency C or --arrivals trace")
    if args.concurrency is not None and args.arrivals == "trace":
        raise SystemExit("--arrivals trace is open loop: drop --concurrency")
    try:
        report = asyncio.run(
            run_serve(
                args.url,
                load_trace(args.trace, args.limit),
                rate=args.rate,
                arrivals=args.arrivals,
                concurrency=args.concurrency,
                seed=args.seed,
                model=args.model,
                max_duration=args.max_duration,
                label=args.label,
                say=say,
                batch_backlog=args.batch_backlog,
                backlog_warmup_s=args.backlog_warmup,
            )
        )
    except (ValueError, RuntimeError, aiohttp.ClientError) as e:  # bad flags, or no model list
        raise SystemExit(f"bench serve: {e}") from None
    report["trace"] = args.trace
    report["command"] = recorded_command()
    print(format_table(report))
    write_json(report, args.output)
    say(f"wrote {args.output}")
    plot = "bench-serve.png" if args.plot is None else args.plot
    if plot:
        plot_run(report, plot)
        say(f"wrote {plot}")
    return 0


def _run_conversations(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    import asyncio

    import aiohttp

    from bench.conversation_trace import load_conversations
    from bench.conversations import run_conversations
    from bench.serve import write_json
    from bench.serve_report import format_table

    trace = load_conversations(args.conversations, args.limit)
    try:
        report = asyncio.run(
            run_conversations(
                args.url,
                trace,
                model=args.model,
                max_duration=args.max_duration,
                label=args.label or "conversations",
                say=say,
            )
        )
    except (ValueError, RuntimeError, aiohttp.ClientError) as e:
        raise SystemExit(f"bench serve: {e}") from None
    report["trace"] = args.conversations
    report["command"] = recorded_command()
    print(format_table(report))
    print(
        f"prefix hit rate {report['prefix_hit_rate']} ({report['cached_tokens']} of "
        f"{report['prompt_tokens']} prompt tokens cached), {report['prefill_tokens']} prefilled"
    )
    write_json(report, args.output)
    say(f"wrote {args.output}")
    return 0


def _add_placement_arguments(sub: argparse._SubParsersAction) -> None:
    from bench.conversation_trace import DEFAULT_PATH
    from bench.placement import PlacementSetup

    d = PlacementSetup()
    pl = sub.add_parser(
        "placement",
        help="a multi-turn trace over one worker, and N workers with placement off and on",
        description="Starts its own stacks (private Redis, workers, one gateway) one after the "
        "other and replays a multi-turn trace on each: the fleet's prefix hit rate against one "
        "worker's, TTFT p50/p99, prefill tokens, where requests went.",
    )
    pl.add_argument("--model", default=d.model)
    pl.add_argument("--workers", type=int, default=d.workers, help="workers of the N-worker runs")
    pl.add_argument("--conversations", default=str(DEFAULT_PATH), metavar="TRACE_JSON")
    pl.add_argument("--limit", type=int, default=None, help="the first N conversations only")
    pl.add_argument(
        "--worker-args",
        default=" ".join(d.worker_args),
        help="engine flags every worker gets (one string, split on spaces)",
    )
    pl.add_argument("--threads", type=int, default=d.threads, help="OMP threads per worker")
    pl.add_argument("--max-duration", type=float, default=d.max_duration, help="per run")
    pl.add_argument("--output", default="bench-placement.json", help="results JSON")


def run_placement(args: argparse.Namespace) -> int:
    from bench.conversation_trace import load_conversations
    from bench.placement import PlacementSetup, format_report, run_placement_bench
    from bench.serve import write_json

    setup = PlacementSetup(
        args.model,
        args.workers,
        tuple(args.worker_args.split()),
        args.threads,
        args.max_duration,
    )
    trace = load_conversations(args.conversations, args.limit)
    try:
        report = run_placement_bench(setup, trace, lambda m: print(m, file=sys.stderr, flush=True))
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    report["trace"] = args.conversations
    report["command"] = recorded_command()
    print(format_report(report))
    write_json(report, args.output)
    return 0


def structured_run(spec: str) -> StructuredRun:
    """--response-format's value as the grammar every request of the structured run gets."""
    from bench.offline import OfflineBenchError, StructuredRun
    from generation import grammar

    kind, _, arg = spec.partition(":")
    try:
        if kind == "json_object" and not arg:
            return StructuredRun(kind, grammar.json_object())
        if kind == "json_schema" and arg:
            return StructuredRun(kind, grammar.json_schema(json.loads(Path(arg).read_text())))
        if kind == "regex" and arg:
            return StructuredRun(kind, grammar.regex(arg))
    except (OSError, ValueError) as e:
        raise OfflineBenchError(f"--response-format {spec}: {e}") from None
    raise OfflineBenchError(
        f"--response-format {spec!r}: expected json_object, json_schema:FILE or regex:PATTERN"
    )


def run(args: argparse.Namespace) -> int:
    if args.bench == "report":
        return run_report(args)  # stdlib HTTP + matplotlib: no torch
    if args.bench == "serve":
        return run_serve(args)  # no torch: the load generator is a plain HTTP client
    if args.bench == "queue":
        return run_queue(args)  # processes of its own: nothing loads torch here
    if args.bench == "placement":
        return run_placement(args)  # processes of its own too
    if args.bench == "busy":
        return run_busy(args)  # checks its flags before torch, then loads it
    from engine.threads import apply_threads, resolve_threads

    try:
        config = engine_config_from_args(args)
        threads = resolve_threads(args.threads)
    except ValueError as e:  # engine flags out of range: before torch is imported
        raise SystemExit(f"bench offline: {e}") from None
    from bench.offline import OfflineBenchError, run_offline_bench, write_json
    from bench.trace import load_trace
    from engine.models.model_loader import LoadedModel, load_model

    apply_threads(threads)
    requests = load_trace(args.trace, args.limit)
    policies = [p for p in args.policies.split(",") if p]
    baselines = [] if args.baseline == "none" else [b for b in args.baseline.split(",") if b]

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def load() -> LoadedModel:
        return load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)

    say(
        f"{len(requests)} requests from {args.trace}, "
        f"{sum(r.output_len for r in requests)} output tokens; {threads.describe()}"
    )
    try:
        structured = structured_run(args.response_format) if args.response_format else None
        report = run_offline_bench(
            config, requests, policies, baselines, load, say, args.detokenize, structured
        )
    except OfflineBenchError as e:  # a trace for another model, an unknown baseline
        raise SystemExit(f"bench offline: {e}") from None
    report["command"] = recorded_command()
    report["threads"] = {"count": threads.count, "source": threads.source}
    print(report["table"])
    print(f"warm-up: {report['warmup']}")
    print()
    print(report["phase_table"])
    if report["draft_table"]:
        print()
        print(report["draft_table"])
    write_json(report, args.output)
    say(f"wrote {args.output}")
    return 0
