"""Reasoning with the official `openai` client, unchanged, against the whole system: a random-weight
model whose chat template opens `<think>` (DeepSeek-R1's and Qwen3.5's way) or, with
`chat_template_kwargs={"enable_thinking": False}`, closes it, served behind
`--reasoning-parser deepseek_r1`. Each answer is checked against the same prompt's raw text
(/v1/completions, greedy), split as the parser's rule says; streamed and whole agree; the
Responses API answers a reasoning item; a grammar runs in the worker for the content only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import requests

from generation.reasoning import FORMATS, split
from tests.model_dirs import SMALL_LLAMA, write_random_llama
from tests.services import RedisServer, start_gateway, start_worker, wait_ready

NAME = "thinker"  # the model directory's name: its served name
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
R1 = FORMATS["deepseek_r1"]
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 8
CLOSED = {"chat_template_kwargs": {"enable_thinking": False}}
# Greedy to max_tokens (vLLM's ignore_eos): every answer of one prompt is the same tokens.
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class Served:
    client: openai.OpenAI
    base: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    models = tmp_path_factory.mktemp("models")
    model_dir = write_random_llama(models / NAME, seed=11, **SMALL_LLAMA)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    server = RedisServer().start()
    worker = start_worker(server, "think-1", model=str(model_dir))
    gateway = start_gateway(server, "--reasoning-parser", "deepseek_r1")
    try:
        wait_ready(server.client(), worker)
        gateway.wait_ready()
        client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)
        yield Served(client, gateway.base)
    finally:
        gateway.proc.stop()
        worker.proc.stop()
        server.close()


def raw(served: Served, extra: dict[str, Any]) -> tuple[str, str]:
    """The prompt's text and the model's raw greedy output after it (no parser on
    /v1/completions), for the chat of MESSAGES rendered as the chat route renders it."""
    body = {"model": NAME, "messages": MESSAGES, **extra}
    ids = requests.post(f"{served.base}/tokenize", json=body, timeout=30).json()["tokens"]
    prompt = requests.post(f"{served.base}/detokenize", json={"tokens": ids}, timeout=30).json()
    completion = served.client.completions.create(
        model=NAME, prompt=ids, max_tokens=MAX_TOKENS, **GREEDY
    )
    return prompt["prompt"], completion.choices[0].text


def chat(served: Served, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    """A greedy chat completion of MESSAGES (`extra`: more of the body)."""
    body = {"ignore_eos": True, **(extra or {})}
    return served.client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=body,
        **fields,
    )


def expected(served: Served, extra: dict[str, Any]) -> tuple[str | None, str | None]:
    """The message's (reasoning_content, content): the raw output split by the parser's rule."""
    prompt, text = raw(served, extra)
    reasoning, content = split(R1, text, prompt)
    return reasoning or None, content or None


def test_the_answer_is_reasoning_while_the_template_opened_it(served: Served) -> None:
    out = chat(served)
    message = out.choices[0].message
    reasoning, content = expected(served, {})
    assert reasoning is not None and content is None  # random weights never write </think>
    assert (message.reasoning_content, message.content) == (reasoning, content)
    details = out.usage.completion_tokens_details
    assert details.reasoning_tokens == out.usage.completion_tokens == MAX_TOKENS


def test_the_stream_agrees_with_the_whole_answer(served: Served) -> None:
    whole = chat(served)
    chunks = list(chat(served, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == whole.choices[0].message.reasoning_content and not content
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.reasoning_tokens == MAX_TOKENS


def test_enable_thinking_false_makes_the_answer_content(served: Served) -> None:
    out = chat(served, CLOSED)
    message = out.choices[0].message
    prompt, text = raw(served, CLOSED)
    assert prompt.endswith("</think>\n\n")
    assert (message.reasoning_content, message.content) == (None, text)
    assert out.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_grammar_holds_for_the_content_only(served: Served) -> None:
    """The worker compiles the wrapped grammar: while the template opened the reasoning the
    output is free text up to max_tokens; closed, it is the JSON the format asks for."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    reasoned = served.client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, response_format=fmt
    )
    assert reasoned.choices[0].finish_reason == "length"
    assert reasoned.choices[0].message.content is None
    closed = served.client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        response_format=fmt,
        extra_body=CLOSED,
    )
    assert json.loads(closed.choices[0].message.content) in ({"ok": True}, {"ok": False})


def test_a_response_holds_the_reasoning_item(served: Served) -> None:
    response = served.client.responses.create(
        model=NAME, input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS, **GREEDY
    )
    [item] = response.output
    reasoning, _ = expected(served, {})
    assert item.type == "reasoning" and item.content[0].text == reasoning
    assert response.status == "incomplete" and item.status == "incomplete"
    assert response.usage.output_tokens_details.reasoning_tokens == MAX_TOKENS
    events = list(
        served.client.responses.create(
            model=NAME,
            input=MESSAGES[0]["content"],
            max_output_tokens=MAX_TOKENS,
            stream=True,
            **GREEDY,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning
    assert events[-1].response.output[0].content[0].text == reasoning
