"""The fleet's runtime LoRA adapters (protocol/lora_registry.py) kept loaded in this engine.

Polled from the engine loop between steps (the engine is not thread-safe), at most every
SYNC_INTERVAL_S: one HGETALL, and only a change loads or drops anything. A request naming an
adapter the engine does not hold yet (registered after the last poll) polls at once, at most
every MISS_INTERVAL_S, so it is served rather than refused. The adapters the worker started
with (`--lora-modules`) are never dropped here; a registered adapter of the same name is
ignored. An adapter that fails to load is logged once per path and not retried until its entry
changes; one still in use when unregistered is dropped once its requests are done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis

from engine.errors import AdapterLoadError, UnknownAdapterError
from engine.llm_engine import Engine
from protocol import Keys
from protocol.lora_registry import read_registry
from worker.log_fields import kv

logger = logging.getLogger("jitney.worker")

SYNC_INTERVAL_S = 1.0
MISS_INTERVAL_S = 0.2


@dataclass(slots=True)
class AdapterWatch:
    client: redis.Redis
    keys: Keys
    model: str
    engine: Engine
    static: frozenset[str]  # the --lora-modules names: never the registry's to drop
    loaded: dict[str, str] = field(default_factory=dict)  # loaded from the registry: name -> path
    failed: dict[str, str] = field(default_factory=dict)  # name -> the path that failed
    _next_at: float = 0.0
    _miss_at: float = 0.0

    def maybe_sync(self) -> None:
        """Once per loop iteration (Redis errors reach the loop's backoff, as its own do)."""
        if time.monotonic() >= self._next_at:
            self.sync()

    def ensure(self, name: str) -> None:
        """Before a request under `name` starts: poll now if the engine does not hold it."""
        now = time.monotonic()
        if name not in self.engine.adapter_names and now >= self._miss_at:
            self._miss_at = now + MISS_INTERVAL_S
            self.sync()

    def sync(self) -> None:
        self._next_at = time.monotonic() + SYNC_INTERVAL_S
        wanted = {
            name: entry.path
            for name, entry in read_registry(
                self.client.hgetall(self.keys.lora_adapters(self.model))
            ).items()
            if name not in self.static
        }
        for name in [n for n in self.loaded if wanted.get(n) != self.loaded[n]]:
            self._drop(name)
        for name, path in wanted.items():
            if name not in self.loaded and self.failed.get(name) != path:
                self._load(name, path)
        self.failed = {n: p for n, p in self.failed.items() if wanted.get(n) == p}

    def _load(self, name: str, path: str) -> None:
        start = time.perf_counter()
        try:
            self.engine.add_adapter(name, path)
        except AdapterLoadError as e:
            self.failed[name] = path
            logger.warning("lora_load_failed %s", kv(adapter=name, error=e))
            return
        self.loaded[name] = path
        seconds = time.perf_counter() - start
        logger.info("lora_loaded %s", kv(adapter=name, seconds=f"{seconds:.3f}"))

    def _drop(self, name: str) -> None:
        try:
            self.engine.remove_adapter(name)
        except UnknownAdapterError:
            pass  # gone already
        except AdapterLoadError:  # live requests run under it: the next poll tries again
            return
        del self.loaded[name]
        logger.info("lora_unloaded %s", kv(adapter=name))
