"""LoRA adapters in the engine (engine/lora/): parity with transformers + PEFT on the same
weights, rows of different adapters (and of none) in one step as each would run alone, the
GGUF adapter form, and the adapters the engine refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.errors import AdapterLoadError, UnknownAdapterError
from engine.kernels import kernel_backend
from generation.sampling_params import SamplingParams
from tests.lora_adapters import write_gguf_adapter, write_peft_adapter
from tests.model_dirs import TWO_LAYER_LLAMA, write_random_llama

ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory="8MiB", speculative="none")
EXACT = dict(ENGINE, model_impl="jitney", quantization="none")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 9, 41, 12, 7, 60, 22, 19, 3, 8, 71, 30, 44, 15, 27, 6], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = write_random_llama(root / "base", seed=3, **TWO_LAYER_LLAMA)
    a = write_peft_adapter(base, root / "a", rank=8, seed=1)
    b = write_peft_adapter(
        base,
        root / "b",
        rank=4,
        seed=2,
        targets=("q_proj", "v_proj", "down_proj"),
        use_rslora=True,
    )
    return {"base": base, "a": a, "b": b, "a.gguf": write_gguf_adapter(a, root / "a.gguf", 4, 2)}


def engine_for(files: dict[str, Path], **config: object):
    from engine.config import EngineConfig
    from engine.llm_engine import Engine

    modules = (("a", str(files["a"])), ("b", str(files["b"])), ("a-gguf", str(files["a.gguf"])))
    fields = dict(EXACT, model=str(files["base"]), lora_modules=modules) | config
    return Engine(EngineConfig.from_flat(**fields))


def peft_greedy(files: dict[str, Path], adapter: str, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(files["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, files[adapter]).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def test_adapter_greedy_matches_peft(files) -> None:
    engine = engine_for(files)
    got = engine.generate(PROMPTS, GREEDY, lora=["a", "b"])
    for prompt, result, name in zip(PROMPTS, got, ["a", "b"], strict=True):
        assert result.token_ids == peft_greedy(files, name, prompt, 10), name
    base = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert base != got[0].token_ids  # the adapter changes what the model says
    # llama.cpp's GGUF form of adapter a (B of Q and K permuted, alpha in the metadata).
    assert engine.generate(PROMPTS[:1], GREEDY, lora="a-gguf")[0].token_ids == (got[0].token_ids)


def logprobs_of(engine, prompts, loras) -> list[list[list[tuple[int, float]]]]:
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    results = engine.generate(prompts, params, lora=loras)
    return [
        [list(t.top) for t in (r.prompt_logprobs or []) + r.logprobs if t is not None]
        for r in results
    ]


def assert_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 1e-5


@pytest.mark.parametrize("quantized", [False, True], ids=["exact", "gguf-blocks"])
def test_rows_of_three_kinds_in_one_step_equal_each_alone(files, quantized, tmp_path) -> None:
    """Base, a, b and a again (a's rows not side by side) prefill and decode together; every
    row's log-probs are those of a step holding only its own request."""
    config = {}
    if quantized:  # the fused jitney:: ops on the file's blocks, adapters added per layer
        from transformers import AutoModelForCausalLM

        from tests.engine.test_gguf_model import BLOCKS
        from tests.gguf_files import write_gguf

        model = AutoModelForCausalLM.from_pretrained(files["base"], dtype=torch.float32)
        path = write_gguf(tmp_path / "base.gguf", model, "llama", matrices=BLOCKS)
        config = dict(model=str(path), quantization="gguf")
    engine = engine_for(files, **config)
    prompts = [PROMPTS[0], PROMPTS[0][:9], PROMPTS[1], PROMPTS[0][3:]]
    loras = [None, "a", "b", "a"]
    backend = kernel_backend()
    before = backend.isa
    if before == "amx":  # AMX's bf16 tiles take the base's larger prefills: not row for row
        backend.set_isa("vnni")
    try:
        together = logprobs_of(engine, prompts, loras)
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
            assert_close(together[i], logprobs_of(engine, [prompt], [lora])[0])
    finally:
        if before is not None:
            backend.set_isa(before)
    assert together[0] != together[1]


def test_prefix_cache_never_shares_kv_across_adapters(files) -> None:
    engine = engine_for(files)
    prompt = PROMPTS[0] * 3  # three full blocks of 16
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([prompt], one)
    cached = engine.generate([prompt], one, lora="a")[0]
    again = engine.generate([prompt], one, lora="a")[0]
    assert cached.num_cached_tokens == 0
    assert again.num_cached_tokens == 48


def test_unknown_adapter_is_refused_before_anything_is_queued(files) -> None:
    engine = engine_for(files)
    with pytest.raises(UnknownAdapterError, match=r"'nope'.*served: a, b, a-gguf"):
        engine.add_request("r", [1, 2, 3], GREEDY, lora="nope")
    assert not engine.has_unfinished()


def test_uncovered_modules_and_ranks_are_refused_by_name(files, tmp_path) -> None:
    head = write_peft_adapter(files["base"], tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(AdapterLoadError, match="'lm_head' is not a module"):
        engine_for(files, lora_modules=(("head", str(head)),))
    with pytest.raises(AdapterLoadError, match="'a' has rank 8, over --max-lora-rank 4"):
        engine_for(files, max_lora_rank=4)


def test_runtime_add_remove_and_lru(files) -> None:
    engine = engine_for(files, lora_modules=(), max_loras=1)
    assert engine.adapter_names == []
    engine.add_adapter("a", str(files["a"]))
    engine.add_adapter("b", str(files["b"]))
    assert engine.adapters.resident_names == ["b"]  # max_loras 1: a was evicted
    first = engine.generate(PROMPTS[:1], GREEDY, lora="a")[0].token_ids  # read again
    assert engine.adapters.resident_names == ["a"]
    assert first == peft_greedy(files, "a", PROMPTS[0], 10)
    engine.add_request("r", PROMPTS[0], GREEDY, lora="a")
    with pytest.raises(AdapterLoadError, match="in use"):
        engine.remove_adapter("a")
    engine.abort("r")
    engine.remove_adapter("a")
    assert engine.adapter_names == ["b"]
    with pytest.raises(AdapterLoadError, match="rank 8, over --max-lora-rank 4"):
        engine_for(files, lora_modules=(), max_lora_rank=4).add_adapter("a", str(files["a"]))
    with pytest.raises(AdapterLoadError, match="no such file"):
        engine.add_adapter("c", str(files["base"] / "missing"))


@pytest.mark.skipif(
    not kernel_backend().is_native, reason=f"C++ kernels not in use: {kernel_backend().reason}"
)
@pytest.mark.parametrize("rows_per_group", [(1, 2), (3, 9)], ids=["one-thread", "two-threads"])
def test_the_update_kernel_matches_its_reference(isa, rows_per_group) -> None:
    """jitney::lora_add_ (C++) against its torch definition, at each instruction set the CPU
    has: two adapter groups (the second's update its pack's second record, after one with
    none), rows scattered, inputs not a whole block, parts whose widths are not whole chunks
    and ranks not multiples of four."""
    from engine.kernels import reference
    from engine.lora.adapter_set import KernelPack, ProjectionSite, _kernel_layout

    g = torch.Generator().manual_seed(0)
    in_width = 40 if rows_per_group[1] < 4 else 700
    total = sum(rows_per_group) + 2
    x, y = torch.randn(total, in_width, generator=g), torch.randn(total, 57, generator=g)
    packs, entries = [], []
    for group in range(2):
        sites = (ProjectionSite("qkv", 0, 37, in_width), ProjectionSite("qkv", 37, 20, in_width))
        parts = [
            (site, torch.randn(r, in_width, generator=g), torch.randn(site.out, r, generator=g))
            for site, r in zip(sites, (8, 5), strict=True)
        ]
        packs += KernelPack.of([None] * group + [_kernel_layout(parts)]).tensors
        entries.append(group)
    order = torch.randperm(total, generator=g)
    rows = [order[: rows_per_group[0]], order[rows_per_group[0] : sum(rows_per_group)]]
    want = y.clone()
    reference.lora_add_(want, x, rows, packs, entries)
    largest = (want - y).abs().max().item()
    torch.ops.jitney.lora_add_(y, x, rows, packs, entries)
    # VNNI's activations are two int8 digits a value (about 15 bits): its error is relative to
    # the update's scale, not to each sum, which may cancel.
    atol = 1e-4 * largest if isa in ("vnni", "amx") else 1e-5 * largest
    torch.testing.assert_close(y, want, rtol=0, atol=atol)


@pytest.mark.skipif(
    not kernel_backend().is_native, reason=f"C++ kernels not in use: {kernel_backend().reason}"
)
def test_the_update_kernel_refuses_a_pack_that_does_not_hold_its_records() -> None:
    """A pack is data from Python: a record pointing past its buffers, an entry past its
    records or a rank start past A's ranks fails with a clear error, before any read."""
    from engine.lora.adapter_set import KernelPack, ProjectionSite, _kernel_layout

    g = torch.Generator().manual_seed(0)
    site = ProjectionSite("o", 0, 40, 32)
    layout = _kernel_layout([(site, torch.randn(8, 32, generator=g), torch.randn(40, 8))])
    x, y, rows = torch.randn(2, 32), torch.zeros(2, 40), torch.tensor([0, 1])
    cases = {(0, 3): "A does not fit", (0, 5): "part 0 does not fit", (0, 9): "a's ranks"}
    for (entry, field), message in cases.items():
        pack = KernelPack.of([layout])
        pack.records[entry, field] = 10**6 if field != 9 else 16
        with pytest.raises(RuntimeError, match=message):
            torch.ops.jitney.lora_add_(y, x, [rows], pack.tensors, [entry])
    with pytest.raises(RuntimeError, match="entry 1 outside the pack's 1 records"):
        torch.ops.jitney.lora_add_(y, x, [rows], KernelPack.of([layout]).tensors, [1])
    assert y.abs().sum() == 0  # nothing was added by the refused calls
