"""engine/heap.py: freed C heap handed back to the system."""

from __future__ import annotations

import sys

import pytest

from engine.heap import _malloc_trim, return_freed_heap


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only"
)
def test_freed_heap_goes_back_to_the_system() -> None:
    # 1,600 chunks of 100 KiB (under glibc's mmap threshold: on the heap), written so that
    # they are resident, each followed by a small live one: once they are freed, the holes
    # between stay in the process (free() gives back only the heap's top).
    chunks, pins = [], []
    for _ in range(1600):
        chunks.append(bytearray(b"x" * (100 * 1024)))
        pins.append(bytearray(b"y" * 1024))
    del chunks
    before = _rss_kib()
    return_freed_heap()
    assert before - _rss_kib() > 100 * 1024  # most of the 160 MiB
    assert all(p[0] == ord("y") for p in pins)
