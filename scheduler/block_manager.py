"""The KV block manager: a fixed pool of blocks, the scheduler's only gate to KV memory.

Invariants (checked by `check_integrity`):
- every block is either free (ref_count 0, in `_free`) or used (ref_count > 0), never both;
- a block's ref_count equals the number of block tables that hold it;
- `_cached[h] == b` implies `blocks[b].block_hash == h`.

Prefix caching: a *full, computed* prompt block gets a chained content hash (its tokens plus the
hash of the block before it), so equal hashes mean equal prefixes. A freed block keeps its hash and
sits in the free list in eviction order; a later request with the same prefix revives it instead of
recomputing. A block loses its hash only when it is handed out fresh. The hash function is
generation/block_hash.py's, which the gateway shares to place a request where its prefix is; the
hashes that enter and leave the cache are logged (`cache_log`) for the worker's summary of them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from generation.block_hash import prompt_block_hashes
from scheduler.prefix_cache_log import CacheChanges, PrefixCacheLog
from scheduler.sequence import Sequence


class BlockIntegrityError(AssertionError):
    """The block pool broke one of its invariants: always a bug."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


@dataclass(slots=True)
class _SeqBlocks:
    block_ids: list[int] = field(default_factory=list)
    # How many leading blocks are registered in the prefix cache (or were hits).
    num_hashed: int = 0


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Eviction order: the front is handed out first. Values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._seqs: dict[str, _SeqBlocks] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which served from it
        # Hashes registered or evicted since the worker's prefix summary last read them.
        self.cache_log = PrefixCacheLog(limit=max(4 * num_blocks, 1024))

    # ----- read-only views -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        entry = self._seqs.get(seq_id)
        return list(entry.block_ids) if entry else []

    def block_ids(self, seq_id: str) -> list[int]:
        """The live block list of an allocated sequence, not a copy: read it, never change it.
        It only grows while the allocation lives and is a new object after a free or a `trim`
        (the model runner keys its device copy on that identity)."""
        return self._seqs[seq_id].block_ids

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now (in use or evictable)."""
        return list(self._cached)

    def drain_cache_changes(self) -> CacheChanges:
        """What entered and left the prefix cache since the last call (`cache_log`)."""
        return self.cache_log.drain(self._cached.__contains__)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of `seq` that its first allocation would take from the prefix cache."""
        if seq.seq_id in self._seqs:
            return seq.num_computed_tokens
        return len(self._lookup(seq)) * self.block_size

    # ----- the gate ----------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, reserve_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more computed tokens of `seq`, all or nothing.

        On a sequence's first allocation (no blocks yet) its prompt is looked up in the prefix
        cache: hit blocks are shared and `seq.num_computed_tokens` jumps past them, so the caller
        must read `num_computed_tokens` again afterwards. `reserve_tokens` asks for blocks up to
        that many tokens now (reservation mode), so later calls never need a free block.
        Returns False, changing nothing, when the free blocks do not suffice.
        """
        entry = self._seqs.get(seq.seq_id)
        if entry is not None:  # a running sequence grows (every decode step: kept lean)
            needed_tokens = max(seq.num_computed_tokens + num_new_tokens, reserve_tokens)
            num_new_blocks = -(-needed_tokens // self.block_size) - len(entry.block_ids)
            if num_new_blocks > len(self._free):
                return False
            for _ in range(num_new_blocks):
                entry.block_ids.append(self._take_fresh())
            return True

        entry = _SeqBlocks()
        hits = self._lookup(seq)
        num_computed = seq.num_computed_tokens + len(hits) * self.block_size
        needed_tokens = max(num_computed + num_new_tokens, reserve_tokens)
        num_new_blocks = max(0, self.blocks_for(needed_tokens) - len(hits))
        # A hit on a block that sits in the free list takes that block out of it.
        num_revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_revived > len(self._free):
            return False

        self._seqs[seq.seq_id] = entry
        self.num_prefix_queries += seq.num_prompt_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = num_computed
        entry.num_hashed = len(hits)
        for b in hits:
            self._take(b)
        entry.block_ids.extend(hits)
        for _ in range(num_new_blocks):
            entry.block_ids.append(self._take_fresh())
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Register the prompt blocks that `seq` has now fully computed in the prefix cache.

        Called after a step ran, never at scheduling time, so a cached block always holds K/V.
        """
        entry = self._seqs.get(seq.seq_id)
        if entry is None or not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        if num_full <= entry.num_hashed:
            return  # a decode: its prompt blocks are all registered already
        hashes = self._prompt_hashes(seq)
        for i in range(entry.num_hashed, num_full):
            block = self.blocks[entry.block_ids[i]]
            h = hashes[i]
            # Two sequences may have computed the same prefix at once; the first one is kept.
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
                self.cache_log.record(h)
        entry.num_hashed = num_full

    def trim(self, seq: Sequence, num_tokens: int, reserve_tokens: int = 0) -> int:
        """Give back the tail blocks of `seq` past what `num_tokens` (and a reservation of
        `reserve_tokens`) needs: the slots of draft tokens the model rejected. They hold no
        prompt block, so no hash; they go to the front of the free list, to be taken first.
        Returns the blocks given back."""
        entry = self._seqs.get(seq.seq_id)
        if entry is None:
            return 0
        keep = max(self.blocks_for(max(num_tokens, reserve_tokens)), entry.num_hashed)
        tail = entry.block_ids[keep:]
        if not tail:
            return 0
        # A new list: the model runner's device copy of the table is keyed on the list's
        # identity, and a list that shrank and grew back would look unchanged to it.
        entry.block_ids = entry.block_ids[:keep]
        for b in reversed(tail):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None
                self._free.move_to_end(b, last=False)
        return len(tail)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`. Tail blocks go to the free list first, so they are
        evicted before the shared prefix blocks that other requests are likelier to reuse."""
        entry = self._seqs.pop(seq.seq_id, None)
        if entry is None:
            return
        for b in reversed(entry.block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None

    # ----- internals ---------------------------------------------------------------------------
    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of the full prompt blocks, computed once per sequence: a waiting
        prompt is looked up every step until it is admitted, and again after a preemption."""
        if not self.enable_prefix_caching:
            return []
        if seq.prompt_block_hashes is None:
            hashes = prompt_block_hashes(seq.prompt_token_ids, self.block_size, adapter=seq.adapter)
            seq.prompt_block_hashes = (self.block_size, hashes)
        block_size, hashes = seq.prompt_block_hashes
        if block_size != self.block_size:
            raise ValueError(
                f"{seq.seq_id!r} was hashed in blocks of {block_size}, not {self.block_size}"
            )
        return hashes

    def _lookup(self, seq: Sequence) -> list[int]:
        # Only a sequence with nothing computed can take hits (a fresh or preempted one), and at
        # least one token must remain to compute: the step that computes it yields the logits.
        if seq.num_computed_tokens or not seq.uses_prefix_cache:
            return []
        max_hits = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._prompt_hashes(seq)[:max_hits]:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _take(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0:
            del self._free[b]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        b, _ = self._free.popitem(last=False)
        block = self.blocks[b]
        if block.block_hash is not None:  # evict its cached content
            del self._cached[block.block_hash]
            self.cache_log.record(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return b

    def check_integrity(self) -> None:
        """Cheap invariant check; tests run it after every scenario, the worker when idle."""
        refs = [0] * self.num_blocks
        for seq_id, entry in self._seqs.items():
            if len(set(entry.block_ids)) != len(entry.block_ids):
                raise BlockIntegrityError(f"{seq_id} holds a block twice: {entry.block_ids}")
            for b in entry.block_ids:
                refs[b] += 1
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise BlockIntegrityError(
                    f"block {block.block_id}: ref_count {block.ref_count}, "
                    f"held by {refs[block.block_id]} tables"
                )
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise BlockIntegrityError(f"block {block.block_id} free-list membership is wrong")
        if len(self._free) + sum(1 for r in refs if r) != self.num_blocks:
            raise BlockIntegrityError("free + used != total")
        for h, b in self._cached.items():
            if self.blocks[b].block_hash != h:
                raise BlockIntegrityError(
                    f"prefix cache entry points at block {b} with another hash"
                )
