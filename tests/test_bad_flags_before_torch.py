"""A command given a bad engine or service flag, or a worker whose metrics port is taken, refuses
it before importing torch (the seconds of its import, and transformers', are not paid to be told
a flag is wrong)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

# Runs the CLI in-process, then says whether torch was imported on the way to the refusal.
RUN_AND_REPORT = """
import sys
from jitney.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
if isinstance(code, str):  # what SystemExit would have printed
    print(code, file=sys.stderr)
print('torch imported:', 'torch' in sys.modules, file=sys.stderr)
sys.exit(code if isinstance(code, int) else 1)
"""
BAD_SPECULATION = ["--speculative-config", '{"method": "medusa"}']
TINY = ["--model", "tiny-random", "--device", "cpu"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", *TINY, *BAD_SPECULATION, "hi"], "method 'medusa' is not supported"),
        (["generate", *TINY, "--temperature", "-1", "hi"], "temperature must be a finite"),
        (["worker", *TINY, "--metrics-port", "0", *BAD_SPECULATION], "cannot_start"),
        (
            ["worker", *TINY, "--metrics-port", "0", "--generation-config", "/nonexistent"],
            "--generation-config must be auto, vllm or a directory",
        ),
        (
            ["bench", "offline", *TINY, "--trace", "bench/traces/quoting.json", *BAD_SPECULATION],
            "bench offline: --speculative-config: method 'medusa'",
        ),
    ],
    ids=[
        "generate-engine-flag",
        "generate-sampling",
        "worker-engine-flag",
        "worker-service-flag",
        "bench-offline",
    ],
)
def test_a_bad_flag_is_refused_before_torch_is_imported(argv, message):
    result = run_and_report(argv)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "torch imported: False" in result.stderr, result.stderr


def test_a_worker_whose_metrics_port_is_taken_exits_2_before_torch_is_imported():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_and_report(["worker", *TINY, "--metrics-port", str(port)])
    assert result.returncode == 2
    assert f"cannot_start metrics_port={port}" in result.stderr, result.stderr
    assert "torch imported: False" in result.stderr


WORKER = ["worker", *TINY, "--metrics-port", "0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*WORKER, "--lora-modules", "sql"], "'sql' is not name=path"),
        (["generate", *TINY, "hi", "--lora-modules", '{"name": "a"}'], "fields name and path"),
        (["up", *TINY, "--lora-modules", '{"name": "a", "path": "/a", "x": 1}'], "key(s) 'x'"),
        (["up", *TINY, "--lora-modules", "a=/x", "a=/y"], "names 'a' more than once"),
        ([*WORKER, "--lora-modules", "a=/x", "a=/y"], "names 'a' more than once"),
        ([*WORKER, "--max-lora-rank", "0"], "must be a whole number of at least 1, not '0'"),
    ],
    ids=["worker-item", "generate-json", "up-json-key", "up-twice", "worker-twice", "rank"],
)
def test_a_bad_lora_flag_is_refused_before_torch_is_imported(argv, message):
    result = run_and_report(argv)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "torch imported: False" in result.stderr, result.stderr


THREADS_REFUSED = "must be a whole number of at least 1"


@pytest.mark.parametrize(
    "argv, env",
    [
        (["worker", *TINY, "--metrics-port", "0", "--threads", "0"], {}),
        (["generate", *TINY, "--threads", "1.5", "hi"], {}),
        (["up", *TINY, "--threads", "-2"], {}),
        (["bench", "offline", *TINY, "--threads", "two"], {}),
        (["generate", *TINY, "hi"], {"JITNEY_THREADS": "0"}),
        (["worker", *TINY, "--metrics-port", "0"], {"OMP_NUM_THREADS": "0"}),
        (["up", *TINY], {"OMP_NUM_THREADS": "many"}),
    ],
    ids=["worker", "generate", "up", "bench-offline", "env-flag", "worker-omp", "up-omp"],
)
def test_a_bad_thread_count_is_refused_before_torch_is_imported(argv, env):
    result = run_and_report(argv, env)
    assert result.returncode != 0
    assert THREADS_REFUSED in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "torch imported: False" in result.stderr, result.stderr


def run_and_report(
    argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        # A Redis nobody listens on: `up` must not start one of its own before refusing.
        env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1", **(env or {})},
    )
