"""The `jitney` CLI: subcommands load lazily, and the batching defaults have one source."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    SchedulerConfig: one set of defaults."""
    from engine.config import EngineConfig

    args = build_parser(["worker"]).parse_args(["worker"])
    assert engine_config_from_args(args).scheduler_config() == SchedulerConfig()
    assert EngineConfig().scheduler_config() == SchedulerConfig()


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


def test_max_preemptions_per_seq_below_one_is_refused():
    args = build_parser(["worker"]).parse_args(["worker", "--max-preemptions-per-seq", "0"])
    with pytest.raises(ValueError, match="max_preemptions_per_seq must be >= 1, got 0"):
        engine_config_from_args(args)
