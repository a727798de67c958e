"""Perplexity of one model kept in several ways, on English prose that ships with Python.

`python -m research.perplexity [--model smollm2-135m] [--modes fp32,bf16,int8,gguf,gguf-1-digit]
 [--tokens 8192] [--window 512] [--chunk 16] [--kv-cache-dtype auto] [--lora ADAPTER]
 [--output perplexity.json]`

The text is the language reference's prose in `pydoc_data/topics.py` (every topic, in sorted
order), so anyone with the same Python gets the same tokens. It is cut into windows of
`--window` tokens; each window runs as one prompt through the engine's forward (the path a
served prompt takes, paged KV cache and all), in chunks of `--chunk` tokens each attending the
cached ones before it (0: the window in one chunk), and every token after a window's first is
scored. Small chunks run the quantized layers through their fused kernels, as decode steps do
(past the crossover measured for the instruction set, a quantized matrix takes the batched
path instead: AMX tiles, or panels dequantized for sgemm).
Modes (each the same weights, kept differently):
  fp32   dense float32 (the exact mode: `--quantization none`)
  bf16   dense bfloat16 (`--dtype bfloat16`)
  int8   Q8_0 blocks made from the fp32 weights (`--quantization int8`)
  gguf   the GGUF file's own blocks (`--quantization gguf`; a GGUF model only)
  gguf-1-digit  the same with one int8 digit per activation (`--activation-digits 1`)
For the bundled SmolLM2 the fp32 weights are the GGUF file's blocks dequantized, so gguf vs fp32
measures the kernels and int8 vs fp32 the 8-bit rounding. `--kv-cache-dtype` keeps every mode's
K/V as the engine's flag of that name does (auto: float16 for int8 and gguf, as the engine keeps
a quantized forward's; the mode's own dtype for fp32 and bf16). Each mode also reports how often
its most likely next token is fp32's (greedy decoding's agreement, position by position).
`--lora` runs every mode under a LoRA adapter (a PEFT directory or a GGUF adapter: each mode's
forward keeps it as the engine does, int8 through jitney::lora_add_ beside quantized
weights, the forward's dtype beside dense ones).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from engine.attention.step_inputs import AttentionMetadata
from engine.kernels import kernel_backend
from engine.kv_cache import KVCacheSpec, PagedKVCache, kv_storage_dtype
from engine.lora.adapter_set import AdapterSet
from engine.lora.step_rows import StepAdapters
from engine.models.model_loader import LoadedModel, load_model
from engine.runner.model_runner import model_forward_for

MODES = {  # mode -> (dtype, quantization, the kernels' int8 digits per activation)
    "fp32": (torch.float32, "none", 2),
    "bf16": (torch.bfloat16, "none", 2),
    "int8": (torch.float32, "int8", 2),
    "gguf": (torch.float32, "gguf", 2),
    "gguf-1-digit": (torch.float32, "gguf", 1),
}
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Score:
    mode: str
    perplexity: float
    scored_tokens: int
    nll_sum: float
    top_tokens: list[int]  # the most likely next token at each scored position


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_tokens(loaded: LoadedModel, num_tokens: int) -> list[int]:
    ids = loaded.tokenizer(reference_text(), add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


def score(
    loaded: LoadedModel,
    mode: str,
    tokens: list[int],
    window: int,
    chunk: int,
    kv_cache_dtype: str = "auto",
    lora: str | None = None,
) -> Score:
    """Sum of each scored token's negative log-likelihood, window by window."""
    _, quantization, digits = MODES[mode]
    backend = kernel_backend()
    backend.set_activation_digits(digits)
    try:
        return _score(loaded, mode, quantization, tokens, window, chunk, kv_cache_dtype, lora)
    finally:
        backend.set_activation_digits(2)


def _score(
    loaded: LoadedModel,
    mode: str,
    quantization: str,
    tokens: list[int],
    window: int,
    chunk: int,
    kv_cache_dtype: str,
    lora: str | None,
) -> Score:
    forward = model_forward_for(loaded, "auto", quantization)
    adapter = None
    if lora is not None:
        config = loaded.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        adapters = AdapterSet(forward.lora_targets(), [("lora", lora)], 1, 1 << 16, heads, kv_heads)
        adapter = adapters.resident("lora")
    dtype = loaded.dtype
    spec = KVCacheSpec(
        loaded.num_layers,
        loaded.num_kv_heads,
        loaded.head_dim,
        kv_storage_dtype(kv_cache_dtype, dtype, quantization != "none"),
        BLOCK_SIZE,
        compute_dtype=dtype,
    )
    nll, scored, top = 0.0, 0, []
    for start in range(0, len(tokens) - 1, window):
        ids = tokens[start : start + window]
        if len(ids) < 2:
            break
        cache = PagedKVCache(spec, -(-len(ids) // BLOCK_SIZE))
        blocks = list(range(cache.num_blocks))
        step = chunk or len(ids)
        parts = []
        for at in range(0, len(ids), step):
            new = ids[at : at + step]
            meta = AttentionMetadata.build(
                [(at, len(new), blocks)], cache, [False], input_ids=new, prompt_rows=[(0, len(new))]
            )
            assert meta.input_ids is not None
            if adapter is not None:
                meta.adapters = StepAdapters.build([(adapter, 0, len(new))], cache.device)
            with torch.inference_mode():
                parts.append(forward(meta.input_ids, None, meta, cache).float())
        logits = torch.cat(parts)
        target = torch.tensor(ids[1:])
        nll += F.cross_entropy(logits[:-1], target, reduction="sum").item()
        scored += len(ids) - 1
        top += logits[:-1].argmax(-1).tolist()
    return Score(mode, math.exp(nll / scored), scored, nll, top)


def run(
    model: str,
    modes: list[str],
    num_tokens: int,
    window: int,
    chunk: int,
    kv_cache_dtype: str = "auto",
    lora: str | None = None,
) -> list[Score]:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; known: {list(MODES)}")
    scores: list[Score] = []
    loaded_by_dtype: dict[torch.dtype, LoadedModel] = {}
    tokens: list[int] | None = None
    for mode in modes:
        dtype = MODES[mode][0]
        if dtype not in loaded_by_dtype:
            loaded_by_dtype[dtype] = load_model(model, dtype=dtype)
        loaded = loaded_by_dtype[dtype]
        tokens = tokens or text_tokens(loaded, num_tokens)
        scores.append(score(loaded, mode, tokens, window, chunk, kv_cache_dtype, lora))
    return scores


def markdown(scores: list[Score]) -> str:
    base = next((s for s in scores if s.mode == "fp32"), scores[0])
    lines = [
        f"| mode | perplexity | vs {base.mode} | same top token as {base.mode} | tokens scored |",
        "|---|---|---|---|---|",
    ]
    for s in scores:
        delta = 100 * (s.perplexity / base.perplexity - 1)
        same = sum(a == b for a, b in zip(s.top_tokens, base.top_tokens, strict=True))
        lines.append(
            f"| {s.mode} | {s.perplexity:.4f} | {delta:+.2f}% | "
            f"{100 * same / len(base.top_tokens):.2f}% | {s.scored_tokens} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default="fp32,bf16,int8,gguf")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=16, help="tokens per forward (0: a window)")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--lora", help="a LoRA adapter every mode runs under")
    parser.add_argument("--output", help="results JSON")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.window < 2 or args.chunk < 0:
        parser.error("--tokens and --window must be at least 2, --chunk at least 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        scores = run(
            args.model,
            args.modes.split(","),
            args.tokens,
            args.window,
            args.chunk,
            args.kv_cache_dtype,
            args.lora,
        )
    except ValueError as e:
        parser.error(str(e))
    print(markdown(scores))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "window": args.window, "chunk": args.chunk,
                       "kv_cache_dtype": args.kv_cache_dtype, "lora": args.lora,
                       "scores": [{k: v for k, v in asdict(s).items() if k != "top_tokens"}
                                  for s in scores]}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
