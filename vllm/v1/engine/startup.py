"""An engine's start-up: every rank through its stages, and the plan they follow.

```
 EngineCore.__init__
   start_workers(executor, config) ----------------------------- every rank, in order:
     init_device                       platform, process groups, device fits
     probe_kv_cache_path               each rank's VMM driver, once (not when turned off)
     StartupPlan.decide(...)           the KV cache path and the utilization it implies
     load_model(plan)                  the sharing check, weights (+ draft model)
     initialize_kv_cache               profile; classic: final size; extensible: warmup prefix
     compile_or_warm_up_model          warmup, graphs, (extensible) measure and extend
     run_post_kv_cache_hooks           KV connectors see the final, committed cache
     elastic_kv_cache_bounds           (elastic) floor, limit, chunk, agreed by the ranks
     get_encoder_budget                (multimodal) what the profile reserved for the encoder
   -> plan.with_kv_cache(num_blocks, max_model_len), logged once
```

max_model_len must fit the final KV cache: one request of that many tokens
needs `ceil(max_model_len / block_size)` blocks besides the null block. As in
vLLM, a cache too small for it fails the start-up (a ValueError naming the
memory needed, the memory the cache has, and the longest length it holds),
whether the length was passed or is the model's own; only `max_model_len=-1`
(`--max-model-len auto`) serves the longest length that fits instead. The
extensible cache changes nothing here: its final size is measured before this
check, and the elastic cache is judged by the limit it may grow to (what one
request can be given), as the scheduler admits requests against it.

A rank that fails a stage raises `WorkerError` naming it (uni: the worker's
own exception); the caller shuts the executor down, so no rank keeps memory.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.config.startup import StartupPlan
from vllm.logger import init_logger
from vllm.v1.executor import Executor
from vllm.v1.worker.elastic_kv_cache import ElasticBounds
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.kv_cache_sizing import fit_max_model_len

logger = init_logger(__name__)


def start_workers(
    executor: Executor, vllm_config: VllmConfig
) -> tuple[StartupPlan, ElasticBounds | None]:
    """Bring every rank through start-up; returns the final plan and the elastic bounds.

    Raises:
        WorkerError: a rank failed a stage.
        ValueError: the extensible cache was required and a rank cannot hold
            it, or sleep mode needs it (`StartupPlan.decide`); the KV cache
            cannot hold one request of max_model_len tokens (`_max_model_len`).
        RuntimeError: the ranks ended with different block counts (their
            agreement makes this impossible).
    """
    run = executor.collective_rpc
    cache = vllm_config.cache_config
    run(Worker.init_device)
    probes = [] if cache.enable_extensible_kv_cache is False else run(Worker.probe_kv_cache_path)
    plan = StartupPlan.decide(cache, probes)
    run(Worker.load_model, args=(plan,))
    run(Worker.initialize_kv_cache)
    counts = run(Worker.compile_or_warm_up_model)
    if len(set(counts)) != 1:
        raise RuntimeError(f"the ranks ended with different block counts: {counts}")
    run(Worker.run_post_kv_cache_hooks)
    bounds = run(Worker.elastic_kv_cache_bounds)[0] if plan.elastic_kv_cache else None
    # Elastic: a request may use what the cache can grow to, not what it holds now.
    num_blocks = counts[0]
    max_model_len = _max_model_len(executor, vllm_config,
                                   bounds.limit if bounds else num_blocks)
    plan = plan.with_kv_cache(num_blocks, max_model_len)
    encoders = [b for b in run(Worker.get_encoder_budget) if b is not None]
    if encoders:  # the ranks' smallest: every rank must hold what the scheduler sends
        plan = plan.with_encoder(min(b.max_num_encoder_input_tokens for b in encoders),
                                 min(b.encoder_cache_size for b in encoders),
                                 max(b.cache_bytes for b in encoders))
    logger.info("Start-up plan: %s", plan.describe())
    return plan, bounds


def _max_model_len(executor: Executor, vllm_config: VllmConfig, num_blocks: int) -> int:
    """max_model_len as configured when one request of it fits `num_blocks`; with
    `max_model_len=-1` (auto), lowered (with a warning) to what they hold.

    Raises:
        ValueError: the cache is too small for one request of max_model_len tokens
            (vLLM refuses to start here too); one line with the numbers and the flags.
    """
    mc, block_size = vllm_config.model_config, vllm_config.cache_config.block_size
    configured = mc.max_model_len
    fitted = fit_max_model_len(configured, num_blocks, block_size)
    if fitted == configured:
        return configured
    if mc.max_model_len_origin == "auto":
        logger.warning(
            "max_model_len auto: the model's %d tokens do not fit the KV cache (%d blocks of "
            "%d tokens for one sequence); serving max_model_len %d",
            configured, num_blocks - 1, block_size, fitted)
        return fitted
    block_bytes = max(m.block_bytes for m in executor.collective_rpc(Worker.kv_cache_memory))
    raise ValueError(max_model_len_error(
        configured, mc.max_model_len_origin, num_blocks, block_size, block_bytes))


def max_model_len_error(max_model_len: int, origin: str, num_blocks: int, block_size: int,
                        block_bytes: int) -> str:
    """The start-up refusal of a max_model_len the KV cache cannot hold (vLLM's numbers:
    the KV memory one such request needs, what the cache has, the longest length that fits).

    `block_bytes` is one block over all layers on the rank whose blocks are largest.
    """
    needed_blocks = -(-max_model_len // block_size)
    usable = num_blocks - 1  # block 0 is the null block
    fits = usable * block_size
    where = ("--max-model-len" if origin == "explicit"
             else "the model's context length; --max-model-len was not given")
    return (
        f"max_model_len {max_model_len} ({where}) does not fit the KV cache: one request of "
        f"{max_model_len} tokens needs {needed_blocks} blocks of {block_size} tokens, "
        f"{_gib(needed_blocks * block_bytes)} of KV cache, but the cache holds {usable} "
        f"usable blocks, {_gib(usable * block_bytes)}; based on that memory the maximum "
        f"model length is {fits}. Raise --gpu-memory-utilization or --kv-cache-memory-bytes, "
        f"lower --max-model-len to at most {fits}, or pass --max-model-len auto to serve "
        "the longest length that fits"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB ({nbytes} bytes)"
