"""llama.cpp as a peer in a benchmark: its `llama-batched-bench` (offline, one prompt and its
generation) and its `llama-server` (the OpenAI API, loaded by bench/serve.py like Jitney's
gateway), run from a directory of its binaries (../shared/tools/build_llama_cpp.sh builds them).
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from launch.private_redis import die_with_parent

BATCHED_BENCH, SERVER = "llama-batched-bench", "llama-server"


class LlamaCppError(RuntimeError):
    """llama.cpp could not run as asked (a missing binary, a failed run, no table)."""


def missing_binaries(bin_dir: str | Path, names: list[str]) -> list[str]:
    return [n for n in names if not os.access(Path(bin_dir) / n, os.X_OK)]


@dataclass(frozen=True, slots=True)
class BatchedBenchRow:
    """One row of llama-batched-bench's table: PP prompt tokens, TG generated, T seconds in all
    (prompt and generation), T_TG seconds of generation."""

    prompt_tokens: int
    generated_tokens: int
    total_s: float
    generation_s: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the whole request's time, as Jitney's offline tokens/s."""
        return self.generated_tokens / self.total_s

    @property
    def generation_tokens_per_s(self) -> float:
        return self.generated_tokens / self.generation_s


def batched_bench(
    bin_dir: str | Path, gguf: str | Path, prompt_len: int, gen_len: int, threads: int
) -> BatchedBenchRow:
    """One user: a prompt of `prompt_len` tokens, then `gen_len` generated, on `threads`."""
    argv = [str(Path(bin_dir) / BATCHED_BENCH), "-m", str(gguf), "-c", str(prompt_len + gen_len)]
    argv += ["-npp", str(prompt_len), "-ntg", str(gen_len), "-npl", "1", "-t", str(threads)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise LlamaCppError(f"{BATCHED_BENCH} exited {result.returncode}: {result.stderr[-500:]}")
    return parse_batched_bench(result.stdout + result.stderr)


def parse_batched_bench(text: str) -> BatchedBenchRow:
    """The first data row of the markdown table llama-batched-bench prints, read by its header
    (`| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |`)."""
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "PP" in cells and "TG" in cells:
            header = cells
        elif header and cells and cells[0].isdigit():
            row = dict(zip(header, cells, strict=False))
            return BatchedBenchRow(
                int(row["PP"]), int(row["TG"]), float(row["T s"]), float(row["T_TG s"])
            )
    raise LlamaCppError(f"no result table in {BATCHED_BENCH}'s output: {text[-500:]!r}")


@contextmanager
def llama_server(
    bin_dir: str | Path,
    gguf: str | Path,
    threads: int,
    parallel: int,
    context: int,
    port: int,
    log_path: str | Path,
) -> Iterator[str]:
    """`llama-server` on 127.0.0.1:`port` with `parallel` slots sharing `context` positions;
    yields its base URL once /health answers, stops it on exit."""
    argv = [str(Path(bin_dir) / SERVER), "-m", str(gguf), "-c", str(context)]
    argv += ["--parallel", str(parallel), "-t", str(threads), "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent()
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace")[-1000:]
                raise LlamaCppError(f"{SERVER} exited {proc.returncode} at start:\n{tail}")
            if time.monotonic() > deadline:
                raise LlamaCppError(f"{SERVER} not healthy after 300 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
