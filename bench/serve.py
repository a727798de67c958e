"""`jitney bench serve`: a load generator against a live service, over the OpenAI streaming API.

Every trace request becomes one POST /v1/completions with its `prompt_ids` as a token-id prompt,
`max_tokens = output_len`, `ignore_eos`, greedy, streamed with usage. Arrivals are open loop
(`rate`: Poisson at R req/s, seeded, or the trace's own `arrival_s`; sending never waits for
completions) or closed loop (`concurrency`: C requests in flight at all times). The run ends when
every request finished or `max_duration` passed; what was still running or not yet sent is
cancelled and counted failed.

Per request (times from the moment the request is sent):
- TTFT: until the first chunk that carries text;
- ITL: the gaps between consecutive chunks that carry text;
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests of two tokens or more;
- e2e: until `data: [DONE]`;
- output tokens: `usage.completion_tokens` of the final chunk.
A request fails on an HTTP status other than 200, an error event in the stream, a stream that ends
without [DONE], a connection error, or the deadline. Throughputs count successful requests only,
over the run's wall time (from the start of the send schedule to the last completion).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import batch_backlog as batch_backlog_mod
from bench.trace import TraceRequest, percentile

NOT_SENT = "not sent before --max-duration"
CANCELLED = "cancelled at --max-duration"
NO_DONE = "stream ended without [DONE]"
STATS = ("mean", "p50", "p90", "p99")


def stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds; None when there are no values (JSON has no NaN)."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = [1000 * v for v in values_s]
    out = {"mean": sum(ms) / len(ms)} | {f"p{q}": percentile(ms, q) for q in (50, 90, 99)}
    return {k: round(v, 3) for k, v in out.items()}


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of n requests with exponential gaps at `rate` req/s; inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass(slots=True)
class RequestResult:
    request_id: str
    prompt_len: int
    output_len: int  # asked for (max_tokens)
    ok: bool = False
    reason: str | None = NOT_SENT  # short failure class, counted in the summary
    detail: str | None = None  # the server's message, when there is one
    start_s: float | None = None  # sent, since the start of the run
    end_s: float | None = None  # finished, failed or cancelled, since the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prefix-cache hits
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _error_reason(prefix: str, body: Any) -> tuple[str, str | None]:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return prefix, None
    return f"{prefix} {err.get('code') or err.get('type') or 'error'}", err.get("message")


async def send_request(
    session: aiohttp.ClientSession, base: str, model: str, req: TraceRequest, res: RequestResult
) -> None:
    body = {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last: float | None = None
    content_chunks = 0
    usage: dict[str, Any] | None = None
    res.reason = CANCELLED  # until it ends otherwise
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                try:
                    payload = await resp.json(content_type=None)
                except ValueError:
                    payload = None
                res.reason, res.detail = _error_reason(f"HTTP {resp.status}", payload)
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    res.e2e_s = time.perf_counter() - start
                    res.ok, res.reason = True, None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.reason, res.detail = _error_reason("error event", chunk)
                    return
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    content_chunks += 1
                usage = chunk.get("usage") or usage
            else:
                res.reason = NO_DONE
        if res.ok:
            res.output_tokens = int(usage["completion_tokens"]) if usage else content_chunks
            details = (usage or {}).get("prompt_tokens_details") or {}
            res.cached_tokens = int(details.get("cached_tokens") or 0)
    except asyncio.CancelledError:
        res.reason = CANCELLED
        raise
    except Exception as e:  # a load generator counts what went wrong and carries on
        res.ok, res.reason, res.detail = False, type(e).__name__, str(e)[:300]


async def run_for(
    load: Coroutine[Any, Any, None], max_duration: float, say: Callable[[str], None]
) -> None:
    """Run the load; at `max_duration` cancel what is left of it (counted failed, not sent)."""
    driver = asyncio.create_task(load)
    done, _ = await asyncio.wait({driver}, timeout=max_duration)
    if not done:
        say(f"--max-duration {max_duration} s reached; cancelling what is left")
        driver.cancel()
        await asyncio.gather(driver, return_exceptions=True)
    else:
        driver.result()


async def first_model(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(f"{base}/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json())["data"]
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model (no live worker?)")
    return str(data[0]["id"])


def base_url(url: str) -> str:
    """The service root: a trailing '/' or '/v1' is dropped, paths are appended to it."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def run_serve(
    url: str,
    requests: Sequence[TraceRequest],
    *,
    rate: float | None = None,
    arrivals: str = "poisson",
    concurrency: int | None = None,
    seed: int = 0,
    model: str | None = None,
    max_duration: float = 600.0,
    label: str | None = None,
    say: Callable[[str], None] = lambda _: None,
    batch_backlog: int = 0,
    backlog_warmup_s: float = 3.0,
) -> dict[str, Any]:
    """Run the requests against `url`; returns the JSON-ready report (summary + per request).
    `batch_backlog` > 0: the mixed-class mode (bench/batch_backlog.py); that many batch lines
    are submitted first and run behind the interactive requests for `backlog_warmup_s` before
    they start."""
    if (concurrency is None) == (rate is None and arrivals != "trace"):
        raise ValueError("give exactly one of rate (or arrivals='trace') and concurrency")
    if arrivals not in ("poisson", "trace"):
        raise ValueError(f"arrivals must be 'poisson' or 'trace', not {arrivals!r}")
    if (rate is not None and not rate > 0) or (concurrency is not None and concurrency < 1):
        raise ValueError("rate must be > 0 (inf: all at once) and concurrency >= 1")
    base = base_url(url)
    results = [RequestResult(r.request_id, len(r.prompt_ids), r.output_len) for r in requests]
    limit = max(1, concurrency or len(requests))
    timeout = aiohttp.ClientTimeout(total=None, connect=30)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit), timeout=timeout
    ) as session:
        model = model or await first_model(session, base)
        if concurrency is None:
            times = (
                [r.arrival_s for r in requests]
                if arrivals == "trace"
                else poisson_arrivals(len(requests), float(rate or math.inf), seed)
            )
            mode = f"{arrivals} arrivals" + ("" if arrivals == "trace" else f" at {rate} req/s")
        else:
            mode = f"concurrency {concurrency}"
        backlog_before = batch_id = None
        if batch_backlog > 0:
            batch_id = await batch_backlog_mod.submit(session, base, requests, batch_backlog, model)
            say(f"backlog: batch {batch_id} of {batch_backlog} lines; warming up")
            backlog_before = await batch_backlog_mod.wait_started(
                session, base, batch_id, backlog_warmup_s
            )
        say(f"{len(requests)} requests to {base} ({model}), {mode}")
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            results[i].start_s = time.perf_counter() - t0
            try:
                await send_request(session, base, model, requests[i], results[i])
            finally:
                results[i].end_s = time.perf_counter() - t0

        async def open_loop() -> None:
            async with asyncio.TaskGroup() as tg:
                for i, at in enumerate(times):
                    delay = at - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tg.create_task(one(i))

        async def closed_loop() -> None:
            queue = iter(range(len(requests)))

            async def user() -> None:
                for i in queue:  # a shared iterator: each index is taken once
                    await one(i)

            async with asyncio.TaskGroup() as tg:
                for _ in range(min(concurrency or 1, len(requests))):
                    tg.create_task(user())

        await run_for(open_loop() if concurrency is None else closed_loop(), max_duration, say)
        wall = time.perf_counter() - t0
        backlog = None
        if batch_id is not None and backlog_before is not None:
            after = await batch_backlog_mod.status(session, base, batch_id)
            backlog = batch_backlog_mod.progress(backlog_before, after, batch_backlog)
            if after["status"] not in batch_backlog_mod.TERMINAL:
                await batch_backlog_mod.cancel(session, base, batch_id)
    return summarize(
        results,
        wall,
        {
            "label": label or _default_label(rate, arrivals, concurrency),
            "url": base,
            "model": model,
            "mode": "closed" if concurrency else "open",
            "rate": rate if concurrency is None and arrivals == "poisson" else None,
            "arrivals": arrivals if concurrency is None else None,
            "concurrency": concurrency,
            "seed": seed,
            "max_duration_s": max_duration,
            "batch_backlog": backlog,
        },
    )


def _default_label(rate: float | None, arrivals: str, concurrency: int | None) -> str:
    if concurrency is not None:
        return f"concurrency-{concurrency}"
    return "trace-arrivals" if arrivals == "trace" else f"rate-{rate:g}"


def summarize(
    results: Sequence[RequestResult], wall_s: float, meta: dict[str, Any]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    useful = sum(min(r.output_tokens, r.output_len) for r in ok)
    per_s = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: 0.0)
    return {
        **meta,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.reason for r in results if not r.ok).most_common()),
        "wall_s": round(wall_s, 6),  # throughputs are derived from it: keep it precise
        "request_throughput": round(per_s(len(ok)), 4),
        "output_tokens": tokens,
        "useful_output_tokens": useful,
        "output_throughput": round(per_s(useful), 3),
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in results],
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1))
