"""research.speculation_ab: speculation off and on, one process, the order flipping by round;
by default the two engines take steps in turn, each timed by its own steps."""

import json
import time
from dataclasses import replace

import pytest

from bench.offline import TraceRun
from bench.trace import trace_requests
from engine.config import EngineConfig
from engine.models.model_loader import load_model
from research.speculation_ab import check_pairing, format_row, main, run_ab, run_in_turn

# Prompts that repeat themselves, so prompt lookup has drafts to propose.
REQUESTS = [
    {"id": i, "prompt_ids": [5, 9, 14, 5, 9, 14, 5, 9, 14 + i], "output_len": 12, "arrival_s": 0.0}
    for i in range(2)
]


def _trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"meta": {}, "requests": REQUESTS}))
    return path


def test_both_modes_run_every_round_with_the_same_greedy_tokens():
    config = EngineConfig(model="tiny-random", kv_cache_memory="16MiB", max_num_seqs=1)
    loaded = load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)
    said = []
    report = run_ab(config, loaded, trace_requests({"requests": REQUESTS}), "ngram", 2, said.append)
    assert said[0].startswith("round 1 --speculative none") and said[2].startswith(
        "round 2 --speculative ngram"
    )  # the order flips
    assert report.same_tokens
    assert len(report.off.tokens_per_s) == len(report.on.tokens_per_s) == 2
    assert report.off.kept is None and report.off.tokens_per_step == 1.0
    assert report.on.kept is not None and report.on.tokens_per_step >= 1.0
    row = format_row("tiny", report, one_at_a_time=True)
    assert row.startswith("| tiny | ") and row.count(" | ") == 6
    with pytest.raises(ValueError, match="rounds"):
        run_ab(config, loaded, trace_requests({"requests": REQUESTS}), "ngram", 0)


def _tiny():
    config = EngineConfig(model="tiny-random", kv_cache_memory="16MiB", max_num_seqs=1)
    return config, load_model(config.model, config.torch_device, config.torch_dtype, None)


def test_engines_in_turn_give_what_each_gives_alone_each_timed_by_its_own_steps():
    config, loaded = _tiny()
    requests = trace_requests({"requests": REQUESTS})
    configs = [config.replace_flat(speculative=m) for m in ("none", "ngram")]
    runs = [TraceRun(c, loaded, requests) for c in configs]
    before = [run.elapsed for run in runs]  # adding the requests
    started = time.perf_counter()
    run_in_turn(runs)
    stepping = time.perf_counter() - started
    off, on = (run.result() for run in runs)
    alone_runs = [TraceRun(c, loaded, requests).run_to_end() for c in configs]
    for alone, in_turn in zip(alone_runs, (off, on), strict=True):
        assert in_turn.outputs == alone.outputs
        assert in_turn.extra["steps"] == alone.extra["steps"]
    assert off.extra["spec_draft_tokens"] == 0 < on.extra["spec_draft_tokens"]
    # Each clock counts its own steps only: together they fit in the time both took stepping
    # (a clock that counted the other's steps too would take about all of it).
    own = [r.wall_s - b for r, b in zip((off, on), before, strict=True)]
    assert all(s > 0 for s in own) and sum(own) <= stepping
    # Every step's time is in one part of the split: the prompts, plain decodes, verifications.
    for run, result in zip(runs, (off, on), strict=True):
        split = result.extra["time_split_s"]
        assert split["prefill"] > 0 and split["plain_decode"] >= 0
        assert sum(split.values()) == pytest.approx(run.step_s)
    assert off.extra["time_split_s"]["drafted_decode"] == 0
    assert on.extra["time_split_s"]["drafted_decode"] > 0
    assert max(off.latencies_s.values()) <= off.wall_s


def test_both_pairings_give_the_same_tokens_and_a_bad_pairing_is_refused():
    config, loaded = _tiny()
    requests = trace_requests({"requests": REQUESTS})
    reports = [
        run_ab(config, loaded, requests, "ngram", 1, pairing=p) for p in ("lockstep", "runs")
    ]
    assert all(r.same_tokens for r in reports)
    assert reports[0].on.kept == reports[1].on.kept  # greedy: the same drafts, the same verdicts
    with pytest.raises(ValueError, match="pairing must be one of"):
        run_ab(config, loaded, requests, "ngram", 1, pairing="interleaved")
    # On a GPU the second engine's pool would be sized by what the first left free.
    gpu = replace(config, device="cuda", kv_cache_memory=None)
    with pytest.raises(ValueError, match="lockstep on a GPU needs --kv-cache-memory"):
        check_pairing(gpu, "lockstep")
    check_pairing(gpu, "runs")
    check_pairing(replace(gpu, kv_cache_memory="1GiB"), "lockstep")


# Prompts of tiny-random's whose greedy replies reach an EOS (id 0 or 2) at their 6th token, and
# not within 16 tokens.
REACHES_EOS = {"id": 0, "prompt_ids": [109, 195, 152, 7, 73, 80, 141, 173], "output_len": 16}
NO_EOS = {"id": 1, "prompt_ids": [143, 234, 62, 134, 71, 269, 180, 61], "output_len": 16}


def test_stop_at_eos_ends_each_reply_at_its_first_eos_in_both_pairings():
    config, loaded = _tiny()
    requests = trace_requests({"requests": [REACHES_EOS, NO_EOS]})
    eos = set(loaded.eos_token_ids)
    full = TraceRun(config, loaded, requests).run_to_end().outputs
    stopped = TraceRun(config, loaded, requests, stop_at_eos=True).run_to_end().outputs
    assert [any(t in eos for t in full[r.request_id]) for r in requests] == [True, False]
    for r in requests:
        tokens = full[r.request_id]
        first = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
        assert stopped[r.request_id] == tokens[: first + 1]
    for pairing in ("lockstep", "runs"):
        report = run_ab(config, loaded, requests, "ngram", 1, pairing=pairing, stop_at_eos=True)
        assert report.same_tokens


def test_the_command_writes_its_report(tmp_path, capsys):
    out = tmp_path / "ab.json"
    argv = ["--trace", str(_trace(tmp_path)), "--model", "tiny-random", "--rounds", "1"]
    main([*argv, "--speculative", "ngram", "--max-num-seqs", "1", "--output", str(out)])
    report = json.loads(out.read_text())
    assert report["same_tokens"] and len(report["round_speed_ups"]) == 1
    assert report["args"]["pairing"] == "lockstep"
    assert len(report["on"]["row_costs"]) == 1 and 0 <= report["on"]["row_costs"][0] <= 1
    assert report["off"]["mode"] == "none" and report["on"]["mode"] == "ngram"
    assert set(report["on"]["time_split_s"]) == {"prefill", "plain_decode", "drafted_decode"}
    printed = capsys.readouterr().out
    assert "same tokens with and without speculation: True" in printed
    assert "seconds in prefill steps / decode steps without drafts / with drafts" in printed
    with pytest.raises(SystemExit):  # none against none compares nothing
        main([*argv, "--speculative", "none"])
    with pytest.raises(SystemExit):
        main([*argv, "--pairing", "interleaved"])


def test_the_speculation_settings_it_is_given_reach_the_engine_or_are_refused(tmp_path, capsys):
    argv = ["--trace", str(_trace(tmp_path)), "--model", "tiny-random", "--rounds", "1"]
    steps = {}
    for cost in ("0", "1"):  # every draft verified; only the odds' probes
        out = tmp_path / f"ab-{cost}.json"
        settings = ["--prompt-lookup-min", "1", "--speculative-draft-row-cost", cost]
        main([*argv, *settings, "--max-num-seqs", "1", "--output", str(out)])
        report = json.loads(out.read_text())
        assert report["same_tokens"]
        steps[cost] = report["on"]["tokens_per_step"]
        assert report["on"]["row_costs"] == [float(cost)]  # fixed, not measured
    assert steps["0"] > steps["1"] >= 1
    for bad in (["--prompt-lookup-min", "0"], ["--speculative-draft-row-cost", "2"]):
        with pytest.raises(SystemExit):
            main([*argv, *bad])
        assert "error:" in capsys.readouterr().err
