"""bench/gpu_check.sh at small shapes on the CPU: the script a lent GPU runs is known to work
before a GPU sees it, from a plain copy of the repository (PYTHONPATH=., no install)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_check
from engine.kernels import kernel_backend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plain_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files (tracked, plus new ones git does not ignore), copied elsewhere."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    copy = tmp_path_factory.mktemp("repo")
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def script_env(pythonpath: str | None = None, unset: tuple[str, ...] = ()) -> dict[str, str]:
    """The script's environment: this interpreter, and no PYTHONPATH but `pythonpath`."""
    env = {**os.environ, "PYTHON": sys.executable}
    for name in ("PYTHONPATH", *unset):
        env.pop(name, None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def run_check(
    copy: Path, *args: str, pythonpath: str | None = None, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = script_env(pythonpath, unset)
    return subprocess.run(
        [str(copy / "bench/gpu_check.sh"), *args],
        cwd="/",  # the script finds the repository from its own path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_cpu_run_checks_correctness_and_writes_every_section(plain_copy, tmp_path):
    out = tmp_path / "gpu"
    done = run_check(plain_copy, str(out), "--device", "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    correctness = results["correctness"]
    assert correctness["passed"] and not correctness["near_tie_failures"]
    assert correctness["preemptions"] > 0  # the small pool really forced preemption
    # Speculation (on by default) drafted and kept tokens, and gave the plain run's replies.
    spec = correctness["speculation"]
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["equal_to_plain"] == correctness["requests"]
    assert 0 <= correctness["bf16_first_32_agreement"] <= 1
    assert correctness["sampling_host_syncs"] is None  # counted on CUDA only
    decode, runs = results["decode"], results["mixed"]["runs"]
    # Every timed step decoded all its rows (else the row is an error): at batch 16 the prompts
    # take several prefill steps (CPU_PROFILE's budget), as on a GPU at batch 64 and above.
    assert [row["batch"] for row in decode["rows"]] == [1, 4, 16] and decode["errors"] == []
    assert all(64 < row["contexts"][0] <= row["contexts"][1] for row in decode["rows"])
    assert decode["weight_read_bound_ms"] > 0 and decode["bandwidth_gb_s"] > 0
    assert all(row["eager_step_ms"] >= row["eager_forward_ms"] > 0 for row in decode["rows"])
    # The phases add up to the step (the engine's laps cover it, less the loop's own calls).
    for row in decode["rows"]:
        phases = row["eager_phases_ms"]
        assert phases["forward"] == row["eager_forward_ms"]
        assert 0.8 * row["eager_step_ms"] < sum(phases.values()) <= row["eager_step_ms"]
    # Jitney's own Llama-family forward, dense (the random models have no GGUF file)
    assert {row["forward"] for row in decode["rows"]} == {"jitney-none"}
    # auto, on a CPU: the native in-place kernel where the C++ kernels built
    in_place = "native" if kernel_backend().is_native else "gather"
    assert {row["decode_attention"] for row in decode["rows"]} == {in_place}
    assert runs["jitney-continuous"]["decode_attention"] == in_place
    assert runs["jitney-continuous"]["tokens_per_s"] > 0 and runs["hf-generate"]["jitney_ratio"]
    assert results["environment"]["torch"]
    table = (out / "results.md").read_text()
    assert "| batch | context |" in table and "| jitney-continuous |" in table
    assert "| batch | schedule | prepare | forward | sample | postprocess |" in table


def test_the_decode_section_with_the_triton_kernel_measures_the_gather_path_beside_it(
    plain_copy, tmp_path
):
    """As `auto` runs on a GPU: the kernel (here under Triton's interpreter, TRITON_INTERPRET=1
    from tests/conftest.py), and at the comparison batch the same step on the gather path."""
    out = tmp_path / "gpu"
    flags = "--device cpu --sections decode --decode-attention triton --decode-batches 1,4"
    done = run_check(plain_copy, str(out), *flags.split())
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["decode"]["rows"]
    assert [row["batch"] for row in rows] == [1, 4]
    assert {row["decode_attention"] for row in rows} == {"triton"}
    assert [row["batch"] for row in rows if row["gather_step_ms"]] == [4]  # CPU_PROFILE's
    assert "Decode attention: triton" in (out / "results.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_the_default_run_says_so(tmp_path, capsys):
    # In-process (main itself; the script's path is run by the tests above): no torch start-up.
    assert gpu_check.main([str(tmp_path / "gpu")]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bad_arguments_are_refused(plain_copy):
    assert run_check(plain_copy).returncode == 2  # no output folder: the shell script says so


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--sections", "warp"], "unknown section"),
        (["--decode-batches", "4,x"], "positive integers"),
        (["--decode-batches", "0"], "positive integers"),
        (["--decode-batches", ","], "positive integers"),
        (["--budget-s", "-1"], "seconds >= 0"),
        (["--budget-s", "soon"], "invalid float"),
    ],
)
def test_bad_flags_are_refused(flags, why, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_check.main([str(tmp_path), "--device", "cpu", *flags])
    assert exited.value.code == 2 and why in capsys.readouterr().err


def test_it_needs_no_package_the_gpu_machine_lacks(plain_copy, tmp_path):
    """The lent machine has torch, transformers, aiohttp and prometheus-client, not llguidance
    (structured outputs) nor redis: with both made unimportable the check still runs."""
    blocked = tmp_path / "blocked"
    for package in ("llguidance", "redis"):
        (blocked / package).mkdir(parents=True)
        (blocked / package / "__init__.py").write_text(f"raise ImportError('no {package} here')")
    out = tmp_path / "gpu"
    done = run_check(
        plain_copy,
        str(out),
        "--device",
        "cpu",
        "--sections",
        "correctness",
        pythonpath=str(blocked),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["correctness"]["passed"]


def run_until_written(copy: Path, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Start the script, kill it as soon as results.json first appears: (what it held, stderr)."""
    env = script_env()
    run = subprocess.Popen(
        [str(copy / "bench/gpu_check.sh"), str(out), "--device", "cpu", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = out / "results.json"
    try:
        deadline = time.monotonic() + 300
        while not results.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        run.kill()
        _, stderr = run.communicate()
    assert results.exists(), stderr[-3000:]
    return json.loads(results.read_text()), stderr


def test_a_run_cut_short_keeps_the_sections_it_finished(plain_copy, tmp_path):
    """The lent machine's time runs out mid-run: what was measured must already be on disk."""
    out = tmp_path / "gpu"
    written, _ = run_until_written(plain_copy, out)
    assert written["correctness"]["passed"] and "mixed" not in written  # cut after section 1
    assert "## 1. Correctness" in (out / "results.md").read_text()


def test_the_decode_section_measures_what_the_targets_read_first():
    """A lent GPU's time may run out mid-section: the 8B rows at batch 64 and 1 and the small
    model's graphs row come before the other batches (and the gather path next to its row)."""
    plan = gpu_check.decode_plan(gpu_check.GPU_PROFILE)
    assert plan[:3] == [("decode", 64), ("decode", 1), ("small", 16)]
    assert sorted(b for what, b in plan if what == "decode") == [1, 16, 64, 128, 256]
    assert plan.index(("gather", 64)) == 3
    later = replace(gpu_check.GPU_PROFILE, decode_batches=(16, 32), gather_batch=32)
    assert gpu_check.decode_plan(later) == [
        ("small", 16),
        ("decode", 16),
        ("decode", 32),
        ("gather", 32),  # after its own row, which it reads
    ]


def test_past_its_budget_the_decode_section_starts_nothing_new_and_says_so(plain_copy, tmp_path):
    """So that section 3, which comes after it, still gets its turn on a lent GPU."""
    out = tmp_path / "gpu"
    flags = "--device cpu --sections decode --budget-s 0.001"
    done = run_check(plain_copy, str(out), *flags.split())
    assert done.returncode == 0, done.stderr[-3000:]
    decode = json.loads((out / "results.json").read_text())["decode"]
    assert decode["rows"] == [] and decode["small_model_rows"] == []
    assert decode["skipped"] == [  # in decode_plan's order
        "decode batch 4",
        "decode batch 1",
        "small batch 4",
        "gather batch 4",
        "decode batch 16",
    ]
    assert (
        "Not measured, past the decode section's time budget: decode batch 4"
        in (out / "results.md").read_text()
    )


def test_a_run_cut_short_mid_section_keeps_the_rows_it_measured(plain_copy, tmp_path):
    out = tmp_path / "gpu"
    written, _ = run_until_written(plain_copy, out, "--sections", "decode")
    decode = written["decode"]
    assert decode["finished"] is False  # written after its first measurement, not at its end
    batches = [row["batch"] for row in decode["rows"]]
    assert 4 in batches and 16 not in batches  # the target's row first, batch 16's last
    assert "cut short" in (out / "results.md").read_text()


def test_a_measurement_that_fails_is_listed_and_the_run_fails(plain_copy, tmp_path):
    """`--decode-attention triton` where the kernel cannot run (on a CPU without Triton's
    interpreter): each measurement says why, the others are still tried, and the exit is 1."""
    out = tmp_path / "gpu"
    flags = "--device cpu --sections decode --decode-attention triton --decode-batches 1,4"
    done = run_check(plain_copy, str(out), *flags.split(), unset=("TRITON_INTERPRET",))
    assert done.returncode == 1 and "failed: decode" in done.stderr
    decode = json.loads((out / "results.json").read_text())["decode"]
    assert decode["rows"] == [] and decode["skipped"] == []
    failed = [error.split(":")[0] for error in decode["errors"]]
    # No kernel row, so no gather path to measure beside it.
    assert failed == ["decode batch 4", "decode batch 1", "small batch 4"]
    assert "Triton runs only as its interpreter" in decode["errors"][0]
    assert (
        "error: `decode batch 4: ValueError: --decode-attention triton"
        in (out / "results.md").read_text()
    )
