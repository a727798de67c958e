"""The LoRA adapters an engine serves: their names and paths, and the ones resident in memory
(at most `max_loras`; the least recently used one that no running request uses makes room).

A resident adapter is laid out for the forward's fused projections (`FusedUpdate`: QKV, o,
gate/up, down): the A matrices of a projection's parts stacked, so one product gives every
part's low-rank activations, and each part's B adding into its own columns of the fused
output. What it costs is its own weights, never a copy of the base model's: the base projection
stays as it is stored. The exact (dense) forward keeps them in its dtype and adds them with
torch ops; the quantized forward keeps them in int8 with a float32 scale per rank (a decode step
reads every one of them beside the base's 4-bit blocks, and reading them is what they cost: a
quarter of float32's bytes), every matrix of the adapter in one buffer in the order a decode
step reads them (`KernelPack`), and adds them with jitney::lora_add_, also inside the one-call
decode op: three tensors an adapter, whatever its number of updates.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.errors import AdapterLoadError, UnknownAdapterError
from engine.lora.adapter_files import AdapterFile, read_adapter

FUSED = ("qkv", "o", "gate_up", "down")  # llama_decode_layers_'s matrices, in its order
MAX_PARTS = 3  # Q, K, V
RECORD_INTS = 5 + 6 * MAX_PARTS  # kernels/reference.py LORA_RECORD_INTS, csrc/ops.h
RANK_TILE = 16  # jitney::lora_add_ takes A's stacked ranks in tiles of 16 (csrc/lora_add.cpp)
ALIGN = 64  # each matrix of a pack starts on a cache line


@dataclass(frozen=True, slots=True)
class PartUpdate:
    """One part's B, adding into columns [start, start + out) of the fused output from
    low-rank activations [rank_start, rank_start + r)."""

    start: int
    rank_start: int
    b: torch.Tensor  # [out, r]; for jitney::lora_add_ (FusedUpdate.kernel) in chunks of 32
    out: int


@dataclass(frozen=True, slots=True)
class FusedUpdate:
    """One fused projection's low-rank update: t = x @ a.T, then each part's t-slice @ b.T."""

    a: torch.Tensor  # [R, in]: the parts' A stacked; for the kernel in tiles of 16 ranks
    parts: tuple[PartUpdate, ...]
    kernel: bool  # int8, added by jitney::lora_add_ (else torch ops in the model's dtype)
    entry: int = -1  # the kernel's: its record in the adapter's KernelPack

    def add_dense(self, y: torch.Tensor, x: torch.Tensor, rows: slice, index: torch.Tensor) -> None:
        """y[rows] += this update of x[rows], in place, in torch ops (`index`: the same rows as a
        tensor). The kernel's form is added by StepAdapters, every adapter in one call."""
        if rows.stop - rows.start != index.numel():  # scattered rows: gathered, added back
            part = torch.zeros(index.numel(), y.shape[1], dtype=y.dtype, device=y.device)
            self._add_dense(part, x[index])
            y.index_add_(0, index, part)
        else:
            self._add_dense(y[rows], x[rows])

    def _add_dense(self, y: torch.Tensor, x: torch.Tensor) -> None:
        t = x @ self.a.T
        for p in self.parts:
            r = p.b.shape[1]
            cols = y[:, p.start : p.start + p.out]
            cols.addmm_(t[:, p.rank_start : p.rank_start + r], p.b.T)


@dataclass(frozen=True, slots=True)
class ProjectionSite:
    """Where a PEFT module's output lies in the forward: its fused projection, the columns,
    and the input width."""

    fused: str
    start: int
    out: int
    inp: int


@dataclass(frozen=True, slots=True)
class LoraTargets:
    """The base model's projections as an adapter must match them."""

    num_layers: int
    sites: dict[str, ProjectionSite]  # PEFT module name -> site
    dtype: torch.dtype
    device: torch.device
    kernel: bool = False  # the quantized forward's: int8 for jitney::lora_add_

    @classmethod
    def llama(
        cls,
        num_layers: int,
        hidden: int,
        q_out: int,
        kv_out: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: bool = False,
    ) -> LoraTargets:
        """The Llama layer's projections (and Phi-3's stored fused ones)."""
        qkv = q_out + 2 * kv_out
        sites = {
            "q_proj": ProjectionSite("qkv", 0, q_out, hidden),
            "k_proj": ProjectionSite("qkv", q_out, kv_out, hidden),
            "v_proj": ProjectionSite("qkv", q_out + kv_out, kv_out, hidden),
            "qkv_proj": ProjectionSite("qkv", 0, qkv, hidden),
            "o_proj": ProjectionSite("o", 0, hidden, q_out),
            "gate_proj": ProjectionSite("gate_up", 0, intermediate, hidden),
            "up_proj": ProjectionSite("gate_up", intermediate, intermediate, hidden),
            "gate_up_proj": ProjectionSite("gate_up", 0, 2 * intermediate, hidden),
            "down_proj": ProjectionSite("down", 0, hidden, intermediate),
        }
        return cls(num_layers, sites, dtype, device, kernel)


@dataclass(frozen=True, slots=True)
class ResidentAdapter:
    """An adapter in memory: per layer, its update of each fused projection it touches."""

    name: str
    path: str
    rank: int
    layers: tuple[dict[str, FusedUpdate], ...]
    nbytes: int
    pack: KernelPack | None = None  # the quantized forward's (jitney::lora_add_)


def lay_out(name: str, file: AdapterFile, targets: LoraTargets, max_rank: int) -> ResidentAdapter:
    """`file`'s pairs checked against the base model and stacked per fused projection."""
    if file.rank > max_rank:
        raise AdapterLoadError(
            f"LoRA adapter {name!r} has rank {file.rank}, over --max-lora-rank {max_rank}"
        )
    grouped: list[dict[str, list[tuple[ProjectionSite, torch.Tensor, torch.Tensor]]]] = [
        {} for _ in range(targets.num_layers)
    ]
    for (layer, module), pair in sorted(file.pairs.items()):
        site = targets.sites[module]
        if layer >= targets.num_layers:
            raise AdapterLoadError(
                f"LoRA adapter {name!r} names layer {layer}; the base model has "
                f"{targets.num_layers}"
            )
        if pair.a.shape[1] != site.inp or pair.b.shape[0] != site.out:
            raise AdapterLoadError(
                f"LoRA adapter {name!r}: layer {layer} {module} maps {pair.a.shape[1]} -> "
                f"{pair.b.shape[0]}; the base model's maps {site.inp} -> {site.out}"
            )
        grouped[layer].setdefault(site.fused, []).append((site, pair.a, pair.b))
    if targets.kernel:
        return _kernel_adapter(name, file, grouped)
    layers, nbytes = [], 0
    for per_fused in grouped:
        updates = {}
        for fused, parts in per_fused.items():
            a, placed = _dense_layout(_ordered(name, fused, parts), targets)
            updates[fused] = FusedUpdate(a, tuple(placed), False)
            nbytes += a.nbytes + sum(p.b.nbytes for p in placed)
        layers.append(updates)
    return ResidentAdapter(name, file.path, file.rank, tuple(layers), nbytes)


Parts = list[tuple["ProjectionSite", torch.Tensor, torch.Tensor]]


def _ordered(name: str, fused: str, parts: Parts) -> Parts:
    """A fused projection's parts in column order (at most MAX_PARTS)."""
    if len(parts) > MAX_PARTS:
        raise AdapterLoadError(f"LoRA adapter {name!r}: {fused} in overlapping parts")
    return sorted(parts, key=lambda part: part[0].start)


def _kernel_adapter(
    name: str, file: AdapterFile, grouped: list[dict[str, Parts]]
) -> ResidentAdapter:
    """The quantized forward's adapter: every update in one KernelPack, record layer * 4 +
    matrix (FUSED's order), the FusedUpdates views into it."""
    laid = [
        {fused: _kernel_layout(_ordered(name, fused, parts)) for fused, parts in per.items()}
        for per in grouped
    ]
    pack = KernelPack.of([per.get(fused) for per in laid for fused in FUSED])
    layers = []
    for i, per in enumerate(laid):
        updates = {}
        for fused, (a, placed, _) in per.items():
            entry = i * len(FUSED) + FUSED.index(fused)
            record = pack.records[entry].tolist()
            views = [
                PartUpdate(p.start, p.rank_start, pack.view(record[5 + 6 * j], p.b), p.out)
                for j, p in enumerate(placed)
            ]
            updates[fused] = FusedUpdate(pack.view(record[3], a), tuple(views), True, entry)
        layers.append(updates)
    return ResidentAdapter(name, file.path, file.rank, tuple(layers), pack.nbytes, pack)


@dataclass(frozen=True, slots=True)
class KernelPack:
    """An adapter's updates as jitney::lora_add_ and the one-call decode op take them: every
    matrix in one int8 buffer, in the order a decode step reads them (each update's A, then its
    parts' B), their float32 scales in another, and a record per update saying where each lies
    (RECORD_INTS ints, kernels/reference.py reads them; parts 0: no update). Three tensors an
    adapter to pass a step, where a tensor per matrix would be hundreds."""

    weights: torch.Tensor  # int8 [bytes]
    scales: torch.Tensor  # float32 [n]
    records: torch.Tensor  # int64 [updates, RECORD_INTS]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.weights, self.scales, self.records]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def view(self, at: int, like: torch.Tensor) -> torch.Tensor:
        """The matrix shaped as `like` that lies at byte `at` of the weights."""
        return self.weights[at : at + like.numel()].view(like.shape)

    @classmethod
    def of(
        cls, updates: Sequence[tuple[torch.Tensor, list[PartUpdate], list[torch.Tensor]] | None]
    ) -> KernelPack:
        """`updates` in _kernel_layout's form (None: no update at that record), in order."""
        weights: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        records = torch.zeros(len(updates), RECORD_INTS, dtype=torch.int64)
        sizes = [0, 0]

        def put(t: torch.Tensor, into: list[torch.Tensor], which: int, align: int) -> int:
            at = sizes[which]
            flat = t.reshape(-1)
            padded = -(-flat.numel() // align) * align
            into += [flat, flat.new_zeros(padded - flat.numel())]
            sizes[which] += padded
            return at

        for i, update in enumerate(updates):
            if update is None:
                continue
            a, placed, sc = update
            record = [len(placed), a.shape[1] * 4, a.shape[0] * RANK_TILE]
            record += [put(a, weights, 0, ALIGN), put(sc[0], scales, 1, 1)]
            for part, part_scale in zip(placed, sc[1:], strict=True):
                b_at = put(part.b, weights, 0, ALIGN)
                b_scale_at = put(part_scale, scales, 1, 1)
                record += [b_at, b_scale_at, part.b.shape[1] * 4]
                record += [part.start, part.rank_start, part.out]
            records[i, : len(record)] = torch.tensor(record)
        flat_weights = torch.cat(weights) if weights else torch.zeros(0, dtype=torch.int8)
        flat_scales = torch.cat(scales) if scales else torch.zeros(0)
        return cls(flat_weights.contiguous(), flat_scales.float().contiguous(), records)


def _dense_layout(parts: Parts, targets: LoraTargets) -> tuple[torch.Tensor, list[PartUpdate]]:
    """The parts' A stacked [R, in] and each B [out, r], in the model's dtype."""
    a = torch.cat([pa for _, pa, _ in parts]).to(targets.device, targets.dtype)
    placed, rank_start = [], 0
    for site, pa, pb in parts:
        b = pb.to(targets.device, targets.dtype)
        placed.append(PartUpdate(site.start, rank_start, b, site.out))
        rank_start += pa.shape[0]
    return a, placed


def _kernel_layout(parts: Parts) -> tuple[torch.Tensor, list[PartUpdate], list[torch.Tensor]]:
    """jitney::lora_add_'s layout (csrc/lora_add.cpp): int8 with a scale per rank, each
    matrix one sequential stream in the order the kernel reads it. A: the parts' A stacked,
    each part's ranks padded to a multiple of 4 (its rank start is one), the stack to
    RANK_TILE, the inputs to a block of 32, in tiles of 16 ranks; each B in chunks of 32
    outputs."""
    inputs = parts[0][1].shape[1]
    padded = [_pad(pa, -(-pa.shape[0] // 4) * 4, 0) for _, pa, _ in parts]
    stacked = torch.cat(padded)
    stacked = _pad(stacked, -(-stacked.shape[0] // RANK_TILE) * RANK_TILE, 0)
    a, a_scale = _int8_columns(_pad(stacked, -(-inputs // 32) * 32, 1).T)  # a scale per rank
    placed, scales, rank_start = [], [a_scale], 0
    for (site, _, pb), pa in zip(parts, padded, strict=True):
        b, b_scale = _int8_columns(_pad(pb, pa.shape[0], 1))  # [out, r], a scale per rank
        placed.append(PartUpdate(site.start, rank_start, _in_lanes(b, 32), site.out))
        scales.append(b_scale)
        rank_start += pa.shape[0]
    return _in_lanes(a.T.contiguous(), RANK_TILE), placed, scales


def _pad(m: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """m float32 with zeros appended along `dim` up to `size`."""
    shape = list(m.shape)
    shape[dim] = size - m.shape[dim]
    return torch.cat([m.float(), torch.zeros(shape)], dim)


def _in_lanes(m: torch.Tensor, lanes: int) -> torch.Tensor:
    """int8 [rows, k] (k a multiple of 4) -> [ceil(rows / lanes), k / 4, 4 lanes]: per group of
    `lanes` rows, per four neighbouring k, each row's four in one 32-bit lane, as a VNNI dot
    product sums them (kernels/reference.py a_from_tiles, b_from_chunks undo it)."""
    rows, k = m.shape
    groups = -(-rows // lanes)
    full = torch.zeros(groups * lanes, k, dtype=m.dtype)
    full[:rows] = m
    return (
        full.reshape(groups, lanes, k // 4, 4)
        .permute(0, 2, 1, 3)
        .reshape(groups, k // 4, -1)
        .contiguous()
    )


def _int8_columns(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m [rows, cols] float32 as int8 with a float32 scale per column (symmetric: the column's
    largest magnitude maps to 127; an all-zero column, a padded rank, gets scale 1)."""
    largest = m.abs().amax(0)
    scale = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    return torch.round(m / scale).clamp(-127, 127).to(torch.int8), scale.float().contiguous()


class AdapterSet:
    """The adapters an engine serves by name, and those resident now."""

    def __init__(
        self,
        targets: LoraTargets | None,
        modules: Iterable[tuple[str, str]],
        max_loras: int,
        max_rank: int,
        num_heads: int = 0,
        num_kv_heads: int = 0,
    ):
        """`targets` None: the forward takes no adapters (any configured one is refused)."""
        self.targets = targets
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._heads = (num_heads, num_kv_heads)
        self.paths: dict[str, str] = {}
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()
        for name, path in modules:
            self.add(name, path)

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    @property
    def resident_names(self) -> list[str]:
        return list(self._resident)

    def check(self, name: str) -> None:
        if name not in self.paths:
            known = ", ".join(self.paths) or "none"
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r} (served: {known})")

    def add(self, name: str, path: str, in_use: Collection[str] = ()) -> ResidentAdapter:
        """Read and check an adapter now, and serve it under `name` (replacing one of that name
        that no running request uses). Raises AdapterLoadError."""
        if self.targets is None:
            raise AdapterLoadError(
                "LoRA adapters run on Jitney's forward; this model runs transformers' "
                "(a family Jitney's forward does not cover, or --model-impl transformers)"
            )
        if name in in_use:
            raise AdapterLoadError(f"LoRA adapter {name!r} is in use by running requests")
        adapter = self._load(name, path)
        self.paths[name] = path
        self._resident.pop(name, None)
        self._make_room(in_use)
        self._resident[name] = adapter
        return adapter

    def remove(self, name: str, in_use: Collection[str] = ()) -> None:
        self.check(name)
        if name in in_use:
            raise AdapterLoadError(f"LoRA adapter {name!r} is in use by running requests")
        del self.paths[name]
        self._resident.pop(name, None)

    def resident(self, name: str, in_use: Collection[str] = ()) -> ResidentAdapter:
        """The adapter in memory (read from its path if it was evicted), most recently used."""
        adapter = self._resident.get(name)
        if adapter is None:
            self.check(name)
            adapter = self._load(name, self.paths[name])
            self._make_room(in_use)
            self._resident[name] = adapter
        self._resident.move_to_end(name)
        return adapter

    def _load(self, name: str, path: str) -> ResidentAdapter:
        assert self.targets is not None
        return lay_out(name, read_adapter(path, *self._heads), self.targets, self.max_rank)

    def _make_room(self, in_use: Collection[str]) -> None:
        """Evict least recently used adapters no running request uses until one more fits;
        when every resident one is in use, the set grows past max_loras for now (a request is
        never stalled for want of a slot) and shrinks back as they finish."""
        while len(self._resident) >= self.max_loras:
            idle = next((n for n in self._resident if n not in in_use), None)
            if idle is None:
                return
            del self._resident[idle]
