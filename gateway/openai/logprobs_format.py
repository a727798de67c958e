"""Log-probs in OpenAI's two shapes, from the [log-prob, [[id, log-prob], ...]] per token that
workers send (engine/sampler.py says which distribution: after penalties and bias, before
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

from gateway.openai.completion_bodies import Kind


@dataclass(slots=True)
class LogprobsFormatter:
    kind: Kind
    decoder: Tokenizer  # the event loop's own tokenizer instance (gateway.serving.served_models)
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
            "top_logprobs": [self._top_dict(top) for _, (_, top) in entries],
            "text_offset": offsets,
        }

    def prompt_part(
        self, token_ids: list[int], logprobs: list[list[Any]] | None, text_len: int
    ) -> dict[str, Any]:
        """Completions' echo: the prompt's tokens, from the worker's prompt log-probs (one entry
        per token after the first; the first has none, null as in OpenAI and vLLM). The
        output's offsets then start after the echoed text (`text_len` characters)."""
        entries: list[list[Any] | None] = [None, *(logprobs or [])]
        entries += [None] * (len(token_ids) - len(entries))
        tokens, offsets, offset = [], [], 0
        for token_id in token_ids:
            tokens.append(self._text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self.text_offset = text_len
        return {
            "tokens": tokens,
            "token_logprobs": [e[0] if e else None for e in entries[: len(token_ids)]],
            "top_logprobs": [
                self._top_dict(e[1]) if e else None for e in entries[: len(token_ids)]
            ],
            "text_offset": offsets,
        }

    def _top_dict(self, top: list[list[Any]]) -> dict[str, float]:
        """Completions' alternatives by text. Ids that decode to the same text share a key,
        which keeps the likeliest (`top` comes likeliest first)."""
        found: dict[str, float] = {}
        for token_id, logprob in top:
            found.setdefault(self._text(token_id), logprob)
        return found

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
