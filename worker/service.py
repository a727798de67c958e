"""The worker's engine loop: requests in from Redis, one engine step, replies out.

One iteration, each part a bounded number of round trips:
1. publish what a failed round trip left unsent (the outbox);
2. read new cancels and abort those requests if this worker holds them;
3. if the engine can start more now, XREADGROUP exactly that many (BLOCK only when idle); drop
   cancelled or expired entries, reject invalid ones, add the rest to the engine;
4. one engine step; the deltas of the whole batch and the XACKs of finished requests go out in
   one pipelined round trip;
5. heartbeat when due.
A worker never hoards: what it reads it can start now, so another worker gets the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from jitney.protocol import (
    HEARTBEAT_INTERVAL_S,
    CancelMessage,
    ModelCard,
    ProtocolError,
    RequestMessage,
)
from worker.engine import Engine
from worker.metrics import WorkerMetrics
from worker.redis_io import Entry, WorkerRedis
from worker.replies import ReplyBook, TrackedRequest, kv
from worker.sampling import SamplingParams

logger = logging.getLogger("jitney.worker")

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0
# After the shutdown timeout, how long to keep trying to deliver the last replies.
SHUTDOWN_PUBLISH_GRACE_S = 5.0
# While work waits but no step ran (a dynamic batch filling up), poll instead of spinning.
WAITING_POLL_MS = 5
TYPICAL_BLOCKS_EMA = 0.2
INVALID_REQUEST = "invalid_request_error"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    worker_id: str
    idle_block_ms: int = 1000
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker id must be non-empty without spaces, got {self.worker_id!r}")
        if not 1 <= self.idle_block_ms <= 60_000:
            raise ValueError(f"idle_block_ms must be in [1, 60000], got {self.idle_block_ms}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout_s}")


@dataclass(slots=True)
class _LoopState:
    inbox: list[Entry] = field(default_factory=list)  # read from the group, not yet taken in
    cancels_after: str | None = None  # last cancel entry seen; None until joined
    next_heartbeat: float = 0.0
    stop_at: float | None = None  # monotonic deadline for in-flight work once stopping
    stop_logged: bool = False
    last_step_empty: bool = False
    typical_blocks: float = 1.0  # KV blocks a request needs at admission (moving average)
    redis_down_since: float | None = None
    backoff_s: float = BACKOFF_START_S


class WorkerService:
    def __init__(
        self,
        engine: Engine,
        io: WorkerRedis,
        config: ServiceConfig,
        metrics: WorkerMetrics,
        card: ModelCard,
    ):
        self.engine = engine
        self.io = io
        self.config = config
        self.metrics = metrics
        self.card = card
        self.book = ReplyBook(metrics)
        self.state = _LoopState()
        # Requests reserve prompt + max_tokens at admission under these settings.
        self._reserves = engine.config.reserve_full_length or engine.config.batching != "continuous"

    # ----- lifecycle -----------------------------------------------------------------------
    def request_stop(self) -> None:
        """First call: stop reading, finish in-flight work within the timeout. Second: abort now.
        Safe in a signal handler: it only sets a deadline."""
        now = time.monotonic()
        first = self.state.stop_at is None
        self.state.stop_at = now + self.config.shutdown_timeout_s if first else now

    @property
    def stopping(self) -> bool:
        return self.state.stop_at is not None

    def run(self) -> None:
        s, book = self.state, self.book
        while s.cancels_after is None:
            if self.stopping:
                return
            self._guarded(self._join)
        logger.info("worker_ready %s", kv(worker=self.config.worker_id, model=self.card.name))
        while not (self.stopping and not (book.tracked or s.inbox or book.outbox)):
            self._guarded(self._iteration)
            if s.stop_at is None:
                continue
            if not s.stop_logged:
                s.stop_logged = True
                logger.info("stopping %s", kv(in_flight=len(book.tracked)))
            if time.monotonic() >= s.stop_at:
                self._abort_all("worker shutting down")
                if time.monotonic() >= s.stop_at + SHUTDOWN_PUBLISH_GRACE_S:
                    logger.error("replies_lost %s", kv(requests=len(book.tracked) + len(s.inbox)))
                    break
        self._guarded(self.io.leave)
        logger.info("worker_stopped %s", kv(worker=self.config.worker_id))

    def _join(self) -> None:
        self.io.ensure_group()
        self.io.publish_card(self.card)  # overwrite: a restarted worker may bring a new tokenizer
        self.state.cancels_after = self.io.last_cancel_id()

    def _guarded(self, fn: Callable[[], None]) -> None:
        """Run one unit of work; on a Redis outage back off (exponentially, capped) and return."""
        s = self.state
        try:
            fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if s.redis_down_since is None:
                s.redis_down_since = time.monotonic()
                logger.warning("redis_unavailable %s", kv(error=type(e).__name__, detail=e))
            time.sleep(s.backoff_s)
            s.backoff_s = min(2 * s.backoff_s, BACKOFF_MAX_S)
            return
        if s.redis_down_since is not None:
            down = time.monotonic() - s.redis_down_since
            logger.warning("redis_recovered %s", kv(down_s=f"{down:.1f}"))
            s.redis_down_since = None
        s.backoff_s = BACKOFF_START_S

    # ----- one iteration -------------------------------------------------------------------
    def _iteration(self) -> None:
        s = self.state
        self._publish()  # what a failed round trip left: nothing steps while deltas are unsent
        self._read_cancels()
        self._admit()
        if self.engine.has_unfinished():
            self._step()
        self._publish()  # the whole step's replies and acks: one round trip
        if time.monotonic() >= s.next_heartbeat:
            self.io.heartbeat(self.card)
            s.next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL_S
        kv_blocks = self.engine.block_manager
        self.metrics.set_state(
            self.engine.num_running,
            self.engine.num_waiting,
            kv_blocks.usage,
            kv_blocks.num_free_blocks,
            kv_blocks.num_blocks,
        )

    def _publish(self) -> None:
        if self.book.outbox:
            self.io.publish(self.book.outbox)
            self.book.clear_outbox()

    def _read_cancels(self) -> None:
        s = self.state
        assert s.cancels_after is not None
        entries = self.io.read_cancels(s.cancels_after)
        for entry in entries:
            try:
                request_id = CancelMessage.decode(entry.fields).request_id
            except ProtocolError as e:
                logger.warning("bad_cancel %s", kv(entry=entry.entry_id, error=e))
                continue
            out = self.engine.abort(request_id) if request_id in self.book.tracked else None
            if out is not None:
                self.book.finish(out, time.monotonic())
        if entries:
            s.cancels_after = entries[-1].entry_id

    def _admit(self) -> None:
        s = self.state
        if not s.inbox and not self.stopping and (count := self._num_admittable()):
            if not self.engine.has_unfinished():
                block_ms: int | None = self.config.idle_block_ms
            else:
                block_ms = WAITING_POLL_MS if s.last_step_empty else None
            s.inbox = self.io.read_requests(count, block_ms)
        if s.inbox:
            self._take(s.inbox)  # its one round trip comes first: a failure keeps the inbox
            s.inbox = []

    def _num_admittable(self) -> int:
        """How many new requests the engine can start now (never more: no hoarding)."""
        e = self.engine
        if e.config.batching != "continuous":
            # A static/dynamic batch runs to completion: read only to assemble the next one.
            return 0 if e.num_running else max(0, e.config.max_num_seqs - e.num_waiting)
        if e.num_waiting:
            return 0  # what was read is not admitted yet
        free_slots = e.config.max_num_seqs - e.num_running
        fit = int(e.block_manager.num_free_blocks // self.state.typical_blocks)
        return max(0, min(free_slots, fit if e.num_running else max(fit, 1)))

    def _take(self, entries: list[Entry]) -> None:
        book = self.book
        messages: list[tuple[Entry, RequestMessage]] = []
        for entry in entries:
            try:
                messages.append((entry, self._decode(entry)))
            except ProtocolError as e:  # nowhere to reply: drop it, loudly
                logger.warning("bad_request_entry %s", kv(entry=entry.entry_id, error=e))
                book.outbox.acks.append(entry.entry_id)
        flags = self.io.cancel_flags([msg.request_id for _, msg in messages])
        now_wall, now = time.time(), time.monotonic()
        for (entry, msg), cancelled in zip(messages, flags, strict=True):
            waited = max(0.0, now_wall - msg.enqueue_time)
            request = TrackedRequest(entry.entry_id, msg.reply_to, now - waited)
            if msg.request_id in book.tracked:  # at-least-once delivery: already serving it
                logger.warning("duplicate_request %s", kv(request=msg.request_id))
                book.outbox.acks.append(entry.entry_id)
            elif cancelled:  # the client left while it was queued: drop before prefill
                book.reject(msg.request_id, request, "abort", None)
            elif msg.deadline is not None and now_wall > msg.deadline:
                book.reject(msg.request_id, request, "expired", "deadline passed before start")
            else:
                self._start(msg, request)

    def _decode(self, entry: Entry) -> RequestMessage:
        msg = RequestMessage.decode(entry.fields)
        if not isinstance(msg.reply_to, str) or not msg.reply_to.startswith(
            self.io.keys.replies("")
        ):
            raise ProtocolError("request: reply_to is not a reply stream of this deployment")
        times_ok = isinstance(msg.enqueue_time, int | float) and isinstance(
            msg.deadline, int | float | None
        )
        if not isinstance(msg.request_id, str) or not times_ok:
            raise ProtocolError("request: request_id, enqueue_time or deadline of the wrong type")
        return msg

    def _start(self, msg: RequestMessage, request: TrackedRequest) -> None:
        e = self.engine
        try:
            params = self._sampling_params(msg)
            e.add_request(msg.request_id, msg.prompt_token_ids, params, request.enqueue_time)
        except (ValueError, TypeError) as err:  # too long, infeasible, bad fields
            self.book.reject(msg.request_id, request, "error", str(err), INVALID_REQUEST)
            return
        self.book.track(msg.request_id, request)
        need = len(msg.prompt_token_ids) + (params.max_tokens - 1 if self._reserves else 0)
        blocks = e.block_manager.blocks_for(need)
        s = self.state
        s.typical_blocks += TYPICAL_BLOCKS_EMA * (blocks - s.typical_blocks)
        logger.debug(
            "request_started %s",
            kv(request=msg.request_id, prompt_tokens=len(msg.prompt_token_ids)),
        )

    def _sampling_params(self, msg: RequestMessage) -> SamplingParams:
        """Checks the engine cannot make itself (a bad token id would crash the whole batch)."""
        if msg.model != self.card.name:
            raise ValueError(f"model {msg.model!r} is not served here (this is {self.card.name!r})")
        ids, vocab = msg.prompt_token_ids, self.engine.vocab_size
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be a list of token ids in [0, {vocab})")
        f = msg.sampling_fields
        return SamplingParams(
            max_tokens=f.max_tokens,
            temperature=f.temperature,
            top_p=f.top_p,
            top_k=f.top_k,
            seed=f.seed,
            stop=tuple(f.stop),
            stop_token_ids=tuple(f.stop_token_ids),
            ignore_eos=f.ignore_eos,
        )

    # ----- stepping -----------------------------------------------------------------------
    def _step(self) -> None:
        e = self.engine
        start = time.monotonic()
        outputs = e.step()
        now = time.monotonic()
        self.metrics.observe_step(e.stats, now - start)
        self.state.last_step_empty = e.stats.batch_size == 0
        self.book.on_step(outputs, e.first_scheduled_time, start, now)

    def _abort_all(self, error: str) -> None:
        now = time.monotonic()
        for request_id in list(self.book.tracked):
            out = self.engine.abort(request_id)
            if out is not None:
                self.book.finish(out, now, error, "server_error")
