"""A GGUF read straight from its file (engine/models/gguf_model.py, gguf_config.py,
gguf_weights.py): files written here as llama.cpp's converter writes them (tests/gguf_files.py).

A Llama-family file with Q8_0 and Q4_0 blocks loads and generates with no converted checkpoint
and no transformers model, greedy tokens as the converted checkpoint's path gives them; it pools;
the exact mode builds its dense model on demand; an architecture no Jitney forward covers still
runs through transformers. Gemma 3, Phi-3 and SmolLM3 files map back to their transformers
models' own tensors and configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.gguf_config import (
    CONFIG_ARRAYS,
    FAMILY_DEFAULTS,
    UndescribedGGUFError,
    family_config_class,
    gguf_config,
    gguf_config_fields,
)
from engine.models.gguf_index import read_gguf_index
from engine.models.gguf_model import TOKENIZER_CACHE, converted_gguf, gguf_cache_key
from engine.models.gguf_weights import read_gguf_tensors
from engine.models.loaded_model import describe_loaded
from engine.models.model_loader import load_model
from engine.models.tiny_model import CHATML_TEMPLATE
from generation import SamplingParams
from tests.gguf_files import BASE_SPECIALS, tiny_vocabulary, write_gguf
from tests.model_dirs import TWO_LAYER_LLAMA

VOCAB = len(tiny_vocabulary()["tokens"])
SMALL = dict(
    vocab_size=VOCAB,
    **TWO_LAYER_LLAMA,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Q4_0 and Q8_0 side by side: each fused projection's parts share one type (the kernels').
BLOCKS = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_memory="8MiB", speculative="none", max_model_len=128)


def random_model(model_type: str, seed: int = 0, **config: object) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory) -> Path:
    model = random_model("llama", **SMALL, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_0.gguf"
    return write_gguf(path, model, "llama", matrices=BLOCKS, chat_template=CHATML_TEMPLATE)


@pytest.fixture
def built_models(monkeypatch) -> list[str]:
    """The class of every transformers model built while the test runs."""
    built: list[str] = []
    init = transformers.PreTrainedModel.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", counting)
    return built


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


def test_a_llama_gguf_loads_and_generates_from_the_file_alone(llama_file, tmp_path, built_models):
    """No transformers model is built and no converted checkpoint written: the config,
    tokenizer and template come from the metadata, the weights stay in their blocks."""
    cache = tmp_path / "cache"
    engine = Engine(EngineConfig.from_flat(model=str(llama_file), cache_dir=str(cache), **ENGINE))
    loaded = engine.loaded
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    [result] = engine.generate([prompt], GREEDY)

    assert engine.startup.forward_name == "jitney-gguf"
    assert len(result.token_ids) == GREEDY.max_tokens
    assert built_models == [] and loaded.built_model is None
    assert entries(cache) == {TOKENIZER_CACHE}  # the tokenizer's entry, no converted model
    config = loaded.config
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == (
        "llama",
        2,
        2,
    )
    assert (loaded.vocab_size, loaded.head_dim, loaded.max_model_len) == (VOCAB, 16, 256)
    assert loaded.tokenizer.chat_template == CHATML_TEMPLATE
    assert loaded.eos_token_ids == [2]
    assert loaded.gguf_path == llama_file


def test_greedy_tokens_are_the_converted_checkpoint_path_s(llama_file, tmp_path):
    """The same forward on the same blocks, built from the metadata's config or from the
    config transformers converted the file with (the path every GGUF took before)."""
    cache = tmp_path / "cache"
    direct = Engine(EngineConfig.from_flat(model=str(llama_file), cache_dir=str(cache), **ENGINE))
    model_dir = converted_gguf(llama_file, tmp_path / "converted", print, None)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    converted = describe_loaded(
        model, AutoTokenizer.from_pretrained(model_dir), "converted", llama_file
    )
    before = Engine(EngineConfig.from_flat(model="converted", **ENGINE), loaded=converted)
    prompts = [[1, 40, 41, 42, 100, 200], [5, 6, 7, 8, 9, 10, 11, 12, 13]]

    assert before.startup.forward_name == direct.startup.forward_name == "jitney-gguf"
    got = [r.token_ids for r in direct.generate(prompts, GREEDY)]
    assert got == [r.token_ids for r in before.generate(prompts, GREEDY)]
    text = "héllo wörld 🚀 <|im_start|>user"
    assert direct.loaded.tokenizer.encode(text) == converted.tokenizer.encode(text)


def test_a_pooling_request_on_the_file_s_blocks(llama_file, tmp_path, built_models):
    """Embeddings come from the same forward: the hidden size is the metadata's, and the
    vector is the one the converted path's forward gives."""
    cache = tmp_path / "cache"
    engine = Engine(EngineConfig.from_flat(model=str(llama_file), cache_dir=str(cache), **ENGINE))
    [vector] = engine.embed([[1, 40, 41, 42, 100, 200, 2]])

    assert engine.embedding_size == 64 and vector.shape == (64,)
    assert torch.isfinite(vector).all() and abs(float(vector.norm()) - 1.0) < 1e-5
    assert built_models == [] and engine.loaded.built_model is None


def test_the_exact_mode_builds_the_dense_model_on_demand(llama_file, tmp_path):
    """`--quantization none` dequantizes the file through its converted checkpoint, once."""
    cache = tmp_path / "cache"
    messages: list[str] = []
    loaded = load_model(str(llama_file), cache_dir=cache, progress=messages.append)
    assert loaded.built_model is None and not any("convert" in m for m in messages)

    exact = EngineConfig.from_flat(model=loaded.name, quantization="none", **ENGINE)
    engine = Engine(exact, loaded=loaded)
    [result] = engine.generate([[1, 40, 41, 42]], GREEDY)

    assert engine.startup.forward_name == "jitney-none"
    assert loaded.built_model is not None and len(result.token_ids) == GREEDY.max_tokens
    assert gguf_cache_key(llama_file) in entries(cache)
    assert any(m.startswith("converting GGUF") for m in messages)
    again: list[str] = []
    load_model(str(llama_file), cache_dir=cache, progress=again.append).model  # noqa: B018
    assert any(m.startswith("using converted cache") for m in again)


def test_an_architecture_no_jitney_forward_covers_runs_through_transformers(tmp_path):
    """StarCoder2: no config is read from its metadata here; transformers converts the file
    and runs it, with its logits."""
    model = random_model("starcoder2", **SMALL)
    path = write_gguf(tmp_path / "tiny-starcoder2.gguf", model, "starcoder2")
    with pytest.raises(UndescribedGGUFError, match="'starcoder2'"):
        gguf_config(read_gguf_index(path))
    loaded = load_model(str(path), cache_dir=tmp_path / "cache")
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits)
    engine = Engine(EngineConfig.from_flat(model=loaded.name, **ENGINE), loaded=loaded)

    assert loaded.built_model is not None and engine.startup.forward_name == "transformers"
    assert len(engine.generate([[1, 40, 41, 42]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_the_tokenizer_is_built_once_and_read_from_its_cache(llama_file, tmp_path):
    """Keyed by the header's digest: a copy of the file elsewhere reads the same entry, and
    the cached tokenizer encodes as the one built from the metadata (with a BOS added)."""
    cache = tmp_path / "cache"
    model = random_model("llama", seed=1, **SMALL)
    path = write_gguf(tmp_path / "bos.gguf", model, "llama", add_bos=True)
    first: list[str] = []
    built = load_model(str(path), cache_dir=cache, progress=first.append).tokenizer
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    second: list[str] = []
    cached = load_model(str(copy), cache_dir=cache, progress=second.append).tokenizer

    assert any(m.startswith("tokenizer built") for m in first)
    assert not any(m.startswith("tokenizer built") for m in second)
    assert len(list((cache / TOKENIZER_CACHE).iterdir())) == 1
    for text in ["Hello world", "  tabs\tand\nnewlines ", "<|im_end|> héllo 🚀"]:
        assert cached.encode(text) == built.encode(text)
        assert cached.encode(text)[0] == 1  # the file says: add BOS
    assert cached.chat_template == CHATML_TEMPLATE  # ChatML's tokens, no template: ChatML


def test_a_generation_ends_at_the_turn_ends_the_vocabulary_has(tmp_path):
    """As llama.cpp: the metadata's end of text, and the chat turn ends it finds by name
    (Gemma's <end_of_turn>, Phi-3's <|end|>), which converters rarely state."""
    turn_ends = ("<end_of_turn>", "<|end|>")
    model = random_model("llama", **(SMALL | {"vocab_size": VOCAB + 2}))
    path = write_gguf(
        tmp_path / "turns.gguf", model, "llama", specials=BASE_SPECIALS, extra_tokens=turn_ends
    )
    loaded = load_model(str(path), cache_dir=tmp_path / "cache")
    assert loaded.eos_token_ids == [2, VOCAB + 1, VOCAB]  # </s>, <|end|>, <end_of_turn>


# --- the families' names and configs -----------------------------------------------------------

FAMILIES = {
    "gemma3": (
        "gemma3_text",
        dict(num_hidden_layers=7, head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
    ),
    "phi3": (
        "phi3",
        dict(
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "long_factor": [1.0, 1.5, 2.0, 4.0],
                "short_factor": [1.0, 1.25, 1.5, 2.0],
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "smollm3": ("smollm3", dict(num_hidden_layers=8)),
    "llama": ("llama", dict(tie_word_embeddings=False, attention_bias=True)),
}
# What each family's config must carry over beside the sizes.
FAMILY_FIELDS = {
    "gemma3": ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"),
    "phi3": ("original_max_position_embeddings", "sliding_window"),
    "smollm3": ("no_rope_layers",),
    "llama": ("tie_word_embeddings", "attention_bias", "rope_parameters"),
}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
SIZES += ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_family_s_file_maps_back_to_its_transformers_model(arch, tmp_path):
    """Every tensor under the transformers model's own name, equal to its value (Gemma's
    norms back from 1 + w, a Llama's and SmolLM3's Q/K rows back in order, Phi-3's fused
    projections as transformers fuses them), and the config the metadata states is the
    model's."""
    model_type, extra = FAMILIES[arch]
    model = random_model(model_type, **(SMALL | extra))
    path = write_gguf(tmp_path / f"{arch}.gguf", model, arch)
    _, tensors = read_gguf_tensors(path)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")

    assert set(tensors) == set(expected)
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor.dequantize(), expected[name], rtol=0, atol=0, msg=name)
    index = read_gguf_index(path, CONFIG_ARRAYS)
    config = gguf_config(index)
    want = model.config
    assert config.model_type == want.model_type
    # Field for field what the family's transformers class makes of the same metadata.
    model_type, fields = gguf_config_fields(index)
    assert _fields(config) == _fields(AutoConfig.for_model(model_type, **fields))
    for field in SIZES + FAMILY_FIELDS[arch]:
        assert getattr(config, field) == getattr(want, field), field
    assert config.head_dim == (getattr(want, "head_dim", None) or 16)
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    if arch == "phi3":
        rope, want_rope = config.rope_parameters, want.rope_parameters
        assert {k: rope[k] for k in ("rope_type", "partial_rotary_factor")} == {
            "rope_type": "longrope",
            "partial_rotary_factor": 0.5,
        }
        for factors in ("long_factor", "short_factor"):
            assert rope[factors] == pytest.approx(want_rope[factors])


def test_a_llama_3_file_s_rope_freqs_are_its_llama3_rope(tmp_path):
    """The converter turns Llama 3's llama3 RoPE into a `rope_freqs` tensor; it is read back as
    that RoPE (Llama 3's low/high factors and original context), or refused if it is not."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    llama3 = SMALL | {"max_position_embeddings": 16384}
    model = random_model("llama", **llama3, rope_parameters=rope)
    path = write_gguf(tmp_path / "llama3.gguf", model, "llama")
    config = gguf_config(read_gguf_index(path))
    assert config.rope_parameters == pytest.approx(rope)
    _, tensors = read_gguf_tensors(path)
    assert set(tensors) == set(model.state_dict())  # the tensor went into the config

    other = random_model("llama", **llama3, rope_parameters=rope | {"high_freq_factor": 2.0})
    odd = write_gguf(tmp_path / "odd.gguf", other, "llama")
    with pytest.raises(UndescribedGGUFError, match="not Llama 3's llama3 RoPE"):
        gguf_config(read_gguf_index(odd))


def test_gemma3_s_layer_pattern_and_rope_bases_default_as_llama_cpp_s(tmp_path):
    """A file stating no pattern: every sixth layer global; the sliding layers' RoPE base
    10,000 where the file states none; the metadata's sliding window."""
    model = random_model("gemma3_text", **(SMALL | {"num_hidden_layers": 7}), head_dim=16)
    path = write_gguf(tmp_path / "g.gguf", model, "gemma3", omit=("gemma3.rope.freq_base_swa",))
    config = gguf_config(read_gguf_index(path, CONFIG_ARRAYS))
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.sliding_window == model.config.sliding_window


def test_greedy_agreement_compares_the_file_s_blocks_with_the_exact_mode(llama_file, monkeypatch):
    """bench.greedy_agreement on a written file: the default forward (its Q8_0/Q4_0 blocks) and
    the exact mode decode every prompt, and each verdict says equal or within the near-tie rule."""
    from bench.greedy_agreement import PROMPTS, compare

    monkeypatch.setenv("JITNEY_CACHE_DIR", str(llama_file.parent / "cache"))
    report = compare(str(llama_file), 6, kv_cache_memory="8MiB", max_model_len=128)
    assert len(report["prompts"]) == len(PROMPTS)
    assert report["passed"] == len(PROMPTS), report["prompts"]
    for row in report["prompts"]:
        assert row["equal"] == (row["first_diff"] is None)


def test_the_cached_tokenizer_json_keeps_merge_pairs_only_where_a_token_has_a_space() -> None:
    """compact_tokenizer_json writes merges as "a b" strings, which tokenizers parses faster,
    unless a merged token holds a space: then "a b" would be ambiguous, and the pairs stay."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.models.gguf_model import compact_tokenizer_json

    def bpe(vocab: list[str], merges: list[tuple[str, str]]) -> Tokenizer:
        tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges))
        tokenizer.pre_tokenizer = pre_tokenizers.Split("|", "removed")
        return tokenizer

    plain = bpe(["a", "b", "c", "ab", "abc"], [("a", "b"), ("ab", "c")])
    spaced = bpe(["a", " ", "b", "a ", "a b"], [("a", " "), ("a ", "b")])
    for tokenizer, form in ((plain, str), (spaced, list)):
        text = compact_tokenizer_json(tokenizer.to_str())
        assert "\n" not in text and all(isinstance(m, form) for m in _merges(text))
        again = Tokenizer.from_str(text)
        for sample in ("abc|ab|ba", "a b|a |b"):
            assert again.encode(sample).ids == tokenizer.encode(sample).ids


def _merges(text: str) -> list:
    import json

    return json.loads(text)["model"]["merges"]


def _fields(config: transformers.PretrainedConfig) -> dict:
    return {k: v for k, v in config.to_dict().items() if k != "transformers_version"}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_a_family_config_is_its_transformers_class_field_for_field(model_type) -> None:
    """The families no test file is written for (Qwen), and Llama: the config built without
    the family's class has the class's every field and default (the others are compared on
    their files, in test_a_family_s_file_maps_back_to_its_transformers_model)."""
    # Every described family is compared, here or on its file.
    assert set(FAMILY_DEFAULTS) == {t for t, _ in FAMILIES.values()} | {"qwen2", "qwen3"}
    fields = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    config = family_config_class(model_type)(**fields)
    assert config.model_type == model_type
    assert _fields(config) == _fields(AutoConfig.for_model(model_type, **fields))
