"""The replies a gateway may not have read yet, sent again after a Redis outage.

A Redis restarted without persistence comes back empty: replies this worker published that a
gateway had not read yet are gone, and its client would see a gap (the gateway then ends the
request with an error) or, for a final reply, no end at all. A gateway reads within
milliseconds, so what it may have missed is what was published in the last moments before the
outage: those replies are kept for `RESEND_WINDOW_S` and published again, ahead of anything
newer, once an outage began. The gateway drops the copies it already has (by seq).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from protocol import ReplyMessage

RESEND_WINDOW_S = 2.0


@dataclass(slots=True)
class RecentReplies:
    window_s: float = RESEND_WINDOW_S
    # (monotonic time of the publish, its (reply stream, reply) pairs), oldest first
    _batches: deque[tuple[float, list[tuple[str, ReplyMessage]]]] = field(default_factory=deque)

    def published(
        self, replies: Sequence[tuple[str, ReplyMessage]], gone: Collection[str], now: float
    ) -> None:
        """Keep a successful publish's replies (not those to gateways that are gone)."""
        kept = [(stream, reply) for stream, reply in replies if stream not in gone]
        if kept:
            self._batches.append((now, kept))
        self._forget_before(now - self.window_s)

    def take(self, now: float) -> list[tuple[str, ReplyMessage]]:
        """What was published in the window before `now`, oldest first, and forget it (the
        publish that sends it keeps it again). Older replies stay forgotten: after a quiet
        spell, an outage resends nothing a gateway has not long read."""
        self._forget_before(now - self.window_s)
        out = [pair for _, batch in self._batches for pair in batch]
        self._batches.clear()
        return out

    def _forget_before(self, cutoff: float) -> None:
        while self._batches and self._batches[0][0] < cutoff:
            self._batches.popleft()
