"""LLMEngine: the offline frontend. Tokenize, add, step, detokenize, in the caller's thread.

```
 LLM.generate -> LLMEngine.add_request   Processor (validate, tokenize, n > 1 fan-out)
                                         OutputProcessor.add_request, EngineCore.add_request
              -> LLMEngine.step()        EngineCore.step() in this process
                                         OutputProcessor.process_outputs -> RequestOutputs
```

The engine core runs in this process: its caller steps it synchronously
(`generate` returns when the batch is done), so there is no frontend work to
overlap with a step, and a second process would only add a copy of every
output. A failed step raises to the caller. The server's frontend is
`AsyncLLM` (async_llm.py), whose core steps in a process of its own.
"""

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
from vllm.v1.engine.output_processor import OutputProcessor
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
    """Tokenize, add, step, detokenize, over an `EngineCore` in this process.

    Args:
        vllm_config: the validated configuration.

    Attributes:
        engine_core: the `EngineCore` (its `EngineCoreUtilities` methods are
            the calls besides the request flow: sleep, wake_up, ...).
        max_model_len: tokens a request may hold, fitted to the KV cache.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.tokenizer: PreTrainedTokenizerBase = get_tokenizer(
            vllm_config.model_config.tokenizer,
            trust_remote_code=vllm_config.model_config.trust_remote_code)
        self.engine_core = EngineCore(vllm_config)
        self.max_model_len = self.engine_core.max_model_len
        self.processor = Processor.from_config(vllm_config, self.tokenizer, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        # What the last step produced (timings, token counts), for metrics.
        self.last_iteration_stats: IterationStats | None = None
        # Woken after a level-2 sleep, weights not loaded yet: generating would run
        # zero weights (empty text), so requests are refused until reload_weights().
        self._weights_stale = False

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
        priority: int = 0,
    ) -> None:
        """Validate and queue a request (n > 1 fans out into n child requests).

        `priority`: vLLM's; lower is scheduled first under `--scheduling-policy
        priority`, and must be 0 under fcfs.

        Raises:
            ValueError: invalid prompt, a prompt of max_model_len tokens or
                more, n > max_num_seqs, or a request the KV cache can never
                hold. Nothing is queued then. (prompt + max_tokens beyond
                max_model_len is accepted, as in vLLM: generation stops at
                max_model_len with finish_reason "length".)
            EngineSleepingError: the engine is asleep, or woke from a level-2
                sleep and its weights were not loaded again (`reload_weights()`).
        """
        if self.engine_core.is_sleeping():
            raise EngineSleepingError(
                "the engine is asleep (sleep mode): call wake_up() before adding requests"
            )
        if self._weights_stale:
            raise EngineSleepingError(
                "the weights were discarded by sleep(level=2) and not loaded again: call "
                "reload_weights() after wake_up() before generating"
            )
        processed = self.processor.process_inputs(request_id, prompt, params, priority)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        added: list[str] = []
        try:
            for request, parent, index in processed.children:
                self.engine_core.add_request(request)
                added.append(request.request_id)
                self.output_processor.add_request(
                    request.request_id, processed.text, processed.prompt_token_ids,
                    request.sampling_params, arrival, parent, index,
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
            `reload_weights()` before generating. False otherwise.

        Raises:
            DeviceMemoryError: not enough device memory now (names the bytes
                needed and free); the engine stays asleep for what could not be
                mapped, and a later call can succeed.
        """
        if self.engine_core.wake_up(tags):
            self._weights_stale = True
        return self._weights_stale

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def reload_weights(self) -> None:
        """Load the checkpoint into the model again (after a level-2 sleep)."""
        self.engine_core.reload_weights()
        self._weights_stale = False

    def set_kv_cache_limit(self, limit_bytes: int | None) -> int:
        """A runtime ceiling for the elastic KV cache in blocks' bytes summed over the
        ranks, as /metrics reports them (None: the start-up limit).

        Returns:
            the limit in blocks.

        Raises:
            RuntimeError: the elastic cache is off.
            ValueError: a limit that is negative or not an int.
        """
        return self.engine_core.set_kv_cache_limit(limit_bytes)

    # ------------------------------------------------------------ figures
    def get_scheduler_stats(self) -> SchedulerStats:
        """Running / waiting requests, KV usage, prefix-cache and preemption counts."""
        return self.engine_core.get_stats()

    def get_kv_cache_memory(self) -> KVCacheMemory:
        """Committed / reserved bytes and committed blocks of the KV cache."""
        return self.engine_core.kv_cache_memory()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
