"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API.

A request runs as the chat completion it translates to (gateway.openai.responses_input), down
the chat route's own path (request_path.prepare_parsed, then completion_routes.enqueue: the same
queue, auth, rate limits, priorities and fair share); its replies become a response object or
its event stream (gateway.serving.responses_relay). A stored response (store: true, the default)
belongs to the API key that made it (gateway.serving.responses_store): to any other key it does
not exist, so reading, continuing (previous_response_id) or deleting it is a 404.
"""

from __future__ import annotations

import time

from aiohttp import web

from gateway.app_state import GATEWAY
from gateway.http.auth import CLIENT
from gateway.http.completion_routes import enqueue, serve_generation
from gateway.openai.errors import ApiError, bad_request
from gateway.openai.responses_input import chat_request, responses_error
from gateway.openai.responses_items import STORED_ITEMS, InputItem
from gateway.openai.responses_models import parse_responses
from gateway.openai.responses_output import ResponseBuilder, ResponseShell, echo, new_id
from gateway.openai.validation import parse_json
from gateway.serving.gateway_state import Gateway
from gateway.serving.relay import Relay
from gateway.serving.request_path import prepare_parsed
from gateway.serving.responses_relay import ResponseReply, collect, stream
from gateway.serving.responses_store import ResponseStore, owner_of

# GET's query options OpenAI has for background responses, which this server never runs.
UNSUPPORTED_QUERY = ("include", "include[]", "starting_after")


def not_found(param: str, code: str) -> ApiError:
    return ApiError(404, "No response with that id.", param=param, code=code)


def _store(gw: Gateway) -> ResponseStore:
    config = gw.config
    return ResponseStore(gw.redis, gw.keys, config.responses_ttl_s, config.responses_max_bytes)


def _owner(request: web.Request) -> str:
    client = request.get(CLIENT)
    return owner_of(None if client is None else client.key_id)


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve_generation(request, _create)


async def _create(request: web.Request, gw: Gateway) -> web.StreamResponse:
    received = time.monotonic()
    body = parse_json(await request.read())  # over client_max_size: 413 via the middleware
    parsed = parse_responses(body)
    store, owner = _store(gw), _owner(request)
    history: list[InputItem] = []
    if parsed.previous_response_id is not None:
        stored = await store.conversation(parsed.previous_response_id, owner)
        if stored is None:
            raise not_found("previous_response_id", "previous_response_not_found")
        history = STORED_ITEMS.validate_python(stored)
    conversation = [item.stored() for item in (*history, *parsed.input)]
    if parsed.store and not store.fits(conversation):
        raise bad_request(
            f"The conversation is larger than a stored response may be ({store.max_bytes} "
            "bytes); send 'store': false, or start a new conversation.",
            param="input",
        )
    try:
        job = await prepare_parsed(gw, "chat", chat_request(parsed, body, history))
    except ApiError as e:
        raise responses_error(e) from None
    shell = ResponseShell(new_id("resp"), job.model.served_name, echo(parsed, job.parsed))
    reply = ResponseReply(
        ResponseBuilder(shell), conversation, store if parsed.store else None, owner
    )

    async def deliver(relay: Relay) -> web.StreamResponse:
        if parsed.stream:
            return await stream(relay, request, reply)
        return await collect(relay, reply)

    return await enqueue(request, gw, job, received, deliver, request_id=shell.id)


async def get_response(request: web.Request) -> web.Response:
    for name in UNSUPPORTED_QUERY:
        if name in request.query:
            raise bad_request(f"'{name}' is not supported by this server.", param=name)
    if request.query.get("stream", "false") != "false":
        raise bad_request(
            "A stored response cannot be streamed again; retrieve it whole.", param="stream"
        )
    gw = request.app[GATEWAY]
    body = await _store(gw).body(request.match_info["response_id"], _owner(request))
    if body is None:
        raise not_found("response_id", "response_not_found")
    return web.json_response(body)


async def delete_response(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    if not await _store(gw).delete(response_id, _owner(request)):
        raise not_found("response_id", "response_not_found")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
