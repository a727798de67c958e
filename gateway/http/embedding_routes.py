"""POST /v1/embeddings: the HTTP side of an embeddings request.

As the generation routes do: the body read, the API key's share applied (tokens/min, default
priority, fair-share weight), then the embeddings path (gateway.serving.embedding_path), whose
inputs travel the generation queue as prefill-only requests.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.auth import CLIENT
from gateway.http.completion_routes import serve_generation
from gateway.http.ratelimit import charge_tokens
from gateway.openai.validation import parse_json
from gateway.serving import embedding_path
from gateway.serving.gateway_state import Gateway


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await serve_generation(request, _serve)  # refused while draining, else waited for


async def _serve(request: web.Request, gw: Gateway) -> web.StreamResponse:
    job = await embedding_path.prepare(gw, parse_json(await request.read()))
    await charge_tokens(request, job.cost)  # per-key tokens/min
    client = request.get(CLIENT)
    priority = job.parsed.priority
    if priority is None:  # the request's own, else its API key's default, else 0
        priority = 0 if client is None else client.priority
    key_id = None if client is None else client.key_id
    weight = None if client is None else client.weight
    request_id, body = await embedding_path.run(gw, job, priority, key_id, weight)
    return web.json_response(body, headers={"X-Request-Id": request_id})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
