"""`CompilationConfig`: eager mode, the CUDA graph mode and the graphs' batch sizes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vllm.config.frozen import FrozenConfig
from vllm.logger import init_logger

logger = init_logger(__name__)

_ALLOWED_KEYS = ("enforce_eager", "cudagraph_capture_sizes", "cudagraph_mode")

# vLLM's CUDAGraphMode names. Our graphs hold the whole step, attention included
# (the Triton kernels' grids depend on shapes and host bounds only), so the mixed
# (prefill) graphs are full ones: FULL_AND_PIECEWISE (vLLM's default) runs as FULL,
# and PIECEWISE (attention outside every graph, decode too) is not built.
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE")
# Token counts of the mixed-batch graphs (any step with a prefill chunk, up to
# min(tokens, max_num_seqs) requests): a step of n tokens replays the smallest
# bucket >= n, one above the largest runs eagerly. Short prompts are launch-bound
# (issue 50: a 7-token prompt of the SmolLM2 shape took 24 decode steps eagerly);
# from a few hundred tokens the step's work hides the launches.
MIXED_CAPTURE_SIZES = (16, 32, 64, 128, 256)


def default_cudagraph_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's size ladder, cut at max_num_seqs, which is always included.

    1, 2, 4, then every 8 up to 248, then every 16 from 256. Including
    max_num_seqs itself means every decode batch pads up to a captured size.
    """
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs + 1, 16)]
    sizes = [s for s in ladder if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class CompilationConfig(FrozenConfig):
    """Whether and at which decode batch sizes CUDA graphs are captured.

    Attributes:
        enforce_eager: never use CUDA graphs.
        cudagraph_capture_sizes: decode batch sizes (sequences) to capture,
            ascending; None = `default_cudagraph_capture_sizes(max_num_seqs)`.
            Sizes above max_num_seqs are dropped with a warning. Resolved even
            where graphs are off, as the decode sizes warmup runs.
        cudagraph_mode: vLLM's names: "FULL" (decode batches and mixed
            batches of up to 256 tokens replay whole-step graphs),
            "FULL_AND_PIECEWISE" (the same here, see `CUDAGRAPH_MODES`),
            "FULL_DECODE_ONLY" (decode batches only), "NONE" (as
            enforce_eager). Default "FULL".
        use_cudagraph: resolved: graphs are captured (not enforce_eager, mode not
            NONE, and the platform supports them). Not an argument.
        mixed_capture_sizes: resolved: token counts of the mixed-batch graphs,
            `MIXED_CAPTURE_SIZES` up to max_num_batched_tokens; [] where graphs
            are off or the mode is FULL_DECODE_ONLY. Not an argument.

    Raises:
        ValueError: sizes that are not ints >= 1, an unknown or unsupported
            cudagraph_mode, or an unknown key in `from_dict`.
    """

    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    cudagraph_mode: str = "FULL"
    use_cudagraph: bool = field(init=False, default=False)
    mixed_capture_sizes: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.cudagraph_capture_sizes is not None:
            bad = [s for s in self.cudagraph_capture_sizes
                   if not isinstance(s, int) or isinstance(s, bool) or s < 1]
            if bad or not self.cudagraph_capture_sizes:
                raise ValueError(
                    "cudagraph_capture_sizes must be a non-empty list of ints >= 1, "
                    f"got {self.cudagraph_capture_sizes!r}"
                )
        mode = self.cudagraph_mode
        if not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode must be one of {list(CUDAGRAPH_MODES)}, got {mode!r}"
                + (" (our graphs hold attention: use FULL)" if mode == "PIECEWISE" else ""))
        self.cudagraph_mode = mode.upper()

    @classmethod
    def from_dict(cls, values: dict) -> CompilationConfig:
        unknown = sorted(set(values) - set(_ALLOWED_KEYS))
        if unknown:
            raise ValueError(
                f"compilation_config has unknown keys {unknown}; supported: {list(_ALLOWED_KEYS)}"
            )
        return cls(**values)

    @classmethod
    def from_cli(cls, text: str) -> CompilationConfig:
        """Parse the `-O` / `--compilation-config` JSON object (ValueError naming the flag)."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"compilation_config is not valid JSON ({e}): {text!r}") from e
        if not isinstance(values, dict):
            raise ValueError(f"compilation_config must be a JSON object, got {text!r}")
        return cls.from_dict(values)

    def resolve(self, max_num_seqs: int, graphs_supported: bool,
                max_num_batched_tokens: int | None = None) -> None:
        """Fix the capture sizes for `max_num_seqs` (decode) and `max_num_batched_tokens`
        (mixed; None: no bound) and whether graphs are used."""
        if self.cudagraph_capture_sizes is None:
            sizes = default_cudagraph_capture_sizes(max_num_seqs)
        else:
            sizes = sorted(set(self.cudagraph_capture_sizes))
            dropped = [s for s in sizes if s > max_num_seqs]
            if dropped:
                logger.warning(
                    "cudagraph_capture_sizes %s exceed max_num_seqs %d and are dropped",
                    dropped, max_num_seqs,
                )
                sizes = [s for s in sizes if s <= max_num_seqs] or [max_num_seqs]
        self.cudagraph_capture_sizes = sizes
        self.use_cudagraph = (graphs_supported and not self.enforce_eager
                              and self.cudagraph_mode != "NONE")
        mixed = self.use_cudagraph and self.cudagraph_mode != "FULL_DECODE_ONLY"
        limit = max_num_batched_tokens or max(MIXED_CAPTURE_SIZES)
        self.mixed_capture_sizes = [s for s in MIXED_CAPTURE_SIZES if mixed and s <= limit]

    @property
    def decode_capture_sizes(self) -> list[int]:
        """The decode sizes the runner captures: [] under enforce_eager or mode NONE."""
        if self.enforce_eager or self.cudagraph_mode == "NONE":
            return []
        return list(self.cudagraph_capture_sizes or [])

    @property
    def max_cudagraph_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0
