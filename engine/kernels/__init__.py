"""CPU kernels for weights kept in GGUF's blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
(block_types.py describes each as data; float32 activations).

    w = BlockWeights.from_gguf("Q4_K", tensor.data, (n, k))  # packs; builds the C++ kernels once
    y = w.linear(x)                                          # x float32 [..., k] -> [..., n]
    kernel_backend()                                         # "native" or "reference", and why

The ops (`torch.ops.jitney.*`, opaque to torch.compile) are in ops.py, their pure-torch
definition in reference.py, the C++ in csrc/quant_linear.cpp, its build and cache in build.py.
"""

from engine.kernels.build import KernelBackend
from engine.kernels.ops import kernel_backend
from engine.kernels.packed_weights import BlockWeights, linear_parts

__all__ = ["BlockWeights", "KernelBackend", "kernel_backend", "linear_parts"]
