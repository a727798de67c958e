"""engine/heap.py: freed C heap handed back to the system."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.heap import _malloc_trim

# Run in a fresh interpreter: what a process's heap holds depends on everything it ran before
# (a test worker's earlier tests could leave the chunks below landing in holes already resident).
_PROBE = """
from engine.heap import return_freed_heap

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

# 1,600 chunks of 100 KiB (under glibc's mmap threshold: on the heap), written so that they
# are resident, each followed by a small live one: once they are freed, the holes between stay
# in the process (free() gives back only the heap's top).
chunks, pins = [], []
for _ in range(1600):
    chunks.append(bytearray(b"x" * (100 * 1024)))
    pins.append(bytearray(b"y" * 1024))
del chunks
before = rss_kib()
return_freed_heap()
assert all(p[0] == ord("y") for p in pins)
print(before - rss_kib())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc only"
)
def test_freed_heap_goes_back_to_the_system() -> None:
    repo = Path(__file__).resolve().parents[2]
    probe = [sys.executable, "-c", _PROBE]
    out = subprocess.run(probe, capture_output=True, text=True, check=True, cwd=repo)
    assert int(out.stdout.split()[-1]) > 100 * 1024  # most of the 160 MiB, in KiB
