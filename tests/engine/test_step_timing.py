"""Engine hygiene on the tiny model: every step's phase timing, and `reset` after a broken step."""

import logging
import time

import pytest

from engine.step_timing import PHASES, StepTiming
from generation import SamplingParams
from tests.engine.engine_helpers import make_engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_every_phase_of_a_working_step_is_timed_and_they_cover_the_step(loaded):
    """Consecutive laps: the phases add up to the step as timed from outside."""
    engine = make_engine(loaded, kv_cache_memory="16MiB")
    engine.add_request("a", [5, 6, 7, 8, 9], greedy(4))
    engine.add_request("b", [10, 11, 12], greedy(4))
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        # The step that leaves the engine idle also checks the whole block pool, deliberately
        # outside the phases and timed on its own (llm_engine.py).
        idle_check = engine.last_idle_check_s
        assert (idle_check > 0) == (not engine.has_unfinished())
        outside = time.perf_counter() - start - idle_check
        timing = engine.last_step_timing
        assert timing.propose == 0  # no draft model
        assert all(s > 0 for phase, s in timing.as_dict().items() if phase != "propose"), timing
        assert timing.total <= outside
        assert timing.total == pytest.approx(outside, rel=0.05, abs=2e-4)
        assert timing.overhead == pytest.approx(timing.total - timing.forward)


def test_a_step_with_nothing_scheduled_times_only_schedule_and_postprocess(loaded):
    """Static batching waits for a full batch: the step plans nothing and runs no forward."""
    engine = make_engine(loaded, kv_cache_memory="16MiB", batching="static", max_num_seqs=4)
    engine.add_request("lonely", [5, 6, 7], greedy(2))
    assert engine.step() == []
    timing = engine.last_step_timing
    assert timing.prepare == timing.forward == timing.sample == 0.0
    assert timing.schedule > 0 and timing.postprocess > 0


def test_step_timings_accumulate_phase_by_phase():
    total = StepTiming()
    total.add(StepTiming(schedule=1.0, forward=2.0))
    total.add(StepTiming(forward=0.5, sample=0.25, postprocess=0.125, prepare=4.0))
    assert total.as_dict() == dict(zip(PHASES, (0.0, 1.0, 4.0, 2.5, 0.25, 0.125), strict=True))
    assert total.total == 7.875 and total.overhead == 5.375


def test_reset_logs_a_failed_abort_and_rebuilds_a_usable_engine(loaded, caplog):
    """A step that died half-way left a sequence in no queue: its abort raises. reset logs it
    with the request id and the exception, and the engine serves that id again afterwards."""
    engine = make_engine(loaded, kv_cache_memory="16MiB", max_num_seqs=1)
    engine.add_request("running", [5, 6, 7, 8], greedy(8))
    engine.add_request("lost", [9, 10, 11], greedy(8))
    engine.step()  # "running" holds the only slot; "lost" waits
    lost = engine.policy.seqs["lost"]
    engine.policy.waiting.remove(lost)  # what a step raising mid-admission leaves behind

    with caplog.at_level(logging.WARNING, logger="jitney.engine"):
        engine.reset()

    failed = [r for r in caplog.records if r.getMessage().startswith("abort_failed")]
    assert len(failed) == 1 and "request=lost" in failed[0].getMessage()
    assert failed[0].exc_info is not None and failed[0].exc_info[0] is ValueError
    assert any("engine state rebuilt" in r.getMessage() for r in caplog.records)
    assert not engine.choices.by_seq and not engine.has_unfinished()
    assert engine.view.kv_used_blocks == 0

    out = engine.generate([[9, 10, 11]], greedy(3))
    assert len(out[0].token_ids) == 3
    engine.add_request("lost", [9, 10, 11], greedy(2))  # no stale "lost" left in the scheduler
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_integrity()


def test_reset_after_clean_aborts_keeps_the_pool_and_logs_nothing(loaded, caplog):
    engine = make_engine(loaded, kv_cache_memory="16MiB")
    engine.add_request("a", [5, 6, 7, 8], greedy(8))
    engine.step()
    pool = engine.block_manager
    with caplog.at_level(logging.WARNING, logger="jitney.engine"):
        engine.reset()
    assert caplog.records == []
    assert engine.block_manager is pool and pool.num_used_blocks == 0
