"""The loop's units of work under Redis outages: back off, never crash, say so once each way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from worker.log_fields import kv

logger = logging.getLogger("jitney.worker")

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0


@dataclass(slots=True)
class RedisBackoff:
    on_recovered: Callable[[], None]  # called once Redis answers again after an outage
    on_outage: Callable[[], None] = lambda: None  # called when an outage begins
    down_since: float | None = None  # monotonic
    delay_s: float = BACKOFF_START_S

    def run(self, fn: Callable[[], None]) -> None:
        """Run one unit of work; on a Redis outage back off (exponentially, capped) and return."""
        try:
            fn()
        except redis.RedisError as e:  # an outage, or an error reply: never crash the loop
            if self.down_since is None:
                self.down_since = time.monotonic()
                logger.warning("redis_unavailable %s", kv(error=type(e).__name__, detail=e))
                self.on_outage()
            time.sleep(self.delay_s)
            self.delay_s = min(2 * self.delay_s, BACKOFF_MAX_S)
            return
        if self.down_since is not None:
            down = time.monotonic() - self.down_since
            logger.warning("redis_recovered %s", kv(down_s=f"{down:.1f}"))
            self.down_since = None
            self.on_recovered()
        self.delay_s = BACKOFF_START_S
