"""POST /tokenize, POST /detokenize and GET /tokenizer_info: a served model's tokenizer, in vLLM's
shapes (at the root, not under /v1/, as vLLM serves them).

The ids are those a generation request with the same input is given: a prompt goes through
`ServedModel.encode` (with `add_special_tokens`, the default) as /v1/completions' text prompts
do, and a chat through `tools.chat_input` + `ServedModel.chat_ids` as /v1/chat/completions'
messages do, with the options chat completions do not have (no generation prompt, continuing
the final message, the tokenizer's specials) passed to the same rendering.

lm-evaluation-harness' remote tokenizer (`local-completions` with no local tokenizer) reads
GET /tokenizer_info (it needs `eos_token`, `bos_token` and `chat_template`, which it renders
itself), then POST /tokenize and /detokenize without a `model`: one model served is that one.
These routes enqueue nothing; each is one request against the caller's rate limit.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from gateway.app_state import GATEWAY
from gateway.http.auth import CLIENT
from gateway.http.ratelimit import RATE_LIMITER
from gateway.openai import tools
from gateway.openai.errors import bad_request, shutting_down
from gateway.openai.generation_fields import MAX_MODEL_NAME_CHARS
from gateway.openai.tokenize_models import (
    TokenizeChat,
    TokenizePrompt,
    parse_detokenize,
    parse_tokenize,
)
from gateway.openai.validation import parse_json
from gateway.serving.gateway_state import Gateway
from gateway.serving.served_models import ServedModel


async def tokenize(request: web.Request) -> web.Response:
    gw = await _admit(request)
    parsed = parse_tokenize(parse_json(await request.read()))
    model = await gw.registry.resolve(parsed.model)
    ids = await _token_ids(gw, model, parsed)
    strs = None
    if parsed.return_token_strs:
        strs = await gw.registry.run(model.tokenizer.convert_ids_to_tokens, ids)
    max_model_len = model.card.max_model_len
    body = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    gw = await _admit(request)
    parsed = parse_detokenize(parse_json(await request.read()))
    model = await gw.registry.resolve(parsed.model)
    if parsed.tokens and max(parsed.tokens) >= model.vocab_size:
        raise bad_request(
            f"'tokens' holds token ids outside the vocabulary (size {model.vocab_size}).",
            param="tokens",
        )
    # The decoder that makes replies' and echoed prompts' text, specials kept (a round trip).
    text = model.decoder.decode(parsed.tokens, skip_special_tokens=False)
    return web.json_response({"prompt": text})


async def tokenizer_info(request: web.Request) -> web.Response:
    gw = await _admit(request)
    name = request.query.get("model") or None
    if name is not None and len(name) > MAX_MODEL_NAME_CHARS:
        raise bad_request(
            f"'model' must be at most {MAX_MODEL_NAME_CHARS} characters.", param="model"
        )
    return web.json_response(_info(await gw.registry.resolve(name)))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)


async def _admit(request: web.Request) -> Gateway:
    """Draining refuses as the generation routes do; the rate limiter's middleware charges
    /v1/ paths only, so these root routes charge their one request here."""
    gw = request.app[GATEWAY]
    if gw.draining:
        raise shutting_down()
    limiter = request.app.get(RATE_LIMITER)
    client = request.get(CLIENT)
    if limiter is not None and client is not None:
        await limiter.charge(client, requests=1)
    return gw


async def _token_ids(
    gw: Gateway, model: ServedModel, parsed: TokenizePrompt | TokenizeChat
) -> list[int]:
    if isinstance(parsed, TokenizePrompt):
        if parsed.add_special_tokens:  # the very call /v1/completions makes
            return await gw.registry.run(model.encode, parsed.prompt)
        encode = partial(model.tokenizer.encode, add_special_tokens=False)
        return list(await gw.registry.run(encode, parsed.prompt))
    messages, specs = tools.chat_input(
        parsed.template_messages(), parsed.tool_config, model.template_has_tools
    )
    render = partial(
        model.chat_ids,
        add_generation_prompt=parsed.add_generation_prompt,
        continue_final_message=parsed.continue_final_message,
        add_special_tokens=parsed.add_special_tokens,
    )
    return await gw.registry.run(render, messages, specs, parsed.chat_template_kwargs)


def _info(model: ServedModel) -> dict[str, Any]:
    """The tokenizer's config as vLLM's /tokenizer_info gives it (its special tokens, chat
    template and length limit), from the model card."""
    card = model.card
    info: dict[str, Any] = {
        "tokenizer_class": type(model.tokenizer).__name__,
        "model": model.name,
        "vocab_size": model.vocab_size,
        "model_max_length": card.max_model_len,
        "max_model_len": card.max_model_len,
        "chat_template": card.chat_template,
        "eos_token_ids": list(card.eos_token_ids),
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = card.special_tokens.get(name)
        info[name] = token
        info[f"{name}_id"] = None if token is None else model.decoder.token_to_id(token)
    return info
