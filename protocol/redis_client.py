"""Redis clients from REDIS_URL: a plain URL, or Redis Sentinel.

- `redis://[:password@]host:port/db` and `rediss://...` (TLS): one server (or a managed
  primary endpoint).
- `redis+sentinel://[:password@]host:port[,host:port...]/service[/db]`: ask the Sentinels for
  the current primary of `service`; after a failover the clients reconnect to the new primary by
  themselves (calls in between fail like any outage and are retried with backoff). The password
  is the data nodes' (Sentinels are asked without one unless JITNEY_SENTINEL_PASSWORD is set).
  `redis+sentinels://` uses TLS to the data nodes.
- `redis+cluster://[:password@]host:port[,host:port...]`: a Redis Cluster, found from any of the
  listed nodes; `redis+clusters://` uses TLS. A deployment's keys share one hash tag
  (protocol.Keys), so its scripts and transactions run on one shard; a primary's failover is
  followed like Sentinel's. The clients start while some slots are uncovered
  (`require_full_coverage=False`): one shard down must not stop the deployments on the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "redis+sentinels")
CLUSTER_SCHEMES = ("redis+cluster", "redis+clusters")


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    service: str
    db: int
    password: str | None
    tls: bool

    def sentinel_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """How to talk to the Sentinels themselves: the same timeouts, their own password."""
        password = os.environ.get("JITNEY_SENTINEL_PASSWORD")
        timeouts = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
        return timeouts | ({"password": password} if password else {})

    @property
    def node_kwargs(self) -> dict[str, Any]:
        return {"db": self.db, "password": self.password, "ssl": self.tls}


def sentinel_target(url: str) -> SentinelTarget | None:
    """The Sentinel form of `url`, or None for a plain Redis URL. Raises ValueError if malformed."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        return None
    sentinels = _host_ports(parts.netloc, "redis+sentinel://s1:26379")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("a Sentinel URL ends in /service or /service/db, e.g. .../mymaster/0")
    password = unquote(parts.password) if parts.password else None
    db = int(path[1]) if len(path) == 2 else 0
    return SentinelTarget(sentinels, path[0], db, password, parts.scheme == "redis+sentinels")


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    nodes: list[tuple[str, int]]
    password: str | None
    tls: bool

    @property
    def client_kwargs(self) -> dict[str, Any]:
        return {"password": self.password, "ssl": self.tls, "require_full_coverage": False}


def _host_ports(netloc: str, example: str) -> list[tuple[str, int]]:
    hosts = []
    for host in netloc.rpartition("@")[2].split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"the URL lists host:port pairs, e.g. {example}")
        hosts.append((name, int(port)))
    return hosts


def cluster_target(url: str) -> ClusterTarget | None:
    """The cluster form of `url`, or None for another URL. Raises ValueError if malformed."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        return None
    nodes = _host_ports(parts.netloc, "redis+cluster://node1:6379,node2:6379")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0")
    password = unquote(parts.password) if parts.password else None
    return ClusterTarget(nodes, password, parts.scheme == "redis+clusters")


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    cluster = cluster_target(url)
    if cluster is not None:
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in cluster.nodes]
        return redis.RedisCluster(startup_nodes=nodes, **cluster.client_kwargs, **kwargs)
    target = sentinel_target(url)
    if target is None:
        return redis.Redis.from_url(url, **kwargs)
    sentinel = Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs(kwargs), **kwargs)
    return sentinel.master_for(target.service, **target.node_kwargs, **kwargs)


def async_client(url: str, max_connections: int, **kwargs: Any) -> aioredis.Redis:
    """A plain URL gets a blocking pool of `max_connections` (callers wait for a connection
    instead of failing); Sentinel's pool does not block, so it gets room for a burst instead."""
    cluster = cluster_target(url)
    if cluster is not None:  # a pool per node, which waits for a free connection
        nodes = [aioredis.cluster.ClusterNode(h, p) for h, p in cluster.nodes]
        return aioredis.RedisCluster(
            startup_nodes=nodes, max_connections=max_connections, **cluster.client_kwargs, **kwargs
        )
    target = sentinel_target(url)
    if target is None:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=kwargs.get("socket_timeout"), **kwargs
        )
        return aioredis.Redis(connection_pool=pool)
    sentinels = target.sentinels
    sentinel = AsyncSentinel(sentinels, sentinel_kwargs=target.sentinel_kwargs(kwargs), **kwargs)
    return sentinel.master_for(
        target.service, max_connections=max_connections * 16, **target.node_kwargs, **kwargs
    )
