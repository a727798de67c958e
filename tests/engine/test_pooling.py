"""Embeddings (pooling requests) through the engine: the vectors are transformers' own final
hidden states pooled the same way, however the prompts were chunked, batched, cached, preempted
or batched statically; and pooling requests keep the scheduler's priorities."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import RequestRejected, RequestTooLongError
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel, load_model
from engine.outputs import RequestOutput
from engine.pooling import normalize
from generation import SamplingParams
from tests.engine.engine_helpers import chat, make_engine

TOL = 1e-5
EMBED = SamplingParams()  # not read for a pooling request
rng = random.Random(11)
PROMPTS = [[rng.randrange(3, 280) for _ in range(n)] for n in (5, 23, 40, 1)]


def reference(ref: LoadedModel, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' hidden states of the last layer (for Llama: after the final norm), pooled
    and L2-normalised."""
    with torch.no_grad():
        out = ref.model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()
    return normalize(hidden[-1] if pooling == "last" else hidden.mean(dim=0))


def run(engine: Engine) -> dict[str, RequestOutput]:
    """Every request to its end; each one's final output, by request id."""
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_the_reference_s_last_hidden_state_is_after_the_final_norm(ref):
    """What the comparisons below rely on: transformers' last entry of hidden_states is the
    decoder's output, after model.norm."""
    with torch.no_grad():
        out = ref.model(torch.tensor([PROMPTS[1]]), output_hidden_states=True)
        base = ref.model.model(torch.tensor([PROMPTS[1]])).last_hidden_state
    torch.testing.assert_close(out.hidden_states[-1], base)


@pytest.mark.parametrize("impl", ["jitney", "transformers"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_match_transformers_in_chunks_and_batches(loaded, ref, pooling, impl):
    """Four prompts (1 to 40 tokens) batched and prefilled in chunks of 16 beside each other."""
    engine = make_engine(
        loaded, pooling=pooling, model_impl=impl, block_size=4, max_num_batched_tokens=16
    )
    vectors = engine.embed(PROMPTS)
    for prompt, got in zip(PROMPTS, vectors, strict=True):
        assert got.shape == (loaded.model.config.hidden_size,) and got.dtype == torch.float32
        torch.testing.assert_close(got, reference(ref, prompt, pooling), atol=TOL, rtol=0)
        assert float(got.norm()) == pytest.approx(1.0, abs=1e-6)
    raw = engine.embed(PROMPTS[:1], normalized=False)[0]
    torch.testing.assert_close(normalize(raw), vectors[0], atol=1e-6, rtol=0)
    assert engine.view.kv_used_blocks == 0 and not engine.pooler.by_seq


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_the_fused_quantized_forward_pools_too(loaded, ref, pooling):
    """--quantization int8 (the jitney:: layer ops, Q8_0 weights): the vectors stay within
    quantization's distance of the dense reference (cosine > 0.9995)."""
    engine = make_engine(loaded, quantization="int8", pooling=pooling, max_num_batched_tokens=16)
    for prompt, got in zip(PROMPTS, engine.embed(PROMPTS), strict=True):
        assert float(got @ reference(ref, prompt, pooling)) > 0.9995


def test_smollm2_vectors_match_transformers():
    """The bundled model, last and mean pooling, two chat prompts in chunks of 16: the exact
    mode (`--quantization none`) gives transformers' vectors; the default, the file's own 4-bit
    blocks, vectors pointing the same way (cosine above 0.999)."""
    loaded, ref = load_model("smollm2-135m"), load_model("smollm2-135m")
    prompts = [chat(loaded, "What is the capital of France?"), chat(loaded, "Name three colors.")]
    for pooling in ("last", "mean"):
        exact, blocks = (
            make_engine(
                loaded,
                pooling=pooling,
                kv_cache_memory="64MiB",
                max_num_batched_tokens=16,
                quantization=quantization,
            )
            for quantization in ("none", "auto")
        )
        assert blocks.view.forward_name == "jitney-gguf"
        for prompt, got, near in zip(
            prompts, exact.embed(prompts), blocks.embed(prompts), strict=True
        ):
            want = reference(ref, prompt, pooling)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert torch.nn.functional.cosine_similarity(near, want, dim=0) > 0.999


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prefix_cache_serves_last_pooling_only(loaded, pooling):
    """The same prompt again: last pooling takes the cached blocks (only its last token is
    needed); mean pooling computes every token. The vectors do not change."""
    engine = make_engine(loaded, pooling=pooling, block_size=4)
    prompt = PROMPTS[2]
    first = engine.embed([prompt])[0]
    engine.add_request("again", prompt, EMBED, embed=True)
    final = run(engine)["again"]
    cached = final.num_cached_tokens
    assert cached == (36 if pooling == "last" else 0)
    torch.testing.assert_close(normalize(final.embedding), first, atol=1e-6, rtol=0)


def test_a_preempted_mean_pooling_request_is_recomputed_and_not_summed_twice(loaded):
    """A priority-5 pooling request two chunks into its prompt loses its only seat to an urgent
    generation, which finishes first; the pooling request starts again from position 0 and its
    vector is the one it gets alone."""
    engine = make_engine(loaded, pooling="mean", max_num_seqs=1, max_num_batched_tokens=8)
    prompt = PROMPTS[2]
    alone = engine.embed([prompt])[0]
    engine.add_request("embed", prompt, EMBED, priority=5, embed=True)
    engine.step()
    engine.step()
    urgent = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("urgent", [7, 8, 9], urgent, priority=-5)
    finals = run(engine)
    assert list(finals) == ["urgent", "embed"]
    assert engine.stats.num_preemptions_total == 1
    torch.testing.assert_close(normalize(finals["embed"].embedding), alone, atol=1e-6, rtol=0)


def test_an_urgent_embedding_is_not_starved_by_running_generation(loaded):
    """Both seats hold long priority-9 generations: a priority-0 embedding takes a seat at once
    (preempting one) and ends within a few steps, while they run on."""
    engine = make_engine(loaded, max_num_seqs=2)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"gen{i}", PROMPTS[0], long, priority=9)
    for _ in range(3):
        engine.step()
    engine.add_request("embed", PROMPTS[1], EMBED, priority=0, embed=True)
    outputs = engine.step() + engine.step()
    [final] = [out for out in outputs if out.request_id == "embed"]
    assert final.finished and final.finish_reason == "stop" and final.embedding is not None
    assert final.new_token_ids == [] and final.num_output_tokens == 0
    assert final.num_prompt_tokens == len(PROMPTS[1])
    assert engine.stats.num_preemptions_total == 1
    assert {out.request_id for out in outputs} >= {"gen0", "embed"}  # gen0 kept decoding


def test_a_flood_of_embeddings_does_not_starve_urgent_generation(loaded):
    """Twenty priority-5 embeddings queue behind two seats; a priority-0 generation that
    arrives after them is admitted at the next step and finishes before most of them."""
    engine = make_engine(loaded, max_num_seqs=2, max_num_batched_tokens=16)
    for i in range(20):
        engine.add_request(f"e{i}", PROMPTS[2], EMBED, priority=5, embed=True)
    engine.step()
    engine.add_request("gen", [7, 8, 9], SamplingParams(max_tokens=4, temperature=0), priority=0)
    order = list(run(engine))
    assert order.index("gen") < 4, order
    assert len(order) == 21


def test_static_batching_holds_the_vector_until_the_batch_ends(loaded):
    """In a static batch a pooling request finishes early but is released with the batch: no
    output before its final, which carries the vector (never the token that ended it)."""
    engine = make_engine(loaded, batching="static", max_num_seqs=2)
    engine.add_request("gen", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0))
    engine.add_request("embed", PROMPTS[1], EMBED, embed=True)
    engine.flush()
    seen = []
    while engine.has_unfinished():
        seen += [out for out in engine.step() if out.request_id == "embed"]
    [final] = seen
    assert final.finished and final.embedding is not None and final.new_token_ids == []
    want = make_engine(loaded).embed([PROMPTS[1]])[0]
    torch.testing.assert_close(normalize(final.embedding), want, atol=1e-6, rtol=0)


def test_abort_mid_prompt_ends_without_a_vector(loaded):
    engine = make_engine(loaded, pooling="mean", max_num_batched_tokens=8)
    engine.add_request("embed", PROMPTS[2], EMBED, embed=True)
    engine.step()
    [final] = engine.abort("embed")
    assert final.finish_reason == "abort" and final.embedding is None
    assert not engine.has_unfinished() and not engine.pooler.by_seq
    engine.block_manager.check_integrity()


def test_the_prompt_alone_must_fit_and_noop_serves_no_embeddings(loaded):
    """A pooling request computes no token: a prompt as long as the context window fits."""
    engine = make_engine(loaded, max_model_len=32)
    engine.add_request("fits", list(range(3, 35)), EMBED, embed=True)
    with pytest.raises(RequestTooLongError, match=r"prompt \(33 tokens\) exceeds"):
        engine.add_request("long", list(range(3, 36)), EMBED, embed=True)
    assert run(engine)["fits"].embedding is not None
    noop = Engine(EngineConfig(model="noop", kv_cache_memory="16MiB"))
    assert noop.embedding_size == 0 and engine.embedding_size == 64
    with pytest.raises(RequestRejected, match="no embeddings"):
        noop.add_request("e", [5, 6], EMBED, embed=True)


def test_pooling_flag_is_checked():
    with pytest.raises(ValueError, match="pooling"):
        EngineConfig(pooling="cls")
