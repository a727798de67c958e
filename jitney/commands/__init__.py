"""One module per `jitney` subcommand: `add_arguments(parser)` and `run(args) -> int`."""
