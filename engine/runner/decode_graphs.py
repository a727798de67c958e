"""Decode-only steps at fixed shapes, replayed as CUDA graphs: the CPU launches one graph instead
of a few hundred kernels per layer (vLLM's idea; on a GPU a small model's decode step is mostly
launch overhead).

A graph needs the same tensors and shapes on every replay, so a decode-only step is padded:
- the batch to the next bucket (1, 2, 4, 8, then multiples of 8 up to `max_batch`);
- every block table to `width` blocks, the next power of two covering the longest context, read
  as one decode group with a mask from each row's context length (rows attend `[0, ctx)`);
- padding rows decode token 0 at position 0 with context 1, reading and writing one scratch block
  that belongs to no sequence (the engine allocates the KV pool one block larger), so they never
  touch a real sequence's K/V.
Inputs are copied into static buffers, then the graph of that (batch, width) replays, writing its
logits into one output buffer all graphs share: an output of its own would stay allocated with
each graph (256 KB per row of a 128k vocabulary in bf16, times every bucket and width: GBs). A
graph is captured after two warm-up runs on a side stream (the standard recipe). Mixed steps
(any prefill chunk), batches above the largest bucket and, on the gather path, steps whose padded
read would pass `max_read_bytes` run eagerly as before.

The Triton decode kernel reads each row's own context in place, so a wider table costs it
nothing: with it, every graph takes the full width, one graph per batch bucket, and all of them
are captured at start (`capture_all`, largest first, as vLLM does). Capturing mid-run would stall
the steps that meet a new bucket (each capture synchronizes the device, empties the allocator's
caches and runs the step three times) and, in a benchmark, count that against the engine. On the
gather path the width sets the read, so graphs stay per (batch, width) bucket and are captured
on first use.

A graph reads and writes memory by address, so everything it touches that was allocated before
its capture must outlive it. The KV cache's read workspace grows with the largest read, and a
graph captured before a growth would write into freed memory (the CPU emulation below caught it).
So with graphs on, the workspace is reserved once at the largest padded read they allow
(`max_read_bytes`, also taken out of the KV budget), and larger eager reads get a buffer of their
own.

Off the GPU the same padded path runs without capture, or under a CPU emulation of capture and
replay (tests/engine/graph_emulator.py): tests check both against the eager path token for token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.attention.step_inputs import AttentionMetadata, DecodeGroup
from engine.kv_cache import KVCacheSpec, PagedKVCache

logger = logging.getLogger("jitney.engine.graphs")

# A padded step reads padded x width blocks per layer into the workspace graphs keep: past this,
# eager (and this is the most memory the workspace holds).
MAX_READ_BYTES = 1 << 30

Forward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]
# Records a step once: (replay, the step's output tensor, which every replay rewrites).
GraphCapture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (multiples of 8), up to and including `max_batch`."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return [*buckets, max_batch]


def width_bucket(blocks: int) -> int:
    """The next power of two >= blocks (at least 4): few graphs, at most 2x the keys read."""
    return max(4, 1 << (blocks - 1).bit_length())


@dataclass
class CudaGraphCapture:
    """GraphCapture on CUDA: warm-up on a side stream, then capture; graphs share one memory
    pool (they never run at once)."""

    pool: object | None = None

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm-up first: lazy initialisations (cuBLAS handles, autotuning) must not happen
        # inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        self.pool = graph.pool()
        return graph.replay, output


@dataclass(slots=True)
class _Graph:
    replay: Callable[[], None]
    logits: torch.Tensor  # the captured output, rewritten by each replay


@dataclass
class DecodeGraphs:
    """Static buffers and the graphs captured so far, for one model on one KV cache."""

    forward: Forward  # (input ids [Bp], metadata) -> logits [Bp, vocab], as the runner's
    kv_cache: PagedKVCache
    max_batch: int
    max_width: int  # blocks per table: the static tables' width (the longest context's)
    capture: GraphCapture | None  # CudaGraphCapture; None: the same padded path, eagerly
    buckets: list[int] = field(init=False)
    graphs: dict[tuple[int, int], _Graph] = field(init=False, default_factory=dict)
    num_steps: int = 0  # decode steps run on this path (replayed, or padded eagerly)
    failed: str | None = None  # why capture was given up (then every step runs eagerly)
    max_read_bytes: int = MAX_READ_BYTES

    def __post_init__(self) -> None:
        self.buckets = batch_buckets(self.max_batch)
        device = self.kv_cache.device
        n, w = self.max_batch, self.max_width
        self.scratch_block = self.kv_cache.num_blocks - 1  # outside the block manager's pool
        scratch_slot = self.scratch_block * self.kv_cache.block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.ctx = torch.ones(n, dtype=torch.long, device=device)
        self.tables = torch.full((n, w), self.scratch_block, dtype=torch.long, device=device)
        self.logits_rows = torch.arange(n, device=device)
        self._scratch_slot = scratch_slot
        # Every graph writes its logits into this one buffer (a view of its first rows): a
        # graph's own output would stay allocated for as long as the graph, one per shape.
        self._logits: torch.Tensor | None = None
        if self.capture is not None and not self.kv_cache.decode_kernel:
            # Graphs hold the workspace's address: it must never move.
            self.kv_cache.reserve_workspace(self.workspace_bytes())

    def fits(self, batch: int, max_ctx: int) -> bool:
        """Whether a decode step of `batch` rows, the longest at context `max_ctx`, goes here."""
        if self.failed is not None or batch > self.max_batch:
            return False
        width = self._width(max_ctx)
        padded = next(b for b in self.buckets if b >= batch)
        return width <= self.max_width and padded * width <= self._max_read_blocks()

    def _width(self, max_ctx: int) -> int:
        """The table width of a step whose longest context is `max_ctx`: the full width for the
        kernel (one graph per batch), else the next power of two (the read is the width's)."""
        if self.kv_cache.decode_kernel:
            return self.max_width
        return width_bucket(-(-max_ctx // self.kv_cache.block_size))

    def capture_all(self) -> int:
        """Capture every batch bucket's graph now, largest first (kernel only: one width);
        returns how many were captured. A failed capture turns graphs off, as on first use."""
        if self.capture is None or not self.kv_cache.decode_kernel:
            return 0
        for padded in reversed(self.buckets):
            if self.failed is not None:
                break
            self._pad(0, padded, self.max_width)
            self._replay(padded, self.max_width)
        logger.info("captured %d decode graphs (batch 1..%d)", len(self.graphs), self.max_batch)
        return len(self.graphs)

    def workspace_bytes(self) -> int:
        """The largest read a padded step makes (K and V of one layer): the workspace to keep."""
        return decode_read_bytes(
            self.kv_cache.spec, self.max_batch, self.max_width, self.max_read_bytes
        )

    def _max_read_blocks(self) -> int:
        if self.kv_cache.decode_kernel:  # no copy: the table's width bounds nothing
            return self.max_batch * self.max_width
        return self.max_read_bytes // self.kv_cache.spec.read_bytes_per_block

    def run(
        self,
        input_ids: torch.Tensor,  # [B] the step's tokens
        positions: torch.Tensor,  # [B]
        slots: torch.Tensor,  # [B]
        tables: torch.Tensor,  # [B, cols] block-table rows (entries past a context: any id)
        ctx_lens: Sequence[int],  # host copy of each row's context length (positions + 1)
    ) -> torch.Tensor:
        """Logits [B, vocab] of one decode-only step (B <= max_batch)."""
        batch = len(ctx_lens)
        padded = next(b for b in self.buckets if b >= batch)
        width = self._width(max(ctx_lens))
        self.input_ids[:batch] = input_ids
        self.positions[:batch] = positions
        self.slots[:batch] = slots
        self.ctx[:batch] = positions + 1
        cols = min(width, tables.shape[1])
        self.tables[:batch, :cols] = tables[:, :cols]
        if cols < width and not self.kv_cache.decode_kernel:
            # Past every context: masked, but the gather path reads them (the kernel does not).
            self.tables[:batch, cols:width] = self.scratch_block
        if padded > batch:  # rows a larger step left behind must not write real slots
            self._pad(batch, padded, width)
        logits = self._replay(padded, width)
        self.num_steps += 1
        return logits[:batch]

    def _pad(self, start: int, end: int, width: int) -> None:
        """Rows [start, end) as padding: token 0 at position 0, context 1, the scratch block."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self._scratch_slot
        self.ctx[start:end] = 1
        self.tables[start:end, :width] = self.scratch_block

    def _metadata(self, padded: int, width: int) -> AttentionMetadata:
        cache = self.kv_cache
        group = DecodeGroup(
            rows=slice(0, padded),
            blocks=self.tables[:padded, :width].reshape(-1),
            members=slice(0, padded),
            num_blocks=width,
            min_len=0,  # always masked by each row's context, never assumed full
        )
        return AttentionMetadata(
            slot_mapping=self.slots[:padded],
            positions=self.positions[:padded],
            logits_indices=self.logits_rows[:padded],
            input_ids=self.input_ids[:padded],
            block_size=cache.block_size,
            mask_dtype=cache.spec.attention_dtype,
            decodes=[group],
            decode_ctx=self.ctx[:padded],
            prefills=[],
        )

    def _step(self, padded: int, width: int) -> torch.Tensor:
        return self.forward(self.input_ids[:padded], self._metadata(padded, width))

    def _step_into_logits(self, padded: int, width: int) -> torch.Tensor:
        assert self._logits is not None
        return self._logits[:padded].copy_(self._step(padded, width))

    def _replay(self, padded: int, width: int) -> torch.Tensor:
        if self.capture is None:
            return self._step(padded, width)
        entry = self.graphs.get((padded, width))
        if entry is None:
            if self._logits is None:  # allocated outside every capture, so no graph owns it
                first = self._step(padded, width)
                self._logits = first.new_empty((self.max_batch, first.shape[1]))
            try:
                replay, logits = self.capture(lambda: self._step_into_logits(padded, width))
            except RuntimeError as e:  # give up on graphs, keep serving eagerly
                self.failed = f"capture of batch {padded} width {width} failed: {e}"
                logger.warning("cuda graphs off: %s", self.failed)
                return self._step(padded, width)
            entry = self.graphs[(padded, width)] = _Graph(replay, logits)
            logger.debug("captured decode graph batch=%d width=%d", padded, width)
        entry.replay()
        return entry.logits


def graph_reserved_bytes(
    spec: KVCacheSpec,
    max_batch: int,
    max_model_len: int,
    vocab_size: int,
    decode_kernel: str | None,
) -> int:
    """What DecodeGraphs keeps allocated beside the KV pool, for the KV budget to leave free:
    the shared logits buffer and, on the gather path, the read workspace."""
    logits = max_batch * vocab_size * spec.dtype_size
    if decode_kernel:
        return logits
    width = width_bucket(-(-max_model_len // spec.block_size))
    return logits + decode_read_bytes(spec, max_batch, width, MAX_READ_BYTES)


def decode_read_bytes(spec: KVCacheSpec, max_batch: int, max_width: int, cap: int) -> int:
    """Bytes of the largest padded decode read (K and V of one layer), at most `cap`: the
    workspace graphs reserve, so also part of what the KV budget must leave free."""
    blocks = min(batch_buckets(max_batch)[-1] * max_width, cap // spec.read_bytes_per_block)
    return blocks * spec.read_bytes_per_block
