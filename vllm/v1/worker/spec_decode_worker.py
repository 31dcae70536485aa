"""Speculative decoding at a worker's start-up: the draft model, the proposer, the verify peak.

    load_model          load_draft_model: the draft model (method draft_model: same
                        vocabulary, the target's dtype and device; layers renamed
                        `draft.<name>`) -> make_spec_decoder: SpecDecoder(proposer:
                        DraftModelProposer or NgramProposer)
    profile / warmup    verify_positions, profile_verify: the worst-case verify
                        batch, min(max_num_seqs x (k + 1), max_num_batched_tokens)
                        positions of logits and the rejection sampler; its peak
                        counts in the activation peak

Functions of plain values the `Worker` calls at those stages; per-step work
lives in the runner's `SpecDecoder` (spec_decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.worker.draft_model import DraftModelProposer, rename_draft_layers
from vllm.v1.worker.kv_cache_sizing import GiB
from vllm.v1.worker.memory import DeviceMemory, PeakReading
from vllm.v1.worker.spec_decode import SpecDecoder

if TYPE_CHECKING:
    from vllm.config import ModelConfig, SpeculativeConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = init_logger(__name__)


def load_draft_model(
    spec: SpeculativeConfig | None, model_config: ModelConfig, device: torch.device
) -> torch.nn.Module | None:
    """The draft model of method draft_model (the target's dtype and device), else None.

    Raises:
        ValueError: its vocabulary differs from the target's.
    """
    from vllm.model_executor.model_loader import get_model
    from vllm.transformers_utils.config import get_hf_config

    if spec is None or spec.method != "draft_model":
        return None
    hf_config = get_hf_config(spec.model)
    if hf_config.vocab_size != model_config.get_vocab_size():
        raise ValueError(
            f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
            f"{hf_config.vocab_size} tokens, the target {model_config.get_vocab_size()}; "
            "they must match"
        )
    # --load-format dummy applies to the draft as to the target (as in vLLM, whose
    # draft shares the load config); otherwise the draft's own path picks its format.
    load_format = "dummy" if model_config.load_format == "dummy" else "auto"
    model = get_model(spec.model, hf_config, dtype=model_config.dtype, device=device,
                      load_format=load_format)
    rename_draft_layers(model)
    return model


def make_spec_decoder(
    spec: SpeculativeConfig | None, vocab_size: int, device: torch.device,
    draft_model: torch.nn.Module | None,
) -> SpecDecoder | None:
    """The runner's `SpecDecoder` for `spec` (None without speculative decoding)."""
    if spec is None:
        return None
    k = spec.num_speculative_tokens
    if draft_model is not None:
        proposer = DraftModelProposer(draft_model, k, vocab_size, device)
    else:
        proposer = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return SpecDecoder(proposer, k, vocab_size, device)


def verify_positions(runner: GPUModelRunner, max_num_seqs: int) -> int:
    """Positions of the worst-case verify batch (0 without speculative decoding)."""
    if runner.spec_decoder is None:
        return 0
    return runner.spec_decoder.max_verify_positions(max_num_seqs, runner.max_num_tokens)


def profile_verify(
    runner: GPUModelRunner, memory: DeviceMemory, hidden: torch.Tensor, max_num_seqs: int,
    spec: SpeculativeConfig | None,
) -> PeakReading:
    """The worst-case verify batch's peak above the steady state (0 without spec decode).

    As vLLM's profile run includes a rejection-sampler run, so does this
    one: logits over min(max_num_seqs x (k + 1), max_num_batched_tokens)
    positions and the sampler's temporaries. The reading counts `hidden`
    (alive during the run), so it compares with the forward's peak.
    """
    reading = PeakReading()
    positions = verify_positions(runner, max_num_seqs)
    if not positions:
        return reading
    with memory.measure_peak() as reading:
        runner.spec_decoder.dummy_verify_run(runner.model, hidden, positions)
        if runner.async_spec is not None:  # the device proposal over every slot
            runner.async_spec.dummy_propose()
    reading.torch_peak += hidden.numel() * hidden.element_size()
    logger.info(
        "Speculative decoding (%s, k=%d): the verify batch of %d positions x %d vocab "
        "peaks at %.2f GiB (%.1f%% of device memory), counted in the activation peak",
        spec.method, spec.num_speculative_tokens, positions, runner.vocab_size,
        reading.torch_peak / GiB, 100 * reading.torch_peak / memory.total,
    )
    return reading
