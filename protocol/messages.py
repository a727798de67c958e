"""The messages that travel through Redis: typed dataclasses with a version field.

Every message is one stream entry (or hash) with two fields: `v` (the protocol version) and `m`
(the message as JSON). A reader refuses a version it does not know instead of misreading it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from protocol.sampling import SamplingParams

PROTOCOL_VERSION = 1
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

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


STOP_STRING = "stop"  # a cancel's reason when the request's text reached a stop string


@dataclass(slots=True)
class CancelMessage(Message):
    kind: ClassVar[str] = "cancel"

    request_id: str
    reason: str = "client_gone"  # or STOP_STRING: the gateway's detokenizer found a stop string
    index: int | None = None  # one choice of an n > 1 request; None: the whole request


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
