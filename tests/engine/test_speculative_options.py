"""The engine's speculative settings are one object on EngineConfig; the flat names the flags use
reach its fields, and what is left open resolves into the scheduler's settings."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig
from engine.speculative_options import FLAT_FIELDS, SPEC, SpeculativeOptions
from scheduler import SpeculativeConfig

# A value per flat name that differs from its default (and is valid beside the others).
FLAT_VALUES = {
    "speculative": "draft",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 5,
    "prompt_lookup_min": 1,
    "prompt_lookup_resume": False,
    "speculative_history_tokens": 10,
    "speculative_max_step_tokens": 6,
    "speculative_draft_row_cost": 0.5,
    "speculative_disable_by_batch_size": 2,
    "speculative_model": "tiny-random",
    "speculative_kv_cache_memory": "1MiB",
}


def test_every_flat_name_sets_its_field_and_the_rest_are_the_engine_s_own():
    assert set(FLAT_VALUES) == set(FLAT_FIELDS)
    assert set(FLAT_FIELDS.values()) == {f.name for f in dataclasses.fields(SpeculativeOptions)}
    config = EngineConfig.from_flat(max_num_seqs=3, **FLAT_VALUES)
    assert config.max_num_seqs == 3
    for name, value in FLAT_VALUES.items():
        assert getattr(config.speculative, FLAT_FIELDS[name]) == value, name
    again = config.replace_flat(prompt_lookup_min=2, block_size=32)
    assert (again.speculative.prompt_lookup_min, again.block_size) == (2, 32)
    assert again.speculative.model == "tiny-random"  # the others kept
    with pytest.raises(TypeError, match="speculative_tokens"):
        EngineConfig.from_flat(speculative_tokens=3)


def test_a_flat_setting_given_to_the_constructor_is_refused_with_the_way_to_give_it():
    with pytest.raises(TypeError, match=r"SpeculativeOptions.*EngineConfig\.from_flat"):
        EngineConfig(speculative="ngram")  # type: ignore[arg-type]


def test_what_is_left_open_resolves_into_the_scheduler_s_settings():
    auto = SpeculativeOptions()
    assert (auto.method_for("continuous"), auto.method_for("static")) == ("ngram", "none")
    assert SpeculativeOptions(model="tiny-random").method_for("continuous") == "draft"
    resolved = auto.resolve("continuous")
    assert resolved == SpeculativeConfig(
        "ngram",
        max_step_tokens=SPEC.max_step_tokens,
        draft_row_cost=SPEC.draft_row_cost,
        measure_row_cost=True,
    )
    # Start-up's figures (which are the configured ones where set: engine/startup.py) fill the
    # row cap and cost; without them, the configured ones; a configured cost is not measured.
    assert auto.resolve("continuous", 4, 0.25).max_step_tokens == 4
    fixed = SpeculativeOptions(max_step_tokens=12, draft_row_cost=0.3).resolve("continuous")
    assert (fixed.max_step_tokens, fixed.draft_row_cost, fixed.measure_row_cost) == (12, 0.3, False)
    assert EngineConfig().scheduler_config().speculative == resolved


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"method": "medusa"}, "speculative must be one of"),
        ({"method": "ngram", "model": "tiny-random"}, "cannot go with --speculative ngram"),
        ({"method": "draft"}, "needs a draft model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"max_step_tokens": 1}, "max_step_tokens must be >= 2"),
        ({"draft_row_cost": 1.5}, "draft_row_cost must be within"),
    ],
)
def test_bad_settings_are_refused_when_the_object_is_built(options: dict, error: str):
    with pytest.raises(ValueError, match=error):
        SpeculativeOptions(**options)


def test_a_draft_model_needs_continuous_batching():
    with pytest.raises(ValueError, match="continuous batching only"):
        EngineConfig(batching="static", speculative=SpeculativeOptions(model="tiny-random"))
