"""CPU kernels for weights kept in GGUF's 4- and 8-bit blocks (float32 activations, exact).

    w = Q4_1Weights.from_gguf_blocks(tensor.data, (n, k))   # packs; builds the C++ kernels once
    y = w.linear(x)                                         # x float32 [..., k] -> [..., n]
    kernel_backend()                                        # "native" or "reference", and why

The ops (`torch.ops.jitney.*`, opaque to torch.compile) are in ops.py, their pure-torch
definition in reference.py, the C++ in csrc/quant_linear.cpp, its build and cache in build.py.
"""

from engine.kernels.build import KernelBackend
from engine.kernels.ops import kernel_backend
from engine.kernels.packed_weights import Q4_1Weights, Q8_0Weights

__all__ = ["KernelBackend", "Q4_1Weights", "Q8_0Weights", "kernel_backend"]
