"""A GGUF model opened straight from its file, and the dense checkpoint made from one on demand.

`open_gguf` reads what the engine needs from the file's header alone: the transformers config
its metadata states (engine/models/gguf_config.py), the tokenizer, the chat template and the
tokens that end a generation. No weight is read and no model is built; Jitney's forward then
takes the file's blocks (engine/models/gguf_weights.py, engine/runner/model_runner.py).

The tokenizer is built once from the vocabulary in the metadata (transformers' GGUF tokenizer
builders) and cached as tokenizer.json under the model cache, keyed by a digest of the file's
header (the vocabulary is in it: a copy of the file anywhere shares the entry) and the
transformers version that built it, in a compact form; later starts parse it (0.7 s for Gemma 3's
262,144 tokens).

`converted_gguf` is the older way, kept for what needs a transformers model: the exact mode
(`--quantization none`, built on first use) and architectures no Jitney forward covers. It
dequantizes the file into a float32 safetensors directory once, read from there afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from engine.chat_template import ensure_chat_template
from engine.heap import return_freed_heap
from engine.models.gguf_config import CONFIG_ARRAYS, gguf_config
from engine.models.gguf_index import GGUFIndex, read_gguf_index

logger = logging.getLogger("jitney.engine.model")

Progress = Callable[[str], None]
TOKENIZER_CACHE = "gguf-tokenizers"
# A cached tokenizer: the backend as tokenizers saves it, and the tokenizer's settings (special
# tokens, add_bos_token, the chat template) as the GGUF states them.
_TOKENIZER, _SETTINGS = "tokenizer.json", "settings.json"
_CACHE_FORM = "compact"  # the entry's JSON form (compact_tokenizer_json): a new form, new entries
# The metadata's token ids that end a generation (llama.cpp's end of text, of turn, of message).
_END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
_END_IDS += ("tokenizer.ggml.eom_token_id",)
# Tokens that end a chat turn, which llama.cpp also stops at wherever the vocabulary has them
# (its converter rarely states them: Gemma's <end_of_turn>, Phi-3's <|end|>).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


@dataclass(frozen=True, slots=True)
class OpenedGGUF:
    """What a GGUF file says of itself, read from its header."""

    path: Path
    index: GGUFIndex
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerFast
    eos_token_ids: list[int]

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.dims) for t in self.index.tensors)


def open_gguf(
    path: Path, cache_root: Path, say: Progress, fallback_template: str | None
) -> OpenedGGUF:
    """The file's config, tokenizer (chat template set, or ChatML / `fallback_template` where
    the file has none: engine/chat_template.py) and end tokens (the metadata's, then the turn
    ends its vocabulary has). Raises UndescribedGGUFError for an architecture gguf_config does
    not state."""
    index = read_gguf_index(path, CONFIG_ARRAYS)
    config = gguf_config(index)
    tokenizer = gguf_tokenizer(path, index, cache_root, say)
    return_freed_heap()  # the tokenizer's parse: hundreds of MB of temporaries (engine/heap.py)
    ensure_chat_template(tokenizer, path, fallback_template)
    tokenizer.model_max_length = config.max_position_embeddings
    ends = [index.metadata.get(key) for key in _END_IDS] + [tokenizer.eos_token_id]
    # token_to_id: None where absent (get_vocab would build a dict of the whole vocabulary)
    ends += [tokenizer.backend_tokenizer.token_to_id(token) for token in TURN_ENDS]
    eos_ids: list[int] = []
    for token_id in ends:
        if isinstance(token_id, int) and token_id not in eos_ids:
            eos_ids.append(token_id)
    return OpenedGGUF(path, index, config, tokenizer, eos_ids)


def gguf_tokenizer(
    path: Path, index: GGUFIndex, cache_root: Path, say: Progress
) -> PreTrainedTokenizerFast:
    """The fast tokenizer the file's metadata describes, from the cache once built."""
    key = f"{index.header_digest[:24]}-{transformers.__version__}-{_CACHE_FORM}"
    cache = cache_root / TOKENIZER_CACHE / key
    if (cache / _SETTINGS).is_file():
        settings = json.loads((cache / _SETTINGS).read_text())
        return PreTrainedTokenizerFast(tokenizer_file=str(cache / _TOKENIZER), **settings)
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    start = time.monotonic()
    arch, vocabulary, settings = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, vocabulary)
    settings = {**settings, **extra}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **settings)

    def save(directory: Path) -> None:  # the settings last: they mark the entry complete
        compact = compact_tokenizer_json(tokenizer.backend_tokenizer.to_str())
        (directory / _TOKENIZER).write_text(compact, encoding="utf-8")
        (directory / _SETTINGS).write_text(json.dumps(settings))

    _write_atomically(cache, save)
    say(f"tokenizer built from {path.name}'s metadata in {time.monotonic() - start:.1f} s")
    return tokenizer


def compact_tokenizer_json(text: str) -> str:
    """A tokenizer's JSON on one line, each BPE merge "a b" where no token of any merge holds
    a space (else the pairs stay lists, the only form that can say so): Gemma 3's 514,906
    merges parse in 0.7 s this way, against 1.1 s as tokenizers saves them."""
    data = json.loads(text)
    merges = data.get("model", {}).get("merges")
    if merges and all(isinstance(m, list) and " " not in m[0] + m[1] for m in merges):
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def dense_from_gguf(
    path: Path,
    converted_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    say: Progress,
    fallback_template: str | None,
) -> torch.nn.Module:
    """The transformers model of the file (dequantized), from its converted checkpoint."""
    from transformers import AutoModelForCausalLM  # models' index: 0.4 s, only where built

    model_dir = converted_gguf(path, converted_dir, say, fallback_template)
    say(f"loading dense weights from {model_dir}")
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, device_map=device, local_files_only=True
    ).eval()


def converted_gguf(
    gguf_path: Path, model_dir: Path, say: Progress, chat_template: str | None
) -> Path:
    """Return a safetensors copy of `gguf_path` in `model_dir`, converting it the first time."""
    if (model_dir / "config.json").is_file():
        say(f"using converted cache {model_dir}")
        return model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

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
    ensure_chat_template(tokenizer, gguf_path, fallback=chat_template)
    tokenizer.init_kwargs.pop("local_files_only", None)  # a load option, not a tokenizer setting
    tokenizer.model_max_length = model.config.max_position_embeddings

    def save(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    _write_atomically(model_dir, save)
    say(f"converted {gguf_path.name} in {time.monotonic() - start:.1f} s")
    return model_dir


def gguf_cache_key(path: Path) -> str:
    # Name + size + mtime: a replaced file gets a fresh conversion without hashing gigabytes.
    stat = path.stat()
    digest = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{path.stem}-{digest[:12]}"


def _write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """`write(dir)` into a temp dir beside `target`, renamed into place: a crash leaves only a
    hidden temp dir, never a half cache; another process that got there first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp_dir)
        # mkdtemp makes it private (0700) and safetensors writes 0600; a cache may be shared.
        tmp_dir.chmod(0o755)
        for file in tmp_dir.iterdir():
            file.chmod(0o644)
        tmp_dir.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        # Another worker finished the same entry first; its copy is as good as ours.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
