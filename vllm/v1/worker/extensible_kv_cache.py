"""ExtensibleKVCache: block counts -> per-segment byte prefixes of one reservation.

The KV cache's backing allocation is an `ExtensibleTensor` reserved for the
*capacity* (the most blocks that could ever fit). Each segment (one per layer
in the default layer-outermost layout) commits a prefix of
`num_blocks x block_stride` bytes:

    segment (layer) i:  [ blk0 | blk1 | ... | blk n-1 |..... reserved, unmapped .....]
                        ^ base + i * capacity * block_stride   (fixed forever)
                        |<--- committed: n * block_stride --->|

Growing maps new pages at the end of every segment under the same addresses,
so a block keeps its address, per-layer views are rebuilt over the committed
bytes (same data pointers, larger first dimension), and CUDA graphs captured
earlier stay valid.
"""

from __future__ import annotations

import torch

from vllm.device_allocator.vmm import VmmDriver
from vllm.utils.extensible_tensor import ExtensibleTensor
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    allocate_and_reshape_kv_cache,
    reshape_kv_cache,
)


class ExtensibleKVCache:
    """The extensible backing of the KV cache.

    Args:
        kv_cache_config: layout for the *capacity* (num_blocks = capacity blocks).
        driver: the platform's VMM driver (probe passed).
        device: the device the views live on.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, driver: VmmDriver, device: torch.device):
        self.config = kv_cache_config
        self.driver = driver
        self.device = device
        self.tensor: ExtensibleTensor | None = None
        self.num_blocks = 0  # committed blocks (per segment)

    @property
    def capacity_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def block_stride(self) -> int:
        return self.config.block_stride

    @property
    def num_segments(self) -> int:
        return self.config.num_segments

    @property
    def physical_bytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.physical_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.config.size_bytes

    def allocate(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Reserve the capacity and commit the first `num_blocks` blocks; returns layer views."""
        if self.tensor is not None:
            raise RuntimeError("the KV cache reservation already exists")

        def reserve(size: int, num_segments: int) -> torch.Tensor:
            # The hook of allocate_and_reshape_kv_cache: the views it builds
            # cover `num_blocks` blocks, so those are committed before it returns.
            self.tensor = ExtensibleTensor.from_capacity(size, num_segments, self.driver)
            self.tensor.resize_segments_([num_blocks * self.block_stride] * num_segments)
            self.num_blocks = num_blocks
            return self.tensor.full_view()

        return allocate_and_reshape_kv_cache(
            self.config, self.device, reserve=reserve, num_blocks=num_blocks
        )

    def commit(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Grow every segment to `num_blocks` blocks (new bytes zero); returns layer views.

        Raises:
            ValueError: more blocks than the capacity, or fewer than committed.
            VmmError: the driver failed (nothing from this call stays mapped).
        """
        assert self.tensor is not None, "allocate() first"
        if num_blocks > self.capacity_blocks:
            raise ValueError(
                f"cannot commit {num_blocks} KV blocks: the reservation holds "
                f"{self.capacity_blocks}"
            )
        if num_blocks < self.num_blocks:
            raise ValueError(
                f"commit() only grows: {num_blocks} blocks < {self.num_blocks} committed; "
                f"use remap() to shrink"
            )
        self.tensor.resize_segments_([num_blocks * self.block_stride] * self.num_segments)
        self.num_blocks = num_blocks
        return self.views()

    def remap(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Commit exactly `num_blocks` blocks, discarding contents (shrink after warmup).

        Only for a cache that holds nothing live (warmup garbage).
        """
        assert self.tensor is not None, "allocate() first"
        self.tensor.release_physical()
        self.tensor.discard_released_sizes_()
        self.num_blocks = 0
        return self.commit(num_blocks)

    def views(self) -> dict[str, torch.Tensor]:
        """Per-layer views over the committed blocks (same data pointers as before)."""
        assert self.tensor is not None
        return reshape_kv_cache(self.config, self.tensor.full_view(), self.num_blocks)

    def release(self) -> None:
        """Drop the physical pages, keep the addresses (sleep)."""
        assert self.tensor is not None
        self.tensor.release_physical()

    def recommit(self) -> None:
        """Fresh zeroed pages for the blocks held before `release` (wake)."""
        assert self.tensor is not None
        self.tensor.recommit_()

    def free(self) -> None:
        if self.tensor is not None:
            self.tensor.free()
            self.tensor = None
            self.num_blocks = 0
