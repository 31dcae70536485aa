"""VllmConfig resolution: dtype, max_model_len, limits, graphs; frozen once built; the
start-up plan (the extensible tri-state against every rank's VMM probe result).
"""

import dataclasses
import logging

import pytest
import torch
from transformers import LlamaConfig

from vllm import platforms
from vllm.config import (
    CacheConfig,
    CompilationConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.compilation import default_cudagraph_capture_sizes
from vllm.config.startup import StartupPlan

MODEL_MAX_LEN = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=MODEL_MAX_LEN, dtype="bfloat16").save_pretrained(path)
    return str(path)


def make(tiny_model, **cache_kwargs) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(tiny_model),
                      cache_config=CacheConfig(**cache_kwargs))


# ---- ModelConfig ----

def test_model_config_resolves_from_hf_dir(tiny_model):
    m = ModelConfig(tiny_model)
    assert m.tokenizer == tiny_model and m.served_model_name == tiny_model
    assert m.load_format == "safetensors" and m.max_model_len == MODEL_MAX_LEN and m.seed == 0
    assert (m.get_vocab_size(), m.get_num_layers(), m.get_head_size(), m.get_num_kv_heads()) == (
        128, 2, 16, 2)


def test_dtype_auto_asks_platform_with_checkpoint_dtype(tiny_model, monkeypatch):
    seen = []
    platform = platforms.current_platform
    monkeypatch.setattr(type(platform), "default_dtype",
                        lambda self, d: seen.append(d) or torch.float16)
    monkeypatch.setattr(type(platform), "supported_dtypes",
                        lambda self: [torch.float32, torch.float16, torch.bfloat16])
    assert ModelConfig(tiny_model).dtype == torch.float16
    assert seen == [torch.bfloat16]  # read from the checkpoint's config


@pytest.mark.parametrize("name, dtype", [("half", torch.float16), ("float16", torch.float16),
                                         ("bfloat16", torch.bfloat16), ("float", torch.float32),
                                         ("float32", torch.float32),
                                         (torch.bfloat16, torch.bfloat16)])
def test_dtype_names(tiny_model, monkeypatch, name, dtype):
    monkeypatch.setattr(type(platforms.current_platform), "supported_dtypes",
                        lambda self: [torch.float32, torch.float16, torch.bfloat16])
    assert ModelConfig(tiny_model, dtype=name).dtype == dtype


def test_dtype_errors(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', .*got 'int8'"):
        ModelConfig(tiny_model, dtype="int8")
    monkeypatch.setattr(type(platforms.current_platform), "supported_dtypes",
                        lambda self: [torch.float32])
    with pytest.raises(ValueError, match=r"dtype bfloat16 is not supported on the .* platform "
                                         r"\(supported: float32\)"):
        ModelConfig(tiny_model, dtype="bfloat16")


def test_max_model_len(tiny_model):
    assert ModelConfig(tiny_model, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match=f"max_model_len 513 is larger than the model's maximum "
                                         f"context length {MODEL_MAX_LEN}"):
        ModelConfig(tiny_model, max_model_len=MODEL_MAX_LEN + 1)
    with pytest.raises(ValueError, match=r"max_model_len must be an int >= 1 or -1 \(auto: "
                                         r"fit the KV cache\), got 0"):
        ModelConfig(tiny_model, max_model_len=0)
    auto = ModelConfig(tiny_model, max_model_len=-1)  # vLLM's "auto": fitted at start-up
    assert (auto.max_model_len, auto.max_model_len_origin) == (MODEL_MAX_LEN, "auto")


def test_load_format(tiny_model):
    assert ModelConfig(tiny_model, load_format="dummy").load_format == "dummy"
    with pytest.raises(ValueError, match="load_format 'gguf' needs a .gguf file"):
        ModelConfig(tiny_model, load_format="gguf")
    with pytest.raises(ValueError, match="load_format must be one of"):
        ModelConfig(tiny_model, load_format="pt")


def test_bundled_model_when_none(monkeypatch, tiny_model):
    import vllm.transformers_utils.config as tu

    monkeypatch.setattr(tu, "get_bundled_model_path", lambda: tiny_model)
    assert ModelConfig().model == tiny_model


# ---- the KV cache path: StartupPlan (docs/design.md, "Start-up") ----

def plan(**cache_kwargs) -> StartupPlan:
    """The plan for these cache settings, every rank's probe passing."""
    return StartupPlan.decide(CacheConfig(**cache_kwargs), [None])


def test_explicit_true_with_failing_probe_fails_with_reason():
    with pytest.raises(ValueError, match="cannot be honoured: cuMemCreate not supported by this "
                                         "driver"):
        StartupPlan.decide(CacheConfig(enable_extensible_kv_cache=True),
                           ["cuMemCreate not supported by this driver"])


def test_unset_with_failing_probe_falls_back_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="vllm"):
        p = StartupPlan.decide(CacheConfig(), ["no VMM here"])
    lines = [r for r in caplog.records if "Extensible KV cache unavailable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "no VMM here" in lines[0].getMessage()
    assert p.extensible_kv_cache is False and p.gpu_memory_utilization == 0.92
    assert p.gpu_memory_utilization_explicit is False and p.reason == "no VMM here"
    assert "kv_cache=classic" in p.describe() and "0.92 (default)" in p.describe()


def test_unset_with_passing_probe_is_extensible_at_full_utilization(caplog):
    with caplog.at_level(logging.INFO, logger="vllm"):
        p = plan()
    assert p.extensible_kv_cache is True and p.gpu_memory_utilization == 1.0
    assert p.reason is None
    assert not [r for r in caplog.records if "Extensible" in r.getMessage()]


def test_a_rank_that_cannot_puts_every_rank_on_the_classic_path():
    """Every rank's device is probed; one failing rank means classic for all, named."""
    p = StartupPlan.decide(CacheConfig(), [None, "no VMM on cuda:1"])
    assert p.extensible_kv_cache is False and p.gpu_memory_utilization == 0.92
    assert p.reason == "rank 1: no VMM on cuda:1"
    explicit = StartupPlan.decide(CacheConfig(gpu_memory_utilization=0.7), [None, "no VMM"])
    assert explicit.gpu_memory_utilization == 0.7  # the user's value stays
    with pytest.raises(ValueError, match="cannot be honoured: rank 1: no VMM on cuda:1"):
        StartupPlan.decide(CacheConfig(enable_extensible_kv_cache=True),
                           [None, "no VMM on cuda:1"])
    with pytest.raises(ValueError, match="enable_sleep_mode needs the extensible KV cache"):
        StartupPlan.decide(CacheConfig(enable_sleep_mode=True), [None, "no VMM"])


def test_explicit_false_never_consults_the_probes():
    p = StartupPlan.decide(CacheConfig(enable_extensible_kv_cache=False), ["not asked"])
    assert p.extensible_kv_cache is False and p.reason is None
    assert p.gpu_memory_utilization == 0.92


@pytest.mark.parametrize("reason", [None, "no VMM"])
def test_explicit_utilization_kept_on_both_paths(reason):
    p = StartupPlan.decide(CacheConfig(gpu_memory_utilization=0.6), [reason])
    assert p.gpu_memory_utilization == 0.6 and p.gpu_memory_utilization_explicit is True
    assert p.extensible_kv_cache is (reason is None)


def test_sleep_mode_needs_extensible():
    with pytest.raises(ValueError, match=r"sleep_mode needs the extensible KV cache.*no VMM"):
        StartupPlan.decide(CacheConfig(enable_sleep_mode=True), ["no VMM"])
    with pytest.raises(ValueError, match=r"enable_sleep_mode needs the extensible KV cache"):
        CacheConfig(enable_sleep_mode=True, enable_extensible_kv_cache=False)


def test_the_plan_gains_the_kv_cache_size():
    p = plan().with_kv_cache(num_blocks=100, max_model_len=256)
    assert (p.num_blocks, p.max_model_len, p.extensible_kv_cache) == (100, 256, True)
    assert "num_blocks=100, max_model_len=256" in p.describe()


def test_the_config_is_frozen_once_built(tiny_model):
    """Nothing rewrites a built configuration (a fallback, a fitted length): it raises."""
    cfg = make(tiny_model)
    for part, name, value in ((cfg.cache_config, "gpu_memory_utilization", 0.5),
                              (cfg.model_config, "max_model_len", 64),
                              (cfg.scheduler_config, "max_num_seqs", 2),
                              (cfg, "device_config", None)):
        with pytest.raises(dataclasses.FrozenInstanceError, match="read-only once built"):
            setattr(part, name, value)
    loose = CacheConfig()  # not part of an engine's config yet
    loose.block_size = 32
    assert loose.block_size == 32


# ---- CacheConfig ranges ----

@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 24}, "block_size must be a power of two in [1, 256], got 24"),
        ({"block_size": 512}, "block_size must be a power of two in [1, 256], got 512"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1], got 0.0"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization must be in (0, 1], got 1.2"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be an int > 0 (bytes), got 0"),
        ({"kv_cache_memory_bytes": 1.5e9}, "kv_cache_memory_bytes must be an int > 0"),
        ({"enable_extensible_kv_cache": "yes"}, "enable_extensible_kv_cache must be None"),
    ],
)
def test_cache_config_ranges(kwargs, message):
    with pytest.raises(ValueError) as e:
        CacheConfig(**kwargs)
    assert message in str(e.value)


def test_kv_cache_memory_bytes_kept(tiny_model):
    assert make(tiny_model, kv_cache_memory_bytes=2**30).cache_config.kv_cache_memory_bytes == 2**30


# ---- scheduler, parallel, compilation, kv transfer ----

def test_scheduler_defaults_per_device():
    s = SchedulerConfig()
    s.resolve(max_model_len=4096, device_type="cuda")
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (256, 8192, 4096)
    s = SchedulerConfig()
    s.resolve(max_model_len=4096, device_type="cpu")
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (64, 512)
    s = SchedulerConfig(max_num_seqs=10000)
    s.resolve(max_model_len=4096, device_type="cuda")
    assert s.max_num_batched_tokens == 10000  # default budget raised to hold every sequence


def test_scheduler_errors():
    s = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs "
                                         r"\(64\)"):
        s.resolve(max_model_len=1024, device_type="cuda")
    s = SchedulerConfig(max_num_batched_tokens=512, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"\(512\) is smaller than max_model_len \(1024\)"):
        s.resolve(max_model_len=1024, device_type="cuda")
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0)


def test_partial_prefill_defaults_and_errors():
    s = SchedulerConfig()
    s.resolve(max_model_len=4096, device_type="cpu")
    assert (s.max_num_partial_prefills, s.max_long_partial_prefills,
            s.long_prefill_token_threshold) == (4, 1, 0)
    s = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=4096)
    assert s.max_num_partial_prefills == 1  # without chunks there is nothing to share
    with pytest.raises(ValueError, match="max_num_partial_prefills=2 needs chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_partial_prefills=2)
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(3\) must be <= "
                                         r"max_num_partial_prefills \(2\)"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold \(5000\) must be <= "
                                         r"max_model_len \(4096\)"):
        SchedulerConfig(long_prefill_token_threshold=5000).resolve(4096, "cpu")


def test_partial_prefill_flags_reach_the_config():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.main import make_parser

    args = make_parser().parse_args(["serve", "--max-num-partial-prefills", "3",
                                     "--max-long-partial-prefills", "2",
                                     "--long-prefill-token-threshold", "1k"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_num_partial_prefills, engine_args.max_long_partial_prefills,
            engine_args.long_prefill_token_threshold) == (3, 2, 1000)
    sched = engine_args._configs_without_model()["scheduler_config"]
    assert (sched.max_num_partial_prefills, sched.max_long_partial_prefills,
            sched.long_prefill_token_threshold) == (3, 2, 1000)


def test_async_scheduling_default_fallback_and_flags(tiny_model, caplog):
    from vllm.config.vllm import resolve_async_scheduling
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.main import make_parser

    assert make(tiny_model).scheduler_config.async_scheduling is False  # CPU: nothing to overlap
    on = VllmConfig(model_config=ModelConfig(tiny_model),
                    scheduler_config=SchedulerConfig(async_scheduling=True))
    assert on.scheduler_config.async_scheduling is True

    def resolve(asked, backend="uni", speculative=None, kv_connector=None):
        return resolve_async_scheduling(asked, backend, speculative=speculative,
                                        kv_connector=kv_connector, cuda_alike=True)

    # Unset: on for a CUDA-like device with the uni executor, off with another executor.
    assert resolve(None) is True and resolve(None, "mp") is False
    # Unset with a draft model: off, one info line naming why.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm"):
        assert resolve(None, speculative="draft_model") is False
    assert "async scheduling off: not supported with speculative decoding" in caplog.text
    # n-gram drafts: on by default (the drafts proposed on the device), off when asked.
    assert resolve(None, speculative="ngram") is True
    assert resolve(True, speculative="ngram") is True
    assert resolve(False, speculative="ngram") is False
    # Asked for where it is unsupported: one warning, synchronous scheduling.
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert resolve(True, "mp") is False
    assert "async scheduling is not supported with the 'mp' executor" in caplog.text
    for kwargs, words in (({"speculative": "draft_model"}, "speculative decoding"),
                          ({"kv_connector": "NixlConnector"}, "a KV connector (NixlConnector)")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm"):
            assert resolve(True, **kwargs) is False
        assert f"async scheduling is not supported with {words}" in caplog.text
    with pytest.raises(ValueError, match="async_scheduling must be a bool, got 'yes'"):
        SchedulerConfig(async_scheduling="yes")
    for argv, expected in (([], None), (["--async-scheduling"], True),
                           (["--no-async-scheduling"], False)):
        args = make_parser().parse_args(["serve", *argv])
        sched = EngineArgs.from_cli_args(args)._configs_without_model()["scheduler_config"]
        assert sched.async_scheduling is expected


def test_parallel_config_values():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be one of \('uni'"):
        ParallelConfig(distributed_executor_backend="threads")


@pytest.mark.parametrize(
    ("tp", "backend", "devices", "expected"),
    [
        (1, None, 8, "uni"),
        (2, None, 8, "mp"),
        (2, None, None, "mp"),  # the CPU: ranks are host processes, no device limit
        (4, None, 2, "ray"),  # more ranks than this node's GPUs: several nodes
        (1, "mp", 1, "mp"),
        (2, "ray", 8, "ray"),
    ],
)
def test_executor_backend_defaults(tp, backend, devices, expected):
    config = ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend=backend)
    config.resolve_executor_backend(devices)
    assert config.distributed_executor_backend == expected


def test_executor_backend_errors():
    with pytest.raises(ValueError, match="'uni' runs one rank; tensor_parallel_size=2 needs 'mp'"):
        ParallelConfig(2, "uni").resolve_executor_backend(8)
    with pytest.raises(ValueError, match="needs 4 devices, this node has 2; the 'mp' executor"):
        ParallelConfig(4, "mp").resolve_executor_backend(2)


def test_kv_transfer_config():
    with pytest.raises(ValueError, match=r"kv_connector 'LMCacheConnectorV1' is not implemented "
                                         r"by this engine \(known connectors: OffloadingConnector, "
                                         r"NixlConnector\)"):
        KVTransferConfig.from_cli('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}')
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    cfg = KVTransferConfig.from_dict(dict(offload, kv_connector_extra_config={"num_cpu_blocks": 8}))
    assert cfg.kv_connector_extra_config == {"num_cpu_blocks": 8}
    for extra, message in [
        ({}, "needs exactly one of kv_connector_extra_config.cpu_bytes_to_use"),
        ({"num_cpu_blocks": 8, "cpu_bytes_to_use": 2**20}, "needs exactly one of"),
        ({"cpu_bytes_to_use": -1}, "cpu_bytes_to_use must be a positive integer, got -1"),
        ({"num_cpu_blocks": 4, "spill": 1}, r"unknown keys \['spill'\] for OffloadingConnector"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_dict(dict(offload, kv_connector_extra_config=extra))
    with pytest.raises(ValueError, match="OffloadingConnector needs kv_role 'kv_both'"):
        KVTransferConfig("OffloadingConnector", "kv_producer", {"num_cpu_blocks": 8})
    assert KVTransferConfig("NixlConnector", "kv_consumer").kv_role == "kv_consumer"
    for extra, message in [
        ({"side_channel_port": 99999}, "side_channel_port must be a TCP port"),
        ({"backends": "UCX"}, "backends must be a non-empty list of NIXL backend names"),
        ({"backends": []}, "backends must be a non-empty list"),
        ({"liveness_timeout_s": float("nan")}, "liveness_timeout_s must be a finite number"),
        ({"transfer_timeout_s": float("inf")}, "transfer_timeout_s must be a finite number"),
        ({"abort_timeout_s": True}, "abort_timeout_s must be a finite number"),
        ({"liveness_timeout_s": -1}, "liveness_timeout_s must be a finite number"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig("NixlConnector", "kv_consumer", extra)
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig(kv_role="sender")
    assert KVTransferConfig.from_cli('{"kv_role": "kv_both"}').kv_connector is None


def test_kv_connector_refused_with_tp_and_allowed_with_sleep(tiny_model):
    # A role without a connector would transfer nothing: refused, not ignored.
    with pytest.raises(ValueError, match="sets kv_role 'kv_both' but names no kv_connector"):
        VllmConfig(model_config=ModelConfig(tiny_model),
                   kv_transfer_config=KVTransferConfig.from_cli('{"kv_role": "kv_both"}'))
    kv = KVTransferConfig("NixlConnector", "kv_producer")
    with pytest.raises(ValueError, match=r"one rank only for now; tensor_parallel_size=2"):
        VllmConfig(model_config=ModelConfig(tiny_model), kv_transfer_config=kv,
                   parallel_config=ParallelConfig(2, "mp"))
    # Sleep deregisters the KV memory and wake registers it again (issue #13 item 4).
    config = VllmConfig(model_config=ModelConfig(tiny_model), kv_transfer_config=kv,
                        cache_config=CacheConfig(enable_sleep_mode=True))
    assert config.cache_config.enable_sleep_mode and config.kv_transfer_config is kv
    with pytest.raises(ValueError, match="cannot be combined with enable_elastic_kv_cache"):
        VllmConfig(model_config=ModelConfig(tiny_model), kv_transfer_config=kv,
                   cache_config=CacheConfig(enable_elastic_kv_cache=True))
    cfg = VllmConfig(model_config=ModelConfig(tiny_model), kv_transfer_config=kv)
    assert cfg.kv_transfer_config is kv


def test_cudagraph_default_sizes():
    assert default_cudagraph_capture_sizes(1) == [1]
    assert default_cudagraph_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_cudagraph_capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-2:] == [248, 256] and len(sizes) == 35
    sizes = default_cudagraph_capture_sizes(300)
    assert sizes[-4:] == [256, 272, 288, 300]


def test_cudagraph_sizes_resolution(tiny_model):
    cfg = VllmConfig(model_config=ModelConfig(tiny_model),
                     scheduler_config=SchedulerConfig(max_num_seqs=8),
                     compilation_config=CompilationConfig(cudagraph_capture_sizes=[16, 4, 1, 4]))
    assert cfg.compilation_config.cudagraph_capture_sizes == [1, 4]  # sorted, deduped, capped
    assert cfg.compilation_config.use_cudagraph == platforms.current_platform.is_cuda_alike()
    c = CompilationConfig(enforce_eager=True)
    c.resolve(max_num_seqs=8, graphs_supported=True)
    assert c.use_cudagraph is False and c.cudagraph_capture_sizes == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a non-empty list"):
        CompilationConfig(cudagraph_capture_sizes=[0, 2])


def test_cudagraph_mode_and_mixed_sizes():
    # Issue 50: steps with prefill chunks replay graphs per token bucket, capped at
    # the step's token budget; vLLM's mode names turn them (or all graphs) on and off.
    # The default is FULL (run on an H100 2026-12-07: cuda tests, short-prompt TTFT).
    c = CompilationConfig()
    c.resolve(max_num_seqs=8, graphs_supported=True, max_num_batched_tokens=100)
    assert c.cudagraph_mode == "FULL" and c.mixed_capture_sizes == [16, 32, 64]
    assert c.decode_capture_sizes == [1, 2, 4, 8]
    c = CompilationConfig(cudagraph_mode="full_and_piecewise")  # vLLM's default, same here
    c.resolve(max_num_seqs=8, graphs_supported=True, max_num_batched_tokens=8192)
    assert c.cudagraph_mode == "FULL_AND_PIECEWISE"
    assert c.mixed_capture_sizes == [16, 32, 64, 128, 256]
    c = CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY")
    c.resolve(max_num_seqs=8, graphs_supported=True, max_num_batched_tokens=8192)
    assert c.use_cudagraph and c.mixed_capture_sizes == [] and c.decode_capture_sizes
    c = CompilationConfig(cudagraph_mode="NONE")
    c.resolve(max_num_seqs=8, graphs_supported=True, max_num_batched_tokens=8192)
    assert not c.use_cudagraph and c.mixed_capture_sizes == [] == c.decode_capture_sizes
    for off in (CompilationConfig(enforce_eager=True), CompilationConfig(cudagraph_mode="FULL")):
        off.resolve(max_num_seqs=8, graphs_supported=off.enforce_eager, max_num_batched_tokens=64)
        assert off.mixed_capture_sizes == []  # eager, or a platform without graphs (CPU)
    with pytest.raises(ValueError, match=r"cudagraph_mode must be one of .*use FULL"):
        CompilationConfig(cudagraph_mode="PIECEWISE")
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        CompilationConfig(cudagraph_mode=2)


def test_summary_says_what_was_asked(tiny_model):
    line = make(tiny_model).summary()
    assert "kv_cache=auto" in line and "gpu_memory_utilization=None" in line
    line = make(tiny_model, enable_extensible_kv_cache=False,
                gpu_memory_utilization=0.5).summary()
    assert "kv_cache=classic" in line and "gpu_memory_utilization=0.5" in line


def test_elastic_requires_the_extensible_cache():
    assert plan(enable_elastic_kv_cache=True).elastic_kv_cache is True
    with pytest.raises(ValueError, match="drop --no-enable-extensible-kv-cache"):
        CacheConfig(enable_elastic_kv_cache=True, enable_extensible_kv_cache=False)
    with pytest.raises(ValueError, match="enable_elastic_kv_cache must be a bool"):
        CacheConfig(enable_elastic_kv_cache="yes")
    with pytest.raises(ValueError, match="needs the extensible KV cache, which cannot be "
                                         "honoured here: no VMM here"):
        StartupPlan.decide(CacheConfig(enable_elastic_kv_cache=True), ["no VMM here"])
