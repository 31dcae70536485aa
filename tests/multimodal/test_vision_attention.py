"""The vision tower's attention runs on torch's fused SDPA kernels (O(len) memory).

With 3-D inputs torch falls back to the math path, whose [heads, len, len] scores
for Qwen2-VL's worst-case image (65,536 patches, 16 heads) are 137 GB in bf16: the
benchmark's warmup ran out of memory at every encoder budget on an H100 (2026-12-07).
Flash attention only (torch has a CPU kernel too): the math fallback is not allowed.
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllm.model_executor.models.qwen2_vl import Qwen2VLVisionAttention


def test_vision_attention_uses_a_fused_kernel_and_stays_within_each_image():
    torch.manual_seed(0)
    attn = Qwen2VLVisionAttention(dim=64, num_heads=4)
    cu_seqlens = [0, 12, 32]  # two images of 12 and 20 patches
    x = torch.randn(32, 64)
    cos, sin = torch.ones(32, 16), torch.zeros(32, 16)  # no rotation
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = attn(x, cu_seqlens, cos, sin)
    # Each image alone gives the same rows: attention never crosses images.
    first = attn(x[:12], [0, 12], cos[:12], sin[:12])
    torch.testing.assert_close(out[:12], first, rtol=1e-4, atol=1e-5)
