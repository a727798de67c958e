"""Gateway test helpers: the model card, heartbeats, and a hand-played worker (FakeWorker).

The tests play the worker's part by hand, so the gateway is tested without torch or a model. The
fake makes the worker's own Redis calls (worker.redis_io.WorkerRedis: the group read, the
queued-token count, the atomic reply + progress + ack publish), so it cannot drift from the
worker there; what it answers is checked against a real `jitney worker` in
test_fake_worker_contract.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from engine.models.tiny_model import build_tiny_tokenizer
from protocol import (
    HEARTBEAT_INTERVAL_S,
    Keys,
    ModelCard,
    ReplyMessage,
    RequestMessage,
    pack_vector,
)
from tests.services import JitneyProcess, RedisServer, free_port, wait_for
from worker.redis_io import EntryRef, Outbox, WorkerRedis

MODEL = "tiny"
TOKENIZER = build_tiny_tokenizer()
MAX_MODEL_LEN = 64
KEYS = Keys("jitney")
REQUESTS = KEYS.requests(MODEL)  # the request stream of MODEL
QUEUED_TOKENS = KEYS.queued_tokens(MODEL)
FAKE_WORKER_ID = "fake-worker"  # its heartbeat's id and its consumer name, as for a real worker
READ_BLOCK_MS = 200  # one blocking read of the fake: short, so a wait can end between reads
MakeClient = Callable[..., Any]  # the make_client fixture: overrides of GatewayConfig


def publish_card(r: redis.Redis, card: ModelCard) -> None:
    WorkerRedis(r, KEYS, FAKE_WORKER_ID, card.name).publish_card(card)


def heartbeat(
    r: redis.Redis, worker_id: str = FAKE_WORKER_ID, at: float | None = None, model: str = MODEL
) -> None:
    """A worker's lease renewed now (or `at`: a stale one), as a worker of `model`; the real one
    is WorkerRedis.heartbeat, which cannot backdate."""
    beat = {worker_id: time.time() if at is None else at}
    r.zadd(KEYS.workers, beat)
    r.zadd(KEYS.model_workers(model), beat)


def enqueued_total(r: redis.Redis) -> int:
    """Requests ever enqueued (its length is no count: a worker deletes what it has answered)."""
    return int(r.xinfo_stream(REQUESTS)["entries-added"]) if r.exists(REQUESTS) else 0


def tokens(text: str) -> list[int]:
    """The token ids of `text` in the tiny tokenizer (byte-level: any text round-trips). Workers
    send ids only; the gateway makes the text."""
    return list(TOKENIZER.encode(text))


def replies_for(
    request: RequestMessage,
    pieces: list[str],
    finish: str = "stop",
    index: int = 0,
    first_seq: int = 0,
) -> list[ReplyMessage]:
    """A generation as a worker replies it: one reply per piece of text (its tokens), seq
    first_seq, first_seq + 1, ...; the last one final with the usage. `index`: the choice."""
    replies = [
        ReplyMessage(request.request_id, seq, tokens(text), index=index)
        for seq, text in enumerate(pieces, start=first_seq)
    ]
    last = replies[-1]
    last.finish_reason = finish
    last.prompt_tokens = len(request.prompt_token_ids)
    last.completion_tokens = sum(len(reply.token_ids) for reply in replies)
    return replies


class FakeWorker:
    """Plays the worker: takes the next request off the queue and answers with given replies.

    The plain methods are blocking (for a thread); take, reply, answer and reject await them
    in a thread, so the in-process gateway keeps running meanwhile."""

    def __init__(self, io: WorkerRedis):
        self.io = io
        self.entries: dict[str, EntryRef] = {}  # request id -> its queue entry, acked when final
        self.finals: dict[str, int] = {}  # request id -> final replies sent (one per choice)

    @staticmethod
    def n_of(request: RequestMessage) -> int:
        return int(request.sampling.get("n", 1))

    @classmethod
    def connect(cls, url: str, worker_id: str = FAKE_WORKER_ID, model: str = MODEL) -> FakeWorker:
        return cls(WorkerRedis.connect(url, KEYS, worker_id, model, READ_BLOCK_MS))

    def close(self) -> None:
        self.io.client.close()

    def read(self, count: int, block_ms: int) -> list[RequestMessage]:
        """Up to `count` new requests, as a worker reads them: their prompt tokens leave the
        queued-token count."""
        entries = self.io.read_requests(count, block_ms)
        requests = [RequestMessage.decode(entry.fields) for entry in entries]
        queued = sum(len(request.prompt_token_ids) for request in requests)
        self.io.dequeue([request.request_id for request in requests], queued)
        for entry, request in zip(entries, requests, strict=True):
            self.entries[request.request_id] = entry.ref
        return requests

    def send(self, request: RequestMessage, replies: list[ReplyMessage]) -> None:
        """Publish replies as a worker does; the request's last final (every choice's normal
        one, or any other) acks and deletes the request entry."""
        outbox = Outbox()
        rid = request.request_id
        for reply in replies:
            outbox.replies.append((request.reply_to, reply))
            if reply.is_final:
                self.finals[rid] = self.finals.get(rid, 0) + 1
                normal = reply.finish_reason in ("stop", "length")
                if rid in self.entries and (not normal or self.finals[rid] == self.n_of(request)):
                    outbox.acks.append(self.entries.pop(rid))
        assert self.io.publish(outbox), f"{self.io.worker_id} is fenced"

    async def take(self, timeout_ms: int = 5000) -> RequestMessage:
        deadline = time.monotonic() + timeout_ms / 1000
        while not (requests := await asyncio.to_thread(self.read, 1, READ_BLOCK_MS)):
            assert time.monotonic() < deadline, "no request was enqueued"
        return requests[0]

    async def reply(self, request: RequestMessage, *replies: ReplyMessage) -> None:
        await asyncio.to_thread(self.send, request, list(replies))

    async def answer(
        self, request: RequestMessage, pieces: list[str], finish: str = "stop"
    ) -> list[ReplyMessage]:
        """One reply per piece (token ids 10, 11, ...), the last one final."""
        replies = replies_for(request, pieces, finish)
        await self.reply(request, *replies)
        return replies

    async def reject(
        self,
        request: RequestMessage,
        reason: str,
        error: str | None = None,
        error_type: str | None = None,
    ) -> None:
        """End a request the worker never started (bad, expired, cancelled): one final reply."""
        final = ReplyMessage(
            request.request_id, 0, finish_reason=reason, error=error, error_type=error_type
        )
        await self.reply(request, final)


def sse_events(raw: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    events = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(body: dict[str, Any], param: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# --- live `jitney gateway` processes (real sockets, real Redis) ---------------------------------


@dataclass
class LiveGateway:
    proc: JitneyProcess
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_gateway(
    server: RedisServer, *flags: str, env: dict[str, str] | None = None, name: str = "gateway"
) -> LiveGateway:
    """`jitney gateway` on a free port against `server`, once /health answers."""
    port = free_port()
    args = ["gateway", "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = JitneyProcess(args, {"REDIS_URL": server.url, **(env or {})}, name=name)
    gateway = LiveGateway(proc, port)

    def up() -> bool:
        assert proc.alive(), proc.output()[-3000:]
        return http(f"{gateway.base}/health")[0] == 200

    wait_for(up, 60, f"{name} /health")
    return gateway


def http(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request with urllib: status, headers and body, for error statuses too."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def raw_http(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes on a fresh connection; read one response (to its Content-Length, or until
    the server closes: aiohttp may linger for seconds reading a body it will not use)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        # The server may answer and close before taking it all; then read what it said.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        received = b""
        while not _complete(received):
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    return received


def _complete(received: bytes) -> bool:
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def parse_raw_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


class KeepHeartbeat:
    """A fake worker's heartbeat kept fresh from a thread, so the gateway sees a live worker."""

    def __init__(self, r: redis.Redis, worker_id: str = FAKE_WORKER_ID):
        self.redis = r
        self.worker_id = worker_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(redis.RedisError):
                heartbeat(self.redis, self.worker_id)
            self._stop.wait(HEARTBEAT_INTERVAL_S)

    def __enter__(self) -> KeepHeartbeat:
        heartbeat(self.redis, self.worker_id)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


class AnsweringWorker(KeepHeartbeat):
    """Plays a worker from a thread: every request read from the queue gets one final reply at
    once ("ok", finish_reason stop; an embedding's, a vector), so accepted requests end
    quickly."""

    def __init__(self, r: redis.Redis):
        super().__init__(r)
        self.worker = FakeWorker(WorkerRedis(r, KEYS, self.worker_id, MODEL))
        self.answered = 0

    def _run(self) -> None:
        beat_at = 0.0
        while not self._stop.is_set():
            if time.monotonic() - beat_at > HEARTBEAT_INTERVAL_S:
                heartbeat(self.redis, self.worker_id)
                beat_at = time.monotonic()
            for request in self.worker.read(64, 100):
                n = request.sampling_params.n
                replies = [replies_for(request, ["ok"], index=i, first_seq=i)[0] for i in range(n)]
                if request.embed:
                    replies = [ReplyMessage(request.request_id, 0, finish_reason="stop")]
                    replies[0].embedding = pack_vector([0.5, -0.5, 0.5, 0.5])
                self.worker.send(request, replies)
                self.answered += 1
