"""The requests the engine refuses, as one family of errors: the caller's fault, never a bug.

`Engine.add_request` raises these (and the scheduler's `InfeasibleRequestError`) before anything
is queued, so a caller can answer them as a bad request (the worker: a 400-style error reply).
Any other exception out of the engine is a bug or a device fault: the worker treats it as it
treats a failed step (handed back, dead-lettered if it keeps failing), never as the client's.
All are ValueErrors, as they were before the family had a name.
"""

from __future__ import annotations

from scheduler import InfeasibleRequestError


class RequestRejected(ValueError):
    """A request the engine refuses as given."""


class RequestTooLongError(RequestRejected):
    """prompt + max_tokens exceed the context window."""


class EmptyPromptError(RequestRejected):
    """A request with no prompt token."""


class LogitBiasError(RequestRejected):
    """logit_bias names a token id outside the model's vocabulary."""


class PredictionError(RequestRejected):
    """A prediction holding token ids outside the model's vocabulary."""


class DuplicateRequestError(RequestRejected):
    """A request id the engine already holds."""


class ResumedOutputError(RequestRejected):
    """A takeover's delivered tokens that do not fit the request (its choices, its max_tokens)."""


class UnknownAdapterError(RequestRejected):
    """A LoRA adapter this engine does not serve."""


class GrammarError(RequestRejected):
    """A grammar that does not compile, or delivered tokens it does not accept."""


class AdapterLoadError(ValueError):
    """A LoRA adapter that cannot be served (engine/lora/): missing or unreadable files, a
    module it targets that Jitney does not cover, a rank over the limit, shapes that are not
    the base model's, or (to replace or remove it) one that live requests run under. An
    operator's error, not a request's."""


# What `except` a caller writes around add_request: the engine's refusals and the scheduler's
# (prompt + max_tokens larger than the whole KV pool; the scheduler cannot import the engine).
REJECTIONS: tuple[type[ValueError], ...] = (RequestRejected, InfeasibleRequestError)
