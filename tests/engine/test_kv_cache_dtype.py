"""`--kv-cache-dtype`: a float32 model's K/V stored in bfloat16 or float16. The pool holds twice
the tokens of the same budget, decode tokens still attend in place, greedy replies stay within
the near-tie rule of the float32 pool's, and bad values are refused by name."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import kernel_backend
from engine.models.model_loader import LoadedModel
from generation.sampling_params import SamplingParams
from jitney.cli import build_parser
from jitney.commands.engine_args import engine_args_to_argv, engine_config_from_args
from tests.engine.engine_helpers import assert_teacher_forced, make_engine

PROMPT = list(range(3, 60))


def _greedy(loaded: LoadedModel, **config: object) -> list[int]:
    engine = make_engine(loaded, kv_cache_memory="16MiB", speculative="none", **config)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return list(engine.generate([PROMPT], [params])[0].token_ids)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_pool_holds_twice_the_tokens_and_decodes_in_place(loaded: LoadedModel, dtype):
    wide = make_engine(loaded, kv_cache_memory="16MiB")
    narrow = make_engine(loaded, kv_cache_memory="16MiB", kv_cache_dtype=dtype)
    assert wide.kv_cache.spec.dtype == torch.float32
    assert narrow.kv_cache.spec.dtype == getattr(torch, dtype)
    assert narrow.kv_cache.spec.attention_dtype == torch.float32  # the model's
    assert narrow.capacity.num_blocks in (
        2 * wide.capacity.num_blocks,
        2 * wide.capacity.num_blocks + 1,
    )
    assert narrow.kv_cache.allocated_bytes <= 16 * 2**20 + narrow.kv_cache.spec.bytes_per_block
    if kernel_backend().is_native:
        assert narrow.kv_cache.decode_kernel == "native"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("decode_attention", ["auto", "gather"])
def test_greedy_on_a_16_bit_pool_follows_the_model(
    loaded: LoadedModel, ref: LoadedModel, dtype, decode_attention
):
    """Each token is the float32 model's argmax after the tokens before it, or within the
    near-tie rule of it: rounding K/V to 16 bits moves logits by far less than a token's lead."""
    got = _greedy(loaded, kv_cache_dtype=dtype, decode_attention=decode_attention)
    assert len(got) == 24
    assert_teacher_forced(ref, PROMPT, got)


def test_kv_cache_dtype_is_validated_and_reaches_the_workers():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        build_parser(["worker"]).parse_args(["worker", "--kv-cache-dtype", "int8"])
    args = build_parser(["up"]).parse_args(["up", "--kv-cache-dtype", "float16"])
    assert engine_config_from_args(args).kv_cache_dtype == "float16"
    argv = engine_args_to_argv(args)  # `jitney up` starts its workers with the same pool
    assert argv[argv.index("--kv-cache-dtype") + 1] == "float16"
    assert EngineConfig().kv_cache_dtype == "auto"
