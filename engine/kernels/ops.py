"""The jitney:: ops: schemas, shapes for tracing, and which implementation runs them.

Each op is defined here once. Its pure-torch reference is registered for every device
(CompositeExplicitAutograd); the C++ library, when `ensure_backend()` manages to load it, adds a
CPU kernel, which the dispatcher prefers. The fake implementations give torch.compile the output
shapes, so the ops stay opaque (one node each) in a compiled graph. `panel_min_tokens` is the
token count from which a linear dequantizes panels of rows for sgemm instead of running the fused
kernel (engine/kernels/packed_weights.py holds the measured defaults).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import reference
from engine.kernels.build import KernelBackend, load_native

# name -> arguments; every op returns one new float32 tensor.
SCHEMAS = {
    "q4_1_linear": "Tensor x, Tensor qs, Tensor d, Tensor m, int panel_min_tokens",
    "q8_0_linear": "Tensor x, Tensor qs, Tensor d, int panel_min_tokens",
    "q8_0_embedding": "Tensor ids, Tensor qs, Tensor d",
}

# FRAGMENT: other modules may add their own jitney:: ops.
_LIB = torch.library.Library("jitney", "FRAGMENT")
for _name, _args in SCHEMAS.items():
    _LIB.define(f"{_name}({_args}) -> Tensor")
    _LIB.impl(_name, getattr(reference, _name), "CompositeExplicitAutograd")


@torch.library.register_fake("jitney::q4_1_linear")
def _q4_1_linear_fake(x, qs, d, m, panel_min_tokens):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("jitney::q8_0_linear")
def _q8_0_linear_fake(x, qs, d, panel_min_tokens):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("jitney::q8_0_embedding")
def _q8_0_embedding_fake(ids, qs, d):
    return d.new_empty(*ids.shape, qs.shape[1])


@functools.cache
def kernel_backend() -> KernelBackend:
    """Load (building on first use) the C++ kernels once per process, and say which path serves
    the ops and why. Packing weights calls it, so a forward never builds."""
    return load_native()
