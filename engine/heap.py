"""Freed heap handed back to the system.

glibc keeps the memory a process frees for its own later allocations, and the resident set
keeps counting it. A large tokenizer's construction is the case here: the `tokenizers` library
parses Gemma 3's 262,144 tokens and 514,906 merges through about 270 MiB of temporaries, freed
once it is built, yet the process stayed that much larger for its whole life (measured in
docs/notes/startup.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "malloc_trim", None)


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (malloc_trim(0)); nothing where the C
    library cannot."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
