"""How a benchmark result was made, as its JSON records it: the command, free of this machine's
paths so a committed result reads the same on any checkout, and the load it ran under.

Standard library only: `jitney bench` imports it for every bench subcommand.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The traces live beside the repository; the benches' default trace is `../shared/traces/...`.
SHARED_TRACES = REPO_ROOT.parent / "shared" / "traces"


def recorded_command(argv: Sequence[str] | None = None, cwd: str | Path | None = None) -> str:
    """`argv` (default: sys.argv) as one would type it at the repository root, shell-quoted:
    the program as `jitney`; paths inside the repository relative to its root; paths under the
    shared traces folder as `../shared/traces/...`; any other path absolute. A word counts as a
    path when it has a `/` and is not a URL (a bare file name is kept as typed)."""
    argv = sys.argv if argv is None else argv
    base = Path.cwd() if cwd is None else Path(cwd)
    return shlex.join(["jitney", *(_portable(word, base) for word in argv[1:])])


def _portable(word: str, base: Path) -> str:
    if word.startswith("--") and "=" in word:
        flag, _, value = word.partition("=")
        return f"{flag}={_portable(value, base)}"
    if "/" not in word or "://" in word:
        return word
    # normpath, not resolve(): lexical, so a symlinked folder keeps the name it was given.
    path = Path(os.path.normpath(base / word))
    if path.is_relative_to(REPO_ROOT):
        return str(path.relative_to(REPO_ROOT))
    if path.is_relative_to(SHARED_TRACES):
        return os.path.relpath(path, REPO_ROOT)
    return str(path)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (a busy machine skews every timing)."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), which every timing table names beside it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
