"""Paged attention vs the same model's plain forward on each sequence alone (CPU, fp32)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from engine.attention import native_decode, paged_attention, step_inputs
from engine.attention.paged_attention import use_paged_attention
from engine.attention.step_inputs import AttentionMetadata, group_decodes
from engine.kv_cache import KVCacheSpec, PagedKVCache, parse_bytes
from engine.models.forward import model_forward

TOL = 1e-4
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)
FAMILIES = {
    "llama": lambda **kw: (LlamaForCausalLM, LlamaConfig(**TINY, **kw)),
    "qwen2": lambda **kw: (Qwen2ForCausalLM, Qwen2Config(**TINY, **kw)),
    # head_dim 32 != hidden / heads: the pool must follow config.head_dim.
    "qwen3": lambda **kw: (Qwen3ForCausalLM, Qwen3Config(**TINY, head_dim=32, **kw)),
    "mistral": lambda **kw: (MistralForCausalLM, MistralConfig(**TINY, **kw)),
}


def make_models(family: str = "llama", **overrides: object) -> tuple[PreTrainedModel, ...]:
    """(reference model on eager attention, same weights on jitney_paged). Configs are copied:
    set_attn_implementation mutates the config object, which models would otherwise share."""
    model_cls, config = FAMILIES[family](**overrides)
    torch.manual_seed(0)
    ref = model_cls(copy.deepcopy(config)).eval()
    ref.set_attn_implementation("eager")
    paged = model_cls(copy.deepcopy(config)).eval()
    paged.load_state_dict(ref.state_dict())
    use_paged_attention(paged)
    return ref, paged


def make_cache(
    config: PretrainedConfig,
    block_size: int = 4,
    num_blocks: int = 64,
    dtype: torch.dtype = torch.float32,
) -> PagedKVCache:
    """A float32 model's pool, its K/V stored in `dtype` (`--kv-cache-dtype`)."""
    spec = KVCacheSpec.from_model_config(config, dtype, block_size)
    return PagedKVCache(dataclasses.replace(spec, compute_dtype=torch.float32), num_blocks)


class BlockPool:
    """Test stand-in for the block manager: hands out block ids in a shuffled order."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def reference_logits(ref: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([tokens])).logits[0]  # [L, vocab]


def run_step(
    model: PreTrainedModel,
    cache: PagedKVCache,
    entries: list[tuple[list[int], int, int, list[int]]],
) -> list[torch.Tensor]:
    """entries[i] = (all tokens, start, num_new, block_table); returns each entry's [n, vocab]
    logits for its new tokens, from one packed forward."""
    meta = AttentionMetadata.build([(s, n, t) for _, s, n, t in entries], cache)
    ids = torch.tensor([tok for toks, s, n, _ in entries for tok in toks[s : s + n]])
    with torch.inference_mode():
        out = model(
            input_ids=ids[None],
            position_ids=meta.positions[None],
            use_cache=False,
            attn_metadata=meta,
            kv_cache=cache,
        )
    return list(out.logits[0].split([n for _, _, n, _ in entries]))


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_prefill_of_three_sequences_matches_each_alone(family: str) -> None:
    """Three full prefills from position 0 packed in one step equal three solo forwards."""
    ref, paged = make_models(family)
    cache, pool = make_cache(paged.config), BlockPool(64)
    seqs = [rand_tokens(n, seed=n) for n in (5, 11, 17)]
    entries = [(s, 0, len(s), pool.take(-(-len(s) // 4))) for s in seqs]
    for got, toks in zip(run_step(paged, cache, entries), seqs, strict=True):
        assert_close(got, reference_logits(ref, toks))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_then_decode_matches_one_shot(family: str) -> None:
    """Chunks of 5, 7 and the rest, then decodes, give the one-shot forward's logits."""
    ref, paged = make_models(family)
    cache, pool = make_cache(paged.config), BlockPool(64)
    toks = rand_tokens(24, seed=1)  # prompt 20, then 4 decoded tokens
    want = reference_logits(ref, toks)
    table = pool.take(6)
    done = 0
    for n in (5, 7, 8, 1, 1, 1, 1):
        (got,) = run_step(paged, cache, [(toks, done, n, table)])
        assert_close(got, want[done : done + n])
        done += n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode_kernel", [None, "native"])
def test_a_16_bit_pool_gives_every_path_the_same_rounded_keys(dtype, decode_kernel) -> None:
    """K/V stored in 16 bits are rounded once, as written: a prompt's first chunk, which attends
    its fresh K/V without reading them back, sees the rounded values too, so a prompt prefilled
    in one chunk and the same prompt in three (the later chunks reading the pool) give the same
    logits to float32 rounding, and so do the decodes after, gathered or in place. Both stay
    close to the float32 model's, and the pool holds half the bytes."""
    if decode_kernel == "native" and native_decode.unavailable_because(
        torch.device("cpu"), dtype, 16, torch.float32
    ):
        pytest.skip("the native decode kernel is not built here")
    ref, paged = make_models("llama")
    toks = rand_tokens(24, seed=3)  # prompt 20, then 4 decoded tokens
    want = reference_logits(ref, toks)
    runs = []
    for chunks in ((20, 1, 1, 1, 1), (5, 7, 8, 1, 1, 1, 1)):
        cache = make_cache(paged.config, dtype=dtype)
        cache.decode_kernel = decode_kernel
        table, done, logits = BlockPool(64).take(6), 0, []
        for n in chunks:
            (got,) = run_step(paged, cache, [(toks, done, n, table)])
            logits.append(got)
            done += n
        runs.append(torch.cat(logits))
    assert cache.spec.bytes_per_block * 2 == make_cache(paged.config).spec.bytes_per_block
    # Not bit for bit: chunks of other lengths project K/V with other matmul shapes, whose
    # float32 sums can round differently, and now and then that moves a value across a
    # bfloat16 rounding boundary (1.6e-5 in the logits on a Zen 3; under 1e-5 on a Xeon). A
    # first chunk attending unrounded K/V differs by 6e-4.
    assert (runs[0] - runs[1]).abs().max().item() < TOL
    assert (runs[1] - want).abs().max().item() < 5e-2


@pytest.mark.parametrize("gqa", ["enable_gqa", "repeated"])
def test_mixed_step_with_interleaved_blocks_matches_each_alone(gqa: str, monkeypatch) -> None:
    """Two decodes, a new prefill and a continuing chunk in one step over shuffled blocks; the
    chunks' K/V given to SDPA once per KV head (the CPU's way) or repeated per query head (what
    CUDA takes for masked or float32 chunks: sdpa_takes_gqa)."""
    if gqa == "repeated":
        monkeypatch.setattr(paged_attention, "sdpa_takes_gqa", lambda query, mask: False)
    ref, paged = make_models("llama")
    cache, pool = make_cache(paged.config, block_size=4), BlockPool(64, seed=3)
    a, b, c, d = (rand_tokens(n, seed=10 + n) for n in (10, 7, 10, 14))
    tables: dict[str, list[int]] = {"a": [], "b": [], "c": [], "d": []}
    for _ in range(4):  # round-robin: every table is non-contiguous and interleaved
        for name in tables:
            tables[name] += pool.take(1)
    # Earlier step: prompts of a and b (all but the last token), first 6 tokens of d.
    run_step(paged, cache, [(a, 0, 9, tables["a"]), (b, 0, 6, tables["b"]), (d, 0, 6, tables["d"])])
    entries = [
        (a, 9, 1, tables["a"]),  # decode
        (c, 0, 10, tables["c"]),  # new prefill
        (b, 6, 1, tables["b"]),  # decode (decode rows are not contiguous)
        (d, 6, 8, tables["d"]),  # continuing chunk after a cached prefix
    ]
    for got, (toks, start, n, _) in zip(run_step(paged, cache, entries), entries, strict=True):
        assert_close(got, reference_logits(ref, toks)[start : start + n])


def test_group_decodes_splits_where_padding_would_cost_more_than_a_group() -> None:
    assert group_decodes([]) == []
    assert group_decodes([7, 7, 7], cost=0) == [[0, 1, 2]]  # equal lengths never pad
    # In length order: 5, 30 (pads 25), then 300 would pad both by 270 each > 512: new group.
    assert group_decodes([300, 5, 500, 30], cost=512) == [[1, 3], [0, 2]]
    assert group_decodes([1, 2, 3], cost=0) == [[0], [1], [2]]


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("mistral", {"sliding_window": 64})],
    ids=["full", "sliding-window"],
)
def test_decodes_of_very_different_lengths_match_each_alone(family, overrides, monkeypatch) -> None:
    """Decode sequences of contexts 5..500 form several groups (each padded to its own longest
    context, with masks where lengths differ): logits still equal each sequence alone."""
    monkeypatch.setattr(step_inputs, "DECODE_GROUP_COST_TOKENS", 512)
    ref, paged = make_models(family, **overrides)
    cache, pool = make_cache(paged.config, block_size=4, num_blocks=256), BlockPool(256, seed=5)
    lengths = [300, 5, 500, 30, 29]
    seqs = [rand_tokens(n, seed=40 + n) for n in lengths]
    tables = [pool.take(-(-n // 4)) for n in lengths]
    for toks, table in zip(seqs, tables, strict=True):  # the prompts, but for their last token
        run_step(paged, cache, [(toks, 0, len(toks) - 1, table)])
    entries = [(toks, len(toks) - 1, 1, table) for toks, table in zip(seqs, tables, strict=True)]
    meta = AttentionMetadata.build([(s, n, t) for _, s, n, t in entries], cache)
    assert len(meta.decodes) == 2
    for got, (toks, start, n, _) in zip(run_step(paged, cache, entries), entries, strict=True):
        assert_close(got, reference_logits(ref, toks)[start : start + n])


def test_prefix_sharing_reuses_kv_written_by_another_sequence() -> None:
    """A sequence whose table shares a prefix's blocks starts at the prefix length, exactly."""
    ref, paged = make_models("llama")
    cache, pool = make_cache(paged.config, block_size=4), BlockPool(64, seed=5)
    prefix = rand_tokens(8, seed=7)  # two full blocks
    first, second = prefix + rand_tokens(5, seed=8), prefix + rand_tokens(6, seed=9)
    t1 = pool.take(4)
    t2 = t1[:2] + pool.take(2)
    run_step(paged, cache, [(first, 0, 12, t1)])
    # second computes only positions [8, 14) while first decodes, both reading the shared blocks.
    got_first, got_second = run_step(paged, cache, [(first, 12, 1, t1), (second, 8, 6, t2)])
    assert_close(got_first, reference_logits(ref, first)[12:])
    assert_close(got_second, reference_logits(ref, second)[8:])


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("mistral", {"sliding_window": 6}),
        # layer 0 full attention, layer 1 sliding: windows differ per layer in one step.
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ],
)
@pytest.mark.parametrize("gqa", ["enable_gqa", "repeated"])
def test_sliding_window_matches_reference(
    family: str, overrides: dict[str, object], gqa: str, monkeypatch
) -> None:
    """Sliding-window layers see only the last `window` positions, in chunks and decodes (the
    chunks' K/V once per KV head, or repeated per query head as CUDA takes masked chunks)."""
    if gqa == "repeated":
        monkeypatch.setattr(paged_attention, "sdpa_takes_gqa", lambda query, mask: False)
    ref, paged = make_models(family, **overrides)
    cache, pool = make_cache(paged.config), BlockPool(64, seed=2)
    long_seq, short_seq = rand_tokens(20, seed=3), rand_tokens(9, seed=4)
    t_long, t_short = pool.take(5), pool.take(3)
    want_long, want_short = reference_logits(ref, long_seq), reference_logits(ref, short_seq)
    got = run_step(paged, cache, [(long_seq, 0, 11, t_long), (short_seq, 0, 8, t_short)])
    assert_close(got[0], want_long[:11])
    assert_close(got[1], want_short[:8])
    got = run_step(paged, cache, [(short_seq, 8, 1, t_short), (long_seq, 11, 9, t_long)])
    assert_close(got[0], want_short[8:])
    assert_close(got[1], want_long[11:])


def test_model_forward_returns_logits_of_sampling_rows_only() -> None:
    """model_forward projects only the last token of sequences that sample."""
    ref, paged = make_models("llama")
    cache, pool = make_cache(paged.config), BlockPool(64)
    seqs = [rand_tokens(n, seed=20 + n) for n in (6, 3, 9)]
    tables = [pool.take(3) for _ in seqs]
    meta = AttentionMetadata.build(
        [(0, len(s), t) for s, t in zip(seqs, tables, strict=True)],
        cache,
        sample=[True, False, True],
    )
    logits = model_forward(paged, torch.tensor([t for s in seqs for t in s]), None, meta, cache)
    assert logits.shape == (2, 512)
    assert_close(logits[0], reference_logits(ref, seqs[0])[-1])
    assert_close(logits[1], reference_logits(ref, seqs[2])[-1])


def test_model_builds_no_mask_for_the_packed_row() -> None:
    """transformers hands the attention attention_mask=None: no T x T mask is ever built."""
    _, paged = make_models("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    x = torch.zeros(1, 5, paged.config.hidden_size)
    packed_positions = torch.tensor([[0, 1, 2, 7, 3]])
    for make_mask in (create_causal_mask, create_sliding_window_causal_mask):
        # config, inputs_embeds, attention_mask, cache (named past_key_values up to 5.17)
        mask = make_mask(paged.config, x, None, None, position_ids=packed_positions)
        assert mask is None


def test_build_rejects_block_table_too_short() -> None:
    """A table that cannot hold start + num_new tokens is a caller bug, reported at build."""
    with pytest.raises(ValueError, match="do not fit"):
        AttentionMetadata.build([(6, 3, [0, 1])], make_cache(LlamaConfig(**TINY), block_size=4))


def test_attention_without_metadata_raises() -> None:
    """Calling a paged model without attn_metadata/kv_cache fails loudly, not silently."""
    _, paged = make_models("llama")
    with pytest.raises(TypeError, match="attn_metadata"), torch.no_grad():
        paged(input_ids=torch.tensor([[1, 2, 3]]))


def test_pool_allocation_stays_within_budget() -> None:
    """The pool sized from a budget allocates at most that many bytes, in whole blocks."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=4)
    assert spec.bytes_per_block == 2 * 2 * 2 * 16 * 4 * 4  # K+V x layers x heads x dim x fp32 x 4
    budget = 10 * spec.bytes_per_block + spec.bytes_per_block - 1
    cache = PagedKVCache.from_budget(spec, budget)
    assert cache.num_blocks == 10
    assert cache.allocated_bytes == 10 * spec.bytes_per_block <= budget
    assert cache.key_cache[1].shape == (10, 4, 2, 16)
    with pytest.raises(ValueError, match="below one block"):
        PagedKVCache.from_budget(spec, spec.bytes_per_block - 1)


def test_a_float16_pool_saturates_what_it_cannot_hold() -> None:
    """Python's writes and a first chunk's fresh K/V hold a float16 pool's values within its
    range, as the C++ write does: 65,504, not inf (whose scores would be NaN)."""
    spec = KVCacheSpec(1, 1, 4, torch.float16, 2, compute_dtype=torch.float32)
    cache = PagedKVCache(spec, 2)
    big = torch.tensor([[[1e6, -1e6, 1.0, float("nan")]]])
    cache.write(0, torch.tensor([3]), big, -big)
    want = torch.tensor([65504.0, -65504.0, 1.0, float("nan")])
    torch.testing.assert_close(cache.key_slots[0][3, 0].float(), want, equal_nan=True)
    torch.testing.assert_close(cache.as_read(big)[0, 0], want, equal_nan=True)
    bf16 = PagedKVCache(dataclasses.replace(spec, dtype=torch.bfloat16), 2)
    assert bf16.as_read(big)[0, 0, 0].item() == torch.tensor(1e6).bfloat16().item()


def test_num_blocks_for_budget_math() -> None:
    """Blocks = floor(budget / (2 x layers x kv_heads x head_dim x dtype size x block_size))."""
    spec = KVCacheSpec(
        num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16
    )
    assert spec.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16 == 2 * 2**20
    assert spec.num_blocks_for_budget("2GiB") == 1024
    assert spec.num_blocks_for_budget(2 * 2**20 - 1) == 0
    assert spec.num_blocks_for_budget("1e9") == 10**9 // (2 * 2**20)


def test_parse_bytes_units() -> None:
    """Binary and decimal units, scientific notation and ints all parse; junk is rejected."""
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("lots", "-1GiB", "2 GiBs", True):
        with pytest.raises(ValueError):
            parse_bytes(bad)  # type: ignore[arg-type]


def test_sdpa_gets_kv_per_kv_head_only_where_a_fused_kernel_takes_it() -> None:
    """On CUDA, flash alone takes enable_gqa, and only half precision without a mask; anything
    else would run SDPA's math kernel, so K/V are repeated there. The CPU fuses every case."""
    mask = torch.zeros(2, 3)
    for dtype in (torch.float32, torch.bfloat16):
        assert paged_attention.sdpa_takes_gqa(torch.zeros(1, dtype=dtype), mask)
    if torch.cuda.is_available():
        half = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
        assert paged_attention.sdpa_takes_gqa(half, None)
        assert not paged_attention.sdpa_takes_gqa(half, mask.cuda())
        assert not paged_attention.sdpa_takes_gqa(half.float(), None)
