"""The `jitney` command line."""
