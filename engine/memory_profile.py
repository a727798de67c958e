"""The activation memory of the largest step, measured once before the KV cache is allocated.

On a GPU, the KV cache takes what memory is left, so what a step needs beside it must be known
first: a guess leaves memory idle or runs out under load. So, as vLLM does, the engine runs one
dummy step of the largest shape the scheduler can produce (max_num_batched_tokens tokens, logits
for max_num_seqs rows, sampled with top-p, the sampler's costliest path) through its own attention
on a small scratch pool, and reads the device's peak allocation over it.
"""

from __future__ import annotations

import torch

from engine.attention.step_inputs import AttentionMetadata
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.models.forward import ModelForward
from engine.sampler import sample
from generation.sampling_params import SamplingParams

# top-p without top-k: the full sort of every row, the sampler's costliest path (top-k takes
# only the k largest).
_SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=0)


def largest_step_layout(
    num_tokens: int, num_seqs: int, block_size: int
) -> list[tuple[int, int, list[int]]]:
    """`num_seqs` sequences sharing `num_tokens` new tokens (one each, the rest to the last),
    each with its own blocks numbered from 0, as AttentionMetadata.build takes them."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    layout, next_block = [], 0
    for i in range(num_seqs):
        n = num_tokens - (num_seqs - 1) if i == num_seqs - 1 else 1
        blocks = -(-n // block_size)
        layout.append((0, n, list(range(next_block, next_block + blocks))))
        next_block += blocks
    return layout


def run_largest_step(
    forward: ModelForward,
    device: torch.device,
    spec: KVCacheSpec,
    num_tokens: int,
    num_seqs: int,
    decode_kernel: str | None = None,
) -> None:
    """One dummy step of the largest shape on a scratch pool (freed on return), through the
    model's forward and the decode attention the engine will use."""
    layout = largest_step_layout(num_tokens, num_seqs, spec.block_size)
    num_blocks = sum(len(blocks) for _, _, blocks in layout)
    pool = PagedKVCache(spec, num_blocks, device, decode_kernel)
    meta = AttentionMetadata.build(layout, pool, input_ids=[0] * num_tokens)
    assert meta.input_ids is not None
    logits = forward(meta.input_ids, None, meta, pool).float()
    sample(logits, [_SAMPLED] * logits.shape[0], [0] * logits.shape[0])


def step_peak_bytes(
    forward: ModelForward,
    device: torch.device,
    spec: KVCacheSpec,
    num_tokens: int,
    num_seqs: int,
    decode_kernel: str | None = None,
) -> int | None:
    """Bytes the largest step allocates beyond what was allocated before it (CUDA); None on a
    device without allocator statistics (the step still runs, so its shapes are checked)."""
    if device.type != "cuda":
        run_largest_step(forward, device, spec, num_tokens, num_seqs, decode_kernel)
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_largest_step(forward, device, spec, num_tokens, num_seqs, decode_kernel)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak
