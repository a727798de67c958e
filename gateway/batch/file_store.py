"""Batch API files in Redis: an object (OpenAI's file object, as JSON) and its lines (a list).

A file appears whole or not at all: its lines are written first, under a TTL, and the object is
set together with PERSIST in one MULTI, so an upload cut short leaves nothing that outlives the
TTL. Batch output and error files are built the same way (gateway.batch.batch_store commits them).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis

from protocol import Keys

CHUNK_LINES = 1000  # lines per RPUSH / LRANGE: bounded round trips, no huge replies
PARTIAL_TTL_S = 3600  # lines of a file still being written (a writer that died leaves these)


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch (uploads) or batch_output (results)

    def to_json(self) -> dict[str, Any]:
        return {
            "object": "file",
            **asdict(self),
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }

    @classmethod
    def decode(cls, raw: str | bytes) -> FileObject:
        data = json.loads(raw)
        return cls(data["id"], data["bytes"], data["created_at"], data["filename"], data["purpose"])

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def content_bytes(lines: list[str]) -> int:
    """The size of the content route's body: each line and its newline, UTF-8."""
    return sum(len(line.encode()) + 1 for line in lines)


class FileStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis = redis
        self.keys = keys

    async def create(self, filename: str, purpose: str, lines: list[str]) -> FileObject:
        file = FileObject(new_file_id(), content_bytes(lines), int(time.time()), filename, purpose)
        await self.write_lines(self.keys.file_lines(file.id), lines)
        pipe = self.redis.pipeline(transaction=True)
        pipe.persist(self.keys.file_lines(file.id))
        pipe.hset(self.keys.file(file.id), "object", file.encode())
        await pipe.execute()
        return file

    async def write_lines(self, key: str, lines: list[str]) -> None:
        """Append `lines` to the list `key` in chunks, under PARTIAL_TTL_S until made whole."""
        for start in range(0, len(lines), CHUNK_LINES):
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(key, *lines[start : start + CHUNK_LINES])
            pipe.expire(key, PARTIAL_TTL_S)
            await pipe.execute()

    async def get(self, file_id: str) -> FileObject | None:
        raw = await self.redis.hget(self.keys.file(file_id), "object")
        return None if raw is None else FileObject.decode(raw)

    async def lines(self, file_id: str) -> list[bytes]:
        key, lines = self.keys.file_lines(file_id), []
        while chunk := await self.redis.lrange(key, len(lines), len(lines) + CHUNK_LINES - 1):
            lines.extend(chunk)
        return lines

    async def count(self, file_id: str) -> int:
        return int(await self.redis.llen(self.keys.file_lines(file_id)))

    async def content(self, file_id: str) -> bytes:
        return b"".join(line + b"\n" for line in await self.lines(file_id))

    async def delete(self, file_id: str) -> bool:
        deleted = await self.redis.delete(self.keys.file(file_id), self.keys.file_lines(file_id))
        return deleted > 0
