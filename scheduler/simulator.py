"""The step simulator: the real policy classes driven by a synthetic model.

The synthetic model computes whatever a plan schedules in one step and samples one (dummy) token
for every chunk that reaches its sequence's end, so a request with output length L that runs
uninterrupted takes L steps. Time is counted in steps; a request's latency is the step at whose
end its result is returned, minus its arrival step. Prefill costs nothing unless the token budget
(`max_num_batched_tokens`) is set low, in which case a step computes at most that many tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scheduler.block_manager import KVBlockManager
from scheduler.config import SchedulerConfig
from scheduler.plan import StepPlan
from scheduler.policies import BatchingPolicy, InfeasibleRequestError, make_policy
from scheduler.sequence import Sequence

DUMMY_TOKEN = 0

# Slot states in `SimResult.occupancy`.
SLOT_IDLE = 0
SLOT_WORKING = 1  # computed tokens this step
SLOT_HELD = 2  # held but not computing: finished, waiting for the rest of a static batch


@dataclass(slots=True, frozen=True)
class SimRequest:
    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    priority: int = 0  # lower is served first


@dataclass(slots=True)
class SimResult:
    policy: str
    num_slots: int
    num_steps: int = 0
    # request_id -> finish step - arrival step, in the order requests were given.
    latencies: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    useful_token_steps: int = 0
    num_preemptions: int = 0
    peak_blocks_used: int = 0
    # occupancy[step][slot] = (request index or -1, SLOT_* state)
    occupancy: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def slot_util(self) -> float:
        return (
            self.useful_token_steps / (self.num_steps * self.num_slots) if self.num_steps else 0.0
        )

    @property
    def avg_latency(self) -> float:
        return sum(self.latencies.values()) / len(self.latencies) if self.latencies else 0.0

    def row(self, show_preemptions: bool = False) -> str:
        first_two = ", ".join(str(v) for v in list(self.latencies.values())[:2])
        text = (
            f"{self.policy} steps={self.num_steps} slot_util={round_half_up(100 * self.slot_util)}%"
            f" avg_latency={round_half_up(self.avg_latency)} first_two=[{first_two}]"
        )
        if show_preemptions:
            text += f" preemptions={self.num_preemptions}"
        if self.rejected:
            text += f" rejected={len(self.rejected)}"
        return text


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


# The classic teaching example: 12 requests, one every 10 steps, 4 slots.
SEED_OUTPUT_LENS = (120, 30, 60, 300, 40, 90, 25, 150, 50, 70, 35, 80)
SEED_ARRIVAL_GAP = 10
SEED_PROMPT_LEN = 8


def seed_scenario() -> list[SimRequest]:
    return [
        SimRequest(
            request_id=f"R{i}",
            arrival_step=SEED_ARRIVAL_GAP * i,
            # Distinct prompts, so prefix caching plays no part in the teaching example.
            prompt_token_ids=tuple(1000 * (i + 1) + k for k in range(SEED_PROMPT_LEN)),
            output_len=n,
        )
        for i, n in enumerate(SEED_OUTPUT_LENS)
    ]


def load_trace(
    path: str | Path, step_seconds: float, all_at_once: bool = False
) -> list[SimRequest]:
    """Read a trace (shared/traces format); arrival seconds become steps of `step_seconds`.
    A request may carry a `priority` (lower is served first; 0 when absent)."""
    data = json.loads(Path(path).read_text())
    requests = []
    for r in data["requests"]:
        prompt = r.get("prompt_ids") or list(range(1, int(r["prompt_len"]) + 1))
        arrival = 0 if all_at_once else int(float(r["arrival_s"]) / step_seconds)
        output_len, priority = int(r["output_len"]), int(r.get("priority", 0))
        requests.append(SimRequest(str(r["id"]), arrival, tuple(prompt), output_len, priority))
    return requests


def blocks_for_everything(requests: list[SimRequest], block_size: int) -> int:
    """A pool that can never run short: every request's whole length at once."""
    return sum(-(-(len(r.prompt_token_ids) + r.output_len) // block_size) for r in requests)


# Called after every step with (step, plan, released sequences, policy): tests check invariants.
StepObserver = Callable[[int, StepPlan, list[Sequence], BatchingPolicy], None]


def simulate(
    requests: list[SimRequest],
    policy_name: str,
    config: SchedulerConfig,
    num_blocks: int | None = None,
    block_size: int = 16,
    check_integrity: bool = False,
    max_steps: int = 10_000_000,
    observer: StepObserver | None = None,
) -> SimResult:
    """Run `requests` through the named policy. `num_blocks=None` means an unlimited KV pool."""
    if num_blocks is None:
        num_blocks = max(1, blocks_for_everything(requests, block_size))
    kv = KVBlockManager(num_blocks, block_size)
    policy = make_policy(policy_name, config, kv)
    result = SimResult(policy=policy_name, num_slots=config.max_num_seqs)
    index = {r.request_id: i for i, r in enumerate(requests)}
    arrival = {r.request_id: r.arrival_step for r in requests}
    pending = sorted(requests, key=lambda r: r.arrival_step)  # stable: ties keep their order
    slots = _SlotMap(config.max_num_seqs)
    step = 0
    while pending or policy.has_unfinished():
        if not policy.has_unfinished() and pending[0].arrival_step > step:
            result.occupancy.extend(slots.idle_rows(pending[0].arrival_step - step))
            step = pending[0].arrival_step  # nothing to do until the next arrival
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            seq = Sequence.create(
                r.request_id,
                r.prompt_token_ids,
                r.output_len,
                r.arrival_step,
                priority=r.priority,
            )
            try:
                policy.add_request(seq)
            except InfeasibleRequestError as e:
                result.rejected[r.request_id] = str(e)
        if not pending:
            policy.flush()

        plan = policy.schedule(now=step)
        result.occupancy.append(slots.observe(policy.slot_holders(), plan, index))
        result.peak_blocks_used = max(result.peak_blocks_used, kv.num_used_blocks)
        sampled = {c.seq_id: DUMMY_TOKEN for c in plan.chunks if c.samples}
        result.useful_token_steps += len(sampled)
        released = policy.update(plan, sampled, now=step + 1)
        for seq in released:
            result.latencies[seq.seq_id] = step + 1 - arrival[seq.seq_id]
        slots.release_missing(policy.slot_holders())
        if check_integrity:
            kv.check_integrity()
        if observer is not None:
            observer(step, plan, released, policy)
        step += 1
        if step > max_steps:
            raise RuntimeError(f"{policy_name}: no progress after {max_steps} steps")
    result.num_steps = step
    result.num_preemptions = policy.stats.num_preemptions_total
    result.latencies = {
        r.request_id: result.latencies[r.request_id]
        for r in requests
        if r.request_id in result.latencies
    }
    return result


class _SlotMap:
    """Gives each sequence holding a batch slot a fixed slot index, for the occupancy picture."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}

    def observe(
        self, holders: list[Sequence], plan: StepPlan, index: dict[str, int]
    ) -> list[tuple[int, int]]:
        working = {c.seq_id for c in plan.chunks}
        self.release_missing(holders)
        used = set(self.slot_of.values())
        free = (s for s in range(self.num_slots) if s not in used)
        for seq in holders:
            if seq.seq_id not in self.slot_of:
                self.slot_of[seq.seq_id] = next(free)
        row = [(-1, SLOT_IDLE)] * self.num_slots
        for seq_id, s in self.slot_of.items():
            row[s] = (index[seq_id], SLOT_WORKING if seq_id in working else SLOT_HELD)
        return row

    def release_missing(self, holders: list[Sequence]) -> None:
        live = {seq.seq_id for seq in holders}
        for seq_id in [k for k in self.slot_of if k not in live]:
            del self.slot_of[seq_id]

    def idle_rows(self, n: int) -> list[list[tuple[int, int]]]:
        return [[(-1, SLOT_IDLE)] * self.num_slots for _ in range(n)]
