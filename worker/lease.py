"""The worker's lease: a heartbeat thread that renews it while the loop makes progress, and the
fence another worker sets when it judged this one dead.

The heartbeat renews the lease every HEARTBEAT_INTERVAL_S from a thread of its own: a long step
(a big prefill on a slow device) must not look like a dead worker. It stops renewing when the
loop has not come round for `stall_timeout_s` (a hung step): the lease lapses and other workers
take the requests over. A renewal refused because another worker fenced this one (it judged it
dead and claimed some of its requests) sets `fenced`; the loop then drops every request without
a word and rejoins (`rejoin`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import redis

from protocol import HEARTBEAT_INTERVAL_S, ModelCard
from worker.redis_io import WorkerRedis


@dataclass
class Lease:
    io: WorkerRedis
    card: ModelCard
    stall_timeout_s: float
    fenced: threading.Event = field(default_factory=threading.Event)  # set by the heartbeat
    loop_alive_at: float = field(default_factory=time.monotonic)  # the loop came round
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def loop_alive(self) -> None:
        """The loop came round: the lease may be renewed for another period."""
        self.loop_alive_at = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat_loop, name="jitney-heartbeat")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def rejoin(self) -> int:
        """After a fence (the loop has dropped every request): hand back what is still ours,
        lift the fence and renew the lease. Returns how many entries were handed back."""
        released = self.io.release_own()
        self.io.unfence()
        self.fenced.clear()
        self.io.heartbeat(self.card)
        return released

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            if time.monotonic() - self.loop_alive_at > self.stall_timeout_s:
                continue  # hung: let the lease lapse so others take the work over
            try:
                if not self.io.heartbeat(self.card):
                    self.fenced.set()
            except redis.RedisError:
                pass  # the loop logs the outage and backs off
