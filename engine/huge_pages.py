"""Buffers backed by 2 MiB pages, for the weights a decode step streams through.

A decode step reads every weight once, front to back; on a memory-bound model (a 1B model in
Q4_K_M reads 700 MB a token) the 4 KiB pages cost a TLB miss each 4 KiB and stop the hardware
prefetchers at each page's end. Linux's transparent huge pages, in their usual `madvise` mode,
back only memory that asked for them. A buffer here is a fresh anonymous mapping, advised
before anything touches it, so its first writes fault in whole 2 MiB pages; copying into huge
pages afterwards (MADV_COLLAPSE) took 1.5 s for 700 MB. Only the buffer's whole 2 MiB pages are
advised: a partly used last page would count 2 MiB resident. Measured in docs/notes/block-types.md.
"""

from __future__ import annotations

import mmap
from functools import cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@cache
def huge_pages_available() -> bool:
    """Whether the kernel gives huge pages to memory that asks (THP not `never`, Linux only)."""
    try:
        setting = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in setting and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes` whose whole 2 MiB pages are huge pages where
    the kernel can; a plain torch.empty below 2 MiB or where it cannot."""
    if nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    skip = -base.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE_PAGE * HUGE_PAGE)
    return base[skip : skip + nbytes]
