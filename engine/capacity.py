"""Sizing the KV cache from a memory budget, and the capacity table printed at start."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec, parse_bytes

logger = logging.getLogger("jitney.engine.capacity")

CPU_DEFAULT_KV_MEMORY = "1GiB"
# A draft model's pool (--speculative-model) takes this share of the KV budget unless
# --speculative-kv-cache-memory says how much: it follows only the few sequences that speculate.
DRAFT_KV_SHARE = 0.125


@dataclass(frozen=True, slots=True)
class KVCapacity:
    budget_bytes: int
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def table(self) -> str:
        lines = [
            f"KV cache: {self.budget_bytes / 2**20:.0f} MiB budget -> {self.num_blocks} blocks x "
            f"{self.block_size} tokens = {self.num_tokens} tokens "
            f"({self.bytes_per_block / 1024:.0f} KiB per block)",
            f"max_model_len {self.max_model_len}; concurrent sequences that fit at full length:",
        ]
        for length in sorted({512, 2048, self.max_model_len}):
            if length <= self.max_model_len:
                per_seq = -(-length // self.block_size)
                lines.append(f"  {length:>6} tokens: {self.num_blocks // per_seq}")
        return "\n".join(lines)


def budget_bytes(config: EngineConfig, device: torch.device, step_peak: int | None = None) -> int:
    """The KV cache's bytes: as configured; on CUDA, the memory `gpu_memory_utilization` allows
    minus what is allocated (the weights) minus the largest step's peak (engine.memory_profile;
    without it, all that is free beyond the utilization's headroom); on CPU, 1 GiB."""
    if config.kv_cache_memory is not None:
        return parse_bytes(config.kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if step_peak is not None:
            allowed = config.gpu_memory_utilization * total
            budget = int(allowed - torch.cuda.memory_allocated(device) - step_peak)
            logger.info(
                "kv budget %.2f GiB = %.0f%% of %.1f GiB - %.2f GiB allocated - %.2f GiB step peak",
                budget / 2**30,
                100 * config.gpu_memory_utilization,
                total / 2**30,
                torch.cuda.memory_allocated(device) / 2**30,
                step_peak / 2**30,
            )
            return max(0, min(budget, free))
        reserve = (1 - config.gpu_memory_utilization) * total
        return max(0, int(free - reserve))
    return parse_bytes(CPU_DEFAULT_KV_MEMORY)


def draft_budget_bytes(config: EngineConfig, budget: int) -> int:
    """What the draft model's KV pool takes out of the KV budget `budget` (0: no draft model)."""
    spec = config.speculative
    if spec.model is None:
        return 0
    if spec.kv_cache_memory is not None:
        wanted = parse_bytes(spec.kv_cache_memory)
        if wanted >= budget:
            raise ValueError(
                f"--speculative-kv-cache-memory {spec.kv_cache_memory} leaves "
                f"nothing of the KV budget ({budget} B) to the target model"
            )
        return wanted
    return int(budget * DRAFT_KV_SHARE)


def plan_capacity(
    config: EngineConfig, spec: KVCacheSpec, model_max_len: int, budget: int
) -> KVCapacity:
    """Blocks from the budget; refuse to start when not even one max-length request fits."""
    num_blocks = budget // spec.bytes_per_block
    num_tokens = num_blocks * spec.block_size
    if config.max_model_len is not None:
        if config.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {model_max_len}"
            )
        if config.max_model_len > num_tokens:
            raise ValueError(
                f"max_model_len {config.max_model_len} does not fit the KV cache: "
                f"{budget} B / {spec.bytes_per_block} B per block = {num_blocks} blocks x "
                f"{spec.block_size} = {num_tokens} tokens. Raise --kv-cache-memory to at least "
                f"{-(-config.max_model_len // spec.block_size) * spec.bytes_per_block} B or "
                "lower --max-model-len."
            )
        max_len = config.max_model_len
    else:
        max_len = min(model_max_len, num_tokens)
        if max_len < 2:
            raise ValueError(
                f"KV cache budget {budget} B holds {num_tokens} tokens "
                f"({spec.bytes_per_block} B per block of {spec.block_size}); need at least 2"
            )
        if max_len < model_max_len:
            logger.warning(
                "max_model_len capped to %d (the model allows %d) by the KV cache budget",
                max_len,
                model_max_len,
            )
    return KVCapacity(budget, num_blocks, spec.block_size, spec.bytes_per_block, max_len)
