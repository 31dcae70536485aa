"""Where every attention layer's KV blocks live in ONE backing allocation.

A `KVCacheSpec` says what one block of one layer holds; a `KVCacheConfig` says
where each layer's blocks sit in a single byte range, so that the range can come
either from a plain `torch.zeros` or from the extensible reservation
(`ExtensibleTensor`), whose base address never moves while it grows. The
allocation itself is the worker's (`vllm/v1/worker/kv_cache.py`,
`allocate_and_reshape_kv_cache`); this module only places blocks and builds
views over a given backing (`reshape_kv_cache`).

The layout (P = page_size_bytes of one block of one layer, N = num_blocks,
L = number of layers): layers outermost, one segment per layer

    base
    |<----------- segment 0: layer 0 ----------->|<----------- segment 1: layer 1 ----------->| ...
    | blk 0 | blk 1 | blk 2 |  ...  | blk N-1   | blk 0 | blk 1 | blk 2 |  ...  | blk N-1   |
    block_stride = P             layer_stride = N * P             offset(layer l) = l * N * P

    byte address of (layer l, block b) = base + offset(l) + b * block_stride
    num_segments = size_bytes / (N * block_stride)       (L)

A *segment* is a contiguous run of N blocks. With the extensible cache only a
prefix of every segment is committed: the first n blocks of each segment,
`n * block_stride` bytes each. Per-layer views built by `reshape_kv_cache`
therefore cover exactly blocks [0, n) of their layer and never touch the
uncommitted rest. Layers are outermost because per-layer views are then
contiguous tensors (what kernels and connectors like best). (Blocks outermost,
one segment with all layers of a block together, was built and tested once and
never used: it is gone; `num_segments` is still derived from the strides, so
the extensible tensor serves any layout.)

Block 0 is the null block: the block pool never hands it to a request, so it
never holds real tokens. Padding tokens write nothing (slot -1 in the slot
mapping), and padded block-table entries point at block 0, so reads through
them stay inside the committed prefix.

Per-layer view shape: [num_blocks, 2, block_size, num_kv_heads, head_size]:
index 0 of dim 1 is K, index 1 is V (what the attention backends read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one KV cache block of one layer holds.

    Attributes:
        block_size: tokens per block.
    """

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (K and V together)."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A full (causal, no sliding window) attention layer's block.

    Attributes:
        block_size: tokens per block (power of two for the Triton kernels).
        num_kv_heads: key/value heads on this rank.
        head_size: elements per head.
        dtype: element type of K and V.

    Raises:
        ValueError: a non-positive size or a dtype that is not a torch.dtype.
    """

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"FullAttentionSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"FullAttentionSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: 2 (K, V) x block_size x heads x head_size x itemsize."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass(frozen=True)
class KVCacheTensor:
    """One layer's place in the backing allocation.

    Attributes:
        layer_name: the attention layer's prefix, e.g. "model.layers.0.self_attn.attn".
        spec: what one of its blocks holds.
        offset: bytes from the base of the allocation to the layer's block 0.
    """

    layer_name: str
    spec: KVCacheSpec
    offset: int


@dataclass(frozen=True)
class KVCacheConfig:
    """One backing allocation holding every layer's blocks (module docstring has the picture).

    Attributes:
        num_blocks: blocks per layer the allocation has room for (its capacity;
            with the extensible cache only a prefix is committed), counting the
            null block 0.
        kv_cache_tensors: one entry per layer, in layer order.
        block_stride: bytes from block b to block b+1 of one layer.
        layer_stride: bytes from layer l's block 0 to layer l+1's block 0.
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    block_stride: int
    layer_stride: int

    def __post_init__(self) -> None:
        if not self.kv_cache_tensors:
            raise ValueError("KVCacheConfig needs at least one KV cache tensor")
        if self.num_blocks < 1 or self.block_stride <= 0 or self.layer_stride <= 0:
            raise ValueError(
                f"KVCacheConfig: num_blocks ({self.num_blocks}) must be >= 1 and block_stride "
                f"({self.block_stride}) / layer_stride ({self.layer_stride}) positive"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (the same for every layer)."""
        return self.kv_cache_tensors[0].spec.page_size_bytes

    @property
    def block_size(self) -> int:
        """Tokens per block (the same for every layer)."""
        return self.kv_cache_tensors[0].spec.block_size

    @property
    def num_layers(self) -> int:
        return len(self.kv_cache_tensors)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers: the one statement of it (sizing
        takes `block_stride x num_segments`, the same number, from here)."""
        return self.num_layers * self.page_size_bytes

    @property
    def size_bytes(self) -> int:
        """Bytes of the whole backing allocation at `num_blocks` blocks."""
        return self.bytes_for_blocks(self.num_blocks)

    @property
    def segment_size_bytes(self) -> int:
        """Bytes of one segment (a contiguous run of `num_blocks` blocks)."""
        return self.num_blocks * self.block_stride

    @property
    def num_segments(self) -> int:
        """Contiguous runs of blocks, from the strides: size / (num_blocks x block_stride)."""
        return self.size_bytes // self.segment_size_bytes

    @property
    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {t.layer_name: t.spec for t in self.kv_cache_tensors}

    def bytes_for_blocks(self, num_blocks: int) -> int:
        """Bytes that `num_blocks` blocks of every layer occupy (no granule rounding)."""
        return num_blocks * self.bytes_per_block

    def max_blocks_for_bytes(self, nbytes: int) -> int:
        """The most blocks (per layer, counting the null block) `nbytes` bytes hold; >= 0."""
        return max(nbytes, 0) // self.bytes_per_block

    def segment_bytes_for_blocks(self, num_blocks: int) -> int:
        """Bytes of each segment's prefix that `num_blocks` committed blocks need."""
        return num_blocks * self.block_stride

    def tensor(self, layer_name: str) -> KVCacheTensor:
        """The placement of `layer_name`.

        Raises:
            KeyError: the layer has no KV cache here (message lists the known layers).
        """
        for t in self.kv_cache_tensors:
            if t.layer_name == layer_name:
                return t
        known = [t.layer_name for t in self.kv_cache_tensors]
        raise KeyError(f"no KV cache tensor for layer {layer_name!r}; layers: {known}")


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    num_blocks: int,
) -> KVCacheConfig:
    """Place every layer's `num_blocks` blocks in one allocation.

    Args:
        kv_cache_specs: layer name -> spec, in layer order (dict order is kept).
        num_blocks: blocks per layer, counting the null block; >= 1.

    All layers must share block_size and page size: with a single block
    stride, a block id means the same tokens in every layer and the segments
    are equal. Models with per-layer differing KV shapes would need one group
    (and one allocation) per page size; none of the supported models has them,
    so they are rejected rather than half-supported.

    Raises:
        ValueError: no layers, num_blocks < 1, or layers whose block_size or
            page size differ (message names them).
    """
    if not kv_cache_specs:
        raise ValueError("get_kv_cache_config needs at least one attention layer, got none")
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(
            f"num_blocks must be an int >= 1 (block 0 is the null block), got {num_blocks!r}"
        )
    _check_uniform(kv_cache_specs, "block_size", lambda s: s.block_size)
    _check_uniform(kv_cache_specs, "page size (bytes)", lambda s: s.page_size_bytes)
    page = next(iter(kv_cache_specs.values())).page_size_bytes
    block_stride, layer_stride = page, num_blocks * page  # layers outermost
    tensors = tuple(
        KVCacheTensor(layer_name=name, spec=spec, offset=i * layer_stride)
        for i, (name, spec) in enumerate(kv_cache_specs.items())
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        block_stride=block_stride,
        layer_stride=layer_stride,
    )


def _check_uniform(specs: Mapping[str, KVCacheSpec], what: str, key: Callable) -> None:
    values: dict[object, list[str]] = {}
    for name, spec in specs.items():
        values.setdefault(key(spec), []).append(name)
    if len(values) > 1:
        listing = "; ".join(
            f"{v}: {names[:3]}{'...' if len(names) > 3 else ''}" for v, names in values.items()
        )
        raise ValueError(f"all attention layers must share one {what}, got {listing}")


def reshape_kv_cache(
    kv_cache_config: KVCacheConfig, backing: torch.Tensor, num_blocks: int
) -> dict[str, torch.Tensor]:
    """Per-layer views over the first `num_blocks` blocks of each layer in `backing`.

    Args:
        kv_cache_config: the placement.
        backing: uint8, 1-D, at least `kv_cache_config.size_bytes` elements;
            its data_ptr() is the base of the allocation. Only the committed
            prefix of each segment (num_blocks x block_stride bytes) is
            addressed; nothing is read or written here.
        num_blocks: committed blocks per layer, 1 <= num_blocks <= kv_cache_config.num_blocks.

    Returns:
        layer name -> view of dtype spec.dtype, shape [num_blocks, 2, block_size,
        num_kv_heads, head_size], aliasing `backing` (contiguous).

    Raises:
        ValueError: backing of the wrong dtype/rank/size, num_blocks out of range,
            or an offset not aligned to the layer's element size.
    """
    size = kv_cache_config.size_bytes
    if backing.dtype != torch.uint8 or backing.dim() != 1:
        raise ValueError(
            f"KV cache backing must be a 1-D uint8 tensor, got dtype {backing.dtype} "
            f"with shape {tuple(backing.shape)}"
        )
    if backing.numel() < size:
        raise ValueError(f"KV cache backing has {backing.numel()} bytes, the config needs {size}")
    if backing.numel() > 1 and backing.stride(0) != 1:
        raise ValueError(f"KV cache backing must be contiguous, got stride {backing.stride(0)}")
    if not isinstance(num_blocks, int) or not 1 <= num_blocks <= kv_cache_config.num_blocks:
        raise ValueError(
            f"num_blocks must be in [1, {kv_cache_config.num_blocks}] (the config's capacity), "
            f"got {num_blocks!r}"
        )
    byte_view = backing[:size]
    return {
        t.layer_name: _layer_view(t, byte_view, t.offset, kv_cache_config.block_stride, num_blocks)
        for t in kv_cache_config.kv_cache_tensors
    }


def reshape_kv_cache_segments(
    kv_cache_config: KVCacheConfig, segments: Sequence[torch.Tensor], num_blocks: int
) -> dict[str, torch.Tensor]:
    """Per-layer views over per-segment backings: each view's storage is its segment's prefix.

    Like `reshape_kv_cache`, but the backing comes as one uint8 tensor per
    segment covering exactly its committed prefix (`ExtensibleTensor.segment_view`),
    so a view's `untyped_storage().nbytes()` is the committed bytes of its
    segment, never the reservation (issue #16 item 1). Segment `i` spans
    `[i x size_bytes / num_segments, ...)` of the layout.

    Args:
        kv_cache_config: the placement at the capacity.
        segments: `num_segments` uint8 1-D tensors, each at least
            `num_blocks x block_stride` bytes (for a layer's blocks to fit).
        num_blocks: committed blocks per layer, 1 <= num_blocks <= capacity.

    Returns / Raises: as `reshape_kv_cache`.
    """
    if len(segments) != kv_cache_config.num_segments:
        raise ValueError(
            f"expected {kv_cache_config.num_segments} segment backings, got {len(segments)}"
        )
    if not isinstance(num_blocks, int) or not 1 <= num_blocks <= kv_cache_config.num_blocks:
        raise ValueError(
            f"num_blocks must be in [1, {kv_cache_config.num_blocks}] (the config's capacity), "
            f"got {num_blocks!r}"
        )
    seg_bytes = kv_cache_config.size_bytes // kv_cache_config.num_segments
    views = {}
    for t in kv_cache_config.kv_cache_tensors:
        index, offset = divmod(t.offset, seg_bytes)
        segment = segments[index]
        if segment.dtype != torch.uint8 or segment.dim() != 1:
            raise ValueError(f"segment {index} backing must be a 1-D uint8 tensor")
        views[t.layer_name] = _layer_view(
            t, segment, offset, kv_cache_config.block_stride, num_blocks
        )
    return views


def _layer_view(
    t: KVCacheTensor, byte_view: torch.Tensor, offset: int, block_stride: int, num_blocks: int
) -> torch.Tensor:
    """One layer's view [num_blocks, 2, block_size, h, d] at `offset` bytes into `byte_view`."""
    spec = t.spec
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"layer {t.layer_name!r}: no view rule for spec {type(spec).__name__}")
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    for what, value in (
        ("offset", offset),
        ("block_stride", block_stride),
        ("base storage offset", byte_view.storage_offset()),
    ):
        if value % itemsize:
            raise ValueError(
                f"layer {t.layer_name!r}: {what} {value} bytes is not a multiple of "
                f"the element size {itemsize} of {spec.dtype}"
            )
    typed = byte_view.view(spec.dtype)
    h, d = spec.num_kv_heads, spec.head_size
    return typed.as_strided(
        size=(num_blocks, 2, spec.block_size, h, d),
        stride=(block_stride // itemsize, spec.block_size * h * d, h * d, d, 1),
        storage_offset=typed.storage_offset() + offset // itemsize,
    )


def bind_kv_cache(
    kv_caches: Mapping[str, torch.Tensor], attention_layers: Mapping[str, object]
) -> None:
    """Set `layer.kv_cache` of every attention layer to its view.

    Args:
        kv_caches: layer name -> view [num_blocks, 2, block_size, num_kv_heads, head_size].
        attention_layers: layer name -> `vllm.attention.layer.Attention`.

    Raises:
        ValueError: a layer without a cache, a cache without a layer, or a view
            whose heads/head size do not match the layer (names and numbers given).
    """
    missing = sorted(set(attention_layers) - set(kv_caches))
    extra = sorted(set(kv_caches) - set(attention_layers))
    if missing or extra:
        raise ValueError(
            f"KV caches and attention layers differ: layers without a cache {missing}, "
            f"caches without a layer {extra}"
        )
    for name, layer in attention_layers.items():
        cache = kv_caches[name]
        expected = (layer.num_kv_heads, layer.head_size)
        if cache.dim() != 5 or tuple(cache.shape[3:]) != expected:
            raise ValueError(
                f"layer {name!r}: KV cache view of shape {tuple(cache.shape)} does not match "
                f"(num_kv_heads, head_size) = {expected}"
            )
        layer.kv_cache = cache
