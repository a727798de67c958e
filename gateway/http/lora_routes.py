"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies): LoRA
adapters registered for the whole fleet at runtime (protocol/lora_registry.py).

Served only with `--enable-lora-runtime-updates` and API keys (with auth off they are not
routes at all: 404), and then only to keys with role=admin (403). An adapter's path must lie
under `--lora-root` once symlinks are resolved (400), so a key cannot make workers read any
other file, and its files must hold what a worker serves (protocol/lora_manifest.py: a LoRA
config without DoRA or modules_to_save, tensors of covered projections only; 400, naming what
is not). Loading registers the adapter: every gateway lists it, and every worker of its base
model loads it within a second (worker/adapter_watch.py); a request naming it that reaches a
worker first has the worker poll at once. The adapters workers were started with
(`--lora-modules`) cannot be unloaded here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.app_state import GATEWAY
from gateway.http.auth import CLIENT
from gateway.openai.errors import ApiError, bad_request
from gateway.openai.generation_fields import MAX_MODEL_NAME_CHARS
from gateway.openai.validation import parse_json
from gateway.serving.gateway_state import Gateway
from gateway.serving.served_models import ServedModel
from protocol.lora_manifest import manifest_problem
from protocol.lora_registry import RegisteredAdapter

MAX_PATH_CHARS = 4096
# vLLM's fields; `load_inplace` (replace an adapter of the same name) is refused by name.
LOAD_FIELDS = frozenset({"lora_name", "lora_path", "base_model_name"})
UNLOAD_FIELDS = frozenset({"lora_name", "lora_int_id"})


async def load_lora_adapter(request: web.Request) -> web.Response:
    gw = _admin(request)
    body = parse_json(await request.read())
    _known_fields(body, LOAD_FIELDS)
    name = _name(body)
    path = _under_root(gw, _text(body, "lora_path", MAX_PATH_CHARS))
    models = await gw.registry.live_models(miss=True)
    base = _base_model(models, body.get("base_model_name"))
    if any(name == m.name or name in m.adapter_names for m in models):
        raise bad_request("A model or LoRA adapter of that name is served already.", "lora_name")
    problem = await asyncio.to_thread(manifest_problem, path)  # a file read: off the loop
    if problem is not None:  # what every worker would refuse, refused here, by name
        raise bad_request(f"The adapter at 'lora_path' cannot be served: {problem}.", "lora_path")
    entry = RegisteredAdapter(str(path))
    if not await gw.redis.hsetnx(gw.keys.lora_adapters(base.name), name, entry.encode()):
        raise bad_request("A LoRA adapter of that name is loaded already.", "lora_name")
    gw.registry.rescan_soon()  # this gateway lists it at once; the others within a scan
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    gw = _admin(request)
    body = parse_json(await request.read())
    _known_fields(body, UNLOAD_FIELDS)
    name = _name(body)
    models = gw.registry.known_models()
    pipe = gw.redis.pipeline(transaction=False)
    for model in models:
        pipe.hdel(gw.keys.lora_adapters(model.name), name)
    if not any(await pipe.execute() if models else []):
        if any(name in m.card.adapters for m in models):
            raise bad_request(
                "That LoRA adapter was given to the workers at start (--lora-modules); it "
                "cannot be unloaded at runtime.",
                "lora_name",
            )
        raise ApiError(
            404, "No LoRA adapter of that name is loaded.", param="lora_name", code="not_found"
        )
    gw.registry.rescan_soon()
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _admin(request: web.Request) -> Gateway:
    client = request.get(CLIENT)
    if client is None or not client.admin:
        raise ApiError(
            403,
            "This API key may not load or unload LoRA adapters (it needs role=admin).",
            type="permission_error",
            code="insufficient_permissions",
        )
    return request.app[GATEWAY]


def _known_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    if set(body) - known:  # not named: an error never echoes the input
        raise bad_request(f"Unknown field; this route takes {', '.join(sorted(known))}.")


def _text(body: dict[str, Any], field: str, limit: int) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{field!r} is required: a non-empty string.", param=field)
    try:
        value.encode("utf-8")  # a lone surrogate JSON allows has no bytes to store or open
    except UnicodeEncodeError:
        raise bad_request(f"{field!r} must be valid Unicode text.", param=field) from None
    if len(value) > limit or "\0" in value:
        raise bad_request(f"{field!r} must be at most {limit} characters, without NUL.", field)
    return value.strip()


def _name(body: dict[str, Any]) -> str:
    name = _text(body, "lora_name", MAX_MODEL_NAME_CHARS)
    if "=" in name or any(c.isspace() for c in name):
        raise bad_request("'lora_name' must hold no '=' or whitespace.", param="lora_name")
    return name


def _under_root(gw: Gateway, given: str) -> Path:
    """`given` (absolute, or relative to the root) resolved, refused unless it lies under the
    root and exists; nothing about a path outside the root is said (not even whether it is)."""
    assert gw.config.lora_root is not None  # GatewayConfig requires it with the routes on
    root = Path(gw.config.lora_root).resolve()
    try:
        path = (root / given).resolve()  # an absolute `given` replaces the root
    except (OSError, RuntimeError, ValueError):  # a symlink loop, an unreadable component
        path = None
    if path is None or not path.is_relative_to(root):
        raise bad_request("'lora_path' must lie under the gateway's --lora-root.", "lora_path")
    if not path.exists():
        raise bad_request("Nothing exists at 'lora_path' under --lora-root.", "lora_path")
    return path


def _base_model(models: list[ServedModel], named: Any) -> ServedModel:
    """The model the adapter is for: `base_model_name`, else the only one served."""
    if named is not None:
        if not isinstance(named, str):
            raise bad_request("'base_model_name' must be a string.", param="base_model_name")
        for model in models:
            if model.name == named:
                return model
        raise bad_request("'base_model_name' names no served model.", param="base_model_name")
    if len(models) == 1:
        return models[0]
    what = "no model is served" if not models else "several models are served"
    raise bad_request(f"'base_model_name' is required: {what}.", param="base_model_name")


def add_routes(app: web.Application) -> None:
    """Only with --enable-lora-runtime-updates and API keys (else the paths are 404s)."""
    config = app[GATEWAY].config
    if config.enable_lora_runtime_updates and config.api_keys:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
