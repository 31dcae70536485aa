"""LLMEngine: the offline engine. Tokenize, add, step, detokenize, in one thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.exceptions import EngineSleepingError
from vllm.v1.engine.output_processor import OutputProcessor, ParentRequest
from vllm.v1.engine.processor import Processor
from vllm.v1.metrics.stats import IterationStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import PromptType
    from vllm.v1.core.sched.stats import SchedulerStats
    from vllm.v1.outputs import KVCacheMemory

logger = init_logger(__name__)


class LLMEngine:
    """Tokenize, add, step, detokenize, over an engine core in this process or its own.

    Args:
        vllm_config: the validated configuration.
        multiprocess_mode: run the engine core in a process of its own
            (`EngineCoreProc` behind `MPEngineCoreClient`: the server's choice,
            so nothing in the frontend delays a step); False keeps it in this
            process (the offline `LLM`: its caller steps it synchronously, so a
            second process would only add a copy of every output).
    """

    def __init__(self, vllm_config: VllmConfig, multiprocess_mode: bool = False) -> None:
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        self.tokenizer: PreTrainedTokenizerBase = get_tokenizer(model_config.tokenizer)
        self.processor = Processor(
            self.tokenizer,
            model_config.max_model_len,
            model_config.get_vocab_size(),
            vllm_config.scheduler_config.max_num_seqs,
            model_config.try_get_generation_config(),
            model_config.max_logprobs,
            kv_connector=(vllm_config.kv_transfer_config.kv_connector
                          if vllm_config.kv_transfer_config else None),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        if multiprocess_mode:
            from vllm.v1.engine.core_client import MPEngineCoreClient

            self.engine_core: EngineCore | MPEngineCoreClient = MPEngineCoreClient(vllm_config)
        else:
            self.engine_core = EngineCore(vllm_config)
        # The core fits max_model_len to the final KV cache; everything the
        # frontend advertises or checks (/v1/models, the processor) reads this.
        model_config.max_model_len = self.processor.max_model_len = self.engine_core.max_model_len
        # What the last step produced (timings, token counts), for metrics.
        self.last_iteration_stats: IterationStats | None = None

    def adjust_kv_cache(self) -> bool:
        """Let the elastic KV cache grow or shrink now (idle loops call this).

        An engine core in its own process does this in its own loop; here its
        figures since the last step are taken in (so /metrics follow a shrink
        while idle).

        Returns:
            True when the committed block count (or, with the core in its own
            process, the figures) changed.
        """
        if isinstance(self.engine_core, EngineCore):
            return self.engine_core.adjust_kv_cache()
        return self.engine_core.poll_idle()

    def set_kv_cache_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling for the elastic KV cache, bytes (None: the start-up limit).

        Returns:
            the limit in blocks.

        Raises:
            RuntimeError: the elastic cache is off.
        """
        return self.engine_core.set_kv_cache_limit(limit_bytes)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        queue=None,
    ) -> None:
        """Validate and queue a request (n > 1 fans out into n child requests).

        Raises:
            ValueError: invalid prompt, n > max_num_seqs, prompt + max_tokens
                beyond max_model_len, or a request the KV cache can never hold.
                Nothing is queued then.
        """
        if self.engine_core.is_sleeping():
            raise EngineSleepingError(
                "the engine is asleep (sleep mode): call wake_up() before adding requests"
            )
        self.processor.validate_params(params)
        text, prompt_token_ids = self.processor.tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            children = [(request_id, params, None, 0)]
        else:
            parent = ParentRequest(request_id, params.n)
            children = [
                (
                    ParentRequest.child_id(i, request_id),
                    ParentRequest.child_params(params, i),
                    parent,
                    i,
                )
                for i in range(params.n)
            ]
        # Validate every child before queueing any, so a rejection loses nothing.
        requests = [
            self.processor.make_request(cid, prompt_token_ids, cparams)
            for cid, cparams, _, _ in children
        ]
        added: list[str] = []
        try:
            for request, (cid, _, parent, index) in zip(requests, children, strict=True):
                self.engine_core.add_request(request)
                added.append(cid)
                self.output_processor.add_request(
                    cid,
                    text,
                    prompt_token_ids,
                    request.sampling_params,
                    arrival,
                    parent,
                    index,
                    queue,
                )
        except Exception:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by id (a parent id aborts all its children)."""
        dropped = self.output_processor.abort_requests(list(request_ids))
        self.engine_core.abort_requests(dropped + list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.finish_requests_stopped(processed.reqs_to_abort)
        self.last_iteration_stats = processed.stats
        return processed.request_outputs

    # ----------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> None:
        """Abort unfinished requests and release weights' and KV cache's device memory.

        Level 1 keeps the weights in host memory; level 2 discards them (reload
        with `reload_weights()` after `wake_up()`).
        """
        self.abort_request(list(self.output_processor.states))
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Recommit "weights" and/or "kv_cache" (both when None) at the same addresses.

        Returns:
            True while the weights hold nothing since a level-2 sleep (this
            call or an earlier, failed one woke them): the caller must call
            `reload_weights()` before generating. The server (`AsyncLLM`) does so itself; the
            offline `LLM` leaves it to its caller. False otherwise.

        Raises:
            DeviceMemoryError: not enough device memory now (names the bytes
                needed and free); the engine stays asleep for what could not be
                mapped, and a later call can succeed.
        """
        return self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def reload_weights(self) -> None:
        """Load the checkpoint into the model again (after a level-2 sleep)."""
        self.engine_core.reload_weights()

    # ------------------------------------------------------------ figures
    def get_scheduler_stats(self) -> SchedulerStats:
        """Running / waiting requests, KV usage, prefix-cache and preemption counts."""
        return self.engine_core.get_stats()

    def get_kv_cache_memory(self) -> KVCacheMemory:
        """Committed / reserved bytes and committed blocks of the KV cache."""
        return self.engine_core.kv_cache_memory()

    def get_scheduled_request_ids(self) -> list[str]:
        """Ids of the (child) requests the last step scheduled, also when it raised."""
        return self.engine_core.scheduled_request_ids()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
