"""The prefix cache's block hash: one function, shared by the block manager and the gateway.

A full block of `block_size` prompt tokens is named by a chained content hash: its tokens and
the hash of the block before it, so equal hashes mean equal prefixes. The block manager keys its
prefix cache on it; workers publish (a short form of) the hashes they hold, and the gateway
hashes a new prompt the same way to find the worker holding its longest prefix
(gateway/serving/placement.py). Any change here changes both sides at once.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# What a worker's summary holds of each hash: 8 bytes (2^-64 a false match per lookup, and a
# false match only costs a cache miss: the worker's own lookup uses the whole hash).
SUMMARY_BYTES = 8


def chain_root(adapter: str | None = None) -> bytes:
    """What the first block's hash chains from: the base model's root, or a LoRA adapter's own
    (the same tokens under two adapters have different K/V, so they never share a block)."""
    return b"root" if adapter is None else b"lora\0" + adapter.encode()


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained content hash of one full block (blake2b: collisions would corrupt output);
    `parent_hash` None: the base model's first block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or chain_root())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    max_blocks: int | None = None,
    adapter: str | None = None,
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (at most `max_blocks` of them), run
    under LoRA adapter `adapter` (None: the base model)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[bytes] = []
    parent: bytes | None = None if adapter is None else chain_root(adapter)
    for i in range(num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def summary_hash(block_hash: bytes) -> bytes:
    """A block hash as a worker's prefix summary holds it (and a gateway looks it up)."""
    return block_hash[:SUMMARY_BYTES]
