"""The C++ kernels, JIT-built on first use and cached on disk, or the reason they are not in use.

The library is built once per source hash (sources + flags + torch + Python version) into
`$JITNEY_CACHE_DIR/kernels/<hash>/` (default `~/.cache/jitney/kernels/<hash>/`); later processes
only load it. Two processes starting together are safe: the build runs under an exclusive
`flock` (released by the kernel if its holder dies, unlike a lock file), in a private temporary
directory, and the finished library is moved into place with one atomic rename.

Where the build is impossible (not x86-64, no AVX2, no compiler or ninja, a failed build) or
`JITNEY_KERNELS=reference` is set, nothing is built and the ops keep their pure-torch reference
implementation (engine/kernels/reference.py); `kernel_backend()` says which and why.
"""

from __future__ import annotations

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

LIBRARY_NAME = "jitney_quant_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / f for f in ("quant_linear.cpp", "layer_ops.cpp", "decode_layers.cpp"))
HEADERS = (CSRC / "blocks.h", CSRC / "ops.h")  # included: part of the hash too
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

    name: str  # "avx2" (the C++ library) or "reference" (pure torch)
    reason: str  # why this one: "built in 41.2 s", "loaded from cache", "no AVX2 ..."
    library_path: Path | None = None

    @property
    def is_native(self) -> bool:
        return self.name == "avx2"


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


def unavailable_reason() -> str | None:
    """Why the C++ kernels cannot be built here, or None when they can."""
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "reference":
        return f"{KERNELS_ENV}=reference is set"
    if not sys.platform.startswith("linux"):  # the flags are gcc's, the lock is flock
        return f"the C++ kernels are built on Linux only, not {sys.platform}"
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"the CPU is {platform.machine()}, not x86-64"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in {"AVX2", "AVX512"}:
        return f"the CPU has no AVX2 (torch reports {capability})"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def load_native() -> KernelBackend:
    """Build (once per source hash) and load the C++ library; the reference on any failure."""
    reason = unavailable_reason()
    if reason is not None:
        return KernelBackend("reference", reason)
    import fcntl  # Linux only, like the build (checked above)

    target_dir = kernels_cache_dir() / source_hash()
    library = target_dir / f"{LIBRARY_NAME}.so"
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
                return KernelBackend("avx2", how, library)  # the build already loaded it
        torch.ops.load_library(str(library))
    except Exception as exc:  # a failed build must leave the engine running, on the reference
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        error = next((ln.strip() for ln in lines if "error:" in ln), lines[0])[:200]
        log = target_dir / "build.log"
        where = f"; log in {log}" if log.exists() else ""
        reason = f"the C++ kernels failed to build or load: {error}{where}"
        logger.warning("%s (the pure-torch reference runs instead)", reason)
        return KernelBackend("reference", reason)
    return KernelBackend("avx2", how, library)


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
