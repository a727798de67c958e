"""What a worker checks of a request entry before the engine sees it.

The gateway validated the request, but an entry is data from outside the process (another
version, a bug, a hand-written XADD), and what the engine would choke on could fail the whole
batch (a token id outside the vocabulary). Two outcomes:
- the entry is no request of this deployment (`decode_request` raises ProtocolError): there is
  nowhere to reply, so it is acked and dropped, loudly;
- the request cannot be served as given (`checked_params` raises InvalidRequest): its client
  gets an error reply, like an engine rejection (engine/errors.py).
"""

from __future__ import annotations

from generation import SamplingParams
from protocol import PRIORITIES, Keys, ProtocolError, RequestMessage
from worker.redis_io import Entry


class InvalidRequest(ValueError):
    """A request this worker cannot serve as given: the client's error."""


def decode_request(entry: Entry, keys: Keys) -> RequestMessage:
    msg = RequestMessage.decode(entry.fields)
    if not isinstance(msg.reply_to, str) or not msg.reply_to.startswith(keys.replies("")):
        raise ProtocolError("request: reply_to is not a reply stream of this deployment")
    times_ok = isinstance(msg.enqueue_time, int | float) and isinstance(
        msg.deadline, int | float | None
    )
    if not isinstance(msg.request_id, str) or not times_ok:
        raise ProtocolError("request: request_id, enqueue_time or deadline of the wrong type")
    return msg


def checked_params(msg: RequestMessage, served_model: str, vocab_size: int) -> SamplingParams:
    """The request's sampling parameters, once what the engine cannot check itself is checked:
    the model it names, its prompt's token ids, its sampling fields, its priority and the type
    of its adapter's name (whether this engine serves that adapter is the engine's check)."""
    if msg.model != served_model:
        raise InvalidRequest(f"model {msg.model!r} is not served here (this is {served_model!r})")
    ids = msg.prompt_token_ids
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"prompt_token_ids must be a list of token ids in [0, {vocab_size})")
    try:
        params = msg.sampling_params
    except (ValueError, TypeError) as e:  # unknown or ill-typed fields, values out of range
        raise InvalidRequest(str(e)) from e
    if msg.priority not in PRIORITIES:
        raise InvalidRequest(f"priority must be in [{PRIORITIES[0]}, {PRIORITIES[-1]}]")
    if msg.lora is not None and not isinstance(msg.lora, str):
        raise InvalidRequest("lora must be an adapter's name")
    return params
