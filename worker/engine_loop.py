"""The worker's engine loop: requests in from Redis, one engine step, replies out.

One iteration, each part a bounded number of round trips:
1. publish what a failed round trip left unsent (the outbox);
2. read new cancels and abort those requests if this worker holds them;
3. every SCAN_INTERVAL_S: abort requests of dead gateways, take over orphaned requests (dead
   workers', handed-back ones) while there is room, dead-letter poison ones (worker/takeover.py);
4. if the engine can start more now (worker/admission.py), XREADGROUP exactly that many (BLOCK
   only when idle); drop cancelled or expired entries, reject invalid ones, add the rest to the
   engine (worker/intake.py);
5. one engine step; the deltas of the whole batch and the XACK+XDEL of finished requests go out
   atomically in one round trip (refused if this worker was fenced). A takeover later reads
   those replies back from the request's reply stream to continue after them. With placement,
   the prefix summary's changes (and the resident LoRA adapters) ride along
   (worker/prefix_summary.py).
A heartbeat thread renews the lease while the loop makes progress (worker/lease.py).
A worker never hoards: what it reads it can start now, so another worker gets the rest.

Failures: a step that raises hands its requests back (another worker, or this one, continues
them; a request that keeps failing is dead-lettered); SIGTERM stops reading, finishes in-flight
work within the shutdown timeout and hands back the rest; a Redis outage backs off
(worker/redis_backoff.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.llm_engine import Engine
from protocol import STOP_STRING, CancelMessage, ModelCard, ProtocolError
from worker.adapter_watch import AdapterWatch
from worker.admission import Admission
from worker.failpoints import Failpoints
from worker.intake import Intake
from worker.lease import Lease
from worker.live_snapshot import SnapshotPublisher
from worker.log_fields import kv
from worker.metrics import WorkerMetrics
from worker.prefix_summary import PrefixSummary
from worker.recent_replies import RecentReplies
from worker.redis_backoff import RedisBackoff
from worker.redis_io import Entry, EntryRef, PublishResult, WorkerRedis
from worker.request_book import RequestBook
from worker.service_config import ServiceConfig
from worker.takeover import Takeover
from worker.tracing import worker_traces

logger = logging.getLogger("jitney.worker")

# After the shutdown timeout, how long to keep trying to deliver the last replies.
SHUTDOWN_PUBLISH_GRACE_S = 5.0
# While work waits but no step ran (a dynamic batch filling up), poll instead of spinning.
WAITING_POLL_MS = 5
# This many failed steps in a row (none succeeding in between) and the worker exits non-zero:
# the device is broken, not a request (a poison request fails at most MAX_DELIVERIES times).
MAX_CONSECUTIVE_STEP_FAILURES = 10


@dataclass(slots=True)
class _LoopState:
    inbox: list[Entry] = field(default_factory=list)  # read from the group, not yet taken in
    cancels_after: str | None = None  # last cancel entry seen; None until joined
    stop_at: float | None = None  # monotonic deadline for in-flight work once stopping
    stop_logged: bool = False
    last_step_empty: bool = False
    step_failures: int = 0  # consecutive


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
        self.book = RequestBook(metrics, traces=worker_traces(config.worker_id, card.name))
        self.state = _LoopState()
        self.takeover = Takeover(io)
        self.admission = Admission()
        # The fleet's runtime LoRA adapters, loaded and dropped as gateways register them.
        self.adapters = AdapterWatch(
            io.client, io.keys, card.name, engine, frozenset(card.adapters)
        )
        self.intake = Intake(
            engine, io, self.book, metrics, card, self.takeover, self.admission, self.failpoints
        )
        self.intake.adapters = self.adapters
        self.lease = Lease(io, card, config.stall_timeout_s)
        self.backoff = RedisBackoff(
            on_recovered=self.takeover.after_outage, on_outage=self._resend_recent
        )
        # Replies a gateway may not have read when Redis went away (worker/recent_replies.py).
        self.recent = RecentReplies()
        self.resend = False
        self.snapshots = SnapshotPublisher(io.client, io.keys, config.worker_id, card.name)
        # Prefix-aware placement: what this worker's cache holds, for gateways (None: off).
        self.summary = PrefixSummary(io.summary_key) if io.placement else None

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
        s, book, guarded = self.state, self.book, self.backoff.run
        while s.cancels_after is None:
            if self.stopping:
                return
            guarded(self._join)
        self.lease.start()
        logger.info("worker_ready %s", kv(worker=self.config.worker_id, model=self.card.name))
        try:
            while not (self.stopping and not (book.tracked or s.inbox or book.outbox)):
                self.lease.loop_alive()
                guarded(self._iteration)
                if s.stop_at is None:
                    continue
                if not s.stop_logged:
                    s.stop_logged = True
                    logger.info("stopping %s", kv(in_flight=len(book.tracked)))
                if time.monotonic() >= s.stop_at:
                    guarded(lambda: self._hand_back(graceful=True))
                    if time.monotonic() >= s.stop_at + SHUTDOWN_PUBLISH_GRACE_S:
                        # Still ours in the group: taken over once our lease lapses.
                        logger.error("hand_back_failed %s", kv(requests=len(book.tracked)))
                        break
        finally:
            self.lease.stop()
        guarded(self.io.leave)
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
        if self.summary is not None:
            io.join_placement(self.engine.view.block_size)
            self.summary.restart()
        io.heartbeat(self.card)
        self.state.cancels_after = io.last_cancel_id()

    # ----- one iteration -------------------------------------------------------------------
    def _iteration(self) -> None:
        if self.lease.fenced.is_set():
            self._on_fenced()
        self._publish()  # what a failed round trip left: nothing steps while deltas are unsent
        self._read_cancels()
        if not self.stopping and self.takeover.due():
            self._scan()
        self.adapters.maybe_sync()  # between steps, at most once a second
        if self.adapters.loaded:  # serving adapters now: vLLM's lora info is exported
            self.metrics.lora.enable(self.engine.config.max_loras)
        self._admit()
        if self.engine.has_unfinished():
            self._step()
        self._summarize()
        self._publish()  # the whole step's replies and acks: one round trip
        self.snapshots.maybe_publish(  # the live batch view, twice a second
            self.engine, self.book.tracked, self.metrics.placement.counts
        )
        view = self.engine.view
        self.metrics.set_state(
            view.num_running,
            view.num_waiting,
            view.kv_usage,
            view.kv_free_blocks,
            view.kv_total_blocks,
        )
        self.metrics.lora.observe(view)  # the adapters running and waiting, a few times a second

    def _resend_recent(self) -> None:
        self.resend = True

    def _publish(self) -> None:
        outbox = self.book.outbox
        if self.resend:  # an outage began: what a restart may have lost goes first, once
            outbox.replies[:0] = self.recent.take(time.monotonic())
            self.resend = False
        if outbox:
            start = time.perf_counter()
            status = self.io.publish(outbox)
            self.metrics.observe_publish(time.perf_counter() - start)
            self.book.clear_outbox()
            if status is PublishResult.FENCED:
                self._on_fenced()
                return
            self.recent.published(outbox.replies, outbox.gone_streams, time.monotonic())
            if status is PublishResult.SUMMARY_LOST:
                self.io.placement_lost = True

    def _summarize(self) -> None:
        """The prefix summary's changes go with this step's publish; a stopping worker takes
        its summary down instead (no more placements; what waits in its own streams is
        anyone's at once)."""
        summary, outbox = self.summary, self.book.outbox
        if summary is None or outbox.summary is not None:
            return  # off, or the last changes are still to send (a failed publish)
        if self.stopping:
            self.io.withdraw_summary()
            self.summary = None
            return
        if self.io.placement_lost:  # Redis restarted: the summary and own streams are gone
            self.io.join_placement(self.engine.view.block_size)
            self.io.placement_lost = False
            summary.restart()
        view = self.engine.view
        resident = self.engine.view.resident_adapters
        outbox.summary = summary.update(view, self._num_to_read(), view.num_waiting, resident)

    def _on_fenced(self) -> None:
        """Another worker judged this one dead and took (some of) its requests: drop them all
        without a word (the successors continue them), hand back what is still ours, rejoin."""
        dropped = len(self.book.tracked)
        self._drop_all()
        self.book.clear_outbox()
        if self.summary is not None:  # its writes were refused with the rest
            self.summary.restart()
        released = self.lease.rejoin()
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
        book = self.book
        holds_last_chance = any(r.last_chance for r in book.tracked.values())
        result = self.takeover.scan(self._num_to_read(), holds_last_chance)
        dead = self.intake.dead_gateways = result.dead_gateways
        orphaned = [rid for rid, r in book.tracked.items() if r.gateway_id in dead]
        now = time.monotonic()
        for request_id in orphaned:  # nobody will read the replies: free the slot and KV now
            book.outbox.gone_streams.add(book.tracked[request_id].reply_to)
            for out in self.engine.abort(request_id):
                book.finish(out, now, "the gateway holding this request is gone")
        self.metrics.handoff("gateway_gone", len(orphaned))
        if result.claimed:
            self.intake.take_over(result.claimed)

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
        if not s.inbox and not self.stopping and (count := self._num_to_read()):
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
            self.intake.take(s.inbox)  # its one round trip comes first: a failure keeps the inbox
            s.inbox = []

    def _num_to_read(self) -> int:
        return self.admission.num_to_read(self.engine.view)

    def _preempts_for(self) -> int | None:
        return self.admission.preempts_for(self.engine.view, self.io.queues.values())

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
        self.metrics.observe_row_cost(e.view.draft_row_cost)
        self.state.last_step_empty = e.stats.batch_size == 0
        if self.book.traces is not None:  # tracing on: before the book ends requests
            self.book.traces.on_step(e.view, e.stats, outputs, start, now)
        self.book.on_step(outputs, e.view.first_scheduled_time, start, now)

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
