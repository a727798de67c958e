"""`jitney bench queue`: what one Redis and one gateway carry, with no model in the way.

N `--model noop` workers (B slots each, a fake forward of --noop-step-ms) and M gateways run
against one private redis-server; the load generator (bench/serve.py) streams requests through
the gateways, closed loop at N × B in flight, so every seat stays busy. Measured over the load:
- streamed tokens/s end to end;
- CPU seconds per million streamed tokens of Redis' command thread (INFO cpu, main thread),
  of each gateway and each worker process (/proc/<pid>/stat), and the workers' publish round
  trip (their own `publish` step phase, wall time);
- Redis commands and network bytes per token (INFO stats).
From CPU per token it extrapolates the tokens/s at which one Redis core and one gateway process
would be saturated (100% of one core), which is what a capacity plan needs (docs/scale.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.processes import Part, start_part, stop_part, wait_serving
from bench.serve import run_serve
from bench.trace import TraceRequest
from launch.private_redis import free_port, private_redis
from protocol.queue.placement import PLACEMENT_DEFAULT

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PUBLISH_METRIC = "jitney_step_phase_seconds_sum{"
NOOP_VOCAB = 281  # the noop model speaks the tiny byte-level tokenizer


@dataclass(frozen=True, slots=True)
class QueueSetup:
    workers: int = 2
    slots: int = 64  # --max-num-seqs per worker
    gateways: int = 1
    step_ms: float = 20.0  # the noop forward
    requests: int = 512
    prompt_len: int = 32
    output_len: int = 128
    placement: bool = PLACEMENT_DEFAULT  # --prefix-placement on gateways and workers
    # K > 0: each prompt starts with one of K shared prefixes (3/4 of it), so placement finds
    # hits and places (its PLACE path measured, not only its lookups)
    prefixes: int = 0

    @property
    def in_flight(self) -> int:
        return self.workers * self.slots


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def redis_info(port: int) -> dict[str, float]:
    """The INFO counters the bench reads (redis-cli: no client library in the measurement)."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "all"], capture_output=True, text=True, check=True
    ).stdout
    wanted = (
        "used_cpu_sys_main_thread",
        "used_cpu_user_main_thread",
        "used_cpu_sys",
        "used_cpu_user",
        "total_commands_processed",
        "total_net_input_bytes",
        "total_net_output_bytes",
    )
    values = {}
    for line in out.splitlines():
        key, _, value = line.strip().partition(":")
        if key in wanted:
            values[key] = float(value)
    return values


def publish_seconds(metrics_port: int) -> float:
    """A worker's summed publish phase (the replies' round trip to Redis), from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(PUBLISH_METRIC) and 'phase="publish"' in line
    )


@contextmanager
def running(setup: QueueSetup, say: Callable[[str], None]) -> Iterator[tuple[int, list[Part]]]:
    """redis-server, the noop workers and the gateways; all stopped on exit."""
    with ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="jitney-bench-queue-")
        stack.callback(shutil.rmtree, workdir, True)
        url = stack.enter_context(private_redis())
        port = urlsplit(url).port or 6379
        env = {**os.environ, "REDIS_URL": url, "OMP_NUM_THREADS": "1"}
        parts = []
        for i in range(setup.workers):
            metrics = free_port()
            args = [
                "worker",
                "--model",
                "noop",
                "--noop-step-ms",
                str(setup.step_ms),
                "--max-num-seqs",
                str(setup.slots),
                "--kv-cache-memory",
                "64MiB",
                "--metrics-port",
                str(metrics),
                "--worker-id",
                f"noop-{i}",
                placement_flag(setup),
            ]
            parts.append(start_part(f"worker-{i}", args, env, workdir, metrics_port=metrics))
        for i in range(setup.gateways):
            gw_port = free_port()
            args = [
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(gw_port),
                "--max-queue-len",
                str(10 * setup.requests),
                "--max-queued-tokens",
                str(10 * setup.requests * setup.prompt_len),
                placement_flag(setup),
            ]
            url_of = f"http://127.0.0.1:{gw_port}"
            parts.append(start_part(f"gateway-{i}", args, env, workdir, url=url_of))
        for part in parts:
            stack.callback(stop_part, part)
        wait_serving(parts, "noop", "bench queue")
        say(
            f"redis :{port}, {setup.workers} noop workers × {setup.slots} slots, "
            f"{setup.gateways} gateway(s)"
        )
        yield port, parts


def placement_flag(setup: QueueSetup) -> str:
    return "--prefix-placement" if setup.placement else "--no-prefix-placement"


def trace(setup: QueueSetup, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, NOOP_VOCAB) for _ in range(n)]

    shared = setup.prompt_len * 3 // 4 if setup.prefixes else 0
    prefixes = [tokens(shared) for _ in range(setup.prefixes)]
    return [
        TraceRequest(
            f"q{i}",
            [*(prefixes[i % setup.prefixes] if shared else []), *tokens(setup.prompt_len - shared)],
            setup.output_len,
        )
        for i in range(setup.requests)
    ]


def placements(gateways: list[Part]) -> dict[str, float]:
    """The gateways' `jitney_placements_total` by outcome, summed."""
    found: dict[str, float] = {}
    for gateway in gateways:
        with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("jitney_placements_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                found[outcome] = found.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def snapshot(redis_port: int, parts: list[Part]) -> dict[str, Any]:
    return {
        "redis": redis_info(redis_port),
        "cpu": {p.name: process_cpu_s(p.proc.pid) for p in parts},
        "publish": {p.name: publish_seconds(p.metrics_port) for p in parts if p.metrics_port},
        "at": time.perf_counter(),
    }


def run_queue_bench(setup: QueueSetup, say: Callable[[str], None] = print) -> dict[str, Any]:
    requests = trace(setup)
    with running(setup, say) as (redis_port, parts):
        gateways = [p for p in parts if p.url]
        before = snapshot(redis_port, parts)
        reports = asyncio.run(_load(setup, requests, gateways, say))
        after = snapshot(redis_port, parts)
        placed = placements(gateways)
    return {**summarize(setup, before, after, reports), "placements": placed}


async def _load(
    setup: QueueSetup,
    requests: list[TraceRequest],
    gateways: list[Part],
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """The closed-loop load, split evenly over the gateways."""
    share = max(1, setup.in_flight // len(gateways))
    runs = [
        run_serve(
            g.url or "",
            requests[i :: len(gateways)],
            concurrency=share,
            model="noop",
            label=g.name,
            say=say,
        )
        for i, g in enumerate(gateways)
    ]
    return list(await asyncio.gather(*runs))


def summarize(
    setup: QueueSetup, before: dict[str, Any], after: dict[str, Any], reports: list[dict[str, Any]]
) -> dict[str, Any]:
    tokens = sum(r["output_tokens"] for r in reports)
    failed = sum(r["failed"] for r in reports)
    wall = after["at"] - before["at"]
    per_m = 1e6 / tokens if tokens else 0.0

    def delta(section: str, key: str) -> float:
        return after[section][key] - before[section][key]

    redis_main = delta("redis", "used_cpu_sys_main_thread") + delta(
        "redis", "used_cpu_user_main_thread"
    )
    redis_all = delta("redis", "used_cpu_sys") + delta("redis", "used_cpu_user")
    cpu = {name: delta("cpu", name) for name in after["cpu"]}
    gateways = {n: s for n, s in cpu.items() if n.startswith("gateway")}
    workers = {n: s for n, s in cpu.items() if n.startswith("worker")}
    publish = sum(delta("publish", n) for n in after["publish"])
    # Each gateway's own tokens per CPU second: the ceiling is the worst of them.
    streamed = {r["label"]: r["output_tokens"] for r in reports}
    gateway_ceilings = [streamed[n] / s for n, s in gateways.items() if s > 0 and streamed.get(n)]
    return {
        "setup": asdict(setup),
        "streamed_tokens": tokens,
        "failed_requests": failed,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "cpu_s_per_million_tokens": {
            "redis_main_thread": round(redis_main * per_m, 2),
            "redis_all_threads": round(redis_all * per_m, 2),
            **{n: round(s * per_m, 2) for n, s in sorted(gateways.items())},
            "workers_total": round(sum(workers.values()) * per_m, 2),
            "workers_publish_wall": round(publish * per_m, 2),
        },
        "redis_commands_per_token": round(delta("redis", "total_commands_processed") / tokens, 3)
        if tokens
        else None,
        "redis_bytes_in_per_token": round(delta("redis", "total_net_input_bytes") / tokens, 1)
        if tokens
        else None,
        "redis_bytes_out_per_token": round(delta("redis", "total_net_output_bytes") / tokens, 1)
        if tokens
        else None,
        "per_request": per_request(before, after, cpu, reports),
        "ceiling_tokens_per_s": {
            "one_redis_core": round(1e6 / (redis_main * per_m)) if redis_main > 0 else None,
            "one_gateway_process": round(min(gateway_ceilings)) if gateway_ceilings else None,
        },
        "load": [
            {k: r[k] for k in ("label", "completed", "failed", "output_throughput")}
            for r in reports
        ],
    }


def per_request(
    before: dict[str, Any],
    after: dict[str, Any],
    cpu: dict[str, float],
    reports: list[dict[str, Any]],
) -> dict[str, float] | None:
    """What one request costs besides its tokens' share: Redis commands and bytes, and the CPU
    of Redis and of the gateways (placement's cost is the difference of two such runs)."""
    done = sum(r["completed"] for r in reports)
    if not done:
        return None

    def per(section: str, *keys: str) -> float:
        return sum(after[section][k] - before[section][k] for k in keys) / done

    redis_cpu = per("redis", "used_cpu_sys_main_thread", "used_cpu_user_main_thread")
    gateways = sum(s for n, s in cpu.items() if n.startswith("gateway")) / done
    return {
        "redis_commands": round(per("redis", "total_commands_processed"), 2),
        "redis_bytes_in": round(per("redis", "total_net_input_bytes"), 1),
        "redis_bytes_out": round(per("redis", "total_net_output_bytes"), 1),
        "redis_cpu_us": round(1e6 * redis_cpu, 1),
        "gateways_cpu_us": round(1e6 * gateways, 1),
    }


def format_report(r: dict[str, Any]) -> str:
    s = r["setup"]
    lines = [
        f"{s['workers']} noop workers × {s['slots']} slots ({s['step_ms']} ms steps), "
        f"{s['gateways']} gateway(s), one Redis: {r['streamed_tokens']} tokens in "
        f"{r['wall_s']} s = {r['tokens_per_s']} tokens/s streamed ({r['failed_requests']} failed)",
        "",
        f"{'CPU s per 1M streamed tokens':<34}{'':>8}",
    ]
    for name, value in r["cpu_s_per_million_tokens"].items():
        lines.append(f"  {name:<32}{value:>8.2f}")
    lines += [
        "",
        f"Redis per token: {r['redis_commands_per_token']} commands, "
        f"{r['redis_bytes_in_per_token']} B in, {r['redis_bytes_out_per_token']} B out",
        f"Per request: {r.get('per_request')}; placements: {r.get('placements')}",
        "Extrapolated at 100% of one core: one Redis ≈ "
        f"{r['ceiling_tokens_per_s']['one_redis_core']:,} tokens/s, one gateway ≈ "
        f"{r['ceiling_tokens_per_s']['one_gateway_process']:,} tokens/s",
    ]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def plot_compare(reports: list[dict[str, Any]], labels: list[str], path: str) -> None:
    """CPU seconds per million streamed tokens, per component, one bar group per report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    components = list(reports[0]["cpu_s_per_million_tokens"])
    width = 0.8 / len(reports)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (report, label) in enumerate(zip(reports, labels, strict=True)):
        values = [report["cpu_s_per_million_tokens"].get(c, 0.0) for c in components]
        ax.bar([x + i * width for x in range(len(components))], values, width, label=label)
    ax.set_xticks([x + width * (len(reports) - 1) / 2 for x in range(len(components))])
    ax.set_xticklabels(components, rotation=20, ha="right")
    ax.set_ylabel("CPU s per 1M streamed tokens")
    ax.set_title("jitney bench queue: where a streamed token's CPU goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
