"""The official `openai` client, unchanged, against the whole system (redis-server, a tiny-random
worker, the gateway): log-probs (generated, and the prompt's through echo) equal to transformers'
own log-softmax, n > 1, structured outputs with `.parse`, and a forced tool call."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.models.model_loader import LoadedModel, load_model
from tests.engine.engine_helpers import next_token_logprobs
from tests.service.helpers import MODEL, offline
from tests.services import running_system

PROMPT = [5, 17, 42, 99, 120, 7, 61]  # token ids: no tokenizer round trip in the comparison
TOL = 1e-4


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_system(("oa1",)) as system:
        yield openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ref() -> LoadedModel:
    return load_model(MODEL)


def test_completion_logprobs_are_the_models_log_softmax(client, ref):
    """logprobs=5 with greedy: each token's log-prob and its top 5 are the reference's, in fp32,
    over the tokens the engine generated (the offline engine gives the same greedy ids)."""
    result = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        extra_body={"ignore_eos": True},
    )
    [choice] = result.choices
    generated = offline([PROMPT], 6)[0].token_ids
    assert choice.text == offline([PROMPT], 6)[0].text
    rows = next_token_logprobs(ref, PROMPT + generated)[len(PROMPT) - 1 :]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for j, token in enumerate(generated):
        assert lp.token_logprobs[j] == pytest.approx(float(rows[j, token]), abs=TOL)
        # A dict by token text: ids that decode alike share a key (OpenAI's shape), so each
        # value is one of the reference's top 5, the largest its top 1.
        want = rows[j].topk(5).values.tolist()
        got = lp.top_logprobs[j].values()
        assert all(min(abs(v - w) for w in want) < TOL for v in got)
        assert max(got) == pytest.approx(want[0], abs=TOL)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_max_tokens_0_gives_the_prompt_s_logprobs(client, ref):
    """lm-evaluation-harness' loglikelihood request: the prompt echoed with its tokens'
    log-probs (the first has none), nothing generated."""
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    [choice] = result.choices
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(PROMPT) and lp.token_logprobs[0] is None
    rows = next_token_logprobs(ref, PROMPT)
    for position in range(1, len(PROMPT)):
        want = float(rows[position - 1, PROMPT[position]])
        assert lp.token_logprobs[position] == pytest.approx(want, abs=TOL)
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(PROMPT)
    assert choice.text == "".join(lp.tokens)


def test_chat_logprobs_in_the_chat_shape(client):
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = result.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_greedy_are_identical_and_usage_counts_the_prompt_once(client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    kw["extra_body"] = {"ignore_eos": True}
    if not stream:
        result = client.completions.create(**kw)
        texts = {c.index: c.text for c in result.choices}
        usage = result.usage
    else:
        texts, usage = {}, None
        chunks = client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
    assert sorted(texts) == [0, 1, 2]
    assert texts[0] == texts[1] == texts[2] == offline([PROMPT], 8)[0].text
    assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens == 24


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_speculation_shows_in_usage_as_prediction_tokens(client, stream):
    """The worker speculates by default: a long greedy reply's usage says how many draft tokens
    were kept and dropped, in OpenAI's Predicted Outputs fields (the client parses them); the
    text is plain decoding's. A one-token reply verified nothing: no such details."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=120, temperature=0, n=2)
    kw["extra_body"] = {"ignore_eos": True}
    if stream:
        chunks = client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        texts: dict[int, str] = {}
        usage = None
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
    else:
        result = client.completions.create(**kw)
        texts, usage = {c.index: c.text for c in result.choices}, result.usage
    assert texts[0] == texts[1] == offline([PROMPT], 120)[0].text
    details = usage.completion_tokens_details
    kept, dropped = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert kept > 0 and dropped >= 0 and kept < usage.completion_tokens == 240
    short = client.completions.create(**{**kw, "max_tokens": 1, "n": 1})
    assert short.usage.completion_tokens_details is None


class Reply(BaseModel):
    answer: str = Field(max_length=12)
    confidence: int = Field(ge=0, le=100)
    labels: list[bool] = Field(max_length=3)


def test_parse_with_a_pydantic_response_format(client):
    """`.parse` sends a strict JSON schema and validates the reply with pydantic: on random
    weights, only the grammar can make it valid."""
    result = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format=Reply,
        max_tokens=200,
        temperature=1.0,
        seed=3,
    )
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Reply) and len(parsed.answer) <= 12


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


def test_a_required_tool_call_has_arguments_that_validate(client):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
        }
    ]
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=200,
        seed=5,
        temperature=1.0,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert call.id.startswith("call_") and call.type == "function"
