"""The bytes Jitney keeps for a GGUF file's weights under `--quantization auto`, against the file.

`python -m bench.resident_weights FILE.gguf`

Every tensor as the default forward keeps it: covered block types packed (engine/kernels), the
rest dense float32 (norms, and any matrix of a type no kernel covers). Fused projections and a
tied LM head change nothing here: parts keep their own bytes, and a tied head is the table.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gguf import GGMLQuantizationType

from engine.kernels import BlockWeights
from engine.layers.quantized import COVERED_KINDS
from engine.models.gguf_index import read_gguf_index


def resident_bytes(path: Path) -> tuple[int, int]:
    """(packed bytes, dense float32 bytes) of the file's tensors."""
    blocks = dense = 0
    for t in read_gguf_index(path).tensors:
        kind = GGMLQuantizationType(t.qtype).name
        if kind in COVERED_KINDS and len(t.dims) == 2:
            blocks += BlockWeights.from_gguf(kind, t.data, (t.dims[1], t.dims[0])).nbytes
        else:
            dense += 4 * math.prod(t.dims)
    return blocks, dense


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    args = p.parse_args()
    blocks, dense = resident_bytes(args.file)
    size = args.file.stat().st_size
    total = blocks + dense
    print(
        f"resident weights: {total / 1e6:.1f} MB ({blocks / 1e6:.1f} MB in blocks, "
        f"{dense / 1e6:.1f} MB dense) for a {size / 1e6:.1f} MB file: {total / size:.3f}x"
    )


if __name__ == "__main__":
    main()
