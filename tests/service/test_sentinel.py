"""Redis Sentinel: REDIS_URL=redis+sentinel://... finds the primary through the Sentinels, and
after a failover (the primary killed, its replica promoted) gateway and worker carry on."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path

import aiohttp
import pytest
import redis

from protocol import Keys
from protocol.redis_client import sentinel_target
from tests.service.helpers import MODEL
from tests.services import (
    RedisServer,
    free_port,
    start_gateway,
    start_worker,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.slow
SERVICE = "jitney-primary"


class Sentinel:
    """One redis-server in Sentinel mode watching `primary` (quorum 1, fast failover)."""

    def __init__(self, primary: RedisServer):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="jitney-sentinel-"))
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        binary = shutil.which("redis-server")
        assert binary, "redis-server not found: `make install` installs it"
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.proc = subprocess.Popen([binary, str(conf), "--sentinel"], **quiet)
        client = redis.Redis(port=self.port, socket_timeout=2)
        wait_for(lambda: client.sentinel_master(SERVICE)["num-slaves"] >= 1, 20, "replica seen")

    def primary_port(self) -> int:
        client = redis.Redis(port=self.port, socket_timeout=2)
        return int(client.sentinel_get_master_addr_by_name(SERVICE)[1])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def test_sentinel_urls_parse():
    t = sentinel_target("redis+sentinel://:pw@s1:26379,s2:26380/mymaster/2")
    assert t is not None and t.sentinels == [("s1", 26379), ("s2", 26380)]
    assert (t.service, t.db, t.password, t.tls) == ("mymaster", 2, "pw", False)
    assert sentinel_target("redis://h:6379/0") is None
    bad_urls = ("redis+sentinel://s1/m", "redis+sentinel://s1:26379/", "redis+sentinel://s1:1/a/b")
    for bad in bad_urls:
        with pytest.raises(ValueError):
            sentinel_target(bad)


async def test_gateway_and_worker_follow_a_failover():
    primary = RedisServer(appendonly=True).start()
    replica_of = ("--replicaof", "127.0.0.1", str(primary.port))
    replica = RedisServer(appendonly=True, extra_args=replica_of).start()
    sentinel = Sentinel(primary)
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/0"
    worker = start_worker(primary, "sw1", env={"REDIS_URL": url})
    gateway = start_gateway(primary, env={"REDIS_URL": url})
    body = {"model": MODEL, "prompt": "failover", "max_tokens": 8, "temperature": 0}
    try:
        wait_ready(primary.client(), worker)
        gateway.wait_ready()
        async with aiohttp.ClientSession() as session:

            async def complete() -> int:
                async with session.post(f"{gateway.base}/v1/completions", json=body) as resp:
                    return resp.status

            assert await complete() == 200
            primary.stop(9)  # SIGKILL: no goodbye
            await asyncio.to_thread(
                wait_for, lambda: sentinel.primary_port() == replica.port, 30, "failover"
            )

            async def served_after_failover() -> bool:
                return await complete() == 200

            deadline = asyncio.get_running_loop().time() + 60
            while not await served_after_failover():
                assert asyncio.get_running_loop().time() < deadline, "not served after failover"
                await asyncio.sleep(0.5)
        assert worker.proc.alive() and gateway.proc.alive()
        assert replica.client().xlen(Keys().requests(MODEL)) == 0  # served and deleted there
    finally:
        gateway.proc.stop()
        worker.proc.stop()
        sentinel.close()
        replica.close()
        primary.close()
