"""vLLM's `--speculative-config` object: each key it shares with Jitney sets that setting, every
other key and every value Jitney cannot honour is refused by name, and the flag reaches the
engine, `jitney up`'s workers and `jitney generate`'s clear errors."""

from __future__ import annotations

import json
import re

import pytest

from engine.config import EngineConfig
from engine.speculative_config_json import FIELDS, INT_KEYS, speculative_config_fields
from engine.speculative_options import SpeculativeOptions
from jitney.cli import build_parser
from jitney.commands.engine_args import (
    engine_args_to_argv,
    engine_config_from_args,
    engine_flag_defaults,
)
from tests.test_generate_command import TINY, jitney_generate

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6}


def config_of(*argv: str) -> EngineConfig:
    return engine_config_from_args(build_parser(["worker"]).parse_args(["worker", *argv]))


@pytest.mark.parametrize(
    ("config", "fields"),
    [
        (
            NGRAM,
            {"speculative": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6},
        ),
        (
            {"method": "ngram", "prompt_lookup_min": 1},
            {"speculative": "ngram", "prompt_lookup_min": 1},
        ),
        (
            {"method": "draft_model", "model": "tiny-random", "num_speculative_tokens": 3},
            {
                "speculative": "draft",
                "speculative_model": "tiny-random",
                "num_speculative_tokens": 3,
            },
        ),
        # Before `method`, vLLM read a model named ngram as prompt lookup, any other as a draft.
        ({"model": "[ngram]"}, {"speculative": "ngram"}),
        ({"model": "ngram", "method": "ngram"}, {"speculative": "ngram"}),
        ({"model": "tiny-random"}, {"speculative": "draft", "speculative_model": "tiny-random"}),
        (
            {"model": "tiny-random", "draft_tensor_parallel_size": 1},
            {"speculative": "draft", "speculative_model": "tiny-random"},
        ),
        (
            {"method": "ngram", "disable_by_batch_size": 4},
            {"speculative": "ngram", "speculative_disable_by_batch_size": 4},
        ),
    ],
)
def test_each_key_sets_its_engine_setting(config: dict, fields: dict):
    assert speculative_config_fields(json.dumps(config)) == fields


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{method: ngram}", "--speculative-config is not JSON"),
        ('["ngram"]', "must be a JSON object"),
        ("{}", "needs a method (ngram, draft_model) or a model"),
        ('{"method": "eagle3", "model": "x"}', "method 'eagle3' is not supported"),
        ('{"method": "suffix"}', "looks up the worker's earlier replies"),
        ('{"method": "draft_model"}', "method draft_model needs a model"),
        ('{"method": "ngram", "model": "tiny-random"}', "method ngram takes no model"),
        ('{"model": ""}', "model must be a model name"),
        ('{"model": 3}', "model must be a model name"),
        ('{"method": "ngram", "num_speculative_tokens": "5"}', "must be an integer, got '5'"),
        ('{"method": "ngram", "prompt_lookup_max": true}', "must be an integer, got True"),
        ('{"method": "ngram", "prompt_lookup_max": 2.5}', "must be an integer, got 2.5"),
        (
            '{"model": "tiny-random", "draft_tensor_parallel_size": 2}',
            "draft_tensor_parallel_size must be 1",
        ),
        (
            '{"method": "ngram", "disable_by_batch_size": 4, "acceptance": 1}',
            "unsupported key(s) acceptance",
        ),
        ('{"method": "ngram", "disable_by_batch_size": "4"}', "must be an integer, got '4'"),
    ],
)
def test_what_jitney_cannot_honour_is_refused_by_name(text: str, error: str):
    with pytest.raises(ValueError, match=re.escape(error)):
        speculative_config_fields(text)


def test_the_flag_sets_the_engine_config():
    config = config_of("--speculative-config", json.dumps(NGRAM))
    want = SpeculativeOptions("ngram", num_speculative_tokens=5, prompt_lookup_max=6)
    assert config == EngineConfig(speculative=want)
    draft = config_of("--speculative-config", '{"method": "draft_model", "model": "tiny-random"}')
    assert draft.scheduler_config().speculative.method == "draft"
    assert draft.speculative.model == "tiny-random"
    # Flags it does not name still apply beside it.
    config = config_of("--speculative-config", json.dumps(NGRAM), "--prompt-lookup-min", "3")
    assert (config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max) == (3, 6)
    cutoff = config_of("--speculative-config", '{"method": "ngram", "disable_by_batch_size": 4}')
    assert cutoff.scheduler_config().speculative.disable_by_batch_size == 4
    two = config_of("--speculative-disable-by-batch-size", "2")
    assert two.speculative.disable_by_batch_size == 2


def test_a_field_set_both_ways_is_refused():
    with pytest.raises(ValueError, match="sets num_speculative_tokens; leave out --num-spec"):
        config_of("--speculative-config", json.dumps(NGRAM), "--num-speculative-tokens", "3")
    with pytest.raises(ValueError, match=r"sets speculative; leave out --speculative$"):
        config_of("--speculative-config", json.dumps(NGRAM), "--speculative", "none")
    # A flag that repeats its default was still given: which one wins would be a guess.
    with pytest.raises(ValueError, match=r"sets speculative; leave out --speculative$"):
        config_of("--speculative", "auto", "--speculative-config", json.dumps(NGRAM))


# (A field whose default is None has no command line that repeats it: any value differs.)
@pytest.mark.parametrize("field", [f for f in FIELDS if engine_flag_defaults()[f] is not None])
def test_every_field_the_object_sets_is_refused_beside_its_flag_even_at_its_default(field):
    default = engine_flag_defaults()[field]
    key = {v: k for k, v in INT_KEYS.items()}.get(field)
    text = json.dumps({"method": "ngram", **({key: default} if key else {})})
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"sets {field}; leave out {flag}$"):
        config_of("--speculative-config", text, flag, str(default))


def test_values_out_of_range_are_the_engine_config_s_errors():
    with pytest.raises(ValueError, match="prompt_lookup"):
        config_of("--speculative-config", '{"method": "ngram", "prompt_lookup_max": 0}')
    with pytest.raises(ValueError, match="disable_by_batch_size must be >= 1"):
        config_of("--speculative-config", '{"method": "ngram", "disable_by_batch_size": 0}')


def test_up_passes_it_to_its_workers_and_the_environment_sets_it(monkeypatch):
    text = json.dumps(NGRAM)
    monkeypatch.setenv("JITNEY_SPECULATIVE_CONFIG", text)
    args = build_parser(["up"]).parse_args(["up"])
    assert engine_config_from_args(args).speculative.num_speculative_tokens == 5
    argv = engine_args_to_argv(args)
    assert argv[argv.index("--speculative-config") + 1] == text
    worker = build_parser(["worker"]).parse_args(["worker", *argv])
    assert engine_config_from_args(worker) == engine_config_from_args(args)


def test_generate_runs_with_it_and_refuses_a_bad_one_before_loading():
    good = jitney_generate(
        *TINY, "--max-tokens", "8", "--speculative-config", json.dumps(NGRAM), "hello hello"
    )
    assert good.returncode == 0, good.stderr
    bad = jitney_generate(*TINY, "--speculative-config", '{"method": "medusa"}', "hello")
    assert bad.returncode != 0
    assert "generate: --speculative-config: method 'medusa' is not supported" in bad.stderr
    assert "model ready" not in bad.stderr and "Traceback" not in bad.stderr


def test_a_draft_model_named_in_it_drafts_and_the_target_verifies():
    from engine.llm_engine import Engine
    from engine.models.model_loader import load_model
    from generation.sampling_params import SamplingParams

    text = '{"method": "draft_model", "model": "tiny-random", "num_speculative_tokens": 4}'
    config = config_of("--speculative-config", text, "--speculative-draft-row-cost", "0")
    engine = Engine(config, loaded=load_model("tiny-random"))
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert engine.drafter is not None
    # The target is its own draft: its greedy picks, kept almost always.
    assert engine.stats.num_draft_tokens_total >= 12
    assert engine.stats.num_accepted_tokens_total >= 0.9 * engine.stats.num_draft_tokens_total
