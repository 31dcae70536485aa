"""Which attention backend runs on a device type.

    "cuda" (NVIDIA and ROCm builds of torch) -> TritonAttentionBackend
    anything else ("cpu", ...)               -> TorchAttentionBackend

The Triton module is imported only when a CUDA device asks for it, so CPU
runs never import Triton.
"""

from __future__ import annotations

from vllm.v1.attention.backends.abstract import AttentionBackend


def get_attn_backend(device_type: str) -> type[AttentionBackend]:
    """The backend class for tensors on `device_type` (a torch device type string)."""
    if device_type == "cuda":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend
    from vllm.v1.attention.backends.torch_attn import TorchAttentionBackend

    return TorchAttentionBackend
