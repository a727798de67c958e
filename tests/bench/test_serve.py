"""`jitney bench serve` against a real stack: redis-server, `jitney worker`, `jitney gateway`."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.conversation_trace import TraceShape, generate
from bench.serve import CANCELLED, NOT_SENT, poisson_arrivals, run_serve
from bench.trace import load_trace, percentile
from jitney.cli import main
from tests.services import running_system

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OUTPUT_LENS = [3, 12, 5, 9, 4, 7, 11, 6]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # Speculation off: tiny-random's replies repeat themselves, so prompt lookup would decode the
    # long request of test_max_duration_cancels_the_rest in under its 1 s (it did, in CI).
    with running_system(("bench-serve-w1",), worker_flags=("--speculative", "none")) as system:
        yield system.base


def write_trace(path: Path, output_lens: list[int], arrivals: list[float] | None = None) -> Path:
    """A synthetic trace: prompt ids inside the tiny vocabulary, the given output lengths."""
    rng = random.Random(len(output_lens))
    requests = [
        {
            "id": i,
            "arrival_s": arrivals[i] if arrivals else 0.05 * i,
            "prompt_len": (n_prompt := rng.randrange(4, 40)),
            "output_len": n,
            "prompt_ids": [rng.randrange(3, 281) for _ in range(n_prompt)],
        }
        for i, n in enumerate(output_lens)
    ]
    path.write_text(json.dumps({"meta": {"n": len(requests)}, "requests": requests}))
    return path


def max_model_len(base: str) -> int:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
        return int(json.load(resp)["data"][0]["max_model_len"])


def assert_all_served(report: dict, output_lens: list[int]) -> None:
    assert report["failed"] == 0, report["failures"]
    assert report["completed"] == report["num_requests"] == len(output_lens)
    assert report["output_tokens"] == report["useful_output_tokens"] == sum(output_lens)
    assert [q["output_tokens"] for q in report["requests"]] == output_lens
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = report[key]
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (key, s)
    for q in report["requests"]:
        assert 0 < q["ttft_s"] <= q["e2e_s"] <= report["wall_s"]
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
    assert report["output_throughput"] == pytest.approx(
        sum(output_lens) / report["wall_s"], rel=1e-3
    )


def test_poisson_arrivals_are_seeded_and_percentile_interpolates():
    a = poisson_arrivals(50, 4.0, seed=1)
    assert a == poisson_arrivals(50, 4.0, seed=1) != poisson_arrivals(50, 4.0, seed=2)
    assert a == sorted(a) and 5 < a[-1] < 25  # 50 arrivals at 4/s: about 12.5 s
    assert poisson_arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


async def test_open_loop_rate(base, tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.json", OUTPUT_LENS))
    report = await run_serve(base, trace, rate=20.0, seed=3, label="open")
    assert_all_served(report, OUTPUT_LENS)
    assert report["label"] == "open" and report["model"] == "tiny-random"
    assert report["mode"] == "open" and report["rate"] == 20.0


def test_cli_closed_loop_then_compare(base, tmp_path, capsys):
    trace = write_trace(tmp_path / "t.json", OUTPUT_LENS)
    outs = {}
    for label, flags in (("c3", ["--concurrency", "3"]), ("replay", ["--arrivals", "trace"])):
        out, png = tmp_path / f"{label}.json", tmp_path / f"{label}.png"
        argv = ["bench", "serve", "--url", f"{base}/v1", "--trace", str(trace), "--label", label]
        assert main([*argv, *flags, "--output", str(out), "--plot", str(png)]) == 0
        assert png.read_bytes()[:8] == PNG_MAGIC
        outs[label] = out
        report = json.loads(out.read_text())
        assert_all_served(report, OUTPUT_LENS)
        assert f"label {label}" in capsys.readouterr().out
    assert json.loads(outs["c3"].read_text())["concurrency"] == 3

    chart = tmp_path / "compare.png"
    files = [str(p) for p in outs.values()]
    assert main(["bench", "serve", "--compare", *files, "--plot", str(chart)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["c3", "replay"]
    assert chart.read_bytes()[:8] == PNG_MAGIC


async def test_rejected_requests_count_as_failed_with_reason(base, tmp_path):
    too_long = max_model_len(base)  # prompt + max_tokens cannot fit the context window
    lens = [4, too_long, 5]
    trace = load_trace(write_trace(tmp_path / "t.json", lens))
    report = await run_serve(base, trace, concurrency=2)
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["failures"] == {"HTTP 400 context_length_exceeded": 1}
    bad = report["requests"][1]
    assert not bad["ok"] and "maximum context length" in bad["detail"]
    assert report["output_tokens"] == 9

    report = await run_serve(base, trace[:2], rate=50.0, model="no-such-model")
    assert report["failures"] == {"HTTP 404 model_not_found": 2} and report["completed"] == 0
    assert report["ttft_ms"]["p50"] is None and report["output_throughput"] == 0


async def test_max_duration_cancels_the_rest(base, tmp_path):
    """A long request in flight is cancelled, a late one never sent; both count as failed."""
    lens = [3, max_model_len(base) - 45, 4]  # thousands of tokens: far more than 1 s of decoding
    late_at, max_duration = 30.0, 1.0
    trace = load_trace(write_trace(tmp_path / "t.json", lens, arrivals=[0.0, 0.0, late_at]))
    report = await run_serve(base, trace, arrivals="trace", max_duration=max_duration)
    # The counts below prove the cut; the wall time only shows the run did not wait for the late
    # arrival (the margin up to it is for a loaded 2-core machine).
    assert report["wall_s"] < late_at
    assert report["completed"] == 1 and report["failures"] == {CANCELLED: 1, NOT_SENT: 1}
    long, late = report["requests"][1:]
    assert long["start_s"] < max_duration <= long["end_s"] and long["e2e_s"] is None
    assert late["start_s"] is None and report["output_tokens"] == 3


async def test_mixed_class_mode_runs_over_a_batch_backlog(base, tmp_path):
    """--batch-backlog: a batch of backlog lines goes in through the Batch API first; the
    interactive requests are all served over it, the report says how far the batch got, and
    the batch does not outlive the run."""
    lens = [6, 4, 8, 5]
    trace = load_trace(write_trace(tmp_path / "t.json", lens))
    report = await run_serve(base, trace, rate=50.0, batch_backlog=40, backlog_warmup_s=0.5)
    assert_all_served(report, lens)
    backlog = report["batch_backlog"]
    assert backlog["lines"] == 40 and backlog["answered_during_run"] >= 0
    assert backlog["answered_before_run"] + backlog["answered_during_run"] <= 40
    with urllib.request.urlopen(f"{base}/v1/batches/{backlog['batch_id']}", timeout=5) as resp:
        status = json.load(resp)["status"]
    assert status in ("cancelling", "cancelled", "completed")


def test_conversations_mode_sends_each_turn_after_the_previous_reply(base, tmp_path, capsys):
    """A multi-turn trace: turns of a conversation never overlap, and (one worker, a cache
    that holds everything) every later turn's cached tokens are the last prompt's full blocks,
    as the usage reports them."""
    shape = TraceShape(
        conversations=3, turns=(3, 3), system_len=40, user_len=(8, 20), reply_len=(3, 6)
    )
    trace = generate(shape, seed=5)
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(trace.to_dict()))
    out = tmp_path / "c.json"
    argv = ["bench", "serve", "--url", base, "--conversations", str(path), "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["completed"] == trace.num_requests == 9
    turns = {q["request_id"]: q for q in report["requests"]}
    cached = 0
    for c in trace.conversations:
        for t in range(1, len(c.turns)):
            this, last = turns[f"{c.id}-{t}"], turns[f"{c.id}-{t - 1}"]
            assert this["start_s"] >= last["end_s"]
            assert this["cached_tokens"] == len(trace.prompt(c, t - 1)) // 16 * 16
            cached += this["cached_tokens"]
    assert report["cached_tokens"] >= cached > 0
    assert report["prefill_tokens"] == report["prompt_tokens"] - report["cached_tokens"]
    assert "prefix hit rate" in capsys.readouterr().out
