"""POST /v1/completions and /v1/chat/completions: the HTTP side of a generation request.

The body is read here, the API key's share applied (tokens/min, default priority, fair-share
weight), and the request sent down the request path (gateway.serving.request_path: `prepare`,
then `submit`), whose relay answers with a JSON body or an SSE stream. The Responses API's
route (gateway.http.responses_routes) takes the same steps through `serve_generation` and
`enqueue`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial

from aiohttp import web

from gateway.app_state import GATEWAY
from gateway.http.auth import CLIENT
from gateway.http.ratelimit import charge_tokens
from gateway.openai.completion_bodies import Kind
from gateway.openai.errors import shutting_down
from gateway.openai.request_models import GenerationRequest
from gateway.openai.validation import parse_json
from gateway.serving.gateway_state import Gateway
from gateway.serving.relay import Relay
from gateway.serving.request_path import Job, prepare, submit

Serve = Callable[[web.Request, Gateway], Awaitable[web.StreamResponse]]


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    return await serve_generation(request, partial(_serve, kind=kind))


async def serve_generation(request: web.Request, serve: Serve) -> web.StreamResponse:
    """`serve` the request unless this gateway is draining; a drain waits for it meanwhile."""
    gw = request.app[GATEWAY]
    if gw.draining:  # a load balancer that has not noticed /ready yet: send it elsewhere
        raise shutting_down()
    gw.active_requests += 1  # a drain waits for these, tokenizing ones included
    try:
        return await serve(request, gw)
    finally:
        gw.active_requests -= 1


async def _serve(request: web.Request, gw: Gateway, kind: Kind) -> web.StreamResponse:
    received = time.monotonic()
    body = parse_json(await request.read())  # over client_max_size: 413 via the middleware
    job = await prepare(gw, kind, body)
    stream = job.parsed.stream

    async def deliver(relay: Relay) -> web.StreamResponse:
        return await (relay.stream(request) if stream else relay.collect())

    return await enqueue(request, gw, job, received, deliver)


async def enqueue(
    request: web.Request,
    gw: Gateway,
    job: Job,
    received: float,
    deliver: Callable[[Relay], Awaitable[web.StreamResponse]],
    request_id: str = "",
) -> web.StreamResponse:
    """A prepared job charged to its API key (tokens/min) and submitted with the key's
    priority and fair-share weight (request_path.submit): admitted, enqueued, delivered."""
    await charge_tokens(request, job.cost)  # per-key tokens/min
    client = request.get(CLIENT)
    key_id = None if client is None else client.key_id
    priority = _priority(request, job.parsed)
    weight = None if client is None else client.weight
    return await submit(
        gw, job, priority, received, deliver, request_id=request_id, key_id=key_id, weight=weight
    )


def _priority(request: web.Request, parsed: GenerationRequest) -> int:
    """The request's own priority, else its API key's default, else 0."""
    if parsed.priority is not None:
        return parsed.priority
    client = request.get(CLIENT)
    return 0 if client is None else client.priority
