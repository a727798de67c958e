"""research.isa_ab: one engine, the kernels' level switched request by request."""

import json

import pytest

from engine.kernels import kernel_backend
from research.isa_ab import main, run_ab

pytestmark = pytest.mark.skipif(
    not kernel_backend().is_native, reason="needs the C++ kernels (levels to switch)"
)
LEVELS = ["avx2", "avx2-int16"]  # every CPU the library builds for has both


def trace(tmp_path):
    requests = [
        {"id": i, "prompt_ids": [1, 5 + i, 9, 14, 3], "output_len": 6, "arrival_s": 0.0}
        for i in range(2)
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"meta": {}, "requests": requests}))
    return path, requests


def test_each_level_runs_every_request_and_the_level_is_restored(tmp_path):
    from engine.config import EngineConfig
    from engine.llm_engine import Engine

    _, requests = trace(tmp_path)
    before = kernel_backend().isa
    engine = Engine(EngineConfig(model="tiny-random", quantization="int8", kv_cache_memory="16MiB"))
    result = run_ab(engine, requests, LEVELS, rounds=2)
    assert [r.level for r in result.runs] == LEVELS
    assert all(r.tokens == 2 * 2 * 6 and r.seconds > 0 for r in result.runs)
    assert kernel_backend().isa == before
    with pytest.raises(ValueError, match="not on this CPU"):
        run_ab(engine, requests, ["avx2", "no-such-level"], rounds=1)


def test_the_command_writes_its_report(tmp_path, capsys):
    path, _ = trace(tmp_path)
    out = tmp_path / "ab.json"
    main(
        [
            "--trace",
            str(path),
            "--model",
            "tiny-random",
            "--quantization",
            "int8",
            "--rounds",
            "1",
            "--output",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert [r["level"] for r in report["runs"]] == LEVELS
    assert all(r["tokens"] == 12 and r["tokens_per_s"] > 0 for r in report["runs"])
    assert "same tokens at every level" in capsys.readouterr().out
