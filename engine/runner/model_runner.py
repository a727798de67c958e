"""Turns a StepPlan into one forward pass: packed input ids, attention metadata, logits.

The runner calls the model only through `ModelForward` (engine/models/forward.py), chosen in
`model_forward_for` (`--model-impl`): Jitney's own Llama-family forward or transformers' model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.attention.step_inputs import AttentionMetadata
from engine.device_copy import device_tensor
from engine.kv_cache import PagedKVCache
from engine.layers.quantized import COVERED_KINDS
from engine.lora.adapter_set import AdapterSet
from engine.lora.step_rows import StepAdapters
from engine.models.forward import ModelForward, TransformersForward
from engine.models.gguf_weights import gguf_tensors, read_gguf_tensors
from engine.models.llama import LlamaForward, UnsupportedArchitectureError, unsupported_because
from engine.models.loaded_model import LoadedModel
from engine.models.rotary import longrope_uses_long_factors
from engine.models.weight_sources import (
    GGUFWeights,
    Int8Weights,
    StateDictWeights,
    WeightSource,
)
from engine.runner.decode_graphs import DecodeGraphs, GraphCapture, width_bucket
from engine.runner.input_batch import InputBatch
from scheduler import Sequence, StepPlan

logger = logging.getLogger("jitney.engine.runner")


def model_forward_for(
    loaded: LoadedModel, impl: str = "auto", quantization: str = "auto", compiled: bool = False
) -> ModelForward:
    """resolve_forward's forward."""
    return resolve_forward(loaded, impl, quantization, compiled)[1]


# The forwards whose weights are quantized blocks (CPU, float32): already not the exact mode, so
# `--kv-cache-dtype auto` stores their K/V in float16 (engine/kv_cache.py kv_storage_dtype).
QUANTIZED_FORWARDS = ("jitney-gguf", "jitney-int8")


def resolve_forward(
    loaded: LoadedModel,
    impl: str = "auto",
    quantization: str = "auto",
    compiled: bool = False,
    max_model_len: int | None = None,
) -> tuple[str, ModelForward]:
    """The forward every step (and the start-up memory profile's dummy step) runs (`impl`,
    `--model-impl`): "jitney", Jitney's own for the Llama family (engine/models/llama.py);
    "transformers", the stock transformers decoder on Jitney's paged attention; "auto", Jitney's
    where the architecture is covered. `quantization` "gguf": Jitney's forward on the GGUF
    file's own blocks (CPU, float32); "int8": on Q8_0 blocks made from the dense weights at
    load (any covered model, CPU, float32); "auto": resolve_quantization's choice. `compiled`
    (`--compile`): Jitney's dense forward with its layers' halves compiled by torch.compile.
    `max_model_len` (`--max-model-len`; None: the model's) picks a LongRoPE model's factors
    (engine/models/rotary.py). Returns the forward and its name ("jitney-gguf", "jitney-none",
    "transformers", ...). Built once per loaded model (and LongRoPE choice) and kept on it, so
    engines sharing a loaded model share its forward (and Jitney's dense one shares the
    transformers model's weights). The choice reads the model's description (`loaded.config`,
    device, dtype); only the dense forwards build (or use) its transformers model."""
    why_not = jitney_unsupported_because(loaded)
    if quantization == "auto":
        quantization = resolve_quantization(loaded, impl, why_not)
    if (impl == "jitney" or quantization != "none") and why_not is not None:
        raise UnsupportedArchitectureError(f"Jitney's forward: {why_not}")
    use_jitney = impl == "jitney" or quantization != "none" or (impl == "auto" and why_not is None)
    if compiled and (not use_jitney or quantization != "none"):
        raise ValueError(
            "--compile compiles Jitney's dense forward (--quantization none); this model runs "
            + (f"quantization {quantization}" if use_jitney else "transformers' forward")
        )
    name = f"jitney-{quantization}" if use_jitney else "transformers"
    name += "-compiled" if compiled else ""
    key = name
    long = longrope_uses_long_factors(loaded.config, max_model_len) if use_jitney else None
    if long is not None:
        key += "-longrope-long" if long else "-longrope-short"
    forwards: dict[str, ModelForward] = loaded.dense.forwards
    if key not in forwards:
        # Only the dense forwards need the transformers model (built here on first use).
        if not use_jitney:
            forwards[key] = TransformersForward(loaded.model)
        elif quantization == "gguf":
            forwards[key] = _gguf_forward(loaded, max_model_len)
        elif quantization == "int8":
            forwards[key] = _int8_forward(loaded, max_model_len)
        else:
            forwards[key] = LlamaForward.from_transformers(loaded.model, compiled, max_model_len)
    return name, forwards[key]


def jitney_unsupported_because(loaded: LoadedModel) -> str | None:
    """Why Jitney's forward cannot run `loaded` (None: it can), from its description."""
    built = loaded.built_model
    if built is not None:
        from transformers import PreTrainedModel  # seconds to import: only once a model is built

        if not isinstance(built, PreTrainedModel):
            return "not a transformers model (noop)"
    return unsupported_because(loaded.config)


def resolve_quantization(loaded: LoadedModel, impl: str, why_not: str | None) -> str:
    """`--quantization auto`: "gguf" for a GGUF model on Jitney's forward, on the CPU in float32
    (measured: 5x a dense float32 step at one sequence, 3x at 64; docs/performance.md), its
    matrices of types no kernel covers dequantized one by one; "none" (dense, exact)
    otherwise."""
    if loaded.gguf_path is None or impl == "transformers" or why_not is not None:
        return "none"
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        return "none"
    return "gguf"


def _gguf_forward(loaded: LoadedModel, max_model_len: int | None) -> LlamaForward:
    """Jitney's forward on the blocks of `loaded`'s GGUF file."""
    if loaded.gguf_path is None:
        raise ValueError(f"quantization gguf needs a GGUF model; {loaded.name} is not one")
    _require_cpu_float32(loaded, "gguf")
    if loaded.gguf_index is not None:  # the header read when the model was opened
        tensors = gguf_tensors(loaded.gguf_index)
    else:
        _, tensors = read_gguf_tensors(loaded.gguf_path)
    weights = GGUFWeights(tensors, torch.float32, quantized=True)
    forward = LlamaForward(loaded.config, weights, fused_ops=True, max_model_len=max_model_len)
    log_dense_fallbacks(weights.dense_fallbacks)
    return forward


def log_dense_fallbacks(fallbacks: Mapping[str, str]) -> None:
    """One line naming the matrices no kernel covers (they run dequantized, float32)."""
    if not fallbacks:
        return
    by_kind: dict[str, list[str]] = {}
    for name, kind in fallbacks.items():
        by_kind.setdefault(kind, []).append(name.removeprefix("model.").removesuffix(".weight"))
    logger.warning(
        "quantization gguf: %d matrices in block types no kernel covers run dequantized "
        "(float32; covered: %s): %s",
        len(fallbacks),
        ", ".join(COVERED_KINDS),
        "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(by_kind.items())),
    )


def _int8_forward(loaded: LoadedModel, max_model_len: int | None) -> LlamaForward:
    """Jitney's forward on int8 blocks made from the model's dense weights: a GGUF's tensors
    dequantized one at a time where no transformers model was built, else the model's."""
    _require_cpu_float32(loaded, "int8")
    dense: WeightSource
    if loaded.gguf_path is not None and loaded.built_model is None:
        _, tensors = read_gguf_tensors(loaded.gguf_path)
        dense = GGUFWeights(tensors, torch.float32, quantized=False)
    else:
        dense = StateDictWeights(dict(loaded.model.named_parameters()))
    weights = Int8Weights(dense)
    return LlamaForward(loaded.config, weights, fused_ops=True, max_model_len=max_model_len)


def _require_cpu_float32(loaded: LoadedModel, quantization: str) -> None:
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        raise ValueError(
            f"quantization {quantization} runs on the CPU in float32 (the kernels' "
            f"activations), not {loaded.device.type} {loaded.dtype}"
        )


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """One step's inputs as `ModelRunner.prepare` built them, for `ModelRunner.forward`."""

    metadata: AttentionMetadata  # the packed input ids and the attention's layout, on the device
    # Each sequence's context length when the step is one the decode graphs take (decodes only,
    # a shape they fit); None: the step runs eagerly.
    graph_ctx: list[int] | None = None
    # Rows of the packed tokens whose final-norm hidden states `forward` returns (pooling);
    # None: none.
    hidden_rows: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, forward: ModelForward, kv_cache: PagedKVCache):
        self.model_forward = forward
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        # Block tables and the upload buffer persist across steps (engine/runner/input_batch.py).
        self.batch = InputBatch(self.device)
        # Decode-only steps at padded shapes (CUDA graphs); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        # The LoRA adapters the engine serves (engine/lora/); None: none.
        self.adapters: AdapterSet | None = None

    def enable_decode_graphs(
        self, max_batch: int, max_model_len: int, capture: GraphCapture | None
    ) -> None:
        """Run decode-only steps through DecodeGraphs, captured by `capture` (None: padded but
        eager): with the decode kernel all at once, now; else each on first use. The KV pool's
        last block is their scratch block, so it must lie outside the block manager's pool."""
        blocks = -(-max_model_len // self.kv_cache.block_size)
        self.graphs = DecodeGraphs(
            lambda ids, meta: self.model_forward(ids, None, meta, self.kv_cache),
            self.kv_cache,
            max_batch,
            width_bucket(blocks),
            capture,
        )
        self.graphs.capture_all()

    # The engine calls prepare then forward, timing each as a phase (engine/step_timing.py).
    def prepare(
        self,
        plan: StepPlan,
        seqs: Mapping[str, Sequence],
        block_ids: Callable[[str], list[int]],
        prompt_rows: Mapping[str, int] | None = None,
        hidden_rows: Mapping[str, tuple[int, int]] | None = None,
    ) -> PreparedStep:
        """The packed inputs of every chunk of `plan`, on the device, for `forward`.
        `block_ids(seq_id)` is the sequence's live block list: the same object for as long as
        its allocation lives (see InputBatch.row). `prompt_rows[seq_id] = k`: that sequence's
        chunk also yields logits for its first k tokens (after the sampling rows); a
        verification's (a chunk with drafts) are its drafts' count. `hidden_rows[seq_id] =
        (first, count)`: that prefill chunk's rows first .. first + count - 1 also yield their
        final-norm hidden states (pooling), in chunk order."""
        input_ids: list[int] = []
        hidden: list[int] = []  # rows of T whose hidden states `forward` returns
        layout: list[tuple[int, int, list[int]]] = []
        keys: list[str] = []
        sample: list[bool] = []
        wanted: list[tuple[int, int]] = []  # (layout entry, leading tokens) whose logits follow
        spans: list[tuple[str, int, int]] = []  # rows under an adapter: (name, first, count)
        for chunk in plan.chunks:
            seq, blocks = seqs[chunk.seq_id], block_ids(chunk.seq_id)
            if seq.adapter is not None:
                spans.append((seq.adapter, len(input_ids), chunk.num_tokens))
            if chunk.is_prefill:
                if hidden_rows and (span := hidden_rows.get(chunk.seq_id)) is not None:
                    hidden += range(len(input_ids) + span[0], len(input_ids) + sum(span))
                input_ids += seq.token_ids(chunk.start, chunk.start + chunk.num_tokens)
                if prompt_rows and chunk.seq_id in prompt_rows:
                    wanted.append((len(layout), prompt_rows[chunk.seq_id]))
                layout.append((chunk.start, chunk.num_tokens, blocks))
                keys.append(chunk.seq_id)
                sample.append(chunk.samples)
                continue
            # A decode feeds back the token sampled last; a verification its drafts after it,
            # each as a decode row of its own (position start + j sees keys [0, start + j]):
            # causal within the chunk, and served by the decode kernels.
            input_ids.append(seq.output_token_ids[-1])
            for j in range(chunk.num_draft_tokens):
                wanted.append((len(layout), 1))
                layout.append((chunk.start + j, 1, blocks))
                keys.append(chunk.seq_id)
                sample.append(False)
                input_ids.append(seq.speculation.draft_token_ids[j])
            layout.append((chunk.start + chunk.num_draft_tokens, 1, blocks))
            keys.append(chunk.seq_id)
            sample.append(True)
        hidden_ids = device_tensor(hidden, self.device, torch.int64) if hidden else None
        graph_ctx = None
        if (
            self.graphs is not None
            and not spans
            and not any(c.is_prefill or c.num_draft_tokens for c in plan.chunks)
        ):
            ctx_lens = [c.start + 1 for c in plan.chunks]
            if self.graphs.fits(len(ctx_lens), max(ctx_lens)):
                graph_ctx = ctx_lens
        metadata = AttentionMetadata.build(
            layout,
            self.kv_cache,
            sample=sample,
            batch=self.batch,
            keys=keys,
            input_ids=input_ids,
            prompt_rows=wanted,
        )
        if spans:
            metadata.adapters = self._step_adapters(spans, seqs)
        return PreparedStep(metadata, graph_ctx, hidden_ids)

    def _step_adapters(
        self, spans: list[tuple[str, int, int]], seqs: Mapping[str, Sequence]
    ) -> StepAdapters | None:
        """The step's adapter rows, each adapter made resident (read again if it was evicted;
        no adapter a live sequence runs under is evicted for it)."""
        if self.adapters is None:
            raise ValueError("a sequence names a LoRA adapter, but this engine serves none")
        in_use = {seq.adapter for seq in seqs.values() if seq.adapter is not None}
        resident = [
            (self.adapters.resident(name, in_use), first, count) for name, first, count in spans
        ]
        return StepAdapters.build(resident, self.device)

    def forward(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over the prepared chunks: float32 logits [S, vocab], one row per chunk that
        samples, in chunk order (then the prompt rows `prepare` was asked for), and the hidden
        rows `prepare` was asked for (None: none). On CUDA it returns before the kernels
        finish."""
        metadata, ctx_lens, hidden_rows = step.metadata, step.graph_ctx, step.hidden_rows
        if hidden_rows is not None:  # a step with prefill chunks: never a graph's
            assert metadata.input_ids is not None
            logits, hidden = self.model_forward.with_hidden(
                metadata.input_ids, None, metadata, self.kv_cache, hidden_rows
            )
            return logits.float(), hidden
        if ctx_lens is not None and self.graphs is not None:
            assert metadata.input_ids is not None and metadata.table_rows is not None
            tables = self.batch.block_table[metadata.table_rows]
            logits = self.graphs.run(
                metadata.input_ids, metadata.positions, metadata.slot_mapping, tables, ctx_lens
            )
        else:
            assert metadata.input_ids is not None
            logits = self.model_forward(metadata.input_ids, None, metadata, self.kv_cache)
        return logits.float(), None
