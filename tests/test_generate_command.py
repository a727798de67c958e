"""`jitney generate`: a bad sampling value or engine flag fails before the model loads."""

from __future__ import annotations

import subprocess
import sys

JITNEY = [sys.executable, "-m", "jitney.cli", "generate"]
TINY = ["--model", "tiny-random", "--device", "cpu", "--raw"]


def jitney_generate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*JITNEY, *argv], capture_output=True, text=True, timeout=180)


def test_bad_sampling_value_is_a_clear_error_before_loading():
    """An out-of-range value exits non-zero naming the field; no model is built."""
    result = jitney_generate(*TINY, "--temperature", "-1", "hello")
    assert result.returncode != 0
    assert "temperature must be a finite number >= 0" in result.stderr
    assert "model ready" not in result.stderr and "Traceback" not in result.stderr


def test_bad_engine_flag_is_a_clear_error_before_loading():
    result = jitney_generate(*TINY, "--speculative-draft-row-cost", "2", "hello")
    assert result.returncode != 0
    assert "generate: speculative draft_row_cost must be within [0, 1]" in result.stderr
    assert "model ready" not in result.stderr and "Traceback" not in result.stderr
