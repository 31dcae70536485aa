"""M-RoPE positions equal transformers' `get_rope_index`; the rotary layer equals HF's."""

from __future__ import annotations

import torch

from tests.multimodal.qwen2_vl_checkpoint import IMAGE_TOKEN_ID, qwen2_vl_config
from vllm.model_executor.models.qwen2_vl import MRotaryEmbedding, mrope_positions


def _hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]]):
    from transformers import Qwen2VLModel

    model = Qwen2VLModel(qwen2_vl_config())
    t = torch.tensor([ids])
    positions, delta = model.get_rope_index(
        t, (t == IMAGE_TOKEN_ID).int(), image_grid_thw=torch.tensor(grids))
    return positions[:, 0].tolist(), int(delta[0, 0])


def test_positions_match_transformers_for_two_images():
    grids = [(1, 4, 6), (1, 2, 2)]  # 6 and 1 placeholder tokens (merge 2)
    ids = [5, 6] + [IMAGE_TOKEN_ID] * 6 + [7, 8, 9] + [IMAGE_TOKEN_ID] + [10]
    rows, delta = mrope_positions(ids, IMAGE_TOKEN_ID, grids, merge=2)
    assert (rows, delta) == _hf_rope_index(ids, grids)
    # The image spans heights 2..3 and widths 2..4 from position 2; text goes on at 5.
    assert rows[1][2:8] == [2, 2, 2, 3, 3, 3] and rows[2][2:8] == [2, 3, 4, 2, 3, 4]
    assert rows[0][8] == 5 and delta == -3


def test_text_only_positions_count_up():
    assert mrope_positions([1, 2, 3], IMAGE_TOKEN_ID, [], merge=2) == ([[0, 1, 2]] * 3, 0)


def test_rotation_matches_transformers():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = qwen2_vl_config().text_config
    head = config.hidden_size // config.num_attention_heads
    ours = MRotaryEmbedding(head, head, 64, 10000.0, [2, 3, 3])
    positions = torch.tensor([[0, 1, 5, 5], [0, 3, 5, 9], [0, 2, 7, 5]])
    q, k = torch.randn(4, 4 * head), torch.randn(4, 2 * head)
    got_q, got_k = ours(positions, q, k)
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, positions[:, None, :])
    want_q, want_k = apply_rotary_pos_emb(q.view(1, 4, 4, head).transpose(1, 2),
                                          k.view(1, 4, 2, head).transpose(1, 2), cos, sin)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(4, -1))
    torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(4, -1))

