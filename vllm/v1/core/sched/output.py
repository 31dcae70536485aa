"""What the scheduler hands the model runner each step (torch-free).

The runner keeps its own state per request (token ids, block ids, sampling
generator) from the first time it sees the request until the request appears
in `finished_req_ids`; each step only says what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    """A request the runner has not seen before."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # vllm.sampling_params.SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    # The compiled structured-output grammar (vllm.v1.structured_output.CompiledGrammar)
    # whose bitmask masks the request's logits, or None.
    grammar: Any = None
    # The prompt's images (vllm.multimodal.inputs.MultiModalFeatureSpec), in prompt order.
    mm_features: list[Any] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Requests the runner already holds, scheduled again this step.

    For a request resumed after preemption, `new_block_ids[i]` *replaces* its
    block list (its blocks were freed) and `num_computed_tokens[i]` restarts
    from the prefix-cache hit; its token ids (prompt + output so far) are
    still in the runner. Otherwise `new_block_ids[i]` is appended.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step, for every scheduled request.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests finished or aborted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step (their blocks are already freed).
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's plan for this step (KVConnectorMetadata), None without one.
    kv_connector_metadata: Any = None
    # req_id -> draft tokens to verify this step (speculative decoding); their
    # count is included in num_scheduled_tokens (1 + len(drafts) for a decode).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> indices into its mm_features whose encoder outputs are computed this
    # step (before the forward); see v1/core/encoder_cache_manager.py.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Encoder outputs (by mm_hash) the runner drops before this step's encoding.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
