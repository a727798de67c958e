"""Runtime LoRA adapters over the API (the gateway in-process, real Redis): loaded and unloaded by
an admin key into the fleet's registry, listed in /v1/models and served on the base model's
queue; refused to other keys (403), absent without the flag or without keys (404), a path
outside --lora-root (a symlink out of it too) refused (400), and an adapter no worker would serve
refused by name (400)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from aiohttp.test_utils import TestClient
from safetensors.numpy import save_file

from gateway.config import ApiKey, parse_api_keys
from protocol.lora_registry import read_registry
from tests.gateway.helpers import KEYS, MODEL, FakeWorker, MakeClient, assert_openai_error

Client = TestClient[Any, Any]
ADMIN, USER = "admin-secret", "user-secret"
KEYS_FILE = [f"ops:{ADMIN} role=admin", f"app:{USER}"]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


Q_PROJ = "model.layers.0.self_attn.q_proj"


def write_adapter(path: Path, modules: tuple[str, ...] = (Q_PROJ,), **config: Any) -> None:
    """A PEFT adapter directory as the gateway reads it (its config, its tensors' names)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    tensors = {
        f"base_model.model.{m}.lora_{half}.weight": np.zeros((2, 2), np.float32)
        for m in modules
        for half in "AB"
    }
    save_file(tensors, path / "adapter_model.safetensors")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_adapter(tmp_path / "root" / "sql")
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "escape").symlink_to(tmp_path / "outside")
    return tmp_path / "root"


@pytest.fixture
async def admin_client(served: redis.Redis, make_client: MakeClient, root: Path) -> Client:
    keys = tuple(parse_api_keys(KEYS_FILE, "test"))
    return await make_client(api_keys=keys, enable_lora_runtime_updates=True, lora_root=str(root))


def test_a_key_is_admin_only_with_role_admin() -> None:
    ops, app = parse_api_keys(KEYS_FILE, "test")
    assert ops.admin and not app.admin
    with pytest.raises(ValueError, match="role must be one of user, admin"):
        parse_api_keys([f"x:{ADMIN} role=root"], "test")


async def test_an_admin_loads_an_adapter_every_route_then_serves_and_unloads_it(
    admin_client: Client, served: redis.Redis, fake_worker: FakeWorker, root: Path
) -> None:
    body = {"lora_name": "sql", "lora_path": str(root / "sql")}
    response = await admin_client.post(LOAD, json=body, headers=bearer(ADMIN))
    assert response.status == 200, await response.text()
    registry = read_registry(served.hgetall(KEYS.lora_adapters(MODEL)))
    assert registry["sql"].path == str((root / "sql").resolve())
    again = await admin_client.post(LOAD, json=body, headers=bearer(ADMIN))
    assert again.status == 400

    models = await (await admin_client.get("/v1/models", headers=bearer(USER))).json()
    listed = {m["id"]: m for m in models["data"]}
    assert listed["sql"]["parent"] == MODEL and listed["sql"]["root"] == registry["sql"].path

    completion = {"model": "sql", "prompt": "hi", "max_tokens": 2}
    call = asyncio.create_task(
        admin_client.post("/v1/completions", json=completion, headers=bearer(USER))
    )
    request = await fake_worker.take()
    assert request.model == MODEL and request.lora == "sql"
    await fake_worker.answer(request, ["ok"])
    assert (await call).status == 200

    gone = await admin_client.post(UNLOAD, json={"lora_name": "sql"}, headers=bearer(ADMIN))
    assert gone.status == 200, await gone.text()
    assert not served.hgetall(KEYS.lora_adapters(MODEL))
    missing = await admin_client.post(UNLOAD, json={"lora_name": "sql"}, headers=bearer(ADMIN))
    assert missing.status == 404
    assert_openai_error(await missing.json(), param="lora_name")
    after = await admin_client.post("/v1/completions", json=completion, headers=bearer(USER))
    assert after.status == 404


async def test_a_key_without_the_admin_role_is_refused(admin_client: Client, root: Path) -> None:
    for path, body in ((LOAD, {"lora_name": "a", "lora_path": str(root)}), (UNLOAD, {})):
        response = await admin_client.post(path, json=body, headers=bearer(USER))
        assert response.status == 403
        assert_openai_error(await response.json())


@pytest.mark.parametrize(
    "path", ["../outside", "/etc", "escape", "nothing-here"], ids=["dotdot", "abs", "link", "none"]
)
async def test_a_path_outside_the_root_or_missing_is_refused(
    admin_client: Client, served: redis.Redis, path: str
) -> None:
    body = {"lora_name": "x", "lora_path": path}
    response = await admin_client.post(LOAD, json=body, headers=bearer(ADMIN))
    assert response.status == 400
    assert_openai_error(await response.json(), param="lora_path")
    assert not served.hgetall(KEYS.lora_adapters(MODEL))


@pytest.mark.parametrize(
    "overrides",
    [
        {"api_keys": (ApiKey("ops", ADMIN, admin=True),)},  # keys, but not the flag
        {"enable_lora_runtime_updates": True, "lora_root": "/tmp"},  # the flag, auth off
    ],
    ids=["flag-off", "auth-off"],
)
async def test_the_routes_are_404s_without_the_flag_or_without_keys(
    served: redis.Redis, make_client: MakeClient, overrides: dict[str, Any]
) -> None:
    client = await make_client(**overrides)
    response = await client.post(
        LOAD, json={"lora_name": "a", "lora_path": "/tmp"}, headers=bearer(ADMIN)
    )
    assert response.status == 404
    assert_openai_error(await response.json())


@pytest.mark.parametrize(
    ("modules", "config", "named"),
    [
        ((Q_PROJ, "lm_head"), {}, "'lm_head' is not a module"),
        ((Q_PROJ,), {"use_dora": True}, "DoRA is not supported"),
        ((Q_PROJ,), {"peft_type": "IA3"}, "a IA3 adapter"),
    ],
    ids=["lm-head", "dora", "ia3"],
)
async def test_an_adapter_no_worker_would_serve_is_refused_by_name(
    admin_client: Client, served: redis.Redis, root: Path, modules, config, named
) -> None:
    write_adapter(root / "odd", modules, **config)
    body = {"lora_name": "odd", "lora_path": "odd"}
    response = await admin_client.post(LOAD, json=body, headers=bearer(ADMIN))
    assert response.status == 400
    error = await response.json()
    assert_openai_error(error, param="lora_path")
    assert named in error["error"]["message"]
    assert not served.hgetall(KEYS.lora_adapters(MODEL))
