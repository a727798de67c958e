"""`jitney gateway` as a real process, its imports (never torch or worker), a stalled Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import redis

from protocol import ModelCard, ReplyMessage
from tests.gateway.helpers import KEYS, FakeWorker, MakeClient, heartbeat, publish_card, tokens
from tests.services import JitneyProcess, RedisServer, free_port, http_status, wait_for

NO_TORCH_SCRIPT = """
import sys
from tokenizers import Tokenizer, models
from gateway.http.app import make_app
from gateway.config import GatewayConfig
from jitney.commands import gateway as command
from protocol.model_card import tokenizer_from_card
from protocol import ModelCard

make_app(GatewayConfig())
backend = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
template = "{% for m in messages %}{{ m.content }}{% endfor %}"
card = ModelCard("m", 8, [0], backend.to_str(), template)
tok = tokenizer_from_card(card)
assert tok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=True,
                               return_dict=False) == [0]
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "worker", "scheduler"})
print(bad)
"""


def test_gateway_never_imports_torch_or_worker() -> None:
    """The gateway stack, tokenizer and chat template included, loads without torch/worker."""
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.getcwd(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


async def test_jitney_gateway_process_serves_and_cancels(
    redis_server: RedisServer, served: redis.Redis, fake_worker: FakeWorker
) -> None:
    """The CLI process: env defaults, /ready, a stream answered end to end, a disconnect cancel,
    and a clean SIGTERM that takes its heartbeat away."""
    port = free_port()
    env = {"REDIS_URL": redis_server.url, "JITNEY_GATEWAY_ID": "gw-proc"}
    proc = JitneyProcess(["gateway", "--port", str(port), "--host", "127.0.0.1"], env, "gateway")
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.alive(), proc.output()
        return http_status(f"{base}/ready") == 200

    try:
        await asyncio.to_thread(wait_for, ready, 60, "gateway ready")
        assert served.zscore(KEYS.gateways, "gw-proc") is not None
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "PROMPT-9c1e", "stream": True}
            async with session.post(f"{base}/v1/completions", json=body) as response:
                request = await fake_worker.take()
                assert request.gateway_id == "gw-proc"
                await fake_worker.answer(request, ["o", "k"])
                text = await response.text()
            assert '"text":"o"' in text and text.endswith("data: [DONE]\n\n")

            response = await session.post(f"{base}/v1/completions", json=body)
            request = await fake_worker.take()
            await fake_worker.reply(request, ReplyMessage(request.request_id, 0, tokens("a")))
            await response.content.readuntil(b"\n\n")
            response.close()
        await asyncio.to_thread(
            wait_for, lambda: served.exists(KEYS.cancelled(request.request_id)), 10, "cancel"
        )
    finally:
        rc = proc.stop(signal.SIGTERM)
    assert rc == 0, proc.output()[-2000:]
    assert served.zscore(KEYS.gateways, "gw-proc") is None
    assert "PROMPT-9c1e" not in proc.output()  # prompts are never logged


async def test_stalled_redis_gives_503_not_a_hang(
    redis_server: RedisServer, served: redis.Redis, card: ModelCard, make_client: MakeClient
) -> None:
    """Redis frozen (SIGSTOP): requests and /ready answer 503 within the Redis timeout bound."""
    client = await make_client(redis_timeout_s=0.5, reply_block_ms=200)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        response = await client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status == 503
        assert (await client.get("/ready")).status == 503
        assert time.monotonic() - start < 5
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    heartbeat(served)
    publish_card(served, card)
    assert (await client.get("/ready")).status == 200
