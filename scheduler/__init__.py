"""Jitney's pure scheduling core: sequences, the KV block manager, batching policies, simulator.

Imports neither torch, redis, aiohttp, `worker` nor `gateway` (a test enforces it).
"""

from scheduler.block_manager import BlockIntegrityError, KVBlockManager
from scheduler.config import SchedulerConfig
from scheduler.plan import ScheduledChunk, SchedulerStats, StepLimit, StepPlan
from scheduler.policies import (
    POLICIES,
    BatchingPolicy,
    ContinuousBatching,
    DynamicBatching,
    InfeasibleRequestError,
    StaticBatching,
    make_policy,
)
from scheduler.sequence import SamplingLimits, Sequence, SequenceStatus
from scheduler.speculation import SpeculativeConfig
from scheduler.speculation.proposer import SPECULATIVE_METHODS

__all__ = [
    "POLICIES",
    "SPECULATIVE_METHODS",
    "BatchingPolicy",
    "BlockIntegrityError",
    "ContinuousBatching",
    "DynamicBatching",
    "InfeasibleRequestError",
    "KVBlockManager",
    "SamplingLimits",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "SpeculativeConfig",
    "StaticBatching",
    "StepLimit",
    "StepPlan",
    "make_policy",
]
