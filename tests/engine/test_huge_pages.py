"""engine/huge_pages.py: weight buffers in 2 MiB pages."""

from __future__ import annotations

import pytest
import torch

from engine.huge_pages import HUGE_PAGE, huge_page_empty, huge_pages_available
from engine.kernels.packed_weights import BlockWeights


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_a_large_buffer_is_backed_by_huge_pages_once_written() -> None:
    before = _anon_huge_kib()
    buf = huge_page_empty(5 * HUGE_PAGE + 123)
    buf.fill_(7)
    assert buf.numel() == 5 * HUGE_PAGE + 123 and int(buf[-1]) == 7
    assert buf.data_ptr() % HUGE_PAGE == 0
    # Its five whole pages; the partial sixth stays in 4 KiB pages (no 2 MiB resident for it).
    assert _anon_huge_kib() - before >= 5 * HUGE_PAGE // 1024


def test_a_small_buffer_is_an_ordinary_tensor() -> None:
    buf = huge_page_empty(1000)
    assert buf.dtype == torch.uint8 and buf.numel() == 1000


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_packed_weights_start_on_a_huge_page_and_hold_their_values() -> None:
    w = torch.randn(2048, 1024)
    packed = BlockWeights.quantize_q8_0(w)
    assert packed.nbytes >= HUGE_PAGE and packed.blocks.data_ptr() % HUGE_PAGE == 0
    assert torch.allclose(packed.dequantize(), w, atol=float(w.abs().max()) / 127)
