"""The Batch API through the whole system with the official `openai` client, unchanged: upload,
create, poll, read the output and error files; and a worker SIGKILLed mid-batch."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import openai
import pytest

from tests.service.helpers import MODEL
from tests.services import System, running_system, wait_for


def line(i: int, **body: Any) -> dict[str, Any]:
    if i % 2:
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}]}
    else:
        url, body = "/v1/completions", {"prompt": f"count {i}:", **body}
    body |= {"model": MODEL, "max_tokens": 4, "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def client_for(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)


def run_batch(client: openai.OpenAI, data: bytes, timeout: float) -> Any:
    file = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert file.purpose == "batch" and file.bytes == len(data)
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.request_counts.total == data.count(b"\n")
    return wait_completed(client, batch.id, timeout)


def wait_completed(client: openai.OpenAI, batch_id: str, timeout: float) -> Any:
    seen: list[Any] = []

    def finished() -> bool:
        got = client.batches.retrieve(batch_id)
        assert got.status not in ("failed", "expired", "cancelled"), got
        seen.append(got)
        return got.status == "completed"

    wait_for(finished, timeout, "batch completed", interval=0.5)
    return seen[-1]


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.mark.slow
def test_the_openai_client_runs_a_batch_end_to_end() -> None:
    lines = [line(i) for i in range(19)]
    bad = {**line(19), "custom_id": "bad"}
    bad["body"] = {**bad["body"], "max_tokens": -1}  # a 400: lands in the error file
    with running_system(("bt1",)) as system:
        client = client_for(system)
        done = run_batch(client, jsonl([*lines, bad]), timeout=120)
        assert done.request_counts.completed == 19 and done.request_counts.failed == 1
        output = output_lines(client, done.output_file_id)
        assert [x["custom_id"] for x in output] == [f"req-{i}" for i in range(19)]
        for x in output:
            body = x["response"]["body"]
            assert x["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] >= 1
            choice = body["choices"][0]
            assert choice.get("message", {}).get("content") is not None or "text" in choice
        [error] = output_lines(client, done.error_file_id)
        assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
        assert client.batches.list(limit=5).data[0].id == done.id


@pytest.mark.slow
def test_a_worker_killed_mid_batch_and_every_line_is_answered_once() -> None:
    """Two workers; one is SIGKILLed once some lines are answered. Its lines are taken over by
    the other (the workers' own takeover), and the batch completes with one output line per
    input line."""
    lines = [line(i) for i in range(24)]
    for x in lines:
        x["body"] = {**x["body"], "max_tokens": 24, "ignore_eos": True}
    with running_system(("bk1", "bk2"), gateway_flags=("--batch-max-queued", "8")) as system:
        client = client_for(system)
        file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        )

        def some_done() -> bool:
            return client.batches.retrieve(batch.id).request_counts.completed >= 4

        wait_for(some_done, 120, "some lines answered", interval=0.2)
        system.workers[0].proc.stop(signal.SIGKILL, timeout=10)
        killed_at = time.monotonic()

        done = wait_completed(client, batch.id, 180)
        assert time.monotonic() - killed_at < 180
        assert done.request_counts.completed == 24 and done.request_counts.failed == 0
        output = output_lines(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines)
        for x in output:
            assert x["response"]["body"]["usage"]["completion_tokens"] == 24
