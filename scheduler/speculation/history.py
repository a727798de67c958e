"""Earlier replies as a proposer: what followed an n-gram in the outputs this engine finished.

Prompt lookup finds only what the sequence itself said before. A model's replies to other
requests repeat too: its stock phrases, answers to templated or repeated questions, the same
JSON keys, an agent's boilerplate (SuffixDecoding, Oliaro et al. 2024, speculates from a global
tree of earlier outputs for this reason). In the last 40% of mixed-64's two longest replies the
bundled model keeps 1.09-1.13 tokens a step from their own text even with every draft verified
free, and 1.78-2.29 with the other replies' n-grams as well (`python -m research.speculation_ceiling
--trace ../shared/traces/mixed-64.json --history 6`; docs/notes/drafts.md).

The index maps each n-gram (`min_order`..`order` tokens) of the latest `capacity` finished
output tokens to how often each token followed it; drafts are its greedy roll-out, longest
context first, the most frequent follower (the earliest seen among equals, so proposals do not
depend on anything but the replies added, in order). The odds key its drafts by the context
length that matched, apart from the sequence's own lookups (`history_kind`). What a proposal is
only sets how many tokens a step may keep: every token is still the target's own pick.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

# The finished output tokens kept by default (--speculative-history-tokens): about 25 MB at most.
HISTORY_TOKENS = 32768
# n-gram keys -> {next token: count}.
Followers = dict[tuple[int, ...], dict[int, int]]


def history_kind(order: int) -> int:
    """The odds' kind of a history proposal whose first context matched `order` tokens: negative,
    apart from prompt lookup's (its tail length, >= 1) and a draft model's (0)."""
    return -order


def is_history_kind(kind: int) -> bool:
    return kind < 0


@dataclass(slots=True)
class OutputHistory:
    """The n-grams of the latest finished outputs (at most `capacity` tokens, oldest out first)."""

    capacity: int = HISTORY_TOKENS
    order: int = 4
    min_order: int = 3
    followers: Followers = field(default_factory=dict)
    replies: deque[list[int]] = field(default_factory=deque)
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError("history capacity must be >= 0 tokens")
        if not 1 <= self.min_order <= self.order:
            raise ValueError("need 1 <= history min_order <= order")

    def add(self, tokens: SequenceABC[int]) -> None:
        """Index a finished reply's tokens, dropping the oldest replies past `capacity`."""
        reply = list(tokens)
        if not self.capacity or len(reply) <= self.min_order:
            return
        reply = reply[-self.capacity :]
        self._count(reply, +1)
        self.replies.append(reply)
        self.num_tokens += len(reply)
        while self.num_tokens > self.capacity:
            old = self.replies.popleft()
            self._count(old, -1)
            self.num_tokens -= len(old)

    def propose(self, token_ids: SequenceABC[int], max_tokens: int) -> tuple[list[int], int]:
        """Up to `max_tokens` drafts after `token_ids`, and the context length the first matched
        (0: no draft)."""
        context = list(token_ids[-self.order :])
        drafts: list[int] = []
        first = 0
        while len(drafts) < max_tokens:
            nxt, n = self._next(context)
            if not n:
                break
            first = first or n
            drafts.append(nxt)
            context = [*context[1:], nxt] if len(context) == self.order else [*context, nxt]
        return drafts, first

    def _next(self, context: list[int]) -> tuple[int, int]:
        for n in range(min(self.order, len(context)), self.min_order - 1, -1):
            counts = self.followers.get(tuple(context[len(context) - n :]))
            if counts:
                # max keeps the first of equals: the follower seen earliest.
                return max(counts.items(), key=lambda kv: kv[1])[0], n
        return 0, 0

    def _count(self, reply: list[int], delta: int) -> None:
        followers = self.followers
        for n in range(self.min_order, self.order + 1):
            for i in range(len(reply) - n):
                key = tuple(reply[i : i + n])
                counts = followers.setdefault(key, {})
                nxt = reply[i + n]
                left = counts.get(nxt, 0) + delta
                if left > 0:
                    counts[nxt] = left
                else:
                    counts.pop(nxt, None)
                    if not counts:
                        del followers[key]
