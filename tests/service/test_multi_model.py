"""Two models behind one gateway: each has its own request stream, read only by its workers, so
every request is answered by the model it named (same text as that model run offline)."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import requests

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation import SamplingParams
from protocol import Keys
from tests.model_dirs import write_random_llama
from tests.service.helpers import MODEL, assert_same_greedy_text, stream_completion
from tests.services import RedisServer, start_gateway, start_worker, wait_for, wait_ready

SECOND = "tiny-b"  # the directory name is its served name
MAX_TOKENS = 12


@pytest.mark.slow
async def test_two_models_each_answer_the_requests_naming_them(tmp_path):
    second_dir = write_random_llama(
        tmp_path / SECOND,
        seed=7,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    specs = {MODEL: MODEL, SECOND: str(second_dir)}
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(8)] for _ in range(6)]
    server = RedisServer().start()
    workers = [
        start_worker(server, "mm-a", model=MODEL),
        start_worker(server, "mm-b", model=specs[SECOND]),
    ]
    gateway = start_gateway(server)
    try:
        wait_ready(server.client(), *workers)
        gateway.wait_ready()
        # The gateway reads new model cards every few seconds (scan_s): both are listed soon.
        wait_for(
            lambda: sorted(m["id"] for m in _listed(gateway.base)) == sorted(specs),
            15,
            "both models listed",
        )

        # Interleaved: each model's requests in flight at once with the other's.
        jobs = [(name, prompt) for prompt in prompts for name in specs]
        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(
                *(
                    stream_completion(
                        session,
                        gateway.base,
                        {
                            "model": name,
                            "prompt": prompt,
                            "max_tokens": MAX_TOKENS,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    for name, prompt in jobs
                )
            )
        texts: dict[str, list[str]] = {name: [] for name in specs}
        for (name, _), (text, _) in zip(jobs, results, strict=True):
            texts[name].append(text)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for name, spec in specs.items():
            ref = load_model(spec)
            engine = Engine(EngineConfig(model=spec, kv_cache_memory="16MiB"), loaded=ref)
            wants = engine.generate(prompts, params)
            for prompt, want, text in zip(prompts, wants, texts[name], strict=True):
                assert_same_greedy_text(ref, prompt, text, want)
        # The two models really differ, so matching texts say which one answered.
        assert texts[MODEL] != texts[SECOND]
        for worker, name in zip(workers, specs, strict=True):
            finished = worker.metric("jitney_requests_finished_total")
            assert finished == len(prompts), (name, finished)

        # A model whose workers are gone: 404, while the other is still served.
        workers[1].proc.stop()
        r = server.client()
        assert r.zcard(Keys().model_workers(SECOND)) == 0  # a clean stop leaves at once
        body = {"model": SECOND, "prompt": "hi", "max_tokens": 2}
        response = requests.post(f"{gateway.base}/v1/completions", json=body, timeout=10)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
        body["model"] = MODEL
        response = requests.post(f"{gateway.base}/v1/completions", json=body, timeout=10)
        assert response.status_code == 200, response.text
    finally:
        gateway.proc.stop()
        for worker in workers:
            worker.proc.stop()
        server.close()


def _listed(base: str) -> list[dict]:
    return requests.get(f"{base}/v1/models", timeout=5).json()["data"]
