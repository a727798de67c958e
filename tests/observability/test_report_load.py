"""`jitney bench report` says what load the machine was under and how it was run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.observability.helpers import ROOT, PrometheusServer


def test_report_records_load_average_and_a_portable_command(tmp_path: Path):
    """Against a real Prometheus with nothing to scrape: no series (exit 1, said so), but the
    report still prints and records the load average at its start and end, and its command."""
    prometheus = PrometheusServer({}).start()
    try:
        out = tmp_path / "report.json"
        argv = ["bench", "report", "--prometheus", prometheus.url, "--last", "1m"]
        argv += ["--output", str(out), "--plot", ""]
        result = subprocess.run(
            [sys.executable, "-m", "jitney.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    finally:
        prometheus.close()
    assert result.returncode == 1 and "no data in the range" in result.stderr, result.stderr
    assert "load average (1/5/15 min) at start " in result.stdout
    report = json.loads(out.read_text())
    load = report["load_average"]
    assert load["cpus"] == os.cpu_count()
    for when in ("start", "end"):
        assert len(load[when]) == 3 and all(x >= 0 for x in load[when]), load
    assert report["command"] == shlex.join(["jitney", *argv])  # tmp_path is outside the repo
