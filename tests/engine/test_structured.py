"""Structured outputs in the engine: grammar masks on the tiny model (random weights, so any
valid output is the grammar's doing), batched with free rows, resumed after a takeover."""

import json
import random

import jsonschema
import llguidance
import pytest

from engine.errors import GrammarError
from engine.models.model_loader import load_model
from generation import SamplingParams
from tests.engine.engine_helpers import make_engine


@pytest.fixture(scope="module")
def engine():
    return make_engine(load_model("tiny-random"), max_num_seqs=16)


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


def test_sampled_outputs_follow_the_schema_beside_free_rows(engine):
    """16 sampled rows, half constrained: every constrained output parses and validates and
    ends as "stop" when its JSON is complete; free rows draw what they draw alone."""
    grammar = json_grammar(PERSON)
    prompts = [[5 + i, 6, 7] for i in range(16)]
    free = [SamplingParams(max_tokens=20, seed=i, ignore_eos=True) for i in range(16)]
    params = [
        SamplingParams(max_tokens=120, seed=i, grammar=grammar) if i % 2 else free[i]
        for i in range(16)
    ]
    results = engine.generate(prompts, params)
    alone = engine.generate(prompts[::2], free[::2])
    for i, result in enumerate(results):
        if i % 2:
            assert result.finish_reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), PERSON)
        else:
            assert result.token_ids == alone[i // 2].token_ids
    assert engine.view.kv_used_blocks == 0


def test_regex_choice_and_greedy(engine):
    grammar = llguidance.LLMatcher.grammar_from_regex(r"(yes|no|maybe) [0-9]{2}")
    for temperature in (0, 1):
        results = engine.generate(
            [[9, 10], [11]], SamplingParams(max_tokens=30, temperature=temperature, grammar=grammar)
        )
        for result in results:
            assert result.finish_reason == "stop"
            word, number = result.text.split(" ")
            assert word in {"yes", "no", "maybe"} and len(number) == 2 and number.isdigit()


def test_a_taken_over_request_resumes_its_grammar_after_the_delivered_tokens(engine):
    grammar = json_grammar(PERSON)
    params = SamplingParams(max_tokens=120, seed=7, grammar=grammar)
    whole = engine.generate([[5, 6]], params)[0]
    delivered = whole.token_ids[:9]
    engine.add_request("resumed", [5, 6], params, output_token_ids=delivered)
    rest = []
    while engine.has_unfinished():
        for out in engine.step():
            rest += out.new_token_ids
    assert delivered + rest == whole.token_ids  # same seed, same position: same draws
    jsonschema.validate(json.loads(engine.loaded.tokenizer.decode(delivered + rest)), PERSON)


def test_grammar_errors_are_refused_before_anything_is_queued(engine):
    with pytest.raises(GrammarError, match="does not compile"):
        engine.add_request("bad", [5], SamplingParams(grammar=json_grammar({"type": "nope"})))
    grammar = llguidance.LLMatcher.grammar_from_regex("[0-9]+")
    letters = engine.loaded.tokenizer.encode("abc")
    with pytest.raises(GrammarError, match="break the grammar"):
        engine.add_request("bad", [5], SamplingParams(grammar=grammar), output_token_ids=letters)
    assert not engine.has_unfinished()


def test_logprobs_of_constrained_tokens_are_renormalised_over_the_allowed_ones(engine):
    """The mask is part of the distribution the token was drawn from: a forced token has
    log-prob 0 and alternatives are only allowed tokens."""
    grammar = llguidance.LLMatcher.grammar_from_regex("ab")
    result = engine.generate(
        [[5]], SamplingParams(max_tokens=5, seed=1, grammar=grammar, logprobs=2)
    )[0]
    assert result.text == "ab"
    for lp in result.logprobs:
        assert lp.logprob == pytest.approx(0.0, abs=1e-6)
        assert lp.top[1][1] == float("-inf")


@pytest.mark.parametrize("seed", range(3))
def test_random_schemas_always_validate(engine, seed):
    """Schemas drawn at random (nesting, enums, arrays, optional fields) on random weights."""
    rng = random.Random(seed)
    schemas = [random_schema(rng, depth=0) for _ in range(8)]
    params = [
        SamplingParams(max_tokens=400, seed=rng.getrandbits(32), grammar=json_grammar(s))
        for s in schemas
    ]
    results = engine.generate([[5, 6, 7]] * len(schemas), params)
    for schema, result in zip(schemas, results, strict=True):
        assert result.finish_reason == "stop", (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)


def random_schema(rng: random.Random, depth: int) -> dict:
    """A bounded schema (so any valid output fits the token budget)."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randrange(1, 8)}
    if kind == "integer":
        return {"type": "integer", "minimum": -50, "maximum": 50}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 1}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, None, True], rng.randrange(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": 3}
    names = rng.sample(["id", "name", "kind", "items", "meta", "score"], rng.randrange(1, 4))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": rng.sample(names, rng.randrange(0, len(names) + 1)),
        "additionalProperties": False,
    }
