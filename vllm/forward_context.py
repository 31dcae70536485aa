"""The per-step forward context: how attention metadata reaches the layers.

The model runner wraps each forward in `set_forward_context(attn_metadata)`;
every `Attention` layer reads it with `get_forward_context()`. This is the one
piece of module state the forward pass uses, so models keep vLLM's signature
`forward(input_ids, positions)` and nothing threads metadata through them.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.backends.abstract import AttentionMetadata


@dataclass
class ForwardContext:
    # None during the memory-profiling run, which runs before any KV cache
    # exists: attention layers then skip the cache and return zeros.
    attn_metadata: "AttentionMetadata | None"


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the forward pass in progress.

    Raises:
        RuntimeError: outside `set_forward_context`.
    """
    if _forward_context is None:
        raise RuntimeError("no forward context: wrap the model call in set_forward_context()")
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: "AttentionMetadata | None") -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention layer for one forward."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
