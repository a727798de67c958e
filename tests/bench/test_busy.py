"""`jitney bench busy` on the tiny model, a few tokens: every case gets its quiet and busy
figures and their ratio, and every busy measurement had a spinner that really spun and was
stopped. No timing is asserted (the machine running the tests is shared)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from bench.llama_cpp import parse_batched_bench
from bench.spinner import Spinner
from jitney.cli import main

TINY = ["--model", "tiny-random", "--kv-cache-memory", "16MiB", "--threads", "1"]
# Three requests whose ids fit the tiny model's vocabulary (281).
MIXED = {
    "meta": {},
    "requests": [
        {"id": i, "arrival_s": 0.0, "prompt_len": 5, "output_len": 3 + i, "prompt_ids": ids}
        for i, ids in enumerate([[9, 10, 11, 12, 13], [20, 30, 40, 50, 60], [70, 7, 77, 8, 88]])
    ],
}


def run_busy(tmp_path: Path, *flags: str) -> dict:
    trace = tmp_path / "mixed.json"
    trace.write_text(json.dumps(MIXED))
    out = tmp_path / "busy.json"
    argv = ["bench", "busy", *TINY, "--mixed-trace", str(trace), "--one-user-prompt-len", "6"]
    assert main([*argv, "--max-tokens", "3", "--output", str(out), *flags]) == 0
    return json.loads(out.read_text())


def check_cases(report: dict, rounds: int, expected: set[tuple[str, str, str]]) -> None:
    cases = {(c["system"], c["path"], c["workload"]): c for c in report["cases"]}
    assert set(cases) == expected
    for case in cases.values():
        assert len(case["quiet_tokens_per_s"]) == len(case["busy_tokens_per_s"]) == rounds
        assert case["quiet_median"] > 0 and case["busy_median"] > 0
        ratios = [
            b / q
            for q, b in zip(case["quiet_tokens_per_s"], case["busy_tokens_per_s"], strict=True)
        ]
        assert case["ratio"] == pytest.approx(statistics.median(ratios), abs=0.01)
    # One spinner per busy measurement, which spun (CPU time) and was stopped (and is gone).
    runs = report["spinner"]["runs"]
    assert len(runs) == rounds * len(cases)
    for run in runs:
        assert run["stopped"] and run["cpu_s"] > 0
        with pytest.raises(ProcessLookupError):
            os.kill(run["pid"], 0)


def test_offline_cases_quiet_and_busy(tmp_path, capsys):
    report = run_busy(tmp_path, "--paths", "offline", "--rounds", "2", "--spinner-cpu", "0")
    check_cases(report, 2, {("jitney", "offline", "one-user"), ("jitney", "offline", "mixed")})
    assert report["spinner"]["cpu"] == 0 and report["threads"] == 1
    assert report["workloads"]["one-user"] == {"requests": 1, "output_tokens": 3}
    assert report["workloads"]["mixed"] == {"requests": 3, "output_tokens": 3 + 3 + 3}
    printed = capsys.readouterr().out
    assert "busy/quiet" in printed and "pinned to CPU 0" in printed


def test_service_cases_through_jitney_up(tmp_path):
    report = run_busy(tmp_path, "--paths", "service", "--rounds", "1")
    check_cases(report, 1, {("jitney", "service", "one-user"), ("jitney", "service", "mixed")})


def test_bad_flags_are_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--spinner-cpu 4096 is not among the CPUs"):
        main(["bench", "busy", *TINY, "--spinner-cpu", "4096"])
    one_user = [*TINY, "--workloads", "one-user"]  # no mixed trace wanted
    with pytest.raises(SystemExit, match="no llama-batched-bench, llama-server in"):
        main(["bench", "busy", *one_user, "--llama-bin-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"no mixed trace at .*missing\.json"):
        main(["bench", "busy", *TINY, "--mixed-trace", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):  # argparse: an unknown workload
        main(["bench", "busy", *TINY, "--workloads", "one-user,chat"])


def test_a_spinner_takes_cpu_until_stopped():
    with Spinner(cpu=min(os.sched_getaffinity(0))) as spinner:
        assert spinner.proc is not None and spinner.proc.poll() is None
    assert spinner.record is not None and spinner.record.stopped
    assert spinner.proc.poll() is not None


def test_llama_batched_bench_table_is_read_by_its_header():
    """llama-batched-bench's table (its README's sample layout): generated tokens over the
    whole time, prompt included, as Jitney's offline tokens/s counts them."""
    text = """
main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   134 |    256 |    1 |    390 |    0.400 |   335.00 |    3.000 |    85.33 |    3.400 |   114.71 |
"""
    row = parse_batched_bench(text)
    assert (row.prompt_tokens, row.generated_tokens) == (134, 256)
    assert row.tokens_per_s == pytest.approx(256 / 3.4)
    assert row.generation_tokens_per_s == pytest.approx(256 / 3.0)
