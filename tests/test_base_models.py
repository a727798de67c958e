"""Base models (no chat template): `jitney generate` refuses a chat prompt for one before torch
is imported and the model loads, saying to use --raw or --chat-template; vLLM's --chat-template
(a Jinja file, or the template inline) gives a model a template on every engine command, and
reaches the model card the gateway renders chats with; a template that does not compile is a
clear error, also before torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.chat_template import has_chat_template, resolve_chat_template
from jitney.cli import build_parser, main
from jitney.commands.engine_args import engine_args_to_argv, engine_config_from_args
from tests.gguf_files import BASE_SPECIALS, tiny_vocabulary, write_gguf
from tests.model_dirs import SMALL_LLAMA, write_random_llama
from tests.test_bad_flags_before_torch import run_and_report

# A template of the base vocabulary's own tokens (no ChatML in it).
TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
QUICK = ["--device", "cpu", "--kv-cache-memory", "8MiB", "--max-tokens", "4"]


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory) -> Path:
    """A Llama-family GGUF with no chat template and no ChatML tokens: a base model."""
    path = tmp_path_factory.mktemp("base") / "base.gguf"
    return write_gguf(path, tiny_llama(), "llama", specials=BASE_SPECIALS)


@pytest.fixture
def cache(tmp_path) -> list[str]:
    """A model cache of the test's own (not $JITNEY_CACHE_DIR: the kernels' cache is there)."""
    return ["--cache-dir", str(tmp_path / "cache")]


def test_a_chat_prompt_for_a_base_model_is_refused_before_torch_is_imported(base_gguf):
    result = run_and_report(["generate", "--model", str(base_gguf), "--device", "cpu", "hi"])
    assert result.returncode != 0
    assert "has no chat template" in result.stderr and "Traceback" not in result.stderr
    assert "--raw" in result.stderr and "--chat-template FILE" in result.stderr
    assert "torch imported: False" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for m in messages %}{{ m.content }", "not a valid Jinja template"),
        ("", "is empty"),
    ],
    ids=["syntax-error", "empty"],
)
def test_a_bad_template_file_is_refused_before_torch_is_imported(
    base_gguf, tmp_path, template, message
):
    bad = tmp_path / "bad.jinja"
    bad.write_text(template)
    argv = ["generate", "--model", str(base_gguf), "--chat-template", str(bad), "hi"]
    result = run_and_report(argv)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"generate: --chat-template: {bad}" in result.stderr and message in result.stderr
    assert "torch imported: False" in result.stderr, result.stderr


def test_chat_template_file_makes_a_base_model_chat(base_gguf, tmp_path, cache, capsys):
    template = tmp_path / "base.jinja"
    template.write_text(TEMPLATE)
    argv = [*QUICK, *cache, "--model", str(base_gguf), "--chat-template", str(template), "hi"]
    assert main(["generate", *argv]) == 0
    out = capsys.readouterr().out
    assert "### hi" in out and "[4 tokens, length]" in out


def test_raw_prompts_need_no_template(base_gguf, cache, capsys):
    assert main(["generate", *QUICK, *cache, "--model", str(base_gguf), "--raw", "hi"]) == 0
    assert "[4 tokens, length]" in capsys.readouterr().out


def test_the_flag_s_template_reaches_the_model_card(base_gguf, tmp_path, cache):
    """What the worker publishes (the gateway renders chats with the card's template), and
    what `jitney up` passes on to its workers."""
    from engine.llm_engine import Engine
    from protocol.model_card import card_from_tokenizer, tokenizer_from_card

    template = tmp_path / "base.jinja"
    template.write_text(TEMPLATE)
    argv = ["worker", *cache, "--model", str(base_gguf), "--chat-template", str(template)]
    args = build_parser(argv[:1]).parse_args(argv)
    config = engine_config_from_args(args)
    engine = Engine(config)
    card = card_from_tokenizer("base", engine.loaded.tokenizer, 128, [2])
    chat = [{"role": "user", "content": "hi"}]

    assert config.chat_template == TEMPLATE and card.chat_template == TEMPLATE
    rendered = tokenizer_from_card(card).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<s>user: hi</s><s>assistant: "
    up = build_parser(["up"]).parse_args(["up", "--chat-template", str(template)])
    assert engine_args_to_argv(up)[-2:] == ["--chat-template", str(template)]


def test_a_template_given_inline_is_taken_as_vllm_takes_it(tmp_path):
    assert resolve_chat_template("{{ messages[0]['content'] }}\\n") == (
        "{{ messages[0]['content'] }}\n"
    )
    with pytest.raises(ValueError, match="no such file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("{{ 'é' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="cannot read it as UTF-8"):
        resolve_chat_template(str(latin))
    uses_generation = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    assert resolve_chat_template(uses_generation) == uses_generation  # transformers' own tag


def test_whether_a_model_has_a_template_is_read_from_its_files(base_gguf, tmp_path):
    """A GGUF's template or ChatML tokens; a directory's template files or ChatML tokens; a
    built-in name cannot be told (each has one)."""
    chatml = write_gguf(tmp_path / "chatml.gguf", tiny_llama(), "llama")  # ChatML's tokens
    templated = write_gguf(
        tmp_path / "t.gguf", tiny_llama(), "llama", specials=BASE_SPECIALS, chat_template=TEMPLATE
    )
    assert has_chat_template(str(base_gguf)) is False
    assert has_chat_template(str(chatml)) is True
    assert has_chat_template(str(templated)) is True

    directory = write_random_llama(tmp_path / "dir", **SMALL_LLAMA)  # ChatML, template saved
    assert has_chat_template(str(directory)) is True
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_file = directory / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    settings.pop("chat_template", None)
    config_file.write_text(json.dumps(settings))
    assert has_chat_template(str(directory)) is True  # its vocabulary is ChatML's
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if "im_" not in t["content"]]
    tokenizer["model"]["vocab"].pop("<|im_start|>")
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert has_chat_template(str(directory)) is False
    assert has_chat_template("smollm2-135m") is None and has_chat_template("tiny-random") is None


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tiny_vocabulary()["tokens"]), **SMALL_LLAMA))
