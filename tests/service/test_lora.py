"""LoRA adapters end to end: a real worker started with `--lora-modules` behind a real gateway
lists its adapter as a model with its base as parent, serves chat and completions under it
(greedy tokens unlike the base model's), counts the requests per adapter, exports vLLM's
`lora_requests_info`, and an unknown name stays the 404 model error. An adapter loaded at
runtime by an admin key is loaded by the worker and served, then unloaded. Requests under two
adapters and the base model, taken over after their worker's SIGKILL, end exact. With
placement, a request goes to the worker holding its adapter resident."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests

from protocol import Keys
from protocol.queue.placement import ADAPTERS_FIELD
from protocol.snapshot import BatchSnapshot
from tests.lora_adapters import write_peft_adapter
from tests.model_dirs import SMALL_LLAMA, write_random_llama
from tests.service.helpers import PLACED, pending_by_consumer, read_since, reads, stream_completion
from tests.services import RedisServer, start_gateway, start_worker, wait_for, wait_ready

BASE = "tiny-lora-base"  # the directory name is its served name
ADAPTER = "sql"
RUNTIME = "chat"  # loaded over the API
ADMIN_KEY = "admin-key-31c"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [5, 17, 42, 9, 33, 61, 7, 12]
MAX_TOKENS = 8


def _completion(base: str, model: str) -> dict:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,  # the chosen tokens' own entries: what the two runs are compared on
    }
    response = requests.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_an_adapter_is_a_model_of_its_own_on_the_base_model_s_worker(tmp_path):
    base_dir = write_random_llama(tmp_path / BASE, seed=3, **SMALL_LLAMA)
    adapter_dir = write_peft_adapter(base_dir, tmp_path / "adapter", rank=8, seed=1)
    root = tmp_path / "lora-root"
    write_peft_adapter(base_dir, root / RUNTIME, rank=4, seed=2)
    server = RedisServer().start()
    worker = start_worker(
        server,
        "lora-w",
        "--lora-modules",
        f"{ADAPTER}={adapter_dir}",
        "--vllm-metrics",
        model=str(base_dir),
    )
    keys = ("--api-keys", f"ops:{ADMIN_KEY} role=admin", "--enable-lora-runtime-updates")
    gateway = start_gateway(server, *keys, "--lora-root", str(root))
    try:
        wait_ready(server.client(), worker)
        gateway.wait_ready(api_key=ADMIN_KEY)
        url = gateway.base

        def listed() -> dict[str, dict]:
            data = requests.get(f"{url}/v1/models", headers=AUTH, timeout=5).json()["data"]
            return {m["id"]: m for m in data}

        wait_for(lambda: ADAPTER in listed(), 15, "the adapter listed")
        assert listed()[ADAPTER]["parent"] == BASE and listed()[BASE]["parent"] is None

        plain, tuned = _completion(url, BASE), _completion(url, ADAPTER)
        assert plain["model"] == BASE and tuned["model"] == ADAPTER
        plain_tokens = plain["choices"][0]["logprobs"]["tokens"]
        tuned_tokens = tuned["choices"][0]["logprobs"]["tokens"]
        assert len(tuned_tokens) == MAX_TOKENS
        assert tuned_tokens != plain_tokens, "the adapter changed nothing"

        chat = requests.post(
            f"{url}/v1/chat/completions",
            json={
                "model": ADAPTER,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            headers=AUTH,
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == ADAPTER

        unknown = requests.post(
            f"{url}/v1/completions",
            json={"model": "nope", "prompt": "hi"},
            headers=AUTH,
            timeout=10,
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"

        assert worker.metric("jitney_lora_requests_total", adapter=ADAPTER) == 2
        wait_for(
            lambda: worker.metric("vllm:lora_requests_info", max_lora="4") > 0,
            5,
            "vLLM's lora_requests_info",
        )

        load = {"lora_name": RUNTIME, "lora_path": RUNTIME}  # relative to --lora-root
        loaded = requests.post(f"{url}/v1/load_lora_adapter", json=load, headers=AUTH, timeout=10)
        assert loaded.status_code == 200, loaded.text
        assert listed()[RUNTIME]["parent"] == BASE
        runtime = _completion(url, RUNTIME)  # the worker loads it at once if its poll has not
        runtime_tokens = runtime["choices"][0]["logprobs"]["tokens"]
        assert runtime_tokens not in (plain_tokens, tuned_tokens)
        assert "lora_loaded adapter=chat" in worker.proc.output()
        gone = requests.post(
            f"{url}/v1/unload_lora_adapter", json={"lora_name": RUNTIME}, headers=AUTH, timeout=10
        )
        assert gone.status_code == 200, gone.text
        wait_for(lambda: "lora_unloaded adapter=chat" in worker.proc.output(), 10, "unloaded")
    finally:
        gateway.proc.stop()
        worker.proc.stop()
        server.close()


# The exact mode on both sides of the comparison: float32 throughout, no drafts.
EXACT_FLAGS = ("--quantization", "none", "--speculative", "none")


def _uninterrupted(base_dir, modules, prompts, loras, max_tokens) -> list[str]:
    """The replies' text from one offline engine configured as the workers are."""
    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from generation import SamplingParams

    config = EngineConfig.from_flat(
        model=str(base_dir),
        kv_cache_memory="16MiB",
        quantization="none",
        speculative="none",
        lora_modules=modules,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [r.text for r in Engine(config).generate(prompts, params, lora=loras)]


@pytest.mark.slow
async def test_adapter_requests_taken_over_after_a_sigkill_end_exact(tmp_path):
    """Streams under adapters a and b and the base model run on a worker SIGKILLed
    mid-generation (all three read, tokens delivered; its live view's seats name their
    adapters); a second worker with the same adapters takes them over (lease expiry, fence,
    XCLAIM) and continues each under its own adapter: every client's text equals an
    uninterrupted run's."""
    base_dir = write_random_llama(tmp_path / BASE, seed=3, **SMALL_LLAMA)
    modules = (
        ("a", str(write_peft_adapter(base_dir, tmp_path / "a", rank=8, seed=1))),
        ("b", str(write_peft_adapter(base_dir, tmp_path / "b", rank=4, seed=2))),
    )
    flags = ("--lora-modules", *(f"{n}={p}" for n, p in modules), *EXACT_FLAGS)
    prompts = [[5, 17, 42, 9, 33], [61, 7, 12, 80, 3, 44], [21, 22, 23, 24]]
    loras = ["a", "b", None]
    n = 64
    server = RedisServer().start()
    # 30 ms a step: 64 tokens take about two seconds, so the kill finds all three mid-generation.
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=30"}
    victim = start_worker(server, "lora-victim", *flags, model=str(base_dir), env=slow)
    gateway = start_gateway(server)
    survivor = None
    try:
        r = server.client()
        wait_ready(r, victim)
        gateway.wait_ready()
        keys = Keys()
        stream = [keys.requests(BASE)]  # adapters' requests queue under their base model
        async with aiohttp.ClientSession() as session:
            streams = [
                asyncio.create_task(
                    stream_completion(
                        session,
                        gateway.base,
                        {
                            "model": lora or BASE,
                            "prompt": prompt,
                            "max_tokens": n,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                )
                for prompt, lora in zip(prompts, loras, strict=True)
            ]

            def generating() -> bool:
                read = pending_by_consumer(r, stream).get(victim.worker_id, 0)
                return read == 3 and victim.metric("jitney_generation_tokens_total") >= 12

            def seats_adapters() -> list[str | None]:
                live = r.get(keys.live_batch(victim.worker_id))
                seats = BatchSnapshot.decode(live).seats if live else []
                return sorted(s.adapter or "" for s in seats)

            await asyncio.to_thread(wait_for, generating, 60, "all three generating")
            # The live view's seats name each request's adapter (published twice a second).
            await asyncio.to_thread(
                wait_for, lambda: seats_adapters() == ["", "a", "b"], 5, "adapters in seats"
            )
            victim.proc.proc.kill()
            survivor = start_worker(server, "lora-survivor", *flags, model=str(base_dir))
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        want = _uninterrupted(base_dir, modules, prompts, loras, n)
        for (text, usage), expected in zip(results, want, strict=True):
            assert usage["completion_tokens"] == n
            assert text == expected
        assert len(set(want)) == 3  # the adapters (and the base) say different things
        assert survivor.metric("jitney_request_handoffs_total", event="taken_over") == 3
    finally:
        gateway.proc.stop()
        for worker in (victim, survivor):
            if worker is not None:
                worker.proc.stop()
        server.close()


@pytest.mark.slow
def test_with_placement_a_request_goes_to_the_worker_holding_its_adapter(tmp_path):
    """Two workers serving adapters a and b with room for one resident (b, the last read):
    the first request under a goes to the shared stream (nobody holds it) and its reader loads
    a in place of b, which its summary then says; the next request under a is placed on that
    worker's own stream, and one under b on the other's."""
    base_dir = write_random_llama(tmp_path / BASE, seed=3, **SMALL_LLAMA)
    a = write_peft_adapter(base_dir, tmp_path / "a", rank=4, seed=1)
    b = write_peft_adapter(base_dir, tmp_path / "b", rank=4, seed=2)
    flags = ("--lora-modules", f"a={a}", f"b={b}", "--max-loras", "1", *PLACED)
    server = RedisServer().start()
    workers = [start_worker(server, w, *flags, model=str(base_dir)) for w in ("pa-1", "pa-2")]
    gateway = start_gateway(server, *PLACED)
    keys = Keys()
    try:
        r = server.client()
        wait_ready(r, *workers)
        gateway.wait_ready()

        def held(worker) -> str:
            return (r.hget(keys.prefix_summary(worker.worker_id), ADAPTERS_FIELD) or b"").decode()

        def read_by(model: str) -> dict:
            before = reads(workers)
            body = {"model": model, "prompt": [5, 17, 42], "max_tokens": 2, "temperature": 0}
            response = requests.post(f"{gateway.base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return read_since(before, workers)

        wait_for(lambda: all(held(w) == " b " for w in workers), 15, "b resident on both")
        ((first, outcome),) = read_by("a")
        assert outcome == "shared"
        (loaded,) = [w for w in workers if w.worker_id == first]
        (other,) = [w for w in workers if w is not loaded]
        wait_for(lambda: held(loaded) == " a ", 10, "a resident on its reader")
        assert read_by("a") == {(loaded.worker_id, "own"): 1}
        assert read_by("b") == {(other.worker_id, "own"): 1}
    finally:
        gateway.proc.stop()
        for worker in workers:
            worker.proc.stop()
        server.close()
