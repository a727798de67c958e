"""The C++ kernels, JIT-built on first use and cached on disk, or the reason they are not in use.

The library is built once per source hash (sources + flags + torch + Python version) into
`$JITNEY_CACHE_DIR/kernels/<hash>/` (default `~/.cache/jitney/kernels/<hash>/`); later processes
only load it. Two processes starting together are safe: the build runs under an exclusive
`flock` (released by the kernel if its holder dies, unlike a lock file), in a private temporary
directory, and the finished library is moved into place with one atomic rename.

Where the build is impossible (not x86-64, no AVX2, no compiler or ninja, a failed build) or
`JITNEY_KERNELS=reference` is set, nothing is built and the ops keep their pure-torch reference
implementation (engine/kernels/reference.py); `kernel_backend()` says which and why.

One library serves every x86-64 CPU: the AVX-512 and AMX kernels are compiled beside the AVX2
ones (under a target pragma) and the library picks the highest instruction set the CPU has when
it loads (csrc/cpu_isa.cpp). `JITNEY_KERNEL_ISA=avx2|avx2-int16|avx512|vnni|amx` caps it;
`set_isa()` changes the cap in a running process (the tests run every path a machine has).
`JITNEY_ACTIVATION_DIGITS=1` (or `set_activation_digits(1)`, the engine's `--activation-digits`)
gives the integer one passes one int8 digit per activation instead of two (csrc/quant_vnni.cpp).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ACTIVATION_DIGITS

LIBRARY_NAME = "jitney_quant_kernels"
CSRC = Path(__file__).parent / "csrc"
_SOURCE_NAMES = (
    "cpu_isa",
    "quant_linear",
    "quant_avx512",
    "quant_vnni",
    "quant_avx2_int",
    "layer_ops",
    "attention_avx2",
    "attention_avx512",
    "decode_layers",
    "lora_add",
    "sampling",
)
SOURCES = tuple(CSRC / f"{name}.cpp" for name in _SOURCE_NAMES)
ISAS = ("avx2", "avx2-int16", "avx512", "vnni", "amx")  # csrc/blocks.h's Isa, in order
# The levels whose one pass rounds activations to int8 digits (two by default, or one).
INTEGER_ISAS = ("avx2-int16", "vnni", "amx")
# The tokens one pass over the weights serves at each level (its token tile: quant_linear.cpp,
# quant_avx2_int.cpp's kInt16Tile, quant_avx512.cpp, quant_vnni.cpp; amx's one pass is vnni's).
# One more token starts a second pass, which costs about a step at one token on an AVX2 CPU.
ONE_PASS_TOKENS = {"avx2": 4, "avx2-int16": 6, "avx512": 8, "vnni": 8, "amx": 8}
# What one more row costs within that pass, as a share of a one-row step of the bundled model:
# where speculation's price for a row starts, before the engine has measured its own steps
# (scheduler/speculation/row_cost.py; the same level costs 0.22 on a Zen 4's vnni). Measured
# in `jitney bench offline`'s steps by drafts verified (docs/notes/speculation.md): AMX Xeon 0.11
# (7 drafts 15.96 ms against 9.03), Zen 3 avx2-int16 0.22; avx2 and avx512 from their kernels'
# rows (2.5x and 1.5x one row's linears for 8).
DRAFT_ROW_COST = {"avx2": 0.25, "avx2-int16": 0.22, "avx512": 0.1, "vnni": 0.11, "amx": 0.11}
# Included by the sources: part of the hash too.
HEADERS = tuple(
    CSRC / h
    for h in ("blocks.h", "ops.h", "vec_avx2.h", "attention.h", "scales_avx2.h", "scales_avx512.h")
)
# -fopenmp: at::parallel_for is inline OpenMP; compiled without it, it runs on one thread. The
# library then shares torch's own libgomp (same soname, already loaded), so one thread pool.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
LDFLAGS = ("-fopenmp",)
logger = logging.getLogger("jitney.engine.kernels")
KERNELS_ENV = "JITNEY_KERNELS"  # "reference" forces the pure-torch path
CACHE_ENV = "JITNEY_CACHE_DIR"


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """Which implementation serves the jitney:: ops in this process."""

    name: str  # "native" (the C++ library) or "reference" (pure torch)
    reason: str  # why this one: "built in 41.2 s", "loaded from cache", "no AVX2 ..."
    library_path: Path | None = None

    @property
    def is_native(self) -> bool:
        return self.name == "native"

    @property
    def best_isa(self) -> str | None:
        """The highest instruction set this CPU gives the kernels (None: the reference)."""
        return ISAS[self._library().jitney_best_isa()] if self.is_native else None

    @property
    def isa(self) -> str | None:
        """The instruction set the kernels use now (None: the reference)."""
        return ISAS[self._library().jitney_active_isa()] if self.is_native else None

    def available_isas(self) -> tuple[str, ...]:
        """Every instruction set this CPU gives the kernels, lowest first (none: the reference)."""
        best = self.best_isa
        return () if best is None else ISAS[: ISAS.index(best) + 1]

    def set_isa(self, isa: str) -> str | None:
        """Use at most `isa` (never more than the CPU has); returns the one now in use."""
        if not self.is_native:
            return None
        return ISAS[self._library().jitney_set_isa(ISAS.index(isa))]

    @property
    def activation_digits(self) -> int | None:
        """The int8 digits the integer one passes give an activation (None: the reference)."""
        return self._library().jitney_activation_digits() if self.is_native else None

    def set_activation_digits(self, digits: int) -> int | None:
        """1 or 2 digits per activation from now on, process-wide; returns those in use."""
        if digits not in ACTIVATION_DIGITS:
            raise ValueError(f"activation digits must be one of {ACTIVATION_DIGITS}, got {digits}")
        if not self.is_native:
            return None
        return self._library().jitney_set_activation_digits(digits)

    def _library(self) -> ctypes.CDLL:
        # The same shared object torch loaded (dlopen returns the loaded handle).
        return ctypes.CDLL(str(self.library_path))


def kernels_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "jitney"
    return base / "kernels"


def source_hash() -> str:
    """What the built library depends on; a change to any of it builds a new one."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    key = (CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2], platform.machine())
    h.update(repr(key).encode())
    return h.hexdigest()[:16]


def unavailable_reason(to_build: bool = True) -> str | None:
    """Why the C++ kernels cannot be built (or, `to_build` False, a built library cannot be
    loaded) here, or None when they can."""
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "reference":
        return f"{KERNELS_ENV}=reference is set"
    if not sys.platform.startswith("linux"):  # the flags are gcc's, the lock is flock
        return f"the C++ kernels are built on Linux only, not {sys.platform}"
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"the CPU is {platform.machine()}, not x86-64"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in {"AVX2", "AVX512"}:
        return f"the CPU has no AVX2 (torch reports {capability})"
    if not to_build:  # a cached library needs no compiler: nor setuptools' import (0.14 s)
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def load_native() -> KernelBackend:
    """Build (once per source hash) and load the C++ library; the reference on any failure."""
    target_dir = kernels_cache_dir() / source_hash()
    library = target_dir / f"{LIBRARY_NAME}.so"
    reason = unavailable_reason(to_build=not library.exists())
    if reason is not None:
        return KernelBackend("reference", reason)
    import fcntl  # Linux only, like the build (checked above)

    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        with (target_dir / "build.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if library.exists():
                how = "loaded from cache"
            else:
                logger.info("building Jitney's CPU kernels once, into %s", target_dir)
                how = f"built in {_build_into(library):.1f} s"
                logger.info("CPU kernels %s", how)
                return KernelBackend("native", how, library)  # the build already loaded it
        torch.ops.load_library(str(library))
    except Exception as exc:  # a failed build must leave the engine running, on the reference
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        error = next((ln.strip() for ln in lines if "error:" in ln), lines[0])[:200]
        log = target_dir / "build.log"
        where = f"; log in {log}" if log.exists() else ""
        reason = f"the C++ kernels failed to build or load: {error}{where}"
        logger.warning("%s (the pure-torch reference runs instead)", reason)
        return KernelBackend("reference", reason)
    return KernelBackend("native", how, library)


def _build_into(library: Path) -> float:
    """Compile in a private directory (which also loads the result) and move the library into
    place atomically; returns the seconds the build took. The full log is left beside it."""
    from torch.utils import cpp_extension

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=library.parent, prefix="build-") as tmp:
        try:
            built = cpp_extension.load(
                name=LIBRARY_NAME,
                sources=[str(s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=tmp,
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:
            (library.parent / "build.log").write_text(str(exc))
            raise
        os.replace(built, library)
    return time.perf_counter() - start
