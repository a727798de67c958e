"""The batch runner: one task per gateway that runs the lines of unfinished batches.

Every round it renews the leases of the lines it runs, abandons its lines of a batch that is no
longer in progress (cancelled: their requests are cancelled like a client's that left),
finalizes batches that are done, and claims and starts new lines, paced:

- a line starts only while fewer than `batch_max_queued` entries wait unread in the request
  stream (the backlog's lag, interactive requests included), counting the lines this runner
  started that may not show in that reading yet. The stream is FIFO and priorities act only once
  a worker has read an entry, so this keeps an interactive request from ever waiting behind more
  than a few batch lines; the workers read the next ones as soon as they have room, which fills
  idle seats (and the engine preempts them first: BATCH_PRIORITY);
- at most `batch_concurrency` lines run here at once.

A line runs the path of an HTTP request (gateway.serving.request_path: validation, tokenizing,
grammar, admission, the queue) at BATCH_PRIORITY, non-streamed. A 4xx/5xx answer is the line's
result (error file); a transient one (RETRYABLE) hands the line back to be claimed again after
a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from typing import Any

from redis.exceptions import RedisError

from gateway.batch.batch_metrics import BatchMetrics
from gateway.batch.batch_store import Batch, BatchStore, Claimed
from gateway.batch.file_store import FileStore
from gateway.batch.finalize import finalize, result_line
from gateway.batch.input_file import BatchLine
from gateway.openai.errors import ApiError, internal_error
from gateway.serving.gateway_state import Gateway
from gateway.serving.relay import Relay
from gateway.serving.request_path import prepare, submit
from gateway.serving.tasks import cancel_and_wait
from protocol import BATCH_PRIORITY

log = logging.getLogger(__name__)

BATCH_TICK_S = 0.05  # a round's interval while some batch is unfinished
# The line is handed back, not answered: queue full (429), no worker, shutting down or Redis
# (503), dropped past --request-timeout or no reply in time (504): the line runs again later.
RETRYABLE = frozenset({429, 503, 504})
LineKey = tuple[str, int]  # batch id, line index


class BatchRunner:
    def __init__(self, gw: Gateway):
        self.gw = gw
        self.config = gw.config
        self.store = BatchStore(gw.redis, gw.keys)
        self.files = FileStore(gw.redis, gw.keys)
        self.metrics = BatchMetrics(gw.metrics.registry)
        self.running: dict[LineKey, asyncio.Task[None]] = {}
        self.starting = 0  # lines started here that are not in the stream yet
        self.enqueued = 0  # lines this runner has put in the stream, ever
        self.pause_until = 0.0  # after a transient failure: no new lines before this
        self._renewed_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.batch_concurrency > 0:
            self._task = asyncio.create_task(self._loop(), name="jitney-batch-runner")

    async def stop(self) -> None:
        """Stop claiming; the lines still running are cancelled and handed back at once, so
        another gateway runs them without waiting for their leases to lapse."""
        await cancel_and_wait(self._task)
        await self._abandon(list(self.running))

    async def _loop(self) -> None:
        failing = False
        while True:
            busy = False
            try:
                busy = await self.step()
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("batch runner: redis unavailable (%s)", type(e).__name__)
                failing = True
            await asyncio.sleep(BATCH_TICK_S if busy else self.config.batch_poll_s)

    async def step(self) -> bool:
        """One round. True while some batch is unfinished."""
        await self._renew_if_due()
        startable = []
        ids = await self.store.active()
        for batch_id in ids:
            batch = await self.store.get(batch_id)
            if batch is None:
                continue
            if batch.status != "in_progress":
                await self._abandon([k for k in self.running if k[0] == batch_id])
            else:
                startable.append(batch)
            await self._finalize_if_done(batch)
        if startable and not self.gw.draining and time.monotonic() >= self.pause_until:
            await self._start_lines(startable)
        return bool(ids)

    async def _start_lines(self, batches: list[Batch]) -> None:
        seen = self.enqueued  # lines enqueued after this may be missing from the reading
        # Every model's unread entries: a conservative bound when the lines name several models.
        lag = sum(b.lag for b in (await self.gw.backlogs(max_age_s=0)).values())
        unseen = self.starting + self.enqueued - seen
        room = min(
            self.config.batch_max_queued - lag - unseen,
            self.config.batch_concurrency - len(self.running),
        )
        for batch in batches:
            if room <= 0:
                return
            for claimed in await self.store.claim(batch, room, self.config.batch_lease_s):
                key = (batch.id, claimed.index)
                if key in self.running:  # our own lease lapsed (a stalled loop): still running
                    continue
                self.starting += 1
                self.running[key] = asyncio.create_task(self._run(batch.id, claimed))
                room -= 1

    async def _run(self, batch_id: str, claimed: Claimed) -> None:
        in_stream = False

        def enqueued() -> None:
            nonlocal in_stream
            in_stream = True
            self.starting -= 1
            self.enqueued += 1

        try:
            result = await self._execute(claimed, enqueued)
        finally:
            if not in_stream:
                self.starting -= 1
        try:
            if result is None:
                self.pause_until = time.monotonic() + self.config.retry_after_s
                await self.store.release({batch_id: [claimed.index]})
                outcome = "retried"
            else:
                line, ok = result
                recorded = await self.store.record(batch_id, claimed.index, line, ok)
                outcome = ("completed" if ok else "failed") if recorded else "duplicate"
            self.metrics.lines.labels(outcome).inc()
        except (RedisError, OSError) as e:  # the lease lapses and the line runs again
            log.warning("batch line not recorded batch=%s: %s", batch_id, type(e).__name__)
        finally:
            self.running.pop((batch_id, claimed.index), None)

    async def _execute(self, claimed: Claimed, enqueued: Any) -> tuple[str, bool] | None:
        """The line's output line and whether it succeeded; None: hand it back (transient)."""
        if claimed.line is None:
            error = {"code": "input_file_deleted", "message": "The input file was deleted."}
            return result_line("", None, error), False
        line = BatchLine.decode(claimed.line)
        body = {**line.body, "stream": False}  # a batch line is answered whole
        body.pop("stream_options", None)

        async def deliver(relay: Relay) -> dict[str, Any]:
            enqueued()
            return await relay.collect_body()

        try:
            job = await prepare(self.gw, line.kind, body)
            response = await submit(self.gw, job, BATCH_PRIORITY, time.monotonic(), deliver)
        except ApiError as e:
            if e.status in RETRYABLE:
                return None
            return _error_line(line.custom_id, e), False
        except (RedisError, OSError):
            return None
        except Exception as e:  # a bug must not loop the line forever: answer it as HTTP would
            log.error("batch line failed batch line error=%s", type(e).__name__)
            return _error_line(line.custom_id, internal_error()), False
        answer = {"status_code": 200, "request_id": response["id"], "body": response}
        return result_line(line.custom_id, answer), True

    async def _abandon(self, keys: list[LineKey]) -> None:
        """Cancel these lines here (their requests are cancelled) and hand them back."""
        keys = [k for k in keys if k in self.running]
        if not keys:
            return
        tasks = [self.running[k] for k in keys]
        await asyncio.gather(*(cancel_and_wait(t) for t in tasks))
        leases: dict[str, list[int]] = defaultdict(list)
        for batch_id, index in keys:
            leases[batch_id].append(index)
            self.running.pop((batch_id, index), None)
        with contextlib.suppress(RedisError, OSError):  # else their leases lapse instead
            await self.store.release(leases)

    async def _renew_if_due(self) -> None:
        if time.monotonic() - self._renewed_at < self.config.batch_lease_s / 3:
            return
        self._renewed_at = time.monotonic()
        leases: dict[str, list[int]] = defaultdict(list)
        for batch_id, index in self.running:
            leases[batch_id].append(index)
        if leases:
            await self.store.renew(leases, self.config.batch_lease_s)

    async def _finalize_if_done(self, batch: Batch) -> None:
        if batch.status == "in_progress":
            expired = time.time() >= (batch.times["expires_at"] or 0)
            if batch.completed + batch.failed < batch.total and not expired:
                return  # the common case, without a script call
        final = await self.store.begin_finalize(batch.id, self.config.batch_lease_s)
        if final is None:
            return
        if await finalize(self.store, self.files, batch, final):
            self.metrics.batches.labels(final).inc()
            log.info("batch finished id=%s status=%s", batch.id, final)


def _error_line(custom_id: str, error: ApiError) -> str:
    response = {
        "status_code": error.status,
        "request_id": "req_" + uuid.uuid4().hex,
        "body": error.body(),
    }
    return result_line(custom_id, response)
