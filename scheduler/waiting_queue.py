"""The waiting queue: sequences not running, in admission order, most urgent first.

Priority is vLLM's: an integer, lower is served first. Within one priority the queue is FIFO
(a preempted sequence, or a request's further choices, go back to the front of their own level).
One deque per priority present, plus their sorted keys: push, pop and peek cost a deque's
operation and a dict lookup, so a single-priority workload pays what a plain deque does; only a
new priority level costs a bisect over the (few) levels present.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Iterator

from scheduler.sequence import Sequence


class WaitingQueue:
    __slots__ = ("_len", "_levels", "_order")

    def __init__(self) -> None:
        self._levels: dict[int, deque[Sequence]] = {}
        self._order: list[int] = []  # the priorities present (non-empty levels), ascending
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Admission order: by priority, FIFO within one."""
        for priority in self._order:
            yield from self._levels[priority]

    def append(self, seq: Sequence) -> None:
        """At the back of its priority level."""
        self._level(seq.priority).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """At the front of its priority level."""
        self._level(seq.priority).appendleft(seq)
        self._len += 1

    def peek(self) -> Sequence:
        """The next to admit (IndexError when empty, like a deque)."""
        if not self._order:
            raise IndexError("peek from an empty waiting queue")
        return self._levels[self._order[0]][0]

    def popleft(self) -> Sequence:
        if not self._order:
            raise IndexError("pop from an empty waiting queue")
        priority = self._order[0]
        level = self._levels[priority]
        seq = level.popleft()
        self._len -= 1
        if not level:
            self._drop(priority)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out wherever it waits (ValueError if it does not, like a deque)."""
        level = self._levels.get(seq.priority)
        if level is None:
            raise ValueError(f"{seq.seq_id!r} is not waiting")
        level.remove(seq)
        self._len -= 1
        if not level:
            self._drop(seq.priority)

    def oldest_arrival(self) -> float:
        """The earliest arrival among the heads of the levels (each level is in arrival order
        but for sequences put back at its front); with one priority, simply the head's."""
        return min(level[0].arrival_time for level in self._levels.values())

    def _level(self, priority: int) -> deque[Sequence]:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = deque()
            insort(self._order, priority)
        return level

    def _drop(self, priority: int) -> None:
        del self._levels[priority]
        self._order.remove(priority)
