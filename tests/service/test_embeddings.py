"""/v1/embeddings through the whole system (redis-server, tiny-random `jitney worker`s, the
gateway) with the official `openai` client: the vectors are the offline engine's (as base64,
the client's default, and as floats), `dimensions` truncates, bad inputs are 400s, an urgent
embedding takes a seat from less urgent generation, and a worker killed mid-batch leaves the
vectors unchanged (another worker takes its inputs over)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import aiohttp
import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from engine.pooling import normalize
from tests.service.helpers import MODEL, assert_nothing_left
from tests.services import System, running_system, start_worker, wait_for, wait_ready

TOL = 1e-5
TEXTS = ["Hello there", "The capital of France", "one two three four five"]
IDS = [[5, 17, 42, 99], [120, 7, 61], list(range(8, 40))]


def offline(prompts: list[list[int]], pooling: str = "last") -> list[torch.Tensor]:
    config = EngineConfig(model=MODEL, kv_cache_memory="16MiB", pooling=pooling)
    return Engine(config, loaded=load_model(MODEL)).embed(prompts)


def assert_vectors(got: list[list[float]], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for vector, expected in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(vector), expected, atol=TOL, rtol=0)


@contextmanager
def concurrent_call(fn: Callable[..., Any], **kwargs: Any) -> Iterator[Future[Any]]:
    """`fn(**kwargs)` in a thread while the test goes on (not waited for if the test fails:
    stopping the system ends it)."""
    pool = ThreadPoolExecutor(1)
    try:
        yield pool.submit(fn, **kwargs)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def system() -> Iterator[System]:
    with running_system(("em1",), ("--max-num-seqs", "2")) as system:
        yield system


@pytest.fixture(scope="module")
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("encoding_format", [openai.NOT_GIVEN, "float"], ids=["base64", "float"])
def test_vectors_are_the_offline_engine_s(client, encoding_format):
    """Texts and token arrays, in one request each, as the client decodes them."""
    tokenizer = load_model(MODEL).tokenizer
    for inputs, ids in ((TEXTS, [tokenizer.encode(t) for t in TEXTS]), (IDS, IDS)):
        result = client.embeddings.create(
            model=MODEL, input=inputs, encoding_format=encoding_format
        )
        assert [d.index for d in result.data] == [0, 1, 2]
        assert_vectors([d.embedding for d in result.data], offline(ids))
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
        assert result.model == MODEL
    [one] = client.embeddings.create(model=MODEL, input=IDS[0]).data  # one token array
    assert_vectors([one.embedding], offline(IDS[:1]))


def test_dimensions_truncate_then_normalise(client):
    [item] = client.embeddings.create(model=MODEL, input=IDS[1], dimensions=8, user="u1").data
    full = offline(IDS[1:2])[0]
    assert_vectors([item.embedding], [normalize(full[:8])])


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[5], "x"]}, "input"),
        ({"input": list(range(5, 2100))}, "input"),  # past the context window (2048)
        ({"input": "a", "dimensions": 65}, "dimensions"),  # tiny-random's vectors have 64
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, **kwargs)
    assert e.value.body["param"] == param


async def test_an_urgent_embedding_takes_a_seat_from_less_urgent_generation(system):
    """Both seats hold long priority-9 generations: a priority-0 embedding is read by the full
    worker, which preempts one for it, and answers while the generations still run."""
    worker = system.workers[0]
    async with aiohttp.ClientSession() as session:

        async def generate() -> None:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1500, "ignore_eos": True}
            async with session.post(
                f"{system.base}/v1/completions", json={**body, "priority": 9}
            ) as response:
                await response.read()

        slow = [asyncio.create_task(generate()) for _ in range(3)]
        try:
            while worker.metric("jitney_requests_running") < 2:
                await asyncio.sleep(0.05)
            preempted = worker.metric("jitney_preemptions_total")
            start = time.monotonic()
            body = {"model": MODEL, "input": TEXTS, "priority": 0}
            async with session.post(f"{system.base}/v1/embeddings", json=body) as response:
                assert response.status == 200, await response.text()
                assert len((await response.json())["data"]) == len(TEXTS)
            assert time.monotonic() - start < 5.0
            assert not any(task.done() for task in slow)  # the priority-9 work still runs
            assert worker.metric("jitney_preemptions_total") > preempted
        finally:
            for task in slow:
                task.cancel()
    wait_for(lambda: worker.metric("jitney_requests_running") == 0, 30, "generations cancelled")


def test_a_worker_killed_mid_batch_leaves_the_vectors_unchanged():
    """Mean pooling, two seats: the worker answers the first inputs, then kills itself
    (SIGKILL) once it holds the fourth (a failpoint on its token 251). A second worker takes
    what it held over after the lease lapses, and serves the rest: the vectors are the offline
    engine's, all of them."""
    inputs = [[5 + i, 17, 42, 99 + i] for i in range(6)]
    inputs[3] = [9, 251, 30]
    crash = {"JITNEY_FAILPOINTS": "step_crash_token=251"}
    flags = ("--pooling", "mean", "--max-num-seqs", "2")
    with running_system(("victim",), flags, crash) as system:
        client = openai.OpenAI(
            base_url=f"{system.base}/v1", api_key="unused", max_retries=0, timeout=120
        )
        (victim,) = system.workers
        with concurrent_call(client.embeddings.create, model=MODEL, input=inputs) as call:
            wait_for(lambda: not victim.proc.alive(), 60, "the victim's crash")
            helper = start_worker(system.server, "helper", *flags)
            try:
                wait_ready(system.server.client(), helper)
                result = call.result(90)
                taken = helper.metric("jitney_request_handoffs_total", event="taken_over")
                served = helper.metric("jitney_requests_finished_total", reason="stop")
                assert 1 <= taken <= served < len(inputs)  # the victim answered the others
            finally:
                helper.proc.stop()
        assert_vectors([d.embedding for d in result.data], offline(inputs, "mean"))
        assert_nothing_left(system.server.client())
