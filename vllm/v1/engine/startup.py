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
   -> plan.with_kv_cache(num_blocks, max_model_len fitted to the cache), logged once
```

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
            it, or sleep mode needs it (`StartupPlan.decide`).
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
    max_model_len = _fit_max_model_len(vllm_config, bounds.limit if bounds else num_blocks)
    plan = plan.with_kv_cache(num_blocks, max_model_len)
    encoders = [b for b in run(Worker.get_encoder_budget) if b is not None]
    if encoders:  # the ranks' smallest: every rank must hold what the scheduler sends
        plan = plan.with_encoder(min(b.max_num_encoder_input_tokens for b in encoders),
                                 min(b.encoder_cache_size for b in encoders),
                                 max(b.cache_bytes for b in encoders))
    logger.info("Start-up plan: %s", plan.describe())
    return plan, bounds


def _fit_max_model_len(vllm_config: VllmConfig, num_blocks: int) -> int:
    """max_model_len, lowered (with a warning) to what the final KV cache holds."""
    configured = vllm_config.model_config.max_model_len
    block_size = vllm_config.cache_config.block_size
    fitted = fit_max_model_len(configured, num_blocks, block_size)
    if fitted < configured:
        logger.warning(
            "max_model_len %d does not fit the KV cache: %d blocks of %d tokens hold "
            "%d tokens for one sequence; serving with max_model_len %d (raise "
            "--kv-cache-memory-bytes or --gpu-memory-utilization, or lower "
            "--max-model-len, to silence this)",
            configured, num_blocks - 1, block_size, fitted, fitted,
        )
    return fitted
