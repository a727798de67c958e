"""What entered or left a block manager's prefix cache since someone last asked.

A worker publishes a summary of the block hashes its prefix cache holds (worker/
prefix_summary.py); rather than compare the whole cache every step, it drains this log of the
hashes that changed. The log is bounded: past `limit` changes (nobody draining it, as offline)
it stops recording and says `resync`, and the reader starts again from the whole cache. A new
log starts that way: a fresh block pool owes its reader a fresh summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheChanges:
    added: list[bytes]  # hashes now in the cache that were not at the last drain
    removed: list[bytes]  # hashes evicted since (they may have been added in between)
    resync: bool  # the log lost track: the reader must start from the whole cache


@dataclass(slots=True)
class PrefixCacheLog:
    limit: int  # changes kept before the log gives up and asks for a resync
    # In the order they happened (a dict as an ordered set): a prompt's first blocks go first.
    changed: dict[bytes, None] = field(default_factory=dict)
    overflowed: bool = True  # a new pool: its reader starts from scratch

    def record(self, block_hash: bytes) -> None:
        """A hash entered or left the cache (whichever: the drain asks the cache)."""
        if self.overflowed:
            return  # the reader will resync from the whole cache anyway
        self.changed[block_hash] = None
        if len(self.changed) > self.limit:
            self.overflowed = True
            self.changed.clear()

    def drain(self, is_cached: Callable[[bytes], bool]) -> CacheChanges:
        """The changes since the last drain, each hash's state as `is_cached` says now."""
        if self.overflowed:
            self.overflowed = False
            self.changed.clear()
            return CacheChanges([], [], resync=True)
        added = [h for h in self.changed if is_cached(h)]
        removed = [h for h in self.changed if not is_cached(h)]
        self.changed.clear()
        return CacheChanges(added, removed, resync=False)
