"""`jitney bench offline` on the tiny model: the phase table adds up, the zero-overhead ratio is
reported, and a trace for another vocabulary is refused with one clear line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.offline import STEP
from engine.step_timing import PHASES
from jitney.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY_VOCAB = 281  # the tiny model's byte-level vocabulary


def write_trace(path: Path, prompts: list[list[int]], output_lens: list[int]) -> Path:
    rows = [
        {"id": i, "arrival_s": 0.0, "prompt_len": len(p), "output_len": n, "prompt_ids": p}
        for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True))
    ]
    path.write_text(json.dumps({"meta": {}, "requests": rows}))
    return path


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    prompts = [[3 + (11 * i + 7 * k) % 270 for k in range(4 + 3 * i)] for i in range(6)]
    return write_trace(tmp_path / "tiny.json", prompts, [7, 3, 12, 5, 9, 4])


def test_phase_table_adds_up_to_the_step_and_is_in_the_report(tiny_trace, tmp_path, capsys):
    """Phases are timed inside Engine.step, the step around it: they must agree."""
    out = tmp_path / "report.json"
    args = ["bench", "offline", "--model", "tiny-random", "--kv-cache-memory", "16MiB"]
    args += ["--trace", str(tiny_trace), "--policies", "continuous,static"]
    args += ["--baseline", "zero-overhead", "--output", str(out)]
    assert main(args) == 0

    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert report["phase_table"] in printed
    runs = {r["name"]: r for r in report["results"]}
    for name in ("jitney-continuous", "jitney-static"):
        ms = runs[name]["extra"]["phase_ms_per_step"]
        assert all(ms[p] > 0 for p in PHASES if p != "propose"), ms  # (no draft model)
        assert sum(ms[p] for p in PHASES) == pytest.approx(ms[STEP], rel=0.05)
        assert ms["overhead"] == pytest.approx(ms[STEP] - ms["forward"])
        assert name in report["phase_table"]
    ideal = runs["zero-overhead"]
    assert ideal["output_tokens"] == runs["jitney-continuous"]["output_tokens"] == 40
    assert "x zero-overhead" in report["table"]


def test_a_trace_outside_the_vocabulary_is_refused_before_any_run(tmp_path):
    """The largest id and the vocabulary size in one line, exit 1, no traceback."""
    path = write_trace(tmp_path / "big.json", [[5, 6, 7], [8, TINY_VOCAB, 9]], [3, 3])
    args = ["bench", "offline", "--model", "tiny-random", "--trace", str(path)]
    proc = subprocess.run(
        [sys.executable, "-m", "jitney.cli", *args, "--output", str(tmp_path / "never.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("bench offline: ")
    assert f"id {TINY_VOCAB}" in last and f"{TINY_VOCAB} ids" in last
    assert "running" not in proc.stderr  # refused before any baseline or policy ran
    assert not (tmp_path / "never.json").exists()


def test_an_engine_flag_out_of_range_is_refused_before_anything_loads(tmp_path):
    args = ["bench", "offline", "--model", "tiny-random", "--speculative-max-step-tokens", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "jitney.cli", *args, "--output", str(tmp_path / "never.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "bench offline: speculative max_step_tokens must be >= 2 (a token and a draft)"
    )
    assert not (tmp_path / "never.json").exists()


def test_an_unknown_baseline_is_refused_by_name(tiny_trace, tmp_path):
    args = ["bench", "offline", "--model", "tiny-random", "--trace", str(tiny_trace)]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--baseline", "hf-cb,vllm", "--output", str(tmp_path / "never.json")])
    assert "unknown baseline vllm" in str(exc.value.code)


def test_the_served_step_gives_the_same_tokens_without_text(tiny_trace):
    """--no-detokenize runs the engine as a worker does (token ids out, the gateway makes the
    text): the same tokens, and the run says which it measured."""
    from bench.offline import TraceRun
    from bench.trace import load_trace
    from engine.config import EngineConfig
    from engine.models.model_loader import load_model

    config = EngineConfig(model="tiny-random", kv_cache_memory="16MiB")
    loaded, requests = load_model("tiny-random"), load_trace(str(tiny_trace), None)
    with_text = TraceRun(config, loaded, requests).run_to_end()
    ids_only = TraceRun(config, loaded, requests, detokenize=False).run_to_end()
    assert ids_only.outputs == with_text.outputs and sum(map(len, ids_only.outputs.values())) == 40
    assert (with_text.extra["detokenize"], ids_only.extra["detokenize"]) == (True, False)


def test_response_format_runs_each_policy_again_constrained(tiny_trace, tmp_path, capsys):
    """--response-format: a second run per policy with every request constrained; the report
    compares it with the free run, and every constrained output follows the grammar."""
    out = tmp_path / "report.json"
    args = ["bench", "offline", "--model", "tiny-random", "--trace", str(tiny_trace)]
    args += ["--baseline", "none", "--response-format", "regex:[a-z]{2,3}", "--output", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["results"]}
    assert set(runs) == {"jitney-continuous", "jitney-continuous+regex"}
    assert runs["jitney-continuous+regex"]["extra"]["ended_by_grammar"] == 5  # 3 < output_len
    assert "jitney-continuous+regex: useful tokens/s = " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([*args[:-4], "--response-format", "yaml", "--output", str(out)])
    assert "expected json_object, json_schema:FILE or regex:PATTERN" in str(exc.value.code)


def test_speculation_shows_its_acceptance_and_the_tail_beside_plain_decoding(tmp_path, capsys):
    """`--speculative ngram` and `--speculative-model` (tiny-random as its own draft): as
    many tokens in fewer steps, and the acceptance and the last quarter's time in the table and
    the report."""
    loop = [11, 12, 13, 14, 15] * 6  # tiny-random's replies to it repeat it: drafts get kept
    trace = write_trace(tmp_path / "loop.json", [loop, loop[3:]], [40, 40])
    reports = {}
    runs = {
        "none": ["--speculative", "none"],
        "ngram": ["--speculative", "ngram"],
        "draft": ["--speculative-model", "tiny-random"],
    }
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        args = ["bench", "offline", "--model", "tiny-random", "--kv-cache-memory", "16MiB"]
        args += ["--trace", str(trace), "--policies", "continuous", "--baseline", "none"]
        assert main([*args, *flags, "--output", str(out)]) == 0
        reports[name] = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "accept" in printed and "tail 25%" in printed
    plain = reports["none"]["results"][0]
    assert plain["extra"]["spec_acceptance"] is None
    for name in ("ngram", "draft"):
        spec = reports[name]["results"][0]
        assert spec["output_tokens"] == plain["output_tokens"] == 80
        assert spec["extra"]["steps"] < plain["extra"]["steps"]
        assert 0 < spec["extra"]["spec_acceptance"] <= 1
        assert spec["extra"]["spec_accepted_tokens"] > 0
        history = spec["extra"]["spec_history_accepted_tokens"]
        assert history <= spec["extra"]["spec_history_draft_tokens"]
        assert spec["extra"]["spec_history_draft_tokens"] <= spec["extra"]["spec_draft_tokens"]
        if name == "draft":  # a draft model proposes alone: no history
            assert spec["extra"]["spec_history_draft_tokens"] == 0
        assert 0 < spec["extra"]["tail_s"] < spec["wall_s"]
        # The decode steps by drafts verified: a draft row's cost beside the plain steps.
        by_drafts = {int(d): e for d, e in spec["extra"]["steps_by_drafts"].items()}
        assert any(d > 0 for d in by_drafts)
        assert sum(e["steps"] for e in by_drafts.values()) <= spec["extra"]["steps"]
        for drafts, e in by_drafts.items():
            assert 0 < e["forward_ms"] <= e["step_ms"]
            assert 0 <= e["kept_per_step"] <= drafts
        assert reports[name]["draft_table"].startswith("jitney-continuous: decode steps by")
    assert plain["extra"]["steps_by_drafts"] is None and reports["none"]["draft_table"] == ""
    assert "decode steps by drafts verified" in printed


def test_the_measured_prefill_of_a_one_request_trace_is_not_served_from_the_prefix_cache(
    tmp_path, capsys
):
    """The warm-up runs on a prompt outside the trace, so the one request's prompt (five blocks)
    is computed in the measured run, not taken from the cache; the report says so."""
    prompt = [3 + (7 * k) % 270 for k in range(80)]
    trace = write_trace(tmp_path / "one.json", [prompt], [4])
    out = tmp_path / "report.json"
    args = ["bench", "offline", "--model", "tiny-random", "--kv-cache-memory", "16MiB"]
    args += ["--trace", str(trace), "--baseline", "none", "--output", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    (run,) = report["results"]
    assert run["extra"]["prefix_cache_hit_tokens"] == 0
    assert run["output_tokens"] == 4
    assert "not in the trace" in report["warmup"]
    assert f"warm-up: {report['warmup']}" in capsys.readouterr().out


def test_the_warmup_prompt_shares_no_prefix_cache_block_with_the_trace():
    """As long as the first request, and none of its chained block hashes is any request's."""
    from bench.offline import warmup_prompt
    from bench.trace import TraceRequest
    from generation.block_hash import prompt_block_hashes

    prompts = [[0, *range(5, 40)], [1, *range(5, 40)], [0, 2, 9], [3] * 33]
    requests = [TraceRequest(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    warm = warmup_prompt(requests)
    assert len(warm) == len(prompts[0]) and warm[0] == 2 and warm[1:] == prompts[0][1:]
    trace_hashes = {h for p in prompts for h in prompt_block_hashes(p, 4)}
    assert not set(prompt_block_hashes(warm, 4)) & trace_hashes
