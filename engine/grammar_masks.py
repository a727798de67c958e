"""Structured outputs: each constrained request's grammar matcher and the step's token masks.

llguidance (see README, "Structured outputs") keeps one matcher per request. Every step the
matchers of the rows that sample fill one bitmask [rows, ceil(vocab / 32)] while the forward
runs: the engine computes them after the forward is launched and before it waits for the device
(on a GPU the CPU is idle then). The sampler sets the logits of disallowed tokens to -inf before
it picks; after the pick each matcher consumes its token, and one whose grammar is complete ends
its request ("stop").

Masks are filled row by row on the calling thread: a few microseconds per row for JSON schemas
(SmolLM2's 49k vocabulary, measured). llguidance's parallel executor was tried and dropped: its
thread pool spins while waiting for work and, on a 2-core CPU, slowed the forward it was meant
to hide behind by 2.3x (52 -> 119 ms per step, bench offline --response-format, 8 requests).

A request taken over from another worker replays its delivered tokens through a fresh matcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerFast

from engine.device_copy import device_tensor
from engine.errors import GrammarError

if TYPE_CHECKING:  # imported on first use: the engine runs without llguidance (a GPU box)
    import llguidance

_BITS = 32


class Grammars:
    """The tokenizer view llguidance needs (built on first use: ~1 s for a large vocabulary)
    and the mask computation for a step's constrained rows."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may pad the tokenizer's
        self._eos_ids = list(eos_ids)

    @cached_property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        from generation.grammar import make_tokenizer

        tokenizer_json = self._tokenizer.backend_tokenizer.to_str()
        return make_tokenizer(tokenizer_json, self.vocab_size, self._eos_ids)

    def matcher(self, grammar: str, delivered: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A matcher for `grammar` that has consumed `delivered` (a takeover's tokens)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar does not compile: {matcher.get_error()}")
        if delivered and not matcher.consume_tokens(list(delivered)):
            raise GrammarError(f"delivered tokens break the grammar: {matcher.get_error()}")
        return matcher

    def masks(
        self,
        matchers: Sequence[llguidance.LLMatcher],
        after: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """The next-token bitmask of each matcher: int32 [len(matchers), ceil(vocab / 32)].
        `after[row]`: tokens the matcher consumes first (a verification's drafts before the
        row's position) and is rolled back by once the row is filled; it consumes none past
        one that ends its grammar (a stopped matcher's mask allows only the end)."""
        import llguidance.torch as llg_torch

        masks = torch.empty(len(matchers), -(-self.vocab_size // _BITS), dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            consumed = 0
            for token in after[row] if after else ():
                if matcher.is_stopped() or not matcher.consume_token(token):
                    break
                consumed += 1
            llg_torch.fill_next_token_bitmask(matcher, masks, row)
            if consumed:
                matcher.rollback(consumed)
        return masks


def apply_masks(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> torch.Tensor:
    """`logits` [N, vocab] with every token the bitmask of `rows[j]` (row j of `masks`, bit t of
    word t // 32 set = allowed) at -inf. A new float32 tensor; `logits` is left as it was."""
    device = logits.device
    vocab = logits.shape[1]
    words = masks.to(device, non_blocking=True)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)[:, :vocab].bool()
    index = device_tensor(list(rows), device)
    x = logits.index_select(0, index).float().masked_fill_(~allowed, float("-inf"))
    return logits.float().index_copy(0, index, x)
