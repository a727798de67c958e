"""Property-based tests: random traces and budgets, every policy, invariants at every step."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import POLICIES, BatchingPolicy, SchedulerConfig, Sequence, SequenceStatus, StepPlan
from scheduler.simulator import SimRequest, simulate

PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def traces(draw: st.DrawFn, priorities: bool = False) -> list[SimRequest]:
    """Requests with shared prompt prefixes (to exercise the prefix cache) and ties in arrival;
    with `priorities`, each request has one of three."""
    prefixes = draw(st.lists(st.lists(st.integers(1, 50), max_size=12), min_size=1, max_size=3))
    requests = []
    for i in range(draw(st.integers(1, 14))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = [1000 + 100 * i + k for k in range(draw(st.integers(1, 20)))]
        requests.append(
            SimRequest(
                request_id=f"r{i}",
                arrival_step=draw(st.integers(0, 40)),
                prompt_token_ids=tuple(prefix + suffix),
                output_len=draw(st.integers(1, 30)),
                priority=draw(st.integers(0, 2)) if priorities else 0,
            )
        )
    return requests


@st.composite
def setups(
    draw: st.DrawFn, priorities: bool = False
) -> tuple[list[SimRequest], SchedulerConfig, int, int]:
    trace = draw(traces(priorities))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    largest = max(-(-(len(r.prompt_token_ids) + r.output_len - 1) // block_size) for r in trace)
    num_blocks = draw(st.integers(largest, 3 * largest + 4))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_queue_delay=draw(st.integers(0, 20)),
        reserve_full_length=draw(st.booleans()),
        max_preemptions_per_seq=draw(st.integers(1, 4)),
    )
    return trace, config, num_blocks, block_size


class InvariantChecker:
    """Checks every step's plan against the limits and records each release."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.released: Counter[str] = Counter()
        self.outputs: dict[str, int] = {}
        self.first_scheduled: dict[str, float] = {}

    def __call__(
        self, step: int, plan: StepPlan, released: list[Sequence], policy: BatchingPolicy
    ) -> None:
        assert plan.batch_size <= self.config.max_num_seqs
        assert len(policy.slot_holders()) <= self.config.max_num_seqs
        assert plan.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len({c.seq_id for c in plan.chunks}) == plan.batch_size
        if self.config.reserve_full_length or policy.name != "continuous":
            assert not plan.preempted_seq_ids
        for seq in policy.running:
            assert seq.status is SequenceStatus.RUNNING
        for seq in policy.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        for seq in released:
            self.released[seq.seq_id] += 1
            self.outputs[seq.seq_id] = seq.num_output_tokens
            self.first_scheduled[seq.seq_id] = seq.first_scheduled_time


@PROFILE
@given(setup=setups(), policy=st.sampled_from(sorted(POLICIES)))
def test_every_request_finishes_once_with_its_length_within_budgets(setup, policy):
    """No request lost or doubled, exact lengths, limits and block integrity held at every step."""
    trace, config, num_blocks, block_size = setup
    checker = InvariantChecker(config)
    result = simulate(
        trace, policy, config, num_blocks, block_size, check_integrity=True, observer=checker
    )
    assert checker.released == Counter({r.request_id: 1 for r in trace})
    assert checker.outputs == {r.request_id: r.output_len for r in trace}
    assert result.useful_token_steps == sum(r.output_len for r in trace)
    assert result.peak_blocks_used <= num_blocks
    assert not result.rejected


@PROFILE
@given(setup=setups(), policy=st.sampled_from(sorted(POLICIES)))
def test_admission_is_fifo(setup, policy):
    """Requests are first scheduled in arrival order: nobody is overtaken, nobody starves."""
    trace, config, num_blocks, block_size = setup
    checker = InvariantChecker(config)
    simulate(trace, policy, config, num_blocks, block_size, observer=checker)
    order = sorted(trace, key=lambda r: r.arrival_step)  # stable: ties keep submission order
    times = [checker.first_scheduled[r.request_id] for r in order]
    assert times == sorted(times)


@PROFILE
@given(setup=setups())
def test_continuous_never_takes_more_steps_than_static(setup):
    """On the same trace and limits, iteration-level batching finishes no later than static."""
    trace, config, _, block_size = setup
    static = simulate(trace, "static", config, None, block_size)
    continuous = simulate(trace, "continuous", config, None, block_size)
    assert continuous.num_steps <= static.num_steps


@PROFILE
@given(setup=setups())
def test_preempted_sequences_resume_and_finish(setup):
    """Under a tight pool, preemption happens, and every preempted request still finishes."""
    trace, config, _, block_size = setup
    config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_preemptions_per_seq=config.max_preemptions_per_seq,
    )
    largest = max(-(-(len(r.prompt_token_ids) + r.output_len - 1) // block_size) for r in trace)
    preempted: set[str] = set()
    checker = InvariantChecker(config)

    def observe(step, plan, released, policy):  # type: ignore[no-untyped-def]
        preempted.update(plan.preempted_seq_ids)
        checker(step, plan, released, policy)

    simulate(trace, "continuous", config, largest, block_size, True, observer=observe)
    assert preempted <= set(checker.released)
    assert all(checker.outputs[r.request_id] == r.output_len for r in trace)


@PROFILE
@given(setup=setups(priorities=True), policy=st.sampled_from(sorted(POLICIES)))
def test_with_priorities_nobody_is_overtaken_by_a_less_urgent_later_request(setup, policy):
    """Random priorities: every request still finishes once with its length, and one that came
    no later and is at least as urgent as another is first scheduled no later than it (with one
    priority this is FIFO admission)."""
    trace, config, num_blocks, block_size = setup
    checker = InvariantChecker(config)
    simulate(trace, policy, config, num_blocks, block_size, check_integrity=True, observer=checker)
    assert checker.released == Counter({r.request_id: 1 for r in trace})
    assert checker.outputs == {r.request_id: r.output_len for r in trace}
    order = sorted(trace, key=lambda r: r.arrival_step)  # stable: ties keep submission order
    first = checker.first_scheduled
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            if a.priority <= b.priority:
                assert first[a.request_id] <= first[b.request_id], (a, b)


@PROFILE
@given(setup=setups(priorities=True))
def test_with_priorities_no_survivor_is_less_urgent_than_a_victim(setup):
    """Under a tight pool with random priorities, whatever keeps running after a step is at least
    as urgent as everything that step preempted; the preempted still finish."""
    trace, config, _, block_size = setup
    config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_preemptions_per_seq=config.max_preemptions_per_seq,
    )
    largest = max(-(-(len(r.prompt_token_ids) + r.output_len - 1) // block_size) for r in trace)
    priority = {r.request_id: r.priority for r in trace}
    checker = InvariantChecker(config)

    def observe(step, plan, released, policy):  # type: ignore[no-untyped-def]
        if plan.preempted_seq_ids and policy.running:
            most_urgent_victim = min(priority[i] for i in plan.preempted_seq_ids)
            assert max(s.priority for s in policy.running) <= most_urgent_victim
        checker(step, plan, released, policy)

    simulate(trace, "continuous", config, largest, block_size, True, observer=observe)
    assert all(checker.outputs[r.request_id] == r.output_len for r in trace)
