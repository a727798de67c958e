"""The one console script, `jitney`, with a subcommand per part of the system.

Every option can also come from the environment: `--kv-blocks` reads `JITNEY_KV_BLOCKS`
(command-line flags win). Subcommand modules are imported only when chosen, so
`jitney simulate` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from collections.abc import Collection, Sequence

# name -> (module under jitney.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("up", "run everything locally: Redis, a gateway and workers"),
    "simulate": ("simulate", "compare static, dynamic and continuous batching on a step simulator"),
    "generate": ("generate", "run the engine offline on a few prompts"),
    "bench": (
        "bench",
        "benchmarks: `bench offline` (engine vs transformers), `bench serve` (live load)",
    ),
    "worker": ("worker", "serve a model from the Redis request stream (one per GPU/CPU)"),
    "gateway": ("gateway", "the OpenAI-compatible HTTP gateway (no torch; enqueues into Redis)"),
    "dead-letters": ("dead_letters", "list (or purge) the requests workers gave up on"),
    "top": ("top", "the live batch view in a terminal: every worker's seats, refreshed"),
}


def env_var_for(option: str) -> str:
    return "JITNEY_" + option.lstrip("-").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Let JITNEY_<OPTION> set any option's default, converted by the option's own type."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                apply_env_defaults(subparser)
            continue
        long_opts = [o for o in action.option_strings if o.startswith("--")]
        if not long_opts or action.dest == "help":
            continue
        value = os.environ.get(env_var_for(long_opts[0]))
        if value is None:
            continue
        if action.nargs == 0:  # store_true / store_false
            action.default = value.strip().lower() in {"1", "true", "yes", "on"}
        else:
            try:
                action.default = env_value(action, value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                parser.error(f"{env_var_for(long_opts[0])}={value!r}: {e}")
        action.required = False


def env_value(action: argparse.Action, value: str) -> object:
    """An option's value from its variable, converted by the option's own type; a list option
    (nargs "+" or "*") takes the items a shell would split (JITNEY_LORA_MODULES='a=/x b=/y')."""
    convert = action.type or str
    if action.nargs in ("+", "*"):
        return [convert(item) for item in shlex.split(value)]
    return convert(value)


def build_parser(load: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """Every command is listed (with its help line); only those in `load` get their arguments,
    which imports their modules: `main` loads just the chosen one."""
    parser = argparse.ArgumentParser(prog="jitney", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in load:
            importlib.import_module(f"jitney.commands.{module}").add_arguments(p)
            apply_env_defaults(p)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line: the first word that is not an option (the
    top level has no options of its own but --help). None: argparse then says what is wrong."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = chosen_command(argv)
    args = build_parser([command] if command else []).parse_args(argv)
    module = importlib.import_module(f"jitney.commands.{COMMANDS[args.command][0]}")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
