"""CUDA-graph semantics on the CPU, so the capture path can be tested where no GPU is.

A CUDA graph records kernels and replays them on the same memory: host values read during capture
are frozen into it, the host cannot read the device inside it, and memory that existed before the
capture is used by address, so it must outlive the graph. `EmulatedGraphCapture` runs the step once
under a TorchDispatchMode that records every aten op, then replays that op list:
- ops that would make the host wait on the device (``.item()``, ``nonzero``, boolean indexing,
  tensors built from host data) raise `GraphCaptureError` during capture, as capture does on CUDA;
- every replay runs the recorded ops with their recorded non-tensor arguments (Python ints, floats,
  shapes): a value the step computed on the host during capture stays frozen, as in a real graph;
- tensors computed inside the step keep their capture-time objects (the graph's private pool), and
  each replay writes new values into them; views are taken again each replay;
- tensors from before the capture (weights, the KV pool, static buffers, workspaces) are held only
  by weak reference: if the program drops one, the replay raises `GraphMemoryFreed`, where a CUDA
  graph would silently read or write freed memory.
After capture, the outputs of computing ops are filled with NaN, because a CUDA capture computes
nothing: a caller that reads them before the first replay sees garbage here too.
Triton kernels launch outside torch's dispatcher: tests patch `kernel_as_op` in for the decode
kernel, so the recorder sees its launch as one op and replays it. Not emulated: ``.tolist()`` and
``.cpu()`` (no dispatched op tells a host copy on the CPU),
random-number state, and streams.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from engine.attention.triton_decode import paged_decode_attention

aten = torch.ops.aten

# Ops whose result the host must wait for (or that copy host data to the device): not capturable.
_HOST_SYNC = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.allclose.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    aten.lift_fresh.default,
}
_BOOL_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}


class GraphCaptureError(RuntimeError):
    """The step did something a CUDA graph capture refuses."""


class GraphMemoryFreed(RuntimeError):
    """A replay would use memory that was freed after the capture."""


@dataclass(frozen=True, slots=True)
class _External:
    """A tensor from before the capture: its base by weak reference, and the view taken of it."""

    base: weakref.ref[torch.Tensor]
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, offset; None: base
    what: str  # the base's shape and dtype, for the error


@dataclass(frozen=True, slots=True)
class _Slot:
    index: int


@dataclass(slots=True)
class _Op:
    func: Any  # an OpOverload
    args: Any  # the recorded arguments, tensors replaced by _Slot
    kwargs: Any
    outputs: list[tuple[int, str]]  # (slot, "alias" | "view" | "fixed") per tensor output


@dataclass
class _Recorder(TorchDispatchMode):
    ops: list[_Op] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)  # slot -> tensor, during capture
    kinds: list[str] = field(default_factory=list)  # slot -> "external" | "alias" | ...
    _slot_of: dict[int, int] = field(default_factory=dict)  # id(tensor) -> slot

    def __post_init__(self) -> None:
        super().__init__()

    def _slot(self, t: torch.Tensor, kind: str) -> int:
        slot = self._slot_of.get(id(t))
        if slot is None:
            slot = self._slot_of[id(t)] = len(self.tensors)
            self.tensors.append(t)  # held until capture ends, so no id is reused meanwhile
            self.kinds.append(kind)
        return slot

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        _refuse_host_sync(func, args, kwargs)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {_storage_key(t) for t in inputs} - {None}

        def encode(x: object) -> object:
            return _Slot(self._slot(x, "external")) if isinstance(x, torch.Tensor) else x

        rec_args, rec_kwargs = tree_map(encode, args), tree_map(encode, kwargs)
        outputs = []
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if any(t is i for i in inputs):  # in-place and out= ops return their argument
                outputs.append((self._slot_of[id(t)], "alias"))
            elif _storage_key(t) in storages:  # a view of an argument: taken again per replay
                outputs.append((self._slot(t, "view"), "view"))
            else:  # computed into memory of its own: the graph's pool
                outputs.append((self._slot(t, "fixed"), "fixed"))
        self.ops.append(_Op(func, rec_args, rec_kwargs, outputs))
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    ptr = t.untyped_storage().data_ptr()
    return ptr or None  # empty tensors share no memory


def _refuse_host_sync(func: Any, args: tuple, kwargs: dict) -> None:
    if func in _HOST_SYNC:
        raise GraphCaptureError(f"{func} waits on the device (or reads host data) inside capture")
    if func in _BOOL_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            raise GraphCaptureError(f"{func} with a boolean mask needs nonzero() on the host")


@dataclass
class EmulatedGraph:
    """One recorded step; `replay()` rewrites `output` as a CUDA graph's replay would."""

    ops: list[_Op]
    slots: list[torch.Tensor | _External | None]  # fixed tensors, external refs; views: None
    output: torch.Tensor
    replays: int = 0

    def replay(self) -> None:
        tensors: list[torch.Tensor | None] = [self._resolve(i, s) for i, s in enumerate(self.slots)]

        def decode(x: object) -> object:
            return tensors[x.index] if isinstance(x, _Slot) else x

        with torch.inference_mode():
            for op in self.ops:
                out = op.func(*tree_map(decode, op.args), **tree_map(decode, op.kwargs))
                results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                for (slot, kind), new in zip(op.outputs, results, strict=True):
                    if kind == "view":
                        tensors[slot] = new
                    elif kind == "fixed":
                        fixed = tensors[slot]
                        assert fixed is not None
                        if fixed.shape != new.shape:
                            raise GraphCaptureError(
                                f"{op.func} gave shape {tuple(new.shape)} on replay, "
                                f"{tuple(fixed.shape)} at capture"
                            )
                        fixed.copy_(new)
        self.replays += 1

    def _resolve(self, index: int, slot: torch.Tensor | _External | None) -> torch.Tensor | None:
        if not isinstance(slot, _External):
            return slot
        base = slot.base()
        if base is None:
            raise GraphMemoryFreed(
                f"tensor {index} of the graph ({slot.what}) existed before its capture and has "
                "been freed since: a CUDA graph would use freed memory"
            )
        return base if slot.view is None else base.as_strided(*slot.view)


@dataclass
class EmulatedGraphCapture:
    """engine.decode_graphs.GraphCapture for the CPU (see the module docstring)."""

    graphs: list[EmulatedGraph] = field(default_factory=list)

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        step()  # warm-up, as before a CUDA capture: lazy growth happens outside the graph
        recorder = _Recorder()
        with torch.inference_mode(), recorder:
            output = step()
        slots: list[torch.Tensor | _External | None] = []
        for t, kind in zip(recorder.tensors, recorder.kinds, strict=True):
            if kind == "external":
                base = t._base if t._is_view() else t
                assert base is not None and base.dtype == t.dtype
                view = None if base is t else (tuple(t.shape), t.stride(), t.storage_offset())
                what = f"{tuple(base.shape)} {base.dtype}"
                slots.append(_External(weakref.ref(base), view, what))
            else:
                slots.append(t if kind == "fixed" else None)
                if kind == "fixed" and t.is_floating_point():
                    with torch.inference_mode():
                        t.fill_(float("nan"))  # a capture computes nothing
        graph = EmulatedGraph(recorder.ops, slots, output)
        self.graphs.append(graph)
        return graph.replay, output


@torch.library.custom_op("jitney_test::paged_decode", mutates_args=("out",))
def _paged_decode_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> None:
    paged_decode_attention(
        query, key_cache, value_cache, block_tables, ctx_lens, scale, window or None, out
    )


def kernel_as_op(query, key_cache, value_cache, block_tables, ctx_lens, scale, window, out):
    """engine.triton_decode.paged_decode_attention launched through a torch op, for tests to
    patch in: a Triton launch is no torch op, so the recorder would not see it (a CUDA graph
    records it like any kernel)."""
    out = torch.empty(query.shape, dtype=key_cache.dtype) if out is None else out
    _paged_decode_op(query, key_cache, value_cache, block_tables, ctx_lens, scale, window or 0, out)
    return out
