"""Log-probs in OpenAI's two shapes, from the [log-prob, [[id, log-prob], ...]] per token that
workers send (engine/sampling.py says which distribution: after penalties and bias, before
temperature and the top-k/top-p cut).

Completions: {"tokens", "token_logprobs", "top_logprobs": [{text: log-prob}], "text_offset"}.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}. A token's text is its own decoding; a byte-level token that holds part of a
character decodes to U+FFFD, as it does in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from gateway.responses import Kind


@dataclass(slots=True)
class LogprobsFormatter:
    kind: Kind
    decoder: Tokenizer  # the event loop's own tokenizer instance (gateway.models)
    text_offset: int = 0  # completions: where the next token's text starts in the output
    _texts: dict[int, str] = field(default_factory=dict)

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.decoder.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def part(self, token_ids: list[int], logprobs: list[list[Any]] | None) -> dict[str, Any]:
        """The logprobs object of these tokens (one reply's); empty lists when the worker sent
        none for them."""
        entries = list(zip(token_ids, logprobs or [], strict=False))
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, lp, top) for t, (lp, top) in entries]}
        tokens, offsets = [], []
        for token_id, _ in entries:
            text = self._text(token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, (lp, _) in entries],
            "top_logprobs": [{self._text(i): v for i, v in top} for _, (_, top) in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float, top: list[list[Any]]) -> dict[str, Any]:
        return {
            **self._chat_token(token_id, logprob),
            "top_logprobs": [self._chat_token(i, v) for i, v in top],
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One logprobs object from the parts of several replies (a non-streamed response)."""
    if not parts:
        return None
    merged: dict[str, Any] = {key: [] for key in parts[0]}
    for part in parts:
        for key, values in part.items():
            merged[key] += values
    return merged
