"""The worker's engine loop: requests in from Redis, one engine step, replies out.

One iteration, each part a bounded number of round trips:
1. publish what a failed round trip left unsent (the outbox);
2. read new cancels and abort those requests if this worker holds them;
3. every SCAN_INTERVAL_S: abort requests of dead gateways, take over orphaned requests (dead
   workers', handed-back ones) while there is room, dead-letter poison ones (worker/takeover.py);
4. if the engine can start more now, XREADGROUP exactly that many (BLOCK only when idle); drop
   cancelled or expired entries, reject invalid ones, add the rest to the engine;
5. one engine step; the deltas of the whole batch, their progress lists and the XACK+XDEL of
   finished requests go out atomically in one round trip (refused if this worker was fenced).
A heartbeat thread renews the lease while the loop makes progress.
A worker never hoards: what it reads it can start now, so another worker gets the rest.

Failures: a step that raises hands its requests back (another worker, or this one, continues
them; a request that keeps failing is dead-lettered); SIGTERM stops reading, finishes in-flight
work within the shutdown timeout and hands back the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from engine.llm_engine import Engine
from protocol import (
    HEARTBEAT_INTERVAL_S,
    PRIORITIES,
    STOP_STRING,
    CancelMessage,
    ModelCard,
    ProtocolError,
    ReplyMessage,
    RequestMessage,
    SamplingParams,
)
from worker.failpoints import Failpoints
from worker.metrics import WorkerMetrics
from worker.redis_io import (
    Claimed,
    Entry,
    EntryRef,
    WorkerRedis,
    entry_cost,
    resumed_outputs,
)
from worker.replies import ReplyBook, TrackedRequest, kv
from worker.snapshot import SnapshotPublisher
from worker.takeover import Takeover

logger = logging.getLogger("jitney.worker")

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0
# After the shutdown timeout, how long to keep trying to deliver the last replies.
SHUTDOWN_PUBLISH_GRACE_S = 5.0
# While work waits but no step ran (a dynamic batch filling up), poll instead of spinning.
WAITING_POLL_MS = 5
TYPICAL_BLOCKS_EMA = 0.2
INVALID_REQUEST = "invalid_request_error"
# This many failed steps in a row (none succeeding in between) and the worker exits non-zero:
# the device is broken, not a request (a poison request fails at most MAX_DELIVERIES times).
MAX_CONSECUTIVE_STEP_FAILURES = 10
# The seq of the error that ends a request whose delivered replies cannot be read back: past
# any seq its gateway has seen, so it is delivered, not dropped as a duplicate.
HISTORY_LOST_SEQ = 2**31


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    worker_id: str
    idle_block_ms: int = 1000
    shutdown_timeout_s: float = 30.0
    # The heartbeat thread stops renewing the lease when the loop has not come round for this
    # long (a hung step): other workers then take its requests over. Longer than any real step.
    stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker id must be non-empty without spaces, got {self.worker_id!r}")
        if not 1 <= self.idle_block_ms <= 60_000:
            raise ValueError(f"idle_block_ms must be in [1, 60000], got {self.idle_block_ms}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.stall_timeout_s <= self.idle_block_ms / 1000:
            raise ValueError(
                f"stall_timeout ({self.stall_timeout_s} s) must exceed the idle block "
                f"({self.idle_block_ms} ms): an idle worker would look hung"
            )


@dataclass(slots=True)
class _LoopState:
    inbox: list[Entry] = field(default_factory=list)  # read from the group, not yet taken in
    cancels_after: str | None = None  # last cancel entry seen; None until joined
    stop_at: float | None = None  # monotonic deadline for in-flight work once stopping
    stop_logged: bool = False
    last_step_empty: bool = False
    typical_blocks: float = 1.0  # KV blocks a request needs at admission (moving average)
    redis_down_since: float | None = None
    backoff_s: float = BACKOFF_START_S
    dead_gateways: set[str] = field(default_factory=set)
    step_failures: int = 0  # consecutive
    loop_alive_at: float = field(default_factory=time.monotonic)  # for the heartbeat thread


class StepFailuresExceeded(RuntimeError):
    """Steps keep failing whatever they run: exit and let the supervisor restart the worker."""


class WorkerService:
    def __init__(
        self,
        engine: Engine,
        io: WorkerRedis,
        config: ServiceConfig,
        metrics: WorkerMetrics,
        card: ModelCard,
        failpoints: Failpoints | None = None,
    ):
        self.engine = engine
        self.io = io
        self.config = config
        self.metrics = metrics
        self.card = card
        self.failpoints = failpoints or Failpoints()
        self.book = ReplyBook(metrics)
        self.state = _LoopState()
        self.takeover = Takeover(io)
        self.snapshots = SnapshotPublisher(io.client, io.keys, config.worker_id, card.name)
        self._fenced = threading.Event()  # set by the heartbeat thread
        self._heartbeat_stop = threading.Event()
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

    @property
    def ready(self) -> bool:
        """Joined and taking work (a stopping worker is not: it only finishes what it has)."""
        return self.state.cancels_after is not None and not self.stopping

    def run(self) -> None:
        s, book = self.state, self.book
        while s.cancels_after is None:
            if self.stopping:
                return
            self._guarded(self._join)
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="jitney-heartbeat")
        heartbeat.start()
        logger.info("worker_ready %s", kv(worker=self.config.worker_id, model=self.card.name))
        try:
            while not (self.stopping and not (book.tracked or s.inbox or book.outbox)):
                s.loop_alive_at = time.monotonic()
                self._guarded(self._iteration)
                if s.stop_at is None:
                    continue
                if not s.stop_logged:
                    s.stop_logged = True
                    logger.info("stopping %s", kv(in_flight=len(book.tracked)))
                if time.monotonic() >= s.stop_at:
                    self._guarded(lambda: self._hand_back(graceful=True))
                    if time.monotonic() >= s.stop_at + SHUTDOWN_PUBLISH_GRACE_S:
                        # Still ours in the group: taken over once our lease lapses.
                        logger.error("hand_back_failed %s", kv(requests=len(book.tracked)))
                        break
        finally:
            self._heartbeat_stop.set()
            heartbeat.join()
        self._guarded(self.io.leave)
        logger.info("worker_stopped %s", kv(worker=self.config.worker_id))

    def _join(self) -> None:
        io = self.io
        io.ensure_group()
        io.publish_card(self.card)  # overwrite: a restarted worker may bring a new tokenizer
        # A restarted worker reusing its id (a pod restart) finds its old entries pending under
        # its name: hand them back so the takeover path continues them.
        released = io.release_own()
        if released:
            logger.warning("released_previous_entries %s", kv(entries=released))
        io.unfence()
        io.heartbeat(self.card)
        self.state.cancels_after = io.last_cancel_id()

    def _heartbeat_loop(self) -> None:
        """Renew the lease every HEARTBEAT_INTERVAL_S while the loop is alive, from a thread of
        its own: a long step (a big prefill on a slow device) must not look like a dead worker."""
        while not self._heartbeat_stop.wait(HEARTBEAT_INTERVAL_S):
            if time.monotonic() - self.state.loop_alive_at > self.config.stall_timeout_s:
                continue  # hung: let the lease lapse so others take the work over
            try:
                if not self.io.heartbeat(self.card):
                    self._fenced.set()
            except redis.RedisError:
                pass  # the loop logs the outage and backs off

    def _guarded(self, fn: Callable[[], None]) -> None:
        """Run one unit of work; on a Redis outage back off (exponentially, capped) and return."""
        s = self.state
        try:
            fn()
        except redis.RedisError as e:  # an outage, or an error reply: never crash the loop
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
            # Every lease lapsed while Redis was away: give the others a lease period to renew
            # theirs before judging anyone dead (no mass takeover of healthy work).
            self.takeover.next_scan = time.monotonic() + self.takeover.lease_s
        s.backoff_s = BACKOFF_START_S

    # ----- one iteration -------------------------------------------------------------------
    def _iteration(self) -> None:
        if self._fenced.is_set():
            self._on_fenced()
        self._publish()  # what a failed round trip left: nothing steps while deltas are unsent
        self._read_cancels()
        if not self.stopping and self.takeover.due():
            self._scan()
        self._admit()
        if self.engine.has_unfinished():
            self._step()
        self._publish()  # the whole step's replies, progress and acks: one round trip
        self.snapshots.maybe_publish(
            self.engine, self.book.tracked
        )  # the live batch view, twice a second
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
            start = time.perf_counter()
            applied = self.io.publish(self.book.outbox)
            self.metrics.observe_publish(time.perf_counter() - start)
            self.book.clear_outbox()
            if not applied:
                self._on_fenced()

    def _on_fenced(self) -> None:
        """Another worker judged this one dead and took (some of) its requests: drop them all
        without a word (the successors continue them), hand back what is still ours, rejoin."""
        dropped = len(self.book.tracked)
        self._drop_all()
        self.book.clear_outbox()
        released = self.io.release_own()
        self.io.unfence()
        self._fenced.clear()
        self.io.heartbeat(self.card)
        logger.warning("fenced %s", kv(dropped=dropped, released=released))

    def _drop_all(self) -> list[EntryRef]:
        """Forget every request locally (engine and book); returns their entry ids."""
        entries = [entry.ref for entry in self.state.inbox]
        self.state.inbox = []
        for request_id in list(self.book.tracked):
            entries.append(self.book.drop(request_id).entry)
        self.engine.reset()
        return entries

    def _hand_back(self, graceful: bool) -> None:
        """Give every request this worker holds to whoever takes it over next (maybe itself),
        after publishing what is already computed. `graceful`: the hand-back does not count as
        a failed delivery (a shutdown), otherwise it does (a failed step)."""
        self._publish()
        entry_ids = self._drop_all()
        self.io.release(entry_ids, graceful)
        self.metrics.handoff("handed_back", len(entry_ids))
        if entry_ids:
            logger.warning("handed_back %s", kv(requests=len(entry_ids), graceful=graceful))

    def _scan(self) -> None:
        s, book = self.state, self.book
        holds_last_chance = any(r.last_chance for r in book.tracked.values())
        result = self.takeover.scan(self._num_admittable(), holds_last_chance)
        s.dead_gateways = result.dead_gateways
        orphaned = [rid for rid, r in book.tracked.items() if r.gateway_id in s.dead_gateways]
        now = time.monotonic()
        for request_id in orphaned:  # nobody will read the replies: free the slot and KV now
            book.outbox.gone_streams.add(book.tracked[request_id].reply_to)
            for out in self.engine.abort(request_id):
                book.finish(out, now, "the gateway holding this request is gone")
        self.metrics.handoff("gateway_gone", len(orphaned))
        if result.claimed:
            self._take_over(result.claimed)

    def _read_cancels(self) -> None:
        s = self.state
        assert s.cancels_after is not None
        entries = self.io.read_cancels(s.cancels_after)
        for entry in entries:
            try:
                cancel = CancelMessage.decode(entry.fields)
            except ProtocolError as e:
                logger.warning("bad_cancel %s", kv(entry=entry.entry_id, error=e))
                continue
            request_id = cancel.request_id
            if request_id not in self.book.tracked:
                continue
            for out in self.engine.abort(request_id, cancel.index):
                if cancel.reason == STOP_STRING:  # the gateway found a stop string: a normal end
                    out.finish_reason = "stop"
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
        elif not s.inbox and not self.stopping and (below := self._preempts_for()) is not None:
            # Full, but a more urgent queue exists: read one entry more urgent than what runs;
            # the engine preempts for it (only what it would preempt for: no hoarding).
            s.inbox = self.io.read_requests(1, None, below=below)
        if s.inbox:
            self._take(s.inbox)  # its one round trip comes first: a failure keeps the inbox
            s.inbox = []

    def _preempts_for(self) -> int | None:
        """The priority below which a full worker still reads (None: it does not): the least
        urgent running one, when some queue of the model is more urgent than it."""
        priorities = self.io.queues.values()
        most_urgent = min(priorities)
        if most_urgent == max(priorities):  # one priority: nothing running is less urgent
            return None
        below = self.engine.preemptible_priority()  # a pass over the running sequences
        return None if below is None or most_urgent >= below else below

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
                book.outbox.acks.append(entry.ref)
        queued = sum(
            len(m.prompt_token_ids) for _, m in messages if isinstance(m.prompt_token_ids, list)
        )
        flags = self.io.dequeue([msg.request_id for _, msg in messages], queued)
        for (entry, msg), cancelled in zip(messages, flags, strict=True):
            request = self._tracked(entry, msg)
            if msg.request_id in book.tracked:  # at-least-once delivery: already serving it
                logger.warning("duplicate_request %s", kv(request=msg.request_id))
                book.outbox.acks.append(entry.ref)
            elif cancelled:  # the client left while it was queued: drop before prefill
                book.reject(msg.request_id, request, "abort", None)
            elif not self._dropped_before_start(msg, request):
                self._start(msg, request)

    def _tracked(self, entry: Entry, msg: RequestMessage, next_seq: int = 0) -> TrackedRequest:
        waited = max(0.0, time.time() - msg.enqueue_time)
        enqueue_time = time.monotonic() - waited
        request = TrackedRequest(entry.ref, msg.reply_to, enqueue_time, msg.gateway_id, next_seq)
        request.key_id = msg.key_id if isinstance(msg.key_id, str) else None
        request.cost = entry_cost(entry.fields)
        return request

    def _dropped_before_start(self, msg: RequestMessage, request: TrackedRequest) -> bool:
        """End a request whose client cannot get it any more (expired, gateway gone)."""
        if msg.gateway_id in self.state.dead_gateways:
            self.book.outbox.gone_streams.add(msg.reply_to)
            self.book.reject(msg.request_id, request, "abort", "the gateway is gone")
            self.metrics.handoff("gateway_gone")
            return True
        if msg.deadline is not None and time.time() > msg.deadline:
            self.book.reject(msg.request_id, request, "expired", "deadline passed before start")
            return True
        return False

    def _take_over(self, claimed: list[Claimed]) -> None:
        """Continue requests another worker published part of (or dead-letter poison ones)."""
        book = self.book
        for c in claimed:
            try:
                msg = self._decode(c.entry)
            except ProtocolError as e:
                logger.warning("bad_request_entry %s", kv(entry=c.entry.entry_id, error=e))
                book.outbox.acks.append(c.entry.ref)
                continue
            if msg.request_id in book.tracked:  # already ours (a rejoin raced the takeover)
                continue
            if c.delivered is None:  # its reply stream lost part of what was delivered
                self._history_lost(c.entry, msg)
                continue
            request = self._tracked(c.entry, msg, next_seq=len(c.delivered))
            request.last_chance = self.takeover.is_last_chance(c.deliveries)
            if self.takeover.is_poison(c):
                reason = f"failed on {c.deliveries - 1} deliveries"
                self.io.dead_letter(c.entry, reason)
                book.reject(
                    msg.request_id,
                    request,
                    "error",
                    f"The request could not be served ({reason}); it was dead-lettered.",
                    "server_error",
                )
                self.metrics.handoff("dead_lettered")
                logger.error("dead_lettered %s", kv(request=msg.request_id, reason=reason))
            elif not self._dropped_before_start(msg, request):
                self._start(msg, request, c.delivered)
                self.metrics.handoff("taken_over")
                logger.warning(
                    "taken_over %s",
                    kv(request=msg.request_id, replies=len(c.delivered), deliveries=c.deliveries),
                )

    def _history_lost(self, entry: Entry, msg: RequestMessage) -> None:
        """End a request that cannot be continued exactly (what its client got is unknown): an
        error its gateway delivers whatever seq it expects (a seq past any it has seen)."""
        request = self._tracked(entry, msg, next_seq=HISTORY_LOST_SEQ)
        self.book.reject(
            msg.request_id,
            request,
            "error",
            "The request's partial output could not be recovered after its worker failed.",
            "server_error",
        )
        self.metrics.handoff("history_lost")
        logger.error("history_lost %s", kv(request=msg.request_id))

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

    def _start(
        self,
        msg: RequestMessage,
        request: TrackedRequest,
        delivered: list[ReplyMessage] | None = None,
    ) -> None:
        """Hand a request to the engine; `delivered`: the replies a takeover continues after."""
        e = self.engine
        try:
            params = self._sampling_params(msg)
            resumed = None if delivered is None else resumed_outputs(delivered, params.n)
            if msg.priority not in PRIORITIES:
                raise ValueError(f"priority must be in [{PRIORITIES[0]}, {PRIORITIES[-1]}]")
            e.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                request.enqueue_time,
                resumed,
                priority=msg.priority,
            )
        except (ValueError, TypeError, KeyError) as err:  # too long, infeasible, bad fields
            self.book.reject(msg.request_id, request, "error", str(err), INVALID_REQUEST)
            return
        request.open_choices = len(resumed) if isinstance(resumed, dict) else params.n
        if delivered:
            request.last_token_time = time.monotonic()
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
        return msg.sampling_params

    # ----- stepping -----------------------------------------------------------------------
    def _step(self) -> None:
        e = self.engine
        start = time.monotonic()
        try:
            self.failpoints.before_step(e)
            outputs = e.step()
        except Exception:
            self._step_failed()
            return
        self.state.step_failures = 0
        now = time.monotonic()
        self.metrics.observe_step(e.stats, now - start)
        self.metrics.observe_phases(e.last_step_timing)
        self.state.last_step_empty = e.stats.batch_size == 0
        self.book.on_step(outputs, e.first_scheduled_time, start, now)

    def _step_failed(self) -> None:
        """A step raised (a device error, a bug some request triggers): nothing of the step was
        published, so hand everything back; each request counts a failed delivery, and one that
        keeps failing is dead-lettered by whoever takes it next."""
        s = self.state
        s.step_failures += 1
        logger.exception(
            "step_failed %s", kv(in_flight=len(self.book.tracked), consecutive=s.step_failures)
        )
        self._hand_back(graceful=False)
        if s.step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise StepFailuresExceeded(f"{s.step_failures} steps failed in a row")
