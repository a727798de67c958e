"""The messages that travel through Redis: typed dataclasses with a version field.

Every message is one stream entry (or hash) with two fields: `v` (the protocol version) and `m`
(the message as JSON). A reader refuses a version it does not know instead of misreading it.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from generation.sampling_params import SamplingParams

# What `from protocol import ...` gets of this module (protocol/__init__.py star-imports it).
# SamplingParams is generation's, re-exported: a RequestMessage carries one.
__all__ = [
    "BATCH_FIELD",
    "BATCH_PRIORITY",
    "MESSAGE_FIELD",
    "NOOP_MODEL",
    "PRIORITIES",
    "PROTOCOL_VERSION",
    "STOP_STRING",
    "VERSION_FIELD",
    "CancelMessage",
    "Message",
    "ModelCard",
    "ProtocolError",
    "ReplyMessage",
    "RequestMessage",
    "SamplingParams",
    "decode_replies",
    "encode_replies",
    "pack_vector",
    "unpack_vector",
]

PROTOCOL_VERSION = 1
# The fields of every message's stream entry (or hash): the version, the message as JSON, and
# in a reply stream's entry a batch of replies instead (encode_replies). protocol/queue adds one.
VERSION_FIELD, MESSAGE_FIELD, BATCH_FIELD = "v", "m", "b"
# A request's priority: an integer, lower is served first (as vLLM defines it); 0 by default.
# Batch API lines run at the least urgent, BATCH_PRIORITY.
PRIORITIES = range(-100, 101)
BATCH_PRIORITY = PRIORITIES[-1]


class ProtocolError(ValueError):
    """An entry that is not a message of this protocol version."""


M = TypeVar("M", bound="Message")


@dataclass(slots=True)
class Message:
    """Base: JSON encoding with a version field. Subclasses are plain dataclasses."""

    kind: ClassVar[str] = "message"

    def encode(self) -> dict[str, str]:
        message = json.dumps(asdict(self), separators=(",", ":"))
        return {VERSION_FIELD: str(PROTOCOL_VERSION), MESSAGE_FIELD: message}

    @classmethod
    def decode(cls: type[M], entry: dict[Any, Any]) -> M:
        def text(key: str) -> str:
            value = entry.get(key, entry.get(key.encode()))
            if value is None:
                raise ProtocolError(f"{cls.kind}: missing field {key!r}")
            return value.decode() if isinstance(value, bytes) else str(value)

        if text(VERSION_FIELD) != str(PROTOCOL_VERSION):
            raise ProtocolError(
                f"{cls.kind}: protocol version {text(VERSION_FIELD)}, expected {PROTOCOL_VERSION}"
            )
        try:
            return cls.from_dict(json.loads(text(MESSAGE_FIELD)))
        except ValueError as e:
            raise ProtocolError(f"{cls.kind}: malformed message: {e}") from e

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        """The message from its JSON object (fields it does not know are ignored)."""
        try:
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (AttributeError, TypeError) as e:
            raise ProtocolError(f"{cls.kind}: malformed message: {e}") from e


@dataclass(slots=True)
class RequestMessage(Message):
    kind: ClassVar[str] = "request"

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_dict()
    reply_to: str  # the gateway's reply stream key
    gateway_id: str
    enqueue_time: float  # unix seconds, stamped by the gateway just before XADD
    deadline: float | None = None  # unix seconds; dropped as "expired" if not started by then
    # Lower is served first (vLLM's convention): admitted first, preempted last. PRIORITIES.
    priority: int = 0
    key_id: str | None = None  # the API key's id (never the key): the live view shows it
    # A pooling request (/v1/embeddings): the prompt is computed and its vector replied
    # (ReplyMessage.embedding) instead of tokens; `sampling` is not read.
    embed: bool = False
    # The W3C trace context (`traceparent`, maybe `tracestate`) of the gateway's enqueue span,
    # when tracing is on: the worker's spans continue that trace (protocol/tracing.py). A
    # worker that does not know the field ignores it; None when the gateway traces nothing.
    trace_context: dict[str, str] | None = None
    # The LoRA adapter the request runs under (the name a client gave as its `model`, which the
    # gateway resolved to `model`, the adapter's base); None: the base model itself.
    lora: str | None = None

    @property
    def sampling_params(self) -> SamplingParams:
        """The sampling dict decoded and validated (ValueError if it is not valid)."""
        return SamplingParams.from_dict(self.sampling)


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
    # A final reply's speculation (the worker that finished it): draft tokens it verified for
    # this choice, and those kept (OpenAI's accepted/rejected_prediction_tokens).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    error: str | None = None  # a message safe to show the client
    error_type: str | None = None  # OpenAI error type, e.g. invalid_request_error
    # Per token of token_ids, when the request asked: [log-prob, [[id, log-prob], ...]].
    logprobs: list[list[Any]] | None = None
    # The choice (0 .. n-1) this reply belongs to. A normal final (stop, length) ends its choice
    # only: the request is done when every choice has one. Any other final ends the request.
    index: int = 0
    # When the request asked (sampling.prompt_logprobs): in its first reply, one entry per prompt
    # token after the first, [log-prob, [[id, log-prob], ...]] as for logprobs.
    prompt_logprobs: list[list[Any]] | None = None
    # A pooling request's final reply: its vector, raw (not normalised), as `pack_vector`
    # writes it.
    embedding: str | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


def encode_replies(replies: Sequence[ReplyMessage]) -> dict[str, str]:
    """Several replies as one stream entry (`b`: a JSON array): what one worker step has for
    one gateway goes in one XADD, not one per request."""
    batch = json.dumps([_compact(r) for r in replies], separators=(",", ":"))
    return {VERSION_FIELD: str(PROTOCOL_VERSION), BATCH_FIELD: batch}


def _compact(reply: ReplyMessage) -> dict[str, Any]:
    """The reply's fields that differ from their defaults (a delta is mostly defaults: this
    roughly quarters the bytes per token that Redis stores and sends)."""
    return {k: v for k, v in asdict(reply).items() if k in _REQUIRED or v != _REPLY_DEFAULTS.get(k)}


def decode_replies(entry: dict[Any, Any]) -> list[ReplyMessage]:
    """A reply stream entry: one reply (`m`) or a batch of them (`b`), in order."""
    batch = entry.get(BATCH_FIELD, entry.get(BATCH_FIELD.encode()))
    if batch is None:
        return [ReplyMessage.decode(entry)]
    version = entry.get(VERSION_FIELD, entry.get(VERSION_FIELD.encode()))
    version = version.decode() if isinstance(version, bytes) else str(version)
    if version != str(PROTOCOL_VERSION):
        raise ProtocolError(f"reply: protocol version {version}, expected {PROTOCOL_VERSION}")
    try:
        items = json.loads(batch)
    except ValueError as e:
        raise ProtocolError(f"reply: malformed batch: {e}") from e
    if not isinstance(items, list):
        raise ProtocolError("reply: a batch must be a JSON array")
    return [ReplyMessage.from_dict(item) for item in items]


_REQUIRED = frozenset({"request_id", "seq"})
_REPLY_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default_factory is not MISSING else f.default
    for f in fields(ReplyMessage)
}


def pack_vector(values: Sequence[float]) -> str:
    """A vector as base64 of little-endian float32: exact for float32 values, and the bytes
    of OpenAI's `encoding_format: base64` too."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def unpack_vector(text: str) -> list[float]:
    """`pack_vector`'s values back (ProtocolError if `text` is not such a vector)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"vector: not base64: {e}") from e
    if len(raw) % 4:
        raise ProtocolError(f"vector: {len(raw)} bytes is no float32 vector")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


STOP_STRING = "stop"  # a cancel's reason when the request's text reached a stop string


@dataclass(slots=True)
class CancelMessage(Message):
    kind: ClassVar[str] = "cancel"

    request_id: str
    reason: str = "client_gone"  # or STOP_STRING: the gateway's detokenizer found a stop string
    index: int | None = None  # one choice of an n > 1 request; None: the whole request


# The model name of `jitney worker --model noop` (no model: load tests only); the gateway
# labels it as such in /v1/models.
NOOP_MODEL = "noop"


@dataclass(slots=True)
class ModelCard(Message):
    """What a gateway needs to serve a model without loading it: tokenizer, limits and the
    model's sampling defaults."""

    kind: ClassVar[str] = "model"

    name: str
    max_model_len: int
    eos_token_ids: list[int]
    tokenizer_json: str  # tokenizers' own serialization
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)  # bos/eos/pad/unk
    created: float = 0.0
    # The model's own defaults for the sampling fields a request leaves out, by API name
    # (protocol.sampling_defaults.SamplingDefaults.to_dict); empty: the API's defaults.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # The length of its embeddings (/v1/embeddings: the hidden size); 0: none or not known.
    embedding_size: int = 0
    # The LoRA adapters its workers serve beside it (`--lora-modules` names): a request naming
    # one as its `model` runs on this model's queue under that adapter.
    adapters: list[str] = field(default_factory=list)
