"""research.speculation_variants: speculation off and named engine settings in lockstep, who goes
first rotating by round; settings parsed to their fields' types, bad ones refused up front."""

import json

import pytest

from bench.trace import trace_requests
from engine.config import EngineConfig
from engine.models.model_loader import load_model
from research.speculation_variants import OFF, Variant, main, parse_variant, run_variants
from tests.research.test_speculation_ab import REQUESTS, _trace


def test_a_variant_s_settings_take_their_fields_types():
    v = parse_variant("loose:prompt_lookup_min=1,prompt_lookup_resume=false")
    assert v == Variant("loose", {"prompt_lookup_min": 1, "prompt_lookup_resume": False})
    assert parse_variant("defaults:") == Variant("defaults", {})
    priced = parse_variant("p:speculative_draft_row_cost=0.25,speculative_max_step_tokens=none")
    assert priced.settings == {
        "speculative_draft_row_cost": 0.25,
        "speculative_max_step_tokens": None,
    }
    assert parse_variant("m:speculative=ngram").settings == {"speculative": "ngram"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no-colon", "NAME:FIELD=VALUE"),
        (":prompt_lookup_min=1", "NAME:FIELD=VALUE"),
        ("off:", "NAME:FIELD=VALUE"),
        ("x:no_such_field=1", "not FIELD=VALUE of an engine field"),
        ("x:prompt_lookup_min", "not FIELD=VALUE of an engine field"),
        ("x:prompt_lookup_min=two", "expected int, got .two."),
        ("x:prompt_lookup_resume=maybe", "true or false"),
        ("x:model=tiny-random", "loaded once"),
    ],
)
def test_a_malformed_variant_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_variant(text)


def test_every_variant_runs_every_round_in_lockstep_with_off_s_greedy_tokens():
    config = EngineConfig(model="tiny-random", kv_cache_memory="16MiB", max_num_seqs=1)
    loaded = load_model(config.model, config.torch_device, config.torch_dtype, config.cache_dir)
    requests = trace_requests({"requests": REQUESTS})
    variants = [
        parse_variant("all:speculative_draft_row_cost=0"),
        parse_variant("probes:speculative_draft_row_cost=1"),
    ]
    said: list[str] = []
    report = run_variants(config, loaded, requests, variants, 3, said.append)
    # Who goes first rotates: off, then the first variant, then the second.
    assert [line.split(")")[0] for line in said] == [
        "round 1 (off, all, probes",
        "round 2 (all, probes, off",
        "round 3 (probes, off, all",
    ]
    assert list(report.summaries) == [OFF, "all", "probes"]
    assert report.same_tokens == {"all": True, "probes": True}
    assert report.summaries[OFF].kept is None and report.speed_ups(OFF) == [1.0] * 3
    # Every draft verified at a free row; at a row as dear as a step, only the odds' probes.
    assert report.summaries["all"].tokens_per_step > report.summaries["probes"].tokens_per_step
    with pytest.raises(ValueError, match="own name"):
        run_variants(config, loaded, requests, [variants[0], variants[0]], 1)
    with pytest.raises(ValueError, match="rounds"):
        run_variants(config, loaded, requests, variants, 0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        run_variants(config, loaded, requests, [Variant("bad", {"prompt_lookup_min": 0})], 1)


def test_the_command_writes_its_report_and_refuses_bad_variants_before_loading(tmp_path, capsys):
    out = tmp_path / "variants.json"
    argv = ["--trace", str(_trace(tmp_path)), "--model", "tiny-random", "--max-num-seqs", "1"]
    main([*argv, "--rounds", "1", "--variant", "a:", "--output", str(out)])
    report = json.loads(out.read_text())
    assert report["same_tokens"] == {"a": True} and report["speed_ups"][OFF] == 1.0
    assert set(report["modes"]["a"]["time_split_s"]) == {
        "prefill",
        "plain_decode",
        "drafted_decode",
    }
    printed = capsys.readouterr().out
    assert printed.startswith("| variant | tokens/s | speed-up (rounds) |")
    assert "| off | " in printed and "| a | " in printed
    for bad in (
        ["--variant", "a:prompt_lookup_min=0"],
        ["--variant", "a:", "--variant", "a:"],
        ["--variant", "a:", "--rounds", "0"],
        ["--variant", "a:bogus=1"],
        [],
    ):
        with pytest.raises(SystemExit):
            main([*argv, *bad])
        assert "error:" in capsys.readouterr().err
