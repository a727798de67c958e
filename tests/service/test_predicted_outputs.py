"""OpenAI's Predicted Outputs through the whole service (the official client, a real worker):
a chat's `prediction` reaches the worker's drafts (its counters), usage says how many drafts
were kept, the reply is the one without it, completions take one too, and a bad one is a 400.

(The tiny random model's replies are bytes that do not survive text and back, so a reply sent
back as a prediction matches its tokens only in part; tests/engine/test_prediction.py checks
what a prediction that matches gives.)"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.service.helpers import MODEL
from tests.services import Worker, running_system

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say something long."}],
    "max_tokens": 60,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}
DRAFTED = "jitney_spec_decode_prediction_draft_tokens_total"
KEPT = "jitney_spec_decode_prediction_accepted_tokens_total"


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[openai.OpenAI, Worker]]:
    # Earlier replies off: a repeated request's drafts come from its prediction, not from them.
    flags = ("--speculative-history-tokens", "0")
    with running_system(("pred1",), worker_flags=flags) as system:
        client = openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)
        yield client, system.workers[0]


def kept(result) -> int:
    return result.usage.completion_tokens_details.accepted_prediction_tokens


def counted(worker: Worker, call) -> tuple[object, float, float]:
    """`call()`'s result and the prediction drafts it verified and kept (the worker's counters)."""
    before = worker.metric(DRAFTED), worker.metric(KEPT)
    result = call()
    return result, worker.metric(DRAFTED) - before[0], worker.metric(KEPT) - before[1]


def test_a_prediction_is_drafted_from_and_changes_nothing(service):
    client, worker = service
    plain, drafted, _ = counted(worker, lambda: client.chat.completions.create(**CHAT))
    assert drafted == 0
    text = plain.choices[0].message.content
    prediction = {"type": "content", "content": text}
    predicted, drafted, from_it = counted(
        worker, lambda: client.chat.completions.create(**CHAT, prediction=prediction)
    )
    assert predicted.choices[0].message.content == text
    assert drafted > 0 and 0 < from_it <= kept(predicted)
    parts = {"type": "content", "content": [{"type": "text", "text": text}]}
    streamed = client.chat.completions.create(
        **CHAT, prediction=parts, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert kept(chunks[-1]) == kept(predicted)


def test_a_wrong_prediction_changes_nothing_and_completions_take_one_too(service):
    client, worker = service
    text = client.chat.completions.create(**CHAT).choices[0].message.content
    wrong = {"type": "content", "content": "nothing like the reply " * 5}
    reply = client.chat.completions.create(**CHAT, prediction=wrong)
    assert reply.choices[0].message.content == text
    prompt = dict(model=MODEL, prompt=[5, 17, 42, 99], max_tokens=40, temperature=0)
    plain = client.completions.create(**prompt, extra_body={"ignore_eos": True})
    prediction = {"type": "content", "content": plain.choices[0].text}
    body = {"ignore_eos": True, "prediction": prediction}
    predicted, drafted, _ = counted(
        worker, lambda: client.completions.create(**prompt, extra_body=body)
    )
    assert predicted.choices[0].text == plain.choices[0].text and drafted > 0


def test_a_bad_prediction_is_a_400_naming_it(service):
    client, _ = service
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**CHAT, prediction={"type": "content", "content": 5})
    assert e.value.body["param"] == "prediction.content"
