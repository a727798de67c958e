"""Lists of prompts on /v1/completions through the whole system (redis-server, a tiny-random
`jitney worker`, the gateway) with the official `openai` client: each prompt's choices are what
that prompt gets alone (greedy, and seeded sampling with n > 1), in OpenAI's order, streamed
too, with echo's log-probs per prompt (lm-evaluation-harness' batched loglikelihood)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.service.helpers import MODEL, offline
from tests.services import running_system

ID_PROMPTS = [[5, 17, 42, 99], [120, 7, 61], [8, 9, 10, 11, 12, 13]]
TEXT_PROMPTS = ["Hello there", "The capital of", "one two three"]
GREEDY = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_system(("pl1",)) as system:
        yield openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)


def alone(client: openai.OpenAI, prompt: str | list[int], **kw: object) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=prompt, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompts", [ID_PROMPTS, TEXT_PROMPTS], ids=["ids", "texts"])
def test_each_prompt_gets_what_it_gets_alone(client, prompts):
    """Greedy: choice i is prompt i's own completion; usage is the singles' summed."""
    together = alone(client, prompts, **GREEDY)
    singles = [alone(client, p, **GREEDY) for p in prompts]
    assert [c.index for c in together.choices] == list(range(len(prompts)))
    assert [c.text for c in together.choices] == [s.choices[0].text for s in singles]
    if prompts is ID_PROMPTS:  # and the offline engine's own greedy text
        assert [c.text for c in together.choices] == [o.text for o in offline(prompts, 8)]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(together.usage, field) == sum(getattr(s.usage, field) for s in singles)


def test_seeded_choices_of_each_prompt_in_openai_order(client):
    """n=2 with a seed: prompt i's choices are indices 2i and 2i+1, each the single request's."""
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2}
    together = alone(client, ID_PROMPTS, **sampled)
    want = [c.text for p in ID_PROMPTS for c in alone(client, p, **sampled).choices]
    assert [c.index for c in together.choices] == list(range(2 * len(ID_PROMPTS)))
    assert [c.text for c in together.choices] == want


def test_a_streamed_list_equals_the_whole_body(client):
    stream = alone(
        client, TEXT_PROMPTS, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts = [""] * len(TEXT_PROMPTS)
    reasons: list[str | None] = [None] * len(TEXT_PROMPTS)
    usages = []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    whole = alone(client, TEXT_PROMPTS, **GREEDY)
    assert texts == [c.text for c in whole.choices]
    assert reasons == ["length"] * len(TEXT_PROMPTS)
    [usage] = usages
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 8 * len(TEXT_PROMPTS)


def test_echo_logprobs_per_prompt_as_a_loglikelihood_batch_asks(client):
    """echo + logprobs + max_tokens 0 on a list: each choice is that prompt's own echo."""
    scoring = {"max_tokens": 0, "echo": True, "logprobs": 1}
    together = alone(client, ID_PROMPTS, **scoring)
    for choice, prompt in zip(together.choices, ID_PROMPTS, strict=True):
        [single] = alone(client, prompt, **scoring).choices
        assert choice.text == single.text
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert len(choice.logprobs.token_logprobs) == len(prompt)
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            single.logprobs.token_logprobs[1:], abs=1e-5
        )
    assert together.usage.completion_tokens == 0
    assert together.usage.prompt_tokens == sum(len(p) for p in ID_PROMPTS)


def test_bad_prompts_in_a_list_are_named(client):
    with pytest.raises(openai.BadRequestError) as e:
        alone(client, [[5, 6], [7, 10**6]], max_tokens=2)
    assert "prompt[1]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        alone(client, [], max_tokens=2)
    assert e.value.body["param"] == "prompt"
