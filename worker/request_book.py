"""Per-request bookkeeping between the engine and the reply streams.

For every request a worker read and has not finished: its stream entry (to XACK), where its
replies go, the next reply seq (0, 1, 2, ... with no gaps: the gateway drops duplicates by it) and
its timing for the latency metrics. Replies and acks collect in an outbox that the loop publishes
in one round trip per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from protocol import ReplyMessage, RequestMessage, pack_vector
from worker.log_fields import kv
from worker.metrics import WorkerMetrics
from worker.redis_io import EntryRef, Outbox
from worker.tracing import HANDED_BACK, RequestTrace, WorkerTraces

logger = logging.getLogger("jitney.worker")


def wire_logprobs(logprobs: list[TokenLogprobs] | None) -> list[list[Any]] | None:
    """ReplyMessage.logprobs: per token [log-prob, [[id, log-prob], ...]]."""
    if logprobs is None:
        return None
    return [[lp.logprob, [list(pair) for pair in lp.top]] for lp in logprobs]


@dataclass(slots=True)
class TrackedRequest:
    entry: EntryRef  # its request queue's entry
    reply_to: str
    enqueue_time: float  # the gateway's enqueue time on this process's time.monotonic() clock
    gateway_id: str = ""
    next_seq: int = 0  # a takeover continues the seq of the replies already published
    last_token_time: float | None = None
    last_chance: bool = False  # one more failure and it is dead-lettered
    open_choices: int = 1  # choices (n) not finished yet: the request ends with the last one
    key_id: str | None = None  # the API key it came with (the live view shows it)
    cost: int = 0  # tokens its queue was charged when read (prompt + max_tokens of each choice)
    used: int = 0  # completion tokens of its finished choices
    trace: RequestTrace | None = None  # what its spans will say (None: tracing off)
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)


@dataclass(slots=True)
class RequestBook:
    metrics: WorkerMetrics
    tracked: dict[str, TrackedRequest] = field(default_factory=dict)
    unscheduled: set[str] = field(default_factory=set)  # queue delay not yet observed
    outbox: Outbox = field(default_factory=Outbox)
    traces: WorkerTraces | None = None  # OpenTelemetry spans of the requests (None: off)

    def open_trace(
        self, msg: RequestMessage, stream: str, enqueue_time: float
    ) -> RequestTrace | None:
        """A request read (or claimed) now: its trace, continuing its entry's (None: off)."""
        if self.traces is None:
            return None
        return self.traces.open(msg, stream, time.monotonic(), enqueue_time)

    def taken_over(self, request: TrackedRequest, num_replies: int, deliveries: int) -> None:
        if request.trace is not None:
            request.trace.mark_taken_over(num_replies, deliveries)

    def track(self, request_id: str, request: TrackedRequest) -> None:
        self.tracked[request_id] = request
        if request.next_seq == 0:  # a takeover's queue delay and TTFT were observed before
            self.unscheduled.add(request_id)
        if self.traces is not None and request.trace is not None:
            self.traces.started(request_id, request.trace)

    def drop(self, request_id: str) -> TrackedRequest:
        """Forget a request without any reply (handed back, or taken over by another worker)."""
        self.unscheduled.discard(request_id)
        request = self.tracked.pop(request_id)
        self._end_trace(request_id, request, time.monotonic(), HANDED_BACK)
        return request

    def clear_outbox(self) -> None:
        """After a successful publish (a failed one leaves the outbox to retry whole)."""
        self.outbox = Outbox()

    def on_step(
        self,
        outputs: list[RequestOutput],
        first_scheduled_time: Callable[[str], float | None],
        start: float,
        now: float,
    ) -> None:
        """A step ran from `start` to `now` (monotonic): its deltas and finals, and metrics."""
        finished = {out.request_id for out in outputs if out.finished}
        for request_id in list(self.unscheduled):
            # One that finished in this very step was first scheduled at its start.
            first = start if request_id in finished else first_scheduled_time(request_id)
            if first is not None:
                delay = first - self.tracked[request_id].enqueue_time
                self.metrics.queue_delay.observe(max(0.0, delay))
                self.unscheduled.discard(request_id)
        for out in outputs:
            request = self.tracked[out.request_id]
            if out.new_token_ids:
                self.metrics.generation_tokens.inc(len(out.new_token_ids))
                if request.last_token_time is None:
                    self.metrics.ttft.observe(max(0.0, now - request.enqueue_time))
                else:
                    self.metrics.itl.observe(now - request.last_token_time)
                request.last_token_time = now
            if out.finished:
                self.finish(out, now)
            else:
                self._send_output(out, request)

    def finish(
        self,
        out: RequestOutput,
        now: float,
        error: str | None = None,
        error_type: str | None = None,
    ) -> None:
        """A choice of a request the engine ran reached its terminal state: its final reply;
        with the request's last choice also the XACK and the request's metrics."""
        request = self.tracked[out.request_id]
        reason = out.finish_reason or "abort"
        request.open_choices -= 1
        request.used += out.num_output_tokens
        self.metrics.speculated(
            out.num_draft_tokens, out.num_accepted_tokens, out.num_verifications
        )
        if request.trace is not None:
            choice = {"index": out.index, "reason": reason, "tokens": out.num_output_tokens}
            if out.num_verifications:
                choice |= {
                    "draft_tokens": out.num_draft_tokens,
                    "accepted_draft_tokens": out.num_accepted_tokens,
                }
            request.trace.phase_events().append(("finished", now, choice))
        if request.open_choices == 0:  # the other choices' finals came before
            del self.tracked[out.request_id]
            self.unscheduled.discard(out.request_id)
        self._send_output(
            out,
            request,
            finish_reason=reason,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            draft_tokens=out.num_draft_tokens,
            accepted_draft_tokens=out.num_accepted_tokens,
            error=error,
            error_type=error_type,
        )
        if request.open_choices > 0:
            return
        self.outbox.acks.append(request.entry)
        self._refund(request, out.num_prompt_tokens + request.used)
        self.metrics.finished(reason, out.num_prompt_tokens, now - request.enqueue_time)
        self._end_trace(
            out.request_id,
            request,
            now,
            reason,
            error_type,
            **{
                "gen_ai.usage.input_tokens": out.num_prompt_tokens,
                "gen_ai.usage.output_tokens": request.used,
                "jitney.usage.cached_tokens": out.num_cached_tokens,
            },
        )
        logger.debug(
            "request_finished %s",
            kv(
                request=out.request_id,
                **({"lora": request.adapter} if request.adapter else {}),
                reason=reason,
                completion_tokens=out.num_output_tokens,
                draft_tokens=out.num_draft_tokens,
                accepted_draft_tokens=out.num_accepted_tokens,
            ),
        )

    def _refund(self, request: TrackedRequest, used: int) -> None:
        """Fair share is charged at the bound a request may use; what it did not use goes back
        to its queue, so a tenant whose requests stop early is not held to its max_tokens."""
        if request.cost > used:
            self.outbox.refunds.append((request.entry.queue, request.cost - used))

    def reject(
        self,
        request_id: str,
        request: TrackedRequest,
        reason: str,
        error: str | None,
        error_type: str | None = None,
    ) -> None:
        """End a request that never reached the engine: its only reply is the final one."""
        self._send(
            request_id, request, [], "", finish_reason=reason, error=error, error_type=error_type
        )
        self.outbox.acks.append(request.entry)
        self._refund(request, 0)
        self.metrics.finished(reason, 0, None)
        self._end_trace(request_id, request, time.monotonic(), reason, error_type)
        logger.debug("request_dropped %s", kv(request=request_id, reason=reason))

    def _end_trace(
        self,
        request_id: str,
        request: TrackedRequest,
        now: float,
        reason: str,
        error_type: str | None = None,
        **attributes: object,
    ) -> None:
        if self.traces is not None and request.trace is not None:
            if error_type is not None:
                attributes["error.type"] = error_type
            self.traces.end(request_id, request.trace, now, reason, **attributes)
            request.trace = None

    def _send_output(self, out: RequestOutput, request: TrackedRequest, **final: object) -> None:
        """One engine output as a reply: its tokens, text and log-probs (and `final` fields)."""
        if out.prompt_logprobs is not None:
            final["prompt_logprobs"] = wire_logprobs(out.prompt_logprobs)
        if out.embedding is not None:
            final["embedding"] = pack_vector(out.embedding.tolist())
        logprobs = wire_logprobs(out.logprobs)
        self._send(
            out.request_id,
            request,
            out.new_token_ids,
            out.delta_text,
            logprobs=logprobs,
            index=out.index,
            **final,
        )

    def _send(
        self,
        request_id: str,
        request: TrackedRequest,
        token_ids: list[int],
        text: str,
        **final: object,
    ) -> None:
        reply = ReplyMessage(request_id, request.next_seq, token_ids, text, **final)  # type: ignore[arg-type]
        self.outbox.replies.append((request.reply_to, reply))
        request.next_seq += 1
