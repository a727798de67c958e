"""A LoRA adapter read from its files: a PEFT directory (`adapter_config.json` +
`adapter_model.safetensors`, or the older `adapter_model.bin`) or a llama.cpp GGUF adapter (what
its `convert_lora_to_gguf.py` writes), as one low-rank pair per (layer, projection).

Only the attention's and the MLP's projections are covered (q, k, v, o, gate, up, down, and
Phi-3's stored fused qkv_proj / gate_up_proj): anything else an adapter holds (embeddings, the
LM head, biases, `modules_to_save`, DoRA's magnitudes) is refused at load, by name, rather than
silently dropped. The scale is PEFT's: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA,
per module where `rank_pattern` / `alpha_pattern` say so; a GGUF adapter's is llama.cpp's
(`adapter.lora.alpha / r`, 1 without an alpha).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import AdapterLoadError
from protocol.lora_manifest import PROJECTIONS, peft_config_problem, peft_key, uncovered

_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# Architectures whose Q and K rows llama.cpp's converter permuted (B's rows, for an adapter).
_PERMUTED_ARCHS = ("llama", "smollm3")


@dataclass(frozen=True, slots=True)
class LowRankPair:
    """One projection's update, delta(x) = (x @ a.T) @ b.T, the scale folded into b."""

    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32, times the module's scale

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class AdapterFile:
    """An adapter as read: its pairs by (layer, PEFT module name)."""

    path: str
    pairs: dict[tuple[int, str], LowRankPair]

    @property
    def rank(self) -> int:
        return max(p.rank for p in self.pairs.values())

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.pairs.values())


def read_adapter(path: str | Path, num_heads: int, num_kv_heads: int) -> AdapterFile:
    """A PEFT directory or a GGUF adapter file; `num_heads` / `num_kv_heads` (the base model's)
    undo llama.cpp's Q/K row permutation in a GGUF adapter's B."""
    p = Path(path)
    if p.is_dir():
        pairs = _read_peft(p)
    elif p.is_file():
        pairs = _read_gguf(p, num_heads, num_kv_heads)
    else:
        raise AdapterLoadError(f"LoRA adapter {str(path)!r}: no such file or directory")
    if not pairs:
        raise AdapterLoadError(f"LoRA adapter {str(path)!r} holds no LoRA weights")
    return AdapterFile(str(path), pairs)


def _read_peft(directory: Path) -> dict[tuple[int, str], LowRankPair]:
    config = _peft_config(directory)
    tensors = _peft_tensors(directory)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        found = peft_key(key)
        if found is None:
            raise AdapterLoadError(f"LoRA adapter {str(directory)!r}: {uncovered(key)}")
        layer, module, half = found
        halves.setdefault((layer, module), {})[half] = value.float()
    pairs = {}
    for (layer, module), ab in halves.items():
        a, b = _both(ab, "A", "B", f"{directory}: layer {layer} {module}")
        name = f"model.layers.{layer}.{module}"
        pairs[(layer, module)] = LowRankPair(a, b * _peft_scale(config, name, a.shape[0]))
    return pairs


def _peft_config(directory: Path) -> dict[str, Any]:
    file = directory / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterLoadError(
            f"LoRA adapter {str(directory)!r}: cannot read {file.name}: {e}"
        ) from None
    problem = peft_config_problem(config)
    if problem is not None:
        raise AdapterLoadError(f"LoRA adapter {str(directory)!r}: {problem}")
    return config


def _peft_tensors(directory: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    try:
        if safetensors.is_file():
            from safetensors.torch import load_file

            return load_file(safetensors)
        if pickled.is_file():
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt file: the loader's message, never a traceback
        raise AdapterLoadError(
            f"LoRA adapter {str(directory)!r}: unreadable weights: {e}"
        ) from None
    raise AdapterLoadError(
        f"LoRA adapter {str(directory)!r} has no adapter_model.safetensors (or .bin)"
    )


def _peft_scale(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for `module`: its alpha over its rank (or the rank's square root)."""
    alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
    if config.get("use_rslora"):
        return alpha / math.sqrt(rank)
    return alpha / rank


def _pattern_value(patterns: Any, module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's name
    (as a regex, anchored at a name boundary), else `default`."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _read_gguf(file: Path, num_heads: int, num_kv_heads: int) -> dict[tuple[int, str], LowRankPair]:
    from engine.models.gguf_index import read_gguf_index
    from engine.models.gguf_weights import GGUFTensor, rotary_row_order

    try:
        index = read_gguf_index(file)
    except Exception as e:  # not a GGUF file, or a truncated one
        raise AdapterLoadError(
            f"LoRA adapter {str(file)!r} is not a readable GGUF file: {e}"
        ) from None
    meta = index.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterLoadError(
            f"{str(file)!r} is not a GGUF LoRA adapter (general.type "
            f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})"
        )
    alpha = meta.get("adapter.lora.alpha") or 0.0
    permuted = meta.get("general.architecture") in _PERMUTED_ARCHS
    by_gguf = {gguf: peft for peft, gguf in PROJECTIONS.items() if peft != "gate_up_proj"}
    from gguf import GGMLQuantizationType

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in index.tensors:
        match = _GGUF_KEY.match(t.name)
        if match is None or match.group(2) not in by_gguf:
            raise AdapterLoadError(
                f"LoRA adapter {str(file)!r}: {t.name!r} is not a tensor Jitney's adapters "
                f"cover (covered: {', '.join(sorted(by_gguf))})"
            )
        layer, module, half = int(match.group(1)), by_gguf[match.group(2)], match.group(3)
        shape = tuple(reversed(t.dims))
        kind = GGMLQuantizationType(t.qtype).name
        value = GGUFTensor(t.name, kind, shape, t.data, t.qtype).dequantize()
        if half == "b" and permuted and module in ("q_proj", "k_proj"):
            heads = num_heads if module == "q_proj" else num_kv_heads
            value = value[torch.from_numpy(rotary_row_order(value.shape[0], heads))]
        halves.setdefault((layer, module), {})[half.upper()] = value
    pairs = {}
    for (layer, module), ab in halves.items():
        a, b = _both(ab, "A", "B", f"{file}: layer {layer} {module}")
        scale = alpha / a.shape[0] if alpha else 1.0
        pairs[(layer, module)] = LowRankPair(a, b * scale)
    return pairs


def _both(
    halves: dict[str, torch.Tensor], a: str, b: str, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if a not in halves or b not in halves:
        raise AdapterLoadError(f"LoRA adapter {where}: lora_{a} or lora_{b} is missing")
    ta, tb = halves[a].contiguous(), halves[b].contiguous()
    if ta.dim() != 2 or tb.dim() != 2 or ta.shape[0] != tb.shape[1]:
        raise AdapterLoadError(
            f"LoRA adapter {where}: lora_{a} {tuple(ta.shape)} and lora_{b} {tuple(tb.shape)} "
            "are not a low-rank pair"
        )
    return ta, tb
