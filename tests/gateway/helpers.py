"""Gateway test helpers: the model card, heartbeats, and a hand-played worker (FakeWorker).

The tests play the worker's part by hand: read the request entry with XREADGROUP and write
ReplyMessages to its reply stream, so the gateway is tested without torch or a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis
import redis.asyncio as aioredis

from protocol import (
    HEARTBEAT_INTERVAL_S,
    WORKER_GROUP,
    Keys,
    ModelCard,
    ReplyMessage,
    RequestMessage,
)
from tests.services import JitneyProcess, RedisServer, free_port, wait_for

MODEL = "tiny"
MAX_MODEL_LEN = 64
KEYS = Keys("jitney")
MakeClient = Callable[..., Any]  # the make_client fixture: overrides of GatewayConfig


def publish_card(r: redis.Redis, card: ModelCard) -> None:
    r.hset(KEYS.model(card.name), mapping=card.encode())
    r.sadd(KEYS.models, card.name)


def heartbeat(r: redis.Redis, worker_id: str = "fake-worker", at: float | None = None) -> None:
    r.zadd(KEYS.workers, {worker_id: time.time() if at is None else at})


class FakeWorker:
    """Plays the worker: takes the next request off the queue and answers with given replies."""

    def __init__(self, r: aioredis.Redis):
        self.redis = r

    async def take(self, timeout_ms: int = 5000) -> RequestMessage:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            try:
                result = await self.redis.xreadgroup(
                    WORKER_GROUP, "fake", {KEYS.requests: ">"}, count=1, block=timeout_ms
                )
                break
            except redis.ResponseError:  # NOGROUP: the gateway creates it when it enqueues
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)
        assert result, "no request was enqueued"
        (_stream, [(_id, fields)]) = result[0]
        request = RequestMessage.decode(fields)
        # As a worker does: its prompt tokens are no longer queued.
        await self.redis.decrby(KEYS.queued_tokens, len(request.prompt_token_ids))
        return request

    async def reply(self, request: RequestMessage, *replies: ReplyMessage) -> None:
        for reply in replies:
            await self.redis.xadd(request.reply_to, reply.encode())

    async def answer(
        self, request: RequestMessage, pieces: list[str], finish: str = "stop"
    ) -> list[ReplyMessage]:
        """One reply per piece (token ids 10, 11, ...), the last one final."""
        n = len(request.prompt_token_ids)
        replies = [
            ReplyMessage(request.request_id, seq, [10 + seq], text)
            for seq, text in enumerate(pieces)
        ]
        last = replies[-1]
        replies[-1] = replace(
            last, finish_reason=finish, prompt_tokens=n, completion_tokens=len(pieces)
        )
        await self.reply(request, *replies)
        return replies


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

    def __init__(self, r: redis.Redis, worker_id: str = "fake-worker"):
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
    once ("ok", finish_reason stop), so accepted requests end quickly."""

    def __init__(self, r: redis.Redis):
        super().__init__(r)
        self.answered = 0

    def _run(self) -> None:
        beat_at = 0.0
        while not self._stop.is_set():
            if time.monotonic() - beat_at > HEARTBEAT_INTERVAL_S:
                heartbeat(self.redis, self.worker_id)
                beat_at = time.monotonic()
            try:
                result = self.redis.xreadgroup(
                    WORKER_GROUP, "answering", {KEYS.requests: ">"}, count=64, block=100
                )
            except redis.ResponseError:  # NOGROUP until the gateway creates it
                time.sleep(0.05)
                continue
            for _stream, entries in result or []:
                for _id, fields in entries:
                    request = RequestMessage.decode(fields)
                    final = ReplyMessage(
                        request.request_id,
                        0,
                        [10],
                        "ok",
                        finish_reason="stop",
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=1,
                    )
                    self.redis.xadd(request.reply_to, final.encode())
                    self.answered += 1
