"""Incremental detokenization with stop strings, one instance per request.

Shared by the gateway, which detokenizes what it serves (workers send token ids only, so the
text costs their step nothing), and the offline engine, which detokenizes its own results.

Text is emitted only when it is final: a token that ends inside a multi-byte UTF-8 character
decodes to U+FFFD and is held back until the next token completes it, and text that could be the
start of a stop string is held back until it is known not to be one. So the deltas, joined, are
always exactly the final text, and the text never moves backwards.

Cost: it runs for every sequence on every step, so it calls tokenizers' own (Rust) decoder
directly, once per token plus once per emitted chunk (the text before the unread tokens is kept,
not decoded again). transformers' `decode` wraps the same call at 5x its cost; its one extra,
clean_up_tokenization_spaces, transformers skips for BPE tokenizers (all of ours), so the text is
the same. tokenizers' DecodeStream (the same algorithm in Rust) measured ~0.7 us/token cheaper,
but after a prompt that ends inside a character it emits the prompt's text, and it raises on a
decoder whose text is not prefix-stable; this code keeps today's behaviour in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded along with the output, so a tokenizer that drops a leading space on a
# lone token (SentencePiece) still renders the first output token with its space.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class IncrementalDetokenizer:
    backend: Tokenizer
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # final text so far, including held-back characters
    num_emitted: int = 0  # characters of `text` already returned as deltas
    stopped: bool = False  # a stop string was found; `text` ends just before it
    # ids[_prefix_offset:_read_offset] were rendered by the last chunk (decoded again with the
    # unread ids after them, as context); _prefix_text is their text.
    _prefix_offset: int = 0
    _read_offset: int = 0
    _prefix_text: str = ""

    @classmethod
    def create(
        cls,
        tokenizer: PreTrainedTokenizerBase | Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
    ) -> IncrementalDetokenizer:
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        backend = tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer
        prefix_text = backend.decode(context, skip_special_tokens=True)
        return cls(backend, stop, context, _read_offset=len(context), _prefix_text=prefix_text)

    def add(self, token_id: int) -> str:
        """Feed one sampled token; return the text that became final (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        full = self._decode(self._prefix_offset, len(self.ids))
        if len(full) > len(self._prefix_text) and not full.endswith(_REPLACEMENT):
            self.text += full[len(self._prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            self._check_stop()
        return self._take_delta(final=False)

    def finish(self) -> str:
        """The request ended: release everything held back (an incomplete character included)."""
        if not self.stopped:
            tail = self._decode(self._prefix_offset, len(self.ids))
            self.text += tail[len(self._prefix_text) :]
            self._read_offset = len(self.ids)
            self._check_stop()
        return self._take_delta(final=True)

    def _decode(self, start: int, stop: int) -> str:
        return self.backend.decode(self.ids[start:stop], skip_special_tokens=True)

    def _check_stop(self) -> None:
        if not self.stop:
            return
        # Only the region the last delta could have completed needs searching.
        window_start = max(0, self.num_emitted - max(map(len, self.stop)))
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take_delta(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        delta = self.text[self.num_emitted : end]
        self.num_emitted = max(self.num_emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
