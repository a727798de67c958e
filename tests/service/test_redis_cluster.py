"""Redis Cluster: REDIS_URL=redis+cluster://... on a real 3-primary cluster on loopback.

Each deployment (key prefix) is one hash tag, so one slot on one primary. Two deployments whose
tags land on different primaries are two shards: killing one primary stops its shard (503s,
nothing hangs) and leaves the other serving; the killed primary's return (AOF, same node id)
brings its shard back. Without replicas no shard fails over: docs/scale.md says what is kept.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time

import pytest
import requests
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from protocol import Keys
from protocol.redis_client import cluster_target
from tests.service.helpers import MODEL
from tests.services import (
    Gateway,
    RedisServer,
    Worker,
    start_gateway,
    start_worker,
    wait_for,
)

NODE_TIMEOUT_MS = 2000


def test_cluster_urls_parse():
    t = cluster_target("redis+cluster://:p%40w@n1:7000,n2:7001")
    assert t is not None and t.nodes == [("n1", 7000), ("n2", 7001)]
    assert (t.password, t.tls) == ("p@w", False)
    assert cluster_target("redis+clusters://n1:7000/0").tls
    assert cluster_target("redis://h:6379/0") is None
    for bad in ("redis+cluster://n1", "redis+cluster://n1:7000/3", "redis+cluster://:7000"):
        with pytest.raises(ValueError):
            cluster_target(bad)


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 higher) is free too, so at most 55535."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class Cluster:
    """Three redis-servers in cluster mode, one primary each, no replicas; each keeps an AOF
    and its nodes.conf in its own directory, so a killed one restarts as the same node."""

    def __init__(self, size: int = 3):
        flags = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            # One primary down must not stop the shards on the others.
            "--cluster-require-full-coverage", "no",
        )  # fmt: skip
        self.nodes = [
            RedisServer(cluster_port(), appendonly=True, extra_args=flags).start()
            for _ in range(size)
        ]
        cli = shutil.which("redis-cli")
        assert cli, "redis-cli not found: `make install` installs it (Debian)"
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(self.healthy, 30, "cluster_state:ok on every node")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def healthy(self) -> bool:
        return all(n.client().cluster("info")["cluster_state"] == "ok" for n in self.nodes)

    def owner(self, key: str) -> RedisServer:
        """The node serving the slot of `key`."""
        slot = key_slot(key.encode())
        for start, end, primary, *_ in self.nodes[0].client().execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise AssertionError(f"slot {slot} is not served")

    def client(self) -> RedisCluster:
        nodes = [ClusterNode("127.0.0.1", n.port) for n in self.nodes]
        return RedisCluster(startup_nodes=nodes, require_full_coverage=False, socket_timeout=2)

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def prefixes_on(cluster: Cluster, nodes: list[RedisServer]) -> list[str]:
    """One key prefix (a deployment) whose hash tag lives on each of `nodes`."""
    found: dict[int, str] = {}
    for i in range(1000):
        prefix = f"shard{i}"
        owner = cluster.owner(Keys(prefix).workers)
        found.setdefault(owner.port, prefix)
        if all(n.port in found for n in nodes):
            return [found[n.port] for n in nodes]
    raise AssertionError("no prefix found for every node")


def complete(gateway: Gateway, timeout: float = 30, priority: int = 0) -> requests.Response:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    body["priority"] = priority
    return requests.post(f"{gateway.base}/v1/completions", json=body, timeout=timeout)


def wait_joined(cluster: Cluster, prefix: str, worker: Worker) -> None:
    client = cluster.client()

    def joined() -> bool:
        assert worker.proc.alive(), worker.proc.output()
        return client.zscore(Keys(prefix).workers, worker.worker_id) is not None

    wait_for(joined, 90, f"{worker.worker_id} heartbeat")


@pytest.mark.slow
def test_two_shards_on_a_cluster_and_one_primary_killed():
    cluster = Cluster()
    a_node, b_node, spare = cluster.nodes
    shard_a, shard_b = prefixes_on(cluster, [a_node, b_node])
    env = {"REDIS_URL": cluster.url}
    workers, gateways = [], []
    try:
        for prefix in (shard_a, shard_b):
            flags = ("--key-prefix", prefix)
            workers.append(start_worker(a_node, f"w-{prefix}", *flags, env=env))
            gateways.append(start_gateway(a_node, *flags, env=env))
        for prefix, worker in zip((shard_a, shard_b), workers, strict=True):
            wait_joined(cluster, prefix, worker)
        for gateway in gateways:
            gateway.wait_ready()
        gw_a, gw_b = gateways

        # Both shards serve through the cluster, each from its own primary; a priority of its
        # own makes a queue of its own (the scripts that list and read queues, on a cluster).
        for gateway in gateways:
            for priority in (0, 5):
                response = complete(gateway, priority=priority)
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 8
        for prefix, node in ((shard_a, a_node), (shard_b, b_node)):
            slot = key_slot(Keys(prefix).workers.encode())
            assert node.client().cluster("countkeysinslot", slot) > 0
        assert spare.client().dbsize() == 0  # neither deployment has a key elsewhere

        # Shard B's primary dies: B answers 503 (never hangs, never 500), A carries on.
        b_node.stop(signal.SIGKILL)
        for _ in range(3):
            response = complete(gw_a)
            assert response.status_code == 200, response.text
        wait_for(lambda: complete(gw_b).status_code == 503, 30, "shard B answers 503")
        error = complete(gw_b).json()["error"]
        assert error["type"] == "service_unavailable"
        assert requests.get(f"{gw_a.base}/ready", timeout=5).status_code == 200
        assert requests.get(f"{gw_b.base}/ready", timeout=5).status_code == 503

        # It comes back (same node, its AOF): shard B serves again; nothing was restarted.
        b_node.start()
        wait_for(cluster.healthy, 30, "the cluster whole again")
        deadline = time.monotonic() + 60
        while (status := complete(gw_b).status_code) != 200:
            assert time.monotonic() < deadline, f"shard B still answers {status}"
            time.sleep(1)
        assert complete(gw_a).status_code == 200
        for process in [*(w.proc for w in workers), *(g.proc for g in gateways)]:
            assert process.alive(), process.output()
    finally:
        for gateway in gateways:
            gateway.proc.stop()
        for worker in workers:
            worker.proc.stop()
        cluster.close()
