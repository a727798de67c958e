"""One decoder layer of Jitney's Llama-family forward (engine/models/llama.py): its shape, the
plain torch ops of its two halves around the attention (eager, or compiled by `--compile`), and
the layer module holding its projections (engine/layers/) and norms.

RMSNorm and the rotary embedding are computed as transformers computes them, so the plain path
is the reference's rounding bit for bit; the fused path's per-layer steps (jitney:: ops) are
LlamaLayer.attention_fused and mlp_fused. What a family changes (Gemma's four norms and GeGLU,
Phi's partial rotation, SmolLM3's layers without RoPE) is read from the shape's switches
(engine/models/families.py) and the rotary table a layer is given (engine/models/rotary.py).
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
from engine.lora.step_rows import StepAdapters
from engine.models.families import FamilySwitches
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
    rope_tables: tuple[int, ...]  # per layer: the rotary table it reads (engine/models/rotary.py)
    switches: FamilySwitches

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by each token's angles, x cos + rotate_half(x) sin, over the first
    `cos.shape[-1]` elements of each head (all, Phi's partial share, or none); the rest kept."""
    width = cos.shape[-1]
    if width == 0:
        return x
    if width < x.shape[-1]:
        return torch.cat((rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the statistics in float32; a weight in the input's dtype applied
    after the cast back (Llama's), a float32 weight (Gemma's 1 + w) before it. The same
    arithmetic for a float32 model."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


# The MLP's gate in plain torch (transformers' silu and gelu_pytorch_tanh).
_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True, slots=True)
class _AttentionSite:
    """What the shared paged attention function reads of the layer calling it."""

    layer_idx: int
    sliding_window: int | None


def project(
    layer: LlamaLayer, name: str, x: torch.Tensor, lora: StepAdapters | None
) -> torch.Tensor:
    """One of the layer's fused projections ("qkv", "o", "gate_up", "down") of x, with the
    step's LoRA updates added to their rows."""
    y = getattr(layer, name)(x)
    return y if lora is None else lora.add(layer.site.layer_idx, name, y, x)


def attention_inputs(
    layer: LlamaLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: StepAdapters | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's input norm, QKV projection, (Qwen3, Gemma) per-head norms and rotary
    embeddings: Q, K [T, heads, d] rotated, V [T, kv heads, d]."""
    s = layer.shape
    num_tokens = x.shape[0]
    h = rms_norm(x, layer.input_norm, s.rms_norm_eps)
    q, k, v = project(layer, "qkv", h, lora).split(s.qkv_sizes, dim=-1)
    q = q.view(num_tokens, s.num_heads, s.head_dim)
    k = k.view(num_tokens, s.num_kv_heads, s.head_dim)
    v = v.view(num_tokens, s.num_kv_heads, s.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:
        q = rms_norm(q, layer.q_norm, s.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, s.rms_norm_eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def after_attention(
    layer: LlamaLayer, x: torch.Tensor, attn: torch.Tensor, lora: StepAdapters | None = None
) -> torch.Tensor:
    """A layer's output projection, (Gemma) its output's norm, residual add, the MLP's norm, the
    gated MLP (SwiGLU or GeGLU), (Gemma) its output's norm and residual add."""
    s = layer.shape
    a = project(layer, "o", attn, lora)
    if layer.attn_out_norm is not None:
        a = rms_norm(a, layer.attn_out_norm, s.rms_norm_eps)
    x = x + a
    h = rms_norm(x, layer.post_norm, s.rms_norm_eps)
    gate, up = project(layer, "gate_up", h, lora).chunk(2, dim=-1)
    m = project(layer, "down", _GATES[s.switches.activation](gate) * up, lora)
    if layer.mlp_out_norm is not None:
        m = rms_norm(m, layer.mlp_out_norm, s.rms_norm_eps)
    return x + m


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


def norm_weight(weights: WeightSource, name: str, offset: float) -> nn.Parameter | None:
    """A norm's weight (None where the source has none); with Gemma's offset, 1 + w computed
    once in float32, the value transformers computes on every call."""
    w = weights.optional_vector(name)
    if w is None:
        return None
    return nn.Parameter(offset + w.float() if offset else w, requires_grad=False)


def _fused_or_parts(weights: WeightSource, fused: str, parts: list[str]) -> list[str]:
    """One projection's matrices: a stored fused one (Phi-3's qkv_proj and gate_up_proj), else
    its parts, which the source concatenates."""
    return [fused] if weights.has(f"{fused}.weight") else parts


class LlamaLayer(nn.Module):
    def __init__(self, shape: LlamaShape, index: int, weights: WeightSource, prefix: str):
        super().__init__()
        self.shape = shape
        self.site = _AttentionSite(index, shape.windows[index])
        self.rope = shape.rope_tables[index]
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        qkv = _fused_or_parts(weights, f"{attn}qkv_proj", [f"{attn}{p}_proj" for p in "qkv"])
        self.qkv = weights.linear(qkv)
        self.o = weights.linear([f"{attn}o_proj"])
        gate_up = _fused_or_parts(
            weights, f"{mlp}gate_up_proj", [f"{mlp}{p}_proj" for p in ("gate", "up")]
        )
        self.gate_up = weights.linear(gate_up)
        self.down = weights.linear([f"{mlp}down_proj"])
        switches = shape.switches

        def norm(name: str) -> nn.Parameter | None:
            return norm_weight(weights, f"{prefix}{name}.weight", switches.norm_offset)

        # post_norm is the MLP's input norm (Llama names it post_attention_layernorm); Gemma also
        # norms the attention's and the MLP's outputs.
        gemma = switches.output_norms
        self.input_norm = _required(norm("input_layernorm"), prefix)
        self.post_norm = _required(
            norm("pre_feedforward_layernorm" if gemma else "post_attention_layernorm"), prefix
        )
        self.attn_out_norm = norm("post_attention_layernorm") if gemma else None
        self.mlp_out_norm = norm("post_feedforward_layernorm") if gemma else None
        # Qwen3, Gemma 3: an RMSNorm over each head of Q and K.
        self.q_norm, self.k_norm = (norm(f"self_attn.{p}_norm") for p in "qk")

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], updated in place
        cos: torch.Tensor,  # [T, 1, rotated width] (engine/models/rotary.py)
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        steps: LayerSteps | None = None,
        lora: StepAdapters | None = None,
    ) -> torch.Tensor:
        """The layer in plain torch ops; `steps` (LlamaForward's) may be compiled versions of
        the two halves around the attention; `lora`: the step's adapter rows."""
        s, steps = self.shape, steps or EAGER_STEPS
        num_tokens = x.shape[0]
        q, k, v = steps.attention_inputs(self, x, cos, sin, lora)
        # The shared attention takes transformers' [1, heads, T, d] layout: views, no copies.
        out, _ = paged_attention_forward(
            self.site,  # type: ignore[arg-type]
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            None,
            s.switches.attention_scale,
            attn_metadata=meta,
            kv_cache=kv_cache,
            sliding_window=self.site.sliding_window,
        )
        attn = out.view(num_tokens, s.num_heads * s.head_dim)
        return steps.after_attention(self, x, attn, lora)

    def attention_fused(
        self,
        h: torch.Tensor,  # [T, hidden], the normed residual
        cos: torch.Tensor,  # [T, rotated width] (engine/models/rotary.py)
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        lora: StepAdapters | None = None,
    ) -> torch.Tensor:
        """The attention block through the jitney:: ops: its output projection, [T, hidden]."""
        s, layer = self.shape, self.site.layer_idx
        num_tokens = h.shape[0]
        qkv = project(self, "qkv", h, lora)
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
            s.switches.attention_scale,
            self.site.sliding_window,
        )
        o = project(self, "o", out.view(num_tokens, s.num_heads * s.head_dim), lora)
        if self.attn_out_norm is not None:
            o = torch.ops.jitney.rms_norm(o, self.attn_out_norm, s.rms_norm_eps)
        return o

    def mlp_fused(self, h: torch.Tensor, lora: StepAdapters | None = None) -> torch.Tensor:
        s, ops = self.shape, torch.ops.jitney
        gu = project(self, "gate_up", h, lora)
        act = ops.silu_mul(gu) if s.switches.activation == "silu" else ops.gelu_tanh_mul(gu)
        m = project(self, "down", act, lora)
        if self.mlp_out_norm is not None:
            m = ops.rms_norm(m, self.mlp_out_norm, s.rms_norm_eps)
        return m


def _required(weight: nn.Parameter | None, prefix: str) -> nn.Parameter:
    if weight is None:
        raise ValueError(f"{prefix}: a norm the family needs is missing from the weights")
    return weight
