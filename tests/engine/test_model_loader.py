"""Model loading: built-in tiny and SmolLM2 models, local Hugging Face directories, GGUF caching."""

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.models.gguf_model import gguf_cache_key
from engine.models.model_loader import LoadedModel, load_model
from tests.gguf_files import write_gguf

PROMPT_IDS = torch.tensor([[1, 40, 41, 42, 100, 200, 2]])


def logits_of(loaded: LoadedModel, input_ids: torch.Tensor = PROMPT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(input_ids.to(loaded.model.device)).logits.float().cpu()


def greedy_reply(loaded: LoadedModel, question: str, max_new_tokens: int = 20) -> str:
    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": question}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = loaded.model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=loaded.eos_token_ids
    )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_tiny_random_has_expected_shape_and_eos():
    """tiny-random is a GQA Llama in eval mode with ChatML end-of-turn tokens as eos."""
    loaded = load_model("tiny-random")
    tokenizer = loaded.tokenizer

    assert loaded.name == "tiny-random"
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (2, 2, 16)
    assert loaded.model.config.num_attention_heads == 4
    assert loaded.max_model_len == 2048
    assert loaded.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert loaded.model.config.vocab_size == len(tokenizer)
    end_ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert sorted(loaded.eos_token_ids) == sorted(end_ids)
    assert tokenizer.eos_token_id in loaded.eos_token_ids


def test_tiny_random_is_deterministic_and_keeps_callers_rng():
    """Two loads give identical weights, and loading does not consume the global torch RNG."""
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = load_model("tiny-random").model.state_dict()
    assert torch.equal(torch.rand(3), expected_draw)

    second = load_model("tiny-random").model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_tiny_random_tokenizer_round_trips_utf8():
    """Byte-level BPE decodes back to exactly the text it encoded, multibyte characters included."""
    tokenizer = load_model("tiny-random").tokenizer
    for text in ["héllo wörld 日本 🚀", "What is the capital of France?", "  tabs\tand\nnewlines "]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("the the the", add_special_tokens=False)) < len("the the the")


def test_tiny_random_chat_template_ends_with_generation_prompt():
    """The ChatML template renders each turn and ends with the assistant header."""
    tokenizer = load_model("tiny-random").tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tiny_random_greedy_output_is_not_one_repeated_token():
    """Random weights still give varied greedy tokens, so decode tests can tell steps apart."""
    loaded = load_model("tiny-random")
    inputs = loaded.tokenizer("What is the capital of France?", return_tensors="pt")
    output = loaded.model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
    new_ids = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(set(new_ids)) > 2


def test_dtype_defaults_to_float32_on_cpu_and_can_be_overridden():
    """CPU loads default to float32; an explicit dtype is honoured."""
    loaded = load_model("tiny-random", dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert logits_of(loaded).isfinite().all()


def test_attention_implementation_can_be_swapped_after_load():
    """A registered attention function can replace the default and sees every layer's call."""
    layer_calls: list[int] = []

    def counting_sdpa(module, query, key, value, attention_mask, **kwargs):
        layer_calls.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("jitney-test-counting", counting_sdpa)
    loaded = load_model("tiny-random")
    expected = logits_of(loaded)
    loaded.model.set_attn_implementation("jitney-test-counting")
    torch.testing.assert_close(logits_of(loaded), expected)
    assert layer_calls == [0, 1]


def test_progress_reports_each_stage():
    """progress receives the stage lines, ending with the ready line naming model and device."""
    messages: list[str] = []
    load_model("tiny-random", progress=messages.append)
    assert messages[-1].startswith("model ready: tiny-random on cpu torch.float32")


def test_unknown_spec_raises_with_builtin_names(tmp_path: Path):
    """An unknown name or a path that is not a model fails fast, listing the built-in names."""
    for spec in ["no-such-model", str(tmp_path)]:
        with pytest.raises(ValueError, match="tiny-random") as error:
            load_model(spec)
        assert "smollm2-135m" in str(error.value)


def test_local_hf_directory_loads_with_same_logits(tmp_path: Path):
    """A save_pretrained directory loads by path and computes the same logits."""
    original = load_model("tiny-random")
    model_dir = tmp_path / "my-tiny"
    original.model.save_pretrained(model_dir)
    original.tokenizer.save_pretrained(model_dir)

    loaded = load_model(str(model_dir))

    assert loaded.name == "my-tiny"
    assert sorted(loaded.eos_token_ids) == sorted(original.eos_token_ids)
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (2, 2, 16)
    assert loaded.tokenizer.chat_template == original.tokenizer.chat_template
    assert loaded.tokenizer.encode("héllo 🚀") == original.tokenizer.encode("héllo 🚀")
    torch.testing.assert_close(logits_of(loaded), logits_of(original), rtol=0, atol=0)


def test_a_gguf_s_dense_model_reads_its_converted_cache(tmp_path: Path):
    """A .gguf path loads without its dense model; the exact mode's, built on first use, comes
    from the converted cache (keyed by name, size and mtime), and a filled cache skips the
    conversion."""
    tiny = load_model("tiny-random")
    gguf_path = write_gguf(
        tmp_path / "some-model.Q8_0.gguf", tiny.model, "llama", matrices=GGMLQuantizationType.Q8_0
    )
    cache_dir = tmp_path / "cache"
    converted = cache_dir / gguf_cache_key(gguf_path)
    tiny.model.save_pretrained(converted)  # not the file's dequantized weights: the cache's
    tiny.tokenizer.save_pretrained(converted)

    messages: list[str] = []
    loaded = load_model(str(gguf_path), cache_dir=cache_dir, progress=messages.append)
    assert loaded.name == "some-model.Q8_0" and loaded.built_model is None
    logits = logits_of(loaded)

    assert any(m.startswith("using converted cache") for m in messages)
    assert not any("converting" in m for m in messages)
    torch.testing.assert_close(logits, logits_of(tiny), rtol=0, atol=0)
    gguf_path.write_bytes(gguf_path.read_bytes() + bytes(32))
    assert gguf_cache_key(gguf_path) != converted.name


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M read from its GGUF; its dense model (`.model`) from the default cache:
    converted once (~40 s), then ~0.3 s per load."""
    return load_model("smollm2-135m")


def test_smollm2_loads_with_chat_template_and_shape(smollm2: LoadedModel):
    """SmolLM2-135M-Instruct comes with ChatML, a 49152-token vocab and its real shape, all
    read from the file's metadata."""
    tokenizer = smollm2.tokenizer
    assert len(tokenizer) == 49152
    assert smollm2.config.vocab_size == smollm2.vocab_size == 49152
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (smollm2.num_layers, smollm2.num_kv_heads, smollm2.head_dim) == (30, 3, 64)
    assert smollm2.max_model_len == 8192
    assert smollm2.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    text = "héllo wörld 日本 🚀"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_smollm2_answers_capital_of_france(smollm2: LoadedModel):
    """Greedy decoding of a chat prompt gives a sensible answer, so the weights survived."""
    assert "Paris" in greedy_reply(smollm2, "What is the capital of France?")


def test_smollm2_second_load_reads_cache(smollm2: LoadedModel):
    """Once converted, SmolLM2's dense model loads from safetensors in the cache instead of
    converting again."""
    logits_of(smollm2)  # converted, if no earlier run did
    messages: list[str] = []
    again = load_model("smollm2-135m", progress=messages.append)
    logits = logits_of(again)

    assert not any("converting" in m for m in messages)
    [used] = [m for m in messages if m.startswith("using converted cache")]
    cache = Path(used.removeprefix("using converted cache "))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in cache.iterdir()
    }
    assert not list(cache.parent.glob(".smollm2-135m.*"))  # no temp dir left behind
    torch.testing.assert_close(logits, logits_of(smollm2), rtol=0, atol=0)
