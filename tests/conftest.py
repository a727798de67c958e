"""Shared fixtures; plain helpers live in tests/factories.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from scheduler import BatchingPolicy, KVBlockManager, SchedulerConfig, make_policy
from tests.services import RedisServer


@pytest.fixture
def make_scheduler() -> Iterator[Callable[..., BatchingPolicy]]:
    """Build a policy over its own block pool; every pool is integrity-checked at teardown."""
    pools: list[KVBlockManager] = []

    def factory(
        policy: str = "continuous", num_blocks: int = 64, block_size: int = 4, **config: object
    ) -> BatchingPolicy:
        kv = KVBlockManager(num_blocks, block_size)
        pools.append(kv)
        return make_policy(policy, SchedulerConfig(**config), kv)  # type: ignore[arg-type]

    yield factory
    for kv in pools:
        kv.check_integrity()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, owned (and killable) by the test."""
    server = RedisServer().start()
    yield server
    server.close()
