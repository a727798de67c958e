"""One step's rows grouped by LoRA adapter, and their updates added to a projection's output.

Rows of different adapters (and of none) run in one forward: the base projection computes
every row as it is stored, then each adapter's low-rank product is added to its own rows only,
one group per adapter (Punica's and S-LoRA's grouping, without a merged copy of the weights).
On the exact forward a group's rows that lie side by side are a slice (a view: no gather, no
scatter), scattered rows are gathered, updated and added back with index_add_; the quantized
forward's jitney::lora_add_ takes the rows' indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.adapter_set import ResidentAdapter


@dataclass(frozen=True, slots=True)
class AdapterGroup:
    adapter: ResidentAdapter
    rows: slice  # its first and last rows of the step's [T, ...] activations
    index: torch.Tensor  # every one of its rows (int64): those between them, if scattered


@dataclass(frozen=True, slots=True)
class StepAdapters:
    """The step's adapter rows; rows of no group run the base model alone."""

    groups: tuple[AdapterGroup, ...]

    @classmethod
    def build(
        cls, spans: list[tuple[ResidentAdapter, int, int]], device: torch.device
    ) -> StepAdapters | None:
        """`spans`: (adapter, first row, row count) in row order; None when there are none."""
        by_name: dict[str, tuple[ResidentAdapter, list[tuple[int, int]]]] = {}
        for adapter, first, count in spans:
            entry = by_name.setdefault(adapter.name, (adapter, []))[1]
            if entry and entry[-1][0] + entry[-1][1] == first:
                entry[-1] = (entry[-1][0], entry[-1][1] + count)  # extends the previous span
            else:
                entry.append((first, count))
        groups = []
        for adapter, runs in by_name.values():
            index = [r for first, count in runs for r in range(first, first + count)]
            rows = slice(index[0], index[-1] + 1)
            groups.append(AdapterGroup(adapter, rows, torch.tensor(index, device=device)))
        return cls(tuple(groups)) if groups else None

    def add(self, layer: int, fused: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (a projection's output for x) with each group's update of `fused` in `layer`
        added to its rows; y is updated in place and returned."""
        rows: list[torch.Tensor] = []
        packs: list[torch.Tensor] = []
        entries: list[int] = []
        for group in self.groups:
            update = group.adapter.layers[layer].get(fused)
            if update is None:
                continue
            if not update.kernel:
                update.add_dense(y, x, group.rows, group.index)
                continue
            rows.append(group.index)
            packs += group.adapter.pack.tensors
            entries.append(update.entry)
        if rows:  # the kernel's: every adapter's update in one call
            torch.ops.jitney.lora_add_(y, x, rows, packs, entries)
        return y

    def decode_arguments(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """llama_decode_layers_'s lora_rows and lora (each group's adapter's pack) for this
        step."""
        packs: list[torch.Tensor] = []
        for group in self.groups:
            packs += group.adapter.pack.tensors
        return [g.index for g in self.groups], packs
