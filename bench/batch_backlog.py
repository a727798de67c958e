"""`jitney bench serve --batch-backlog N`: batch work behind the interactive load.

N lines (the trace's requests, cycled) go to the service through the OpenAI Batch API before
the interactive stream starts, so the workers' idle seats are full of least-urgent work; the
interactive requests' TTFT then shows what that backlog costs them. The batch is cancelled
when the run ends (nothing is left running), and the report says how far it got.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.trace import TraceRequest

ENDPOINT = "/v1/completions"
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def backlog_lines(requests: Sequence[TraceRequest], n: int, model: str) -> bytes:
    """The batch input file: `n` completions, the trace's requests cycled (exact lengths)."""
    lines = []
    for i in range(n):
        r = requests[i % len(requests)]
        body = {
            "model": model,
            "prompt": r.prompt_ids,
            "max_tokens": r.output_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(
            json.dumps({"custom_id": f"bg-{i}", "method": "POST", "url": ENDPOINT, "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


async def _json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    body = await resp.json(content_type=None)
    if resp.status >= 400:
        raise RuntimeError(f"{resp.method} {resp.url.path}: {resp.status} {body}")
    return body


async def submit(
    session: aiohttp.ClientSession, base: str, requests: Sequence[TraceRequest], n: int, model: str
) -> str:
    """Upload the lines and create the batch; its id."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field(
        "file",
        backlog_lines(requests, n, model),
        filename="backlog.jsonl",
        content_type="application/jsonl",
    )
    async with session.post(f"{base}/v1/files", data=form) as resp:
        file_id = (await _json(resp))["id"]
    body = {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"}
    async with session.post(f"{base}/v1/batches", json=body) as resp:
        return (await _json(resp))["id"]


async def status(session: aiohttp.ClientSession, base: str, batch_id: str) -> dict[str, Any]:
    async with session.get(f"{base}/v1/batches/{batch_id}") as resp:
        return await _json(resp)


async def wait_started(
    session: aiohttp.ClientSession, base: str, batch_id: str, warmup_s: float
) -> dict[str, Any]:
    """Until the batch runs and `warmup_s` has passed (the workers' seats fill up). A batch
    that completes first was too small to be a backlog: the report shows it (every line
    answered before the run); one that failed or was cancelled is an error."""
    deadline = time.monotonic() + warmup_s
    while True:
        batch = await status(session, base, batch_id)
        if batch["status"] == "completed":
            return batch
        if batch["status"] in TERMINAL:
            raise RuntimeError(f"the backlog batch ended before the run: {batch['status']}")
        if batch["status"] == "in_progress" and time.monotonic() >= deadline:
            return batch
        await asyncio.sleep(0.2)


async def cancel(session: aiohttp.ClientSession, base: str, batch_id: str) -> dict[str, Any]:
    async with session.post(f"{base}/v1/batches/{batch_id}/cancel") as resp:
        return await _json(resp)


def progress(before: dict[str, Any], after: dict[str, Any], lines: int) -> dict[str, Any]:
    """What the report keeps of the backlog: its size and the lines answered during the run."""
    done = after["request_counts"]["completed"] + after["request_counts"]["failed"]
    done_before = before["request_counts"]["completed"] + before["request_counts"]["failed"]
    return {
        "batch_id": after["id"],
        "lines": lines,
        "answered_before_run": done_before,
        "answered_during_run": done - done_before,
        "status_at_end": after["status"],
    }
