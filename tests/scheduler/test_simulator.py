"""The step simulator and `jitney simulate`: the seed scenario follows from the stated rules."""

import heapq
import json
import subprocess
import sys

import pytest

from jitney.cli import main
from scheduler import SchedulerConfig
from scheduler.simulator import (
    SEED_ARRIVAL_GAP,
    SEED_OUTPUT_LENS,
    round_half_up,
    seed_scenario,
    simulate,
)

SLOTS, MAX_WAIT = 4, 15
ARRIVALS = [SEED_ARRIVAL_GAP * i for i in range(len(SEED_OUTPUT_LENS))]


def expected_static() -> list[int]:
    """Batches of 4 in arrival order; one at a time; all return at start + longest."""
    finish, end = [], 0
    for b in range(0, len(ARRIVALS), SLOTS):
        start = max(end, ARRIVALS[b + SLOTS - 1])
        end = start + max(SEED_OUTPUT_LENS[b : b + SLOTS])
        finish += [end] * SLOTS
    return finish


def expected_dynamic() -> list[int]:
    """Launch when 4 wait or the oldest waited 15 steps, after the previous batch ended."""
    finish, end, i = [], 0, 0
    while i < len(ARRIVALS):
        oldest = max(end, ARRIVALS[i])
        fourth = ARRIVALS[i + SLOTS - 1] if i + SLOTS - 1 < len(ARRIVALS) else float("inf")
        launch = max(end, min(fourth, ARRIVALS[i] + MAX_WAIT), oldest)
        batch = [j for j in range(i, min(i + SLOTS, len(ARRIVALS))) if ARRIVALS[j] <= launch]
        end = launch + max(SEED_OUTPUT_LENS[j] for j in batch)
        finish += [end] * len(batch)
        i += len(batch)
    return finish


def expected_continuous() -> list[int]:
    """FIFO into the earliest free slot; a request arriving at t can run in step t."""
    free_at = [0] * SLOTS
    finish, last_start = [], 0
    for arrival, n in zip(ARRIVALS, SEED_OUTPUT_LENS, strict=True):
        start = max(arrival, heapq.heappop(free_at), last_start)
        last_start = start
        heapq.heappush(free_at, start + n)
        finish.append(start + n)
    return finish


def expected_row(policy: str, finish: list[int]) -> str:
    latencies = [f - a for f, a in zip(finish, ARRIVALS, strict=True)]
    steps = max(finish)
    util = round_half_up(100 * sum(SEED_OUTPUT_LENS) / (steps * SLOTS))
    avg = round_half_up(sum(latencies) / len(latencies))
    return (
        f"{policy} steps={steps} slot_util={util}% avg_latency={avg} "
        f"first_two=[{latencies[0]}, {latencies[1]}]"
    )


EXPECTED = {
    "static": expected_static,
    "dynamic": expected_dynamic,
    "continuous": expected_continuous,
}


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_seed_scenario_rows_follow_from_the_rules(policy):
    """Each policy's row equals what the batching rule computes by hand."""
    config = SchedulerConfig(max_num_seqs=SLOTS, max_queue_delay=MAX_WAIT)
    result = simulate(seed_scenario(), policy, config, check_integrity=True)
    assert result.row() == expected_row(policy, EXPECTED[policy]())


def test_cli_prints_the_three_rows_in_order(capsys):
    """`jitney simulate --scenario seed` prints static, dynamic, continuous rows."""
    assert main(["simulate", "--scenario", "seed"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [expected_row(p, f()) for p, f in EXPECTED.items()]


def test_continuous_beats_static_on_the_seed_scenario():
    """The teaching point: fewer steps, higher utilisation, lower latency."""
    config = SchedulerConfig(max_num_seqs=SLOTS, max_queue_delay=MAX_WAIT)
    static = simulate(seed_scenario(), "static", config)
    continuous = simulate(seed_scenario(), "continuous", config)
    assert continuous.num_steps < static.num_steps
    assert continuous.slot_util > static.slot_util
    assert continuous.avg_latency < static.avg_latency


def test_plot_writes_a_png(tmp_path, capsys):
    """--plot draws the occupancy timelines into a real PNG image."""
    out = tmp_path / "seed.png"
    assert main(["simulate", "--scenario", "seed", "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_occupancy_shows_static_holding_slots():
    """Static's timeline has held-but-idle slot steps; continuous has none."""
    config = SchedulerConfig(max_num_seqs=SLOTS, max_queue_delay=MAX_WAIT)
    held = {
        p: sum(
            state == 2 for row in simulate(seed_scenario(), p, config).occupancy for _, state in row
        )
        for p in ("static", "continuous")
    }
    assert held["static"] > 0 and held["continuous"] == 0


def test_trace_with_kv_budget_reports_preemptions(tmp_path, capsys):
    """--trace with a small --kv-blocks runs every policy and prints a preemption count."""
    trace = {
        "meta": {"n": 6},
        "requests": [
            {"id": i, "arrival_s": 0.1 * i, "prompt_len": 12, "output_len": 20 + 3 * i}
            for i in range(6)
        ],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    args = [
        "simulate",
        "--trace",
        str(path),
        "--slots",
        "4",
        "--kv-blocks",
        "12",
        "--block-size",
        "4",
        "--tokens-per-step",
        "16",
    ]
    assert main(args) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows] == ["static", "dynamic", "continuous"]
    assert all("preemptions=" in r for r in rows)
    assert int(rows[2].rsplit("preemptions=", 1)[1]) > 0
    assert rows[0].endswith("preemptions=0")  # static reserves its batch, never preempts


def test_env_var_sets_a_default(monkeypatch, capsys):
    """JITNEY_SLOTS=1 makes every policy run one request at a time."""
    monkeypatch.setenv("JITNEY_SLOTS", "1")
    assert main(["simulate", "--policy", "continuous"]) == 0
    row = capsys.readouterr().out.strip()
    assert f"steps={sum(SEED_OUTPUT_LENS)}" in row


def test_scheduler_imports_no_torch_redis_or_aiohttp():
    """The core stays pure: importing all of it loads none of the heavy or IO packages."""
    code = (
        "import sys, scheduler, scheduler.simulator, scheduler.sim_plot, jitney.cli;"
        "bad = {'torch', 'redis', 'aiohttp', 'worker', 'gateway', 'transformers'};"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
