"""research/prediction_ab.py on the tiny model, small: both modes run every round, the tokens agree,
and a prediction that is the reply keeps more drafts than none."""

from __future__ import annotations

import json
from pathlib import Path

from research import prediction_ab


def test_both_modes_run_and_agree(tmp_path: Path, capsys):
    trace = tmp_path / "trace.json"
    requests = [
        {"id": i, "prompt_ids": [5 + i, 17, 42, 99, 120], "output_len": 40} for i in range(2)
    ]
    trace.write_text(json.dumps({"requests": requests}))
    prediction_ab.main(["--trace", str(trace), "--rounds", "2", "--model", "tiny-random"])
    out = capsys.readouterr().out
    cells = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    rows = {row[1].strip(): row for row in cells}
    assert rows["none"][5].strip() == "True"  # the same tokens with and without
    assert int(rows["prediction"][3]) > int(rows["none"][3])  # drafts kept a round
