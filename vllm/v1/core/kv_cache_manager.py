"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and
allocation for the tokens of a step. Torch-free.

A request's blocks, in sequence order::

    req_to_blocks[req_id] = [ hit | hit | new | new | new ]
                              \\ prefix-cache hits, shared (ref_cnt may be > 1)
                                          \\ allocated for this request only

Block i holds the KV of token positions [i*block_size, (i+1)*block_size).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, update_request_block_hashes
from vllm.v1.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache figures, in tokens (vLLM's names)."""

    requests: int = 0  # admissions that looked the prefix cache up
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps requests to KV cache blocks over one BlockPool.

    Args:
        num_blocks: total blocks including the null block 0 (>= 1).
        block_size: tokens per block (>= 1).
        enable_caching: prefix caching on/off.
        max_model_len: longest sequence in tokens; no request gets slots past it.

    Raises:
        ValueError: a size is out of range.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many leading blocks of the request are registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- sizes and figures ----

    @property
    def num_blocks(self) -> int:
        """Total blocks including the null block."""
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def max_blocks_per_request(self) -> int:
        """Blocks that one max_model_len sequence needs (block-table width)."""
        return cdiv(self.max_model_len, self.block_size)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def resize(self, num_blocks: int) -> None:
        """Change the block count; see BlockPool.resize (a shrink drops free tail blocks)."""
        self.block_pool.resize(num_blocks)

    def num_free_tail_blocks(self) -> int:
        """Free blocks at the end of the id range (what a shrink may drop)."""
        return self.block_pool.num_free_tail_blocks()

    def prefer_blocks_below(self, num_blocks: int | None) -> None:
        """Hand out ids below `num_blocks` first (None: LRU order); see BlockPool."""
        self.block_pool.prefer_blocks_below(num_blocks)

    def num_blocks_in_use(self) -> int:
        """Blocks held by requests (the null block not counted)."""
        return self.num_blocks - 1 - self.get_num_free_blocks()

    def move_blocks_below(self, num_blocks: int, req_ids: Iterable[str]
                          ) -> tuple[list[int], list[int]]:
        """Move the blocks at or above `num_blocks` that `req_ids` hold into free blocks below.

        The elastic cache empties its tail this way before releasing it: the
        requests keep running (no recompute). Each moved block's holders get
        the new block at the same place of their block lists, its prefix-cache
        entry moves with it (`BlockPool.move_blocks_below`). A block another
        holder shares (a request not in `req_ids`: one whose KV a connector
        loads or sends) stays. The caller copies the bytes (`Worker.move_kv_blocks`)
        before any step reads the new ids.

        Returns:
            (source ids, destination ids), pairwise; both empty when nothing moved.

        Raises:
            ValueError: fewer free blocks below `num_blocks` than blocks to move.
        """
        holders: dict[int, int] = {}  # block id -> holders among req_ids
        blocks: dict[int, KVCacheBlock] = {}
        lists = [self.req_to_blocks[r] for r in req_ids if r in self.req_to_blocks]
        for held in lists:
            for block in held:
                if block.block_id >= num_blocks:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
                    blocks[block.block_id] = block
        movable = [b for i, b in sorted(blocks.items()) if holders[i] == b.ref_cnt]
        if not movable:
            return [], []
        src = [b.block_id for b in movable]
        dst = self.block_pool.move_blocks_below(movable, num_blocks)
        new = {s: d for s, d in zip(src, dst, strict=True)}
        for held in lists:
            held[:] = [new.get(b.block_id, b) for b in held]
        return src, [b.block_id for b in dst]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    # ---- per request ----

    def reads_prefix_cache(self, request: Request) -> bool:
        """Whether `request` may be served from the prefix cache.

        Requests asking for prompt logprobs must compute every prompt position.
        """
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache.

        Never covers the whole sequence: at least the last token is left to
        compute, because the step that computes it produces the next logits.
        Takes no reference; pass the result to `allocate_slots`.

        Returns:
            (blocks, num_computed_tokens) with num_computed_tokens =
            len(blocks) * block_size.
        """
        if not self.reads_prefix_cache(request):
            return [], 0
        block_hashes = update_request_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_external_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give `request` slots for `num_new_tokens` more tokens.

        Args:
            request: the request (its num_computed_tokens not yet advanced).
            num_new_tokens: tokens to compute this step (>= 1).
            num_new_computed_tokens: tokens covered by `new_computed_blocks`.
            new_computed_blocks: prefix-cache hits from `get_computed_blocks`,
                only when the request (re)enters from the waiting queue.
            num_external_tokens: tokens after the hits that a KV connector
                loads into the new blocks this step. Their blocks are not
                registered in the prefix cache by this call (a failed load
                must not leave them there); the request's next allocation
                registers them.
            num_lookahead_tokens: slots held beyond this step's tokens (a draft
                model's proposals); never registered in the prefix cache.

        Returns:
            The newly allocated blocks (excluding the hits), possibly empty; or
            None when not enough blocks are free, in which case nothing changed.

        Blocks that will be full once this step's tokens are written are
        registered in the prefix cache now, so a request scheduled later in
        the same step can hit them. This is sound because the runner writes
        the whole batch's K/V into the cache before attention reads it (per
        layer), as the paged-attention path does.

        Raises:
            ValueError: num_new_tokens < 1.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        req_id = request.request_id
        num_held = len(self.req_to_blocks.get(req_id, [])) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = cdiv(num_slots, self.block_size) - num_held
        # Hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        first_allocation = req_id not in self.req_to_blocks
        new_blocks = self._append_blocks(req_id, new_computed_blocks, max(num_new_blocks, 0))
        if first_allocation and self.reads_prefix_cache(request):
            self._count_prefix_lookup(request, num_new_computed_tokens)
        if self.enable_caching and not num_external_tokens:
            self._cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _append_blocks(
        self, req_id: str, hits: list[KVCacheBlock], num_new_blocks: int
    ) -> list[KVCacheBlock]:
        """Append the prefix-cache `hits` (taking a reference; they count as cached) and
        `num_new_blocks` fresh blocks to the request's blocks; returns the fresh ones."""
        self.block_pool.touch(hits)
        req_blocks = self.req_to_blocks.setdefault(req_id, [])
        req_blocks.extend(hits)
        if hits:
            self.num_cached_block[req_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def _count_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Add one admission's lookup to `prefix_cache_stats` (tokens)."""
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (the sequence end is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in sequence order ([] if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens`."""
        num_full_blocks = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        block_hashes = update_request_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request.request_id], block_hashes, num_cached, num_full_blocks
        )
        self.num_cached_block[request.request_id] = num_full_blocks
