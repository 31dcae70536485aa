"""The Worker's speculative-decoding set-up: the draft model, the proposer, the verify peak.

    load_model          the draft model (method draft_model: same vocabulary,
                        the target's dtype and device; layers renamed `draft.<name>`)
                        -> SpecDecoder(proposer: DraftModelProposer or NgramProposer)
    profile / warmup    the worst-case verify batch: min(max_num_seqs x (k + 1),
                        max_num_batched_tokens) positions of logits and the
                        rejection sampler; its peak counts in the activation peak

Per-step work lives in the runner's `SpecDecoder` (spec_decode.py).
"""

from __future__ import annotations

import torch

from vllm.logger import init_logger
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.worker.draft_model import DraftModelProposer, rename_draft_layers
from vllm.v1.worker.kv_cache_sizing import GiB
from vllm.v1.worker.memory import PeakReading
from vllm.v1.worker.spec_decode import SpecDecoder

logger = init_logger(__name__)


class SpecDecodeWorkerMixin:
    """The Worker's speculative-decoding helpers (load time, profile and warmup).

    Expects the Worker's `config`, `device`, `memory`, `model_runner` and
    `spec_decode_peak`.
    """

    def _load_draft_model(self) -> torch.nn.Module | None:
        """The draft model of method draft_model (target's dtype and device), else None.

        Raises:
            ValueError: its vocabulary differs from the target's.
        """
        from vllm.model_executor.model_loader import get_model
        from vllm.transformers_utils.config import get_hf_config

        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        mc = self.config.model_config
        hf_config = get_hf_config(spec.model)
        if hf_config.vocab_size != mc.get_vocab_size():
            raise ValueError(
                f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
                f"{hf_config.vocab_size} tokens, the target {mc.get_vocab_size()}; they must match"
            )
        # --load-format dummy applies to the draft as to the target (as in vLLM, whose
        # draft shares the load config); otherwise the draft's own path picks its format.
        load_format = "dummy" if mc.load_format == "dummy" else "auto"
        model = get_model(spec.model, hf_config, dtype=mc.dtype, device=self.device,
                          load_format=load_format)
        rename_draft_layers(model)
        return model

    def _spec_decoder(self, vocab_size: int, draft_model) -> SpecDecoder | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        k = spec.num_speculative_tokens
        if draft_model is not None:
            proposer = DraftModelProposer(draft_model, k, vocab_size, self.device)
        else:
            proposer = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return SpecDecoder(proposer, k, vocab_size, self.device)

    def _verify_positions(self) -> int:
        """Positions of the worst-case verify batch (0 without speculative decoding)."""
        runner = self.model_runner
        if runner.spec_decoder is None:
            return 0
        return runner.spec_decoder.max_verify_positions(
            self.config.scheduler_config.max_num_seqs, runner.max_num_tokens
        )

    def _profile_verify(self, hidden: torch.Tensor) -> PeakReading:
        """The worst-case verify batch's peak above the steady state (0 without spec decode).

        As vLLM's profile run includes a rejection-sampler run, so does this
        one: logits over min(max_num_seqs x (k + 1), max_num_batched_tokens)
        positions and the sampler's temporaries. The reading counts `hidden`
        (alive during the run), so it compares with the forward's peak.
        """
        reading = PeakReading()
        positions = self._verify_positions()
        if not positions:
            return reading
        with self.memory.measure_peak() as reading:
            self.model_runner.spec_decoder.dummy_verify_run(
                self.model_runner.model, hidden, positions
            )
        reading.torch_peak += hidden.numel() * hidden.element_size()
        spec = self.config.speculative_config
        logger.info(
            "Speculative decoding (%s, k=%d): the verify batch of %d positions x %d vocab "
            "peaks at %.2f GiB (%.1f%% of device memory), counted in the activation peak",
            spec.method, spec.num_speculative_tokens, positions,
            self.model_runner.vocab_size, reading.torch_peak / GiB,
            100 * reading.torch_peak / self.memory.total,
        )
        self.spec_decode_peak = reading.torch_peak
        return reading
