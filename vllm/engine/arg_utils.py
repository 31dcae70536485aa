"""`EngineArgs`: the engine's user-facing arguments, and the CLI flags for them.

```
LLM(**kwargs) ----------------> EngineArgs --create_engine_config()--> VllmConfig
vllm serve --flags --(argparse)-^  (from_cli_args)                     (validated once)
```

Flag names are vLLM's. argparse rejects flags it does not know; values the
engine does not support (a model that does not split over the ranks, an
unknown KV connector) are rejected when the config is built, with a message naming the value.
vLLM flags that map onto this engine are accepted (`--revision`, `--download-dir`,
`--trust-remote-code`, `--enable-chunked-prefill`, `--kv-cache-dtype auto`,
`--swap-space` with a warning); those that do not (`--quantization` methods,
`--enable-lora`, fp8 KV caches) are refused by `_refuse_unsupported` with a line
saying so and what this fork does instead.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from vllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from vllm.config.model import DTYPE_CHOICES, LOAD_FORMAT_CHOICES
from vllm.config.multimodal import MultiModalConfig, limit_mm_per_prompt_from_cli
from vllm.config.parallel import DEFAULT_WORKER_CLS, EXECUTOR_BACKENDS
from vllm.config.scheduler import DEFAULT_LIMITS, DEFAULT_MAX_NUM_PARTIAL_PREFILLS
from vllm.config.vllm import check_kv_transfer_combination
from vllm.logger import init_logger
from vllm.transformers_utils.model_path import (
    BUNDLED_MODEL_NAME,
    check_generation_config_path,
    check_model_path,
    get_bundled_model_path,
    is_gguf,
    resolve_model,
)

# Suffixes for integer flags. vLLM's convention: lowercase k/m/g/t are decimal
# (1k = 1000, decimals allowed: 25.6k), uppercase K/M/G/T binary (1K = 1024).
# Byte flags also take explicit units: KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal).
logger = init_logger(__name__)

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DECIMAL_BYTES = {f"{p}B": 10 ** (3 * i) for i, p in enumerate("KMGT", 1)}
_BINARY_BYTES = {"B": 1, **{f"{p}iB": 2 ** (10 * i) for i, p in enumerate("KMGT", 1)}}
_NUMBER_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")


def _parse_int(value: str, decimal: dict[str, int], binary: dict[str, int], what: str) -> int:
    match = _NUMBER_RE.fullmatch(value.strip())
    suffix = match.group(2) if match else None
    if match is None and _NUMBER_RE.fullmatch(value.strip().lstrip("-")):
        raise argparse.ArgumentTypeError(f"invalid {what} {value!r}: must not be negative")
    if suffix is None or (suffix and suffix not in decimal and suffix not in binary):
        raise argparse.ArgumentTypeError(
            f"invalid {what} {value!r}: expected an integer, optionally with a suffix "
            f"({', '.join([*decimal, *binary])})"
        )
    number = match.group(1)
    if suffix in decimal:
        return int(float(number) * decimal[suffix])
    if "." in number:  # 1.5K is ambiguous; 1.5k (decimal) is not
        raise argparse.ArgumentTypeError(
            f"invalid {what} {value!r}: a fraction needs a decimal suffix ({', '.join(decimal)})"
        )
    return int(number) * binary.get(suffix, 1)


def human_readable_int(value: str) -> int:
    """An int flag with vLLM's suffixes: `4096`, `32k` (32000), `32K` (32768), `25.6k`."""
    return _parse_int(value, _DECIMAL, _BINARY, "integer")


def human_readable_int_or_auto(value: str) -> int:
    """`--max-model-len`: a human-readable int, or vLLM's `auto` / `-1` (-1: fit the KV cache)."""
    return -1 if value.strip().lower() in ("auto", "-1") else human_readable_int(value)


def human_readable_bytes(value: str) -> int:
    """A byte count: `4294967296`, vLLM's `4G` (= 4 GiB) / `4g` (= 4e9), or `4GiB` / `4GB`."""
    return _parse_int(
        value, {**_DECIMAL, **_DECIMAL_BYTES}, {**_BINARY, **_BINARY_BYTES}, "byte count"
    )


def _json_type(parse, name: str):
    """An argparse type that turns a JSON string into a config, keeping the error message."""

    def parse_json(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    parse_json.__name__ = name
    return parse_json


@dataclass
class EngineArgs:
    """Arguments of one engine (vLLM's names; see `add_cli_args` for each one's meaning).

    `LLM(**kwargs)` builds one of these; an unknown keyword is a TypeError.
    Values are checked when `create_engine_config()` builds the `VllmConfig`.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int | None = 0
    load_format: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enable_extensible_kv_cache: bool | None = None
    enable_elastic_kv_cache: bool = False
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    async_scheduling: bool | None = None
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False
    compilation_config: CompilationConfig | dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_cls: str = DEFAULT_WORKER_CLS
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | str | None = None
    disable_log_stats: bool = False
    generation_config: str = "auto"
    max_logprobs: int = 20
    served_model_name: str | list[str] | None = None  # None: `model` as given, as /v1/models
    # vLLM's flags for where a model comes from and what it may run.
    revision: str | None = None
    download_dir: str | None = None
    trust_remote_code: bool = False
    # vLLM's flags for what this fork does one way only: accepted for that way.
    enable_chunked_prefill: bool | None = None
    kv_cache_dtype: str = "auto"
    swap_space: float | None = None
    quantization: str | None = None
    enable_lora: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags to `parser` (in an "EngineArgs" group) and return it."""
        g = parser.add_argument_group("EngineArgs")
        _add_model_args(g)
        _add_cache_args(g)
        _add_scheduler_args(g)
        _add_execution_args(g)
        _add_feature_args(g)
        _add_vllm_compat_args(g)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from a namespace parsed with `add_cli_args` (extra attributes ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def validate(self) -> None:
        """Check every value that needs neither torch nor the model's files.

        That is the ranges and combinations of the cache, scheduler, parallel,
        compilation and KV-transfer configs (built and dropped here: their
        constructors check them), the combinations a KV connector refuses, that
        the vLLM flags this fork does not build are absent, and that the model
        path exists (a Hugging Face id is resolved: `resolve_model`). `vllm serve`
        runs this before importing torch, so a bad flag fails in a fraction of a
        second; `create_engine_config` runs the same checks and then those that
        need the platform or the model's config (dtype, max_model_len, the VMM
        probe).

        Raises:
            ValueError / FileNotFoundError: the first invalid value, naming it.
        """
        configs = self._configs_without_model()
        check_kv_transfer_combination(configs["kv_transfer_config"],
                                      configs["parallel_config"], configs["cache_config"],
                                      configs["speculative_config"])
        model = self._model_path()
        if model is not None:
            check_model_path(model)
        if self.quantization == "gguf" and not is_gguf(model or get_bundled_model_path()):
            raise ValueError("--quantization gguf needs a .gguf model file; this fork detects "
                             "GGUF from the path, so the flag can be left out")
        check_generation_config_path(self.generation_config)
        spec = configs["speculative_config"]
        if spec is not None and spec.model is not None:
            try:
                check_model_path(spec.model)
            except FileNotFoundError as e:  # say which model: the draft, not the target
                raise FileNotFoundError(f"speculative_config: draft {e}") from None

    def create_engine_config(self) -> VllmConfig:
        """Build and validate the engine's `VllmConfig` (the one place args are checked).

        Raises:
            ValueError: any invalid or unsupported value, naming the field.
        """
        model_config = ModelConfig(
            model=self._model_path(),
            tokenizer=None if self.tokenizer is None else resolve_model(self.tokenizer),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            load_format=self.load_format,
            generation_config=self.generation_config,
            max_logprobs=self.max_logprobs,
            served_model_name=(self.model or BUNDLED_MODEL_NAME) if self.served_model_name
            is None else self.served_model_name,
            trust_remote_code=self.trust_remote_code,
        )
        _check_kv_cache_dtype(self.kv_cache_dtype, model_config.dtype)
        if self.swap_space is not None:
            logger.warning("--swap-space %g is accepted and has no effect: this fork (as vLLM "
                           "V1) preempts by recomputation and keeps no CPU swap space",
                           self.swap_space)
        return VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig(),
            **self._configs_without_model(),
        )

    def _model_path(self) -> str | None:
        """The model as a local path (a Hugging Face id resolved: `resolve_model`)."""
        if self.model is None:
            if self.revision is not None:
                raise ValueError(f"--revision {self.revision!r} applies to a Hugging Face model "
                                 "id; the bundled model (no MODEL given) is a local file")
            return None
        return resolve_model(self.model, self.revision, self.download_dir)

    def _configs_without_model(self) -> dict[str, Any]:
        """The sub-configs that need neither torch nor the model (each checks itself)."""
        _refuse_unsupported(self)
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_extensible_kv_cache=self.enable_extensible_kv_cache,
            enable_sleep_mode=self.enable_sleep_mode,
            enable_elastic_kv_cache=self.enable_elastic_kv_cache,
        )
        return dict(
            cache_config=cache_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_partial_prefills=self.max_num_partial_prefills,
                max_long_partial_prefills=self.max_long_partial_prefills,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                async_scheduling=self.async_scheduling, policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                worker_cls=self.worker_cls,
            ),
            compilation_config=self._compilation_config(),
            kv_transfer_config=self._kv_transfer_config(),
            speculative_config=SpeculativeConfig.coerce(self.speculative_config),
            structured_outputs_config=StructuredOutputsConfig.coerce(
                self.structured_outputs_config),
            multimodal_config=MultiModalConfig(
                limit_mm_per_prompt=self.limit_mm_per_prompt or {},
                allowed_local_media_path=self.allowed_local_media_path,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                encoder_cache_size=self.encoder_cache_size,
            ),
        )

    def _compilation_config(self) -> CompilationConfig:
        cc = self.compilation_config
        if cc is None:
            return CompilationConfig(enforce_eager=self.enforce_eager)
        if isinstance(cc, dict):
            cc = CompilationConfig.from_dict(cc)
        elif not isinstance(cc, CompilationConfig):
            raise ValueError(f"compilation_config must be a dict or CompilationConfig, got {cc!r}")
        # --enforce-eager wins when given alongside a compilation config.
        return CompilationConfig(
            enforce_eager=cc.enforce_eager or self.enforce_eager,
            cudagraph_capture_sizes=cc.cudagraph_capture_sizes, cudagraph_mode=cc.cudagraph_mode)

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        kv = self.kv_transfer_config
        if kv is None or isinstance(kv, KVTransferConfig):
            return kv
        if isinstance(kv, str):
            return KVTransferConfig.from_cli(kv)
        if isinstance(kv, dict):
            return KVTransferConfig.from_dict(kv)
        raise ValueError(
            f"kv_transfer_config must be a JSON string, dict or KVTransferConfig, got {kv!r}"
        )


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    """The model, its weights and tokenizer, dtype, context length and seed."""
    d = EngineArgs
    g.add_argument("--model", type=str, default=d.model,
                   help="HF model directory or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct).")
    g.add_argument("--tokenizer", type=str, default=d.tokenizer,
                   help="Tokenizer path (default: the model's own).")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype,
                   help="Weight and activation dtype (default: %(default)s: the platform's "
                        "choice: bfloat16 on CUDA, float16 for fp16 checkpoints, float32 on "
                        "the CPU).")
    g.add_argument("--max-model-len", type=human_readable_int_or_auto, default=d.max_model_len,
                   help="Context length in tokens (prompt + output), e.g. 4096 or 4k; default: "
                        "the model's. A KV cache too small for one request of it fails the "
                        "start-up, as in vLLM; 'auto' (-1): the model's, fitted to the cache.")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="Random seed of the engine (default: %(default)s).")
    g.add_argument("--load-format", choices=LOAD_FORMAT_CHOICES, default=d.load_format,
                   help="Weight format; 'dummy' = random weights (default: %(default)s: "
                        "from the path).")


def _add_cache_args(g: argparse._ArgumentGroup) -> None:
    """KV cache: block size, how much memory, extensible / elastic, prefix caching, sleep."""
    d = EngineArgs
    bool_flag = argparse.BooleanOptionalAction
    g.add_argument("--block-size", type=int, default=d.block_size,
                   help="Tokens per KV cache block, a power of two, 1-256 "
                        "(default: %(default)s).")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="Fraction of total device memory the engine may use, in (0, 1] "
                        "(default: 1.0 extensible, 0.92 classic KV cache).")
    g.add_argument("--kv-cache-memory-bytes", type=human_readable_bytes,
                   default=d.kv_cache_memory_bytes,
                   help="Explicit KV cache size in bytes: 4294967296, 4GiB, 4G (binary) "
                        "or 4GB (decimal); bypasses measured sizing (default: unset: "
                        "measured).")
    g.add_argument("--enable-extensible-kv-cache", action=bool_flag,
                   default=d.enable_extensible_kv_cache,
                   help="Reserve, warm up, measure, then grow the KV cache (default: on "
                        "where the platform supports it; the flag makes it required).")
    g.add_argument("--enable-elastic-kv-cache", action=bool_flag,
                   default=d.enable_elastic_kv_cache,
                   help="Commit KV cache memory while serving as it is needed, only into "
                        "memory free at that moment, and return free tail blocks when "
                        "idle, so engines share a device without tuning (implies "
                        "--enable-extensible-kv-cache; default: off).")
    g.add_argument("--enable-prefix-caching", action=bool_flag,
                   default=d.enable_prefix_caching,
                   help="Reuse KV cache blocks of shared prompt prefixes (default: on).")
    g.add_argument("--enable-sleep-mode", action=bool_flag, default=d.enable_sleep_mode,
                   help="Allow sleep()/wake_up() (POST /sleep, /wake_up): level 1 offloads "
                        "the weights to host memory and discards the KV cache, level 2 "
                        "discards both; wake_up maps them back at the same addresses "
                        "(default: off).")


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    """Scheduler: requests and tokens per step, partial prefills, async scheduling."""
    d = EngineArgs
    bool_flag = argparse.BooleanOptionalAction
    (cuda_seqs, cuda_tokens), (cpu_seqs, cpu_tokens) = DEFAULT_LIMITS["cuda"], DEFAULT_LIMITS["cpu"]
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"Most requests per step, and the most samples (n) of one "
                        f"request (default: {cuda_seqs} on CUDA, {cpu_seqs} on CPU).")
    g.add_argument("--max-num-batched-tokens", type=human_readable_int,
                   default=d.max_num_batched_tokens,
                   help=f"Token budget per step (default: {cuda_tokens} on CUDA, "
                        f"{cpu_tokens} on CPU).")
    g.add_argument("--max-num-partial-prefills", type=int,
                   default=d.max_num_partial_prefills,
                   help=f"Most requests mid-prefill at once; above 1 the prefills of a step "
                        f"share its budget, so a short prompt is not stuck behind a long "
                        f"one (default: {DEFAULT_MAX_NUM_PARTIAL_PREFILLS}; vLLM's: 1).")
    g.add_argument("--max-long-partial-prefills", type=int,
                   default=d.max_long_partial_prefills,
                   help="Most prompts longer than --long-prefill-token-threshold prefilled "
                        "at once; shorter prompts may go ahead of the others (default: 1).")
    g.add_argument("--long-prefill-token-threshold", type=human_readable_int,
                   default=d.long_prefill_token_threshold,
                   help="Prompts with more tokens to compute are long, and compute at most "
                        "this many tokens a step (default: 0 = 4%% of --max-model-len count "
                        "as long, no cap).")
    g.add_argument("--async-scheduling", action=bool_flag, default=d.async_scheduling,
                   help="Schedule and prepare the next step while the device runs this "
                        "one; sampled tokens feed the next step on the device (default: "
                        "on for CUDA with the 'uni' executor, off elsewhere; unsupported "
                        "combinations fall back to synchronous with a warning).")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=d.scheduling_policy,
                   help="Request order: fcfs, or priority (lower first; default: %(default)s).")


def _add_execution_args(g: argparse._ArgumentGroup) -> None:
    """How the model runs: CUDA graphs, tensor-parallel ranks, their executor and worker."""
    d = EngineArgs
    bool_flag = argparse.BooleanOptionalAction
    g.add_argument("--enforce-eager", action=bool_flag, default=d.enforce_eager,
                   help="Never capture CUDA graphs (default: off).")
    _add_json_config_arg(g, "-O", "--compilation-config", parse=CompilationConfig.from_cli,
                         help_text='JSON, e.g. \'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\' '
                                   "(default: decode batch sizes up to --max-num-seqs; "
                                   "cudagraph_mode FULL adds mixed steps up to 256 tokens).")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="Devices (ranks) to shard the model over; each rank is a process "
                        "with its own KV cache (default: %(default)s).")
    g.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
                   default=d.distributed_executor_backend,
                   help="How the ranks run: 'uni' in the engine process (one rank), 'mp' "
                        "one process per rank on this node, 'ray' Ray actors (several "
                        "nodes). Default: 'uni' for one rank, 'ray' when Ray is "
                        "initialised or the ranks outnumber this node's GPUs, else 'mp'.")
    g.add_argument("--worker-cls", type=str, default=d.worker_cls,
                   help="The worker class each rank runs, as 'package.module.Class' "
                        "(a subclass of the default, for instrumentation; default: "
                        "%(default)s).")


def _add_feature_args(g: argparse._ArgumentGroup) -> None:
    """KV connector, generation config, logprob cap, speculative decoding, stats logging."""
    d = EngineArgs
    _add_json_config_arg(g, "--kv-transfer-config", parse=KVTransferConfig.from_cli,
                         help_text='KV connector as JSON: \'{"kv_connector": ..., "kv_role": '
                                   '...}\' (connectors: OffloadingConnector, NixlConnector; '
                                   "see docs/kv_connectors.md; default: none).")
    g.add_argument("--generation-config", type=str, default=d.generation_config,
                   help="Where the generation config comes from: 'auto' (the model's "
                        "generation_config.json, or a GGUF file's metadata), 'vllm' (its "
                        "EOS ids only, no sampling defaults), or a directory holding "
                        "generation_config.json. Its EOS ids stop generation; its "
                        "temperature, top_p, top_k, min_p and repetition_penalty become the "
                        "defaults a request overrides (default: %(default)s).")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="The most logprobs (sample or prompt) a request may ask for; -1 "
                        "lifts the cap, so logprobs / prompt_logprobs -1 return the whole "
                        "vocabulary (default: %(default)s).")
    _add_json_config_arg(g, "--speculative-config", parse=SpeculativeConfig.from_cli,
                         help_text='Speculative decoding as JSON (vLLM\'s keys): \'{"method": '
                                   '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": '
                                   '5, "prompt_lookup_min": 2}\' (default: none).')
    _add_json_config_arg(g, "--structured-outputs-config",
                         parse=StructuredOutputsConfig.coerce,
                         help_text='vLLM\'s JSON: \'{"backend": "xgrammar", "disable_any_'
                                   'whitespace": false}\' (guidance = llguidance; default: auto '
                                   '= xgrammar, else llguidance; whitespace allowed).')
    _add_json_config_arg(g, "--limit-mm-per-prompt", parse=limit_mm_per_prompt_from_cli,
                         help_text='Most images per prompt as JSON, vLLM\'s form: \'{"image": '
                                   '2}\' (default: 999 each; multimodal models only).')
    g.add_argument("--allowed-local-media-path", type=str, default=d.allowed_local_media_path,
                   help="Directory file:// image URLs may read from (default: refused).")
    g.add_argument("--max-num-encoder-input-tokens", type=human_readable_int,
                   default=d.max_num_encoder_input_tokens,
                   help="Image tokens the vision encoder computes per step (default: "
                        "max(--max-num-batched-tokens, one worst-case image); start-up "
                        "halves it while the worst case does not fit the device).")
    g.add_argument("--encoder-cache-size", type=human_readable_int, default=d.encoder_cache_size,
                   help="Image tokens of encoder output kept until their placeholders are "
                        "computed (default: the encoder budget).")
    g.add_argument("--disable-log-stats", action="store_true", default=d.disable_log_stats,
                   help="Do not log engine statistics periodically (default: log every 10 s).")


def _add_vllm_compat_args(g: argparse._ArgumentGroup) -> None:
    """vLLM's flags for the model's source, and those this fork does one way only."""
    d = EngineArgs
    bool_flag = argparse.BooleanOptionalAction
    g.add_argument("--revision", type=str, default=d.revision,
                   help="Branch, tag or commit of a Hugging Face model id (default: main).")
    g.add_argument("--download-dir", type=str, default=d.download_dir,
                   help="Where a Hugging Face model id is downloaded and looked up (default: "
                        "the Hugging Face cache, $HF_HUB_CACHE; HF_HUB_OFFLINE=1 uses "
                        "only what is already there).")
    g.add_argument("--trust-remote-code", action=bool_flag, default=d.trust_remote_code,
                   help="Let transformers run the model repository's own code for its "
                        "config and tokenizer (default: off).")
    g.add_argument("--enable-chunked-prefill", action=bool_flag,
                   default=d.enable_chunked_prefill,
                   help="Prefills are always chunked under --max-num-batched-tokens here: "
                        "the flag is accepted, its --no- form refused (default: on).")
    g.add_argument("--kv-cache-dtype", type=str, default=d.kv_cache_dtype,
                   help="KV cache dtype: 'auto' (the model's dtype) or that dtype's name; "
                        "fp8 caches are not supported by this fork (default: %(default)s).")
    g.add_argument("--swap-space", type=float, default=d.swap_space,
                   help="Accepted for vLLM launch scripts, with a warning: preemption "
                        "recomputes, so no CPU swap space is used (default: unset).")
    g.add_argument("--quantization", "-q", type=str, default=d.quantization,
                   help="Not supported by this fork beyond 'gguf' (GGUF files are "
                        "dequantized at load; default: none).")
    g.add_argument("--enable-lora", action=bool_flag, default=d.enable_lora,
                   help="Not supported by this fork (refused; default: off).")


# How this fork handles weights and LoRA, for the refusals of vLLM's flags.
_WEIGHTS_SUPPORTED = ("it loads HF safetensors in float32 / bfloat16 / float16 (--dtype) "
                      "and GGUF files, dequantized at load")


def _refuse_unsupported(args: EngineArgs) -> None:
    """Refuse vLLM flags this fork does not build, in one line saying what it does.

    Raises:
        ValueError: --quantization other than gguf, --enable-lora,
            --no-enable-chunked-prefill, an fp8 --kv-cache-dtype, a negative
            --swap-space.
    """
    if args.quantization not in (None, "gguf"):
        raise ValueError(f"--quantization {args.quantization} is not supported by this fork: "
                         f"{_WEIGHTS_SUPPORTED}")
    if args.enable_lora:
        raise ValueError("--enable-lora is not supported by this fork: it serves one set of "
                         "weights; merge the adapter into them (peft's merge_and_unload) and "
                         "serve the merged model")
    if args.enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill is not supported by this fork: "
                         "prefills are always chunked under --max-num-batched-tokens (set it "
                         "to --max-model-len to prefill a whole prompt in one step)")
    if args.kv_cache_dtype.startswith("fp8"):
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported by this "
                         "fork: the KV cache is kept in the model's dtype (--kv-cache-dtype "
                         "auto)")
    if args.swap_space is not None and args.swap_space < 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {args.swap_space:g}")


def _check_kv_cache_dtype(kv_cache_dtype: str, model_dtype: Any) -> None:
    """`--kv-cache-dtype` is 'auto' or names the model's dtype (the cache's dtype here).

    Raises:
        ValueError: another dtype; the message names the one in use.
    """
    from vllm.config.model import _to_torch_dtype

    if kv_cache_dtype == "auto" or _to_torch_dtype(kv_cache_dtype) == model_dtype:
        return
    name = str(model_dtype).removeprefix("torch.")
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported by this fork: the KV "
                     f"cache is kept in the model's dtype ({name} here; --dtype sets it), so "
                     f"use --kv-cache-dtype auto or {name}")


def _add_json_config_arg(
    g: argparse._ArgumentGroup, *flags: str, parse: Callable[[str], Any], help_text: str
) -> None:
    """A flag whose value is a config as JSON: `parse` builds it (its ValueError becomes
    argparse's usage error, message kept); the default is EngineArgs' field of that name."""
    dest = flags[-1].removeprefix("--").replace("-", "_")
    g.add_argument(*flags, type=_json_type(parse, dest), default=getattr(EngineArgs, dest),
                   help=help_text)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """`EngineArgs` plus the options only the async (serving) engine has."""

    enable_log_requests: bool = False
    disable_log_requests: bool = False

    def __post_init__(self) -> None:
        if self.enable_log_requests and self.disable_log_requests:
            raise ValueError("--enable-log-requests and --disable-log-requests contradict "
                             "each other; give one")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = EngineArgs.add_cli_args(parser)
        parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                            default=AsyncEngineArgs.enable_log_requests,
                            help="Log every request's prompt and sampling parameters "
                                 "(default: off).")
        parser.add_argument("--disable-log-requests", action="store_true",
                            default=AsyncEngineArgs.disable_log_requests,
                            help="vLLM's older flag: requests are not logged, which is the "
                                 "default (see --enable-log-requests).")
        return parser
