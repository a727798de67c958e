"""`jitney bench placement`: a multi-turn trace over one worker, and over N workers without and
with prefix-aware placement, measured in one run (the comparison issue 29 asks for).

Each run gets a fresh private redis-server, its workers and one gateway, all started here
(bench/processes.py), and replays the trace (bench/conversations.py: each turn after the
previous reply). Per run: the fleet's prefix hit rate (cached prompt tokens / prompt tokens)
and its share of the one worker's, TTFT p50/p99, the prefill tokens computed, and where the
requests went (the gateway's placements by outcome; what workers read from their own streams,
the shared ones, or stole).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.conversation_trace import ConversationTrace
from bench.conversations import run_conversations
from bench.processes import Part, start_part, stop_part, wait_serving
from launch.private_redis import free_port, private_redis


@dataclass(frozen=True, slots=True)
class PlacementRun:
    label: str
    workers: int
    placement: bool


@dataclass(frozen=True, slots=True)
class PlacementSetup:
    model: str = "tiny-random"
    workers: int = 3
    worker_args: tuple[str, ...] = ("--kv-cache-memory", "64MiB")
    threads: int = 1  # OMP_NUM_THREADS of each worker
    max_duration: float = 900.0
    runs: tuple[PlacementRun, ...] = field(default_factory=tuple)

    def all_runs(self) -> tuple[PlacementRun, ...]:
        return self.runs or (
            PlacementRun("one worker", 1, True),
            PlacementRun(f"{self.workers} workers, shared stream", self.workers, False),
            PlacementRun(f"{self.workers} workers, placement", self.workers, True),
        )


@contextmanager
def stack(
    setup: PlacementSetup, run: PlacementRun, say: Callable[[str], None]
) -> Iterator[list[Part]]:
    """A private redis-server, the run's workers and one gateway; all stopped on exit."""
    flag = "--prefix-placement" if run.placement else "--no-prefix-placement"
    with ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="jitney-bench-placement-")
        stack.callback(shutil.rmtree, workdir, True)
        url = stack.enter_context(private_redis())
        env = {**os.environ, "REDIS_URL": url, "OMP_NUM_THREADS": str(setup.threads)}
        parts = []
        for i in range(run.workers):
            metrics = free_port()
            args = ["worker", "--model", setup.model, *setup.worker_args, flag]
            args += ["--metrics-port", str(metrics), "--worker-id", f"w{i}"]
            parts.append(start_part(f"worker-{i}", args, env, workdir, metrics_port=metrics))
        port = free_port()
        args = ["gateway", "--host", "127.0.0.1", "--port", str(port), flag]
        args += ["--max-queue-len", "100000", "--max-queued-tokens", "100000000"]
        parts.append(start_part("gateway", args, env, workdir, url=f"http://127.0.0.1:{port}"))
        for part in parts:
            stack.callback(stop_part, part)
        wait_serving(parts, setup.model, "bench placement", timeout=600)
        say(f"{run.label}: {run.workers} worker(s) of {setup.model} ready")
        yield parts


def metric_sums(part: Part, name: str, label: str) -> dict[str, float]:
    """`name`'s samples on a part's /metrics summed by the value of `label`."""
    port = part.metrics_port
    url = f"{part.url}/metrics" if part.url else f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            found[value] = found.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def run_one(
    setup: PlacementSetup, run: PlacementRun, trace: ConversationTrace, say: Callable[[str], None]
) -> dict[str, Any]:
    with stack(setup, run, say) as parts:
        gateway = next(p for p in parts if p.url)
        report = asyncio.run(
            run_conversations(
                gateway.url or "",
                trace,
                model=setup.model,
                max_duration=setup.max_duration,
                label=run.label,
                say=say,
            )
        )
        reads: dict[str, float] = {}
        for worker in (p for p in parts if p.metrics_port):
            by_outcome = metric_sums(worker, "jitney_placement_reads_total", "outcome")
            for outcome, n in by_outcome.items():
                reads[outcome] = reads.get(outcome, 0.0) + n
        placements = metric_sums(gateway, "jitney_placements_total", "outcome")
    report.pop("requests", None)  # per-turn details: not kept in the comparison
    return {
        **report,
        "workers": run.workers,
        "placement": run.placement,
        "placements": placements,
        "reads": reads,
    }


def run_placement_bench(
    setup: PlacementSetup, trace: ConversationTrace, say: Callable[[str], None] = print
) -> dict[str, Any]:
    runs = [run_one(setup, run, trace, say) for run in setup.all_runs()]
    one = next((r for r in runs if r["workers"] == 1), None)
    for r in runs:
        if one and one["prefix_hit_rate"] and r["prefix_hit_rate"] is not None:
            r["hit_rate_vs_one_worker"] = round(r["prefix_hit_rate"] / one["prefix_hit_rate"], 3)
    return {
        "model": setup.model,
        "worker_args": list(setup.worker_args),
        "threads_per_worker": setup.threads,
        "conversations": len(trace.conversations),
        "turns": trace.num_requests,
        "runs": runs,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model']}: {report['conversations']} conversations, {report['turns']} turns",
        "",
        f"{'run':<32}{'hit rate':>9}{'vs one':>8}{'prefill tok':>12}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'wall s':>8}{'failed':>7}",
    ]
    for r in report["runs"]:
        ratio = r.get("hit_rate_vs_one_worker")
        lines.append(
            f"{r['label']:<32}{r['prefix_hit_rate'] or 0:>9.3f}"
            f"{'' if ratio is None else f'{ratio:.2f}':>8}{r['prefill_tokens']:>12}"
            f"{r['ttft_ms']['p50'] or 0:>10.1f}{r['ttft_ms']['p99'] or 0:>10.1f}"
            f"{r['wall_s']:>8.1f}{r['failed']:>7}"
        )
    lines.append("")
    for r in report["runs"]:
        lines.append(f"{r['label']}: placements {r['placements']}, reads {r['reads']}")
    return "\n".join(lines)
