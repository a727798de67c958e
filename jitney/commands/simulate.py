"""`jitney simulate`: the three batching policies on the step simulator, side by side."""

from __future__ import annotations

import argparse

from scheduler import POLICIES, SchedulerConfig
from scheduler.simulator import SimRequest, load_trace, seed_scenario, simulate

UNLIMITED = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--scenario",
        choices=["seed"],
        default=None,
        help="built-in scenario (default: seed when no --trace is given)",
    )
    src.add_argument("--trace", help="trace JSON (format: shared/traces/README.md)")
    p.add_argument("--policy", choices=[*POLICIES, "all"], default="all")
    p.add_argument("--slots", type=int, default=4, help="batch slots (max_num_seqs)")
    p.add_argument(
        "--max-wait",
        type=float,
        default=15,
        help="dynamic batching: launch once the oldest request waited this many steps",
    )
    p.add_argument(
        "--kv-blocks", type=int, default=UNLIMITED, help="KV budget in blocks (0: unlimited)"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=UNLIMITED,
        help="per-step token budget; prefill then costs one step per N prompt tokens "
        "(0: unlimited, prefill is free)",
    )
    p.add_argument(
        "--reserve",
        action="store_true",
        help="continuous: reserve prompt + max_tokens at admission (no preemption)",
    )
    p.add_argument(
        "--step-seconds",
        type=float,
        default=0.05,
        help="--trace: seconds of arrival time per simulated step",
    )
    p.add_argument("--all-at-once", action="store_true", help="--trace: every request arrives at 0")
    p.add_argument("--plot", metavar="FILE.png", help="draw the slot-occupancy timelines")


def _requests(args: argparse.Namespace) -> list[SimRequest]:
    if args.trace:
        return load_trace(args.trace, args.step_seconds, args.all_at_once)
    return seed_scenario()


def run(args: argparse.Namespace) -> int:
    requests = _requests(args)
    config = SchedulerConfig(
        max_num_seqs=args.slots,
        max_num_batched_tokens=args.tokens_per_step or 2**62,
        max_queue_delay=args.max_wait,
        reserve_full_length=args.reserve,
    )
    names = list(POLICIES) if args.policy == "all" else [args.policy]
    results = [
        simulate(requests, name, config, args.kv_blocks or None, args.block_size) for name in names
    ]
    for result in results:
        print(result.row(show_preemptions=bool(args.kv_blocks)))
    if args.plot:
        from scheduler.sim_plot import plot_occupancy

        source = args.trace or "seed scenario"
        plot_occupancy(results, args.plot, f"{source}: {args.slots} slots")
        print(f"wrote {args.plot}")
    return 0
