"""Process management for local stacks: a private redis-server on a free port, tied to the life
of the process tree that started it (`jitney up`, `jitney bench queue`, the tests)."""
