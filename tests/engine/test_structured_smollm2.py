"""JSON-schema-constrained output on the real default model: 50 schemas and prompts (nested
objects, enums, arrays, required and optional fields), batched; every output parses and
validates against its schema."""

import json
import random

import jsonschema
import pytest

from engine.models.model_loader import load_model
from generation import SamplingParams
from generation.grammar import json_schema
from tests.engine.engine_helpers import chat, make_engine


def text(max_length: int = 24) -> dict:
    return {"type": "string", "maxLength": max_length}


def integer(lo: int = 0, hi: int = 1000) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def obj(required: list[str], optional: dict | None = None, **props: dict) -> dict:
    return {
        "type": "object",
        "properties": {**props, **(optional or {})},
        "required": required,
        "additionalProperties": False,
    }


def array(items: dict, max_items: int = 4, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


SUBJECTS = [
    (
        "a person who lives in Paris",
        obj(
            ["name", "age", "city"],
            {"email": text(40)},
            name=text(),
            age=integer(0, 120),
            city=text(),
        ),
    ),
    (
        "a laptop for sale",
        obj(
            ["product", "price", "in_stock", "tags"],
            product=text(),
            price=integer(1, 5000),
            in_stock={"type": "boolean"},
            tags=array(text(12), 3),
        ),
    ),
    (
        "a recipe for pancakes",
        obj(
            ["title", "ingredients", "difficulty"],
            title=text(),
            ingredients=array(obj(["item", "grams"], item=text(16), grams=integer(1, 1000)), 5, 1),
            difficulty={"enum": ["easy", "medium", "hard"]},
        ),
    ),
    (
        "the weather in London today",
        obj(
            ["city", "temperature_c", "condition"],
            city=text(),
            temperature_c=integer(-40, 50),
            condition={"enum": ["sunny", "cloudy", "rain", "snow"]},
        ),
    ),
    (
        "a small company with two employees",
        obj(
            ["company", "employees"],
            company=text(),
            employees=array(
                obj(
                    ["name", "role"],
                    name=text(16),
                    role={"enum": ["engineer", "manager", "designer"]},
                ),
                3,
                1,
            ),
        ),
    ),
    (
        "a movie you like",
        obj(
            ["title", "year", "genres", "rating"],
            {"director": text()},
            title=text(),
            year=integer(1900, 2030),
            genres=array({"enum": ["drama", "comedy", "action", "sci-fi"]}, 3, 1),
            rating=integer(1, 10),
        ),
    ),
    (
        "a shipping address",
        obj(
            ["recipient", "address"],
            recipient=text(),
            address=obj(
                ["street", "city", "zip"],
                street=text(30),
                city=text(),
                zip={"type": "string", "pattern": "^[0-9]{5}$"},
            ),
        ),
    ),
    (
        "a to-do list for tomorrow",
        obj(
            ["items"],
            items=array(obj(["task", "done"], task=text(30), done={"type": "boolean"}), 4, 1),
        ),
    ),
    (
        "a bank transfer",
        obj(
            ["from_account", "to_account", "amount", "currency"],
            from_account={"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
            to_account={"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
            amount=integer(1, 100000),
            currency={"enum": ["EUR", "USD", "GBP"]},
        ),
    ),
    (
        "the sentiment of the sentence 'I love this phone'",
        obj(
            ["sentiment", "confidence"],
            sentiment={"enum": ["positive", "negative", "neutral"]},
            confidence=integer(0, 100),
        ),
    ),
]
STYLES = [
    "Describe {} as JSON.",
    "Give me {} in JSON format.",
    "Return a JSON object about {}.",
    "Write {} as a JSON record.",
    "Output only JSON: {}.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_fifty_schemas_always_parse_and_validate(smollm2):
    rng = random.Random(0)
    cases = [(style.format(subject), schema) for subject, schema in SUBJECTS for style in STYLES]
    assert len(cases) == 50
    prompts = [chat(smollm2, question) for question, _ in cases]
    # Half greedy, half sampled: a constrained sample must validate as surely as the argmax.
    params = [
        SamplingParams(
            max_tokens=300,
            temperature=0 if i % 2 else 0.8,
            seed=rng.getrandbits(32),
            grammar=json_schema(schema),
        )
        for i, (_, schema) in enumerate(cases)
    ]
    engine = make_engine(smollm2, kv_cache_memory="256MiB", max_num_seqs=50)
    results = engine.generate(prompts, params)
    for (question, schema), result in zip(cases, results, strict=True):
        assert result.finish_reason == "stop", (question, result.text)
        jsonschema.validate(json.loads(result.text), schema)
    assert engine.view.kv_used_blocks == 0
