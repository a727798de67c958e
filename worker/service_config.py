"""The worker loop's own settings (the engine's are EngineConfig's): one frozen dataclass,
validated on construction, importable without the engine (the command line reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.queue.placement import PLACEMENT_DEFAULT, STEAL_AFTER_MS
from protocol.sampling_defaults import SamplingDefaults
from worker import generation_defaults


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    worker_id: str
    idle_block_ms: int = 1000
    shutdown_timeout_s: float = 30.0
    # The heartbeat thread stops renewing the lease when the loop has not come round for this
    # long (a hung step): other workers then take its requests over. Longer than any real step.
    stall_timeout_s: float = 60.0
    # Where the model card's sampling defaults come from: auto, vllm or a directory, and a JSON
    # object whose keys win (worker.generation_defaults).
    generation_config: str = generation_defaults.AUTO
    override_generation_config: str = ""
    # Prefix-aware placement (protocol/queue/placement.py): publish a summary of the prefix
    # cache, read this worker's own streams, and take others' entries their owner has not read
    # within `placement_steal_ms`.
    prefix_placement: bool = PLACEMENT_DEFAULT
    placement_steal_ms: int = STEAL_AFTER_MS

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker id must be non-empty without spaces, got {self.worker_id!r}")
        if not 1 <= self.idle_block_ms <= 60_000:
            raise ValueError(f"idle_block_ms must be in [1, 60000], got {self.idle_block_ms}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.stall_timeout_s <= self.idle_block_ms / 1000:
            raise ValueError(
                f"stall_timeout ({self.stall_timeout_s} s) must exceed the idle block "
                f"({self.idle_block_ms} ms): an idle worker would look hung"
            )
        if not 10 <= self.placement_steal_ms <= 600_000:
            raise ValueError(
                f"placement_steal_ms must be in [10, 600000], got {self.placement_steal_ms}"
            )
        # Refused now, not after a minute of loading the model.
        generation_defaults.check_choice(self.generation_config)
        generation_defaults.parse_override(self.override_generation_config)

    @property
    def generation_override(self) -> SamplingDefaults:
        return generation_defaults.parse_override(self.override_generation_config)
