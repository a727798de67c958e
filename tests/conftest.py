"""Shared fixtures; plain helpers live in tests/factories.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator

# Triton kernels (engine/attention/triton_decode.py) run here on the CPU, under Triton's
# interpreter; it must be chosen before Triton is first imported. Off by default outside tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from scheduler import BatchingPolicy, KVBlockManager, SchedulerConfig, make_policy
from tests import processes
from tests.processes import LeakWatch
from tests.services import RedisServer

LEAK_WATCH = pytest.StashKey[LeakWatch]()


@pytest.fixture(scope="session", autouse=True)
def leak_watch(request: pytest.FixtureRequest) -> Iterator[LeakWatch]:
    """Fails the run if a gateway, worker, `jitney up`, redis-server, prometheus or nginx the
    run started outlives its test (the teardown hook below checks after each test; this, after
    the last). Orphans count: pytest adopts them as a child subreaper. Under pytest-xdist each
    worker process watches its own descendants."""
    processes.become_subreaper()
    watch = request.config.stash.setdefault(LEAK_WATCH, LeakWatch())
    yield watch
    watch.closed = True
    report = watch.after_test(scope_ends=True)
    if report:
        pytest.fail(report, pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash.setdefault(LEAK_WATCH, LeakWatch()).current = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    """After each test's teardown: what it started must be gone by the end of its module (at
    once when the next test is in another module); a leak fails this test's teardown."""
    result = yield
    watch = item.config.stash.get(LEAK_WATCH, None)
    if watch is None or watch.closed:  # the last test: the session fixture checked already
        return result
    module = item.getparent(pytest.Module)
    scope_ends = nextitem is None or nextitem.getparent(pytest.Module) is not module
    report = watch.after_test(scope_ends)
    if report:
        pytest.fail(report, pytrace=False)
    return result


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
