"""The three batching policies behind one interface (`BatchingPolicy`)."""

from scheduler.block_manager import KVBlockManager
from scheduler.config import SchedulerConfig
from scheduler.policies.base import BatchingPolicy, InfeasibleRequestError
from scheduler.policies.continuous import ContinuousBatching
from scheduler.policies.run_to_completion import DynamicBatching, StaticBatching
from scheduler.speculation import Speculator

POLICIES: dict[str, type[BatchingPolicy]] = {
    p.name: p for p in (StaticBatching, DynamicBatching, ContinuousBatching)
}


def make_policy(
    name: str, config: SchedulerConfig, kv: KVBlockManager, speculator: Speculator | None = None
) -> BatchingPolicy:
    """Policy `name` on `kv`; `speculator`: its speculative decoding (None: what
    `config.speculative` gives without an engine: scheduler/speculation/speculator.py)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown batching policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
    return cls(config, kv, speculator)


__all__ = [
    "POLICIES",
    "BatchingPolicy",
    "ContinuousBatching",
    "DynamicBatching",
    "InfeasibleRequestError",
    "StaticBatching",
    "make_policy",
]
