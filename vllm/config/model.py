"""`ModelConfig`: which model, in which dtype, with how long a context.

Resolved once at construction: `model=None` becomes the bundled
SmolLM2-135M-Instruct GGUF, `dtype` a `torch.dtype` the platform supports,
`max_model_len` an int no larger than the model's own context, `load_format`
a concrete format. The HF config is loaded here, once, and kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.config.frozen import FrozenConfig

if TYPE_CHECKING:
    import torch

    from vllm.config.parallel import ParallelConfig

# `--dtype` spellings (vLLM's) -> torch dtype attribute names.
_DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
DTYPE_CHOICES = ("auto", *_DTYPE_NAMES)
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "gguf", "dummy")
# generation_config.json fields that become a request's sampling defaults (as in vLLM).
GENERATION_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _platform():
    from vllm import platforms

    return platforms.current_platform


def _to_torch_dtype(value: Any) -> torch.dtype | None:
    """A torch.dtype from a torch.dtype or its name ("bfloat16", "torch.float16"); else None."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = _DTYPE_NAMES.get(value.removeprefix("torch."), value.removeprefix("torch."))
        candidate = getattr(torch, name, None)
        if isinstance(candidate, torch.dtype):
            return candidate
    return None


@dataclass
class ModelConfig(FrozenConfig):
    """The model and how it is loaded.

    Attributes:
        model: HF model directory or `.gguf` file; None = the bundled model.
        tokenizer: tokenizer path; None = the model's own.
        dtype: "auto" | "float32" | "float" | "bfloat16" | "float16" | "half" |
            a torch.dtype; resolved to a torch.dtype through the platform
            ("auto" picks the platform's choice for the checkpoint's dtype).
        max_model_len: context length in tokens (prompt + output); None = the
            model's own (from its config); -1 = vLLM's "auto": the model's own,
            lowered at start-up to what the KV cache holds. Otherwise a KV cache
            too small for one request of this length fails the start-up.
        max_model_len_origin: where max_model_len came from: "explicit", "model"
            (the model's config) or "auto" (not an argument).
        seed: the engine's random seed (vLLM V1 default 0); None = not seeded.
        load_format: "auto" | "safetensors" | "gguf" | "dummy" (random weights);
            "auto" resolves from the path (a `.gguf` file or a directory).
        served_model_name: the name the server reports (the first of a list, as
            vLLM's `--served-model-name a b`), also the engine's name in the
            device registry (`vllm kv-top`); None = `model`.
        generation_config: where the model's generation config comes from, as
            vLLM's `--generation-config`: "auto" (the model's own:
            generation_config.json of an HF directory, the metadata of a GGUF
            file), "vllm" (its EOS ids still stop generation, but its sampling
            values are not used as defaults), or a directory holding
            generation_config.json (or the file itself).
        max_logprobs: the most logprobs (sample or prompt) a request may ask
            for, vLLM's default 20; -1 = the whole vocabulary.
        trust_remote_code: let transformers run the model repository's own
            Python for its config and tokenizer (vLLM's `--trust-remote-code`);
            the model itself must still be an architecture this fork implements.
        hf_config: the transformers `PretrainedConfig`, loaded once (not an argument).

    Raises:
        ValueError: unknown dtype / load_format, a dtype the platform does not
            support, max_model_len < 1 or above the model's, a load_format
            that does not match the path, a served_model_name that is not a
            non-empty string (or a list of them).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int | None = 0
    load_format: str = "auto"
    served_model_name: str | list[str] | None = None
    generation_config: str = "auto"
    max_logprobs: int = 20
    trust_remote_code: bool = False
    hf_config: Any = field(init=False, repr=False, compare=False)
    max_model_len_origin: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from vllm.transformers_utils.config import (
            check_generation_config_path,
            get_bundled_model_path,
            get_hf_config,
            get_model_max_len,
        )

        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        self.model = os.fspath(get_bundled_model_path() if self.model is None else self.model)
        self.tokenizer = self.model if self.tokenizer is None else os.fspath(self.tokenizer)
        self.served_model_name = _first_served_name(self.served_model_name) or self.model
        self.load_format = self._resolve_load_format()
        self.hf_config = get_hf_config(self.model, trust_remote_code=self.trust_remote_code)
        self.dtype = self._resolve_dtype()
        self.max_model_len = self._resolve_max_model_len(get_model_max_len(self.hf_config))
        check_generation_config_path(self.generation_config)
        ml = self.max_logprobs
        if not isinstance(ml, int) or isinstance(ml, bool) or ml < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or an int >= 0, got {ml!r}")

    def try_get_generation_config(self) -> dict[str, Any]:
        """The generation config as a dict ({} when there is none); see `generation_config`.

        "auto" and "vllm" read the model's own; a path reads that one.
        """
        from vllm.transformers_utils.config import try_get_generation_config

        source = self.generation_config
        if source in ("auto", "vllm"):
            source = self.model
        return try_get_generation_config(source)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults the generation config sets (vLLM's name for this).

        Returns:
            A subset of {temperature, top_p, top_k, min_p, repetition_penalty}:
            the values a request uses for fields it leaves unset. {} with
            generation_config "vllm", or when the config sets none of them.
        """
        if self.generation_config == "vllm":
            return {}
        config = self.try_get_generation_config()
        return {name: config[name] for name in GENERATION_SAMPLING_FIELDS
                if config.get(name) is not None}

    def _resolve_load_format(self) -> str:
        fmt = self.load_format
        if fmt not in LOAD_FORMAT_CHOICES:
            raise ValueError(f"load_format must be one of {LOAD_FORMAT_CHOICES}, got {fmt!r}")
        is_gguf = self.model.endswith(".gguf")
        if fmt == "auto":
            return "gguf" if is_gguf else "safetensors"
        if fmt == "gguf" and not is_gguf:
            raise ValueError(f"load_format 'gguf' needs a .gguf file, got model {self.model!r}")
        if fmt == "safetensors" and is_gguf:
            raise ValueError(
                f"load_format 'safetensors' needs an HF model directory, got the GGUF file "
                f"{self.model!r} (use load_format 'gguf' or 'auto')"
            )
        return fmt

    def _resolve_dtype(self) -> torch.dtype:
        platform = _platform()
        supported = list(platform.supported_dtypes())
        if isinstance(self.dtype, str) and self.dtype == "auto":
            # transformers >= 4.56 names it `dtype`; older releases `torch_dtype`.
            cfg = self.hf_config
            stored = cfg.dtype if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
            config_dtype = _to_torch_dtype(stored)
            dtype = platform.default_dtype(config_dtype)
        else:
            dtype = _to_torch_dtype(self.dtype)
            if dtype is None or (isinstance(self.dtype, str) and self.dtype not in _DTYPE_NAMES):
                raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if dtype not in supported:
            names = ", ".join(str(d).removeprefix("torch.") for d in supported)
            raise ValueError(
                f"dtype {str(dtype).removeprefix('torch.')} is not supported on the "
                f"{platform.device_name} platform (supported: {names})"
            )
        return dtype

    def _resolve_max_model_len(self, model_max_len: int) -> int:
        user = self.max_model_len
        if user is None or user == -1:
            self.max_model_len_origin = "model" if user is None else "auto"
            return model_max_len
        self.max_model_len_origin = "explicit"
        if not isinstance(user, int) or isinstance(user, bool) or user < 1:
            raise ValueError(
                f"max_model_len must be an int >= 1 or -1 (auto: fit the KV cache), got {user!r}")
        if user > model_max_len:
            raise ValueError(
                f"max_model_len {user} is larger than the model's maximum context length "
                f"{model_max_len} (from its config); use at most {model_max_len}"
            )
        return user

    @property
    def model_path(self) -> str:
        """The local file or directory the weights load from (the resolved `model`)."""
        return self.model

    # -- model shape, read from the HF config; per-rank figures are rank 0's (the largest) --

    @property
    def hf_text_config(self) -> Any:
        """The language model's config: `text_config` of a multimodal model, else hf_config."""
        return self.hf_config.get_text_config()

    @property
    def is_multimodal_model(self) -> bool:
        """Whether the model takes images (vllm/multimodal)."""
        from vllm.model_executor.models.registry import is_multimodal_config

        return is_multimodal_config(self.hf_config)

    def get_vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_text_config.hidden_size

    def get_num_layers(self, parallel_config: ParallelConfig | None = None) -> int:
        return self.hf_text_config.num_hidden_layers

    def get_num_attention_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        return self._head_shard(parallel_config).num_heads

    def get_total_num_kv_heads(self) -> int:
        cfg = self.hf_text_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    def get_num_kv_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        # With TP, KV heads are split and replicated when there are fewer than ranks.
        return self._head_shard(parallel_config).num_kv_heads

    def _head_shard(self, parallel_config: ParallelConfig | None, rank: int = 0):
        from vllm.distributed.utils import partition_attention_heads

        tp = 1 if parallel_config is None else parallel_config.tensor_parallel_size
        return partition_attention_heads(
            self.hf_text_config.num_attention_heads, self.get_total_num_kv_heads(), tp, rank
        )

    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        """Raise ValueError (naming the sizes) when the model cannot be split over the ranks.

        Attention heads split by KV head, unevenly where they must
        (`partition_attention_heads`); the MLP's intermediate size must divide.
        """
        from vllm.distributed.utils import divide

        tp = parallel_config.tensor_parallel_size
        if tp == 1:
            return
        for rank in range(tp):
            self._head_shard(parallel_config, rank)
        intermediate = getattr(self.hf_text_config, "intermediate_size", None)
        if intermediate is not None:
            divide(intermediate, tp, "intermediate_size")

    def get_head_size(self) -> int:
        cfg = self.hf_text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _first_served_name(names: str | list[str] | None) -> str | None:
    """The name reported of `served_model_name` (a string, or a list's first); None: unset.

    Raises:
        ValueError: an empty list or a name that is not a non-empty string.
    """
    if names is None:
        return None
    listed = list(names) if isinstance(names, list | tuple) else [names]
    if not listed or not all(isinstance(n, str) and n.strip() for n in listed):
        raise ValueError(f"served_model_name must be a non-empty string or a list of them, "
                         f"got {names!r}")
    return listed[0]
