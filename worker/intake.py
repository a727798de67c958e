"""Requests into the engine: entries read from the queue, and entries a takeover claimed.

Each entry is decoded and checked (worker/wire_checks.py), then either answered at once (a
duplicate delivery, a client that left while it was queued, a past deadline, a gateway that is
gone, a poison request, a takeover whose delivered replies cannot be read back) or started: added
to the engine and tracked in the book. A request the engine refuses (engine/errors.py) gets an
error reply as the client's fault; anything else `Engine.add_request` raises is a bug, handled
as a failed step is: the entry goes back as a failed delivery, and a request that keeps failing
is dead-lettered with a server error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.errors import REJECTIONS
from engine.llm_engine import Engine
from protocol import ModelCard, ProtocolError, ReplyMessage, RequestMessage
from protocol.queue import entry_cost
from worker.adapter_watch import AdapterWatch
from worker.admission import Admission
from worker.failpoints import Failpoints
from worker.log_fields import kv
from worker.metrics import WorkerMetrics
from worker.redis_io import Claimed, Entry, WorkerRedis, resumed_outputs
from worker.request_book import RequestBook, TrackedRequest
from worker.takeover import Takeover
from worker.wire_checks import InvalidRequest, checked_params, decode_request

logger = logging.getLogger("jitney.worker")

INVALID_REQUEST = "invalid_request_error"
# The seq of the error that ends a request whose delivered replies cannot be read back: past
# any seq its gateway has seen, so it is delivered, not dropped as a duplicate.
HISTORY_LOST_SEQ = 2**31


@dataclass
class Intake:
    engine: Engine
    io: WorkerRedis
    book: RequestBook
    metrics: WorkerMetrics
    card: ModelCard
    takeover: Takeover
    admission: Admission
    failpoints: Failpoints
    dead_gateways: set[str] = field(default_factory=set)  # as the last takeover scan found
    adapters: AdapterWatch | None = None  # the fleet's runtime LoRA adapters (None: not watched)

    def take(self, entries: list[Entry]) -> None:
        """Entries this worker read from its queues (one round trip: the dequeue flags)."""
        book = self.book
        messages: list[tuple[Entry, RequestMessage]] = []
        for entry in entries:
            try:
                messages.append((entry, decode_request(entry, self.io.keys)))
            except ProtocolError as e:  # nowhere to reply: drop it, loudly
                logger.warning("bad_request_entry %s", kv(entry=entry.entry_id, error=e))
                book.outbox.acks.append(entry.ref)
        queued = sum(
            len(m.prompt_token_ids) for _, m in messages if isinstance(m.prompt_token_ids, list)
        )
        flags = self.io.dequeue([msg.request_id for _, msg in messages], queued)
        now = time.time()
        for (entry, msg), cancelled in zip(messages, flags, strict=True):
            outcome = self.io.placement_outcome(entry.queue)
            self.metrics.placement.read(outcome, now - msg.enqueue_time)
            request = self._tracked(entry, msg)
            if msg.request_id in book.tracked:  # at-least-once delivery: already serving it
                logger.warning("duplicate_request %s", kv(request=msg.request_id))
                book.outbox.acks.append(entry.ref)
            elif cancelled:  # the client left while it was queued: drop before prefill
                book.reject(msg.request_id, request, "abort", None)
            elif not self._dropped_before_start(msg, request):
                self._start(msg, request)

    def take_over(self, claimed: list[Claimed]) -> None:
        """Continue requests another worker published part of (or dead-letter poison ones)."""
        book = self.book
        for c in claimed:
            try:
                msg = decode_request(c.entry, self.io.keys)
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
            self.book.taken_over(request, len(c.delivered), c.deliveries)  # its trace goes on
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

    def _tracked(self, entry: Entry, msg: RequestMessage, next_seq: int = 0) -> TrackedRequest:
        waited = max(0.0, time.time() - msg.enqueue_time)
        enqueue_time = time.monotonic() - waited
        request = TrackedRequest(entry.ref, msg.reply_to, enqueue_time, msg.gateway_id, next_seq)
        request.key_id = msg.key_id if isinstance(msg.key_id, str) else None
        request.cost = entry_cost(entry.fields)
        request.trace = self.book.open_trace(msg, entry.queue, enqueue_time)  # None: tracing off
        return request

    def _dropped_before_start(self, msg: RequestMessage, request: TrackedRequest) -> bool:
        """End a request whose client cannot get it any more (expired, gateway gone)."""
        if msg.gateway_id in self.dead_gateways:
            self.book.outbox.gone_streams.add(msg.reply_to)
            self.book.reject(msg.request_id, request, "abort", "the gateway is gone")
            self.metrics.handoff("gateway_gone")
            return True
        if msg.deadline is not None and time.time() > msg.deadline:
            self.book.reject(msg.request_id, request, "expired", "deadline passed before start")
            return True
        return False

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

    def _start(
        self,
        msg: RequestMessage,
        request: TrackedRequest,
        delivered: list[ReplyMessage] | None = None,
    ) -> None:
        """Hand a request to the engine; `delivered`: the replies a takeover continues after."""
        e = self.engine
        if self.adapters is not None and isinstance(msg.lora, str):
            self.adapters.ensure(msg.lora)  # registered since the last poll: loaded now
        try:
            params = checked_params(msg, self.card.name, e.vocab_size)
            resumed = None if delivered is None else resumed_outputs(delivered, params.n)
            self.failpoints.before_start(msg.prompt_token_ids)
            e.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                request.enqueue_time,
                resumed,
                priority=msg.priority,
                embed=msg.embed is True,  # /v1/embeddings: a vector, no tokens
                lora=msg.lora,  # a takeover's too: the entry carries it
            )
        except (InvalidRequest, *REJECTIONS) as err:  # too long, infeasible, bad fields
            self.book.reject(msg.request_id, request, "error", str(err), INVALID_REQUEST)
            return
        except Exception:
            self._start_failed(msg, request)
            return
        request.open_choices = len(resumed) if isinstance(resumed, dict) else params.n
        request.adapter = msg.lora
        if delivered:
            request.last_token_time = time.monotonic()
        elif msg.lora is not None:  # a takeover was counted where it started
            self.metrics.lora.started(msg.lora)
        self.book.track(msg.request_id, request)
        self.admission.started(e.view, len(msg.prompt_token_ids), params.max_tokens)
        logger.debug(
            "request_started %s",
            kv(
                request=msg.request_id,
                prompt_tokens=len(msg.prompt_token_ids),
                **({"lora": msg.lora} if msg.lora else {}),
            ),
        )

    def _start_failed(self, msg: RequestMessage, request: TrackedRequest) -> None:
        """The engine raised what is no rejection (a bug, not the client's fault): like a failed
        step, the entry goes back as a failed delivery (nothing was replied), so a request that
        keeps failing is dead-lettered with a server error by whoever takes it next."""
        logger.exception("start_failed %s", kv(request=msg.request_id))
        self.io.release([request.entry], graceful=False)
        self.metrics.handoff("handed_back")
