"""The wire protocol between gateways and workers: Redis key names and typed messages.

Nothing else in the code base spells a key name. Every message is one stream entry (or hash) with
two fields: `v` (the protocol version) and `m` (the message as JSON). A reader refuses a version
it does not know instead of misreading it.

Keys (prefix `jitney` by default, so several deployments can share one Redis):
- `{p}:requests`            stream of RequestMessage; consumer group `workers`. A worker XACKs
                            and XDELs an entry with its final reply, so the stream holds only
                            queued and in-progress requests
- `{p}:progress:{id}`       list, one element per reply a worker published for the request (the
                            reply's token ids), pushed atomically with the reply: a worker taking
                            over a dead worker's request continues from exactly what the client got
- `{p}:dead`                stream of dead-lettered requests (failed MAX_DELIVERIES times)
- `{p}:fenced:{worker}`     a flag: another worker judged this one dead and took its requests
- `{p}:replies:{gateway}`   stream of ReplyMessage for the requests one gateway enqueued
- `{p}:cancels`             stream of CancelMessage; every worker reads all of it
- `{p}:cancelled:{id}`      a flag with a TTL, so a worker can drop a queued entry before prefill
- `{p}:workers`             sorted set worker id -> last heartbeat (unix seconds):
                            the worker's lease on the requests it holds
- `{p}:gateways`            sorted set gateway id -> last heartbeat (unix seconds)
- `{p}:models`              set of the model names with a published card
- `{p}:model:{name}`        hash: ModelCard published by the workers serving that model
- `{p}:queued_tokens`       prompt tokens of entries no worker has read yet (all gateways)
- `{p}:ratelimit:{key_id}`  a token bucket per API key (gateway rate limits)

Reply seq contract: replies of one request carry seq 0, 1, 2, ... with no gaps, whichever worker
sends them; a worker that takes a request over continues from the progress list's length.
Delivery is at-least-once, so a gateway drops a reply whose seq it has already delivered.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

PROTOCOL_VERSION = 1
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
WORKER_GROUP = "workers"
# A worker or gateway whose heartbeat is older than this is gone (hosts' clocks must agree to
# well within it: NTP).
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5.0
# A request delivered (read or taken over) more than this many times is dead-lettered.
MAX_DELIVERIES = 3
DEAD_LETTER_MAXLEN = 10_000
# Progress lists outlive any healthy request; the TTL only bounds what a lost one leaves behind.
PROGRESS_TTL_S = 24 * 3600
FENCE_TTL_S = 3600
# The consumer that holds handed-back entries until a live worker takes them over. It never
# heartbeats, so its entries always count as orphaned.
RELEASED_CONSUMER = "released"
# How long a cancel flag outlives the cancel (long enough for any queued entry to be read).
CANCEL_FLAG_TTL_S = 3600
# Reply streams are trimmed approximately to this length: a gateway reads within milliseconds.
REPLY_STREAM_MAXLEN = 100_000
CANCEL_STREAM_MAXLEN = 10_000


def redis_url() -> str:
    """The one place REDIS_URL is read (password and TLS go in the URL: rediss://:pw@host)."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def redacted(url: str) -> str:
    """The URL without its credentials, for logs (Sentinel URLs list several hosts)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "jitney"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    def replies(self, gateway_id: str) -> str:
        return f"{self.prefix}:replies:{gateway_id}"

    @property
    def cancels(self) -> str:
        return f"{self.prefix}:cancels"

    def cancelled(self, request_id: str) -> str:
        return f"{self.prefix}:cancelled:{request_id}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def gateways(self) -> str:
        return f"{self.prefix}:gateways"

    @property
    def models(self) -> str:
        return f"{self.prefix}:models"

    def model(self, name: str) -> str:
        return f"{self.prefix}:model:{name}"

    def progress(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{request_id}"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    def fenced(self, worker_id: str) -> str:
        return f"{self.prefix}:fenced:{worker_id}"

    @property
    def queued_tokens(self) -> str:
        return f"{self.prefix}:queued_tokens"

    def ratelimit(self, key_id: str) -> str:
        return f"{self.prefix}:ratelimit:{key_id}"


class ProtocolError(ValueError):
    """An entry that is not a message of this protocol version."""


M = TypeVar("M", bound="Message")


@dataclass(slots=True)
class Message:
    """Base: JSON encoding with a version field. Subclasses are plain dataclasses."""

    kind: ClassVar[str] = "message"

    def encode(self) -> dict[str, str]:
        return {"v": str(PROTOCOL_VERSION), "m": json.dumps(asdict(self), separators=(",", ":"))}

    @classmethod
    def decode(cls: type[M], entry: dict[Any, Any]) -> M:
        def text(key: str) -> str:
            value = entry.get(key, entry.get(key.encode()))
            if value is None:
                raise ProtocolError(f"{cls.kind}: missing field {key!r}")
            return value.decode() if isinstance(value, bytes) else str(value)

        if text("v") != str(PROTOCOL_VERSION):
            raise ProtocolError(
                f"{cls.kind}: protocol version {text('v')}, expected {PROTOCOL_VERSION}"
            )
        try:
            data = json.loads(text("m"))
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"{cls.kind}: malformed message: {e}") from e


@dataclass(slots=True)
class SamplingFields:
    """The sampling parameters as they travel (worker.sampling.SamplingParams mirrors them)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True)
class RequestMessage(Message):
    kind: ClassVar[str] = "request"

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingFields as a dict
    reply_to: str  # the gateway's reply stream key
    gateway_id: str
    enqueue_time: float  # unix seconds, stamped by the gateway just before XADD
    deadline: float | None = None  # unix seconds; dropped as "expired" if not started by then

    @property
    def sampling_fields(self) -> SamplingFields:
        return SamplingFields(**self.sampling)


@dataclass(slots=True)
class ReplyMessage(Message):
    """One step's delta for a request, or its terminal message (`finish_reason` set)."""

    kind: ClassVar[str] = "reply"

    request_id: str
    seq: int  # 0, 1, 2, ... per request: the gateway drops duplicates and sees gaps
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # stop | length | abort | expired | error; None while the request is still running
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # a message safe to show the client
    error_type: str | None = None  # OpenAI error type, e.g. invalid_request_error

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CancelMessage(Message):
    kind: ClassVar[str] = "cancel"

    request_id: str
    reason: str = "client_gone"


@dataclass(slots=True)
class ModelCard(Message):
    """What a gateway needs to serve a model without loading it: tokenizer and limits."""

    kind: ClassVar[str] = "model"

    name: str
    max_model_len: int
    eos_token_ids: list[int]
    tokenizer_json: str  # tokenizers' own serialization
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)  # bos/eos/pad/unk
    created: float = 0.0
