"""The Batch API with the test playing the worker: uploads checked line by line, the batch's
life and shapes, output and error files, cancel, pacing behind the request stream's backlog,
and exactly-once answers when runners race or a dead gateway's leases lapse."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis
from aiohttp import FormData
from aiohttp.test_utils import TestClient

from gateway.batch import line_runner
from gateway.batch.batch_store import BatchStore
from gateway.batch.file_store import FileStore
from gateway.batch.finalize import finalize, result_line
from gateway.config import GatewayConfig
from gateway.http.app import BATCH_RUNNER
from protocol import BATCH_PRIORITY, WORKER_GROUP
from tests.gateway.helpers import (
    KEYS,
    MODEL,
    AnsweringWorker,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    eventually,
    replies_for,
)

Client = TestClient[Any, Any]
FAST = {"batch_poll_s": 0.05}  # the runner looks for work often: tests stay fast


def line(custom_id: str, url: str = "/v1/completions", **body: Any) -> dict[str, Any]:
    body = body or {"prompt": "hi", "max_tokens": 2}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


async def upload(client: Client, data: bytes, purpose: str = "batch") -> Any:
    form = FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
    return await client.post("/v1/files", data=form)


async def create_batch(client: Client, data: bytes, **extra: Any) -> dict[str, Any]:
    resp = await upload(client, data)
    assert resp.status == 200, await resp.text()
    file = await resp.json()
    body = {
        "input_file_id": file["id"],
        "endpoint": "/v1/completions",
        "completion_window": "24h",
        **extra,
    }
    resp = await client.post("/v1/batches", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def wait_status(client: Client, batch_id: str, status: str, timeout: float = 5) -> Any:
    async def reached() -> Any:
        batch = await (await client.get(f"/v1/batches/{batch_id}")).json()
        return batch if batch["status"] == status else None

    return await eventually(reached, timeout)


async def file_lines(client: Client, file_id: str) -> list[dict[str, Any]]:
    resp = await client.get(f"/v1/files/{file_id}/content")
    assert resp.status == 200
    return [json.loads(x) for x in (await resp.read()).splitlines()]


BATCH_QUEUE = KEYS.requests(MODEL, BATCH_PRIORITY)  # where batch lines are queued


def unread(r: redis.Redis, queue: str = BATCH_QUEUE) -> int:
    groups = r.xinfo_groups(queue) if r.exists(queue) else []
    return next((int(g["lag"]) for g in groups if g["name"] == WORKER_GROUP.encode()), 0)


# --- uploads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "number"),
    [
        (jsonl(line("a"), b"{not json"), 2),
        (jsonl(line("a"), b"[1, 2]"), 2),
        (jsonl(line("a"), line("a")), 2),
        (jsonl({**line("a"), "custom_id": 7}), 1),
        (jsonl(line("a"), {**line("b"), "method": "GET"}), 2),
        (jsonl(line("a"), line("b"), {**line("c"), "url": "/v1/embeddings"}), 3),
        (jsonl({**line("a"), "body": "hi"}), 1),
        (b"\n" + jsonl(line("a")) + b"\xff\xfe\n", 3),
    ],
)
async def test_a_bad_file_is_a_400_naming_its_line(
    client: Client, data: bytes, number: int
) -> None:
    resp = await upload(client, data)
    assert resp.status == 400
    body = await resp.json()
    assert_openai_error(body, param="file")
    assert body["error"]["message"].startswith(f"Line {number}")


async def test_upload_refusals(served: Any, make_client: MakeClient) -> None:
    client = await make_client(max_file_bytes=400, batch_max_lines=2)
    cases = [
        (await upload(client, jsonl(line("a")), purpose="fine-tune"), 400, "purpose"),
        (await upload(client, b"\n\n"), 400, "file"),
        (await upload(client, jsonl(line("a"), line("b"), line("c"))), 400, "file"),
        (await upload(client, jsonl(*[line(str(i)) for i in range(2)]) + b" " * 400), 413, "file"),
        (await client.post("/v1/files", json={"purpose": "batch"}), 400, None),
    ]
    for resp, status, param in cases:
        assert resp.status == status, await resp.text()
        assert_openai_error(await resp.json(), param=param)
    form = FormData(default_to_multipart=True)
    form.add_field("purpose", "batch")
    resp = await client.post("/v1/files", data=form)
    assert resp.status == 400
    assert_openai_error(await resp.json(), param="file")
    broken = {"Content-Type": "multipart/form-data; boundary=zz"}
    resp = await client.post("/v1/files", data=b"--zz\r\nno headers end", headers=broken)
    assert resp.status == 400
    assert_openai_error(await resp.json())


async def test_a_file_s_object_content_and_delete(client: Client) -> None:
    data = jsonl(line("a"), line("b"))
    file = await (await upload(client, data)).json()
    assert file["object"] == "file" and file["purpose"] == "batch" and file["bytes"] == len(data)
    assert file["filename"] == "in.jsonl" and isinstance(file["created_at"], int)
    assert await (await client.get(f"/v1/files/{file['id']}")).json() == file
    assert await (await client.get(f"/v1/files/{file['id']}/content")).read() == data
    resp = await client.delete(f"/v1/files/{file['id']}")
    assert await resp.json() == {"id": file["id"], "object": "file", "deleted": True}
    for path in (f"/v1/files/{file['id']}", f"/v1/files/{file['id']}/content"):
        resp = await client.get(path)
        assert resp.status == 404
        assert_openai_error(await resp.json(), param="file_id")


@pytest.mark.parametrize(
    ("change", "param", "status"),
    [
        ({"input_file_id": None}, "input_file_id", 400),
        ({"input_file_id": "file-nope"}, "input_file_id", 404),
        ({"endpoint": "/v1/embeddings"}, "endpoint", 400),
        ({"completion_window": "1h"}, "completion_window", 400),
        ({"metadata": {"k": 1}}, "metadata", 400),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", 400),
    ],
)
async def test_a_bad_batch_is_refused(
    client: Client, change: dict[str, Any], param: str, status: int
) -> None:
    file = await (await upload(client, jsonl(line("a")))).json()
    body = {"input_file_id": file["id"], "endpoint": "/v1/completions"}
    body |= {"completion_window": "24h", **change}
    resp = await client.post("/v1/batches", json=body)
    assert resp.status == status
    assert_openai_error(await resp.json(), param=param)


async def test_unknown_batches_are_404s(client: Client) -> None:
    for resp in (
        await client.get("/v1/batches/batch_nope"),
        await client.post("/v1/batches/batch_nope/cancel"),
    ):
        assert resp.status == 404
        assert_openai_error(await resp.json(), param="batch_id")
    resp = await client.get("/v1/batches?limit=0")
    assert resp.status == 400
    assert_openai_error(await resp.json(), param="limit")


# --- a batch's life --------------------------------------------------------------------------


async def test_a_batch_runs_to_completed_with_output_and_error_files(
    served: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(**FAST)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    data = jsonl(
        line("c1"),
        line("chat1", "/v1/chat/completions", **chat),
        line("bad", prompt="hi", max_tokens=-1),
        line("c2"),
    )
    with AnsweringWorker(served) as worker:
        batch = await create_batch(client, data, metadata={"job": "nightly"})
        assert batch["object"] == "batch" and batch["status"] == "in_progress"
        assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 0}
        assert batch["metadata"] == {"job": "nightly"} and batch["completion_window"] == "24h"
        assert batch["expires_at"] == batch["created_at"] + 24 * 3600
        done = await wait_status(client, batch["id"], "completed")
    assert worker.answered == 3  # the bad line never reached the queue
    assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert done["completed_at"] >= done["finalizing_at"] >= done["in_progress_at"]
    output = await file_lines(client, done["output_file_id"])
    assert [x["custom_id"] for x in output] == ["c1", "chat1", "c2"]
    for x in output:
        assert x["id"].startswith("batch_req_") and x["error"] is None
        assert x["response"]["status_code"] == 200
        assert x["response"]["request_id"] == x["response"]["body"]["id"]
    assert output[0]["response"]["body"]["choices"][0]["text"] == "ok"
    assert output[1]["response"]["body"]["choices"][0]["message"]["content"] == "ok"
    [error] = await file_lines(client, done["error_file_id"])
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert_openai_error(error["response"]["body"], param="max_tokens")
    out = await (await client.get(f"/v1/files/{done['output_file_id']}")).json()
    assert out["purpose"] == "batch_output" and out["object"] == "file"
    listed = await (await client.get("/v1/batches?limit=5")).json()
    assert listed["object"] == "list" and [b["id"] for b in listed["data"]] == [batch["id"]]
    assert listed["has_more"] is False
    metrics = await (await client.get("/metrics")).text()
    assert 'jitney_batch_lines_total{outcome="completed"} 3.0' in metrics
    assert 'jitney_batch_lines_total{outcome="failed"} 1.0' in metrics


async def test_lines_are_enqueued_at_batch_priority_without_streaming(
    client: Client, fake_worker: FakeWorker, served: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(**FAST)
    stream = {"prompt": "hi", "max_tokens": 2, "stream": True, "priority": -5}
    batch = await create_batch(client, jsonl(line("s", **stream)))
    request = await fake_worker.take()
    assert request.priority == BATCH_PRIORITY
    await fake_worker.reply(request, *replies_for(request, ["o", "k"]))
    done = await wait_status(client, batch["id"], "completed")
    [out] = await file_lines(client, done["output_file_id"])
    assert out["response"]["body"]["choices"][0]["text"] == "ok"


async def test_listing_pages_newest_first(client: Client) -> None:
    ids = [(await create_batch(client, jsonl(line("a"))))["id"] for _ in range(3)]
    page = await (await client.get("/v1/batches?limit=2")).json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = await (await client.get(f"/v1/batches?limit=2&after={page['last_id']}")).json()
    assert [b["id"] for b in rest["data"]] == ids[:1] and rest["has_more"] is False


async def test_cancel_stops_the_lines_and_ends_cancelled(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    client = await make_client(**FAST)
    batch = await create_batch(client, jsonl(*[line(f"l{i}") for i in range(6)]))
    first = await fake_worker.take()  # it runs; the worker never answers
    resp = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert resp.status == 200 and (await resp.json())["status"] in ("cancelling", "cancelled")
    done = await wait_status(client, batch["id"], "cancelled")
    assert done["cancelled_at"] >= done["cancelling_at"]
    assert done["output_file_id"] is None and done["request_counts"]["completed"] == 0
    # the running line's request was cancelled like a client's that left
    assert await eventually(lambda: served.exists(KEYS.cancelled(first.request_id)))
    resp = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert resp.status == 200 and (await resp.json())["status"] == "cancelled"


async def test_a_finished_batch_cannot_be_cancelled(
    served: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(**FAST)
    with AnsweringWorker(served):
        batch = await create_batch(client, jsonl(line("a")))
        await wait_status(client, batch["id"], "completed")
    resp = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert resp.status == 409
    assert_openai_error(await resp.json(), param="batch_id")


# --- pacing ----------------------------------------------------------------------------------


async def test_the_stream_never_holds_more_unread_lines_than_the_bound(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """A slow worker: the runner keeps exactly `batch_max_queued` lines unread, refilling as
    the worker reads, never more."""
    client = await make_client(batch_max_queued=3, **FAST)
    batch = await create_batch(client, jsonl(*[line(f"l{i}") for i in range(12)]))
    await eventually(lambda: unread(served) == 3)
    for _ in range(4):
        request = await fake_worker.take()
        for _ in range(10):  # the runner refills; the bound holds meanwhile
            assert unread(served) <= 3
            await asyncio.sleep(0.02)
        await fake_worker.reply(request, *replies_for(request, ["ok"]))
    await eventually(lambda: unread(served) == 3)
    assert unread(served) == 3
    counts = (await (await client.get(f"/v1/batches/{batch['id']}")).json())["request_counts"]
    assert counts["completed"] == 4


async def test_a_full_queue_hands_lines_back_to_run_later(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """An interactive burst filled the queue (429 for the line): the line is handed back, not
    failed, and runs once there is room."""
    client = await make_client(max_queue_len=1, batch_max_queued=5, retry_after_s=1, **FAST)
    blocker = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    await eventually(lambda: unread(served, KEYS.requests(MODEL)) == 1)
    batch = await create_batch(client, jsonl(line("a")))
    runner_metrics = await eventually(
        lambda: _metric(client, 'jitney_batch_lines_total{outcome="retried"}')
    )
    assert runner_metrics >= 1
    with AnsweringWorker(served):
        done = await wait_status(client, batch["id"], "completed")
        assert (await blocker).status == 200
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}


async def _metric(client: Client, sample: str) -> float:
    for row in (await (await client.get("/metrics")).text()).splitlines():
        if row.startswith(sample + " "):
            return float(row.split()[-1])
    return 0.0


# --- exactly once ----------------------------------------------------------------------------


async def test_two_gateways_racing_answer_each_line_once(
    served: redis.Redis, make_client: MakeClient
) -> None:
    one = await make_client(gateway_id="gw-one", batch_max_queued=8, **FAST)
    two = await make_client(gateway_id="gw-two", batch_max_queued=8, **FAST)
    with AnsweringWorker(served) as worker:
        batch = await create_batch(one, jsonl(*[line(f"l{i}") for i in range(30)]))
        done = await wait_status(two, batch["id"], "completed", timeout=10)
    assert done["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    output = await file_lines(two, done["output_file_id"])
    assert [x["custom_id"] for x in output] == [f"l{i}" for i in range(30)]
    assert worker.answered == 30  # each line ran once: claims are disjoint


async def test_claims_are_disjoint_and_a_result_is_written_once(
    served: redis.Redis, client: Client
) -> None:
    gw_redis = _async_redis(served)
    store = BatchStore(gw_redis, KEYS)
    file = await FileStore(gw_redis, KEYS).create("in", "batch", [json.dumps(line("a"))] * 1)
    batch = await store.create("/v1/completions", file.id, 1, "24h", None)
    a, b = await asyncio.gather(store.claim(batch, 1, 30), store.claim(batch, 1, 30))
    assert len(a) + len(b) == 1
    assert await store.record(batch.id, 0, "{}", ok=True) is True
    assert await store.record(batch.id, 0, '{"again":1}', ok=False) is False
    got = await store.get(batch.id)
    assert got is not None and (got.completed, got.failed) == (1, 0)
    assert await store.results(batch.id) == {0: b"+{}"}
    await gw_redis.aclose()


async def test_a_dead_gateway_s_lines_run_again_once_their_lease_lapses(
    served: redis.Redis, make_client: MakeClient
) -> None:
    """A 'gateway' claims two lines with a short lease and dies; a live gateway runs them after
    the lease lapses. The dead one's late answer is then refused: each line is written once."""
    gw_redis = _async_redis(served)
    store = BatchStore(gw_redis, KEYS)
    data = [json.dumps(line(f"l{i}")) for i in range(3)]
    file = await FileStore(gw_redis, KEYS).create("in.jsonl", "batch", data)
    batch = await store.create("/v1/completions", file.id, 3, "24h", None)
    dead = await store.claim(batch, 2, lease_s=0.3)
    assert [c.index for c in dead] == [0, 1]
    client = await make_client(**FAST)
    with AnsweringWorker(served) as worker:
        done = await wait_status(client, batch.id, "completed")
    assert worker.answered == 3
    assert await store.record(batch.id, 0, "{}", ok=True) is False  # the dead one, late
    output = await file_lines(client, done["output_file_id"])
    assert [x["custom_id"] for x in output] == ["l0", "l1", "l2"]
    await gw_redis.aclose()


async def test_two_finalizers_commit_once(served: redis.Redis, client: Client) -> None:
    """A finalizer whose lease lapsed races its successor: one commit wins, the other's files
    are dropped, and the batch has one output file."""
    gw_redis = _async_redis(served)
    store, files = BatchStore(gw_redis, KEYS), FileStore(gw_redis, KEYS)
    file = await files.create("in", "batch", [json.dumps(line("a"))])
    batch = await store.create("/v1/completions", file.id, 1, "24h", None)
    await store.claim(batch, 1, 30)
    assert await store.record(batch.id, 0, result_line("a", {"status_code": 200}), ok=True)
    assert await store.begin_finalize(batch.id, lease_s=0.0) == "completed"
    assert await store.begin_finalize(batch.id, lease_s=30.0) == "completed"  # lapsed: retaken
    assert await store.begin_finalize(batch.id, lease_s=30.0) is None  # held now
    assert await finalize(store, files, batch, "completed") is True
    assert await finalize(store, files, batch, "completed") is False
    done = await store.get(batch.id)
    assert done is not None and done.status == "completed" and done.output_file_id
    assert len(await files.lines(done.output_file_id)) == 1
    assert await store.active() == []
    assert not [k for k in served.scan_iter(KEYS.file_lines("tmp-*"))]  # the loser's temps
    await gw_redis.aclose()


async def test_a_batch_past_its_window_expires_with_the_lines_never_run(
    served: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(**FAST, batch_concurrency=0)  # nothing runs: all lines expire
    batch = await create_batch(client, jsonl(line("a"), line("b")))
    served.hset(KEYS.batch(batch["id"]), "expires_at", 1)
    runner = client.server.app[BATCH_RUNNER]
    await runner.step()
    done = await wait_status(client, batch["id"], "expired")
    assert done["expired_at"] and done["output_file_id"] is None
    errors = await file_lines(client, done["error_file_id"])
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("a", "batch_expired"),
        ("b", "batch_expired"),
    ]
    assert all(x["response"] is None for x in errors)


async def test_a_deleted_input_file_fails_its_remaining_lines(
    served: redis.Redis, make_client: MakeClient
) -> None:
    gw_redis = _async_redis(served)
    store, files = BatchStore(gw_redis, KEYS), FileStore(gw_redis, KEYS)
    file = await files.create("in", "batch", [json.dumps(line("a"))])
    batch = await store.create("/v1/completions", file.id, 1, "24h", None)
    await files.delete(file.id)
    client = await make_client(**FAST)
    done = await wait_status(client, batch.id, "completed")
    [error] = await file_lines(client, done["error_file_id"])
    assert error["error"]["code"] == "input_file_deleted"
    await gw_redis.aclose()


async def test_an_unexpected_error_answers_the_line_500_not_forever(
    served: redis.Redis, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(line_runner, "prepare", broken)
    client = await make_client(**FAST)
    batch = await create_batch(client, jsonl(line("a")))
    done = await wait_status(client, batch["id"], "completed")
    [error] = await file_lines(client, done["error_file_id"])
    assert error["response"]["status_code"] == 500
    assert_openai_error(error["response"]["body"])


async def test_a_stopping_gateway_hands_its_lines_back_at_once(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    client = await make_client(**FAST)
    batch = await create_batch(client, jsonl(line("a")))
    request = await fake_worker.take()
    assert served.zscore(KEYS.batch_leases(batch["id"]), "0") > time.time()
    await client.close()
    assert served.zscore(KEYS.batch_leases(batch["id"]), "0") == 0  # claimable by anyone now
    assert served.exists(KEYS.cancelled(request.request_id))  # and its request cancelled


def _async_redis(r: redis.Redis) -> Any:
    from redis.asyncio import Redis

    kwargs = r.connection_pool.connection_kwargs
    return Redis(host=kwargs["host"], port=kwargs["port"])


@pytest.mark.parametrize(
    "bad",
    [
        {"batch_concurrency": -1},
        {"batch_max_queued": 0},
        {"batch_lease_s": 0},
        {"batch_poll_s": 0},
        {"max_file_bytes": 0},
        {"batch_max_lines": 0},
    ],
)
def test_batch_options_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GatewayConfig(**bad)


def test_a_result_is_one_line_whatever_its_text() -> None:
    """Model text may hold characters that line splitters take for line ends (U+2028, U+2029,
    NEL): escaped, each result stays one JSONL line, and reads back unchanged."""
    text = "a\u2028b\x85c\u2029d\ne"
    line = result_line("x", {"body": {"text": text}})
    assert len(line.splitlines()) == 1
    assert json.loads(line)["response"]["body"]["text"] == text
