"""Each queue script's call: its KEYS and ARGV built from typed values, and its reply read back.

The layouts scripts.py documents are built here only: neither end indexes a script's KEYS or
ARGV itself.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

from protocol.keys import REPLY_STREAM_MAXLEN, WORKER_GROUP, Keys
from protocol.messages import (
    BATCH_FIELD,
    MESSAGE_FIELD,
    VERSION_FIELD,
    ReplyMessage,
    encode_replies,
)
from protocol.queue.entry import COST_FIELD, Fields, Queue
from protocol.queue.placement import STEAL_AFTER_MS, UNREAD_COUNT_BOUND, SummaryUpdate

# Tokens a weight-1 queue gets per round of the deficit round robin. A top-up grants just enough
# rounds for the next queue to go (computed, not looped), so a small quantum costs nothing and
# interleaves request by request: no queue banks credit that a queue arriving later must wait out.
DRR_QUANTUM = 1
READ_ALL = 1_000_000_000  # `below` for reading every priority


class ScriptCall(NamedTuple):
    """What a registered script is called with: `script(keys=call.keys, args=call.args)`."""

    keys: list[str]
    args: list[str | int | float]


class ReadReply(NamedTuple):
    queues: dict[str, int]  # every queue of the model -> its priority
    entries: list[tuple[str, str, Fields]]  # (queue, entry id, fields), in read order


def enqueue_call(
    keys: Keys, model: str, queue: Queue, fields: dict[str, str], prompt_tokens: int
) -> ScriptCall:
    """ENQUEUE one request's entry (`encode_entry`'s fields) into `queue`."""
    stream = queue.stream(keys, model)
    return ScriptCall(
        [keys.queues(model), keys.queue_weights(model), stream, keys.queued_tokens(model)],
        [
            queue.priority,
            queue.weight,
            WORKER_GROUP,
            fields[VERSION_FIELD],
            fields[MESSAGE_FIELD],
            fields[COST_FIELD],
            prompt_tokens,
        ],
    )


def backlog_call(keys: Keys, model: str, count_bound: int) -> ScriptCall:
    """BACKLOG of `model`; a queue whose lag Redis cannot say is counted up to `count_bound`."""
    return ScriptCall(
        [keys.queues(model), keys.requests(model), keys.queued_tokens(model)],
        [WORKER_GROUP, count_bound],
    )


def read_call(
    keys: Keys,
    model: str,
    consumer: str,
    count: int,
    below: int | None = None,
    placed: bool = False,
    steal: bool = False,
    steal_after_ms: int = STEAL_AFTER_MS,
) -> ScriptCall:
    """READ up to `count` entries for `consumer`, only those more urgent than `below` if given.
    `placed`: its own streams too, and (`steal`) others' it may take (placement.py)."""
    queue_keys = [keys.queues(model), keys.queue_weights(model), keys.queue_deficits(model)]
    call = ScriptCall(
        [*queue_keys, keys.requests(model)],
        [WORKER_GROUP, consumer, count, READ_ALL if below is None else below, DRR_QUANTUM],
    )
    if placed:
        call.keys.append(keys.queue_owners(model))
        call.args.extend([keys.own_suffix(""), keys.prefix_summary(""), steal_after_ms, int(steal)])
    return call


def read_reply(reply: list[Any]) -> ReadReply:
    """READ's reply: the model's queues (flat: queue, priority, ...) and the entries read, each
    with its fields flat as Lua returns them."""
    listed, found = reply[:2]
    queues = {_text(listed[i]): int(float(listed[i + 1])) for i in range(0, len(listed), 2)}
    entries = [
        (_text(queue), _text(entry_id), dict(zip(flat[::2], flat[1::2], strict=True)))
        for queue, entry_id, flat in found
    ]
    return ReadReply(queues, entries)


def publish_call(
    keys: Keys,
    worker_id: str,
    model: str,
    replies: Iterable[tuple[str, ReplyMessage]],
    gone_streams: Collection[str],
    acks: Iterable[tuple[str, str]],
    refunds: Iterable[tuple[str, int]],
    summary: SummaryUpdate | None = None,
) -> ScriptCall:
    """PUBLISH one step: `replies` as (reply stream, reply), one entry per stream in order (a
    stream in `gone_streams` is written only if it still exists); `acks` as (queue, entry id);
    `refunds` as (queue, tokens); a prefix summary's changes."""
    args: list[str | int | float] = [WORKER_GROUP, REPLY_STREAM_MAXLEN]
    by_stream: dict[str, list[ReplyMessage]] = {}
    for stream, reply in replies:  # in order: a request's seqs stay in order
        by_stream.setdefault(stream, []).append(reply)
    for stream, batch in by_stream.items():
        fields = encode_replies(batch)
        nomkstream = int(stream in gone_streams)
        args += ["R", stream, nomkstream, fields[VERSION_FIELD], fields[BATCH_FIELD]]
    for queue, entry_id in acks:
        args += ["A", queue, entry_id]
    for queue, tokens in refunds:
        args += ["F", queue, tokens]
    if summary:
        args += summary.args()
    return ScriptCall([keys.fenced(worker_id), keys.queue_deficits(model)], args)


def heartbeat_call(
    keys: Keys, worker_id: str, model: str, card: str, now: float, summary_ttl_ms: int = 0
) -> ScriptCall:
    """HEARTBEAT of `worker_id`, serving `model` (whose card is named `card`), at unix `now`;
    its prefix summary's expiry renewed to `summary_ttl_ms` when it publishes one."""
    call = ScriptCall(
        [keys.fenced(worker_id), keys.workers, keys.model(card), keys.model_workers(model)],
        [worker_id, now],
    )
    if summary_ttl_ms:
        call.keys.append(keys.prefix_summary(worker_id))
        call.args.append(summary_ttl_ms)
    return call


def lookup_call(
    keys: Keys,
    model: str,
    queue: Queue,
    workers: Sequence[str],
    hashes: Sequence[bytes],
    adapter: str | None = None,
) -> ScriptCall:
    """LOOKUP how much of a prompt (its block hashes, summary form) each of `workers` holds,
    and whether it holds the LoRA `adapter` the prompt runs under resident."""
    found: list[str] = []
    for worker in workers:
        found += [keys.prefix_summary(worker), queue.stream(keys, model, worker)]
    return ScriptCall(found, [WORKER_GROUP, UNREAD_COUNT_BOUND, adapter or "", *hashes])


def place_call(
    keys: Keys,
    model: str,
    queue: Queue,
    worker: str,
    fields: dict[str, str],
    prompt_tokens: int,
) -> ScriptCall:
    """PLACE one request's entry into `worker`'s own stream of `queue` (or `queue`'s own)."""
    call = enqueue_call(keys, model, queue, fields, prompt_tokens)
    own = queue.stream(keys, model, worker)
    call.keys.extend([keys.queue_owners(model), own, keys.prefix_summary(worker)])
    call.args.append(worker)
    return call


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
