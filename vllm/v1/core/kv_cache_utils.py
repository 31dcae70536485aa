"""KV cache blocks, the free queue that orders their eviction, and block hashing.

Torch-free: this module deals in block ids and token ids only.

Prefix caching identifies a *full* block by a hash chained over everything
before it::

    hash[0] = H(NONE_HASH, tokens[0:B],  extra_keys[0])
    hash[i] = H(hash[i-1], tokens[iB:(i+1)B], extra_keys[i])

so two requests share block i only if they agree on every token of blocks
0..i (and on the extra keys, e.g. a `cache_salt`). A partial last block is
never hashed and never shared.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from vllm.v1.request import Request

# A block hash is the 32-byte SHA-256 digest of (parent hash, token ids, extra keys).
BlockHash = NewType("BlockHash", bytes)

# Parent of the first block. A fixed constant (not a per-process random seed)
# so that hashes agree across processes and restarts, which KV-transfer
# connectors that look blocks up by hash rely on.
NONE_HASH = BlockHash(hashlib.sha256(b"vllm-extensible-kv/none-hash").digest())

# Pickle protocol for extra keys, pinned so the bytes (and hence the hashes)
# do not change when Python's default protocol does.
_EXTRA_KEYS_PICKLE_PROTOCOL = 4


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Hashable, ...] | None = None,
) -> BlockHash:
    """Hash one block, chained to its parent.

    The digest covers, in this byte layout::

        parent (32 B) | len(tokens) u32 LE | tokens as i64 LE ... | pickle(extra_keys)

    The explicit length prefix keeps (tokens, extra keys) unambiguous. SHA-256
    rather than Python's `hash()`: `hash()` of bytes/str is salted per process
    (PYTHONHASHSEED) and 64-bit, so it neither survives a restart nor makes
    collisions negligible; SHA-256 costs ~1 us per 16-token block here.
    Rejected: pickling the whole tuple (same cost, byte layout less explicit).

    Args:
        parent_block_hash: hash of the previous block; None for the first block.
        curr_block_token_ids: the block's token ids (ints in [-2**63, 2**63)).
        extra_keys: anything else the block's KV depends on (e.g. a cache salt);
            must be picklable and deterministic (ints, strs, bytes, tuples).

    Returns:
        The 32-byte digest.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    n = len(curr_block_token_ids)
    payload = parent + struct.pack(f"<I{n}q", n, *curr_block_token_ids)
    if extra_keys is not None:
        payload += pickle.dumps(extra_keys, protocol=_EXTRA_KEYS_PICKLE_PROTOCOL)
    return BlockHash(hashlib.sha256(payload).digest())


def request_block_extra_keys(request: Request, block_index: int, block_size: int
                             ) -> tuple[Hashable, ...] | None:
    """Extra hash keys of a request's block `block_index` (of `block_size` tokens).

    Only the first block carries the request's `cache_salt`: every later hash
    is chained through it, so the salt separates the whole sequence. A block
    holding placeholder tokens of an image carries that image's hash (its
    `identifier`): two prompts with the same placeholder ids but different
    images must not share the block.
    """
    keys: list[Hashable] = []
    if block_index == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    start, end = block_index * block_size, (block_index + 1) * block_size
    for feature in request.mm_features:
        position = feature.mm_position
        if position.offset < end and position.offset + position.length > start:
            keys.append(feature.identifier)
    return tuple(keys) if keys else None


def update_request_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` over the request's newly full blocks.

    Hashes cover prompt and output tokens alike (a request resumed after
    preemption looks its outputs up in the cache too). Incremental: each full
    block is hashed once over the request's lifetime.

    Returns:
        `request.block_hashes` (one hash per full block, in order).
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    token_ids = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        block_tokens = token_ids[i * block_size : (i + 1) * block_size]
        extra_keys = request_block_extra_keys(request, i, block_size)
        parent = hash_block_tokens(parent, block_tokens, extra_keys)
        hashes.append(parent)
    return hashes


class KVCacheBlock:
    """One block of the paged KV cache (metadata only; the bytes live in the runner).

    Attributes:
        block_id: index into the KV cache tensors, in [0, num_blocks).
        ref_cnt: number of running requests using the block. 0 means the block
            sits in the free queue (possibly still holding a cached prefix).
        block_hash: hash of the full block's content while it is registered in
            the prefix cache, else None.
        prev_free_block / next_free_block: links of the free queue; both None
            while the block is not in the queue.
        is_null: True only for block 0, the placeholder that is never allocated.
    """

    __slots__ = (
        "_block_hash",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = is_null

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a hash; reset it first")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (the block is being evicted or reused)."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Not the dataclass default: that would recurse through the free-queue links.
        h = self._block_hash.hex()[:8] if self._block_hash is not None else None
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: a doubly linked list through the blocks.

    ::

        fake_head <-> b7 <-> b3 <-> b9 <-> ... <-> fake_tail
                      ^ evicted (reused) first      ^ freed most recently

    `popleft` takes the least recently freed block; `append` adds a freed
    block at the tail; `remove` takes a block out of the middle in O(1) when a
    prefix-cache hit revives it. A Python deque cannot remove from the middle
    in O(1), hence the intrusive links.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block.

        Raises:
            ValueError: the queue is empty.
        """
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free blocks left in the free queue")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the `n` head blocks, head first.

        Raises:
            ValueError: fewer than `n` blocks are free.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks but only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Remove `block` from anywhere in the queue in O(1).

        Raises:
            ValueError: the block is not in the queue.
        """
        if block not in self:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last).

        Raises:
            ValueError: the block is already in the queue.
        """
        if block in self:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append `blocks` in order (the first one is evicted first)."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to evict) first."""
        out = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            out.append(block)
            block = block.next_free_block
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
