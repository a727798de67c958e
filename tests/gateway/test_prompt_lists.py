"""Lists of prompts on /v1/completions, with the test playing the worker: one queue entry per
prompt, choices numbered prompt * n + i, usage summed, streams with every choice's index, errors
that name the prompt, one bound per request, admission and rate limits on the sum, and every
prompt's entry cancelled when the request ends early."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from gateway.config import RateLimits
from protocol import CancelMessage, ReplyMessage, RequestMessage
from tests.gateway.helpers import (
    KEYS,
    AnsweringWorker,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    enqueued_total,
    eventually,
    replies_for,
    sse_events,
    tokens,
)
from tests.gateway.test_batches import FAST, create_batch, file_lines, jsonl, line, wait_status

Client = TestClient[Any, Any]
COMPLETIONS = "/v1/completions"
PROMPTS = ["red?", "a longer blue?", "green"]


async def take_all(worker: FakeWorker, count: int) -> dict[str, RequestMessage]:
    """`count` entries off the queue, by request id."""
    requests = [await worker.take() for _ in range(count)]
    return {r.request_id: r for r in requests}


def answer_of(request: RequestMessage, prompt: int, choice: int) -> list[ReplyMessage]:
    """Choice `choice` of prompt `prompt`: the text "p<prompt>c<choice>" in two replies."""
    return replies_for(request, [f"p{prompt}", f"c{choice}"], index=choice)


def renumbered(replies: list[ReplyMessage]) -> list[ReplyMessage]:
    for seq, reply in enumerate(replies):
        reply.seq = seq
    return replies


async def answer_choices(
    worker: FakeWorker, requests: list[RequestMessage], n: int, cached: int = 0
) -> None:
    """Every prompt's n choices answered, the last prompt first and choices taking turns."""
    for p in reversed(range(len(requests))):
        request = requests[p]
        per_choice = [answer_of(request, p, i) for i in range(n)]
        replies = renumbered([r for pair in zip(*per_choice, strict=True) for r in pair])
        for reply in replies:
            reply.cached_tokens = cached if reply.is_final else 0
        await worker.reply(request, *replies)


async def test_each_prompt_is_an_entry_and_choices_come_in_openai_order(
    client: Client, fake_worker: FakeWorker
) -> None:
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 5, "priority": 3}
    call = asyncio.create_task(client.post(COMPLETIONS, json=body))
    taken = await take_all(fake_worker, len(PROMPTS))
    out_id = None
    requests = []
    for i, text in enumerate(PROMPTS):  # entry i: the prompt's own tokens, the request's params
        [request] = [r for r in taken.values() if r.prompt_token_ids == tokens(text)]
        assert request.request_id.endswith(f"-{i}") and request.priority == 3
        assert request.sampling_params.n == 2 and request.sampling_params.max_tokens == 5
        requests.append(request)
        out_id = request.request_id.rsplit("-", 1)[0]
    await answer_choices(fake_worker, requests, n=2, cached=1)
    response = await call
    out = await response.json()
    assert out["id"] == out_id == response.headers["X-Request-Id"]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [f"p{i // 2}c{i % 2}" for i in range(6)]
    prompt = sum(len(tokens(t)) for t in PROMPTS)
    completion = sum(len(tokens(c["text"])) for c in out["choices"])
    assert out["usage"] == {
        "prompt_tokens": prompt,  # each prompt once, whatever n
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": len(PROMPTS)},  # 1 per prompt, summed
    }


async def test_a_list_streams_every_choice_with_its_index_and_one_summed_usage(
    client: Client, fake_worker: FakeWorker
) -> None:
    body = {
        "prompt": [tokens(t) for t in PROMPTS[:2]],  # token-id lists
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    call = asyncio.create_task(client.post(COMPLETIONS, json=body))
    taken = await take_all(fake_worker, 2)
    requests = sorted(taken.values(), key=lambda r: r.request_id)
    await answer_choices(fake_worker, requests, n=2)
    events = sse_events(await (await call).text())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage_chunk = events[:-1]
    for index in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == f"p{index // 2}c{index % 2}"
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == sum(len(tokens(t)) for t in PROMPTS[:2])
    assert usage_chunk["usage"]["completion_tokens"] == 4 * len(tokens("p0c0"))


async def test_echo_is_each_prompt_s_own(client: Client, fake_worker: FakeWorker) -> None:
    prompts = [tokens("the cat"), tokens("a dog")]
    body = {"prompt": prompts, "echo": True, "max_tokens": 1}
    call = asyncio.create_task(client.post(COMPLETIONS, json=body))
    taken = await take_all(fake_worker, 2)
    for request in taken.values():
        await fake_worker.reply(request, *replies_for(request, ["!"], finish="length"))
    out = await (await call).json()
    assert [c["text"] for c in out["choices"]] == ["the cat!", "a dog!"]


@pytest.mark.parametrize("prompt", [["only"], [tokens("only")]])
async def test_a_list_of_one_is_the_single_prompt(
    client: Client, fake_worker: FakeWorker, prompt: list[Any]
) -> None:
    call = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": prompt}))
    request = await fake_worker.take()
    assert request.prompt_token_ids == tokens("only")
    await fake_worker.answer(request, ["fine"])
    out = await (await call).json()
    assert out["id"] == request.request_id  # no per-prompt suffix: the single request's own
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "fine")]


async def test_an_error_in_one_prompt_fails_the_request_and_cancels_the_others(
    client: Client, fake_worker: FakeWorker, served: redis.Redis
) -> None:
    call = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": PROMPTS}))
    taken = await take_all(fake_worker, len(PROMPTS))
    first, failing, third = sorted(taken.values(), key=lambda r: r.request_id)
    await fake_worker.answer(first, ["done"])
    await fake_worker.reply(third, ReplyMessage(third.request_id, 0, tokens("so")))
    await fake_worker.reject(failing, "error", error="boom", error_type="server_error")
    response = await call
    assert response.status == 500
    assert_openai_error(await response.json())

    def cancelled() -> set[str]:
        return {CancelMessage.decode(f).request_id for _, f in served.xrange(KEYS.cancels)}

    await eventually(lambda: third.request_id in cancelled())
    assert cancelled() == {third.request_id}  # the finished and the failed need none
    assert served.exists(KEYS.cancelled(third.request_id))


async def test_a_client_gone_cancels_every_prompt_s_entry(
    client: Client, fake_worker: FakeWorker, served: redis.Redis
) -> None:
    body = {"prompt": PROMPTS, "stream": True, "max_tokens": 30}
    response = await client.post(COMPLETIONS, json=body)
    taken = await take_all(fake_worker, len(PROMPTS))
    one = next(iter(taken.values()))
    await fake_worker.reply(one, ReplyMessage(one.request_id, 0, tokens("so")))
    await response.content.readany()  # the stream has begun
    response.close()  # the client goes away mid-stream
    for rid in taken:
        await eventually(lambda rid=rid: served.exists(KEYS.cancelled(rid)))
        assert served.get(KEYS.cancelled(rid)) == b"client_gone"


async def test_a_stop_string_ends_that_prompt_s_choice_only(
    client: Client, fake_worker: FakeWorker, served: redis.Redis
) -> None:
    body = {"prompt": PROMPTS[:2], "stop": ["END"], "max_tokens": 30}
    call = asyncio.create_task(client.post(COMPLETIONS, json=body))
    taken = await take_all(fake_worker, 2)
    first, second = sorted(taken.values(), key=lambda r: r.request_id)
    await fake_worker.reply(second, ReplyMessage(second.request_id, 0, tokens("x END y")))
    entries = await eventually(lambda: served.xrange(KEYS.cancels))
    cancel = CancelMessage.decode(entries[-1][1])
    assert (cancel.request_id, cancel.index) == (second.request_id, 0)
    await fake_worker.answer(first, ["fine"])
    out = await (await call).json()
    assert [(c["text"], c["finish_reason"]) for c in out["choices"]] == [
        ("fine", "stop"),
        ("x ", "stop"),
    ]


async def test_more_prompts_than_the_bound_is_a_400(
    served: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(max_prompts_per_request=2)
    response = await client.post(COMPLETIONS, json={"prompt": PROMPTS})
    assert response.status == 400
    out = await response.json()
    assert_openai_error(out, "prompt")
    assert "3 prompts" in out["error"]["message"] and "at most 2" in out["error"]["message"]
    assert enqueued_total(served) == 0


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (["fits", "x" * 60], "prompt[1]: This model's maximum context length is 64"),
        ([[5, 6], [7, 100_000]], "prompt[1]: 'prompt' holds token ids outside the vocabulary"),
        (["fits", ""], "'prompt[1]' must not be empty."),
        ([[5], []], "'prompt[1]' must not be empty."),
    ],
)
async def test_a_bad_prompt_is_named_and_nothing_is_enqueued(
    client: Client, served: redis.Redis, prompt: list[Any], words: str
) -> None:
    response = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 10})
    assert response.status == 400
    out = await response.json()
    assert_openai_error(out, "prompt")
    assert out["error"]["message"].startswith(words)
    assert enqueued_total(served) == 0


async def test_an_empty_list_is_a_400(client: Client, served: redis.Redis) -> None:
    response = await client.post(COMPLETIONS, json={"prompt": []})
    assert response.status == 400
    assert (await response.json())["error"]["message"] == "'prompt' must not be empty."
    assert enqueued_total(served) == 0


async def test_the_list_is_admitted_whole_on_its_summed_tokens(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """With 8 prompt tokens queued and a bound of 20, a list of two 7-token prompts (each of
    which would fit alone) is refused whole: nothing of it is enqueued."""
    client = await make_client(max_queued_tokens=20)
    waiting = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": list(range(5, 13))}))
    await eventually(lambda: enqueued_total(served) == 1)
    pair = [list(range(5, 12)), list(range(20, 27))]
    response = await client.post(COMPLETIONS, json={"prompt": pair})
    assert response.status == 429 and response.headers["Retry-After"]
    assert enqueued_total(served) == 1
    await fake_worker.answer(await fake_worker.take(), ["x"])
    assert (await waiting).status == 200


async def test_the_rate_limit_charges_every_prompt(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """tpm=40: a prompt of 5 tokens + max_tokens 10 costs 15, a list of three 45, over the
    bucket whole (a 400: it can never fit), where one of them alone is served."""
    client = await make_client(rate_limits=RateLimits(tpm=40))
    one = [5, 6, 7, 8, 9]
    response = await client.post(COMPLETIONS, json={"prompt": [one] * 3, "max_tokens": 10})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "tokens_over_rate_limit" and "needs 45 tokens" in error["message"]
    call = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": [one], "max_tokens": 10}))
    await fake_worker.answer(await fake_worker.take(), ["x"])
    assert (await call).status == 200
    assert enqueued_total(served) == 1


async def test_a_batch_line_with_a_list_of_prompts(
    served: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(**FAST)
    data = jsonl(line("pair", prompt=["a", "b"], n=2, max_tokens=2))
    with AnsweringWorker(served) as worker:
        batch = await create_batch(client, data)
        done = await wait_status(client, batch["id"], "completed")
    assert worker.answered == 2  # one entry per prompt
    [out] = await file_lines(client, done["output_file_id"])
    body = out["response"]["body"]
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(i, "ok") for i in range(4)]
    assert body["usage"]["prompt_tokens"] == len(tokens("a")) + len(tokens("b"))
