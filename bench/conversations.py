"""`jitney bench serve --conversations`: a multi-turn trace replayed against a live service.

Each conversation (bench/conversation_trace.py) starts at its `start_s` and sends turn after
turn, each once the previous reply has ended (as a chat client waits for the answer before the
user writes again), so conversations interleave while each keeps its order. Every turn is one
streamed POST /v1/completions with its history as a token-id prompt (bench/serve.py's request),
greedy, exactly the reply's length. Besides bench serve's figures it reports what the prefix
cache saved: the fleet's prefix hit rate (cached prompt tokens / prompt tokens, from each
response's `usage.prompt_tokens_details.cached_tokens`) and the prefill tokens computed (prompt
tokens - cached ones).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from bench.conversation_trace import ConversationTrace
from bench.serve import (
    RequestResult,
    base_url,
    first_model,
    run_for,
    send_request,
    summarize,
)
from bench.trace import TraceRequest


def prefix_stats(results: Sequence[RequestResult]) -> dict[str, Any]:
    """The prefix cache's part of a run, over the turns that succeeded."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
        "prefill_tokens": prompt - cached,
    }


async def run_conversations(
    url: str,
    trace: ConversationTrace,
    *,
    model: str | None = None,
    max_duration: float = 600.0,
    label: str = "conversations",
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Replay `trace` against `url`; the JSON-ready report (bench serve's, plus prefix_stats)."""
    base = base_url(url)
    requests = [
        TraceRequest(f"{c.id}-{t}", trace.prompt(c, t), len(turn.reply), c.start_s)
        for c in trace.conversations
        for t, turn in enumerate(c.turns)
    ]
    results = [RequestResult(r.request_id, len(r.prompt_ids), r.output_len) for r in requests]
    by_id = {r.request_id: (r, res) for r, res in zip(requests, results, strict=True)}
    timeout = aiohttp.ClientTimeout(total=None, connect=30)
    connector = aiohttp.TCPConnector(limit=max(1, len(trace.conversations)))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = model or await first_model(session, base)
        say(
            f"{len(trace.conversations)} conversations, {len(requests)} turns to {base} "
            f"({model}), each turn after the previous reply"
        )
        t0 = time.perf_counter()

        async def converse(index: int) -> None:
            conversation = trace.conversations[index]
            await asyncio.sleep(max(0.0, conversation.start_s - (time.perf_counter() - t0)))
            for t in range(len(conversation.turns)):
                request, result = by_id[f"{conversation.id}-{t}"]
                result.start_s = time.perf_counter() - t0
                try:
                    await send_request(session, base, model, request, result)
                finally:
                    result.end_s = time.perf_counter() - t0
                if not result.ok:
                    return  # a conversation whose turn failed stops there (the rest: not sent)

        async def replay() -> None:
            async with asyncio.TaskGroup() as tg:
                for i in range(len(trace.conversations)):
                    tg.create_task(converse(i))

        await run_for(replay(), max_duration, say)
        wall = time.perf_counter() - t0
    meta = {
        "label": label,
        "url": base,
        "model": model,
        "mode": "conversations",
        "conversations": len(trace.conversations),
        "max_duration_s": max_duration,
    }
    return {**summarize(results, wall, meta), **prefix_stats(results)}
