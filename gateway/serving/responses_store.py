"""Stored Responses API responses in Redis, shared by every gateway, each readable only by the
API key that made it.

A stored response is one hash (`Keys.response`) with its owner, the response object (`body`,
what GET returns) and the conversation a continuation reads (`conversation`: the stored
history it continued, its input items, its output items), expiring `ttl_s` after it was
written. A continued conversation is copied whole into each new response, so a continuation
costs one read however long the chain, and an expired or deleted ancestor never breaks it; the
size bound per response (`max_bytes`) bounds the copies.

The owner is the API key's id (`Client.key_id`), or "" on a gateway without keys. A response is
found only by its owner: to any other key it does not exist (404, never 403), so ids say
nothing about other keys' responses. Ids are `resp_` and 128 random bits; anything else is not
looked up.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from protocol import Keys

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


def owner_of(key_id: str | None) -> str:
    return key_id or ""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True)
class ResponseStore:
    redis: aioredis.Redis
    keys: Keys
    ttl_s: float
    max_bytes: int

    def fits(self, conversation: list[dict[str, Any]]) -> bool:
        """Whether a response continuing this conversation could still be stored."""
        return len(_dumps(conversation)) < self.max_bytes

    async def save(
        self, owner: str, body: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> bool:
        """Store a finished response; False when it is over the size bound (not stored)."""
        fields = {"owner": owner, "body": _dumps(body), "conversation": _dumps(conversation)}
        if sum(len(v) for v in fields.values()) > self.max_bytes:
            return False
        key = self.keys.response(body["id"])
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, max(1, int(self.ttl_s * 1000)))
        await pipe.execute()
        return True

    async def body(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The response object, if `owner` stored it and it has not expired."""
        found = await self._read(response_id, owner, "body")
        return None if found is None else json.loads(found)

    async def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The items a continuation of the response starts from (history, input, output)."""
        found = await self._read(response_id, owner, "conversation")
        return None if found is None else json.loads(found)

    async def delete(self, response_id: str, owner: str) -> bool:
        """Whether `owner`'s response was there to delete."""
        if await self._read(response_id, owner, "owner") is None:
            return False
        return bool(await self.redis.delete(self.keys.response(response_id)))

    async def _read(self, response_id: str, owner: str, name: str) -> bytes | None:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        stored_owner, value = await self.redis.hmget(self.keys.response(response_id), "owner", name)
        if stored_owner is None or stored_owner.decode() != owner:
            return None
        return value
