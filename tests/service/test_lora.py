"""LoRA adapters end to end: a real worker started with `--lora-modules` behind a real gateway
lists its adapter as a model with its base as parent, serves chat and completions under it
(greedy tokens unlike the base model's), counts the requests per adapter, exports vLLM's
`lora_requests_info`, and an unknown name stays the 404 model error. An adapter loaded at
runtime by an admin key is loaded by the worker and served, then unloaded."""

from __future__ import annotations

import pytest
import requests

from tests.lora_adapters import write_peft_adapter
from tests.model_dirs import SMALL_LLAMA, write_random_llama
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
