"""`Sampler`: logits -> one token per row, on the device, plus optional logprobs.

```
logits [N, V] --grammar bitmask (structured outputs: refused tokens -> -inf)
   |  --raw log_softmax--> logprobs (before anything below, vLLM's default)
   |
   +-- allowed_token_ids, bad_words (-> -inf), logit_bias, min_tokens mask (stop tokens -> -inf)
   +-- penalties (repetition, frequency, presence)
   +-- greedy rows: argmax ------------------------------+
   +-- random rows: / temperature -> min_p -> top-k/top-p |
   |               -> softmax -> exponential race --------+--> sampled [N]
   '-- gather: sampled token's logprob + rank, top-k ---------> LogprobsTensors
```

No per-row Python except for drawing the noise of seeded rows from their
own generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.layers.ops import use_fused_ops
from vllm.sampling_params import _SAMPLING_EPS
from vllm.v1.sample.logprobs import LogprobsTensors, compute_token_logprobs, gather_logprobs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.bitmask import apply_bitmask
from vllm.v1.sample.ops.penalties import apply_penalties
from vllm.v1.sample.ops.topk_topp import apply_min_p, apply_top_k_top_p, random_sample

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_token_logprobs"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64, on the logits' device
    logprobs_tensors: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler(nn.Module):
    """Samples one token per row from [N, V] logits under `SamplingMetadata`."""

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                greedy: torch.Tensor | None = None) -> SamplerOutput:
        """Sample.

        Args:
            logits: [N, V] float32 (other float dtypes are converted); may be
                modified in place.
            sampling_metadata: the N rows' settings, tensors on logits' device.
            greedy: [N] int64, the argmax of each row of `logits` when already
                computed (a decode CUDA graph does); an all-greedy batch that
                needs nothing else returns a copy of it (the caller's buffer may
                be rewritten, as a graph's is by its next replay).

        Raises:
            ValueError: logits not 2-D, or N differs from the metadata's rows.
        """
        md = sampling_metadata
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(
                f"logits must be [N, V] with N = {md.num_rows} rows of sampling metadata, "
                f"got {tuple(logits.shape)}"
            )
        if (md.all_greedy and md.max_num_logprobs is None and not _modifies_logits(md)
                and md.grammar_bitmask is None):
            # Only the argmax is needed: casting to float32 is exact and keeps
            # order, so the raw logits give the same tokens without the copy.
            ids = argmax_rows(logits) if greedy is None else greedy.clone()
            return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)
        logits = logits.to(torch.float32)
        if md.grammar_bitmask is not None:
            apply_bitmask(logits, md.grammar_bitmask)
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = self.apply_logits_processors(logits, md)
        sampled = self.sample(logits, md)
        logprobs_tensors = None
        if raw_logprobs is not None:
            logprobs_tensors = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logit_bias, the min_tokens mask and the penalties (`LOGITS_PROCESSORS`), in place."""
        for used_by, apply in LOGITS_PROCESSORS:
            if used_by(md):
                apply(logits, md)
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """[N] int64: argmax for greedy rows, a truncated-softmax draw for the rest."""
        greedy = None if md.all_random else argmax_rows(logits)
        if md.all_greedy:
            return greedy
        is_greedy = md.temperature < _SAMPLING_EPS
        # Greedy rows divide by 1 (their draw is discarded); avoids 0-division.
        logits = logits.div_(torch.where(is_greedy, 1.0, md.temperature).unsqueeze(1))
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        drawn = random_sample(logits.softmax(dim=-1), md.generators)
        return drawn if greedy is None else torch.where(is_greedy, greedy, drawn)


def _apply_allowed_token_ids(logits: torch.Tensor, md: SamplingMetadata) -> None:
    rows, allowed = md.allowed_token_ids
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _apply_bad_words(logits: torch.Tensor, md: SamplingMetadata) -> None:
    logits.index_put_(md.bad_words, torch.tensor(float("-inf"), device=logits.device))


def _apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> None:
    rows, cols, values = md.logit_bias
    logits.index_put_((rows, cols), values, accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> None:
    logits.index_put_(md.min_tokens, torch.tensor(float("-inf"), device=logits.device))


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    apply_penalties(logits, md.prompt_token_ids, md.output_token_ids, md.presence_penalties,
                    md.frequency_penalties, md.repetition_penalties)


# The logits processors in the order they apply: (whether a batch uses it, the
# in-place processor). The one list both applying them and `_modifies_logits`
# read, so a batch that needs none takes the raw-logits argmax.
LOGITS_PROCESSORS = (
    (lambda md: md.allowed_token_ids is not None, _apply_allowed_token_ids),
    (lambda md: md.bad_words is not None, _apply_bad_words),
    (lambda md: md.logit_bias is not None, _apply_logit_bias),
    (lambda md: md.min_tokens is not None, _apply_min_tokens),
    (lambda md: not md.no_penalties, _apply_penalties),
)


def _modifies_logits(md: SamplingMetadata) -> bool:
    """Whether `Sampler.apply_logits_processors` changes any logit of this batch."""
    return any(used_by(md) for used_by, _ in LOGITS_PROCESSORS)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's argmax, the first column on ties (NaN counts as largest).

    CUDA logits with a contiguous last dim take the chunked Triton argmax
    (`ops/argmax.py`: 2-5x faster than `torch.argmax` at decode shapes), others
    `torch.argmax`; both give the same answer. `logits` [N, V], N >= 1.
    """
    if use_fused_ops(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        from vllm.v1.sample.ops.argmax import greedy_argmax

        return greedy_argmax(logits)
    return logits.argmax(dim=-1)
