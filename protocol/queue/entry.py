"""A request queue's entry: which queue it goes to, the fields it holds, and reading them back.

An entry is a RequestMessage's two fields (`v`, `m`: protocol/messages.py) and `c`, its cost in
tokens (prompt + max_tokens) for fair share. The gateway writes it (`encode_entry`, through the
enqueue script or a MULTI), the read script charges `c` to the entry's queue, and the worker
decodes `m` and refunds what `c` charged that the request did not use. A dead-lettered entry
keeps those fields and adds where it was and why it died.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from protocol.keys import Keys
from protocol.messages import MESSAGE_FIELD, RequestMessage

COST_FIELD = "c"
ENTRY_ID_FIELD, REASON_FIELD = "entry_id", "reason"  # added to a dead-lettered entry

Fields = dict[bytes, bytes]  # an entry's fields as redis-py reads them

_COST, _MESSAGE = COST_FIELD.encode(), MESSAGE_FIELD.encode()


@dataclass(frozen=True, slots=True)
class Queue:
    """Which of a model's queues a request goes to."""

    priority: int = 0
    share: str | None = None  # the API key id, for a key with a fair-share weight
    weight: int = 1

    def stream(self, keys: Keys, model: str, worker: str | None = None) -> str:
        """Its stream, or `worker`'s own stream of it (prefix-aware placement)."""
        return keys.requests(model, self.priority, self.share, worker)


DEFAULT_QUEUE = Queue()  # priority 0, no fair-share key: `{p}:requests:{model}`


class Addressing(NamedTuple):
    """Whose an entry is and where its replies go, read without validating the rest."""

    request_id: str
    reply_to: str  # the gateway's reply stream


def encode_entry(message: RequestMessage, cost: int) -> dict[str, str]:
    """A request's entry fields: the message's own, and its fair-share cost in tokens."""
    return {**message.encode(), COST_FIELD: str(cost)}


def entry_cost(fields: Fields) -> int:
    """The tokens a request entry was charged for fair share (`c`; 0 when absent)."""
    try:
        return max(int(fields.get(_COST, 0)), 0)
    except ValueError:
        return 0


def addressing(fields: Fields) -> Addressing:
    """(request id, reply stream) of an entry without validating the rest ("" when absent)."""
    try:
        message = json.loads(fields[_MESSAGE])
        return Addressing(str(message["request_id"]), str(message.get("reply_to") or ""))
    except (KeyError, TypeError, ValueError, AttributeError):
        return Addressing("", "")


def dead_letter_fields(fields: Fields, entry_id: str, reason: str) -> dict[Any, Any]:
    """A request entry as the dead-letter stream keeps it: its fields, its id, the reason."""
    return {**fields, ENTRY_ID_FIELD: entry_id, REASON_FIELD: reason}
