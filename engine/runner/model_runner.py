"""Turns a StepPlan into one forward pass: packed input ids, attention metadata, logits.

The runner calls the model only through `ModelForward` (engine/models/forward.py), chosen in
`model_forward_for` (`--model-impl`): Jitney's own Llama-family forward or transformers' model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from transformers import PreTrainedModel

from engine.attention.step_inputs import AttentionMetadata
from engine.device_copy import device_tensor
from engine.kv_cache import PagedKVCache
from engine.layers.quantized import COVERED_KINDS, uncovered_kinds
from engine.models.forward import ModelForward, TransformersForward
from engine.models.gguf_weights import GGUFTensor, read_gguf_tensors
from engine.models.llama import LlamaForward, UnsupportedArchitectureError, unsupported_because
from engine.models.model_loader import LoadedModel
from engine.models.weight_sources import GGUFWeights, Int8Weights, StateDictWeights
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
    loaded: LoadedModel, impl: str = "auto", quantization: str = "auto", compiled: bool = False
) -> tuple[str, ModelForward]:
    """The forward every step (and the start-up memory profile's dummy step) runs (`impl`,
    `--model-impl`): "jitney", Jitney's own for the Llama family (engine/models/llama.py);
    "transformers", the stock transformers decoder on Jitney's paged attention; "auto", Jitney's
    where the architecture is covered. `quantization` "gguf": Jitney's forward on the GGUF
    file's own blocks (CPU, float32); "int8": on Q8_0 blocks made from the dense weights at
    load (any covered model, CPU, float32); "auto": resolve_quantization's choice. `compiled`
    (`--compile`): Jitney's dense forward with its layers' halves compiled by torch.compile.
    Returns the forward and its name ("jitney-gguf", "jitney-none", "transformers", ...). Built
    once per loaded model and kept on it, so engines sharing a loaded model share its forward
    (and Jitney's dense one shares the transformers model's weights)."""
    model = loaded.model
    why_not = (
        unsupported_because(model.config)
        if isinstance(model, PreTrainedModel)
        else "not a transformers model (noop)"
    )
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
    forwards: dict[str, ModelForward] = model.__dict__.setdefault("_jitney_forwards", {})
    if name not in forwards:
        if not use_jitney:
            forwards[name] = TransformersForward(model)
        elif quantization == "gguf":
            forwards[name] = _gguf_forward(loaded)
        elif quantization == "int8":
            forwards[name] = _int8_forward(loaded)
        else:
            forwards[name] = LlamaForward.from_transformers(model, compiled)
    return name, forwards[name]


def resolve_quantization(loaded: LoadedModel, impl: str, why_not: str | None) -> str:
    """`--quantization auto`: "gguf" for a GGUF model whose projections are all in block types
    the kernels cover, on Jitney's forward, on the CPU in float32 (measured: 5x a dense float32
    step at one sequence, 3x at 64; docs/performance.md); "none" (dense, exact) otherwise."""
    model = loaded.model
    if loaded.gguf_path is None or impl == "transformers" or why_not is not None:
        return "none"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "none"
    _, tensors = read_gguf_tensors(loaded.gguf_path)
    missing = uncovered_kinds(tensors)
    if missing:
        logger.info("quantization auto: none (no kernel for the file's %s blocks)", missing)
        return "none"
    return "gguf"


def _gguf_forward(loaded: LoadedModel) -> LlamaForward:
    """Jitney's forward on the blocks of the GGUF file `loaded` was converted from."""
    model = loaded.model
    if loaded.gguf_path is None:
        raise ValueError(f"quantization gguf needs a GGUF model; {loaded.name} is not one")
    _require_cpu_float32(model, "gguf")
    _, tensors = read_gguf_tensors(loaded.gguf_path)
    return LlamaForward(model.config, gguf_block_weights(tensors), fused_ops=True)


def gguf_block_weights(tensors: Mapping[str, GGUFTensor]) -> GGUFWeights:
    """The file's tensors kept in their blocks; refused, saying which, where a layer matrix is in
    a block type no kernel covers (`--quantization none` dequantizes those)."""
    missing = uncovered_kinds(tensors)
    if missing:
        raise ValueError(
            f"quantization gguf: the file's {', '.join(missing)} blocks have no kernel "
            f"(covered: {', '.join(COVERED_KINDS)}); use --quantization none to dequantize them"
        )
    return GGUFWeights(tensors, torch.float32, quantized=True)


def _int8_forward(loaded: LoadedModel) -> LlamaForward:
    """Jitney's forward on int8 blocks made from the loaded model's own dense weights."""
    model = loaded.model
    _require_cpu_float32(model, "int8")
    dense = StateDictWeights(dict(model.named_parameters()))
    return LlamaForward(model.config, Int8Weights(dense), fused_ops=True)


def _require_cpu_float32(model: PreTrainedModel, quantization: str) -> None:
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError(
            f"quantization {quantization} runs on the CPU in float32 (the kernels' "
            f"activations), not {model.device.type} {model.dtype}"
        )


class ModelRunner:
    def __init__(self, forward: ModelForward, kv_cache: PagedKVCache):
        self.model_forward = forward
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        # Block tables and the upload buffer persist across steps (engine/runner/input_batch.py).
        self.batch = InputBatch(self.device)
        # Decode-only steps at padded shapes (CUDA graphs); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        self._graph_ctx: list[int] | None = None  # set by prepare for a step graphs take
        self._hidden_rows: torch.Tensor | None = None  # set by prepare for a pooling step

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
    ) -> AttentionMetadata:
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
        for chunk in plan.chunks:
            seq, blocks = seqs[chunk.seq_id], block_ids(chunk.seq_id)
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
        self._graph_ctx = None
        self._hidden_rows = device_tensor(hidden, self.device, torch.int64) if hidden else None
        if self.graphs is not None and not any(
            c.is_prefill or c.num_draft_tokens for c in plan.chunks
        ):
            ctx_lens = [c.start + 1 for c in plan.chunks]
            if self.graphs.fits(len(ctx_lens), max(ctx_lens)):
                self._graph_ctx = ctx_lens
        return AttentionMetadata.build(
            layout,
            self.kv_cache,
            sample=sample,
            batch=self.batch,
            keys=keys,
            input_ids=input_ids,
            prompt_rows=wanted,
        )

    def forward(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over the prepared chunks: float32 logits [S, vocab], one row per chunk that
        samples, in chunk order (then the prompt rows `prepare` was asked for), and the hidden
        rows `prepare` was asked for (None: none). On CUDA it returns before the kernels
        finish."""
        ctx_lens, self._graph_ctx = self._graph_ctx, None
        hidden_rows, self._hidden_rows = self._hidden_rows, None
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
