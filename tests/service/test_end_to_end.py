"""The whole system: real redis-server, `jitney gateway` and `jitney worker` processes, real HTTP.

Streaming and non-streaming requests through the gateway give what the engine gives offline;
a client that goes away mid-stream frees its slot and KV; /metrics agree with what was served.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import aiohttp
import pytest

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation import SamplingParams
from tests.service.helpers import MODEL, assert_same_greedy_text, offline, stream_completion
from tests.services import Worker, running_stack, wait_for


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[str, Worker]]:
    with running_stack("e2e-w1") as stack:
        yield stack


async def test_concurrent_streaming_and_plain_requests_match_offline(system):
    """8 concurrent requests, half streamed: each text equals the offline engine's."""
    base, _ = system
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 280) for _ in range(rng.randrange(4, 30))] for _ in range(8)]
    n = 12
    body = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:

        async def plain(prompt: list[int]) -> tuple[str, dict]:
            async with session.post(
                f"{base}/v1/completions", json={**body, "prompt": prompt}
            ) as resp:
                assert resp.status == 200, await resp.text()
                data = await resp.json()
                return data["choices"][0]["text"], data["usage"]

        results = await asyncio.gather(
            *[
                stream_completion(session, base, {**body, "prompt": p}) if i % 2 else plain(p)
                for i, p in enumerate(prompts)
            ]
        )
    ref = load_model(MODEL)
    for prompt, want, (text, usage) in zip(prompts, offline(prompts, n), results, strict=True):
        assert usage["completion_tokens"] == n and usage["prompt_tokens"] == len(prompt)
        assert_same_greedy_text(ref, prompt, text, want)


async def test_stop_string_cuts_the_text_in_the_gateway_and_ends_the_work(system):
    """The gateway detokenizes and finds stop strings: the text, streamed or not, is the run
    without the stop cut before it, finish_reason is "stop", and the worker ends the request
    (counted as a "stop" finish) instead of generating to max_tokens."""
    base, worker = system
    n = 40
    body = {"model": MODEL, "prompt": [5, 9, 40, 77], "max_tokens": n, "temperature": 0}
    body["ignore_eos"] = True
    async with aiohttp.ClientSession() as session:
        full, usage = await stream_completion(session, base, body)
        assert usage["completion_tokens"] == n
        # A stop string that first occurs after the first character.
        at = next(i for i in range(1, len(full) - 1) if full.find(full[i : i + 2]) == i)
        stop = full[at : at + 2]
        stops_before = worker.metric("jitney_requests_finished_total", reason="stop")
        body["stop"] = [stop]
        streamed, streamed_usage = await stream_completion(session, base, body)
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            plain = await resp.json()
    assert streamed == plain["choices"][0]["text"] == full[:at]
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert streamed_usage["completion_tokens"] < n and plain["usage"]["completion_tokens"] < n
    wait_for(
        lambda: worker.metric("jitney_requests_finished_total", reason="stop") == stops_before + 2,
        10,
        "both requests ended by the worker as stopped",
    )
    wait_for(lambda: worker.metric("jitney_requests_running") == 0, 10, "running back to 0")


async def test_logit_bias_and_min_tokens_reach_the_workers_sampler(system):
    """A +100 bias makes every greedy token the biased one, through gateway, Redis and worker;
    min_tokens keeps a stop token from ending the request early."""
    base, _ = system
    tokenizer = load_model(MODEL).tokenizer
    body = {"model": MODEL, "prompt": [5, 9, 40], "max_tokens": 5, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{base}/v1/completions", json={**body, "logit_bias": {"72": 100}}
        ) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        assert out["choices"][0]["text"] == tokenizer.decode([72] * 5)
        held = {**body, "logit_bias": {"72": 100}, "stop_token_ids": [72], "min_tokens": 3}
        async with session.post(f"{base}/v1/completions", json=held) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
    # 72 is a stop token: with the bias it is picked as soon as min_tokens allows it.
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_through_the_service_are_the_engines(system):
    """completions `logprobs: 2`: the worker's sampler computes them, the gateway shapes them;
    they equal the offline engine's for the same greedy tokens."""
    base, _ = system
    prompt, n = [5, 9, 40, 77], 6
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        served = (await resp.json())["choices"][0]["logprobs"]
    loaded = load_model(MODEL)
    engine = Engine(EngineConfig(model=MODEL, kv_cache_memory="16MiB"), loaded=loaded)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
    want = engine.generate([prompt], params)[0]
    texts = [loaded.tokenizer.decode([t]) for t in want.token_ids]
    assert served["tokens"] == texts and len(served["top_logprobs"]) == n
    assert served["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert served["text_offset"] == [sum(map(len, texts[:i])) for i in range(n)]


async def test_client_gone_mid_stream_frees_slot_and_kv(system):
    """Closing the connection mid-stream: the worker aborts, running and KV usage return to 0."""
    base, worker = system
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    aborted_before = worker.metric("jitney_requests_finished_total", reason="abort")
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{base}/v1/completions", json=body)
        assert resp.status == 200
        chunks = 0
        async for raw in resp.content:
            chunks += raw.startswith(b"data: ")
            if chunks >= 3:
                break
        assert worker.metric("jitney_requests_running") == 1
        resp.close()  # the client goes away
    wait_for(
        lambda: (
            worker.metric("jitney_requests_finished_total", reason="abort") == aborted_before + 1
        ),
        30,
        "the worker to abort the request",
    )
    wait_for(lambda: worker.metric("jitney_requests_running") == 0, 10, "running back to 0")
    assert worker.metric("jitney_kv_cache_usage_ratio") == 0
    assert worker.metric("jitney_kv_blocks_free") == worker.metric("jitney_kv_blocks_total")


async def test_metrics_agree_with_what_was_served(system):
    """Worker token counters and gateway request counters move by exactly what was served."""
    base, worker = system
    gen_before = worker.metric("jitney_generation_tokens_total")
    prompt_before = worker.metric("jitney_prompt_tokens_total")
    usage_total = {"prompt_tokens": 0, "completion_tokens": 0}
    async with aiohttp.ClientSession() as session:

        async def gateway_count() -> float:
            async with session.get(f"{base}/metrics") as resp:
                text = await resp.text()
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("jitney_http_requests_total{")
                and 'route="/v1/chat/completions"' in line
                and 'status="200"' in line
            )

        served_before = await gateway_count()
        for i in range(3):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 5 + i,
                "temperature": 0,
            }
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
            for k in usage_total:
                usage_total[k] += usage[k]
        assert await gateway_count() == served_before + 3
    assert (
        worker.metric("jitney_generation_tokens_total") - gen_before
        == usage_total["completion_tokens"]
    )
    assert (
        worker.metric("jitney_prompt_tokens_total") - prompt_before == usage_total["prompt_tokens"]
    )
