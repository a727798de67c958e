"""One decoder layer of Jitney's Llama-family forward (engine/models/llama.py): its shape, the
plain torch ops of its two halves around the attention (eager, or compiled by `--compile`), and
the layer module holding its projections (engine/layers/) and norms.

RMSNorm and the rotary embedding are computed as transformers computes them, so the plain path
is the reference's rounding bit for bit; the fused path's per-layer steps (jitney:: ops) are
LlamaLayer.attention_fused and mlp_fused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.paged_attention import attend, paged_attention_forward
from engine.attention.step_inputs import AttentionMetadata
from engine.kv_cache import PagedKVCache
from engine.models.weight_sources import WeightSource


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """What the forward needs to know of a checkpoint's architecture."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by each token's angles: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the statistics in float32, the weight applied in the input's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True, slots=True)
class _AttentionSite:
    """What the shared paged attention function reads of the layer calling it."""

    layer_idx: int
    sliding_window: int | None


def attention_inputs(
    layer: LlamaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's input norm, QKV projection, (Qwen3) per-head norms and rotary embeddings:
    Q, K [T, heads, d] rotated, V [T, kv heads, d]."""
    s = layer.shape
    num_tokens = x.shape[0]
    h = rms_norm(x, layer.input_norm, s.rms_norm_eps)
    q, k, v = layer.qkv(h).split(s.qkv_sizes, dim=-1)
    q = q.view(num_tokens, s.num_heads, s.head_dim)
    k = k.view(num_tokens, s.num_kv_heads, s.head_dim)
    v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:
        q = rms_norm(q, layer.q_norm, s.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, s.rms_norm_eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def after_attention(layer: LlamaLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """A layer's output projection, residual add, post norm, SwiGLU MLP and residual add."""
    x = x + layer.o(attn)
    h = rms_norm(x, layer.post_norm, layer.shape.rms_norm_eps)
    gate, up = layer.gate_up(h).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up)


@dataclass(frozen=True, slots=True)
class LayerSteps:
    """The two halves of a layer around its attention: eager, or compiled by torch.compile
    (`--compile`: one graph for every layer, since modules are inlined and their parameters
    are the graph's inputs; dynamic in the number of tokens, so batch sizes do not recompile)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    after_attention: Callable[..., torch.Tensor]


EAGER_STEPS = LayerSteps(attention_inputs, after_attention)


def compiled_steps() -> LayerSteps:
    """torch.compile'd layer halves; inductor's generated code is cached on disk under
    `$JITNEY_CACHE_DIR/inductor` (default ~/.cache/jitney/inductor), so only a machine's first
    start pays the compile."""
    root = os.environ.get("JITNEY_CACHE_DIR") or str(Path.home() / ".cache" / "jitney")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(root) / "inductor"))
    return LayerSteps(
        torch.compile(attention_inputs, dynamic=True, fullgraph=True),
        torch.compile(after_attention, dynamic=True, fullgraph=True),
    )


class LlamaLayer(nn.Module):
    def __init__(self, shape: LlamaShape, index: int, weights: WeightSource, prefix: str):
        super().__init__()
        self.shape = shape
        self.site = _AttentionSite(index, shape.windows[index])
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        self.qkv = weights.linear([f"{attn}{p}_proj" for p in "qkv"])
        self.o = weights.linear([f"{attn}o_proj"])
        self.gate_up = weights.linear([f"{mlp}gate_proj", f"{mlp}up_proj"])
        self.down = weights.linear([f"{mlp}down_proj"])
        self.input_norm = nn.Parameter(weights.vector(f"{prefix}input_layernorm.weight"), False)
        self.post_norm = nn.Parameter(
            weights.vector(f"{prefix}post_attention_layernorm.weight"), False
        )
        # Qwen3: an RMSNorm over each head of Q and K.
        q_norm, k_norm = (weights.optional_vector(f"{attn}{p}_norm.weight") for p in "qk")
        self.q_norm = None if q_norm is None else nn.Parameter(q_norm, False)
        self.k_norm = None if k_norm is None else nn.Parameter(k_norm, False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], updated in place
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        steps: LayerSteps | None = None,
    ) -> torch.Tensor:
        """The layer in plain torch ops; `steps` (LlamaForward's) may be compiled versions of
        the two halves around the attention."""
        s, steps = self.shape, steps or EAGER_STEPS
        num_tokens = x.shape[0]
        q, k, v = steps.attention_inputs(self, x, cos, sin)
        # The shared attention takes transformers' [1, heads, T, d] layout: views, no copies.
        out, _ = paged_attention_forward(
            self.site,  # type: ignore[arg-type]
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            None,
            s.head_dim**-0.5,
            attn_metadata=meta,
            kv_cache=kv_cache,
            sliding_window=self.site.sliding_window,
        )
        return steps.after_attention(self, x, out.view(num_tokens, s.num_heads * s.head_dim))

    def attention_fused(
        self,
        h: torch.Tensor,  # [T, hidden], the normed residual
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """The attention block through the jitney:: ops: its output projection, [T, hidden]."""
        s, layer = self.shape, self.site.layer_idx
        num_tokens = h.shape[0]
        qkv = self.qkv(h)
        qk = torch.ops.jitney.rope_write_kv_(
            qkv,
            cos,
            sin,
            meta.slot_mapping,
            kv_cache.key_slots[layer],
            kv_cache.value_slots[layer],
            s.num_heads,
            s.num_kv_heads,
            self.q_norm,
            self.k_norm,
            s.rms_norm_eps,
        )
        v = qkv.view(num_tokens, -1, s.head_dim)[:, s.num_heads + s.num_kv_heads :]
        out = attend(
            meta,
            kv_cache,
            layer,
            qk[:, : s.num_heads],
            qk[:, s.num_heads :],
            v,
            s.head_dim**-0.5,
            self.site.sliding_window,
        )
        return self.o(out.view(num_tokens, s.num_heads * s.head_dim))

    def mlp_fused(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.ops.jitney.silu_mul(self.gate_up(h)))
