"""engine/huge_pages.py: weight buffers in 2 MiB pages."""

from __future__ import annotations

import itertools

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


def _huge_kib_of_mapping_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                start, end = (int(a, 16) for a in first.split("-"))
                inside = start <= address < end
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_small_buffers_are_carved_apart_on_cache_lines_and_hold_their_values() -> None:
    bufs = [huge_page_empty(n) for n in (1000, 1, 70_000, 4096)]
    for i, buf in enumerate(bufs):
        assert buf.dtype == torch.uint8 and buf.is_contiguous()
        buf.fill_(i + 1)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert [int(b.min()) for b in bufs] == [1, 2, 3, 4] == [int(b.max()) for b in bufs]
    if huge_pages_available():
        assert all(b.data_ptr() % 64 == 0 for b in bufs)


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_small_packed_matrices_live_in_huge_pages() -> None:
    # SmolLM2's matrices are each under 2 MiB: in 4 KiB pages they streamed at half the rate
    # of big ones (docs/notes/block-types.md).
    packed = [BlockWeights.quantize_q8_0(torch.randn(576, 576)) for _ in range(8)]
    assert all(0 < p.nbytes < HUGE_PAGE for p in packed)
    assert _huge_kib_of_mapping_at(packed[-1].blocks.data_ptr()) >= HUGE_PAGE // 1024


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_packed_weights_start_on_a_huge_page_and_hold_their_values() -> None:
    w = torch.randn(2048, 1024)
    packed = BlockWeights.quantize_q8_0(w)
    assert packed.nbytes >= HUGE_PAGE and packed.blocks.data_ptr() % HUGE_PAGE == 0
    assert torch.allclose(packed.dequantize(), w, atol=float(w.abs().max()) / 127)
