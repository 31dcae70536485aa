"""EngineArgs <-> CLI: every flag round-trips, --no- forms, JSON configs, clear errors."""

import argparse

import pytest

from vllm.config import CompilationConfig
from vllm.engine.arg_utils import (
    AsyncEngineArgs,
    EngineArgs,
    human_readable_bytes,
    human_readable_int,
    human_readable_int_or_auto,
)


def parse(argv):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_no_flags_gives_dataclass_defaults():
    assert parse([]) == EngineArgs()
    assert EngineArgs().enable_extensible_kv_cache is None


def test_every_flag_round_trips():
    args = parse([
        "--model", "/m", "--tokenizer", "/t", "--dtype", "bfloat16", "--max-model-len", "4k",
        "--seed", "7", "--load-format", "dummy", "--block-size", "32",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "2GiB",
        "--enable-extensible-kv-cache", "--no-enable-prefix-caching", "--enable-sleep-mode",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--enforce-eager",
        "-O", '{"cudagraph_capture_sizes": [1, 2, 8]}', "-tp", "1",
        "--kv-transfer-config", "{}", "--disable-log-stats",
    ])
    assert args == EngineArgs(
        model="/m", tokenizer="/t", dtype="bfloat16", max_model_len=4000, seed=7,
        load_format="dummy", block_size=32, gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=2 * 2**30, enable_extensible_kv_cache=True,
        enable_prefix_caching=False, enable_sleep_mode=True, max_num_seqs=64,
        max_num_batched_tokens=4096, enforce_eager=True,
        compilation_config=CompilationConfig(cudagraph_capture_sizes=[1, 2, 8]),
        tensor_parallel_size=1, kv_transfer_config=args.kv_transfer_config,
        disable_log_stats=True,
    )
    assert args.kv_transfer_config.kv_connector is None


def test_no_forms():
    args = parse(["--no-enable-extensible-kv-cache", "--enable-prefix-caching",
                  "--no-enforce-eager", "--no-enable-sleep-mode", "--tensor-parallel-size", "2"])
    assert args.enable_extensible_kv_cache is False
    assert args.enable_prefix_caching is True and args.enforce_eager is False
    assert args.tensor_parallel_size == 2  # parsed; rejected when the config is built


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--load-format", "pt"], "invalid choice: 'pt'"),
        (["--max-model-len", "1.5K"], "fraction needs a decimal suffix"),
        (["--kv-cache-memory-bytes", "4XB"], "invalid byte count '4XB'"),
        (["--kv-transfer-config", '{"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}'],
         "'MooncakeConnector' is not implemented by this engine (known connectors: "
         "OffloadingConnector, NixlConnector)"),
        (["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'],
         "needs exactly one of kv_connector_extra_config.cpu_bytes_to_use"),
        (["--kv-transfer-config", "{bad"], "not valid JSON"),
        (["--kv-transfer-config", '{"kv_rank": 0}'], "unknown keys ['kv_rank']"),
        (["-O", '{"level": 3}'], "unknown keys ['level']"),
        (["--structured-outputs-config", '{"backend": "outlines"}'],
         "backend 'outlines' is not available in this engine; use one of ['auto', 'xgrammar', "
         "'guidance', 'llguidance']"),
        (["--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
        (["--structured-outputs-config", '{"backend": "nope"}'], "backend 'nope' is unknown"),
        (["--structured-outputs-config", '{"reasoning": 1}'], "unknown keys ['reasoning']"),
        (["--structured-outputs-config", '{"disable_any_whitespace": 1}'],
         "disable_any_whitespace must be a bool"),
    ],
)
def test_bad_values_rejected_with_reason(argv, message):
    with pytest.raises(argparse.ArgumentError) as e:
        parse(argv)
    assert message in str(e.value)


def test_unknown_flag_rejected():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(SystemExit):  # argparse reports unrecognized arguments and exits
        parser.parse_args(["--bogus-flag"])


def test_unknown_kwarg_rejected():
    with pytest.raises(TypeError, match="bogus"):
        EngineArgs(bogus=1)
    # vLLM's own keywords are known: one this fork does not build is refused by value.
    with pytest.raises(ValueError, match="--quantization awq is not supported by this fork"):
        EngineArgs(quantization="awq").validate()


def test_human_readable_numbers():
    assert human_readable_int("4096") == 4096
    assert human_readable_int("32k") == 32000 and human_readable_int("32K") == 32768
    assert human_readable_int("25.6k") == 25600
    assert human_readable_bytes("4G") == 4 * 2**30 and human_readable_bytes("4g") == 4 * 10**9
    assert human_readable_bytes("4GiB") == 4 * 2**30 and human_readable_bytes("4GB") == 4 * 10**9
    assert human_readable_bytes("512 MiB") == 512 * 2**20
    with pytest.raises(argparse.ArgumentTypeError, match=r"invalid integer '-5': must not be "
                       "negative"):
        human_readable_int("-5")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer, optionally"):
        human_readable_int("five")


def test_async_engine_args_flag():
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--enable-log-requests",
                                                            "--max-num-seqs", "3"]))
    assert isinstance(args, AsyncEngineArgs)
    assert args.enable_log_requests and args.max_num_seqs == 3


# ---- create_engine_config: the one place values are validated ----

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256).save_pretrained(path)
    return str(path)


def test_create_engine_config_carries_every_value(tiny_model):
    cfg = parse([
        "--model", tiny_model, "--max-model-len", "128", "--block-size", "8", "--seed", "3",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "64MiB",
        "--no-enable-extensible-kv-cache", "--no-enable-prefix-caching", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256", "--enforce-eager", "--load-format", "dummy",
        "--kv-transfer-config", '{}',
    ]).create_engine_config()
    m, c, s = cfg.model_config, cfg.cache_config, cfg.scheduler_config
    assert (m.model, m.tokenizer, m.max_model_len, m.seed, m.load_format) == (
        tiny_model, tiny_model, 128, 3, "dummy")
    assert (c.block_size, c.gpu_memory_utilization, c.kv_cache_memory_bytes) == (8, 0.5, 64 << 20)
    assert c.enable_extensible_kv_cache is False and c.enable_prefix_caching is False
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (4, 256)
    assert cfg.compilation_config.use_cudagraph is False
    assert cfg.compilation_config.cudagraph_capture_sizes == [1, 2, 4]
    assert cfg.kv_transfer_config is None  # an empty config: no connector, as in vLLM


def test_max_model_len_auto_is_the_models_length_marked_for_fitting(tiny_model):
    """vLLM's `--max-model-len auto` (or -1): the model's length, which start-up lowers to
    what the KV cache holds; a length passed or left unset is kept (or fails start-up)."""
    assert human_readable_int_or_auto("auto") == human_readable_int_or_auto(" -1") == -1
    assert human_readable_int_or_auto("4k") == 4000
    origins = {}
    for argv in (["--max-model-len", "AUTO"], ["--max-model-len", "128"], []):
        m = parse(["--model", tiny_model, "--load-format", "dummy", *argv]
                  ).create_engine_config().model_config
        origins[m.max_model_len_origin] = m.max_model_len
    assert origins == {"auto": 256, "explicit": 128, "model": 256}


def test_served_model_name_reaches_the_engine(tiny_model):
    """`vllm serve --served-model-name engine-a` (a list on the CLI): the engine's
    ModelConfig knows the name (it named the engine after the model path in
    `vllm kv-top` while /v1/models said engine-a); the first of several is reported."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("--served-model-name", nargs="+")  # the server's flag (cli_args)
    args = parser.parse_args(["--model", tiny_model, "--served-model-name", "engine-a", "b"])
    assert EngineArgs.from_cli_args(args).create_engine_config(
        ).model_config.served_model_name == "engine-a"
    assert EngineArgs(model=tiny_model, served_model_name="x").create_engine_config(
        ).model_config.served_model_name == "x"
    # Unset: the MODEL argument as given, else the bundled model's name, as /v1/models says.
    assert EngineArgs(model=tiny_model).create_engine_config(
        ).model_config.served_model_name == tiny_model
    assert EngineArgs(max_model_len=128).create_engine_config(
        ).model_config.served_model_name == "SmolLM2-135M-Instruct"
    for bad in ([], "", [""], [3]):
        with pytest.raises(ValueError, match="served_model_name must be a non-empty string"):
            EngineArgs(model=tiny_model, served_model_name=bad).create_engine_config()


def test_the_registry_names_an_engine_by_its_served_name():
    from vllm.v1.engine.elastic_kv import registry_name

    gguf = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert registry_name("engine-a", gguf) == "engine-a"
    assert registry_name("org/llama-8b", "/models/llama") == "org/llama-8b"  # kept whole
    assert registry_name(gguf, gguf) == "SmolLM2-135M-Instruct.Q4_1"  # no name given
    assert registry_name("/models/llama/", "/models/llama/") == "llama"


def test_create_engine_config_rejects_unsupported(tiny_model):
    with pytest.raises(ValueError, match="'uni' runs one rank; tensor_parallel_size=2 needs"):
        EngineArgs(model=tiny_model, tensor_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config()
    with pytest.raises(ValueError, match="'MooncakeConnector' is not implemented"):
        EngineArgs(model=tiny_model, kv_transfer_config={
            "kv_connector": "MooncakeConnector", "kv_role": "kv_both"}).create_engine_config()
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineArgs(model=tiny_model, block_size=48).create_engine_config()


def test_compilation_config_dict_and_enforce_eager(tiny_model):
    cfg = EngineArgs(model=tiny_model, max_num_seqs=16, enforce_eager=True,
                     compilation_config={"cudagraph_capture_sizes": [2, 16]}
                     ).create_engine_config()
    assert cfg.compilation_config.enforce_eager is True
    assert cfg.compilation_config.cudagraph_capture_sizes == [2, 16]
    with pytest.raises(ValueError, match=r"unknown keys \['mode'\]"):
        EngineArgs(model=tiny_model, compilation_config={"mode": 3}).create_engine_config()
    cfg = EngineArgs(model=tiny_model, enforce_eager=True, compilation_config={
        "cudagraph_mode": "FULL_DECODE_ONLY"}).create_engine_config()
    assert cfg.compilation_config.cudagraph_mode == "FULL_DECODE_ONLY"
    assert parse(["-O", '{"cudagraph_mode": "NONE"}']).compilation_config == CompilationConfig(
        cudagraph_mode="NONE")


def test_structured_outputs_config_flag():
    args = parse(["--structured-outputs-config",
                  '{"backend": "xgrammar", "disable_any_whitespace": true}'])
    config = args.structured_outputs_config
    assert (config.backend, config.disable_any_whitespace) == ("xgrammar", True)
    assert parse([]).structured_outputs_config is None  # the default: auto, whitespace allowed
