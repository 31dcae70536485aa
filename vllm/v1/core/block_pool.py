"""BlockPool: every KV cache block, their reference counts, the free queue and
the prefix-cache map from block hash to block. Torch-free.

Invariants (checked by tests/v1/core/test_block_pool.py):

- Block 0 is the null block: never allocated, freed, cached or queued.
- A block with `ref_cnt == 0` is in the free queue; one with `ref_cnt > 0` is not.
- Every block `cached_block_hash_to_block` holds under `h` has `block_hash == h`. A
  free block may keep its hash (it is a cache entry that can still be revived
  by `touch`) until `get_new_blocks` evicts it.
- Every cached copy is kept, as in vLLM: two requests that computed the same
  block at once (neither could hit the other) both register theirs under the
  one hash, so evicting one copy leaves the other to hit.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

logger = init_logger(__name__)


class BlockHashToBlockMap:
    """Block hash -> every cached block with that hash (vLLM's structure of that name).

    Identical content can sit in several blocks: requests scheduled together
    each compute a shared prefix before either is cached. Keeping all of them
    (rather than the first) means a hit survives the eviction of one copy.
    Lookups return one of them; eviction removes exactly the evicted block.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block cached under `block_hash` (the earliest registered), or None."""
        blocks = self._cache.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        """Register `block` under `block_hash` (alongside any other copies)."""
        self._cache.setdefault(block_hash, {})[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Unregister block `block_id` from `block_hash`; returns it, or None if absent."""
        blocks = self._cache.get(block_hash)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[block_hash]
        return block

    def items(self) -> Iterator[tuple[BlockHash, KVCacheBlock]]:
        """(hash, block) for every cached block, copies included."""
        for block_hash, blocks in self._cache.items():
            for block in blocks.values():
                yield block_hash, block

    def clear(self) -> None:
        self._cache.clear()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._cache

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._cache)

    def __len__(self) -> int:
        """Distinct hashes cached."""
        return len(self._cache)


class BlockPool:
    """Reference-counted KV cache blocks with an LRU-evicted prefix cache.

    Args:
        num_blocks: total blocks, including the null block 0 (>= 1; a pool of
            only the null block is valid and is grown later).
        enable_caching: keep freed full blocks addressable by hash.

    Raises:
        ValueError: num_blocks < 1.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks must be >= 1 (block 0 is the null block), got {num_blocks}"
            )
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(0, is_null=True)]
        self.blocks += [KVCacheBlock(i) for i in range(1, num_blocks)]
        self.null_block = self.blocks[0]
        # Initially free in id order, so a fresh pool hands out 1, 2, 3, ...
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Elastic cache: hand out ids below this first, so the tail can be released.
        self._prefer_below: int | None = None
        # Ids of blocks taken (negated: a max-heap), pushed whenever a block's ref_cnt
        # leaves 0 and dropped lazily once freed: the highest block in use in O(log n),
        # so the free tail is known every step without a walk over the pool.
        self._taken_ids: list[int] = []

    @property
    def num_blocks(self) -> int:
        """Total blocks including the null block."""
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out (free, cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the non-null blocks held by requests, in [0, 1]."""
        usable = self.num_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block registered under `block_hash` (any of its copies), or None."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, ref_cnt 1 each.

        A taken block that still held a cached prefix is evicted: its hash
        entry is dropped.

        Raises:
            ValueError: fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} new blocks: only {self.get_num_free_blocks()} are free"
            )
        blocks = self._pop_free(num_blocks)
        for block in blocks:
            self._evict_cached_block(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            heapq.heappush(self._taken_ids, -block.block_id)
        return blocks

    def prefer_blocks_below(self, num_blocks: int | None) -> None:
        """Hand out ids below `num_blocks` first (None: plain LRU order).

        The elastic cache asks for the block count it would like to shrink to,
        so the tail empties: free blocks at or above it are passed over (moved
        to the queue's tail, where they are evicted last) while enough lower
        ones are free.
        """
        self._prefer_below = num_blocks

    def _pop_free(self, n: int) -> list[KVCacheBlock]:
        """`n` blocks from the free queue's head; ids below the preferred count first."""
        if self._prefer_below is None:
            return self.free_block_queue.popleft_n(n)
        queue, taken, passed = self.free_block_queue, [], []
        for _ in range(len(queue)):
            if len(taken) == n:
                break
            block = queue.popleft()
            (taken if block.block_id < self._prefer_below else passed).append(block)
        need = n - len(taken)
        taken += passed[:need]
        queue.append_n(passed[need:])
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving free ones from the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                heapq.heappush(self._taken_ids, -block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the queue tail.

        Args:
            ordered_blocks: in eviction order, the first to be evicted first.
                `KVCacheManager.free` passes a request's blocks tail first, so
                the end of a sequence (least likely to be shared) goes first.

        Raises:
            ValueError: a block's reference count is already 0 (double free).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id} (ref_cnt {block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register a request's newly full blocks in the prefix cache.

        Args:
            blocks: the request's blocks in sequence order.
            block_hashes: the request's block hashes (at least num_full_blocks).
            num_cached_blocks: leading blocks already registered (skipped).
            num_full_blocks: blocks that are full once this step's tokens are written.

        Raises:
            ValueError: fewer hashes or blocks than num_full_blocks.
        """
        if num_full_blocks <= num_cached_blocks or not self.enable_caching:
            return
        if len(block_hashes) < num_full_blocks or len(blocks) < num_full_blocks:
            raise ValueError(
                f"cache_full_blocks needs {num_full_blocks} blocks and hashes, got "
                f"{len(blocks)} blocks and {len(block_hashes)} hashes"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue  # a prefix-cache hit: already registered
            block.block_hash = block_hashes[i]
            # Same content computed twice is kept twice (see BlockHashToBlockMap).
            self.cached_block_hash_to_block.insert(block.block_hash, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is in use.

        Returns:
            True on success; False (with a warning) when some block is held,
            because the hashes of running requests' blocks must survive.
        """
        num_used = self.num_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            logger.warning("Failed to reset the prefix cache: %d blocks are still in use", num_used)
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def resize(self, num_blocks: int) -> None:
        """The one way to change the pool's size: after warmup, and for the elastic cache.

        Growing appends blocks `num_blocks_before .. num_blocks - 1` at the tail
        of the free queue in id order; existing blocks, hashes, reference
        counts and queue order are untouched. Equal counts are a no-op.

        Shrinking (the elastic cache returning memory) drops the *tail* blocks
        `num_blocks ..`, which must all be free: live blocks never move. Any of
        them that still held a prefix-cache entry is evicted (a later request
        with that prefix misses and recomputes).

        Raises:
            ValueError: num_blocks < 1, or a tail block to drop is in use
                (names the block and the counts).
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (the null block), got {num_blocks}")
        if num_blocks < self.num_blocks:
            self._drop_tail(num_blocks)
            return
        new_blocks = [KVCacheBlock(i) for i in range(self.num_blocks, num_blocks)]
        self.blocks += new_blocks
        self.free_block_queue.append_n(new_blocks)

    def move_blocks_below(self, blocks: Sequence[KVCacheBlock], num_blocks: int
                          ) -> list[KVCacheBlock]:
        """Give each of `blocks` (in use, ids >= `num_blocks`) a free block below `num_blocks`.

        The elastic cache's block move: each destination takes over its source's
        reference count and prefix-cache entry (the hash map then points at it);
        each source becomes free (queue tail, no hash), so the tail can be dropped
        once the caller has copied the bytes and rewritten its holders' block
        lists (`KVCacheManager.move_blocks_below`). Free blocks below
        `num_blocks` that held a cached prefix are evicted to serve as
        destinations, least recently freed first.

        Returns:
            The destinations, in the order of `blocks`.

        Raises:
            ValueError: a block is free, the null block or below `num_blocks`; or fewer
                free blocks lie below `num_blocks` than `blocks` has.
        """
        wrong = [b.block_id for b in blocks if not b.ref_cnt or b.block_id < num_blocks]
        if wrong:
            raise ValueError(f"cannot move blocks {wrong[:4]}: each must be in use and at or "
                             f"above {num_blocks}")
        queue, below = self.free_block_queue, []
        block = queue.fake_head.next_free_block
        while len(below) < len(blocks) and block is not None and block is not queue.fake_tail:
            if block.block_id < num_blocks:
                below.append(block)
            block = block.next_free_block
        if len(below) < len(blocks):
            raise ValueError(f"cannot move {len(blocks)} blocks below {num_blocks}: only "
                             f"{len(below)} free blocks lie there")
        for src, dst in zip(blocks, below, strict=True):
            queue.remove(dst)
            self._evict_cached_block(dst)
            dst.ref_cnt, src.ref_cnt = src.ref_cnt, 0
            heapq.heappush(self._taken_ids, -dst.block_id)
            if src.block_hash is not None:
                block_hash = src.block_hash
                self._evict_cached_block(src)
                dst.block_hash = block_hash
                self.cached_block_hash_to_block.insert(block_hash, dst)
            queue.append(src)
        return below

    def num_free_tail_blocks(self) -> int:
        """How many blocks at the end of the id range are free (ref_cnt 0): what may shrink.

        O(log n) amortised: the highest taken id, stale entries dropped on the way.
        """
        heap, blocks = self._taken_ids, self.blocks
        while heap and (-heap[0] >= len(blocks) or blocks[-heap[0]].ref_cnt == 0):
            heapq.heappop(heap)
        if len(heap) > 2 * len(blocks) + 64:  # stale entries below the top: rebuild
            heap[:] = [-b.block_id for b in blocks if b.ref_cnt and not b.is_null]
            heapq.heapify(heap)
        return len(blocks) - 1 - (-heap[0] if heap else 0)

    def _drop_tail(self, num_blocks: int) -> None:
        tail = self.blocks[num_blocks:]
        busy = [b.block_id for b in tail if b.ref_cnt]
        if busy:
            raise ValueError(
                f"cannot shrink the block pool from {self.num_blocks} to {num_blocks} blocks: "
                f"{len(busy)} of the tail blocks are in use (first: block {busy[0]})"
            )
        for block in tail:
            self.free_block_queue.remove(block)
            self._evict_cached_block(block)
        del self.blocks[num_blocks:]
        if self._prefer_below is not None and self._prefer_below >= num_blocks:
            self._prefer_below = None

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop `block`'s prefix-cache entry, if it has one."""
        block_hash = block.block_hash
        if block_hash is None:
            return
        self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        block.reset_hash()
