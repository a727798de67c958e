"""The `jitney` CLI: subcommands load lazily, and the batching defaults have one source."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping

import pytest

from jitney.cli import COMMANDS, build_parser, chosen_command
from jitney.commands.engine_args import engine_args_to_argv, engine_config_from_args
from scheduler import SchedulerConfig

# Runs `jitney <argv>` in a fresh interpreter and prints which heavy or command modules it
# imported (argparse exits after --help; that still counts as the command having run).
LAZY_SCRIPT = """
import json, sys
from jitney.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "transformers"}
                or m.startswith("jitney.commands."))
print("LOADED " + json.dumps(loaded))
"""


def run_cli(*argv: str) -> tuple[str, list[str]]:
    """(stdout before the report, modules loaded) of `jitney *argv` in a subprocess."""
    env = {**os.environ, "COLUMNS": "200"}  # argparse wraps help lines to the terminal width
    result = subprocess.run(
        [sys.executable, "-c", LAZY_SCRIPT, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out, _, loaded = result.stdout.rpartition("LOADED ")
    return out, json.loads(loaded)


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        (["gateway", "--help"], "jitney.commands.gateway"),
        (["simulate", "--policy", "static"], "jitney.commands.simulate"),
    ],
)
def test_a_command_imports_only_its_own_module_and_no_torch(argv, module):
    """`jitney gateway` / `jitney simulate` import their command module alone: no torch."""
    out, loaded = run_cli(*argv)
    assert loaded == [module]
    assert out.strip()  # it did run: help text or the simulator's row


def test_top_level_help_lists_every_command_without_importing_any():
    """`jitney --help` lists each command with its one-line help, from the table alone."""
    out, loaded = run_cli("--help")
    assert loaded == []
    words = " ".join(out.split())  # argparse puts a long name on a line of its own
    for name, (_, help_text) in COMMANDS.items():
        assert f" {name} {' '.join(help_text.split())} " in words, name


def test_an_unknown_command_is_refused_by_name(capsys):
    """A misspelt command gets argparse's error listing the valid ones."""
    assert chosen_command(["simulat"]) is None
    with pytest.raises(SystemExit):
        build_parser([]).parse_args(["simulat"])
    assert "invalid choice: 'simulat'" in capsys.readouterr().err


def test_chosen_command_skips_options_before_it():
    """The command is the first non-option word; later words (bench's own) do not count."""
    assert chosen_command(["-h"]) is None
    assert chosen_command(["--help", "worker"]) == "worker"
    assert chosen_command(["bench", "report", "--out", "x"]) == "bench"


def test_engine_flag_defaults_are_the_scheduler_defaults():
    """A bare EngineConfig and `jitney worker` without flags schedule exactly as a bare
    SchedulerConfig, but for the speculative method the engine resolves (`auto`: n-gram under
    continuous batching): one set of defaults."""
    from engine.config import EngineConfig

    bare = SchedulerConfig()
    want = dataclasses.replace(
        bare, speculative=dataclasses.replace(bare.speculative, method="ngram")
    )
    args = build_parser(["worker"]).parse_args(["worker"])
    assert engine_config_from_args(args).scheduler_config() == want
    assert EngineConfig().scheduler_config() == want
    assert EngineConfig(batching="static").scheduler_config().speculative.method == "none"


def test_max_preemptions_per_seq_flag_and_env_reach_the_scheduler(monkeypatch):
    """--max-preemptions-per-seq (or JITNEY_MAX_PREEMPTIONS_PER_SEQ) sets the scheduler's cap,
    and `jitney up` passes it on to the workers it starts."""
    args = build_parser(["worker"]).parse_args(["worker", "--max-preemptions-per-seq", "2"])
    assert engine_config_from_args(args).scheduler_config().max_preemptions_per_seq == 2
    monkeypatch.setenv("JITNEY_MAX_PREEMPTIONS_PER_SEQ", "3")
    args = build_parser(["up"]).parse_args(["up"])
    assert engine_config_from_args(args).scheduler_config().max_preemptions_per_seq == 3
    argv = engine_args_to_argv(args)
    assert argv[argv.index("--max-preemptions-per-seq") + 1] == "3"


def test_no_prompt_lookup_resume_reaches_the_proposer_and_the_workers_up_starts():
    from scheduler import ContinuousBatching, KVBlockManager

    args = build_parser(["up"]).parse_args(["up", "--no-prompt-lookup-resume"])
    config = engine_config_from_args(args).scheduler_config()
    assert config.speculative.prompt_lookup_resume is False
    assert ContinuousBatching(config, KVBlockManager(8, 4)).speculator.proposer.resume is False
    assert "--no-prompt-lookup-resume" in engine_args_to_argv(args)
    bare = build_parser(["worker"]).parse_args(["worker"])
    config = engine_config_from_args(bare).scheduler_config()
    assert ContinuousBatching(config, KVBlockManager(8, 4)).speculator.proposer.resume is True
    assert "--no-prompt-lookup-resume" not in engine_args_to_argv(bare)


def test_lora_modules_in_both_forms_reach_the_engine_and_the_workers_up_starts():
    """`name=path` and vLLM's JSON item both reach EngineConfig; `jitney up` passes them on."""
    item = '{"name": "chat", "path": "/adapters/chat", "base_model_name": "x"}'
    argv = ["up", "--lora-modules", "sql=/adapters/sql", item, "--max-loras", "2"]
    args = build_parser(["up"]).parse_args(argv)
    config = engine_config_from_args(args)
    assert config.lora_modules == (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
    assert config.max_loras == 2
    passed = engine_args_to_argv(args)
    at = passed.index("--lora-modules")
    assert passed[at : at + 3] == ["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"]
    again = build_parser(["worker"]).parse_args(["worker", *passed])
    assert engine_config_from_args(again) == config


def test_a_list_flag_s_variable_holds_its_items_as_a_shell_splits_them(monkeypatch):
    """JITNEY_LORA_MODULES='a=/x {json}': two items, each read by the flag's own type; the
    flag on the command line replaces them."""
    item = '{"name": "chat", "path": "/adapters/chat"}'
    monkeypatch.setenv("JITNEY_LORA_MODULES", f"sql=/adapters/sql '{item}'")
    config = engine_config_from_args(build_parser(["worker"]).parse_args(["worker"]))
    assert config.lora_modules == (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))
    given = build_parser(["worker"]).parse_args(["worker", "--lora-modules", "b=/b"])
    assert engine_config_from_args(given).lora_modules == (("b", "/b"),)


def test_max_preemptions_per_seq_below_one_is_refused():
    args = build_parser(["worker"]).parse_args(["worker", "--max-preemptions-per-seq", "0"])
    with pytest.raises(ValueError, match="max_preemptions_per_seq must be >= 1, got 0"):
        engine_config_from_args(args)


def flag_defaults(
    command: str, *configs: type, flat_names: Mapping[type, Mapping[str, str]] | None = None
) -> tuple[dict[str, object], dict[str, object]]:
    """(each valued flag's default by dest, a sentinel per config field): the parser built while
    every plain field default of `configs` is a sentinel, so a flag that took its default from
    its field holds that field's sentinel, and one with a literal of its own holds the literal.
    A sentinel is keyed by its field's name, or by the flat name `flat_names[config]` gives it
    (flat name -> field)."""
    sentinels: dict[str, object] = {}
    with pytest.MonkeyPatch.context() as mp:
        for config in configs:
            flat = {field: name for name, field in (flat_names or {}).get(config, {}).items()}
            for f in dataclasses.fields(config):
                if f.default is not dataclasses.MISSING:
                    key = flat.get(f.name, f.name)
                    sentinels[key] = object()
                    mp.setattr(f, "default", sentinels[key])
        parser = build_parser([command])
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[command]._actions
    return {a.dest: a.default for a in actions if a.option_strings and a.nargs != 0}, sentinels


def test_every_engine_flag_defaults_to_its_engine_config_field():
    """Each valued engine flag's default is EngineConfig's field, or its speculative settings'
    under the flag's flat name (read, never written again), and the switches are off where the
    fields are: no flags give exactly a bare EngineConfig."""
    from engine.config import EngineConfig
    from engine.speculative_options import FLAT_FIELDS, SpeculativeOptions

    flat_names = {SpeculativeOptions: FLAT_FIELDS}
    defaults, sentinels = flag_defaults(
        "worker", EngineConfig, SpeculativeOptions, flat_names=flat_names
    )
    engine_flags = {dest: defaults[dest] for dest in defaults.keys() & sentinels.keys()}
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"speculative"} | set(FLAT_FIELDS)
    assert set(engine_flags) == fields - SWITCHED_ENGINE_FIELDS, (
        "an engine setting without a flag, or a flag under another name"
    )
    for dest, default in engine_flags.items():
        assert default is sentinels[dest], f"--{dest.replace('_', '-')} writes its own default"
    args = build_parser(["worker"]).parse_args(["worker"])
    assert engine_config_from_args(args) == EngineConfig()


# Engine fields set by a switch (--reserve, --no-prefix-caching, --no-prompt-lookup-resume,
# --enforce-eager, --compile), not a value.
SWITCHED_ENGINE_FIELDS = {
    "reserve_full_length",
    "enable_prefix_caching",
    "prompt_lookup_resume",
    "enforce_eager",
    "compile",
}


def test_every_gateway_flag_defaults_to_its_gateway_config_field():
    """Each gateway flag's default is GatewayConfig's (or RateLimits') field, never a literal."""
    from gateway.config import GatewayConfig, RateLimits

    defaults, sentinels = flag_defaults("gateway", GatewayConfig, RateLimits)
    # Flags named other than their field; the rest share the field's name.
    fields = {
        "shutdown_timeout": "shutdown_timeout_s",
        "batch_lease": "batch_lease_s",
        "responses_ttl": "responses_ttl_s",
        "rate_limit_rps": "rps",
        "rate_limit_burst": "burst",
        "rate_limit_tpm": "tpm",
    }
    # Flags with no plain field default: a generated id, keys parsed into ApiKeys, reasoning
    # parsers parsed into (model, name) pairs, logging.
    no_field = {"gateway_id", "api_keys", "api_keys_file", "log_level", "reasoning_parser"}
    assert set(defaults) - no_field, "no gateway flags found"
    for dest, default in defaults.items():
        if dest not in no_field:
            field = fields.get(dest, dest)
            assert default is sentinels[field], f"--{dest.replace('_', '-')} writes its own default"
    config = GatewayConfig()
    args = build_parser(["gateway"]).parse_args(["gateway"])
    assert (args.port, args.max_queue_len, args.batch_lease) == (
        config.port,
        config.max_queue_len,
        config.batch_lease_s,
    )
    assert args.queue_without_workers is config.queue_without_workers is False


def test_every_worker_loop_flag_defaults_to_its_service_config_field():
    """The worker loop's flags take ServiceConfig's defaults (read, never written again)."""
    from worker.service_config import ServiceConfig

    defaults, sentinels = flag_defaults("worker", ServiceConfig)
    fields = {
        "idle_block_ms": "idle_block_ms",
        "shutdown_timeout": "shutdown_timeout_s",
        "stall_timeout": "stall_timeout_s",
    }
    for dest, field in fields.items():
        assert defaults[dest] is sentinels[field], f"--{dest.replace('_', '-')} writes its own"


def test_up_shares_the_automatic_thread_count_among_its_workers():
    """`jitney up --workers N` divides the automatic count (never below one each); a count the
    user gave is each worker's, and reaches the workers as their own --threads."""
    from engine.threads import AFFINITY, FLAG, OMP, ThreadChoice
    from jitney.commands.up import worker_threads

    auto = ThreadChoice(4, AFFINITY, "affinity: 4 CPUs")
    assert worker_threads(auto, 1) == auto
    shared = worker_threads(auto, 2)
    assert (shared.count, shared.reason) == (2, "affinity: 4 CPUs, shared by 2 workers")
    assert worker_threads(auto, 8).count == 1
    for given in (ThreadChoice(3, FLAG, FLAG), ThreadChoice(3, OMP, "OMP_NUM_THREADS=3")):
        assert worker_threads(given, 2) == given
    args = build_parser(["up"]).parse_args(["up", "--threads", "3"])
    assert engine_args_to_argv(args)[-2:] == ["--threads", "3"]
