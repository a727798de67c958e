"""Client-side helpers for the whole-system tests: streaming over HTTP, the offline reference."""

from __future__ import annotations

import json

import aiohttp

from engine.config import EngineConfig
from engine.llm_engine import CompletedRequest, Engine
from engine.model_loader import load_model
from engine.sampling import SamplingParams
from tests.engine.engine_helpers import NEAR_TIE, top2_gap

MODEL = "tiny-random"


def offline(prompts: list[list[int]], max_tokens: int) -> list[CompletedRequest]:
    engine = Engine(EngineConfig(model=MODEL, kv_cache_memory="16MiB"), loaded=load_model(MODEL))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine.generate(prompts, params)


async def stream_completion(
    session: aiohttp.ClientSession, base: str, body: dict, allow_error: bool = False
) -> tuple[str, dict]:
    """POST with stream=true; return the joined text and the usage chunk (or, with
    `allow_error`, the error chunk's body under "error")."""
    text, usage = "", {}
    async with session.post(
        f"{base}/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                assert allow_error, chunk
                return text, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    return text, usage


def assert_same_greedy_text(ref, prompt: list[int], text: str, want: CompletedRequest) -> None:
    """The served text equals the offline run's (same incremental detokenizer), or the two
    token streams part at a numerical near-tie."""
    if text == want.text:
        return
    # The served text is the offline text up to some token, then departs: find that token.
    tokens, decode = want.token_ids, ref.tokenizer.decode
    i = 0
    while i < len(tokens) and text.startswith(decode(tokens[: i + 1])):
        i += 1
    gap = top2_gap(ref, prompt + tokens[:i])
    assert gap < NEAR_TIE, (
        f"served {text!r} != offline {want.text!r}; they part at token {i}, top-2 gap {gap:.2e}"
    )
