"""`jitney generate`: a bad sampling value or engine flag fails before the model loads."""

from __future__ import annotations

import subprocess
import sys

JITNEY = [sys.executable, "-m", "jitney.cli", "generate"]
TINY = ["--model", "tiny-random", "--device", "cpu", "--raw"]


def jitney_generate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*JITNEY, *argv], capture_output=True, text=True, timeout=180)


def test_bad_sampling_value_is_a_clear_error_before_loading():
    """An out-of-range value exits non-zero naming the field; no model is built."""
    result = jitney_generate(*TINY, "--temperature", "-1", "hello")
    assert result.returncode != 0
    assert "temperature must be a finite number >= 0" in result.stderr
    assert "model ready" not in result.stderr and "Traceback" not in result.stderr


def test_bad_engine_flag_is_a_clear_error_before_loading():
    result = jitney_generate(*TINY, "--speculative-draft-row-cost", "2", "hello")
    assert result.returncode != 0
    assert "generate: speculative draft_row_cost must be within [0, 1]" in result.stderr
    assert "model ready" not in result.stderr and "Traceback" not in result.stderr


def test_lora_names_one_of_the_lora_modules_before_loading():
    result = jitney_generate(*TINY, "--lora-modules", "sql=/adapters/sql", "--lora", "chat", "hi")
    assert result.returncode != 0
    assert "generate: --lora 'chat' is not one of --lora-modules (sql)" in result.stderr
    result = jitney_generate(*TINY, "--lora", "chat", "hi")
    assert "--lora 'chat' is not one of --lora-modules (none given)" in result.stderr
    assert "model ready" not in result.stderr and "Traceback" not in result.stderr


def test_a_prompt_right_after_the_lora_modules_is_refused_with_the_way_out():
    """--lora-modules takes every word up to the next flag: the error says so."""
    result = jitney_generate(*TINY, "--lora-modules", "sql=/adapters/sql", "hello")
    assert result.returncode != 0
    assert "'hello' is not name=path" in result.stderr and "`--`" in result.stderr


def test_the_prompts_run_under_the_adapter_lora_names(tmp_path):
    """`--lora a` (prompts after `--`): the text the engine gives under adapter a, not the base
    model's."""
    from engine.config import EngineConfig
    from engine.llm_engine import Engine
    from generation import SamplingParams
    from tests.lora_adapters import write_peft_adapter
    from tests.model_dirs import SMALL_LLAMA, write_random_llama

    base = write_random_llama(tmp_path / "base", seed=3, **SMALL_LLAMA)
    adapter = str(write_peft_adapter(base, tmp_path / "a", rank=4, seed=1))
    flags = ["--model", str(base), "--raw", "--max-tokens", "6", "--quantization", "none"]
    result = jitney_generate(*flags, "--lora", "a", "--lora-modules", f"a={adapter}", "--", "hi")
    assert result.returncode == 0, result.stderr
    config = EngineConfig.from_flat(
        model=str(base), quantization="none", lora_modules=(("a", adapter),)
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = engine.loaded.tokenizer.encode("hi")
    tuned, plain = engine.generate([prompt, prompt], params, lora=["a", None])
    assert tuned.text != plain.text
    assert f"### hi\n{tuned.text}\n[{len(tuned.token_ids)} tokens" in result.stdout
