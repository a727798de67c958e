"""The paged KV pool: per layer, one key and one value tensor cut into fixed-size blocks.

Layout (per layer, K and V alike): ``[num_blocks, block_size, num_kv_heads, head_dim]``
(token-major, the layout of vLLM's flash-attention KV cache). Slot ``s = block_id * block_size +
offset`` is row ``s`` of the flat view ``[num_slots, kv_heads, head_dim]``, so writing a step's new
K/V is one ``index_copy_``. Reading a batch's context copies whole blocks (``read_blocks``: an
``index_select`` over the block axis, rows of ``block_size * kv_heads * head_dim`` contiguous
elements) into a workspace reused by every layer and step; ``[n, blocks * block_size, kv_heads, d]``
transposed is SDPA's ``[n, kv_heads, L, d]`` without a copy. NOTE: measured on CPU (SmolLM2
shapes, 256 sequences x 13 blocks): reading K and V into the reused workspace took 7 ms against
42 ms into fresh tensors (a new 40 MB allocation page-faults every time), and on the tiny model
gathering whole blocks took half the time of gathering each (position, head) row of 64 bytes.

The block manager (``scheduler/block_manager.py``) owns which block ids are in use; this module
only owns the memory. All layers live in one allocation made once at start.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1e9"`` or an int -> bytes (floored)."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = _BYTES_RE.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"not a byte size: {value!r} (examples: 2GiB, 512MiB, 1e9)")
        number, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"byte size must be a finite number >= 0, got {value!r}")
    return int(number * _UNITS[unit])


def kv_storage_dtype(choice: str, model_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """`--kv-cache-dtype` (EngineConfig validated it) resolved: "float32", "bfloat16" or
    "float16" as named; "auto", float16 for a float32 model whose weights are quantized blocks
    (`quantized`: GGUF's or int8's, on the CPU), else the model's dtype.

    NOTE: why float16 there (docs/performance.md, SmolLM2 on 2 cores): half the bytes of every
    decode step's K/V read, so one user's step at 4,000 positions took 23.1-23.7 ms against
    32.4-33.8 (`python -m research.kv_dtype`) and mixed-64 ran 4% faster; twice the tokens per
    budget; perplexity -0.005% (bfloat16: +0.02%, its 8-bit significand). llama.cpp's default
    KV type is the same. The exact mode (`--quantization none`) keeps the model's dtype."""
    if choice != "auto":
        return getattr(torch, choice)
    return torch.float16 if quantized and model_dtype == torch.float32 else model_dtype


FLOAT16_MAX = torch.finfo(torch.float16).max  # 65,504


def to_pool(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as a pool of `dtype` stores them: rounded to nearest even, and for float16 held
    within its range (a value past 65,504 would become inf, and every score it meets NaN: a
    saturated key or value keeps the reply finite). csrc/layer_ops.cpp writes the same bits."""
    if dtype == torch.float16 and t.dtype != torch.float16:
        t = t.clamp(-FLOAT16_MAX, FLOAT16_MAX)
    return t.to(dtype)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the pool stores
    block_size: int
    # What attention computes in, the model's dtype (None: `dtype`). A float32 model may store its
    # K/V in bfloat16 or float16 (`--kv-cache-dtype`): half the bytes, so twice the tokens a budget
    # holds and half the memory a long context's decode reads; rounded once as written, widened
    # as read, so every path attends the same values.
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def dtype_size(self) -> int:
        return self.dtype.itemsize

    @property
    def attention_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def read_bytes_per_block(self) -> int:
        """K and V of one block of one layer: what `PagedKVCache.read_blocks` copies per id."""
        return self.bytes_per_block // self.num_layers

    def num_blocks_for_budget(self, budget_bytes: int | str) -> int:
        """How many whole blocks fit in ``budget_bytes`` (0 when not even one does)."""
        return parse_bytes(budget_bytes) // self.bytes_per_block

    @classmethod
    def from_model_config(cls, config: Any, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
        """Shape of a transformers decoder config (Llama/Qwen2/Qwen3/Mistral field names)."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            dtype=dtype,
            block_size=block_size,
        )


class PagedKVCache:
    """Preallocated K/V blocks for every layer; ``key_cache[l]``/``value_cache[l]`` are views of
    shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` into one tensor."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device | str = "cpu",
        decode_kernel: str | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        # The kernel decode tokens attend through in place, not via read_blocks: "triton"
        # (engine/attention/triton_decode.py), "native" (the C++ CPU kernel), None: gathered.
        self.decode_kernel = decode_kernel
        self.device = torch.device(device)
        # [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]; zeros so that reads of
        # padding slots (always masked out) never see NaN/Inf garbage.
        self._storage = torch.zeros(
            (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=self.device,
        )
        self.key_cache = [self._storage[i, 0] for i in range(spec.num_layers)]
        self.value_cache = [self._storage[i, 1] for i in range(spec.num_layers)]
        # Flat views of each layer, [num_slots, kv_heads, head_dim], for writes by slot.
        shape = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.key_slots = [k.view(shape) for k in self.key_cache]
        self.value_slots = [v.view(shape) for v in self.value_cache]
        # What read_blocks copies into; grows to the largest read so far (at most about one
        # layer's pool: a step reads each running sequence's blocks, padded within a group),
        # unless reserved at a fixed size.
        self._workspace = torch.empty(0, dtype=spec.dtype, device=self.device)
        self._workspace_fixed = False

    @classmethod
    def from_budget(
        cls, spec: KVCacheSpec, budget_bytes: int | str, device: torch.device | str = "cpu"
    ) -> PagedKVCache:
        num_blocks = spec.num_blocks_for_budget(budget_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"KV budget {parse_bytes(budget_bytes)} B is below one block "
                f"({spec.bytes_per_block} B = {spec.block_size} tokens)"
            )
        return cls(spec, num_blocks, device)

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store K/V ``[T, kv_heads, head_dim]`` of T tokens at ``slots`` ``[T]`` of `layer`."""
        self.key_slots[layer].index_copy_(0, slots, to_pool(key, self.spec.dtype))
        self.value_slots[layer].index_copy_(0, slots, to_pool(value, self.spec.dtype))

    def as_read(self, fresh: torch.Tensor) -> torch.Tensor:
        """This step's own K or V as attention reads them back from the pool: rounded to the
        pool's dtype, in the attention's (for a chunk that attends its fresh K/V directly)."""
        spec = self.spec
        if spec.dtype != spec.attention_dtype:
            fresh = to_pool(fresh, spec.dtype)
        return fresh.to(spec.attention_dtype)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at block ids ``blocks`` ``[n]``, each ``[n, block_size, kv_heads,
        head_dim]`` in the pool's dtype: views of the workspace, valid until the next read."""
        shape = (blocks.numel(), *self.key_cache[layer].shape[1:])
        size = blocks.numel() * self.key_cache[layer][0].numel()
        workspace = self._workspace
        if workspace.numel() < 2 * size:
            if self._workspace_fixed:  # a larger read than reserved: this read's own buffer
                workspace = torch.empty(2 * size, dtype=self.spec.dtype, device=self.device)
            else:
                grown = max(2 * size, 3 * workspace.numel() // 2)  # amortize slow growth
                workspace = self._workspace = torch.empty(
                    grown, dtype=self.spec.dtype, device=self.device
                )
        k, v = workspace[:size].view(shape), workspace[size : 2 * size].view(shape)
        torch.index_select(self.key_cache[layer], 0, blocks, out=k)
        torch.index_select(self.value_cache[layer], 0, blocks, out=v)
        return k, v

    def reserve_workspace(self, num_bytes: int) -> None:
        """Give the read workspace `num_bytes` now and never replace it: a captured CUDA graph
        reads through its address, and a grown workspace would free the memory it writes."""
        numel = -(-num_bytes // self.spec.dtype_size)
        if self._workspace_fixed:
            if self._workspace.numel() < numel:
                raise ValueError(f"the workspace is fixed at {self._workspace.numel()} elements")
            return
        if self._workspace.numel() < numel:
            self._workspace = torch.empty(numel, dtype=self.spec.dtype, device=self.device)
        self._workspace_fixed = True

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def pool(self) -> torch.Tensor:
        """Every layer's K and V in one tensor, ``[layers, 2, blocks, block_size, kv_heads, d]``
        (for a kernel that walks all the layers itself)."""
        return self._storage

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def allocated_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()
