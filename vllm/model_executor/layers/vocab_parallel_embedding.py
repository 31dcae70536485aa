"""Token embedding and LM head, split over the vocabulary.

Rank r holds rows [r * V_r, (r + 1) * V_r) of the [vocab, hidden] table, with
V_r = ceil(vocab / tp_size); rows past the real vocabulary (last rank only)
stay zero and their logits are dropped:

    vocab ids:  | rank 0: 0 .. V_r-1 | rank 1: V_r .. 2V_r-1 | ... | pad |

The embedding looks up the ids it owns, zeroes the rest and all-reduces; the
LM head computes its slice of the logits and all-gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.tensor_parallel import all_gather, all_reduce, check_tp
from vllm.model_executor.layers.weight_utils import check_shape


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] int64 -> embeddings [T, embedding_dim] (weight dtype).

    Args:
        num_embeddings: vocabulary size (all ranks).
        embedding_dim: hidden size.
        tp_rank, tp_size: this rank's place in the tensor-parallel group.

    Ids outside [0, num_embeddings) are undefined behaviour, as in torch.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings
        )
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of the full [num_embeddings, embedding_dim] table."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not stacked; got shard id {shard_id!r}")
        check_shape((self.num_embeddings, self.embedding_dim), loaded_weight)
        rows = self.vocab_end_index - self.vocab_start_index
        with torch.no_grad():
            param[:rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
            param[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(owned, input_ids - self.vocab_start_index, 0)
        embeddings = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(embeddings, self.tp_size)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """hidden_states [N, embedding_dim] -> logits [N, num_embeddings] (weight dtype).

    With `tie_weights(embedding)` the head shares the embedding's parameter
    (tied word embeddings): the checkpoint then needs no `lm_head.weight`.
    """

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share `embedding.weight` (same shape and sharding required)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie lm_head {tuple(self.weight.shape)} to embedding "
                f"{tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return all_gather(logits, self.tp_size, dim=-1)[..., : self.num_embeddings]
