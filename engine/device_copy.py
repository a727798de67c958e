"""Small host values to the device without waiting for the device.

On CUDA, ``torch.tensor(values, device="cuda")`` copies from pageable host memory, and such a
copy synchronizes the stream first: the host waits for every kernel already queued (a whole
forward pass, when the sampler runs) before it can queue the next one, once per such tensor. The
values go instead through pinned memory from PyTorch's caching host allocator (which keeps a
block until the copy that reads it has run) and copy asynchronously, so the step's only wait is
the one transfer of sampled ids back to the host. Elsewhere it is plain ``torch.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def device_tensor(
    values: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, with no host sync on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
