"""The worker's sampling defaults: `--generation-config auto|vllm|DIR` and
`--override-generation-config`, read into the model card it publishes; every refusal is a clear
start-up error (exit 2), and a model without sampling keys keeps the API's defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

from engine.models.model_loader import TINY_RANDOM, load_model, read_generation_config
from protocol import Keys, ModelCard
from protocol.model_card import card_from_tokenizer
from protocol.sampling_defaults import SamplingDefaults
from tests.model_dirs import write_random_llama
from tests.services import (
    JitneyProcess,
    RedisServer,
    start_gateway,
    start_worker,
    wait_for,
    wait_ready,
)
from worker import generation_defaults
from worker.generation_defaults import AUTO, VLLM, from_generation_config, parse_override, resolve
from worker.service_config import ServiceConfig

# A generation_config.json as transformers writes one: sampling keys among others.
FILE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 5],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": None,  # transformers' "not set"
    "max_new_tokens": 48,
    "min_p": 0.05,  # no such sampler option in Jitney: passed over with a warning
    "transformers_version": "4.51.0",
}
FROM_FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 48}
TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
)


def config_dir(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_file_s_sampling_keys_become_api_defaults():
    """temperature, top_p, top_k, repetition_penalty and max_new_tokens (as max_tokens) are
    taken; null is "not set"; every other key (eos ids, do_sample, ...) is no sampling default."""
    assert from_generation_config(FILE, "f").to_dict() == FROM_FILE
    assert from_generation_config({"top_k": -1}, "f").top_k == 0  # vLLM's "off" is 0's
    assert from_generation_config({"min_p": 0.0, "eos_token_id": 2}, "f") == SamplingDefaults()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"temperature": "hot"}, "f: temperature must be a number, got 'hot'"),
        ({"temperature": 2.5}, r"f: temperature must be in \[0, 2\], got 2.5"),
        ({"temperature": float("nan")}, "f: temperature must be a number, got nan"),
        ({"top_p": 0}, r"f: top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": 2.5}, "f: top_k must be an integer, got 2.5"),
        ({"top_k": -2}, "f: top_k must be >= 0"),
        ({"repetition_penalty": True}, "f: repetition_penalty must be a number, got True"),
        ({"max_new_tokens": 0}, "f: max_new_tokens must be >= 1, got 0"),
    ],
)
def test_a_bad_value_in_the_file_is_refused_naming_the_file_and_key(config, message):
    with pytest.raises(ValueError, match=message):
        from_generation_config(config, "f")


def test_the_override_parses_and_wins_over_the_file():
    override = parse_override('{"temperature": 0.5, "max_new_tokens": 8}')
    assert override.to_dict() == {"temperature": 0.5, "max_tokens": 8}
    assert resolve(AUTO, override, FILE).to_dict() == {
        **FROM_FILE,
        "temperature": 0.5,
        "max_tokens": 8,
    }
    assert parse_override("") == parse_override("  ") == parse_override("{}") == SamplingDefaults()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{temperature: 1}", "--override-generation-config is not JSON"),
        ("[0.5]", "--override-generation-config must be a JSON object, got list"),
        ('{"temp": 0.5}', "unknown or unsupported key\\(s\\) temp; known: temperature, top_p"),
        ('{"min_p": 0.1}', "unknown or unsupported key\\(s\\) min_p"),  # no such sampler option
        ('{"max_tokens": 5}', "unknown or unsupported key\\(s\\) max_tokens"),  # the file's names
        ('{"top_p": 1.5}', r"--override-generation-config: top_p must be in \(0, 1\]"),
    ],
)
def test_a_bad_override_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_override(text)


def test_the_sources(tmp_path):
    """auto: the model's file; vllm: nothing (the API's defaults) whatever the model holds; a
    directory: its file instead of the model's; the override on top of each."""
    other = config_dir(tmp_path / "other", {"temperature": 0.1, "top_k": 5})
    override = parse_override('{"top_p": 0.8}')
    assert resolve(AUTO, SamplingDefaults(), FILE).to_dict() == FROM_FILE
    assert resolve(VLLM, SamplingDefaults(), FILE) == SamplingDefaults()
    assert resolve(VLLM, override, FILE).to_dict() == {"top_p": 0.8}
    assert resolve(str(other), override, FILE).to_dict() == {
        "temperature": 0.1,
        "top_k": 5,
        "top_p": 0.8,
    }
    assert resolve(AUTO, SamplingDefaults(), {}) == SamplingDefaults()  # tiny-random's case


def test_service_config_refuses_a_bad_source_or_override_before_the_model_loads(tmp_path):
    ok = config_dir(tmp_path / "ok", {})
    assert ServiceConfig("w", generation_config=str(ok)).generation_config == str(ok)
    with pytest.raises(ValueError, match="must be auto, vllm or a directory holding a genera"):
        ServiceConfig("w", generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="must be auto, vllm or a directory"):
        ServiceConfig("w", generation_config="VLLM")
    with pytest.raises(ValueError, match="unknown or unsupported key"):
        ServiceConfig("w", override_generation_config='{"seed": 1}')


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "generation_config.json does not exist"),
        ("{not json", "generation_config.json is not readable JSON"),
        ("[1, 2]", "generation_config.json must hold a JSON object, got list"),
    ],
)
def test_read_generation_config_refusals(tmp_path, content, message):
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_generation_config(tmp_path)
    with pytest.raises(ValueError, match=message):  # and so resolve() of that directory
        resolve(str(tmp_path), SamplingDefaults(), {})


def test_the_loader_reads_a_model_directory_s_file_and_smollm2_gets_its_authors_values(
    tmp_path,
):
    """A Hugging Face directory's generation_config.json as written; an in-process model has
    none; SmolLM2's converted file has no sampling keys, so its model card's values apply."""
    model_dir = write_random_llama(tmp_path / "m", **TINY_LLAMA)
    config_dir(model_dir, FILE)
    assert load_model(str(model_dir)).generation_config == FILE
    assert load_model(TINY_RANDOM).generation_config == {}
    smollm2 = load_model("smollm2-135m")
    assert resolve(AUTO, SamplingDefaults(), smollm2.generation_config).to_dict() == {
        "temperature": 0.2,
        "top_p": 0.9,
    }


def test_the_card_carries_the_defaults_and_an_old_card_reads_as_none():
    tiny = load_model(TINY_RANDOM)
    defaults = SamplingDefaults(temperature=0.2, top_k=3)
    card = card_from_tokenizer("t", tiny.tokenizer, 64, [0], defaults)
    decoded = ModelCard.decode(card.encode())
    assert SamplingDefaults.from_dict(decoded.sampling_defaults) == defaults
    fields = json.loads(card.encode()["m"])
    del fields["sampling_defaults"]  # a card from a worker before this field
    old = ModelCard.decode({"v": "1", "m": json.dumps(fields)})
    assert SamplingDefaults.from_dict(old.sampling_defaults) == SamplingDefaults()
    with pytest.raises(ValueError, match="unknown sampling default\\(s\\) min_p"):
        SamplingDefaults.from_dict({"min_p": 0.1})


def listed_defaults(base: str) -> dict[str, Any]:
    models = requests.get(f"{base}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["sampling_defaults"] for m in models}


def test_workers_publish_the_defaults_in_force_and_v1_models_lists_them(tmp_path):
    """Real workers: auto with an override (the model directory's file, temperature replaced),
    vllm on the same directory (none), a directory's file for tiny-random; each model's card
    says so and the gateway's /v1/models shows it."""
    model_dir = config_dir(write_random_llama(tmp_path / "cfg-model", **TINY_LLAMA), FILE)
    other = config_dir(tmp_path / "other", {"temperature": 0.1})
    server = RedisServer().start()
    workers = [
        start_worker(
            server,
            "g-auto",
            "--override-generation-config",
            '{"temperature": 0.3}',
            model=str(model_dir),
        ),
        start_worker(
            server,
            "g-vllm",
            "--generation-config",
            VLLM,
            "--served-model-name",
            "cfg-vllm",
            model=str(model_dir),
        ),
        start_worker(server, "g-dir", "--generation-config", str(other)),
    ]
    gateway = start_gateway(server)
    expected = {
        "cfg-model": {**FROM_FILE, "temperature": 0.3},
        "cfg-vllm": {},
        TINY_RANDOM: {"temperature": 0.1},
    }
    try:
        wait_ready(server.client(), *workers)
        card = ModelCard.decode(server.client().hgetall(Keys().model("cfg-model")))
        assert card.sampling_defaults == expected["cfg-model"]
        gateway.wait_ready()
        wait_for(lambda: listed_defaults(gateway.base) == expected, 20, "all three listed")
        log = workers[0].proc.output()
        assert "sampling_defaults source=auto temperature=0.3" in log
        assert "generation_config_key_ignored key=min_p value=0.05" in log
    finally:
        gateway.proc.stop()
        for worker in workers:
            worker.proc.stop()
        server.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--override-generation-config", '{"min_p": 0.05}'], "unknown or unsupported key"),
        (["--override-generation-config", "temperature=0.5"], "is not JSON"),
        (["--generation-config", "/nonexistent/dir"], "must be auto, vllm or a directory"),
        (["--generation-config", "BAD"], "must be auto, vllm or a directory"),
        (["--generation-config", "{bad}"], "temperature must be in [0, 2], got 9.0"),
    ],
)
def test_a_worker_with_a_bad_generation_config_exits_2_saying_why(tmp_path, flags, message):
    """Refused at start-up with the reason (a bad file's value once the model has loaded)."""
    bad = config_dir(tmp_path / "bad", {"temperature": 9})
    flags = [str(bad) if f == "{bad}" else f for f in flags]
    proc = JitneyProcess(
        ["worker", "--model", TINY_RANDOM, "--metrics-port", "0", *flags],
        {"REDIS_URL": "redis://127.0.0.1:1", "OMP_NUM_THREADS": "1"},
        name="bad-generation-config",
    )
    assert proc.proc.wait(120) == 2, proc.output()
    assert "cannot_start" in proc.output() and message in proc.output()


def test_up_passes_the_flags_on_to_its_workers():
    """`jitney up --override-generation-config ...` reaches the workers' command line."""
    from jitney.cli import build_parser
    from jitney.commands.worker import generation_config_argv

    args = build_parser(["up"]).parse_args(
        ["up", "--generation-config", VLLM, "--override-generation-config", '{"top_k": 4}']
    )
    assert generation_config_argv(args) == [
        "--generation-config",
        VLLM,
        "--override-generation-config",
        '{"top_k": 4}',
    ]
    assert generation_config_argv(build_parser(["up"]).parse_args(["up"])) == []
    worker_defaults = build_parser(["worker"]).parse_args(["worker"])
    assert worker_defaults.generation_config == generation_defaults.AUTO
