"""Model cards: a worker publishes its tokenizer, limits and sampling defaults; a gateway
rebuilds the tokenizer.

This is how a gateway serves a model without loading it (no torch, no model files): it reads the
card of every model that live workers serve from Redis.
"""

from __future__ import annotations

import time

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from protocol import ModelCard
from protocol.sampling_defaults import SamplingDefaults

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def card_from_tokenizer(
    name: str,
    tokenizer: PreTrainedTokenizerFast,
    max_model_len: int,
    eos_token_ids: list[int],
    sampling_defaults: SamplingDefaults | None = None,
) -> ModelCard:
    special = {}
    for attr in _SPECIAL:
        value = getattr(tokenizer, attr, None)
        special[attr] = None if value is None else str(value)
    return ModelCard(
        name=name,
        max_model_len=max_model_len,
        eos_token_ids=list(eos_token_ids),
        tokenizer_json=tokenizer.backend_tokenizer.to_str(),
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
        special_tokens=special,
        created=time.time(),
        sampling_defaults=(sampling_defaults or SamplingDefaults()).to_dict(),
    )


def tokenizer_from_card(card: ModelCard) -> PreTrainedTokenizerFast:
    """The same tokenizer the worker uses: same ids for the same text and chat messages."""
    backend = Tokenizer.from_str(card.tokenizer_json)
    kwargs = {k: v for k, v in card.special_tokens.items() if v is not None}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=card.chat_template, **kwargs
    )
