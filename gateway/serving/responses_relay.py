"""A Responses API request's replies, from the relay to the client: one response object, or its
typed event stream, and then the response stored (store: true) before the client is told it is
complete, so a retrieve or a continuation that follows at once finds it.

The relay (gateway.serving.relay) applies the worker's replies as for a chat completion;
`ResponseBuilder` (gateway.openai.responses_output) turns each delta into output items and
events. A request that fails answers with its error (a body), or with an `error` event and
`response.failed` (a stream, whose headers went out already).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.openai.errors import ApiError
from gateway.openai.responses_items import STORED_ITEMS
from gateway.openai.responses_output import ResponseBuilder, usage
from gateway.openai.sse import KEEPALIVE, sse
from gateway.serving.relay import SSE_HEADERS, Relay, final_error
from gateway.serving.responses_store import ResponseStore

log = logging.getLogger(__name__)


def frame(event: dict[str, Any]) -> bytes:
    """An SSE event named by its type, as OpenAI's API sends them."""
    return f"event: {event['type']}\n".encode() + sse(event)


@dataclass(slots=True)
class ResponseReply:
    builder: ResponseBuilder
    conversation: list[dict[str, Any]]  # the stored history and this request's input items
    store: ResponseStore | None  # None: store false
    owner: str

    async def complete(self, relay: Relay) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Once every choice ended: the events that close the output, and the whole response
        (stored first when asked to be)."""
        [choice] = relay.choices
        incomplete = choice.final_reason == "length"
        events = self.builder.finish(incomplete)
        status = "incomplete" if incomplete else "completed"
        body = self.builder.shell.body(status, self.builder.output, usage(relay.usage()))
        if self.store is not None and not await self._save(self.store, body):
            body["store"] = False
        return events, body

    async def _save(self, store: ResponseStore, body: dict[str, Any]) -> bool:
        output = [item.stored() for item in STORED_ITEMS.validate_python(body["output"])]
        try:
            saved = await store.save(self.owner, body, self.conversation + output)
        except RedisError as e:
            log.warning("response not stored id=%s error=%s", body["id"], type(e).__name__)
            return False
        if not saved:
            log.info("response not stored id=%s: over --responses-max-bytes", body["id"])
        return saved


async def collect(relay: Relay, reply: ResponseReply) -> web.Response:
    async for applied in relay.updates():
        if applied is not None:
            reply.builder.add(applied[1])
    if relay.error is not None:
        raise final_error(relay.error)
    _, body = await reply.complete(relay)
    return web.json_response(body, headers={"X-Request-Id": reply.builder.shell.id})


async def stream(relay: Relay, request: web.Request, reply: ResponseReply) -> web.StreamResponse:
    builder = reply.builder
    response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": builder.shell.id})

    async def write(events: list[dict[str, Any]]) -> None:
        for event in events:
            await response.write(frame(event))

    try:
        await response.prepare(request)  # headers go out only now, after XADD returned
        await write(builder.started())
        try:
            async for applied in relay.updates(relay.gw.config.sse_keepalive_s):
                if applied is None:
                    await response.write(KEEPALIVE)
                else:
                    await write(builder.add(applied[1]))
        except ApiError as e:  # no reply in time
            await write(builder.failed(e))
            return response
        if relay.error is not None:
            await write(builder.failed(final_error(relay.error)))
            return response
        events, body = await reply.complete(relay)
        await write([*events, builder.ended(body)])
        await response.write_eof()
    except ConnectionError:  # the client went away mid-write; the caller cancels
        pass
    return response
