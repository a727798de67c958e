"""Buffers backed by 2 MiB pages, for the weights a decode step streams through.

A decode step reads every weight once, front to back; on a memory-bound model (a 1B model in
Q4_K_M reads 700 MB a token) the 4 KiB pages cost a TLB miss each 4 KiB and stop the hardware
prefetchers at each page's end. Linux's transparent huge pages, in their usual `madvise` mode,
back only memory that asked for them. A buffer here is a fresh anonymous mapping, advised
before anything touches it, so its first writes fault in whole 2 MiB pages; copying into huge
pages afterwards (MADV_COLLAPSE) took 1.5 s for 700 MB. Only the buffer's whole 2 MiB pages are
advised: a partly used last page would count 2 MiB resident.

Buffers under 2 MiB (every matrix of a 135M model) are carved one after another out of a shared
slab of huge pages, so they too stream without page walks, and in the order they were packed.
A slab lives while any buffer in it does. Measured in docs/notes/block-types.md.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
SLAB_BYTES = 16 * HUGE_PAGE  # untouched pages of a slab are never resident
ALIGN = 64  # a cache line: where each carved buffer starts
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@cache
def huge_pages_available() -> bool:
    """Whether the kernel gives huge pages to memory that asks (THP not `never`, Linux only)."""
    try:
        setting = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in setting and hasattr(mmap, "MADV_HUGEPAGE")


def _huge_page_mapping(nbytes: int) -> torch.Tensor:
    """nbytes of a fresh private mapping starting on a 2 MiB boundary, its whole 2 MiB pages
    advised MADV_HUGEPAGE before anything touches them."""
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    skip = -base.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE_PAGE * HUGE_PAGE)
    return base[skip : skip + nbytes]


@dataclass(slots=True)
class _Slab:
    """The slab small buffers are carved from now, and where the next one starts."""

    pages: torch.Tensor
    used: int = 0

    def carve(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.pages.numel():
            return None
        self.used = start + nbytes
        return self.pages[start : self.used]


_slab: _Slab | None = None
_slab_lock = threading.Lock()  # two engines of one process may load at once


def _carve(nbytes: int) -> torch.Tensor:
    global _slab
    with _slab_lock:
        piece = _slab.carve(nbytes) if _slab is not None else None
        if piece is None:
            _slab = _Slab(_huge_page_mapping(SLAB_BYTES))
            piece = _slab.carve(nbytes)
        assert piece is not None  # nbytes < HUGE_PAGE <= SLAB_BYTES
        return piece


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes` in huge pages where the kernel can: a mapping
    of its own from 2 MiB up, a piece of a shared slab below; a plain torch.empty where the
    kernel gives no huge pages."""
    if not huge_pages_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes < HUGE_PAGE:
        return _carve(nbytes)
    return _huge_page_mapping(nbytes)
